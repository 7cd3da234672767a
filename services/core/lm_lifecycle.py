"""The LM's task lifecycle: what a GM's request, a worker's report, a registering worker's
inventory, a dead node, a cancel or a restart does to the tasks one LM holds, as plain
code. The live LM (``services/local_master``) carries out the actions each call returns
(starts and kills on worker streams, events on the bus, next attempts into user queues,
rows in its journal); a simulator or a test carries them out its own way. Nomad's shape:
the books are read and changed here, effects are a plan the driver executes in order.

    event (the driver's)                 Lifecycle (ClusterState + held tasks)       plan
    place(kind, gm, spec, node) ──▶ cancelled? ─▶ ClusterState.launch | repartition
                                      an older attempt replaced ────────▶ Kill, LOST "superseded"
    preempt(gm, spec, node, ...) ──▶ ClusterState.preempt ─────────────▶ Kill victims, then
                                      victims stopping                   PREEMPTED each
    hold(task, allocation) ─────────▶ the attempt is held; no orphan ──▶ Start, PLACED
    report(node, report) ───────────▶ ReportVerdict ───────────────────▶ (LOST | RETRYING) +
                                                                         Requeue, or the event;
                                      a stopping attempt's end ────────▶ Requeue
    withdrawn(task, attempt) ───────▶ its start never left the LM ─────▶ Requeue if stopping
    take_back(node, held, pending) ─▶ InventoryVerdict per task ──────▶ Journal the adopted,
                                                                         cancel, Kill stale,
                                                                         LOST + Requeue missing
    node_lost(node, reason) ────────▶ released; its stopping attempts ──▶ LOST + Requeue
    cancel(job_ids) ────────────────▶ released ─────────────────────────▶ CANCELLED, Kill
    stop(task, attempt, reason) ────▶ released; stopping ───────────────▶ LOST, Owe, Kill
    heard(node, now) / silent(now) ─▶ nodes silent past the timeout (the watchdog)
    forgettable(now, after) / forget ▶ nodes lost past forget_lost_after_s: row vacated
    expire_orphan(now) ─────────────▶ the oldest orphan past the grace ▶ Requeue, LOST
    lookup(task_ids, lease) ────────▶ attempt, running; fences what is not held

Exactly once is by (task id, attempt), never by timing:

- A task is *held* (``tasks``) by one attempt at a time, the one the books hold. It stops
  being held once, by whichever comes first: its end, its re-queue (lost, preempted,
  retrying), a newer attempt replacing it (superseded), its job's cancel. Every re-queue
  checks the held attempt is the one that lost its place, so no attempt is queued twice.
- A killed attempt's next one is queued only once the killed one can no longer run
  (``stopping``): a kill travels the worker's stream, which may be slow or broken, and
  the old attempt runs (or even starts: its start and kill may wait together) until the
  worker reads it. So a preempted victim ends on the books at once (its resources go to
  the preempting task, which starts at once) and is told PREEMPTED, but its next attempt
  is queued when its worker reports it ended (any final state), when its start is
  withdrawn before it left the LM (``withdrawn``), when its worker registers again
  without it, or when its node is taken for dead. The last is safe only with the
  workers' fence on (``worker_fence_s`` below ``worker_timeout_s``): a worker the LM has
  not heard from for the timeout has by then killed what it ran and starts nothing more;
  with the fence off, a worker cut off from its LM (not dead) may still run it.
- A report counts only for the attempt the books hold, on the node that holds it; a late
  report of an attempt that ended here (its next attempt may run on that very node) does
  nothing. Every kill names its attempt, so it never kills the attempt that replaced it.
- What a worker holds and the books saw end (or a GM fenced) is killed, not booked again.
- An *orphan* is a task an earlier life of this LM accepted (its journal says so) that no
  worker has named since. Past ``orphan_grace_s`` from the LM's start (the live LM:
  ``worker_timeout_s`` plus ``RESTART_GRACE_S``, the time a worker has to register again)
  it is ended on the books first (a worker naming it later has its copy killed), then
  re-queued.

Time comes in as ``now`` (seconds, any monotonic clock the driver keeps to).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from services.core.cancels import CancelledJobs
from services.core.cluster_state import ClusterState, Decision
from services.core.reservations import Reservations, is_placeholder
from services.core.snapshot import Allocation
from services.core.states import RUN_ENDED, TaskState
from services.core.status import PlacementStatus
from services.core.task import TaskSpec


class Timestamps(Protocol):
    started_unix_nanos: int


class HeldTask(Protocol):
    """The task as the driver holds it (the live LM: the ``megha.v1.Task`` it started).
    The lifecycle reads these and counts ``failures`` up on a retry."""

    task_id: str
    job_id: str
    attempt: int
    failures: int
    max_retries: int
    timestamps: Timestamps


class WorkerReport(Protocol):
    """A worker's word on one attempt (the live LM: a ``megha.v1.TaskReport``)."""

    task_id: str
    attempt: int
    state: int  # a TaskState value
    message: str
    peak_memory_mb: int


