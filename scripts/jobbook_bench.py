"""What a GM's job book costs when full: time per update, memory per task, and how long a
full garbage collection of the process takes with it.

    python scripts/jobbook_bench.py                  # 500,000 tasks, the GM's default bound
    python scripts/jobbook_bench.py --tasks 100000 --json
    python scripts/jobbook_bench.py --tasks 100000 --tasks-per-job 100000   # GetJob of a big job

Each task is queued, then placed, running and succeeded (three events), as in a GM that
sees every task of the federation. Uses only JobBook's public calls, so the same script
measures an older checkout: ``PYTHONPATH=path/to/old python scripts/jobbook_bench.py``.
"""

from __future__ import annotations

import argparse
import gc
import time

from _measure import emit, full_collection_ms, rss_kb

from services._proto.megha.v1 import common_pb2, global_master_pb2
from services.global_master.jobs import JobBook

S = common_pb2


def fill(book: JobBook, tasks: int, per_job: int) -> float:
    """Seconds spent in the book's calls (building the messages is not counted)."""
    spent = 0.0
    stamps = common_pb2.TaskTimestamps(
        submitted_unix_nanos=1_800_000_000_000_000_000,
        queued_unix_nanos=1_800_000_000_001_000_000,
    )
    for first in range(0, tasks, per_job):
        job_id = f"job-{first // per_job:08d}"
        batch = [
            common_pb2.Task(task_id=f"{job_id}.{n}", job_id=job_id, queue="q", timestamps=stamps)
            for n in range(min(per_job, tasks - first))
        ]
        events = [
            common_pb2.TaskEvent(
                task_id=task.task_id,
                job_id=job_id,
                queue="q",
                state=state,
                lm_id="lm-1",
                node_id="lm-1-w17",
                timestamps=stamps,
            )
            for state in (S.TASK_STATE_PLACED, S.TASK_STATE_RUNNING, S.TASK_STATE_SUCCEEDED)
            for task in batch
        ]
        began = time.perf_counter()
        for task in batch:
            book.queued(task)
        for event in events:
            book.apply(event)
        spent += time.perf_counter() - began
    return spent


def get_job_ms(book: JobBook) -> float:
    """How long GetJob's answer for the newest job takes to make (its loop is held so
    long), the median of five."""
    job = book.newest(1)[0]
    times = []
    for _ in range(5):
        began = time.perf_counter()
        if hasattr(job, "response"):
            job.response()
        else:  # an older checkout: each status parsed into the message
            global_master_pb2.GetJobResponse(job=job.to_proto())
        times.append(time.perf_counter() - began)
    return round(1000 * sorted(times)[2], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=500_000)
    parser.add_argument("--tasks-per-job", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    gc.collect()
    gc.freeze()  # what was there before the book is not counted in the collections below
    rss_before = rss_kb()
    book = JobBook(max_tasks=args.tasks)
    spent = fill(book, args.tasks, args.tasks_per_job)
    gc.collect()
    rss_after = rss_kb()
    tracked = len(gc.get_objects())
    out = {
        "tasks": book.task_count,
        "us_per_update": round(1e6 * spent / (4 * book.task_count), 3),
        "kb_per_task": round((rss_after - rss_before) / book.task_count, 3),
        "tracked_objects": tracked,
        "full_collection_ms": full_collection_ms(),
        "get_job_ms": get_job_ms(book),
    }
    emit(out, args.json)


if __name__ == "__main__":
    main()
