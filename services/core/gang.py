"""Gang (all-or-nothing) planning over the GM's view: every member placed, or none.

    Gang(members, min_tasks, vdc) ──slots──> every usable node of every LM, numbered:
                                             own partitions first (Launch), then the
                                             others' (Repartition), LM by LM
                                  ──Colocate.place──> Packing (member -> slot) | Verdict
                                  ──> GangPlan: one GangPiece per member, grouped by LM
                                      (what each LM is asked to reserve, reservations.py)

Model and assumptions:

- A gang is a job's tasks that start together: all of them (``min_tasks`` 0), or at
  least ``min_tasks`` of them (Volcano's ``minMember``). A plan holds at least that many
  members or does not exist: ``plan_gang`` never returns part of a gang.
- A member may go to any alive node, of any LM and any partition, that satisfies *every*
  member's constraints (the union of their masks): members of one job are alike, and one
  candidate set keeps the packer vectorised. A gang whose members differ in constraints
  is planned as if each needed all of them (conservative: it may wait where a finer
  planner would place it).
- Silent LMs are passed over, as for single tasks; ``OwnerFirst``'s holds are not
  applied (a gang needs room now, on as few nodes as possible).
- Fit is strict (free >= request), whatever the view's policy: GPA's cpu
  oversubscription is not planned for gangs. An LM running GPA validates the pieces
  with its own policy, which may refuse; the gang then waits, it never runs in part.
- With a ``Vdc`` the node's uplink is its ``net_mbps`` (vdc.py says why): each piece
  books its member's uplink share as ``net_mbps``, and the plan carries the whole
  ``VdcLayout`` so that each LM checks its own nodes' uplinks with ``fits_uplinks``,
  the same function the plan was made with.

A GM calls ``plan_gang``; on a ``GangPlan`` it books the plan (``book``) and sends each LM
its pieces (``GangPlan.by_lm``); on a ``Verdict`` it refuses the job (INFEASIBLE) or parks
it with the reason (UNSCHEDULABLE).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from services.core.fairness import FairShare
from services.core.global_view import GlobalView, Placement
from services.core.limits import LimitLedger, QueueLimits
from services.core.match import candidates
from services.core.node_table import bools_from_bits
from services.core.resources import CPU, NUM_RESOURCES
from services.core.status import Schedulability, Verdict
from services.core.task import TaskSpec
from services.core.vdc import Colocate, Packing, Vdc

# A waiting gang (no room, or refused by an LM) is planned again on the next view change,
# or after this long (the GM's ``Gangs`` and the simulator alike).
GANG_RETRY_S = 1.0
# A gang that preempted for itself (``gang_evictions``) does not again for this long: its
# victims' room frees as their kills take effect; meanwhile it is planned on every view
# change.
GANG_EVICT_S = 5.0


class GangError(ValueError):
    """A gang is malformed; the message says why."""


@dataclass(frozen=True, slots=True, eq=False)
class Gang:
    """A job's tasks that start all together (``min_tasks`` 0) or at least ``min_tasks``
    of them; with ``vdc``, a Gridiron VDC whose vlinks must fit the uplinks."""

    gang_id: str
    members: tuple[TaskSpec, ...]
    min_tasks: int = 0
    vdc: Vdc | None = None

    def __post_init__(self) -> None:
        if not self.gang_id:
            raise GangError("a gang needs a gang_id (the job's id will do)")
        if not self.members:
            raise GangError(f"gang {self.gang_id} has no members")
        ids = [m.task_id for m in self.members]
        if len(set(ids)) != len(ids):
            raise GangError(f"gang {self.gang_id} names a task twice")
        if not 0 <= self.min_tasks <= len(self.members):
            raise GangError(
                f"gang {self.gang_id}: min_tasks {self.min_tasks} is not in "
                f"0..{len(self.members)} (0: all its tasks)"
            )

    @property
    def needed(self) -> int:
        """How many members must start together."""
        return self.min_tasks or len(self.members)

    @property
    def constraint_mask(self) -> int:
        mask = 0
        for member in self.members:
            mask |= member.constraint_mask
        return mask


@dataclass(frozen=True, slots=True)
class VdcLayout:
    """Where every member of a VDC gang goes, as the LMs need it to check their uplinks:
    members' cpu and their slots (``NOT_PLACED`` for a member left out); a slot number
    means nothing beyond "the same node" (an LM maps its own through its pieces)."""

    vdc: Vdc
    cpu_milli: np.ndarray
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class GangPiece:
    """One member's place: ``task`` carries the vector to book (with a VDC its
    ``net_mbps`` is the member's uplink share); ``member`` indexes ``VdcLayout``."""

    member: int
    task: TaskSpec
    lm_id: str
    node: int
    node_id: str
    repartition: bool

    @property
    def placement(self) -> Placement:
        return Placement(self.lm_id, self.node, self.node_id, self.repartition)


