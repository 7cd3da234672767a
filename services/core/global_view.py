"""The GM's eventually-consistent view of every LM, and placement over it (paper Alg. 1).

    heartbeats / replies ──apply──> LMView per LM ──match──> Placement(lm, node, kind)
                                     (NodeTable,            internal partitions round-robin,
                                      allocations)          then external ones (repartition)

The view is rebuilt from LM snapshots alone, so a GM can be killed and restarted at any
time. After a launch it deducts the task optimistically (``reserve``); the LM's next
state overwrites the deduction with the truth either way.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
from bitarray import bitarray
from bitarray.util import ones

from services.core.constraints import DEFAULT_NUM_CONSTRAINTS
from services.core.contention import (
    OWNER_GRACE_S,
    Backlog,
    OldestFirst,
    OwnerFirst,
    Run,
    contention_rule,
)
from services.core.fairness import FairShare, Victims, pick_victims
from services.core.gpa import task_usage
from services.core.match import NO_NODE, FirstFit, PlacementPolicy, assess, match
from services.core.node_table import NodeTable
from services.core.resources import CPU, NUM_RESOURCES
from services.core.snapshot import Allocation, Snapshot
from services.core.status import Schedulability, Verdict
from services.core.task import TaskSpec


class ApplyResult(enum.Enum):
    APPLIED = "applied"
    STALE = "stale"  # not newer than the view: ignored
    NEEDS_FULL = "needs_full"  # a delta whose base the view has not reached: ask GetState


@dataclass(frozen=True, slots=True)
class Placement:
    lm_id: str
    node: int
    node_id: str
    repartition: bool  # True: the node belongs to another GM's partition


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    lm_id: str
    node_id: str
    victims: Victims


_FOLD_AFTER = 4096  # changes a queue's pending sums keep before they are folded anyway


class HeldAllocations(dict[str, Allocation]):
    """Task id -> ``Allocation``, keeping what each queue holds up to date as tasks come
    and go once it has been asked for, so the queues' usage costs O(queues), not
    O(tasks): a GM with a queue limit asks for it every scheduling round
    (``LimitLedger``), fairness on every preemption. Until first asked (a GM with neither
    limits nor shares may never ask: then the sums would cost a tenth of a simulation,
    issue 29), nothing is summed; the first ask sums every allocation once.

    Only ``[]=``, ``del``, ``pop`` and ``clear`` change it (the rest of dict's mutators
    would bypass the sums and raise).
    """

    __slots__ = ("_count", "_held", "_pending", "_summed")

    def __init__(self, allocations: Iterable[Allocation] = ()):
        super().__init__()
        self._summed = False  # whether the sums below are kept (since ``held`` was read)
        self._held: dict[str, np.ndarray] = {}  # queue -> resources, as of the last fold
        self._count: dict[str, int] = {}
        # Queue -> resources of the allocations added and of those taken away since the
        # last fold: summed in one numpy call when ``held`` is read (a GM reads it once a
        # round at most, a view changes it for every task a snapshot names: adding each
        # 4-vector at once cost more than the rest of applying a heartbeat).
        self._pending: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for allocation in allocations:
            dict.__setitem__(self, allocation.task_id, allocation)

    @property
    def held(self) -> dict[str, np.ndarray]:
        """Queue -> the resources its allocations hold (only queues holding some)."""
        if not self._summed:
            self._summed = True
            for allocation in self.values():
                self._add(allocation)
        if self._pending:
            self._fold()
        return self._held

    def _fold(self) -> None:
        held = self._held
        for queue, (added, taken) in self._pending.items():
            total = np.add.reduce(added, dtype=np.int64) if added else None
            if taken:
                total = (0 if total is None else total) - np.add.reduce(taken, dtype=np.int64)
            if queue in held:
                held[queue] += total
            else:
                held[queue] = np.asarray(total, dtype=np.int64)
        self._pending.clear()

    def _add(self, allocation: Allocation) -> None:
        queue = allocation.queue
        self._count[queue] = self._count.get(queue, 0) + 1
        self._pend(queue, 0, allocation.resources)

    def _sub(self, allocation: Allocation) -> None:
        queue = allocation.queue
        if self._count[queue] == 1:  # its last: it holds nothing now
            del self._count[queue]
            self._held.pop(queue, None)
            self._pending.pop(queue, None)
            return
        self._count[queue] -= 1
        self._pend(queue, 1, allocation.resources)

    def _pend(self, queue: str, side: int, resources: np.ndarray) -> None:
        """``resources`` join ``queue``'s pending sums: added (side 0) or taken (1)."""
        pending = self._pending.get(queue)
        if pending is None:
            pending = self._pending[queue] = ([], [])
        pending[side].append(resources)
        if len(pending[side]) > _FOLD_AFTER:
            self._fold()

    def __setitem__(self, task_id: str, allocation: Allocation) -> None:
        if not self._summed:
            dict.__setitem__(self, task_id, allocation)
            return
        old = dict.get(self, task_id)
        if old is allocation:
            return
        if old is not None:
            self._sub(old)
        dict.__setitem__(self, task_id, allocation)
        self._add(allocation)

    def __delitem__(self, task_id: str) -> None:
        allocation = dict.pop(self, task_id)
        if self._summed:
            self._sub(allocation)

    _MISSING = object()

    def pop(self, task_id: str, default=_MISSING):  # type: ignore[override]
        if task_id in self:
            allocation = dict.pop(self, task_id)
            if self._summed:
                self._sub(allocation)
            return allocation
        if default is HeldAllocations._MISSING:
            raise KeyError(task_id)
        return default

    def clear(self) -> None:
        dict.clear(self)
        self._held.clear()
        self._count.clear()
        self._pending.clear()

    def _refuse(self, *_args, **_kwargs):
        raise TypeError("HeldAllocations changes only through []=, del, pop and clear")

    update = setdefault = popitem = __ior__ = _refuse  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class Ended:
    """A task whose end a lifecycle event told this GM before a snapshot did."""

    attempt: int
    since: float | None  # when this GM heard it (None: never expires)
    # Its allocation as a snapshot showed it running; None if none did.
    shown: Allocation | None = None
    # A launch of this GM's that no snapshot showed: a full snapshot without it may have
    # been taken before the LM launched it, so only an end the LM names confirms it.
    booked_here: bool = False