T = TypeVar("T", bound=HeldTask)


# ------------------------------------------------------------------- actions
@dataclass(frozen=True, slots=True)
class Kill:
    """Tell ``node``'s worker to kill ``attempt`` of ``task_id`` (only that attempt)."""

    node: int
    task_id: str
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True)
class Start(Generic[T]):
    """Send ``task`` to ``node``'s worker."""

    node: int
    task: T


@dataclass(frozen=True, slots=True)
class Publish(Generic[T]):
    """Tell the federation ``task`` (its current attempt) is now in ``state``; ``node``
    -1 for none."""

    task: T
    state: int  # a TaskState (a worker's report's own state is passed on as it came)
    node: int
    reason: str = ""
    peak_memory_mb: int = 0


@dataclass(frozen=True, slots=True)
class Requeue(Generic[T]):
    """Put ``task``'s next attempt (``task.attempt + 1``) in its user queue. The attempt
    has ended on the books: this is the task's only way on, so the driver retries it
    until the queue has it. ``owed``: the journal has it as owed (``Owe``), a row struck
    once the queue has it."""

    task: T
    owed: bool = False


@dataclass(frozen=True, slots=True)
class Owe(Generic[T]):
    """Write to the journal that ``task``'s next attempt is owed (the attempt was killed;
    the next is queued once it ended), so that a restart, which loses ``stopping``,
    still queues it (``Lifecycle.recall``)."""

    task: T


@dataclass(frozen=True, slots=True)
class Journal(Generic[T]):
    """Write ``task`` to the journal as accepted (a task taken back from its worker, so
    that a later restart knows it too)."""

    task: T


Action = Kill | Start | Publish | Requeue | Journal | Owe


# ------------------------------------------------------------------ verdicts
class ReportVerdict(enum.Enum):
    """What a worker's report did."""

    IGNORED = "ignored"  # about an attempt this LM does not hold there: nothing
    KNOWN = "known"  # RUNNING, and known to run (a reconnecting worker's inventory)
    PROGRESS = "progress"  # the attempt goes on (e.g. it started): its event only
    LOST = "lost"  # its worker killed it going away: released, the next attempt queued
    RETRYING = "retrying"  # it failed with retries left: released, the next attempt queued
    ENDED = "ended"  # a final state (RUN_ENDED): released, done
    STOPPED = "stopped"  # a killed (stopping) attempt ended: its next attempt queued now

    @property
    def accepted(self) -> bool:
        return self is not ReportVerdict.IGNORED


class InventoryVerdict(enum.Enum):
    """What ``take_back`` made of one task: of those the worker names, and of those the
    books hold on its node that it does not."""

    KNOWN = "known"  # booked there, that attempt: a worker reconnecting to the LM it left
    ADOPTED = "adopted"  # not booked (the LM restarted): booked now
    STALE = "stale"  # a running attempt the books saw end, or fenced: killed
    REFUSED = "refused"  # an ended one (its final report is owed) the books will not take
    MALFORMED = "malformed"  # unreadable: left alone
    MISSING = "missing"  # booked on the node, not named by it: lost, the next queued


@dataclass(slots=True)
class ReportOutcome(Generic[T]):
    verdict: ReportVerdict
    # The held task the report is about, when it counts: the driver merges the worker's
    # timestamps into it before carrying out ``actions``.
    task: T | None = None
    actions: list[Action] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Held(Generic[T]):
    """A task a registering worker names: running, or ended with its final report owed.
    ``spec`` is None when the task cannot be read (it is left alone)."""

    task: T
    spec: TaskSpec | None
    running: bool


