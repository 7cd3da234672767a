"""The scheduler's view of a task: what it asks for, not how it runs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.core.resources import validate_request


@dataclass(frozen=True, slots=True, eq=False)
class TaskSpec:
    """A task as placement sees it.

    ``attempt`` grows each time the task is re-queued (preemption, lost worker); an LM
    treats a launch of an attempt it has already seen end as a stale duplicate, so a
    retried request can never run the same attempt twice.
    """

    task_id: str
    resources: np.ndarray
    constraint_mask: int = 0
    queue: str = "default"
    job_id: str = ""
    attempt: int = 0
    # The fencing token of the request that placed it (``Task.lease``): an LM refuses a
    # placement below the lease a newer request fenced the task with.
    lease: int = 0
    duration_s: float = 0.0
    # GPA: the task's CPU usage distribution (millicores), when known.
    cpu_usage_mean: float = 0.0
    cpu_usage_std: float = 0.0
    lifetime_features: dict[str, str] = field(default_factory=dict)
    # A member of a gang (started by ReserveGang / CommitGang): never a preemption's
    # victim, as preempting one would leave the rest of its gang running without it.
    gang: bool = False

    def __post_init__(self) -> None:
        if not self.task_id:
            raise ValueError("a task needs a task_id")
        validate_request(self.resources)