@dataclass(slots=True, eq=False)
class LMView:
    """What one GM believes about one LM."""

    lm_id: str
    gm_ids: tuple[str, ...]
    table: NodeTable
    version: int
    partition: int | None  # this GM's partition in the LM, None if the LM doesn't know us
    updated_at: float
    incarnation: int = 0  # the LM's life that ``version`` counts in (Snapshot.incarnation)
    restarted_at: float | None = None  # when this GM first heard of this life, if not the first
    allocations: HeldAllocations = field(default_factory=HeldAllocations)
    internal: bitarray | None = None
    external: bitarray | None = None
    # What this GM knows that a snapshot may predate (see GlobalView._reconcile), with
    # when it learnt it: launches it sent that no snapshot showed yet, and tasks that
    # ended (lifecycle event) before a snapshot confirmed it.
    inflight: dict[str, tuple[Allocation, float | None]] = field(default_factory=dict)
    ended: dict[str, Ended] = field(default_factory=dict)
    # Of ``inflight``, the launches the LM has not answered yet (``GlobalView.accepted``).
    unanswered: set[str] = field(default_factory=set)
    # Preemptions this GM asked for: the preempting task's id -> its victims' ids, and
    # each victim's id -> (the preempting task's id, the victim's room the task was
    # booked into). See ``GlobalView.reserve_preemption``.
    evicting: dict[str, tuple[str, ...]] = field(default_factory=dict)
    evicted: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)
    # Shapes that found no node here while ``miss_table`` stood at ``miss_version`` and
    # the holds at ``miss_epoch``: matching them again before one changes would find
    # none again (an overloaded federation otherwise re-scans every full partition for
    # every task).
    misses: set[tuple] = field(default_factory=set)
    miss_table: NodeTable | None = None
    miss_version: int = -1
    miss_epoch: int = 0  # of the holds (``OwnerFirst.epoch``)

    def queue_usage(self) -> dict[str, np.ndarray]:
        """Resources held per queue on this LM (the view's own arrays: do not change)."""
        return self.allocations.held

    def refresh_masks(self) -> None:
        self.misses.clear()
        if self.partition is None:
            self.internal, self.external = None, ones(self.table.size, endian="big")
        else:
            self.internal = self.table.members[self.partition]
            self.external = ~self.internal


# How long a GM trusts its own news (a launch sent, an end heard) that no LM snapshot has
# confirmed yet; past it the LM's books win. Far longer than any reply or heartbeat.
KNOWLEDGE_TTL_S = 30.0


_FEASIBLE_CACHE = 4096  # shapes remembered by GlobalView.infeasible

# An LM a GM has not heard from (heartbeat or reply) for this many heartbeat intervals is
# silent: dead, cut off, or its heartbeats lost. Its nodes take no placements until it is
# heard again, and ``megha status`` does not count their room. Not less than
# ``SILENT_AFTER_MIN_S``, so that a GM whose own loop was busy for a moment (a burst of
# submissions) does not take every LM for silent.
SILENT_AFTER_HEARTBEATS = 5
SILENT_AFTER_MIN_S = 2.0


def silent_after(heartbeat_interval_s: float) -> float:
    """How long an LM may say nothing before a GM takes it for silent."""
    return max(SILENT_AFTER_HEARTBEATS * heartbeat_interval_s, SILENT_AFTER_MIN_S)


def _expired(since: float | None, now: float) -> bool:
    return since is not None and now - since > KNOWLEDGE_TTL_S


