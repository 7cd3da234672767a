"""What an LM tells GMs about itself: full snapshots and deltas, ordered by version.

A delta carries *absolute* values for everything that changed after ``base_version``,
never increments. Applying it twice, or applying it on top of any view at least as new
as ``base_version``, gives the same result: a GM can miss, repeat or reorder heartbeats
and still converge to the LM's books at the next one it can use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.core.node_table import NodeColumns
from services.core.resources import NUM_RESOURCES


@dataclass(frozen=True, slots=True, eq=False)
class Allocation:
    """A task holding resources on a node of an LM.

    ``partition`` is the GM partition that scheduled it; ``logical`` marks a repartition:
    the resources were carved from a node another GM owns and go back to it on release.
    ``sequence`` orders launches LM-wide (larger = younger), for youngest-first victims.
    ``usage_mean`` / ``usage_var`` are the CPU usage the task added to its node's GPA
    sums (``gpa.task_usage``), so a release takes back exactly what the launch booked.
    """

    task_id: str
    queue: str
    node: int
    resources: np.ndarray
    partition: int
    logical: bool
    sequence: int
    attempt: int = 0
    version: int = 0  # LM version at which it started (for deltas)
    usage_mean: float = 0.0  # millicores
    usage_var: float = 0.0  # millicores^2
    # The task's job, on the LM's own books ("" when unknown: not sent to GMs), so that
    # another job's task with the same id is refused there (task ids are global).
    job_id: str = ""
    # A gang's task or placeholder (``TaskSpec.gang``): never a preemption's victim.
    gang: bool = False


@dataclass(slots=True, eq=False)
class Snapshot:
    lm_id: str
    version: int
    full: bool
    base_version: int
    gm_ids: tuple[str, ...]
    num_constraints: int
    nodes: NodeColumns  # full: every node; delta: nodes whose static facts changed
    free_indices: np.ndarray  # int64 (k,): row numbers (uint32 on the wire)
    free: np.ndarray  # int64 (NUM_RESOURCES, k)
    allocations: list[Allocation] = field(default_factory=list)
    ended_task_ids: list[str] = field(default_factory=list)
    # GPA usage sums of the ``free_indices`` nodes, float64 (k,) each: mean (millicores)
    # and variance (millicores^2). None = not reported; a view then derives them from
    # free (see ``NodeTable.set_free``).
    usage_mean: np.ndarray | None = None
    usage_var: np.ndarray | None = None
    # Which life of the LM took it (its start time in ns; 0 for an LM that never
    # restarts, as in the simulator). Versions count from zero in each.
    incarnation: int = 0

    @staticmethod
    def empty_free() -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(0, dtype=np.int64), np.zeros((NUM_RESOURCES, 0), dtype=np.int64)
