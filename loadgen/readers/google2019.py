"""Google cluster-data 2019 ``instance_events`` table -> canonical jobs.

The table (schema: ``clusterdata_trace_format_v3.proto``, message ``InstanceEvent``, in
github.com/google/cluster-data) has one row per state change of one instance. The columns
read, by their published names and order:

====  ========================  ==========================================================
 col  name                      use
====  ========================  ==========================================================
  0   time                      microseconds since the trace start; ``2**63 - 1`` means
                                "after the trace ended" and closes nothing
  1   type                      SUBMIT=0 QUEUE=1 ENABLE=2 SCHEDULE=3 EVICT=4 FAIL=5
                                FINISH=6 KILL=7 LOST=8 UPDATE_PENDING=9 UPDATE_RUNNING=10
  2   collection_id             the job (``TraceJob.job_id``)
  5   collection_type           JOB=0 or ALLOC_SET=1; alloc-set rows are ignored (an alloc
                                reserves room, it is not work); empty counts as a job
  8   instance_index            the task within its job
 11   resource_request.cpus     normalised CPU (NCU, 1.0 = the largest machine)
 12   resource_request.memory   normalised memory (1.0 = the largest machine)
====  ========================  ==========================================================

Columns 3-4, 6-7, 9-10 and 13 (constraints) are not read. Three layouts are accepted:
CSV in that published order without a header; CSV with a header (names as above, or
``resource_request`` as one cell holding ``{"cpus": .., "memory": ..}``); and the
newline-delimited JSON the public BigQuery export writes (one object per line).

How a task is derived from its instance's events (sorted by time):
- a *run* starts at SCHEDULE and ends at the next EVICT, FAIL, FINISH, KILL or LOST;
  the task's ``duration_s`` is the total length of its runs (the work the cluster did);
- an instance with no finished run, or still running when the trace ends, is left out and
  counted in ``ReadStats.incomplete``;
- cpu and memory come from the latest event that carries a resource request, times the
  machine size below; a request of zero for both becomes 1 millicore so it stays a valid
  request.
A job arrives at its earliest SUBMIT (its earliest event when the trace saw no SUBMIT).
Jobs come out sorted by arrival; ``max_jobs`` keeps the first ones.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.readers._csv import header_index, integer, numbered_rows, optional_number
from loadgen.trace import ReadStats, TraceError, TraceJob, TraceTask, open_text

# The trace hides real machine sizes (1.0 = the largest machine). These are an assumption
# (a 64-core, 256 GiB machine); pass your own to the reader to change them.
CPU_MILLI_PER_NCU = 64_000
MEMORY_MB_PER_UNIT = 256 * 1024

SUBMIT, SCHEDULE = 0, 3
RUN_ENDS = frozenset({4, 5, 6, 7, 8})  # EVICT FAIL FINISH KILL LOST
MAX_EVENT_TYPE = 10
AFTER_TRACE_END = 2**63 - 1
ALLOC_SET = 1

_POSITIONS = {"time": 0, "type": 1, "collection_id": 2, "collection_type": 5}
_POSITIONS |= {"instance_index": 8, "cpus": 11, "memory": 12}
_ALIASES = {
    "time": ("time",),
    "type": ("type", "event_type"),
    "collection_id": ("collection_id", "job_id"),
    "collection_type": ("collection_type",),
    "instance_index": ("instance_index", "task_index"),
    "cpus": ("resource_request.cpus", "resource_request_cpus", "cpus"),
    "memory": ("resource_request.memory", "resource_request_memory", "memory"),
    "resource_request": ("resource_request",),
}
_REQUIRED = ("time", "type", "collection_id", "instance_index")


@dataclass(slots=True)
class _Event:
    time_us: int
    type: int
    cpus: float | None
    memory: float | None


@dataclass(slots=True)
class _Instance:
    events: list[_Event] = field(default_factory=list)


def read_google2019(
    path: str | Path,
    strict: bool = False,
    max_jobs: int | None = None,
    stats: ReadStats | None = None,
    cpu_milli_per_ncu: float = CPU_MILLI_PER_NCU,
    memory_mb_per_unit: float = MEMORY_MB_PER_UNIT,
) -> Iterator[TraceJob]:
    """Yield the jobs of an ``instance_events`` file, sorted by arrival."""
    path = Path(path)
    stats = stats if stats is not None else ReadStats()
    jobs: dict[str, dict[int, _Instance]] = defaultdict(dict)
    for where, record in _records(path, stats):
        try:
            parsed = _parse(record, where)
        except TraceError as err:
            stats.malformed(err, strict)
            continue
        if parsed is None:
            continue
        job_id, index, event = parsed
        jobs[job_id].setdefault(index, _Instance()).events.append(event)
    built = []
    for job_id, instances in jobs.items():
        job = _build_job(job_id, instances, stats, cpu_milli_per_ncu, memory_mb_per_unit)
        if job is not None:
            built.append(job)
    built.sort(key=lambda j: (j.arrival_s, j.job_id))
    for job in built[:max_jobs]:
        stats.jobs += 1
        yield job


def _records(path: Path, stats: ReadStats) -> Iterator[tuple[str, dict[str, object]]]:
    """Yield ``(where, {column: raw value})`` whatever the file's layout."""
    if _first_char(path) == "{":
        yield from _json_records(path, stats)
        return
    positions: dict[str, int] | None = None
    for where, row in numbered_rows(path, stats):
        if positions is None:
            positions = _POSITIONS
            if not _looks_numeric(row[0]):
                positions = header_index(row, _ALIASES)
                missing = [c for c in _REQUIRED if c not in positions]
                if missing:
                    raise TraceError(f"{where}: header has no {', '.join(missing)} column")
                continue
        needed = max(positions[c] for c in _REQUIRED) + 1
        if len(row) < needed:
            yield where, {"_error": f"expected at least {needed} columns, got {len(row)}"}
            continue
        yield where, {name: row[i] if i < len(row) else "" for name, i in positions.items()}


