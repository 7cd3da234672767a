"""A trace as flat arrays (``Workload``) and what happened to each task (``TaskLog``).

Tasks are numbered ``0..n-1`` in trace order; job ``j`` owns ``first[j]:first[j + 1]``.
Arrays instead of one object per task keep 50,000-worker, 100,000-task runs small.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from loadgen import report
from loadgen.trace import TraceJob
from services.core.constraints import to_mask
from services.core.resources import resources

# Virtual time of the first job's arrival. Not 0: a stamp of 0 means "never reached".
START_NS = 1_000_000_000


@dataclass(frozen=True, eq=False)
class Shape:
    """What placement sees of a task: its request and constraints."""

    resources: np.ndarray
    constraint_mask: int

    @property
    def key(self) -> tuple[int, bytes]:
        return (self.constraint_mask, self.resources.tobytes())


@dataclass(eq=False)
class Workload:
    job_ids: list[str]
    arrival_ns: np.ndarray  # int64 (jobs,), virtual time, first arrival at START_NS
    first: np.ndarray  # int64 (jobs + 1,), task index range of each job
    duration_ns: np.ndarray  # int64 (tasks,)
    shape_of: np.ndarray  # int32 (tasks,), index into shapes
    shapes: list[Shape] = field(default_factory=list)
    users: list[str] = field(default_factory=list)  # per job; "" when the trace names none

    @property
    def jobs(self) -> int:
        return len(self.job_ids)

    @property
    def tasks(self) -> int:
        return int(self.duration_ns.size)

    def job_of(self) -> np.ndarray:
        """Job index of every task."""
        return np.repeat(np.arange(self.jobs), np.diff(self.first))

    def scale_arrivals(self, scale: float) -> None:
        """Multiply every job's arrival time since the first by ``scale`` (0.5: the
        trace's jobs arrive in half the time, twice the load on the same cluster)."""
        if scale != 1.0:
            since = (self.arrival_ns - START_NS).astype(float) * scale
            self.arrival_ns = np.rint(since).astype(np.int64) + START_NS

    @classmethod
    def from_jobs(cls, jobs: Iterable[TraceJob], num_constraints: int = 64) -> Workload:
        job_ids: list[str] = []
        users: list[str] = []
        arrivals: list[float] = []
        counts: list[int] = []
        durations: list[float] = []
        shape_of: list[int] = []
        shapes: list[Shape] = []
        index: dict[tuple, int] = {}
        for job in jobs:
            job_ids.append(job.job_id)
            users.append(job.user)
            arrivals.append(job.arrival_s)
            counts.append(len(job.tasks))
            for task in job.tasks:
                durations.append(task.duration_s)
                key = (
                    task.cpu_milli,
                    task.memory_mb,
                    task.disk_mb,
                    task.net_mbps,
                    task.constraints,
                )
                shape = index.get(key)
                if shape is None:
                    shape = index[key] = len(shapes)
                    request = resources(task.cpu_milli, task.memory_mb, task.disk_mb, task.net_mbps)
                    shapes.append(Shape(request, to_mask(task.constraints, num_constraints)))
                shape_of.append(shape)
        if not job_ids:
            raise ValueError("the trace holds no job")
        arrival = np.asarray(arrivals, dtype=float)
        order = np.argsort(arrival, kind="stable")
        if (order != np.arange(order.size)).any():
            raise ValueError("trace jobs must come in arrival order")
        rel = np.rint((arrival - arrival[0]) * 1e9).astype(np.int64) + START_NS
        first = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=first[1:])
        return cls(
            job_ids=job_ids,
            arrival_ns=rel,
            first=first,
            duration_ns=np.rint(np.asarray(durations, dtype=float) * 1e9).astype(np.int64),
            shape_of=np.asarray(shape_of, dtype=np.int32),
            shapes=shapes,
            users=users,
        )


class TaskLog:
    """Per-task stamps (virtual ns, the fields of ``TaskTimestamps``) and placement."""

    def __init__(self, tasks: int):
        self.stamps = {name: np.zeros(tasks, dtype=np.int64) for name in report.STAMPS}
        self.gm = np.full(tasks, -1, dtype=np.int32)
        self.lm = np.full(tasks, -1, dtype=np.int32)
        self.node = np.full(tasks, -1, dtype=np.int64)
        self.attempt = np.zeros(tasks, dtype=np.int32)
        self.rejections = np.zeros(tasks, dtype=np.int32)
        self.infeasible = np.zeros(tasks, dtype=bool)
        # net_mbps each task's last attempt booked on its node (a VDC member: its uplink
        # share); filled only when workers have an uplink (``SimConfig.uplink_mbps``).
        self.net_mbps = np.zeros(tasks, dtype=np.int64)

    def started(self) -> np.ndarray:
        return self.stamps["started"] > 0

    def finished(self) -> np.ndarray:
        return self.stamps["finished"] > 0
