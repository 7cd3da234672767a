"""Alibaba cluster-trace-v2018 ``batch_task.csv`` -> canonical jobs.

The published file has no header; its columns, in order (github.com/alibaba/clusterdata,
``cluster-trace-v2018/schema.txt``):

====  ============  ===================================================================
 col  name          use
====  ============  ===================================================================
  0   task_name     not read (encodes the DAG, e.g. ``M2_1``)
  1   instance_num  how many instances the task has: one ``TraceTask`` each
  2   job_name      the job (``TraceJob.job_id``)
  3   task_type     not read
  4   status        ``Running`` / ``Waiting`` / ``Ready`` rows have not finished
  5   start_time    seconds since the trace start
  6   end_time      seconds; 0 or empty while the task has not finished
  7   plan_cpu      100 = one core; empty = not given (the model's default, 1 core)
  8   plan_mem      normalised memory, 100 = the largest machine; empty = 0
====  ============  ===================================================================

A header row naming these columns is accepted too (then the order may differ).
Each instance lasts ``end_time - start_time``; a job arrives at its earliest
``start_time`` (the table has no submit time). Rows that have not finished are left out
and their instances counted in ``ReadStats.incomplete``. Jobs come out sorted by arrival;
``max_jobs`` keeps the first ones.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from loadgen.readers._csv import field_at, header_index, integer, is_header, number, numbered_rows
from loadgen.trace import ReadStats, TraceError, TraceJob, TraceTask

# plan_mem is a percentage of the largest machine, whose real memory the trace hides.
# Assumed here: 512 GiB; pass memory_mb_per_percent to change it.
MEMORY_MB_PER_PERCENT = 512 * 1024 / 100
CPU_MILLI_PER_PLAN_UNIT = 10  # plan_cpu 100 = 1 core = 1000 millicores

COLUMNS = (
    "task_name",
    "instance_num",
    "job_name",
    "task_type",
    "status",
    "start_time",
    "end_time",
    "plan_cpu",
    "plan_mem",
)
REQUIRED = tuple(c for c in COLUMNS if c not in ("task_name", "task_type"))
UNFINISHED = frozenset({"running", "waiting", "ready"})


def read_alibaba2018(
    path: str | Path,
    strict: bool = False,
    max_jobs: int | None = None,
    stats: ReadStats | None = None,
    memory_mb_per_percent: float = MEMORY_MB_PER_PERCENT,
) -> Iterator[TraceJob]:
    """Yield the jobs of a ``batch_task`` file, sorted by arrival."""
    path = Path(path)
    stats = stats if stats is not None else ReadStats()
    tasks: dict[str, list[TraceTask]] = defaultdict(list)
    arrival: dict[str, float] = {}
    positions: dict[str, int] | None = None
    for where, row in numbered_rows(path, stats):
        if positions is None:
            positions = {name: i for i, name in enumerate(COLUMNS)}
            if is_header(row, COLUMNS):
                positions = header_index(row, {c: (c,) for c in COLUMNS})
                missing = [c for c in REQUIRED if c not in positions]
                if missing:
                    raise TraceError(f"{where}: header has no {', '.join(missing)} column")
                continue
        try:
            parsed = _parse(row, positions, where, memory_mb_per_percent)
        except TraceError as err:
            stats.malformed(err, strict)
            continue
        job, start, count, task = parsed
        if task is None:
            stats.incomplete += count
            continue
        tasks[job].extend([task] * count)
        arrival[job] = min(start, arrival.get(job, start))
    order = sorted(arrival, key=lambda j: (arrival[j], j))
    for job in order[:max_jobs]:
        stats.jobs += 1
        yield TraceJob(job_id=job, arrival_s=arrival[job], tasks=tuple(tasks[job]))


def _parse(
    row: list[str], positions: dict[str, int], where: str, memory_mb_per_percent: float
) -> tuple[str, float, int, TraceTask | None]:
    def cell(name: str) -> str:
        return field_at(row, positions[name], name, where).strip()

    job = cell("job_name")
    if not job:
        raise TraceError(f"{where}: job_name is empty")
    count = integer(cell("instance_num"), "instance_num", where)
    if count < 0:
        raise TraceError(f"{where}: instance_num must be >= 0, got {count}")
    start_text, end_text = cell("start_time"), cell("end_time")
    start = number(start_text, "start_time", where) if start_text else 0.0
    end = number(end_text, "end_time", where) if end_text else 0.0
    if cell("status").lower() in UNFINISHED or end <= 0:
        return job, start, count, None
    if start < 0 or end < start:
        raise TraceError(f"{where}: end_time {end:g} is before start_time {start:g}")
    cpu_text, mem_text = cell("plan_cpu"), cell("plan_mem")
    cpu = number(cpu_text, "plan_cpu", where) if cpu_text else None
    mem = number(mem_text, "plan_mem", where) if mem_text else 0.0
    if (cpu is not None and cpu < 0) or mem < 0:
        raise TraceError(f"{where}: negative plan_cpu or plan_mem")
    cpu_milli = 1000 if cpu is None else math.ceil(cpu * CPU_MILLI_PER_PLAN_UNIT)
    memory_mb = math.ceil(mem * memory_mb_per_percent)
    if cpu_milli == 0 and memory_mb == 0:
        cpu_milli = 1  # keep it a valid request: a task must ask for something
    task = TraceTask(duration_s=end - start, cpu_milli=cpu_milli, memory_mb=memory_mb)
    return job, start, count, task