@dataclass(frozen=True, slots=True)
class GangPlan:
    gang_id: str
    pieces: tuple[GangPiece, ...]
    layout: VdcLayout | None = None

    def by_lm(self) -> dict[str, list[GangPiece]]:
        """The pieces each LM is asked to reserve, LMs in name order."""
        out: dict[str, list[GangPiece]] = {}
        for piece in sorted(self.pieces, key=lambda p: (p.lm_id, p.member)):
            out.setdefault(piece.lm_id, []).append(piece)
        return out


@dataclass(slots=True)
class _Slots:
    """Every node the gang may use, numbered: (lm, row, repartition) per slot."""

    lm_ids: list[str]
    rows: np.ndarray
    repartition: np.ndarray
    free: np.ndarray  # (NUM_RESOURCES, K)
    capacity: np.ndarray  # (NUM_RESOURCES, K)


def _slots(view: GlobalView, mask: int, now: float | None, alive_only: bool) -> _Slots:
    lm_ids: list[str] = []
    rows, parts, free, capacity = [], [], [], []
    # Own partitions first: ties in the packer go to the lowest slot, so a gang takes
    # Launch room before it repartitions another GM's.
    for internal in (True, False):
        for lm_id in sorted(view.lms):
            lm = view.lms[lm_id]
            within = lm.internal if internal else lm.external
            if within is None or (now is not None and view.silent(lm_id, now)):
                continue
            cand = candidates(lm.table, mask, within, alive_only=alive_only)
            idx = np.flatnonzero(bools_from_bits(cand)) if len(cand) else np.zeros(0, int)
            if not len(idx):
                continue
            lm_ids.extend([lm_id] * len(idx))
            rows.append(idx)
            parts.append(np.full(len(idx), not internal))
            free.append(lm.table.free[:, idx])
            capacity.append(lm.table.capacity[:, idx])
    if not rows:
        empty = np.zeros((NUM_RESOURCES, 0), dtype=np.int64)
        return _Slots([], np.zeros(0, np.int64), np.zeros(0, bool), empty, empty)
    return _Slots(
        lm_ids,
        np.concatenate(rows),
        np.concatenate(parts),
        np.concatenate(free, axis=1),
        np.concatenate(capacity, axis=1),
    )


def limit_gang(gang: Gang, queue: str, ledger: LimitLedger | None) -> Gang | Verdict:
    """The members of ``gang`` (of ``queue``) that its queue's limit lets start now: all
    of them, the first ones of a ``min_tasks`` gang (the rest start one by one later,
    each within the limit), or a Verdict (UNSCHEDULABLE, with the ledger's reason) when
    fewer than ``gang.needed`` fit what the queue holds. Members are taken in order, as
    the packer places them; the whole plan is then booked at once, so the next round's
    ledger counts it."""
    limit = ledger.limits.get(queue) if ledger is not None else None
    if ledger is None or limit is None:
        return gang
    if ledger.unknown is not None:
        return Verdict(Schedulability.UNSCHEDULABLE, ledger.unknown)
    held = ledger.held(queue)
    assert held is not None  # every limited queue has a row
    requests = np.stack([m.resources for m in gang.members]).astype(np.int64)
    fits = np.all(np.cumsum(requests, axis=0) <= limit - held, axis=1)
    k = len(fits) if fits.all() else int(np.argmin(fits))
    if k < gang.needed:
        why = ledger.check(queue, requests[: gang.needed].sum(axis=0))
        return Verdict(Schedulability.UNSCHEDULABLE, f"{gang.needed} tasks together: {why}")
    return gang if k == len(gang.members) else replace(gang, members=gang.members[:k])


