"""What task events say about each task, and the ``tasks.csv`` row made from them.

    TaskEvent (RabbitMQ topic, or a GM's WatchJob stream) ──EventLog.add_event──▶
        latest RUNNING per task, its end ──task_row──▶ tasks.csv row + stamps for report.py

The live benchmark and the live replay both keep one ``EventLog``, so their reports are
built the same way.
"""

from __future__ import annotations

import struct
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from loadgen import report
from services._proto.megha.v1 import common_pb2

RUNNING = common_pb2.TASK_STATE_RUNNING
SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED
# Ends a task for good; LOST and PREEMPTED tasks come back as a new attempt.
ENDED = {SUCCEEDED, common_pb2.TASK_STATE_FAILED, common_pb2.TASK_STATE_REJECTED}
# Every stamp of ``report.STAMPS``, packed: a run keeps one record per task and event
# kind, so a replay of millions of tasks must not keep whole protobuf events.
_STAMPS = struct.Struct(f"<{len(report.STAMPS)}q")
_FIELDS = tuple(f"{name}_unix_nanos" for name in report.STAMPS)


class Seen(NamedTuple):
    """What one task event says that a report needs, in ~0.2 KB instead of a whole event
    (which also keeps its whole batch's memory alive).

    ``EventLog`` keeps ``record``'s plain tuple and makes the named one when read: the
    garbage collector stops tracking a plain tuple of strings, ints and bytes, but tracks
    every named one, and a million of them made each full collection of the load
    generator ~0.3 s, stalling the load it offers (``scripts/eventlog_memory.py`` times it).
    """

    state: int
    attempt: int
    lm_id: str
    node_id: str
    packed_stamps: bytes

    @classmethod
    def of(cls, event: common_pb2.TaskEvent) -> Seen:
        return cls._make(cls.record(event))

    @staticmethod
    def record(event: common_pb2.TaskEvent) -> tuple[int, int, str, str, bytes]:
        ts = event.timestamps
        return (
            event.state,
            event.attempt,
            sys.intern(event.lm_id),  # a few LMs and nodes, shared by every record
            sys.intern(event.node_id),
            _STAMPS.pack(*(getattr(ts, name) for name in _FIELDS)),
        )

    @property
    def stamps(self) -> dict[str, int]:
        return dict(zip(report.STAMPS, _STAMPS.unpack(self.packed_stamps), strict=True))


_ATTEMPT = Seen._fields.index("attempt")  # in a record


class EventLog:
    """What the LMs' task events say about each task, recorded as they arrive."""

    def __init__(self) -> None:
        # Task id -> ``Seen.record``; read them through ``seen``.
        self.running: dict[str, tuple] = {}  # the latest attempt's RUNNING
        self.ended: dict[str, tuple] = {}  # SUCCEEDED / FAILED / REJECTED
        self.successes: Counter[str] = Counter()  # > 1 for a task id = exactly-once broken
        self.events = 0
        self.batches = 0

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
            if known is None or event.attempt >= known[_ATTEMPT]:
                self.running[event.task_id] = Seen.record(event)
        elif state in ENDED:
            self.ended[event.task_id] = Seen.record(event)
            if state == SUCCEEDED:
                self.successes[event.task_id] += 1

    def seen(self, task_id: str) -> tuple[Seen | None, Seen | None]:
        """The task's latest RUNNING and its end, as far as seen."""
        running, ended = self.running.get(task_id), self.ended.get(task_id)
        return (
            None if running is None else Seen._make(running),
            None if ended is None else Seen._make(ended),
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
