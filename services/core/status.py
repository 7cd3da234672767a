"""Outcomes of scheduling decisions: values, never effects.

Following the Kubernetes framework's ``Status`` and Ray's FAILED/INFEASIBLE split, a task
that cannot be placed now (``UNSCHEDULABLE``: wait and retry) is told apart from one that
no node could ever hold (``INFEASIBLE``: reject at submit, never queue).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PlacementStatus(enum.IntEnum):
    """The LM's verdict on a request; values match ``megha.v1.PlacementStatus``."""

    ACCEPTED = 1
    DUPLICATE = 2
    REJECTED_UNKNOWN_NODE = 3
    REJECTED_WRONG_PARTITION = 4
    REJECTED_NODE_DEAD = 5
    REJECTED_CONSTRAINTS = 6
    REJECTED_RESOURCES = 7
    REJECTED_VICTIMS = 8
    REJECTED_UNKNOWN_GM = 9
    REJECTED_INVALID = 10  # the task is malformed for this LM; retrying cannot help
    REJECTED_EXPIRED = 11  # read after the GM gave up on the request: nothing was done
    REJECTED_CANCELLED = 12  # the task's job was cancelled: it must not run
    REJECTED_NODE_DRAINING = 13  # an operator drains the node: it takes no new task
    REJECTED_FENCED = 14  # a newer request fenced the task (its lease is older): nothing done
    REJECTED_TASK_ID_TAKEN = 15  # another job uses this task id here; it can never run here

    @property
    def ok(self) -> bool:
        return self in (PlacementStatus.ACCEPTED, PlacementStatus.DUPLICATE)


class Schedulability(enum.Enum):
    SCHEDULABLE = "schedulable"
    UNSCHEDULABLE = "unschedulable"  # no room now; may fit later
    INFEASIBLE = "infeasible"  # no node of the federation could ever hold it


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a task can be placed, with the reason a person can act on."""

    schedulability: Schedulability
    reason: str = ""