@dataclass(slots=True)
class TakeBack(Generic[T]):
    actions: list[Action] = field(default_factory=list)
    verdicts: list[tuple[str, InventoryVerdict]] = field(default_factory=list)
    cancelled: int = 0  # of the tasks ``actions`` ends CANCELLED
    cancelled_jobs: set[str] = field(default_factory=set)  # their jobs

    def count(self, verdict: InventoryVerdict) -> int:
        return sum(1 for _, v in self.verdicts if v is verdict)


@dataclass(slots=True)
class NodeLoss(Generic[T]):
    lost: list[Allocation]  # what the books held there, released
    actions: list[Action] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Lookup:
    """What this LM knows of a task: its latest attempt here and whether it still holds
    it (booked, or an orphan a worker may still name)."""

    task_id: str
    attempt: int
    running: bool


@dataclass(frozen=True, slots=True)
class Stopping(Generic[T]):
    """A killed attempt (``task``, as it was held) on ``node`` whose end is not known
    yet: its next attempt is queued once it is. ``node`` -1: recalled from the journal,
    on whichever node's worker names it (or, if none does within the orphans' grace,
    on a node that died or fenced itself)."""

    task: T
    node: int


NOTHING: tuple[Action, ...] = ()


@dataclass(frozen=True, slots=True)
class RoomFor:
    """Where an evicted victim's room goes: held for gang job ``job_id`` in ``gangs``
    from ``now`` for ``ttl_s`` (``Lifecycle.evict_books``)."""

    gangs: Reservations
    job_id: str
    now: float
    ttl_s: float


