"""What keeping task output costs a worker host (``services/worker/outputs.py``):
opening an attempt's two files (with the oldest deleted past ``--keep``), a host's start
over the files it finds, and a short process task run with its output kept against
discarded, in alternating rounds.

    python scripts/output_bench.py --attempts 20000 --keep 10000 --rounds 6 --tasks 100
    python scripts/output_bench.py --image megha-offline/debian:bookworm --rounds 4 --tasks 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from services._proto.megha.v1 import common_pb2
from services.worker.executors import DockerExecutor, ProcessExecutor
from services.worker.outputs import TaskOutputs


def _opening(directory: Path, attempts: int, keep: int) -> tuple[float, float]:
    """Microseconds per attempt to open (and close) both files; milliseconds for a new
    ``TaskOutputs`` to take stock of what the first left."""
    outputs = TaskOutputs(directory, keep)
    began = time.perf_counter()
    for i in range(attempts):
        for stream in ("out", "err"):
            os.close(outputs.open(f"task-{i}", 0, stream))
    per_attempt = (time.perf_counter() - began) / attempts
    began = time.perf_counter()
    TaskOutputs(directory, keep)
    return per_attempt * 1e6, (time.perf_counter() - began) * 1e3


async def _tasks(
    directory: Path, rounds: int, tasks: int, image: str = ""
) -> dict[str, list[float]]:
    """Milliseconds per ``sh -c 'echo hi'`` task, each round with and without output: a
    process, or a container of ``image``."""
    if image:
        executors: dict[str, Any] = {
            "discarded": DockerExecutor(),
            "kept": DockerExecutor(outputs=TaskOutputs(directory)),
        }
    else:
        executors = {
            "discarded": ProcessExecutor(),
            "kept": ProcessExecutor(outputs=TaskOutputs(directory)),
        }
    times: dict[str, list[float]] = {name: [] for name in executors}
    try:
        for r in range(rounds):
            for name, executor in executors.items():
                began = time.perf_counter()
                for i in range(tasks):
                    task = common_pb2.Task(task_id=f"r{r}-{i}")
                    if image:
                        task.docker.image = image
                        task.docker.args.extend(["sh", "-c", "echo hi"])
                    else:
                        task.process.args.extend(["sh", "-c", "echo hi"])
                    await executor.run(task)
                times[name].append((time.perf_counter() - began) / tasks * 1e3)
    finally:
        for executor in executors.values():
            if image:
                executor.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attempts", type=int, default=20_000)
    parser.add_argument("--keep", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument(
        "--image", default="", help="time containers of this local image instead of processes"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        us_open, ms_start = _opening(Path(scratch) / "open", args.attempts, args.keep)
        times = asyncio.run(_tasks(Path(scratch) / "tasks", args.rounds, args.tasks, args.image))
    out = {
        "attempts": args.attempts,
        "keep": args.keep,
        "us_per_attempt_open": round(us_open, 1),
        "ms_start_over_files": round(ms_start, 1),
        "ms_per_task_kept": [round(t, 2) for t in times["kept"]],
        "ms_per_task_discarded": [round(t, 2) for t in times["discarded"]],
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"opening an attempt's two files ({args.attempts:,} attempts, keep {args.keep:,}): "
        f"{out['us_per_attempt_open']} us"
    )
    print(f"a host's start over {min(args.attempts, args.keep) * 2:,} files: {ms_start:.0f} ms")
    what = f"a container of {args.image}" if args.image else "a process"
    print(f"sh -c 'echo hi' in {what}, ms a task, output kept:      {out['ms_per_task_kept']}")
    print(f"sh -c 'echo hi' in {what}, ms a task, output discarded: {out['ms_per_task_discarded']}")


if __name__ == "__main__":
    main()
