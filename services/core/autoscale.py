"""The autoscaler's decisions: how many nodes each pool needs, and which to start, drain
and stop. No I/O and no clocks: the caller passes the time.

    waiting tasks (shape, constraints, count) ──pool_demand──▶ nodes per pool they need
        + busy nodes of each pool ──▶ demand now ──forecast (predictor)──▶ target per pool
    target, the pool's nodes ──decide──▶ start slots / undrain / drain idle / stop drained

A **pool** is a node shape the autoscaler may add to one LM, between ``low`` and
``high`` nodes. A waiting task is counted for the cheapest pool (lexicographic order,
cores first, as ``services/core/buckets.py``) whose nodes have its constraints and hold it
whole; a task no pool can hold is counted apart (``unplaced``), never as a node. The
nodes a pool needs for its waiting tasks are a packing that exists: each shape of task
packed apart, ``ceil(count / per_node)``, so never fewer than the fluid count
``buckets.counts_from_sums`` gives and never a node short for tasks that do not split.

Scale-up is immediate. Scale-down is careful: only a node that has run nothing for
``idle_s`` is drained, longest idle first, and only a drained node that still runs
nothing is stopped (a launch may have reached it between the look and the drain). A
pool never goes below ``low`` or above ``high`` started nodes, and a draining node is
taken back before a new one is started.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.core.buckets import increasing_order
from services.core.limits import LimitLedger
from services.core.task import TaskSpec

STARTING, ALIVE, DRAINING = "starting", "alive", "draining"


@dataclass(frozen=True)
class Pool:
    name: str
    shape: np.ndarray  # (R,) int64: what each node offers
    mask: int = 0  # constraints each node has
    low: int = 0
    high: int = 1


def waiting_shapes(
    queues: Iterable[tuple[str, Iterable[TaskSpec]]], ledger: LimitLedger | None = None
) -> list[tuple[str, tuple[int, ...], int, int]]:
    """A GM's waiting tasks as (queue, request, constraint mask, count), sorted.

    With ``ledger`` (the queues' limits and what they hold), the tasks a queue's limit
    holds back are left out: no node would let them run. Of each queue's shapes, in the
    order they first wait, as many tasks are counted as the room left under the limit
    takes. One dict update per task; the limit costs one step per shape, not per task.
    """
    out = []
    for queue, specs in queues:
        shapes: Counter[tuple[bytes, int]] = Counter()
        for spec in specs:
            shapes[(spec.resources.tobytes(), spec.constraint_mask)] += 1
        for (raw, mask), count in shapes.items():
            request = np.frombuffer(raw, dtype=np.int64)
            if ledger is not None:
                count = _room_for(ledger, queue, request, count)
            if count:
                out.append((queue, tuple(request.tolist()), mask, count))
    return sorted(out)


def _room_for(ledger: LimitLedger, queue: str, request: np.ndarray, count: int) -> int:
    """How many of ``count`` tasks asking ``request`` the queue's limit lets run now;
    takes them from the ledger."""
    if ledger.check(queue, request) is not None:
        return 0
    limit, held = ledger.limits.get(queue), ledger.held(queue)
    if limit is not None and held is not None:
        asks = request > 0
        if asks.any():
            count = min(count, int(((limit[asks] - held[asks]) // request[asks]).min()))
    ledger.take(queue, request * count)
    return count


@dataclass(frozen=True)
class PoolDemand:
    """``nodes[p]``: nodes pool p needs for the waiting tasks it was given;
    ``tasks[p]``: how many waiting tasks it was given; ``unplaced``: waiting tasks no pool
    can hold (too big, or constraints no pool has)."""

    nodes: np.ndarray
    tasks: np.ndarray
    unplaced: int


def pool_demand(
    pools: Sequence[Pool],
    shapes: np.ndarray | Sequence[Sequence[int]],
    masks: Sequence[int],
    counts: Sequence[int],
) -> PoolDemand:
    """Waiting tasks, as distinct (shape, constraint mask) rows with a count each, to the
    nodes each pool needs (vectorised over the rows; pools are few)."""
    num_pools = len(pools)
    nodes = np.zeros(num_pools, dtype=np.int64)
    given = np.zeros(num_pools, dtype=np.int64)
    count = np.asarray(counts, dtype=np.int64)
    if count.size == 0 or num_pools == 0:
        return PoolDemand(nodes, given, int(count.sum()))
    need = np.asarray(shapes, dtype=np.int64).reshape(count.size, -1)
    mask = np.asarray(masks, dtype=np.uint64)
    caps = np.stack([p.shape for p in pools]).astype(np.int64)
    pool_masks = np.array([p.mask for p in pools], dtype=np.uint64)
    rank = increasing_order(caps)  # cheapest first
    holds = np.all(need[:, None, :] <= caps[None, rank, :], axis=2)  # (N, P) in rank order
    has = (mask[:, None] & ~pool_masks[None, rank]) == 0
    ok = holds & has
    placed = ok.any(axis=1)
    pool_of = rank[np.argmax(ok, axis=1)]  # the cheapest pool that can run it
    # Tasks of one shape per node: the scarcest dimension decides (0 asks for nothing).
    room = np.where(need > 0, caps[pool_of] // np.maximum(need, 1), np.iinfo(np.int64).max)
    per_node = np.maximum(room.min(axis=1), 1)
    rows = np.flatnonzero(placed)
    np.add.at(nodes, pool_of[rows], -(-count[rows] // per_node[rows]))
    np.add.at(given, pool_of[rows], count[rows])
    return PoolDemand(nodes, given, int(count[~placed].sum()))


@dataclass
class PoolNode:
    """A node the autoscaler started (its process), as last seen."""

    node_id: str
    pool: int
    slot: int
    state: str  # STARTING (not registered yet), ALIVE or DRAINING
    tasks: int = 0
    idle_since: float | None = None  # when it was first seen running nothing
    drained_here: bool = True  # False: drained by someone else, who wants it gone


@dataclass
class ScaleDecision:
    start: list[tuple[int, int]] = field(default_factory=list)  # (pool, slot)
    undrain: list[str] = field(default_factory=list)
    drain: list[str] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.start or self.undrain or self.drain or self.stop)


def busy_nodes(pools: Sequence[Pool], nodes: Sequence[PoolNode]) -> np.ndarray:
    """Nodes of each pool running something (demand that is already met)."""
    busy = np.zeros(len(pools), dtype=np.int64)
    for node in nodes:
        if node.tasks > 0:
            busy[node.pool] += 1
    return busy


def active_nodes(pools: Sequence[Pool], nodes: Sequence[PoolNode]) -> np.ndarray:
    """Nodes of each pool started and not draining (what the pool is allocated)."""
    active = np.zeros(len(pools), dtype=np.int64)
    for node in nodes:
        if node.state != DRAINING:
            active[node.pool] += 1
    return active


def decide(
    pools: Sequence[Pool],
    nodes: Sequence[PoolNode],
    target: Sequence[int],
    now: float,
    idle_s: float,
) -> ScaleDecision:
    """What to do so each pool holds ``target`` nodes, within its bounds."""
    out = ScaleDecision()
    for p, pool in enumerate(pools):
        mine = [n for n in nodes if n.pool == p]
        want = int(min(max(int(target[p]), pool.low), pool.high))
        active = [n for n in mine if n.state != DRAINING]
        draining = sorted(
            (n for n in mine if n.state == DRAINING),
            key=lambda n: (-n.drained_here, -n.tasks, n.slot),
        )
        short = want - len(active)
        if short > 0:
            # Running ones first: they would stay up anyway. Not one an operator drained.
            back = [n for n in draining if n.drained_here][:short]
            out.undrain.extend(n.node_id for n in back)
            short -= len(back)
            used = {n.slot for n in mine}
            free = [s for s in range(pool.high) if s not in used][:short]
            out.start.extend((p, s) for s in free)
            draining = [n for n in draining if n not in back]
        elif short < 0:
            idle = sorted(
                (
                    n
                    for n in active
                    if n.state == ALIVE
                    and n.tasks == 0
                    and n.idle_since is not None
                    and now - n.idle_since >= idle_s
                ),
                key=lambda n: (n.idle_since, -n.slot),
            )
            out.drain.extend(n.node_id for n in idle[:-short])
        out.stop.extend(n.node_id for n in draining if n.tasks == 0)
    return out
