"""What task events say about each task, and the ``tasks.csv`` row made from them.

    TaskEvent (RabbitMQ topic, or a GM's WatchJob stream) ──EventLog.add_event──▶
        latest RUNNING per task, its end ──task_row──▶ tasks.csv row + stamps for report.py

The live benchmark and the live replay both keep one ``EventLog``, so their reports are
built the same way.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from loadgen import report
from services._proto.megha.v1 import common_pb2
from services.core.recent import GrowingMap
from services.core.states import PREEMPTED, RUNNING, SUCCEEDED, TERMINAL

# What a report needs of one event, packed: state, attempt and every stamp of
# ``report.STAMPS``, then "lm_id\0node_id". A run keeps one record per task and event kind.
_HEAD = struct.Struct(f"<ii{len(report.STAMPS)}q")
_STAMPS = struct.Struct(f"<{len(report.STAMPS)}q")
_STATE_ATTEMPT = struct.Struct("<ii")  # the head's first two fields
_FIELDS = tuple(f"{name}_unix_nanos" for name in report.STAMPS)


def record(event: common_pb2.TaskEvent) -> bytes:
    """``event`` as ``EventLog`` keeps it: bytes, ~0.15 KB. A map whose values are all
    bytes and strings is never tracked by the garbage collector, so the load generator's
    maps of a million tasks add nothing to its full collections. With tuples they did:
    337 ms a collection at a million tasks (32 ms now, ``scripts/eventlog_memory.py``),
    and the load generator offered nothing meanwhile."""
    ts = event.timestamps
    head = _HEAD.pack(event.state, event.attempt, *(getattr(ts, name) for name in _FIELDS))
    return head + f"{event.lm_id}\0{event.node_id}".encode()


class Seen(NamedTuple):
    """What one task event says that a report needs (a record, read back)."""

    state: int
    attempt: int
    lm_id: str
    node_id: str
    packed_stamps: bytes

    @classmethod
    def read(cls, data: bytes) -> Seen:
        state, attempt = _STATE_ATTEMPT.unpack_from(data)
        lm_id, node_id = data[_HEAD.size :].decode().split("\0")
        return cls(state, attempt, lm_id, node_id, data[_STATE_ATTEMPT.size : _HEAD.size])

    @property
    def stamps(self) -> dict[str, int]:
        return dict(zip(report.STAMPS, _STAMPS.unpack(self.packed_stamps), strict=True))


class AcceptedTasks(Mapping[str, tuple[str, str]]):
    """Task id -> (job id, GM) of every task a GM acknowledged. Kept as maps of strings
    (task -> job, job -> GM), which the garbage collector never scans (see ``record``);
    the one per task grows in generations (``GrowingMap``), as do ``EventLog``'s."""

    def __init__(self) -> None:
        self._job: GrowingMap[str] = GrowingMap()
        self._gm: dict[str, str] = {}

    def add(self, task_id: str, job_id: str, gm: str) -> None:
        self._job[task_id] = job_id
        self._gm[job_id] = sys.intern(gm)

    def __getitem__(self, task_id: str) -> tuple[str, str]:
        job_id = self._job[task_id]
        return job_id, self._gm[job_id]

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._job

    def __iter__(self) -> Iterator[str]:
        return iter(self._job)

    def __len__(self) -> int:
        return len(self._job)