def gang_never_fits(gang: Gang, queue: str, limits: QueueLimits) -> str | None:
    """Why ``gang`` can never start in ``queue`` however little the queue holds: the
    ``needed`` smallest requests, resource by resource, add up past its limit (a bound:
    a gang whose members differ may still never fit, and then waits), or None."""
    if queue not in limits:
        return None
    requests = np.stack([m.resources for m in gang.members]).astype(np.int64)
    least = np.sort(requests, axis=0)[: gang.needed].sum(axis=0)
    why = limits.never_fits(queue, least)
    if why is None:
        return None
    return f"the {gang.needed} tasks that start together ask {why[len('it asks ') :]}"


def plan_gang(
    gang: Gang,
    view: GlobalView,
    now: float | None = None,
    policy: Colocate | None = None,
    judge_never: bool = True,
    held: Sequence[tuple[str, str]] = (),
) -> GangPlan | Verdict:
    """Every member of ``gang`` on a node of ``view`` (at least ``gang.needed`` of them),
    or a ``Verdict`` saying why not: UNSCHEDULABLE (wait) or INFEASIBLE (never).

    Without ``judge_never`` a gang that does not fit now is UNSCHEDULABLE without asking
    whether it ever could (a second packing over every node): for a caller that judged
    it at submission and retries it on every view change. ``held``: (lm_id, placeholder
    id) of the room LMs hold for this gang's job (``room_id``: its preemption's victims
    left it), counted free for it."""
    policy = policy or Colocate()
    requests = np.stack([m.resources for m in gang.members]).astype(np.int64)
    usable = _slots(view, gang.constraint_mask, now, alive_only=True)
    if held and len(usable.rows):
        _count_held(view, usable, held)

    def every() -> np.ndarray:
        # "Never" is judged on every node that could ever take the gang, dead ones too,
        # as ``assess`` does for a task: a dead node may come back.
        return _slots(view, gang.constraint_mask, None, alive_only=False).capacity

    if not len(usable.rows):
        if judge_never and every().shape[1] == 0:
            return Verdict(
                Schedulability.INFEASIBLE,
                "no node has every constraint the gang's members need"
                if gang.constraint_mask
                else "no worker node has registered",
            )
        return Verdict(Schedulability.UNSCHEDULABLE, "no alive node of a heard LM can take it")
    capacity = every if judge_never else None
    outcome = policy.place(requests, usable.free, capacity, gang.vdc, gang.needed)
    if isinstance(outcome, Verdict):
        return outcome
    return _plan(gang, view, usable, outcome)


def _count_held(view: GlobalView, slots: _Slots, held: Sequence[tuple[str, str]]) -> None:
    """Add to ``slots.free`` the room the view shows held for the gang (placeholders
    that the gang's reserve releases before it books its pieces)."""
    pairs = zip(slots.lm_ids, slots.rows.tolist(), strict=True)
    slot_of = {(lm_id, row): k for k, (lm_id, row) in enumerate(pairs)}
    for lm_id, holder_id in held:
        lm = view.lms.get(lm_id)
        allocation = None if lm is None else lm.allocations.get(holder_id)
        slot = None if allocation is None else slot_of.get((lm_id, allocation.node))
        if slot is not None:
            slots.free[:, slot] += allocation.resources


def _plan(gang: Gang, view: GlobalView, slots: _Slots, packing: Packing) -> GangPlan:
    pieces = []
    for member in np.flatnonzero(packing.slots >= 0).tolist():
        slot = int(packing.slots[member])
        lm_id, row = slots.lm_ids[slot], int(slots.rows[slot])
        task = gang.members[member]
        booked = packing.booked[member]
        if not np.array_equal(booked, task.resources):
            task = replace(task, resources=booked.copy())
        node_id = view.lms[lm_id].table.node_ids[row]
        pieces.append(GangPiece(member, task, lm_id, row, node_id, bool(slots.repartition[slot])))
    layout = None
    if gang.vdc is not None:
        # Slot numbers are the GM's; an LM only compares them for equality.
        cpu = np.array([m.resources[CPU] for m in gang.members], dtype=np.int64)
        layout = VdcLayout(gang.vdc, cpu, packing.slots.copy())
    return GangPlan(gang.gang_id, tuple(pieces), layout)


