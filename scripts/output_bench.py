"""What keeping task output costs a worker host (``services/worker/outputs.py``):
opening an attempt's two files (with the oldest deleted past ``--keep``), a host's start
over the files it finds, a short process task run with its output kept (held to
``--max-mb``) against discarded, in alternating rounds, and a task that writes ``--chatty-mb``
MiB to stdout, its output held to ``--max-mb`` against kept whole (time, and disk used).

    python scripts/output_bench.py --attempts 20000 --keep 10000 --rounds 6 --tasks 100
    python scripts/output_bench.py --rounds 0 --chatty-mb 2048 --max-mb 64
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


def _opening(directory: Path, attempts: int, keep: int, max_bytes: int) -> tuple[float, float]:
    """Microseconds per attempt to open (and close) both files; milliseconds for a new
    ``TaskOutputs`` to take stock of what the first left."""
    outputs = TaskOutputs(directory, keep, max_bytes)
    began = time.perf_counter()
    for i in range(attempts):
        for stream in ("out", "err"):
            outputs.close(outputs.open(f"task-{i}", 0, stream))
    per_attempt = (time.perf_counter() - began) / attempts
    began = time.perf_counter()
    TaskOutputs(directory, keep)
    return per_attempt * 1e6, (time.perf_counter() - began) * 1e3


async def _tasks(
    directory: Path, rounds: int, tasks: int, max_bytes: int, image: str = ""
) -> dict[str, list[float]]:
    """Milliseconds per ``sh -c 'echo hi'`` task, each round with and without output: a
    process, or a container of ``image``."""
    outputs = TaskOutputs(directory, max_bytes=max_bytes)
    if image:
        executors: dict[str, Any] = {
            "discarded": DockerExecutor(),
            "kept": DockerExecutor(outputs=outputs),
        }
    else:
        executors = {
            "discarded": ProcessExecutor(),
            "kept": ProcessExecutor(outputs=outputs),
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
        outputs.stop()
        for executor in executors.values():
            if image:
                executor.close()
    return times


async def _chatty(directory: Path, mib: int, max_bytes: int) -> dict[str, dict[str, float]]:
    """A process task that writes ``mib`` MiB to stdout, with its output held to
    ``max_bytes`` and kept whole: seconds it took, and MiB of disk its file used after."""
    result = {}
    for name, cap in (("held", max_bytes), ("whole", 0)):
        outputs = TaskOutputs(directory / name, max_bytes=cap)
        task = common_pb2.Task(task_id="chatty")
        task.process.args.extend(["sh", "-c", f"head -c {mib << 20} /dev/zero"])
        began = time.perf_counter()
        await ProcessExecutor(outputs=outputs).run(task)
        took = time.perf_counter() - began
        outputs.stop()
        used = os.stat(outputs.path("chatty", 0, "out")).st_blocks * 512
        result[name] = {"s": round(took, 3), "disk_mib": round(used / (1 << 20), 1)}
        outputs.path("chatty", 0, "out").unlink()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attempts", type=int, default=20_000)
    parser.add_argument("--keep", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument(
        "--image", default="", help="time containers of this local image instead of processes"
    )
    parser.add_argument(
        "--max-mb", type=int, default=64, help="worker_output_max_mb of the hosts timed"
    )
    parser.add_argument(
        "--chatty-mb", type=int, default=0, help="also time a task writing this many MiB"
    )
    parser.add_argument("--dir", default="", help="where the files go (default: the temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    max_bytes = args.max_mb << 20
    with tempfile.TemporaryDirectory(dir=args.dir or None) as scratch:
        root = Path(scratch)
        us_open, ms_start = _opening(root / "open", args.attempts, args.keep, max_bytes)
        times = asyncio.run(_tasks(root / "tasks", args.rounds, args.tasks, max_bytes, args.image))
        chatty = asyncio.run(_chatty(root, args.chatty_mb, max_bytes)) if args.chatty_mb else {}
    out = {
        "attempts": args.attempts,
        "keep": args.keep,
        "max_mb": args.max_mb,
        "us_per_attempt_open": round(us_open, 1),
        "ms_start_over_files": round(ms_start, 1),
        "ms_per_task_kept": [round(t, 2) for t in times["kept"]],
        "ms_per_task_discarded": [round(t, 2) for t in times["discarded"]],
        "chatty": chatty,
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
    for name, took in chatty.items():
        print(
            f"a task writing {args.chatty_mb} MiB, output {name} "
            f"({'max ' + str(args.max_mb) + ' MiB' if name == 'held' else 'no cap'}): "
            f"{took['s']} s, {took['disk_mib']} MiB on disk after"
        )


if __name__ == "__main__":
    main()
