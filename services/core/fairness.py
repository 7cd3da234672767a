"""Global fairness decisions (paper Alg. 2): shares, usage, and whom to preempt.

Fairness acts only under contention: when a task finds no node anywhere, its queue may
preempt if it is under its share, and the victims come from the queue with the largest
share violation. Shares are dominant-resource shares over CPU and memory.

Victim choice, vectorised: take the violating queue's allocations on nodes that satisfy
the task's constraints, order them by node and youngest first, and within each node
accumulate freed resources; the node needing the fewest victims wins.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from services.core.match import candidates
from services.core.node_table import NodeTable, bools_from_bits
from services.core.resources import CPU, MEMORY
from services.core.snapshot import Allocation
from services.core.task import TaskSpec


@dataclass(frozen=True, slots=True)
class QueueShare:
    """A user queue as fairness sees it. Drivers make it from their config with
    ``services.common.config.QueueConfig.as_share``."""

    name: str
    share: float  # fraction of the federation, 0 < share <= 1


@dataclass(frozen=True, slots=True)
class Victims:
    node: int
    task_ids: tuple[str, ...]
    queue: str


def usage_by_queue(allocations: Iterable[Allocation]) -> dict[str, np.ndarray]:
    """Resources held per user queue."""
    # Grouped first and summed once per queue: one numpy call per queue instead of one
    # per allocation (this runs for every preemption decision over every allocation).
    groups: dict[str, list[np.ndarray]] = {}
    for allocation in allocations:
        held = groups.get(allocation.queue)
        if held is None:
            groups[allocation.queue] = [allocation.resources]
        else:
            held.append(allocation.resources)
    return {
        queue: np.add.reduce(held) if len(held) > 1 else held[0].copy()
        for queue, held in groups.items()
    }


# The questions below are asked of 4-vectors several times a scheduling round: on
# Python numbers (one ``tolist`` each) they cost a fraction of numpy's per-call overhead,
# with the same float64 arithmetic.


def dominant_share(usage: np.ndarray, total: np.ndarray) -> float:
    """max(cpu used / cpu total, memory used / memory total)."""
    used, of = usage.tolist(), total.tolist()
    shares = [used[d] / of[d] for d in (CPU, MEMORY) if of[d] > 0]
    return float(max(shares, default=0.0))


def tasks_within(room: np.ndarray, request: np.ndarray, most: int) -> int:
    """How many tasks of ``request`` fit in ``room`` (``FairShare.headroom``), up to ``most``."""
    fits = [r / q for r, q in zip(room.tolist(), request.tolist(), strict=True) if q > 0]
    if not fits:
        return most
    fit = min(fits)
    return most if fit >= most else max(math.floor(fit), 0)


class FairShare:
    """The configured shares, and the questions Alg. 2 asks of them."""

    def __init__(self, queues: Sequence[QueueShare], slack: float = 0.0):
        """``slack``: how far below its share (a fraction of the federation, dominant
        share) a queue must be before it may preempt (``may_preempt``); 0: any amount.
        Room that ends free reaches an under-share queue without preempting when freed
        room goes to it first (``claims: oldest``): the slack leaves the small deficits to
        that, and preempts for the large ones."""
        if not 0 <= slack < 1:
            raise ValueError(f"slack must be in [0, 1), got {slack}")
        self.slack = slack
        names = [q.name for q in queues]
        if len(set(names)) != len(names):
            raise ValueError(f"queue names must be unique, got {names}")
        for q in queues:
            if not 0 < q.share <= 1:
                raise ValueError(f"queue {q.name!r}: share must be in (0, 1], got {q.share}")
        total = sum(q.share for q in queues)
        if total > 1 + 1e-9:
            raise ValueError(f"queue shares add up to {total:.2f}; they must not exceed 1")
        self.queues = {q.name: q for q in queues}

    def share_of(self, queue: str) -> float:
        q = self.queues.get(queue)
        return q.share if q is not None else 0.0

    def share_violation(self, queue: str, usage: dict[str, np.ndarray], total: np.ndarray) -> float:
        """Dominant share used minus share configured (> 0: over share)."""
        held = usage.get(queue)
        used = dominant_share(held, total) if held is not None else 0.0
        return used - self.share_of(queue)

    def headroom(self, queue: str, usage: dict[str, np.ndarray], total: np.ndarray) -> np.ndarray:
        """What ``queue`` may still take before it is over its share: per resource, its
        share of the total less what it holds (CPU and memory; the others unbounded).
        Negative where it is over."""
        of, held = total.tolist(), usage.get(queue)
        used = held.tolist() if held is not None else [0] * len(of)
        share = self.share_of(queue)
        room = [math.inf] * len(of)
        for d in (CPU, MEMORY):
            if of[d] > 0:
                room[d] = share * of[d] - used[d]
        return np.array(room, dtype=np.float64)

    def is_under_share(self, queue: str, usage: dict[str, np.ndarray], total: np.ndarray) -> bool:
        return self.share_violation(queue, usage, total) < 0

    def is_over_share(self, queue: str, usage: dict[str, np.ndarray], total: np.ndarray) -> bool:
        return self.share_violation(queue, usage, total) > 0

    def may_preempt(self, queue: str, usage: dict[str, np.ndarray], total: np.ndarray) -> bool:
        """Alg. 2: ``queue`` is under its share by more than ``slack``."""
        return self.share_violation(queue, usage, total) < -self.slack

    def most_over_share(
        self, usage: dict[str, np.ndarray], total: np.ndarray, exclude: str = ""
    ) -> str | None:
        """The queue with the largest positive violation, if any queue is over share."""
        best, best_violation = None, 0.0
        for queue in sorted(usage):
            if queue == exclude:
                continue
            violation = self.share_violation(queue, usage, total)
            if violation > best_violation:
                best, best_violation = queue, violation
        return best

    def describe(self, queue: str, usage: dict[str, np.ndarray], total: np.ndarray) -> str:
        """``"over share (32 % of 25 %)"`` or ``"under share (10 % of 25 %)"``."""
        held = usage.get(queue)
        used = dominant_share(held, total) if held is not None else 0.0
        share = self.share_of(queue)
        if used <= share and share - used <= self.slack:
            return (
                f"under share by no more than the preemption slack ({used:.1%} of "
                f"{share:.0%}; it preempts below {share - self.slack:.1%})"
            )
        side = "over" if used > share else "under"
        return f"{side} share ({used:.0%} of {share:.0%})"


def pick_victims(table: NodeTable, task: TaskSpec, running: Sequence[Allocation]) -> Victims | None:
    """Fewest allocations from ``running`` (one queue's, on this table) whose release
    lets ``task`` fit on one node that satisfies its constraints; youngest first."""
    if not running:
        return None
    cand = bools_from_bits(candidates(table, task.constraint_mask))
    nodes = np.fromiter((a.node for a in running), dtype=np.int64, count=len(running))
    keep = np.flatnonzero(cand[nodes])
    if keep.size == 0:
        return None
    nodes = nodes[keep]
    seq = np.array([running[i].sequence for i in keep], dtype=np.int64)
    res = np.stack([running[i].resources for i in keep], axis=1)  # (R, k)
    order = np.lexsort((-seq, nodes))  # by node, youngest first within a node
    nodes, res, keep = nodes[order], res[:, order], keep[order]
    starts = np.flatnonzero(np.r_[True, nodes[1:] != nodes[:-1]])
    group_start = np.repeat(starts, np.diff(np.r_[starts, nodes.size]))
    cumulative = np.cumsum(res, axis=1)
    before_group = np.where(group_start > 0, cumulative[:, group_start - 1], 0)
    freed = cumulative - before_group  # freed on the node by victims up to here
    enough = ((table.free[:, nodes] + freed) >= task.resources[:, None]).all(axis=0)
    hits = np.flatnonzero(enough)
    if hits.size == 0:
        return None
    counts = hits - group_start[hits] + 1
    best = hits[int(counts.argmin())]
    chosen = keep[group_start[best] : best + 1]
    return Victims(
        node=int(nodes[best]),
        task_ids=tuple(running[i].task_id for i in chosen),
        queue=running[int(chosen[0])].queue,
    )
