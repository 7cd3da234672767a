"""What the LM's journal costs: writing each task as accepted (before the LM answers a
launch) and its ending, the file's size, and how long a restarted LM takes to read it
back (the LM serves nothing until it has).

    python scripts/journal_bench.py --endings 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services._proto.megha.v1 import common_pb2
from services.common.config import FederationConfig
from services.core.cluster_state import ENDED_KEPT, ClusterState
from services.local_master.journal import TaskJournal

# The LM's default: whole final events kept for LookupTasks.
ENDINGS_KEPT = FederationConfig.model_fields["lm_endings_kept"].default


def _event(i: int, now: int) -> common_pb2.TaskEvent:
    job = f"replay-1732412345-{i // 100}"
    event = common_pb2.TaskEvent(
        task_id=f"{job}.{i % 100}",
        job_id=job,
        queue="research",
        state=common_pb2.TASK_STATE_SUCCEEDED,
        lm_id="lm-1",
        node_id=f"lm-1-w{i % 64}",
    )
    for field in event.timestamps.DESCRIPTOR.fields:  # every stamp set, as on a real end
        setattr(event.timestamps, field.name, now)
    return event


def _task(event: common_pb2.TaskEvent) -> common_pb2.Task:
    """The task as the LM accepted it: what a launch carries, with the LM's stamps."""
    task = common_pb2.Task(
        task_id=event.task_id, job_id=event.job_id, queue=event.queue, expected_duration_s=60
    )
    task.resources.cpu_milli, task.resources.memory_mb = 1000, 2048
    task.process.args.extend(["python", "-c", "import time; time.sleep(60)"])
    task.timestamps.CopyFrom(event.timestamps)
    return task


async def _from_the_loop(path: Path, tasks: list[common_pb2.Task]) -> tuple[float, float]:
    """CPU per one-task accept made from an event loop, as the LM answers a launch:
    written on the loop, and handed to a thread and awaited (seconds each)."""
    journal = TaskJournal(path, ENDED_KEPT, ENDINGS_KEPT)
    thread = ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()
    half = len(tasks) // 2
    began = time.process_time()
    for i, task in enumerate(tasks[:half]):
        journal.accept([task])
        await asyncio.sleep(0)
        if i % 200 == 199:
            journal.checkpoint()
    inline = (time.process_time() - began) / half
    began = time.process_time()
    for i, task in enumerate(tasks[half:]):
        await loop.run_in_executor(thread, journal.accept, [task])
        if i % 200 == 199:
            journal.checkpoint()
    hopped = (time.process_time() - began) / (len(tasks) - half)
    thread.shutdown()
    journal.close()
    return inline, hopped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endings", type=int, default=ENDED_KEPT, help="endings to write")
    parser.add_argument(
        "--batch", type=int, default=4, help="endings per append (one turn of the LM's loop)"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=200, help="endings between two checkpoints"
    )
    parser.add_argument(
        "--launch", type=int, default=8, help="tasks accepted per write (one launch request)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "lm.journal"
        journal = TaskJournal(path, ENDED_KEPT, ENDINGS_KEPT)
        now = time.time_ns()
        events = [_event(i, now) for i in range(args.endings)]
        tasks = [_task(e) for e in events]
        accepting = ending = checkpointing = 0.0
        checkpoints = 0
        for start in range(0, len(events), args.batch):
            began = time.perf_counter()
            for first in range(start, min(start + args.batch, len(tasks)), args.launch):
                journal.accept(tasks[first : min(first + args.launch, start + args.batch)])
            accepting += time.perf_counter() - began
            began = time.perf_counter()
            journal.append(events[start : start + args.batch])
            ending += time.perf_counter() - began
            if (start + args.batch) // args.checkpoint_every > start // args.checkpoint_every:
                began = time.perf_counter()
                journal.checkpoint()  # in the LM, from its thread, every FLUSH_S
                checkpointing += time.perf_counter() - began
                checkpoints += 1
        unfinished = [_task(_event(args.endings + i, now)) for i in range(args.launch * 100)]
        journal.accept(unfinished)  # what ran when the LM was killed
        journal.close()
        size = sum(p.stat().st_size for p in Path(directory).iterdir())
        began = time.perf_counter()
        recalled = TaskJournal(path, ENDED_KEPT, ENDINGS_KEPT).load()
        read = time.perf_counter() - began
        assert len(recalled.accepted) == len(unfinished)
        books = ClusterState("lm-1", ["gm-1"])  # what LocalMaster._recall does next
        began = time.perf_counter()
        for task_id, attempt in recalled.attempts:
            books.remember_ended(task_id, attempt)
        booked = time.perf_counter() - began
        loop_tasks = [_task(_event(i, now)) for i in range(min(args.endings, 20_000))]
        inline, hopped = asyncio.run(_from_the_loop(Path(directory) / "loop.journal", loop_tasks))
    calls = -(-args.endings // args.launch)
    print(f"{args.endings:,} tasks, accepted {args.launch} a write, ended {args.batch} a write")
    print(f"  accept: {accepting / calls * 1e6:.1f} us per write ({accepting:.1f} s)")
    print(f"  append: {ending / args.endings * 1e6:.1f} us per ending ({ending:.1f} s)")
    print(
        f"  checkpoint: {checkpointing / max(checkpoints, 1) * 1e3:.2f} ms each, one per "
        f"{args.checkpoint_every} endings ({checkpointing:.1f} s, off the LM's loop)"
    )
    print(f"  on disk: {size / 1e6:.0f} MB")
    print(
        f"  read back: {read:.2f} s ({len(recalled.attempts):,} attempts, "
        f"{len(recalled.events):,} whole events, {len(recalled.accepted):,} unfinished)"
    )
    print(f"  booked as ended: {booked:.2f} s (a restarted LM serves after both)")
    print(
        f"  one-task accept from an event loop: {inline * 1e6:.1f} us of CPU on the loop, "
        f"{hopped * 1e6:.1f} us through a thread"
    )


if __name__ == "__main__":
    main()
