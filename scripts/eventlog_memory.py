"""What the load generator's record of task events costs per task, in resident memory
and in the garbage collector's time.

    python scripts/eventlog_memory.py [--tasks 100000]

Feeds ``EventLog`` a RUNNING and a SUCCEEDED event per task, in batches of 50 as an LM
publishes them, then makes what bench-live and replay make at the end of a run: the
summary's measurements (``EventLog.measure`` and the component medians and step
percentiles over them) and ``tasks.csv`` (``TaskRows``, made as the file is written).
Prints the growth of this process's resident memory (Linux /proc) per task at each step;
the peak is what the kernel recorded (``VmHWM``). Then times a full garbage collection
with the record and the accepted-task map in memory, each time after one more job came
in, as during a run (median of 3; what was in memory before them is frozen out of it).
Last, the slowest single step while the maps filled (one batch of events, one job
accepted): a map growing its table holds the load generator, which offers nothing then.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

from loadgen import events as events_module
from loadgen import report
from loadgen.events import EventLog, TaskRows
from services._proto.megha.v1 import common_pb2

BATCH = 50
STARTED = ("submitted", "queued", "dequeued", "decided", "lm_received", "lm_decided")


def resident_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    status = Path("/proc/self/status").read_text()
    line = next(ln for ln in status.splitlines() if ln.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def batch_of(job: int, state: int, now: int) -> bytes:
    batch = common_pb2.TaskEventBatch()
    for i in range(BATCH):
        event = batch.events.add(
            task_id=f"job-{job}.{i}", job_id=f"job-{job}", state=state, attempt=0
        )
        event.lm_id, event.node_id, event.queue = "lm-1", f"lm-1-w{i % 100}", "default"
        for k, name in enumerate((*STARTED, "worker_received", "started")):
            setattr(event.timestamps, f"{name}_unix_nanos", now + k)
        if state != common_pb2.TASK_STATE_RUNNING:
            event.timestamps.finished_unix_nanos = now + 100
    return batch.SerializeToString()


def accepted_map():
    """The load generator's map of accepted tasks; a plain dict of (job, GM) tuples in a
    checkout from before ``AcceptedTasks``, so the script measures both."""
    kind = getattr(events_module, "AcceptedTasks", None)
    return kind() if kind is not None else {}


def accept(accepted, task_id: str, job_id: str, gm: str) -> None:
    if isinstance(accepted, dict):
        accepted[task_id] = (job_id, gm)
    else:
        accepted.add(task_id, job_id, gm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100_000, help="tasks (multiple of 50)")
    tasks = parser.parse_args().tasks // BATCH * BATCH
    if tasks <= 0:
        parser.error("--tasks must be at least 50")
    now = time.time_ns()
    gc.collect()
    gc.freeze()
    log = EventLog()
    before = resident_mb()
    slowest_add = (0.0, 0)  # the slowest batch of events taken in (s, tasks before it)
    adding = accepting = 0.0
    for job in range(tasks // BATCH):
        for state in (common_pb2.TASK_STATE_RUNNING, common_pb2.TASK_STATE_SUCCEEDED):
            batch = common_pb2.TaskEventBatch.FromString(batch_of(job, state, now))
            began = time.perf_counter()
            log.add(batch)
            took = time.perf_counter() - began
            adding += took
            slowest_add = max(slowest_add, (took, job * BATCH))
    logged = resident_mb()
    jobs = range(tasks // BATCH)
    accepted = accepted_map()
    slowest_accept = (0.0, 0)
    for job in jobs:
        began = time.perf_counter()
        for i in range(BATCH):
            accept(accepted, f"job-{job}.{i}", f"job-{job}", "gm-1")
        took = time.perf_counter() - began
        accepting += took
        slowest_accept = max(slowest_accept, (took, job * BATCH))
    offered = resident_mb()
    measured = log.measure(accepted)
    report.component_medians(map(log.stamps, measured.task_ids))
    report.detail_percentiles(map(log.stamps, measured.task_ids))
    summarised = resident_mb()
    with tempfile.TemporaryDirectory() as out:
        csv = report.write_tasks_csv(out, TaskRows(log, accepted))
        lines = sum(1 for _ in csv.open()) - 1
    written = resident_mb()
    assert len(measured.task_ids) == lines == tasks and log.succeeded == tasks
    per_task = 1024 / tasks
    pauses = []
    for extra in range(3):
        job = tasks // BATCH + extra  # one more job offered and run, as during a run
        for i in range(BATCH):
            accept(accepted, f"job-{job}.{i}", f"job-{job}", "gm-1")
        for state in (common_pb2.TASK_STATE_RUNNING, common_pb2.TASK_STATE_SUCCEEDED):
            log.add(common_pb2.TaskEventBatch.FromString(batch_of(job, state, now)))
        began = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - began)
    print(
        f"{tasks} tasks, KB per task: event record {(logged - before) * per_task:.2f}, "
        f"accepted-task map {(offered - logged) * per_task:.2f}, "
        f"summary {(summarised - offered) * per_task:.2f}, "
        f"tasks.csv {(written - summarised) * per_task:.2f}; "
        f"peak above the accepted-task map {(peak_mb() - offered) * per_task:.2f}; "
        f"a full collection {1000 * statistics.median(pauses):.1f} ms"
    )
    print(
        f"slowest step: a batch of {BATCH} events {1000 * slowest_add[0]:.1f} ms "
        f"(at task {slowest_add[1]:,}), accepting a job {1000 * slowest_accept[0]:.1f} ms "
        f"(at task {slowest_accept[1]:,}); a map grows its table at 2/3 full. CPU per task: "
        f"{1e6 * adding / tasks:.2f} us for its two events, {1e6 * accepting / tasks:.2f} us "
        "to accept it"
    )


if __name__ == "__main__":
    main()