def _json_records(path: Path, stats: ReadStats) -> Iterator[tuple[str, dict[str, object]]]:
    with open_text(path) as lines:
        for number, line in enumerate(lines, start=1):
            stats.lines += 1
            if not line.strip():
                continue
            where = f"{path.name}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                obj = {"_error": f"not a JSON object ({err.msg})"}
            yield where, obj if isinstance(obj, dict) else {"_error": "not a JSON object"}


def _parse(record: dict[str, object], where: str) -> tuple[str, int, _Event] | None:
    if "_error" in record:
        raise TraceError(f"{where}: {record['_error']}")
    for name in _REQUIRED:
        if record.get(name) in (None, ""):
            raise TraceError(f"{where}: {name} is missing")
    time_us = integer(str(record["time"]), "time", where)
    kind = integer(str(record["type"]), "type", where)
    index = integer(str(record["instance_index"]), "instance_index", where)
    if time_us < 0 or index < 0:
        raise TraceError(f"{where}: time and instance_index must be >= 0")
    if not 0 <= kind <= MAX_EVENT_TYPE:
        raise TraceError(f"{where}: event type {kind} is not one of 0..{MAX_EVENT_TYPE}")
    collection_type = optional_number(_text(record, "collection_type"), "collection_type", where)
    if collection_type == ALLOC_SET:
        return None
    cpus, memory = _request(record, where)
    return str(record["collection_id"]).strip(), index, _Event(time_us, kind, cpus, memory)


def _request(record: dict[str, object], where: str) -> tuple[float | None, float | None]:
    nested = record.get("resource_request")
    if isinstance(nested, str) and nested.strip():
        try:
            nested = json.loads(nested.replace("'", '"'))
        except json.JSONDecodeError:
            raise TraceError(f"{where}: resource_request is not {{cpus, memory}}") from None
    if isinstance(nested, dict):
        record = {**record, **nested}
    cpus = optional_number(_text(record, "cpus"), "cpus", where)
    memory = optional_number(_text(record, "memory"), "memory", where)
    if (cpus is not None and cpus < 0) or (memory is not None and memory < 0):
        raise TraceError(f"{where}: negative resource request")
    return cpus, memory


def _text(record: dict[str, object], name: str) -> str:
    value = record.get(name)
    return "" if value is None else str(value)


def _build_job(
    job_id: str,
    instances: dict[int, _Instance],
    stats: ReadStats,
    cpu_milli_per_ncu: float,
    memory_mb_per_unit: float,
) -> TraceJob | None:
    tasks = []
    arrival_us = None
    for index in sorted(instances):
        events = sorted(instances[index].events, key=lambda e: e.time_us)
        submits = [e.time_us for e in events if e.type == SUBMIT]
        first = min(submits) if submits else events[0].time_us
        arrival_us = first if arrival_us is None else min(arrival_us, first)
        task = _build_task(events, cpu_milli_per_ncu, memory_mb_per_unit)
        if task is None:
            stats.incomplete += 1
        else:
            tasks.append(task)
    if not tasks:
        return None
    return TraceJob(job_id=job_id, arrival_s=(arrival_us or 0) / 1e6, tasks=tuple(tasks))


def _build_task(
    events: list[_Event], cpu_milli_per_ncu: float, memory_mb_per_unit: float
) -> TraceTask | None:
    ran_us, runs, since = 0, 0, None
    cpus = memory = None
    for e in events:
        if e.cpus is not None or e.memory is not None:
            cpus, memory = e.cpus, e.memory
        if e.type == SCHEDULE and since is None:
            since = e.time_us
        elif e.type in RUN_ENDS and since is not None and e.time_us < AFTER_TRACE_END:
            ran_us += e.time_us - since
            runs += 1
            since = None
    if runs == 0 or since is not None:
        return None
    if cpus is None and memory is None:
        return TraceTask(duration_s=ran_us / 1e6)
    cpu_milli = math.ceil((cpus or 0.0) * cpu_milli_per_ncu)
    memory_mb = math.ceil((memory or 0.0) * memory_mb_per_unit)
    if cpu_milli == 0 and memory_mb == 0:
        cpu_milli = 1
    return TraceTask(duration_s=ran_us / 1e6, cpu_milli=cpu_milli, memory_mb=memory_mb)


def _first_char(path: Path) -> str:
    with open_text(path) as handle:
        for line in handle:
            if line.strip():
                return line.lstrip()[0]
    return ""


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