class EventLog:
    """What the LMs' task events say about each task, recorded as they arrive."""

    def __init__(self) -> None:
        # Task id -> ``record``; read them through ``seen``. In generations of plain
        # dicts: one dict of a million tasks held the offer ~30 ms each time it grew, and
        # these three and AcceptedTasks grow together (~0.12 s at 699,050 tasks).
        self.running: GrowingMap[bytes] = GrowingMap()  # the latest attempt's RUNNING
        self.ended: GrowingMap[bytes] = GrowingMap()  # SUCCEEDED / FAILED / REJECTED / CANCELLED
        # Task id -> successes seen, > 1 = exactly-once broken (ints, never scanned by the
        # collector, where a Counter would be).
        self.successes: GrowingMap[int] = GrowingMap()
        self.events = 0
        self.batches = 0
        self.preempted = 0  # PREEMPTED events: attempts preemption ended

    async def on_batch(self, _routing_key: str, body: bytes) -> None:
        self.add(common_pb2.TaskEventBatch.FromString(body))

    def add(self, batch: common_pb2.TaskEventBatch) -> None:
        self.batches += 1
        for event in batch.events:
            self.add_event(event)

    def add_event(self, event: common_pb2.TaskEvent) -> None:
        self.events += 1
        state = event.state
        if state == RUNNING:
            known = self.running.get(event.task_id)
            if known is None or event.attempt >= _STATE_ATTEMPT.unpack_from(known)[1]:
                self.running[event.task_id] = record(event)
        elif state == PREEMPTED:
            self.preempted += 1
        elif state in TERMINAL:  # LOST, PREEMPTED, RETRYING come back as a new attempt
            self.ended[event.task_id] = record(event)
            if state == SUCCEEDED:
                self.successes[event.task_id] = self.successes.get(event.task_id, 0) + 1

    def seen(self, task_id: str) -> tuple[Seen | None, Seen | None]:
        """The task's latest RUNNING and its end, as far as seen."""
        running, ended = self.running.get(task_id), self.ended.get(task_id)
        return (
            None if running is None else Seen.read(running),
            None if ended is None else Seen.read(ended),
        )

    @property
    def succeeded(self) -> int:
        return len(self.successes)

    @property
    def duplicates(self) -> int:
        return sum(1 for count in self.successes.values() if count > 1)

    def stamps(self, task_id: str) -> dict[str, int]:
        """One task's stamps (``report.STAMPS`` names, 0 where not seen)."""
        running, ended = self.seen(task_id)
        # RUNNING carries the stamps up to the start; the end event has them too, plus
        # finished, so it stands in if RUNNING was never seen.
        stamps = stamps_of(running or ended)
        if ended is not None:
            stamps["finished"] = ended.stamps["finished"]
        return stamps

    def measure(self, task_ids: Iterable[str], started_from_ns: int = 0) -> Measured:
        """The tasks of ``task_ids`` that were allocated and started at or after
        ``started_from_ns``."""
        ids: list[str] = []
        alloc_s: list[float] = []
        started_ns: list[int] = []
        allocated = 0
        for task_id in task_ids:
            stamps = self.stamps(task_id)
            alloc = report.allocation_s(stamps)
            if alloc is None:
                continue
            allocated += 1
            if stamps["started"] >= started_from_ns:
                ids.append(task_id)
                alloc_s.append(alloc)
                started_ns.append(stamps["started"])
        return Measured(ids, alloc_s, started_ns, allocated)

    def task_row(self, task_id: str, job_id: str, gm: str) -> tuple[dict[str, Any], dict[str, int]]:
        """The ``tasks.csv`` row of one task, and its stamps (``report.STAMPS`` names)."""
        running, ended = self.seen(task_id)
        stamps = self.stamps(task_id)
        source = running or ended
        state = ended.state if ended else running.state if running else 0
        row = {
            "task_id": task_id,
            "job_id": job_id,
            "gm": gm,
            "lm_id": source.lm_id if source else "",
            "node_id": source.node_id if source else "",
            **{f"{name}_unix_nanos": stamps[name] for name in report.STAMPS},
            "alloc_s": report.allocation_s(stamps),
            "attempt": source.attempt if source else "",
            "state": common_pb2.TaskState.Name(state).removeprefix("TASK_STATE_").lower(),
        }
        return row, stamps


class Measured(NamedTuple):
    """The tasks a report measures (allocated, started at or after a warm-up's end), each
    by id, allocation time and start, in the same order; only what a summary needs, so a
    run of a million tasks does not keep a dict of stamps per task (``EventLog.stamps``
    makes them again where wanted)."""

    task_ids: list[str]
    alloc_s: list[float]
    started_ns: list[int]
    allocated: int  # tasks with an allocation time, warm-up included


class TaskRows:
    """The ``tasks.csv`` rows of the accepted tasks (task id -> (job id, GM)), in task id
    order, made anew each time they are iterated instead of kept: a row and its stamps
    take ~2 KB, so a run of a million tasks would hold gigabytes just to write a file."""

    def __init__(self, events: EventLog, accepted: Mapping[str, tuple[str, str]]) -> None:
        self._events = events
        self._accepted = accepted

    def __len__(self) -> int:
        return len(self._accepted)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for task_id in sorted(self._accepted):
            job_id, gm = self._accepted[task_id]
            yield self._events.task_row(task_id, job_id, gm)[0]


def stamps_of(seen: Seen | None) -> dict[str, int]:
    return dict.fromkeys(report.STAMPS, 0) if seen is None else seen.stamps