def book(view: GlobalView, plan: GangPlan, now: float | None = None) -> None:
    """The GM's optimistic deduction of a whole plan (``GlobalView.reserve`` per piece)."""
    for piece in plan.pieces:
        view.reserve(piece.placement, piece.task, now)


def unbook(view: GlobalView, plan: GangPlan, pieces: Sequence[GangPiece] | None = None) -> None:
    """Undo ``book`` (an LM refused its part: the whole gang is released everywhere)."""
    for piece in plan.pieces if pieces is None else pieces:
        view.release(piece.lm_id, piece.task.task_id)


@dataclass(frozen=True, slots=True)
class Eviction:
    """Victims whose room lets a waiting gang start whole: (lm_id, task_id, attempt),
    youngest first, all of ``queue``."""

    queue: str
    victims: tuple[tuple[str, str, int], ...]


def gang_evictions(
    gang: Gang,
    queue: str,
    view: GlobalView,
    fair: FairShare,
    pledged: frozenset[str] | set[str] = frozenset(),
    now: float | None = None,
) -> Eviction | str:
    """Alg. 2 for a gang that found no room: whom to preempt so that it starts whole, or
    why not. The gang is one unit: its queue must be under its share by more than the
    slack (``may_preempt``) and stay within its share with all the members that start
    together running; victims come from the queue most over its share only, never a
    gang's (no half gang is preempted), and no more of them than keep that queue at or
    above its own share; node by node (the most candidates first), youngest first on
    each, so the room concentrates where a packing gang wants it. Victims are tasks a
    snapshot showed running, not ``pledged`` (another preemption's) nor this GM's
    launches not shown yet; none on a silent LM. Cost: one packing per victim added
    (``Colocate.place``)."""
    usage, total = view.queue_usage(), view.total_capacity()
    if not fair.may_preempt(queue, usage, total):
        return f"queue {queue} is {fair.describe(queue, usage, total)}"
    requests = np.stack([m.resources for m in gang.members]).astype(np.int64)
    least = np.sort(requests, axis=0)[: gang.needed].sum(axis=0)
    held = usage.get(queue, np.zeros(NUM_RESOURCES, dtype=np.int64))
    if fair.is_over_share(queue, {**usage, queue: held + least}, total):
        return f"its {gang.needed} tasks together would take queue {queue} over its share"
    victim_queue = fair.most_over_share(usage, total, exclude=queue)
    if victim_queue is None:
        return "no queue is over its share"
    slots = _slots(view, gang.constraint_mask, now, alive_only=True)
    pairs = zip(slots.lm_ids, slots.rows.tolist(), strict=True)
    slot_of = {(lm_id, row): k for k, (lm_id, row) in enumerate(pairs)}
    candidates = []
    for lm_id in sorted(view.lms):
        if now is not None and view.silent(lm_id, now):
            continue
        lmv = view.lms[lm_id]
        for a in lmv.allocations.values():
            slot = slot_of.get((lm_id, a.node))
            if (
                slot is not None
                and a.queue == victim_queue
                and not a.gang
                and a.task_id not in pledged
                and a.task_id not in lmv.evicted
                and a.task_id not in lmv.inflight
            ):
                candidates.append((slot, -a.sequence, lm_id, a))
    # Node by node, the one with the most candidates first (room concentrates: fewer
    # nodes, fewer victims for a gang that packs), youngest first on each.
    per_slot = Counter(c[0] for c in candidates)
    candidates.sort(key=lambda c: (-per_slot[c[0]], c[0], c[1]))
    free = slots.free.copy()
    left = usage.get(victim_queue, np.zeros(NUM_RESOURCES, dtype=np.int64)).copy()
    policy, victims = Colocate(), []
    for slot, _, lm_id, a in candidates:
        left = left - a.resources
        if fair.is_under_share(victim_queue, {**usage, victim_queue: left}, total):
            break  # no deeper than the victims' own share
        free[:, slot] += a.resources
        victims.append((lm_id, a.task_id, a.attempt))
        if isinstance(policy.place(requests, free, None, gang.vdc, gang.needed), Packing):
            return Eviction(victim_queue, tuple(victims))
    return (
        f"no room for its {gang.needed} tasks together even after preempting queue "
        f"{victim_queue} down to its share"
    )