class Lifecycle(Generic[T]):
    """One LM's tasks from acceptance to end, over its books (``ClusterState``).

    ``tasks``: the held attempt of each task the books hold (the driver's task object,
    kept as given). ``orphans``: tasks an earlier life accepted that no worker has named
    since, oldest first. ``cancelled``: jobs whose tasks must not run here. ``stopping``:
    killed attempts, by (task id, attempt), whose next attempt waits for their end.
    """

    def __init__(
        self,
        books: ClusterState,
        cancelled: CancelledJobs | None = None,
        worker_timeout_s: float = 10.0,
        orphan_grace_s: float = 15.0,
    ) -> None:
        self.books = books
        self.cancelled = cancelled if cancelled is not None else CancelledJobs()
        self.worker_timeout_s = worker_timeout_s
        self.orphan_grace_s = orphan_grace_s
        self.tasks: dict[str, T] = {}
        self.stopping: dict[tuple[str, int], Stopping[T]] = {}
        self.orphans: dict[str, T] = {}
        self.orphans_due = math.inf  # see ``arm_orphans``
        self.last_heard: dict[int, float] = {}  # by node
        # When each node now dead was taken for dead (``node_lost`` given ``now``), for
        # ``forgettable``; a node heard from again leaves it.
        self.lost_at: dict[int, float] = {}

    # ------------------------------------------------------- GM requests
    def refusal(self, job_id: str) -> Decision | None:
        """REJECTED_CANCELLED for a task of a cancelled job, else None."""
        why = self.cancelled.refusal(job_id)
        return None if why is None else Decision(PlacementStatus.REJECTED_CANCELLED, why)

    def place(
        self, gm_id: str, spec: TaskSpec, node: int, repartition: bool = False
    ) -> tuple[Decision, Sequence[Action]]:
        """Launch (or, ``repartition``, carve and launch) ``spec`` on ``node`` for
        ``gm_id``. Accepted over an older attempt of the task, the books replaced it:
        that one ends LOST and its worker kills it, so two attempts never run at once.
        The driver then ``hold``s its copy of the task."""
        refused = self.refusal(spec.job_id)
        if refused is not None:
            return refused, NOTHING
        older = self.books.allocations.get(spec.task_id)
        place = self.books.repartition if repartition else self.books.launch
        decision = place(gm_id, spec, node)
        if decision.status is not PlacementStatus.ACCEPTED or older is None:
            return decision, NOTHING
        return decision, self._supersede(older)

    def preempt(
        self,
        gm_id: str,
        spec: TaskSpec,
        node: int,
        victim_ids: Sequence[str],
        is_over_share: Callable[[str], bool],
    ) -> tuple[Decision, list[Action]]:
        """Kill ``victim_ids`` on ``node`` for ``spec`` if still justified. The victims
        end on the books now (the task takes their place: the driver then ``hold``s and
        starts it, its start after their kills on the worker's stream), and are told
        PREEMPTED; their next attempts wait until the kills took effect (``stopping``)."""
        refused = self.refusal(spec.job_id)
        if refused is not None:
            return refused, []
        older = self.books.allocations.get(spec.task_id)
        decision = self.books.preempt(gm_id, spec, node, victim_ids, is_over_share)
        if decision.status is not PlacementStatus.ACCEPTED:
            return decision, []
        # Each victim is stopping (journalled, ``Owe``) before its kill goes out: a kill
        # that takes its start back at once re-queues it then (``withdrawn``), and the
        # journal's row must not be written after that, or a restart would queue it again.
        actions: list[Action] = []
        for victim in decision.preempted:
            actions.extend(self._stop(victim, TaskState.PREEMPTED, "preempted"))
        actions.extend(Kill(v.node, v.task_id, v.attempt, "preempted") for v in decision.preempted)
        if older is not None and all(v.task_id != older.task_id for v in decision.preempted):
            # (The live LM did not check this before the lifecycle moved here: the older
            # attempt was dropped from the books and left running on its worker.)
            actions.extend(self._supersede(older))
        return decision, actions

    def stop(self, task_id: str, attempt: int, reason: str) -> list[Action]:
        """A GM stops ``attempt`` of ``task_id`` (a gang restarting whole without it):
        if it is the attempt held, it ends on the books now, told LOST with ``reason``,
        and is killed; its next attempt waits for the kill to take effect
        (``stopping``), as a preempted victim's does. Else (ended, another attempt, a
        placeholder): nothing."""
        allocation = self.books.allocations.get(task_id)
        task = self.tasks.get(task_id)
        if allocation is None or task is None or allocation.attempt != attempt:
            return []
        if task.attempt != attempt:
            return []
        self.books.release(task_id)
        # Stopping (journalled, ``Owe``) before its kill goes out: see ``preempt``.
        actions = self._stop(allocation, TaskState.LOST, reason)
        actions.append(Kill(allocation.node, task_id, attempt, reason))
        return actions

    def evictable(
        self, task_id: str, attempt: int, is_over_share: Callable[[str], bool]
    ) -> Allocation | None:
        """The allocation of ``task_id`` if it is ``attempt``, no gang's, and of a queue
        over its share; else None."""
        allocation = self.books.allocations.get(task_id)
        if allocation is None or allocation.attempt != attempt or allocation.gang:
            return None
        return allocation if is_over_share(allocation.queue) else None

    def evict_books(
        self,
        task_id: str,
        attempt: int,
        is_over_share: Callable[[str], bool],
        room_for: RoomFor | None = None,
    ) -> Allocation | None:
        """The books' half of ``evict``: ``attempt`` of ``task_id``, if ``evictable``,
        leaves the books, and with ``room_for`` its room is held for that gang job
        (``Reservations.hold_room``) until it reserves here. Returns what was released.
        (The simulator, which keeps no tasks, calls this alone.)"""
        allocation = self.evictable(task_id, attempt, is_over_share)
        if allocation is None:
            return None
        self.books.release(task_id)
        if room_for is not None:
            room_for.gangs.hold_room(room_for.job_id, allocation, room_for.now, room_for.ttl_s)
        return allocation

    def evict(
        self,
        task_id: str,
        attempt: int,
        is_over_share: Callable[[str], bool],
        reason: str,
        room_for: RoomFor | None = None,
    ) -> list[Action]:
        """A GM preempts ``attempt`` of ``task_id`` for a waiting gang (which then starts
        whole in the room once it is free, held for it with ``room_for``): if it is the
        attempt held, of a queue over its share and no gang's, it ends on the books now,
        told PREEMPTED with ``reason``, and is killed; its next attempt waits for the
        kill (``stopping``), as a preempted victim's does. Else nothing (the GM's view
        was stale)."""
        task = self.tasks.get(task_id)
        if task is None or task.attempt != attempt:
            return []
        allocation = self.evict_books(task_id, attempt, is_over_share, room_for)
        if allocation is None:
            return []
        actions = self._stop(allocation, TaskState.PREEMPTED, reason)
        actions.append(Kill(allocation.node, task_id, attempt, reason))
        return actions

    def hold(self, task: T, allocation: Allocation) -> list[Action]:
        """``task`` (the driver's own copy) is the attempt the books just accepted."""
        self.tasks[task.task_id] = task
        self._unorphan(task.task_id, task.attempt)
        return [Start(allocation.node, task), Publish(task, TaskState.PLACED, allocation.node)]

    def _supersede(self, older: Allocation) -> list[Action]:
        actions: list[Action] = [Kill(older.node, older.task_id, older.attempt, "superseded")]
        task = self.tasks.get(older.task_id)
        if task is not None and task.attempt == older.attempt:
            del self.tasks[older.task_id]
            actions.append(Publish(task, TaskState.LOST, older.node, "superseded"))
        return actions

    # ---------------------------------------------------------- reports
    def report(self, node: int, report: WorkerReport) -> ReportOutcome[T]:
        """A worker's report on one of its attempts."""
        key = (report.task_id, report.attempt)
        stop = self.stopping.get(key)
        # (node -1: recalled after a restart, and no registration named it yet: its
        # worker's report, sent again on a new stream, says where it was and that it ended)
        if stop is not None and stop.node in (node, -1) and report.state != TaskState.RUNNING:
            # A killed attempt ended (killed, or it finished or failed before the kill
            # came): now its next attempt cannot run beside it.
            del self.stopping[key]
            return ReportOutcome(ReportVerdict.STOPPED, None, [Requeue(stop.task, owed=True)])
        task = self.tasks.get(report.task_id)
        allocation = self.books.allocations.get(report.task_id)
        if task is None or allocation is None or allocation.node != node:
            return ReportOutcome(ReportVerdict.IGNORED)  # an attempt that ended here
        if report.attempt != allocation.attempt:
            return ReportOutcome(ReportVerdict.IGNORED)
        state = report.state
        if state == TaskState.RUNNING and task.timestamps.started_unix_nanos:
            return ReportOutcome(ReportVerdict.KNOWN)
        if state == TaskState.LOST:
            # The worker killed it, going away (a graceful stop): queued again now, not
            # once the watchdog takes the node for dead.
            self.books.release(report.task_id)
            actions = self._requeue(allocation, TaskState.LOST, report.message)
            return ReportOutcome(ReportVerdict.LOST, task, actions)
        if state == TaskState.FAILED and task.failures < task.max_retries:
            # Its own failure, with retries left: the next attempt is queued now.
            self.books.release(report.task_id)
            task.failures += 1
            actions = self._requeue(
                allocation, TaskState.RETRYING, report.message, report.peak_memory_mb
            )
            return ReportOutcome(ReportVerdict.RETRYING, task, actions)
        verdict = ReportVerdict.PROGRESS
        if state in RUN_ENDED:
            self.books.release(report.task_id)
            del self.tasks[report.task_id]
            verdict = ReportVerdict.ENDED
        publish = Publish(task, state, node, report.message, report.peak_memory_mb)
        return ReportOutcome(verdict, task, [publish])

    def _requeue(
        self, allocation: Allocation, state: TaskState, reason: str, peak_memory_mb: int = 0
    ) -> list[Action]:
        """``allocation`` lost its place (released already): if its attempt is the one
        held, it is held no more, its end is told and its next attempt queued; else
        (re-queued already, or a later attempt runs now) nothing."""
        task = self.tasks.get(allocation.task_id)
        if task is None or task.attempt != allocation.attempt:
            return []
        del self.tasks[allocation.task_id]
        return [Publish(task, state, allocation.node, reason, peak_memory_mb), Requeue(task)]

    def _stop(self, allocation: Allocation, state: TaskState, reason: str) -> list[Action]:
        """``allocation`` lost its place (released already) and its worker is told to
        kill it: if its attempt is the one held, it is held no more and its end is told;
        its next attempt waits in ``stopping`` for the kill to take effect."""
        task = self.tasks.get(allocation.task_id)
        if task is None or task.attempt != allocation.attempt:
            return []
        del self.tasks[allocation.task_id]
        self.stopping[allocation.task_id, allocation.attempt] = Stopping(task, allocation.node)
        return [Publish(task, state, allocation.node, reason), Owe(task)]

    def withdrawn(self, task_id: str, attempt: int) -> list[Action]:
        """The driver took back the start of ``attempt`` of ``task_id`` before it left
        for the worker (its kill found it still waiting): it never ran, and will not."""
        stop = self.stopping.pop((task_id, attempt), None)
        return [] if stop is None else [Requeue(stop.task, owed=True)]

    def _stopped_on(self, node: int, still_there: Callable[[str, int], bool]) -> list[Action]:
        """The stopping attempts on ``node`` that ``still_there`` says can no longer run:
        their next attempts queued."""
        ended = [
            key
            for key, stop in self.stopping.items()
            if stop.node == node and not still_there(*key)
        ]
        return [Requeue(self.stopping.pop(key).task, owed=True) for key in ended]

    # -------------------------------------------------------- inventory
    def take_back(
        self, node: int, held: Sequence[Held[T]], pending: Iterable[str] = ()
    ) -> TakeBack[T]:
        """Square the books with what ``node``'s registering worker holds (``held``) and
        what waits to be sent to it (``pending``, task ids). What it holds that the books
        do not is booked (after an LM restart they are empty: unbooked, the tasks would
        run and their ends reach no one), unless the books saw that attempt end or a GM
        fenced it: a running one is killed. What the books hold on the node that the
        worker neither holds nor is yet to be sent was lost with it (a worker process
        that died and came back before the watchdog noticed): released and re-queued.
        Tasks it runs of jobs cancelled meanwhile are cancelled."""
        books = self.books
        # By attempt: a worker that names an earlier attempt of a task (ended there, its
        # report owed) does not hold the attempt the books put on it since.
        newest: dict[str, int] = {}
        for h in held:
            newest[h.task.task_id] = max(h.task.attempt, newest.get(h.task.task_id, -1))
        pending_ids = set(pending)
        for h in held:
            self._unorphan(h.task.task_id, h.task.attempt)
            key = (h.task.task_id, h.task.attempt)
            recalled = self.stopping.get(key)
            if recalled is not None and recalled.node == -1:
                # A killed attempt an earlier life owed the next of: it is on this node.
                self.stopping[key] = Stopping(recalled.task, node)
        missing = [
            allocation
            for allocation in (books.allocations[t] for t in books.task_ids_on(node))
            if allocation.task_id not in pending_ids
            and newest.get(allocation.task_id, -1) < allocation.attempt
            and not is_placeholder(allocation.task_id)  # a gang's held room: no worker's
        ]
        for allocation in missing:
            books.release(allocation.task_id)
        plan: TakeBack[T] = TakeBack()
        stale: list[Action] = []
        for h in held:
            task = h.task
            if h.spec is None:
                plan.verdicts.append((task.task_id, InventoryVerdict.MALFORMED))
                continue
            booked = books.allocations.get(task.task_id)
            if booked is not None and booked.node == node and booked.attempt == task.attempt:
                plan.verdicts.append((task.task_id, InventoryVerdict.KNOWN))
                continue
            if books.adopt(h.spec, node) is None:
                if h.running:
                    reason = "this attempt ended on the LM's books"
                    stale.append(Kill(node, task.task_id, task.attempt, reason))
                    plan.verdicts.append((task.task_id, InventoryVerdict.STALE))
                else:
                    plan.verdicts.append((task.task_id, InventoryVerdict.REFUSED))
                continue
            self.tasks[task.task_id] = task
            plan.actions.append(Journal(task))
            plan.verdicts.append((task.task_id, InventoryVerdict.ADOPTED))
        # Cancelled after this LM restarted, before the worker came back.
        doomed = {h.task.job_id for h in held if h.running and h.task.job_id in self.cancelled}
        if doomed:
            cancels = self.cancel(doomed)
            plan.cancelled_jobs = doomed
            plan.cancelled = sum(isinstance(a, Publish) for a in cancels)
            plan.actions.extend(cancels)
        plan.actions.extend(stale)
        node_id = books.table.node_ids[node]
        for allocation in missing:
            plan.verdicts.append((allocation.task_id, InventoryVerdict.MISSING))
            reason = f"worker {node_id} came back without it (restarted?)"
            plan.actions.extend(self._requeue(allocation, TaskState.LOST, reason))
        # A killed attempt the worker still runs (its kill was lost with the stream: sent
        # again above, STALE) or whose start still waits to be sent stops later; one it
        # does not run (ended, or never got) stopped.
        running = {(h.task.task_id, h.task.attempt) for h in held if h.running}
        plan.actions.extend(
            self._stopped_on(node, lambda t, a: (t, a) in running or t in pending_ids)
        )
        return plan

    def node_lost(self, node: int, reason: str, now: float | None = None) -> NodeLoss[T]:
        """``node`` is dead (silent, or its worker said it leaves): out of the books, its
        tasks re-queued, and the attempts killed there (``stopping``) too: a worker silent
        for ``worker_timeout_s`` has fenced itself by then (when the fence is on). The
        driver also drops what still waits to be sent to it: a start reaching it when it
        comes back would run its task twice. With ``now``, the node may be forgotten once
        it has stayed lost long enough (``forgettable``)."""
        if now is not None and self.books.table.is_alive(node):
            self.lost_at[node] = now
        lost = self.books.set_alive(node, False)
        loss: NodeLoss[T] = NodeLoss(lost)
        for allocation in lost:
            loss.actions.extend(self._requeue(allocation, TaskState.LOST, f"worker lost: {reason}"))
        loss.actions.extend(self._stopped_on(node, lambda task_id, attempt: False))
        return loss

    def cancel(self, job_ids: set[str]) -> list[Action]:
        """End the held tasks of cancelled ``job_ids`` CANCELLED and kill them on their
        workers; a later report of the kill finds nothing held. (``cancelled`` already
        has the jobs, with their reasons.)"""
        actions: list[Action] = []
        for task in [t for t in self.tasks.values() if t.job_id in job_ids]:
            allocation = self.books.allocations.get(task.task_id)
            if allocation is None:
                continue
            reason = self.cancelled.reason(task.job_id) or "cancelled"
            self.books.release(task.task_id)
            del self.tasks[task.task_id]
            actions.append(Publish(task, TaskState.CANCELLED, allocation.node, reason))
            actions.append(
                Kill(allocation.node, task.task_id, allocation.attempt, f"cancelled: {reason}")
            )
        return actions

    # --------------------------------------------------------- watchdog
    def heard(self, node: int, now: float) -> None:
        """``node``'s worker was heard from (it registered, or sent a heartbeat)."""
        self.last_heard[node] = now
        self.lost_at.pop(node, None)

    def forgettable(self, now: float, after_s: float) -> list[int]:
        """Nodes lost for longer than ``after_s`` that never came back: the driver
        ``forget``s them. None when ``after_s`` is 0 (never forget)."""
        if after_s <= 0:
            return []
        table = self.books.table
        return [
            node
            for node, since in self.lost_at.items()
            if now - since > after_s and not table.is_alive(node)
        ]

    def forget(self, node: int) -> bool:
        """Forget a node that stayed lost: its row leaves the books
        (``ClusterState.forget_node``), so GMs stop listing it; its worker, if it ever
        comes back, registers as a new node. Refused (False, kept) while anything still
        refers to the node: it is alive, holds allocations, or has killed attempts whose
        end is awaited there (``node_lost`` queued those, so none should be left)."""
        if any(stop.node == node for stop in self.stopping.values()):
            return False
        if not self.books.forget_node(node):
            return False
        self.last_heard.pop(node, None)
        self.lost_at.pop(node, None)
        return True

    def silent(self, now: float) -> Iterator[int]:
        """Alive nodes not heard from for longer than ``worker_timeout_s``: dead. Lazy,
        so a node heard from (or taken for dead) while the driver acts on an earlier one
        is judged as it is then."""
        timeout = self.worker_timeout_s
        for node in list(self.last_heard):
            if now - self.last_heard[node] > timeout and self.books.table.is_alive(node):
                yield node

    # ---------------------------------------------------------- orphans
    def recall(self, orphans: Iterable[T], owed: Iterable[T] = ()) -> None:
        """Tasks an earlier life accepted and never saw end, and killed attempts whose
        next it owed (from the journal). A killed attempt ended on the books when it was
        killed, though its ending may not have been written before the LM died (the kill's
        row is written at once, the ending on the loop's next turn): it is no orphan (its
        next attempt would be queued twice, by the orphan's expiry and by its own), and a
        worker that still runs it has it killed, not adopted."""
        for task in owed:
            self.stopping[task.task_id, task.attempt] = Stopping(task, -1)
            self.books.remember_ended(task.task_id, task.attempt, task.job_id)
        self.orphans = {
            task.task_id: task
            for task in orphans
            if (task.task_id, task.attempt) not in self.stopping
        }

    @property
    def unclaimed(self) -> bool:
        """Something recalled waits for the workers to name it (``expire_orphan``)."""
        return bool(self.orphans) or any(s.node == -1 for s in self.stopping.values())

    def arm_orphans(self, now: float) -> float:
        """Start the orphans' grace (as the LM starts serving): returns when it is over."""
        self.orphans_due = now + self.orphan_grace_s
        return self.orphans_due

    def expire_orphan(self, now: float) -> list[Action] | None:
        """Past the grace, the oldest orphan: its worker died too, or never got it. Ended
        on the books first (a worker naming it later has its copy killed), its next
        attempt queued, this one ended LOST. Then each recalled killed attempt no worker
        named: its worker died, or fenced itself, so its next is queued. None: none is
        due."""
        if now < self.orphans_due:
            return None
        if not self.orphans:
            unnamed = next((k for k, s in self.stopping.items() if s.node == -1), None)
            if unnamed is None:
                return None
            return [Requeue(self.stopping.pop(unnamed).task, owed=True)]
        task = self.orphans.pop(next(iter(self.orphans)))
        self.books.remember_ended(task.task_id, task.attempt, task.job_id)
        restarted = f"{self.books.lm_id} restarted"
        return [Requeue(task), Publish(task, TaskState.LOST, -1, restarted)]

    def _unorphan(self, task_id: str, attempt: int) -> None:
        """This attempt of the task (or a later one) is held again: no orphan any more."""
        orphan = self.orphans.get(task_id)
        if orphan is not None and orphan.attempt <= attempt:
            del self.orphans[task_id]

    # ------------------------------------------------------------ views
    def lookup(self, task_ids: Iterable[str], fence_lease: int = 0) -> list[Lookup]:
        """What this LM knows of ``task_ids`` (those it never launched are left out).
        With ``fence_lease``, in the same step: every request of these tasks read after
        this with an older lease does nothing (``ClusterState.fence``), except of those
        it holds (booked, or orphans), which the GM counts as launched and whose
        worker's copy must still be taken back when it registers."""
        found: list[Lookup] = []
        held: set[str] = set()
        task_ids = list(task_ids)
        for task_id in task_ids:
            known = self.books.known_attempt(task_id)
            orphan = self.orphans.get(task_id)
            if orphan is not None and (known is None or known[0] < orphan.attempt):
                # Not ended: a worker may still name it. (The books may remember an
                # earlier attempt that ended here: that one is not what this LM holds.)
                known = orphan.attempt, True
            if known is None:
                continue
            if known[1]:
                held.add(task_id)
            found.append(Lookup(task_id, known[0], known[1]))
        if fence_lease:
            for task_id in task_ids:
                if task_id not in held:
                    self.books.fence(task_id, fence_lease)
        return found

    def listing(self) -> Iterator[tuple[T, TaskState, int]]:
        """Every task held, with its state and node (-1: an orphan, on no node yet)."""
        for task_id, task in self.tasks.items():
            allocation = self.books.allocations.get(task_id)
            if allocation is not None:
                started = task.timestamps.started_unix_nanos
                state = TaskState.RUNNING if started else TaskState.PLACED
                yield task, state, allocation.node
        for task in self.orphans.values():
            yield task, TaskState.PLACED, -1