class GlobalView:
    """Every LM's nodes as this GM last heard of them."""

    def __init__(
        self,
        gm_id: str,
        policy: PlacementPolicy | None = None,
        num_constraints: int = DEFAULT_NUM_CONSTRAINTS,
        constraint_labels: Mapping[int, str] | None = None,
        silent_after_s: float = math.inf,
        owner_grace_s: float = OWNER_GRACE_S,
        claims: str = "owner",
    ):
        """``owner_grace_s``: room an end freed is left to the GM with the first claim
        on it for this long before this one takes it (0: no rule). ``claims``: who has
        that claim (``services.core.contention.CLAIMS``): the node's ``owner``
        (``OwnerFirst``) or the GM whose work waited longest (``oldest``,
        ``OldestFirst``: fed by ``backlog``)."""
        self.gm_id = gm_id
        self.silent_after_s = silent_after_s  # see ``silent``
        self.owner_first: OwnerFirst | None = contention_rule(claims, gm_id, owner_grace_s)
        self.policy: PlacementPolicy = policy or FirstFit()
        self.num_constraints = num_constraints
        self.constraint_labels = dict(constraint_labels or {})  # id -> name, for reasons
        self.lms: dict[str, LMView] = {}
        self._order: list[str] = []
        # Shape -> why it can never run (None: it can), valid while no LM's nodes,
        # capacities or constraints change (``_feasible_at``).
        self._feasible: dict[tuple[int, bytes], str | None] = {}
        self._feasible_at: tuple = ()
        self._capacity = np.zeros(NUM_RESOURCES, dtype=np.int64)  # ``total_capacity``
        self._capacity.flags.writeable = False
        self._capacity_at: tuple = ()
        self._rr_internal = 0
        self._rr_external = 0

    # -------------------------------------------------------------- updates
    def apply(self, snapshot: Snapshot, now: float) -> ApplyResult:
        """Fold an LM snapshot (heartbeat or reply) into the view."""
        view = self.lms.get(snapshot.lm_id)
        if view is not None and snapshot.incarnation != view.incarnation:
            # The LM restarted: its versions count from zero again, and its books (node
            # rows, tasks) are new. A late message of its earlier life changes nothing.
            if snapshot.incarnation < view.incarnation:
                return ApplyResult.STALE
            if not snapshot.full:
                return ApplyResult.NEEDS_FULL
            if self.owner_first is not None:
                self.owner_first.forget(snapshot.lm_id)
            self._apply_full(snapshot, now)
            return ApplyResult.APPLIED
        if view is not None and snapshot.version <= view.version:
            if snapshot.version == view.version:
                view.updated_at = now  # nothing changed, but the LM is alive and current
                if snapshot.full and self._outlived(view, now):
                    # What this GM learnt expires only as a snapshot is applied, and an
                    # LM whose books no longer change sends none newer: a launch whose
                    # end event was lost (a retry, which a snapshot's ends by task id
                    # do not settle) stayed booked for good (chaos-sim --seed 6005).
                    # The full state at the view's own version is the LM's books now.
                    self._apply_full(snapshot, now)
                    return ApplyResult.APPLIED
            return ApplyResult.STALE
        if snapshot.full:
            heard = []
            if view is not None:
                listed = {a.task_id for a in snapshot.allocations}
                gone = (t for t in view.allocations if t not in listed and t not in view.inflight)
                heard = self._first_heard(view, gone)
            self._apply_full(snapshot, now)
            if self.owner_first is not None:
                self.owner_first.seen(snapshot.lm_id, None)
            self._claim(self.lms[snapshot.lm_id], heard, now)
            return ApplyResult.APPLIED
        if view is None or view.version < snapshot.base_version:
            return ApplyResult.NEEDS_FULL
        heard = self._first_heard(view, snapshot.ended_task_ids)
        if len(snapshot.nodes):
            view.table.set_columns(snapshot.nodes)
            view.refresh_masks()
        view.table.set_free(
            snapshot.free_indices, snapshot.free, snapshot.usage_mean, snapshot.usage_var
        )
        for task_id in snapshot.ended_task_ids:
            view.allocations.pop(task_id, None)
        for allocation in snapshot.allocations:
            view.allocations[allocation.task_id] = allocation
        view.version = snapshot.version
        view.updated_at = now
        self._reconcile(view, snapshot, now)
        if self.owner_first is not None:
            self.owner_first.seen(snapshot.lm_id, snapshot.free_indices)
        self._claim(view, heard, now)
        return ApplyResult.APPLIED

    @staticmethod
    def _outlived(view: LMView, now: float) -> bool:
        """Whether the view keeps knowledge past ``KNOWLEDGE_TTL_S`` (a launch no
        snapshot showed, an end none confirmed): the next snapshot applied drops it."""
        return any(_expired(since, now) for _, since in view.inflight.values()) or any(
            _expired(end.since, now) for end in view.ended.values()
        )

    def _first_heard(self, view: LMView, ended: Iterable[str]) -> list[Allocation]:
        """Of the tasks a snapshot shows ended, those whose end this GM hears of first
        there (not by event): their claims count (``OldestFirst``; live, a heartbeat
        often comes before the event)."""
        rule = self.owner_first
        if not isinstance(rule, OldestFirst):
            return []
        heard = []
        for task_id in ended:
            known = view.allocations.get(task_id)
            if known is not None and rule.first_heard(task_id, known.attempt):
                heard.append(known)
        return heard

    def _claim(self, view: LMView, heard: list[Allocation], now: float) -> None:
        """Count the claims of ends first heard in a snapshot (``_first_heard``), after
        its ``seen``: no GM had a chance at these nodes yet, so they are held as an
        event's would be."""
        rule = self.owner_first
        for ended in heard:
            assert rule is not None
            self._hold(view, ended.node, rule.claimant(ended.queue), now)

    def _hold(self, view: LMView, node: int, claimant: str | None, now: float) -> bool:
        """Room an end freed on ``node``: held for the GM it is for (True), or this GM's
        to take now, a hold it kept there for another GM ending (``OwnerFirst.mine``)."""
        rule = self.owner_first
        assert rule is not None
        if not self._mine(view, node, claimant):
            rule.freed(view.lm_id, view.table.size, node, now)
            return True
        rule.mine(view.lm_id, node)
        return False

    def _mine(self, view: LMView, node: int, claimant: str | None) -> bool:
        """Whether room freed on ``node`` is this GM's to take now: the claimant's, or
        with none named, the node's owner's."""
        if claimant is not None:
            return claimant == self.gm_id
        return view.internal is not None and bool(view.internal[node])

    def _reconcile(self, view: LMView, snapshot: Snapshot, now: float) -> None:
        """Re-apply what this GM learnt after the LM took ``snapshot``.

        A snapshot's free columns are absolute values as of its version. If it predates a
        launch this GM sent, it undoes the optimistic deduction: book the launch again on
        the nodes it overwrote. If it predates the end of a task this GM already heard of,
        it resurrects the task: drop it again and credit its node. Each entry leaves when
        a snapshot confirms it (or after ``KNOWLEDGE_TTL_S``, for an answer that never
        came), so the view converges to the LM's books. Ends are credited before launches
        are booked again: a launch may have been booked into the room of a task that ended.
        """
        if not view.inflight and not view.ended:
            return
        touched = np.zeros(view.table.size, dtype=bool)
        touched[snapshot.free_indices] = True
        shown = {a.task_id: a for a in snapshot.allocations}
        gone = set(snapshot.ended_task_ids)
        table = view.table
        for task_id, end in list(view.ended.items()):
            unlisted = snapshot.full and task_id not in shown and not end.booked_here
            if task_id in gone or unlisted or _expired(end.since, now):
                del view.ended[task_id]  # the snapshot's books stand
                continue
            seen = view.allocations.get(task_id)
            if seen is not None and seen.attempt <= end.attempt:
                # The snapshot lists it running: it predates the end. Later deltas that
                # predate it too will count it on this node without naming it.
                del view.allocations[task_id]
                view.ended[task_id] = Ended(end.attempt, end.since, seen)
            elif seen is None and end.shown is not None and not snapshot.full:
                # A delta lists only the tasks that started after its base: one that
                # started before still counts on its node, though the delta does not
                # name it, as long as the delta does not say it ended.
                seen = end.shown
            else:
                continue
            if touched[seen.node]:
                table.give_back(seen.node, seen.resources, seen.usage_mean, seen.usage_var)
        for task_id, (allocation, since) in list(view.inflight.items()):
            seen = shown.get(task_id)
            confirmed = seen is not None and seen.attempt >= allocation.attempt
            # A snapshot names ends by task id alone: for a retry the end it names may be
            # an earlier attempt's (a preempted victim's, placed again at once), so only
            # the retry's own end event (``release``) or a snapshot showing it settles it.
            ended_there = task_id in gone and allocation.attempt == 0
            if confirmed or ended_there or _expired(since, now):
                del view.inflight[task_id]
                view.unanswered.discard(task_id)
                self._end_eviction(view, task_id, allocation, restore=False)
                if not confirmed and not ended_there:
                    view.allocations.pop(task_id, None)
                continue
            view.allocations[task_id] = allocation
            if touched[allocation.node]:
                # The snapshot predates the preemption too: its victims are on the node.
                for _victim, room in self._victims(view, task_id, allocation.node):
                    table.give_back(allocation.node, room, 0.0, 0.0)
                table.take(
                    allocation.node,
                    allocation.resources,
                    allocation.usage_mean,
                    allocation.usage_var,
                )

    def _apply_full(self, snapshot: Snapshot, now: float) -> None:
        table = NodeTable(len(snapshot.gm_ids), snapshot.num_constraints)
        table.set_columns(snapshot.nodes)
        table.set_free(
            snapshot.free_indices, snapshot.free, snapshot.usage_mean, snapshot.usage_var
        )
        gm_ids = tuple(snapshot.gm_ids)
        view = LMView(
            lm_id=snapshot.lm_id,
            gm_ids=gm_ids,
            table=table,
            version=snapshot.version,
            partition=gm_ids.index(self.gm_id) if self.gm_id in gm_ids else None,
            updated_at=now,
            allocations=HeldAllocations(snapshot.allocations),
            incarnation=snapshot.incarnation,
        )
        view.refresh_masks()
        old = self.lms.get(snapshot.lm_id)
        if old is None:
            self._order = sorted([*self._order, snapshot.lm_id])
        elif old.incarnation == snapshot.incarnation:
            view.inflight, view.ended, view.unanswered = old.inflight, old.ended, old.unanswered
            view.evicting, view.evicted = old.evicting, old.evicted
            view.restarted_at = old.restarted_at
        else:
            # What this GM learnt about an earlier life (its node rows may now be other
            # nodes) would only corrupt the new books; launches still out are answered.
            view.restarted_at = now
        self.lms[snapshot.lm_id] = view
        self._reconcile(view, snapshot, now)

    def restarted(self, now: float, within_s: float) -> list[str]:
        """The LMs that restarted less than ``within_s`` ago: their workers may still be
        registering again, so their nodes are not all in the view yet."""
        return sorted(
            lm_id
            for lm_id, view in self.lms.items()
            if view.restarted_at is not None and now - view.restarted_at < within_s
        )

    def silent(self, lm_id: str, now: float) -> bool:
        """Whether this GM has heard nothing from ``lm_id`` for longer than
        ``silent_after_s``: its nodes are not matched, nor its tasks preempted, until it
        is heard again (what the view holds of it is kept, as it may come back)."""
        return now - self.lms[lm_id].updated_at > self.silent_after_s

    def forget(self, lm_id: str) -> None:
        """Drop an LM (gone silent for too long); its nodes take no more placements."""
        if self.lms.pop(lm_id, None) is not None:
            self._order.remove(lm_id)
            if self.owner_first is not None:
                self.owner_first.forget(lm_id)

    def reserve(self, placement: Placement, task: TaskSpec, now: float | None = None) -> None:
        """Optimistic deduction after deciding a placement; kept until a snapshot shows
        the launch (``now`` dates it, so an answer that never came expires)."""
        view = self.lms[placement.lm_id]
        earlier = view.allocations.get(task.task_id)
        if earlier is not None and earlier.attempt < task.attempt:
            # An earlier attempt the view still books here (its end not heard yet, or
            # heard by task id alone, which does not settle a retry): the LM ended it
            # before this one was queued, or replaces it when it accepts this one. Its
            # room is given back now: overwritten, it would stay booked for good where
            # the LM's books do not change again (chaos-sim --seed 101241).
            self._release(placement.lm_id, task.task_id, False, earlier.attempt, now, "", None)
        usage_mean, usage_var = task_usage(task)
        view.table.take(placement.node, task.resources, usage_mean, usage_var)
        allocation = view.allocations[task.task_id] = Allocation(
            task_id=task.task_id,
            queue=task.queue,
            node=placement.node,
            resources=task.resources.copy(),
            partition=view.partition if view.partition is not None else -1,
            logical=placement.repartition,
            sequence=0,
            attempt=task.attempt,
            version=view.version,
            usage_mean=usage_mean,
            usage_var=usage_var,
            gang=task.gang,
        )
        view.inflight[task.task_id] = (allocation, now)
        view.unanswered.add(task.task_id)

    def reserve_preemption(
        self, plan: PreemptionPlan, task: TaskSpec, now: float | None = None
    ) -> None:
        """``reserve`` for a task that preempts ``plan``'s victims, booked into their room.

        Booking it on top of them would count the node's room twice (its free goes below
        zero until the LM answers). The room the task takes comes from its victims first
        (they stay booked to their queue until the LM kills them), so what the node shows
        free is free whatever the LM answers: the rest of the victims' room is offered
        once a snapshot shows them gone. If the LM refuses, ``release`` of the task gives
        their room back to them. Their CPU usage (GPA) stays on the node meanwhile.
        """
        view = self.lms[plan.lm_id]
        node = plan.victims.node
        need = task.resources.astype(np.int64)  # a copy
        evicted = []
        for victim_id in plan.victims.task_ids:
            victim = view.allocations.get(victim_id)
            if victim is None or victim.node != node or victim_id in view.evicted:
                continue  # already gone, or already booked for another preemption
            room = np.minimum(victim.resources, need)
            need -= room
            view.table.give_back(node, room, 0.0, 0.0)
            view.evicted[victim_id] = (task.task_id, room)
            evicted.append(victim_id)
        view.evicting[task.task_id] = tuple(evicted)
        self.reserve(Placement(plan.lm_id, node, plan.node_id, False), task, now)

    def _victims(
        self, view: LMView, task_id: str, node: int
    ) -> Iterator[tuple[Allocation, np.ndarray]]:
        """The victims of ``task_id``'s preemption still booked on ``node`` in the view,
        each with the room of it the task was booked into."""
        for victim_id in view.evicting.get(task_id, ()):
            victim = view.allocations.get(victim_id)
            evicted = view.evicted.get(victim_id)
            if evicted is None or evicted[0] != task_id or victim is None:
                continue
            if victim.node == node:
                yield victim, evicted[1]

    def _end_eviction(
        self, view: LMView, task_id: str, booked: Allocation | None, restore: bool
    ) -> None:
        """Forget ``task_id``'s preemption. With ``restore`` (the LM refused it, or it never
        left), the victims the view still holds take back the room the task was booked
        into on ``booked.node`` (the task's reservation)."""
        if task_id not in view.evicting:
            return
        victims = list(self._victims(view, task_id, booked.node)) if booked else []
        for victim_id in view.evicting.pop(task_id):
            evicted = view.evicted.get(victim_id)
            if evicted is not None and evicted[0] == task_id:
                del view.evicted[victim_id]
        if restore and booked is not None:
            for _victim, room in victims:
                view.table.take(booked.node, room, 0.0, 0.0)

    def accepted(self, lm_id: str, task_id: str) -> None:
        """The LM accepted a launch: it holds the task, though no snapshot showed it yet."""
        view = self.lms.get(lm_id)
        if view is not None:
            view.unanswered.discard(task_id)

    def release(
        self,
        lm_id: str,
        task_id: str,
        ended: bool = False,
        attempt: int = 0,
        now: float | None = None,
        node: str = "",
        queue: str = "",
    ) -> bool:
        """Give a task's resources back in the view: a launch the LM rejected (or that
        never left), or, with ``ended``, attempt ``attempt`` of a task whose end a
        lifecycle event reported, remembered until a snapshot confirms it (even if the
        view never saw the task run). Returns whether room is this GM's to use now that
        was not: the view knew the allocation and its room is this GM's, or this GM is
        the claimant and a hold of its own there ended. Room an end freed on another
        GM's partition is left to that GM (``OwnerFirst``) until a snapshot shows the
        node, which wakes the GM then; waking every GM for every end was most of an
        overloaded run's work.
        ``node``: the ended task's node id (its event says it), for a claimant that never
        saw the task run: a hold it kept there since an earlier end ends
        (``OwnerFirst.mine``). ``queue``: the ended task's user queue (its event says
        it): with shares it may claim one task more (``OldestFirst``)."""
        # Every GM counts every end's claim, in the order heard, known here or not, so
        # that all of them name the same claimant (``OldestFirst``).
        claimant = None
        rule = self.owner_first
        if ended and now is not None and rule is not None and rule.first_heard(task_id, attempt):
            claimant = rule.claimant(queue)
        return self._release(lm_id, task_id, ended, attempt, now, node, claimant)

    def replay_end(
        self, lm_id: str, task_id: str, attempt: int, now: float, node: str, claimant: str | None
    ) -> bool:
        """Run an end this GM only counted then (``count_end``, which named ``claimant``)
        as ``release`` would have at ``now``: for a driver that put it off while it could
        change nothing here (the simulator, ``MeghaSim._gms_learn_end``)."""
        return self._release(lm_id, task_id, True, attempt, now, node, claimant)

    def _release(
        self,
        lm_id: str,
        task_id: str,
        ended: bool,
        attempt: int,
        now: float | None,
        node: str,
        claimant: str | None,
    ) -> bool:
        rule = self.owner_first
        view = self.lms.get(lm_id)
        if view is None:
            return False
        lifted = False
        if claimant is not None and claimant == self.gm_id and rule is not None:
            # This GM's room, known or not: a task placed and ended by another GM between
            # two of its snapshots is not in its view, and its hold from the node's last
            # end (held for that GM) would keep it from its own room until a snapshot
            # offered the node to every GM at once. The hold ending frees room here
            # (``lifted``: parked work must be tried, or younger work takes it first).
            at = view.table.index_of(node) if node else None
            if at is not None:
                lifted = rule.mine(lm_id, at)
        newer = view.allocations.get(task_id)
        if ended and newer is not None and newer.attempt > attempt:
            # An earlier attempt's end, heard after the view booked or saw the next one
            # (a preempted victim placed again): the next one keeps its room.
            earlier = view.ended.get(task_id)
            if earlier is None or earlier.attempt < attempt:
                view.ended[task_id] = Ended(attempt, now)
            return lifted
        booked_here = view.inflight.pop(task_id, None) is not None  # no snapshot showed it
        view.unanswered.discard(task_id)
        allocation = view.allocations.pop(task_id, None)
        # A victim of a preemption under way: the room the preempting task was booked
        # into is not given back twice.
        evicted = view.evicted.pop(task_id, None)
        if ended:
            known = allocation.attempt if allocation is not None else attempt
            shown = None if booked_here else allocation
            view.ended[task_id] = Ended(max(known, attempt), now, shown, booked_here)
        held = False
        if allocation is not None:
            back = allocation.resources if evicted is None else allocation.resources - evicted[1]
            view.table.give_back(allocation.node, back, allocation.usage_mean, allocation.usage_var)
            if ended and now is not None and self.owner_first is not None:
                held = self._hold(view, allocation.node, claimant, now)
        # A preemption that ended (the task ran) killed its victims; one that was refused
        # or never left did not: they hold their node again.
        self._end_eviction(view, task_id, allocation, restore=not ended)
        return (allocation is not None and not held) or lifted

    # ------------------------------------------------------------- matching
    def match(self, task: TaskSpec, now: float | None = None) -> Placement | None:
        """Internal partitions round-robin over LMs, then external ones; None if full.
        With ``now``, silent LMs (``silent``) are passed over and room freed lately on
        another GM's partition is left to it (``OwnerFirst``)."""
        found = self._search(task, True, now)
        if found is None:
            found = self._search(task, False, now)
        return found

    def _search(self, task: TaskSpec, internal: bool, now: float | None) -> Placement | None:
        # The hot loop of an overloaded run (most matches miss every LM): the cheap
        # skips first, ``silent`` inlined, the miss stamp compared field by field.
        order, lms = self._order, self.lms
        count = len(order)
        if not count:
            return None
        start = (self._rr_internal if internal else self._rr_external) % count
        # Holds are on other GMs' nodes, and with ``OldestFirst`` on this GM's own too.
        owner_first = None if now is None else self.owner_first
        if owner_first is not None:
            owner_first.expire(now)
        epoch = self.owner_first.epoch if self.owner_first is not None else 0
        # Everything a policy's verdict depends on besides the table (and the holds).
        shape = (
            owner_first is not None,
            internal,
            task.constraint_mask,
            task.resources.tobytes(),
            task.cpu_usage_mean,
            task.cpu_usage_std,
        )
        needs_cpu = self.policy.strict_cpu and task.resources[CPU] > 0
        silent_after = self.silent_after_s
        for step in range(count):
            slot = start + step
            if slot >= count:
                slot -= count
            view = lms[order[slot]]
            within = view.internal if internal else view.external
            if within is None:
                continue
            table = view.table
            # NodeTable compares by identity; a hold that ended offers nodes again.
            if (
                view.miss_table is table
                and view.miss_version == table.version
                and view.miss_epoch == epoch
            ):
                if shape in view.misses:
                    continue
            else:
                view.misses.clear()
                view.miss_table, view.miss_version, view.miss_epoch = table, table.version, epoch
            if now is not None and now - view.updated_at > silent_after:  # ``silent``
                continue
            if needs_cpu and not table.has_cpu.any():
                continue  # no node of this LM has CPU free: the policies would find none
            if owner_first is not None:
                within = owner_first.exclude(view.lm_id, within)
            node = match(table, task, self.policy, within)
            if node == NO_NODE:
                view.misses.add(shape)
            else:
                if internal:
                    self._rr_internal = slot + 1
                else:
                    self._rr_external = slot + 1
                return Placement(view.lm_id, node, table.node_ids[node], not internal)
        return None

    def claims_end(self, task_id: str, attempt: int, queue: str = "") -> str | None:
        """The GM that ``release`` (with ``ended``) would name claimant of the room this
        end frees, without counting the claim; None: the node's owner (or the end was
        counted already)."""
        rule = self.owner_first
        if rule is None or rule.counted(task_id, attempt):
            return None
        return rule.next_claimant(queue)

    def count_end(self, task_id: str, attempt: int, queue: str = "") -> str | None:
        """Count this end's claim as ``release`` would, and change nothing else: for a
        driver that knows the end changes none of this GM's decisions until it runs it
        (``replay_end``, with the claimant returned here), if ever (the simulator,
        ``MeghaSim._gms_learn_end``). Every GM must count every end, in the same order,
        to name the same claimants (``OldestFirst``)."""
        rule = self.owner_first
        if rule is not None and rule.first_heard(task_id, attempt):
            return rule.claimant(queue)
        return None

    def backlog(
        self, gm_id: str, runs: Iterable[Run], room: Mapping[str, int] | None = None
    ) -> None:
        """``gm_id`` (this GM too) reported its oldest waiting work, as (enqueued, tasks,
        queue) runs oldest first, and ``room``: how many tasks each of its queues with a
        share may still take (``Scheduler.backlog``, ``Scheduler.room``): the claims
        ``OldestFirst`` counts. Nothing to do under the other rules."""
        self.backlogs((Backlog.of(gm_id, runs, room),))

    def backlogs(self, reports: Iterable[Backlog]) -> None:
        """``backlog`` for several reports heard one after another."""
        if isinstance(self.owner_first, OldestFirst):
            self.owner_first.backlogs(reports)

    def held_until(self) -> float | None:
        """When the next node held for its owner (``OwnerFirst``) is anyone's again."""
        return self.owner_first.next_due() if self.owner_first is not None else None

    def assess(self, task: TaskSpec) -> Verdict:
        """Placeable now, later (with why), or never, judged on this view."""
        tables = (v.table for v in self.lms.values())
        return assess(tables, task, self.policy, self.constraint_labels)

    def infeasible(self, task: TaskSpec) -> str | None:
        """Why no node of this view could ever hold ``task``, or None if one could.

        The same answer as ``assess(task)`` being INFEASIBLE, remembered per shape until
        an LM's nodes change: every submission asks, and a full ``assess`` scans every node.
        """
        stamp = self._static_stamp()
        if stamp != self._feasible_at or len(self._feasible) > _FEASIBLE_CACHE:
            self._feasible.clear()
            self._feasible_at = stamp
        shape = (task.constraint_mask, task.resources.tobytes())
        if shape not in self._feasible:
            verdict = self.assess(task)
            infeasible = verdict.schedulability is Schedulability.INFEASIBLE
            self._feasible[shape] = verdict.reason if infeasible else None
        return self._feasible[shape]

    # ----------------------------------------------------------- accounting
    def allocations(self, accepted: bool = False) -> Iterator[Allocation]:
        """Every task the view holds; with ``accepted``, not the launches no LM has
        answered yet."""
        for view in self.lms.values():
            if accepted and view.unanswered:
                held = view.allocations.values()
                yield from (a for a in held if a.task_id not in view.unanswered)
            else:
                yield from view.allocations.values()

    def total_capacity(self) -> np.ndarray:
        """Every LM's nodes' capacity summed (read-only): made again only when some LM's
        nodes or capacities changed (fairness asks for it several times a round)."""
        stamp = self._static_stamp()
        if stamp != self._capacity_at:
            total = np.zeros(NUM_RESOURCES, dtype=np.int64)
            for view in self.lms.values():
                total += view.table.capacity.sum(axis=1)
            total.flags.writeable = False
            self._capacity, self._capacity_at = total, stamp
        return self._capacity

    def _static_stamp(self) -> tuple:
        """Changes whenever an LM's nodes, capacities or constraints do (a new table,
        or ``NodeTable.static_version``)."""
        return tuple((v.table, v.table.static_version) for v in self.lms.values())

    def queue_usage(self, accepted: bool = False) -> dict[str, np.ndarray]:
        """Resources held per queue over every LM (fresh arrays: callers may keep them).

        With ``accepted``, without this GM's launches no LM has answered yet, many of
        which a busy federation rejects: placement and fairness count them (so as not to
        oversubscribe a node), a report of what a queue holds should not.
        """
        total: dict[str, np.ndarray] = {}
        for view in self.lms.values():
            for queue, held in view.queue_usage().items():
                known = total.get(queue)
                total[queue] = held.copy() if known is None else known + held
            if accepted:
                for task_id in view.unanswered:
                    allocation = view.allocations.get(task_id)
                    if allocation is not None and allocation.queue in total:
                        total[allocation.queue] -= allocation.resources
        return total

    # ----------------------------------------------------------- fairness
    def preemption_plan(
        self,
        task: TaskSpec,
        fair: FairShare,
        pledged: Collection[str] = (),
        now: float | None = None,
    ) -> PreemptionPlan | str:
        """Paper Alg. 2 for a task that found no node: whom to preempt, or why not.

        Only a queue under its share may preempt, and only the queue with the largest
        share violation loses tasks; among LMs, the node needing fewest victims wins.
        ``pledged`` are victims of preemptions already under way: never chosen twice.
        Victims are tasks a snapshot showed running: not this GM's launches no snapshot
        showed yet (the LM may not hold them, and one that preempts in turn would leave
        its own victims' room booked twice if the LM refuses it). With ``now``, none on
        a silent LM (``silent``): it could not be asked.
        """
        usage, total = self.queue_usage(), self.total_capacity()
        if not fair.may_preempt(task.queue, usage, total):
            return f"queue {task.queue} is {fair.describe(task.queue, usage, total)}"
        victim_queue = fair.most_over_share(usage, total, exclude=task.queue)
        if victim_queue is None:
            return "no queue is over its share"
        best: PreemptionPlan | None = None
        for lm_id in self._order:
            if now is not None and self.silent(lm_id, now):
                continue
            view = self.lms[lm_id]
            running = [
                a
                for a in view.allocations.values()
                if a.queue == victim_queue
                and not a.gang  # preempting part of a gang is not done (issue 33)
                and a.task_id not in pledged
                and a.task_id not in view.evicted
                and a.task_id not in view.inflight
            ]
            victims = pick_victims(view.table, task, running)
            if victims is None:
                continue
            if best is None or len(victims.task_ids) < len(best.victims.task_ids):
                node_id = view.table.node_ids[victims.node]
                best = PreemptionPlan(lm_id, node_id, victims)
        if best is None:
            return f"no node could hold it even after preempting queue {victim_queue}"
        return best
