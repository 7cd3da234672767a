"""The GM's scheduler: its user queues, the scheduling round, and what a reply from an LM
does to them, as plain code. The live GM (``services/global_master``) and the simulator
(``loadgen/sim/megha.py``) both drive this one class, so a simulated decision is the live
one by construction (Nomad's ``scheduler/``: pure logic over a state view, returning a
plan; the driver carries it out).

    drivers                         Scheduler                               plan / verdict
    submit(queue, work) ─────▶ UserQueues (round-robin, priorities, parked)
    round(now) ─────────────▶ per queue up to round_per_queue tasks:        RoundPlan
                                cancelled / withdrawn ─────────────────▶   .dropped
                                queue limit (LimitLedger) ─────────────▶   .waiting (parked)
                                shape that found no node this round ───▶   .waiting (parked)
                                GlobalView.match ─▶ reserve ───────────▶   .launches (per LM)
                                none: Alg. 2 preemption_plan ─▶ pledge ▶   .preemptions
                                none at all ───────────────────────────▶   .waiting (parked)
    accepted / refused(lm, task)  the view's optimistic booking kept / undone
    rejected(queue, work, status) retry first, park, drop, resend ──────▶  Reply
    preempt_replied(plan, ...)    victims unpledged; booking kept / undone
    apply(snapshot, now)          the view; a change unparks ───────────▶  wake?
    ended(lm, task, attempt, now) room back; unparks ─────────────────────▶ wake?
    cancel(job, reason)           the job's queued work ─────────────────▶  dropped

What waits in a user queue is *work*: one task (the live GM) or a run of one job's
consecutive tasks of one shape (the simulator, where a backlog of a million identical
tasks must cost one park, not a million). Time comes in as ``now`` (seconds, monotonic);
``None`` means a driver with no clock (the simulator): no LM is ever silent then.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Generic, Protocol, TypeVar

from services.core.cancels import CancelledJobs
from services.core.contention import BACKLOG_RUNS, Backlog, OldestFirst, Run
from services.core.fairness import FairShare, tasks_within
from services.core.gang import (
    Eviction,
    Gang,
    GangPlan,
    gang_evictions,
    gang_never_fits,
    limit_gang,
    plan_gang,
)
from services.core.global_view import ApplyResult, GlobalView, Placement, PreemptionPlan
from services.core.limits import LimitLedger, QueueLimits
from services.core.resources import CPU
from services.core.snapshot import Snapshot
from services.core.status import PlacementStatus, Schedulability, Verdict
from services.core.task import TaskSpec
from services.core.user_queues import UserQueues

ROUND_PER_QUEUE = 512  # tasks taken from each queue per scheduling round
# After an LM restart its nodes come back one by one (workers register again): for this
# long a task no node in the view could hold is not refused at submission.
RESTART_SETTLE_S = 30.0
MAX_REJECTIONS = 20  # an LM rejecting a task this often parks it until the view changes
WAITING_FOR_RESOURCES = "waiting for resources"
HELD_SLACK_S = 1e-6  # a recheck lands just after a hold ends, never just before
# Work parked for a reason no view change need announce (an LM refused it too often, or
# a preemption went unanswered and the LM does not hold it) is tried again this soon,
# whatever the view does: in a quiet federation nothing else would wake it.
BLIND_RECHECK_S = 5.0
ROOM_MOST = 2**31 - 1  # ``room`` of a queue whose tasks ask no CPU or memory: unlimited


class Work(Protocol):
    """What waits in a user queue: the tasks not yet decided, the next one first."""

    rejections: int  # times an LM refused it (one task's work only)

    def head(self) -> TaskSpec:
        """The next task to place."""
        ...

    def take(self) -> Any:
        """The next task is decided: what the driver sends for it (work of one task may
        stay as it is; a run moves on to its next task)."""
        ...

    def __len__(self) -> int:
        """Tasks not yet decided."""
        ...

    def join(self, other: Any) -> bool:
        """Take ``other``'s tasks onto this parked work's tail, when both wait for the
        same thing (no node for one shape) and ``other`` is no older than this work's
        last task (queued work stays in age order). False: they stay two."""
        ...

    @property
    def lease(self) -> int:
        """The lease it was last sent under (0: never)."""
        ...

    @property
    def enqueued(self) -> float:
        """When its next task was queued (the driver's clock, seconds)."""
        ...


class OneTask:
    """``Work`` of one task, all but ``enqueued`` and ``rejections``: for a driver's class
    with its ``spec`` (the task as placement sees it) and ``task`` (what it sends, with
    the ``lease`` it was last sent under). The live GM's and the fault model's
    ``Pending``."""

    __slots__ = ()
    spec: TaskSpec
    task: Any

    def head(self) -> TaskSpec:
        return self.spec

    def take(self) -> OneTask:
        return self

    def join(self, _other: Any) -> bool:
        return False

    def __len__(self) -> int:
        return 1

    @property
    def lease(self) -> int:
        return self.task.lease


W = TypeVar("W", bound=Work)
K = TypeVar("K")


class Drop(enum.Enum):
    """Why work left its queue without being placed."""

    CANCELLED = "cancelled"  # its job was cancelled
    WITHDRAWN = "withdrawn"  # the driver withdrew it (its submission was not stored)


class Reply(enum.Enum):
    """What ``rejected`` (or ``rechecked``) did with work an LM refused; the driver acts
    on all but RETRY, PARKED and RESEND."""

    RETRY = "retry"  # back to the front of its queue
    PARKED = "parked"  # refused too often: waits for the view to change
    RESEND = "resend"  # fenced by this GM itself since it was sent: back to the front
    RECHECK = "recheck"  # fenced by another GM: the driver fences above it and asks the
    # LMs whether one holds the task, then calls ``rechecked``
    LET_GO = "let-go"  # an LM holds it (``rechecked``): launched, by whichever GM
    WITHDRAWN = "withdrawn"  # the driver withdrew it (see ``Drop``)
    CANCELLED = "cancelled"  # its job was cancelled (the LM may have heard it first):
    # the driver calls ``cancel``
    ID_TAKEN = "id-taken"  # the LM holds its id as another job's: it ends REJECTED
    INVALID = "invalid"  # the LM cannot read it: it ends REJECTED


@dataclass(slots=True)
class Decided:
    """One task placed in a round: ``handle`` is what the work's ``take`` returned;
    ``match`` the round's match count when it was decided (the simulator's clock)."""

    handle: Any
    spec: TaskSpec
    placement: Placement
    match: int


@dataclass(slots=True)
class Preemption:
    """A task placed into victims' room: ask ``plan.lm_id`` to preempt them for it."""

    queue: str
    handle: Any
    spec: TaskSpec
    plan: PreemptionPlan
    match: int


@dataclass
class RoundPlan(Generic[W]):
    """What one round decided; the driver sends it and tells the waiting why."""

    launches: dict[tuple[str, bool], list[Decided]] = field(default_factory=dict)
    preemptions: list[Preemption] = field(default_factory=list)
    waiting: list[tuple[W, str]] = field(default_factory=list)  # parked, and why
    dropped: list[tuple[W, Drop]] = field(default_factory=list)
    taken: list[W] = field(default_factory=list)  # every piece of work the round took
    matches: int = 0
    placed: int = 0
    recheck_in: float | None = None  # run a round again then, whatever happens before
    more: bool = False  # work is ready still: run another round

    def per_lm(self) -> dict[str, list[Decided]]:
        """The round's placements as one request per LM: its launches and repartitions
        together (each says which it is, ``placement.repartition``), in the order they
        were decided. The live GM sends each as one message on its LM's launch stream;
        the simulator keeps the paper's two messages (``launches``)."""
        requests: dict[str, list[Decided]] = {}
        for (lm_id, _), decided in self.launches.items():
            requests.setdefault(lm_id, []).extend(decided)
        for decided in requests.values():
            decided.sort(key=_decided_order)
        return requests


def _decided_order(decided: Decided) -> int:
    return decided.match


class Scheduler(Generic[W]):
    """The user queues one GM serves and every decision about them."""

    def __init__(
        self,
        view: GlobalView,
        queues: UserQueues[W],
        fair: FairShare | None,
        limits: QueueLimits,
        *,
        round_per_queue: int = ROUND_PER_QUEUE,
        max_rejections: int = MAX_REJECTIONS,
        lm_ids: Iterable[str] = (),
        started_at: float = 0.0,
        limit_settle_s: float = 0.0,
        withdrawn: Callable[[W], bool] | None = None,
        explain: bool = True,
        charge_taken: bool = False,
    ):
        """``fair``: the federation's queue shares (None or one queue: no preemption).
        ``lm_ids``: the LMs there are; until each is heard from, up to ``limit_settle_s``
        after ``started_at``, a limited queue waits (what it holds is not known yet).
        ``withdrawn``: work the driver took back (a submission the broker refused).
        ``explain=False`` skips the reasons given to waiting tasks (the simulator).
        ``charge_taken``: every work a round takes costs at least one of the queue's
        ``round_per_queue``, parked again or not, so a round's length is bounded by the
        work it takes (the live GM: after each end its whole parked backlog is ready
        again, and re-parking 3,000 one-task items held its loop 0.4 s); without it only
        the tasks decided count (the simulator's rounds, charged virtual time by their
        matches)."""
        self.view = view
        shared = fair is not None and len(fair.queues) > 1
        if shared and not isinstance(view.owner_first, OldestFirst):
            # With shares, Alg. 2 decides who gets room: a partition-first claim
            # (``OwnerFirst``) hands a GM its partition beyond its queues' shares (the
            # fairness test: a 10 % queue held 32 %; exempting under-share queues from
            # over-share GMs' holds still left it at 15 %). ``OldestFirst`` stays: a
            # queue claims no more than its room under its share (``room``).
            view.owner_first = None
        self.queues = queues
        if queues.age is None:
            # Parked work goes back in the order it was queued (``UserQueues.unpark``):
            # a launch an LM refused, pushed to the front while a backlog was parked,
            # waited behind that whole backlog, younger jobs' too (issue 29: the p99).
            queues.age = attrgetter("enqueued")
        self.fair = fair
        self.limits = limits
        self.round_per_queue = round_per_queue
        self.max_rejections = max_rejections
        self.lm_ids = set(lm_ids)
        self.started_at = started_at
        self.limit_settle_s = limit_settle_s
        self.withdrawn = withdrawn
        self.explain = explain
        self.charge_taken = charge_taken
        self.limited_here = any(q in limits for q in queues.names)
        self.cancelled = CancelledJobs()
        self.pledged: set[str] = set()  # victims of preemptions under way
        self.lease = 0  # the lease this GM sends under now (fencing: see the LM)
        self._pledge_epoch = 0  # bumped whenever ``pledged`` changes
        # (queue, constraints, request) -> (view token, why) of a preemption Alg. 2
        # refused: asked again only once the view or the pledges changed.
        self._refused: dict[tuple[str, int, bytes], tuple[tuple, str]] = {}
        # Per queue, the parked work that waits for "no node" (nothing unparked since):
        # later work of its shape joins it instead of parking beside it.
        self._last_parked: dict[str, W] = {}
        # Work is parked that waits for no change of the view (``BLIND_RECHECK_S``).
        self._blind = False
        # Parked work that room without free CPU might take (``_may_fit``).
        self._parked_wide = False

    @property
    def shares(self) -> bool:
        """Whether queues share the federation (two or more): Alg. 2 and the share rules
        apply; with one queue or none, nothing is preempted for fairness."""
        return self.fair is not None and len(self.fair.queues) > 1

    # ------------------------------------------------------------------ intake
    def never_runs(self, queue: str, spec: TaskSpec, now: float | None) -> str | None:
        """Why ``spec`` can never run in ``queue`` (it is refused at submission), or
        None: no node of the view could ever hold it (unless an LM restarted lately and
        its nodes are still coming back), or it asks more than its queue's limit."""
        never = self.view.infeasible(spec)
        if never is not None and now is not None and self.view.restarted(now, RESTART_SETTLE_S):
            never = None
        return self.limits.never_fits(queue, spec.resources) or never

    def submit(self, queue: str, work: W) -> None:
        self.queues.push(queue, work)

    def ready(self) -> bool:
        return any(self.queues.ready(name) for name in self.queues.names)

    # ------------------------------------------------------------------- round
    def round(self, now: float | None) -> RoundPlan[W]:
        """One scheduling round: from each queue in turn (a different one first each
        round), up to ``round_per_queue`` tasks, highest priority first."""
        plan: RoundPlan[W] = RoundPlan()
        # Within one round the view only shrinks, so a shape (queue, constraints,
        # request) that found no node finds none for any later task either: a backlog
        # of identical tasks costs one match per round, not one per task. The queue is
        # part of the shape because what fairness decides depends on it.
        failed: dict[tuple[str, int, bytes], str] = {}
        ledger = self._ledger(now, plan)
        launches: dict[tuple[str, bool], list[Decided]] = defaultdict(list)
        yielding = self._yielding()
        for queue in self.queues.rotation():
            if queue in yielding:
                # Over its share while a queue under its share waits somewhere: room it
                # took now, Alg. 2 would preempt back. Looked at again next round.
                plan.recheck_in = BLIND_RECHECK_S
                continue
            budget = self.round_per_queue
            while budget > 0:
                work = self.queues.take(queue)
                if work is None:
                    break
                plan.taken.append(work)
                decided = self._place(queue, work, budget, now, ledger, failed, launches, plan)
                budget -= max(decided, 1) if self.charge_taken else decided
        plan.launches = dict(launches)
        plan.more = any(self.queues.ready(q) for q in self.queues.names if q not in yielding)
        held = self.view.held_until()
        if plan.waiting and held is not None and now is not None:
            # Nodes held for their owners (``OwnerFirst``) are anyone's then: parked
            # work may fit there, though the view will not change by itself.
            again = max(held - now, 0.0) + HELD_SLACK_S
            plan.recheck_in = again if plan.recheck_in is None else min(plan.recheck_in, again)
        if self._blind and (plan.recheck_in is None or plan.recheck_in > BLIND_RECHECK_S):
            plan.recheck_in = BLIND_RECHECK_S
        return plan

    def _yielding(self) -> frozenset[str]:
        """The queues served here that wait this round: over their share while some GM
        reports waiting work of a queue under its share (``OldestFirst`` only: the
        reports are its)."""
        rule = self.view.owner_first
        if not self.shares or not isinstance(rule, OldestFirst):
            return frozenset()
        waiting = rule.waiting_queues()
        if not waiting:
            return frozenset()
        usage, total = self.view.queue_usage(), self.view.total_capacity()
        if not any(self.fair.is_under_share(q, usage, total) for q in waiting):
            return frozenset()
        return frozenset(q for q in self.queues.names if self.fair.is_over_share(q, usage, total))

    def _place(
        self,
        queue: str,
        work: W,
        budget: int,
        now: float | None,
        ledger: LimitLedger | None,
        failed: dict[tuple[str, int, bytes], str],
        launches: dict[tuple[str, bool], list[Decided]],
        plan: RoundPlan[W],
    ) -> int:
        """Place up to ``budget`` of ``work``'s tasks; how many were decided."""
        if (drop := self._drop(work)) is not None:
            plan.dropped.append((work, drop))
            return 0
        view = self.view
        left = len(work)
        decided = 0
        while decided < min(budget, left):
            spec = work.head()
            if ledger is not None and (why := ledger.check(queue, spec.resources)):
                self._wait(queue, work, why, plan, no_node=False)
                return decided
            shape = (queue, spec.constraint_mask, spec.resources.tobytes())
            if shape in failed:
                self._wait(queue, work, failed[shape], plan, no_node=True)
                return decided
            plan.matches += 1
            placement = view.match(spec, now=now)
            if placement is None:
                preemption = self._preemption(queue, spec, now)
                if isinstance(preemption, str):
                    failed[shape] = preemption
                    self._wait(queue, work, preemption, plan, no_node=True)
                    return decided
                if ledger is not None:  # the preemption makes room for it
                    ledger.take(queue, spec.resources)
                plan.preemptions.append(
                    Preemption(queue, work.take(), spec, preemption, plan.matches)
                )
                decided += 1
                continue
            view.reserve(placement, spec, now=now)
            if ledger is not None:
                ledger.take(queue, spec.resources)
            launches[(placement.lm_id, placement.repartition)].append(
                Decided(work.take(), spec, placement, plan.matches)
            )
            plan.placed += 1
            decided += 1
        if decided < left:  # the budget ran out first
            self.queues.push_front(queue, work)
        return decided

    def _drop(self, work: W) -> Drop | None:
        if self.withdrawn is not None and self.withdrawn(work):
            return Drop.WITHDRAWN
        if work.head().job_id in self.cancelled:
            return Drop.CANCELLED
        return None

    def _ledger(self, now: float | None, plan: RoundPlan[W]) -> LimitLedger | None:
        """``ledger``, for one round: while what the queues hold is not known, the
        round is planned again once it may be."""
        ledger = self.ledger(now)
        if ledger is not None and ledger.unknown is not None and now is not None:
            # nothing may change in the view meanwhile
            plan.recheck_in = self.started_at + self.limit_settle_s - now + 0.05
        return ledger

    def ledger(self, now: float | None) -> LimitLedger | None:
        """What the limited queues served here hold now (None: no limit here).

        Until every LM has been heard from, what a queue holds is not known: a GM that
        just started would count only part of it and overshoot. So its limited queues
        wait for the LMs, up to ``limit_settle_s`` after the start; then what the LMs
        heard from hold is taken as all (an LM may be down for long).
        """
        if not self.limited_here:
            return None
        unknown = None
        unheard = sorted(self.lm_ids - set(self.view.lms))
        left = self.started_at + self.limit_settle_s - now if now is not None else 0.0
        if unheard and left > 0:
            unknown = (
                f"this GM has not heard from {', '.join(unheard)} yet, so it does not know "
                f"what the queue holds against its limit; waiting at most {left:.0f} s more"
            )
        return LimitLedger(self.limits, self.view.queue_usage(), unknown)

    # ------------------------------------------------------------------ gangs
    def plan_gang(
        self,
        queue: str,
        gang: Gang,
        now: float | None,
        judge_never: bool = False,
        held: Sequence[tuple[str, str]] = (),
    ) -> GangPlan | Verdict:
        """A gang job of ``queue``, planned whole over the view (``plan_gang``) with the
        members its queue's limit lets start now (``limit_gang``), counting free the room
        LMs hold for it (``held``: its preemption's victims', ``Reservations.hold_room``).
        Nothing is booked: the driver books the plan (``book``) before it asks the LMs."""
        limited = limit_gang(gang, queue, self.ledger(now))
        if isinstance(limited, Verdict):
            return limited
        return plan_gang(limited, self.view, now, judge_never=judge_never, held=held)

    def gang_evictions(
        self, queue: str, gang: Gang, now: float | None, pledge: bool = True
    ) -> Eviction | str:
        """Whom to preempt so that a waiting gang of ``queue`` starts whole (Alg. 2 with
        the gang as one unit: ``gang_evictions``, within the queue's limit), or why not.
        The victims are pledged (no other preemption picks them) until the driver has
        asked their LMs (``evictions_replied``); it plans the gang again once their room
        is free. Without ``pledge`` (a dry run) nothing changes."""
        if not self.shares:
            return "one queue: nothing to preempt for fairness"
        limited = limit_gang(gang, queue, self.ledger(now))
        if isinstance(limited, Verdict):  # it waits for its own queue's tasks
            return limited.reason
        out = gang_evictions(limited, queue, self.view, self.fair, self.pledged, now)
        if isinstance(out, Eviction) and pledge:
            self.pledged.update(task_id for _, task_id, _ in out.victims)
            self._pledge_epoch += 1
        return out

    def evictions_replied(self, eviction: Eviction) -> None:
        """Every LM of ``eviction`` answered (or not): its victims may be picked again.
        Those stopped stay booked until the LMs' events or states show them gone."""
        self.pledged.difference_update(task_id for _, task_id, _ in eviction.victims)
        self._pledge_epoch += 1

    def gang_never_runs(self, queue: str, gang: Gang, now: float | None) -> str | None:
        """Why ``gang`` can never start whole in ``queue`` (refused at submission; each
        member alone is ``never_runs``'s): the members that start together ask more than
        the queue's limit, or no set of the view's nodes (dead ones too) could ever hold
        them (``plan_gang``'s INFEASIBLE); None if it may. The latter is not judged while
        an LM was not heard yet or restarted lately (its nodes are coming back)."""
        over = gang_never_fits(gang, queue, self.limits)
        if over is not None:
            return over
        if self.lm_ids - set(self.view.lms):
            return None
        if now is not None and self.view.restarted(now, RESTART_SETTLE_S):
            return None
        outcome = plan_gang(gang, self.view, now, judge_never=True)
        if isinstance(outcome, Verdict) and outcome.schedulability is Schedulability.INFEASIBLE:
            return outcome.reason
        return None

    def _preemption(self, queue: str, spec: TaskSpec, now: float | None) -> PreemptionPlan | str:
        """No node internal or external: fairness (Alg. 2) picks victims, booked into
        their room and pledged so that no other task picks them while the request is
        out. Else why the task waits."""
        if not self.shares:
            return self._room(spec)
        # Alg. 2 is a function of the view (its tables, which LMs are silent) and the
        # pledged victims: while none changed, a shape it refused is refused again.
        key = (queue, spec.constraint_mask, spec.resources.tobytes())
        token = (
            self._pledge_epoch,
            tuple((id(v.table), v.table.version) for v in self.view.lms.values()),
            () if now is None else tuple(i for i in self.view.lms if self.view.silent(i, now)),
        )
        refused = self._refused.get(key)
        if refused is not None and refused[0] == token:
            return refused[1]
        plan = self.view.preemption_plan(spec, self.fair, self.pledged, now=now)
        if isinstance(plan, PreemptionPlan):
            self.pledged.update(plan.victims.task_ids)
            self._pledge_epoch += 1
            self.view.reserve_preemption(plan, spec, now=now)
            return plan
        # Why fairness cannot help, then what the task waits for: "queue q1 is over
        # share (32% of 25%); waiting for resources: needs ...; largest free ...".
        why = f"{plan}; {self._room(spec)}" if self.explain else ""
        self._refused[key] = (token, why)
        return why

    def _room(self, spec: TaskSpec) -> str:
        if not self.explain:
            return ""
        return self.view.assess(spec).reason or WAITING_FOR_RESOURCES

    def _wait(self, queue: str, work: W, why: str, plan: RoundPlan[W], no_node: bool) -> None:
        plan.waiting.append((work, why))
        self._park(queue, work, no_node)

    def _park(self, queue: str, work: W, no_node: bool, blind: bool = False) -> None:
        """Park ``work`` until the view changes; work that waits for no node joins the
        parked work of its shape when that is the queue's newest (same order, one item):
        sound because a shape that found no node keeps finding none until the view
        changes, and every view change unparks (and forgets ``_last_parked``).
        ``blind``: what it waits for may never show in the view; the next round asks
        for a recheck (``BLIND_RECHECK_S``), so the driver must run one."""
        self._blind |= blind
        if blind or not no_node or not work.head().resources[CPU] > 0:
            self._parked_wide = True
        last = self._last_parked.get(queue)
        if no_node and last is not None and last.join(work):
            return
        self.queues.park(queue, work)
        if no_node:
            self._last_parked[queue] = work
        else:
            self._last_parked.pop(queue, None)

    def recheck(self) -> bool:
        """A round's ``recheck_in`` is due: parked work is tried again. True when a round
        should run: work was parked, or is ready in a queue a round passed over (it
        yielded: ``_yielding``)."""
        unparked = self.unpark()
        return unparked or self.ready()

    def unpark(self) -> bool:
        """The view changed: parked work is tried again. True if there was any."""
        self._last_parked.clear()
        self._blind = False
        self._parked_wide = False
        return self.queues.unpark() > 0

    def backlog(self, most: int = BACKLOG_RUNS) -> list[Run]:
        """The oldest waiting work, as up to ``most`` runs of (enqueued, tasks, queue),
        oldest first: what this GM reports to every GM (itself too) every
        ``BACKLOG_INTERVAL_S`` for ``OldestFirst``, with ``room``. A queue's work of one
        enqueued time is one run. Cost: O(queues x lanes x ``most``)."""
        tasks: dict[tuple[float, str], int] = defaultdict(int)
        for queue in self.queues.names:
            for work in self.queues.oldest(queue, most):
                tasks[(work.enqueued, queue)] += len(work)
        return [(at, n, queue) for (at, queue), n in sorted(tasks.items())[:most]]

    def room(self, queues: Iterable[str]) -> dict[str, int]:
        """With shares: for each of ``queues`` served here, how many tasks of its oldest
        waiting work it may still take before it is over its share, by this GM's view of
        what it holds (its launches no LM answered yet too: counted out, the next report
        would offer the room they take again). Sent with ``backlog``: every GM then
        counts the same claims for each queue, none beyond its share (``OldestFirst``).
        Without shares: nothing (no queue is limited)."""
        if not self.shares:
            return {}
        usage, total = self.view.queue_usage(), self.view.total_capacity()
        room = {}
        for queue in set(queues):
            oldest = min(self.queues.oldest(queue, 1), key=attrgetter("enqueued"), default=None)
            if oldest is not None:
                headroom = self.fair.headroom(queue, usage, total)
                room[queue] = tasks_within(headroom, oldest.head().resources, ROOM_MOST)
        return room

    def heard_backlog(
        self, gm_id: str, runs: Iterable[Run], room: Mapping[str, int] | None = None
    ) -> bool:
        """``gm_id``'s report (``backlog`` and ``room``) came: the claims ``OldestFirst``
        counts. True when a round should run: with shares, a queue that yielded
        (``_yielding``) may not now."""
        return self.heard_backlogs((Backlog.of(gm_id, runs, room),))

    def heard_backlogs(self, reports: Iterable[Backlog]) -> bool:
        """``heard_backlog`` for several reports heard one after another (the simulator
        delivers every GM's at once): True when a round should run after any of them."""
        if not self.shares:  # nothing to answer after each: the claims' order made once
            self.view.backlogs(reports)
            return False
        wake = False
        for report in reports:
            self.view.backlogs((report,))
            wake |= self.ready()
        return wake

    # ----------------------------------------------------------------- replies
    def accepted(self, lm_id: str, task_id: str) -> None:
        """An LM took a task (launch or preemption): its booking in the view stands."""
        self.view.accepted(lm_id, task_id)

    def refused(self, lm_id: str, task_id: str) -> None:
        """An LM refused a task: undo its optimistic booking first (the LM's state, if
        the reply carries it, then overwrites every node that really changed)."""
        self.view.release(lm_id, task_id)

    def unanswered(self, lm_id: str) -> None:
        """A request to ``lm_id`` went unanswered: nothing is placed there until its
        next heartbeat proves it back (its tasks are fenced before they go elsewhere)."""
        self.view.forget(lm_id)

    def retry(self, queue: str, work: W) -> Drop | None:
        """Work whose request was not answered, fenced and not held by the LM: tried
        again first, unless it was dropped meanwhile."""
        drop = self._drop(work)
        if drop is None:
            self.queues.push_front(queue, work)
        return drop

    def rechecked(self, queue: str, work: W, held: bool) -> Reply:
        """``work`` was refused as fenced by another GM (``Reply.RECHECK``) and the driver
        has since fenced it above every lease on every LM: ``held`` if an LM holds it
        (at its attempt or a later one). Held, it runs: LET_GO (the driver counts it
        launched); else no launch of it can land any more but this GM's: sent again.
        Safe with two GMs doing this at once: each fence refuses the other's earlier
        launches, and each looks after fencing, so one launch lands and the other GM
        finds it held."""
        if held:
            return Reply.LET_GO
        drop = self._drop(work)
        if drop is Drop.WITHDRAWN:
            return Reply.WITHDRAWN
        if drop is Drop.CANCELLED:
            return Reply.CANCELLED
        self.queues.push_front(queue, work)
        return Reply.RESEND

    def rejected(self, queue: str, work: W, status: PlacementStatus) -> Reply:
        """An LM refused ``work`` (its booking undone by ``refused``)."""
        if status is PlacementStatus.REJECTED_INVALID:
            return Reply.INVALID
        if status is PlacementStatus.REJECTED_TASK_ID_TAKEN:
            return Reply.ID_TAKEN
        if status is PlacementStatus.REJECTED_FENCED:
            if work.lease < self.lease:  # this GM fenced it since: sent again
                self.queues.push_front(queue, work)
                return Reply.RESEND
            # Fenced above this GM's own lease by another GM: one that took over its queue
            # message (this one lost its broker connection), or, with queue failover, one
            # that fenced the task in an earlier attempt and is gone. Which it is, only
            # the LMs can say: the driver fences above that lease and asks them all.
            return Reply.RECHECK
        drop = self._drop(work)
        if drop is Drop.WITHDRAWN:
            return Reply.WITHDRAWN
        if drop is Drop.CANCELLED or status is PlacementStatus.REJECTED_CANCELLED:
            return Reply.CANCELLED
        work.rejections += 1
        if work.rejections >= self.max_rejections:
            self._park(queue, work, no_node=False, blind=True)
            return Reply.PARKED
        self.queues.push_front(queue, work)
        return Reply.RETRY

    def preempt_replied(self, plan: PreemptionPlan, task_id: str, ok: bool | None) -> None:
        """The answer to a preemption (``ok`` None: none came): its victims are free to
        be picked again; a refused task's booking in their room is undone. The victims
        stay booked until the LM's events or state show them gone."""
        self.pledged.difference_update(plan.victims.task_ids)
        self._pledge_epoch += 1
        if not ok:
            self.view.release(plan.lm_id, task_id)

    def preempt_unanswered(self, queue: str, work: W) -> Drop | None:
        """A preemption went unanswered and its LM, fenced, does not hold the task: it
        waits for the view to change (the victims may be gone by then), or at most
        ``BLIND_RECHECK_S`` after the next round (the federation may be quiet by then:
        ``chaos-sim --small --seed 4463``). The driver runs a round after this."""
        drop = self._drop(work)
        if drop is None:
            self._park(queue, work, no_node=False, blind=True)
        return drop

    # -------------------------------------------------------------- reconcilers
    def unheld(self, placed: Mapping[K, tuple[str, str, int]]) -> set[K]:
        """Of tasks a GM's books show placed or running, as (LM, task id, attempt) by
        key, those their LM's books (as the view has them) do not hold at that attempt:
        an end event may have been lost. A booking of this GM's own that no snapshot has
        shown yet does not count as held: a task can start and end unseen while the
        broker is away (its events and heartbeats lost), and a full snapshot that does
        not list it cannot tell it ended from not yet launched. The driver asks the LM of
        each once still so a round later (the view may just lag)."""
        out = set()
        for key, (lm_id, task_id, attempt) in placed.items():
            view = self.view.lms.get(lm_id)
            held = view.allocations.get(task_id) if view is not None else None
            if held is None or held.attempt < attempt or task_id in view.inflight:
                out.add(key)
        return out

    def lost_starts(
        self,
        lm_id: str,
        unknown: Iterable[str],
        accepted: Mapping[str, tuple],
        now: float,
        grace_s: float,
    ) -> list[str]:
        """Tasks ``lm_id`` accepted (``accepted``: task id -> (LM, when, ...), on this
        GM's clock) that it no longer knows (``unknown``) after it restarted before passing
        them to their workers: queued again as their next attempt, once it has been
        back ``grace_s`` (every live worker has registered again and named what it runs;
        a task that did start is adopted)."""
        view = self.view.lms.get(lm_id)
        if view is None or view.restarted_at is None or now - view.restarted_at < grace_s:
            return []
        lost = []
        for task_id in sorted(unknown):
            took = accepted.get(task_id)
            if took is not None and took[0] == lm_id and took[1] <= view.restarted_at:
                lost.append(task_id)
        return lost

    # ---------------------------------------------------------------- the view
    def apply(self, snapshot: Snapshot, now: float) -> tuple[ApplyResult, bool]:
        """Fold an LM's state into the view; True when parked work should be tried
        again (the view changed, or the LM was silent and is heard again: it may hold
        room though its books did not change)."""
        lm_id = snapshot.lm_id
        was_silent = lm_id in self.view.lms and self.view.silent(lm_id, now)
        result = self.view.apply(snapshot, now)
        back = was_silent and not self.view.silent(lm_id, now)
        wake = (result is ApplyResult.APPLIED or back) and self._may_fit(lm_id) and self.unpark()
        return result, wake

    def _may_fit(self, lm_id: str) -> bool:
        """Whether the parked work may fit now that ``lm_id``'s state changed. Parked
        work found no node on the view as it was; a snapshot changes one LM's part of
        it, so if none of that LM's nodes has CPU free, work that needs CPU (under a
        policy that places only where CPU is free) still finds none, and the round a
        wake would run places nothing (most rounds of an overloaded federation: 182k of
        293k at 3,000 workers on the Yahoo sample; issue 29). Not judged, so always
        True: with shares (a round may preempt, and every end changes what the queues
        hold), and while some parked work asks no CPU, waits for its queue's limit
        rather than for room, or waits blind (``_park``)."""
        if self._parked_wide:
            return True
        if self.shares:
            return True
        # (``apply`` asks only for an LM it just applied or heard again: in the view.)
        return not self.view.policy.strict_cpu or self.view.lms[lm_id].table.has_cpu.any()

    def ended(self, ends: Iterable[tuple[str, str, int, str, str]], now: float | None) -> bool:
        """Attempts that ended, as (LM, task id, attempt, node id or "", queue or ""):
        their room is back in the view. True when parked work should be tried again."""
        freed = False
        for lm_id, task_id, attempt, node, queue in ends:
            freed |= self.view.release(
                lm_id, task_id, ended=True, attempt=attempt, now=now, node=node, queue=queue
            )
        return freed and self.unpark()

    def ended_counted(
        self, lm_id: str, task_id: str, attempt: int, node: str, claimant: str | None, now: float
    ) -> bool:
        """``ended`` for one end whose claim the driver counted already
        (``GlobalView.count_end``, which named ``claimant``)."""
        return self.view.replay_end(lm_id, task_id, attempt, now, node, claimant) and self.unpark()

    def cancel(self, job_id: str, reason: str) -> list[W]:
        """The job is cancelled: its work leaves the queues, ready or parked (returned),
        and any that turns up later is dropped."""
        self.cancelled.add(job_id, reason)
        dropped: list[W] = []
        for queue in list(self.queues.names):
            dropped += self.withdraw(queue, lambda work: work.head().job_id == job_id)
        return dropped

    def withdraw(self, queue: str, drop: Callable[[W], bool]) -> list[W]:
        """Take the work of ``queue`` for which ``drop`` is true out, ready or parked."""
        dropped = self.queues.remove(queue, drop)
        if dropped:
            self._last_parked.clear()
        return dropped
