"""What the simulated processes send each other: the wire messages' fields the protocol
reads, as small Python objects (a protobuf per message would cost most of a run)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.core import states
from services.core.cluster_state import Decision
from services.core.resources import resources
from services.core.snapshot import Snapshot
from services.core.status import PlacementStatus
from services.core.task import TaskSpec


@dataclass(slots=True, eq=False)
class Stamps:
    started_unix_nanos: int = 0
    finished_unix_nanos: int = 0


@dataclass(slots=True, eq=False)
class Task:
    """``megha.v1.Task``: what the lifecycle reads (``HeldTask``) and what a run needs."""

    task_id: str
    job_id: str
    queue: str
    cpu: int
    mem: int
    duration_s: float
    attempt: int = 0
    lease: int = 0
    failures: int = 0
    max_retries: int = 1
    timestamps: Stamps = field(default_factory=Stamps)

    def copy(self) -> Task:
        return Task(
            self.task_id,
            self.job_id,
            self.queue,
            self.cpu,
            self.mem,
            self.duration_s,
            self.attempt,
            self.lease,
            self.failures,
            self.max_retries,
            Stamps(self.timestamps.started_unix_nanos, self.timestamps.finished_unix_nanos),
        )

    def next_attempt(self) -> Task:
        """``services.common.convert.next_attempt``: the copy a re-queue puts in its queue."""
        again = self.copy()
        again.attempt += 1
        again.timestamps = Stamps()
        return again

    def spec(self) -> TaskSpec:
        return TaskSpec(
            task_id=self.task_id,
            resources=resources(self.cpu, self.mem),
            queue=self.queue,
            job_id=self.job_id,
            attempt=self.attempt,
            lease=self.lease,
            duration_s=self.duration_s,
        )


@dataclass(slots=True, eq=False)
class Batch:
    """``megha.v1.TaskBatch``: one user-queue message."""

    job_id: str
    queue: str
    tasks: tuple[Task, ...]
    queued_at: float = 0.0  # the tasks' queued_unix_nanos (simulated seconds)
    more_jobs: tuple[Batch, ...] = ()  # more jobs in the same message (``TaskBatch.more_jobs``)

    def key(self) -> tuple:
        return (self.job_id, tuple((t.task_id, t.attempt) for t in self.tasks))


@dataclass(slots=True, eq=False)
class Event:
    """``megha.v1.TaskEvent``."""

    task_id: str
    job_id: str
    queue: str
    state: int
    lm_id: str
    node_id: str
    attempt: int
    reason: str = ""
    started: int = 0
    finished: int = 0


@dataclass(slots=True, eq=False)
class Report:
    """``megha.v1.TaskReport``: a worker's word on one attempt (``WorkerReport``)."""

    task_id: str
    attempt: int
    state: int
    message: str = ""
    peak_memory_mb: int = 0
    started: int = 0
    finished: int = 0


@dataclass(slots=True, eq=False)
class PlaceRequest:
    """A launch on an LM: (task, node, repartition) each, launches and repartitions in
    one request as the live GM's launch stream carries them (``Placement.repartition``)."""

    gm_id: str
    placements: list[tuple[Task, int, bool]]
    known_version: int
    expires: float


@dataclass(slots=True, eq=False)
class PlaceReply:
    results: list[Decision]
    state: Snapshot | None = None


@dataclass(slots=True, eq=False)
class PreemptRequest:
    gm_id: str
    task: Task
    node: int
    victims: list[str]
    known_version: int
    expires: float


@dataclass(slots=True, eq=False)
class PreemptReply:
    result: Decision
    preempted: list[str]
    state: Snapshot | None = None


@dataclass(slots=True, eq=False)
class Known:
    """``LookupTasksResponse.tasks[i]``."""

    task_id: str
    attempt: int
    running: bool
    last_ended: Event | None


@dataclass(slots=True, eq=False)
class Beat:
    """``megha.v1.WorkerHeartbeat``."""

    node_id: str
    reports: list[Report]
    sent_at: float
    want_ack: bool


EXPIRED = PlacementStatus.REJECTED_EXPIRED
RELEASED = states.RELEASED
TERMINAL = states.TERMINAL
ZERO = np.zeros(0)
