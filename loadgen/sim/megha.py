"""Megha in virtual time: simulated GMs and LMs that call the same ``services.core`` classes
as the live services, with messages, heartbeats and processing as timed events.

    job arrival ──▶ GM user queue (UserQueues) ──round──▶ GlobalView.match + reserve, per task
        GM busy gm_match_s per match; one message per (LM, launch|repartition) per round
    ──delay──▶ LM: ClusterState.launch / repartition, lm_validate_s per request
        accepted ──delay──▶ worker starts it ──duration──▶ finishes ──delay──▶ LM release
                                           ──delay──▶ GM(s) GlobalView.release (finish_notify)
        rejected ──delay──▶ reply with ClusterState.snapshot(since GM's version)
                             ──▶ GM: release reservation, GlobalView.apply, retry first
    every heartbeat_interval_s per LM ──delay──▶ every GM applies the LM's delta snapshot
    (a message every GM hears, an end or a heartbeat, reaches them in a seeded random
    order: live, each GM consumes its own queue, and none is always first)
    no node anywhere ──▶ fairness (Alg. 2, when on) else the task waits (parked) until the
        view changes, exactly as the live GM (services/global_master/service.py)

Gangs (``SimConfig.gangs``, issue 33): a job arrives as one ``Gang`` in its GM's gang
queue (FIFO, ahead of single tasks); the GM plans it whole (``plan_gang``, busy
``gm_match_s`` per member), books it and sends each LM its pieces; each LM holds them
(``Reservations.reserve``) and answers; when all accepted the GM sends the commits and
the LMs start the tasks, else it releases the gang everywhere and plans it again after
the next view change: the core's protocol in virtual time, as the live GM
(``services/global_master/gangs.py``) and LM (``ReserveGang`` / ``CommitGang`` /
``ReleaseGang``) drive it.

The only liberty taken with the live GM is bookkeeping: queue items are runs of a job's
tasks of one shape instead of single tasks, so a backlog of N identical tasks costs one
park, not N. Decisions, their order, and the per-round shape cache are the live GM's.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from loadgen.queues import (
    Attempts,
    assign_queues,
    gm_index,
    measured_shares,
    peak_held,
    summary_queues,
)
from loadgen.sim.config import SimConfig, ns
from loadgen.sim.engine import Engine
from loadgen.sim.workload import TaskLog, Workload
from services.common.config import QueueConfig
from services.core.cluster_state import ClusterState
from services.core.constraints import DEFAULT_NUM_CONSTRAINTS
from services.core.contention import Backlog, OwnerFirst
from services.core.fairness import FairShare, usage_by_queue
from services.core.gang import (
    GANG_EVICT_S,
    GANG_RETRY_S,
    Eviction,
    Gang,
    GangPiece,
    GangPlan,
    book,
    gang_never_fits,
    plan_gang,
    unbook,
)
from services.core.global_view import ApplyResult, GlobalView, PreemptionPlan
from services.core.limits import QueueLimits
from services.core.lm_lifecycle import Lifecycle, RoomFor
from services.core.match import make_policy
from services.core.reservations import GangVerdict, Reservations, held_for, room_id
from services.core.resources import NET, resources
from services.core.scheduler import Decided, Scheduler
from services.core.snapshot import Allocation, Snapshot
from services.core.status import PlacementStatus, Schedulability, Verdict
from services.core.task import TaskSpec
from services.core.user_queues import UserQueues
from services.core.vdc import Vdc

ACCEPTED = PlacementStatus.ACCEPTED


@dataclass(eq=False, slots=True)
class TaskRun:
    """Consecutive tasks of one job with one shape, waiting in a user queue, in order:
    the scheduler core's ``Work`` (a backlog of identical tasks parks as one item)."""

    tasks: list[int]
    shape: int
    specs: list[TaskSpec | None]  # every task's spec, by task index (the simulator's)
    queued: np.ndarray  # every task's queued stamp (ns), by task index (the log's)
    pos: int = 0
    rejections: int = 0
    lease: int = 0

    def head(self) -> TaskSpec:
        spec = self.specs[self.tasks[self.pos]]
        assert spec is not None
        return spec

    def take(self) -> int:
        self.pos += 1
        return self.tasks[self.pos - 1]

    @property
    def enqueued(self) -> float:
        """When the next task was queued (virtual seconds): a run that joined others
        is as old as the task it would place next, not as its first."""
        return float(self.queued[self.tasks[min(self.pos, len(self.tasks) - 1)]]) / 1e9

    def join(self, other: TaskRun) -> bool:
        """Not when ``other``'s next task is older than this run's last: it would then
        wait behind younger work (a launch an LM refused, queued again)."""
        if other.shape != self.shape:
            return False
        queued = self.queued
        if queued[other.tasks[other.pos]] < queued[self.tasks[-1]]:
            return False
        self.tasks.extend(other.tasks[other.pos :])
        return True

    def __len__(self) -> int:
        return len(self.tasks) - self.pos


class _Orders:
    """Seeded random orders of the GMs, for messages every GM hears at the same moment.

    Live, every GM consumes its own copy of a heartbeat or lifecycle event, so which GM
    acts on freed room first is a race none wins always. Delivering in ``self.gms`` order
    made gm0 win every race (issue 29: per-GM mean allocation time rose with the GM's
    index, 17x apart at 5,000 workers). Permutations are drawn in blocks: one per
    message would cost more than the message.
    """

    BLOCK = 4096

    def __init__(self, rng: np.random.Generator, count: int):
        self.rng = rng
        self.count = count
        self._block: list[list[int]] = []

    def shuffled(self, gms: list[SimGM]) -> list[SimGM]:
        if len(gms) < 2:
            return gms
        if len(gms) != self.count:  # not every GM: rare (owner-only notices are one)
            return [gms[i] for i in self.rng.permutation(len(gms))]
        if not self._block:
            rows = np.tile(np.arange(self.count), (self.BLOCK, 1))
            self._block = self.rng.permuted(rows, axis=1).tolist()
        return [gms[i] for i in self._block.pop()]


@dataclass(eq=False)
class SimLM:
    index: int
    life: Lifecycle  # the LM's decisions over its books (the simulator keeps no tasks)
    busy_until: int = 0
    published: int | None = None  # version of the last heartbeat; None: send a full one
    reservations: Reservations | None = None  # gangs' reserve / commit (SimConfig.gangs)

    @property
    def state(self) -> ClusterState:
        return self.life.books


@dataclass(eq=False)
class SimGM:
    index: int
    gm_id: str
    scheduler: Scheduler[TaskRun]
    busy_until: int = 0
    round_pending: bool = False
    recheck_at: int | None = None  # a round asked to try parked work again then
    infeasible_shapes: dict[tuple[str, int], bool] = field(default_factory=dict)
    # Gangs waiting for room, oldest first, and those whose reservations are under way.
    gangs: collections.deque[GangWait] = field(default_factory=collections.deque)
    reserving: dict[str, GangTry] = field(default_factory=dict)
    # Ends it only counted (``_blind_to_ends``), by LM and node id, until it runs an end
    # on that node or a snapshot of that LM comes: (task id, attempt, heard, claimant).
    put_off: dict[str, dict[str, list[tuple[str, int, float, str | None]]]] = field(
        default_factory=dict
    )

    @property
    def view(self) -> GlobalView:
        return self.scheduler.view


@dataclass(eq=False, slots=True)
class GangWait:
    """A job waiting to start as a gang: its tasks are ``first + member``."""

    gang: Gang
    first: int
    tries: int = 0
    # The view (each LM's table and version) it last found no room in: planning it
    # again before one of them changes would find none again.
    missed: tuple = ()
    evict_after: int = 0  # no preemption for it before then (virtual ns; GANG_EVICT_S)
    evict_due: bool = False  # a round is set for evict_after, view changed or not
    # (lm_id, placeholder id) of the room its victims left it, held by their LMs for
    # its job (``Reservations.hold_room``), as the live GangJob's.
    held: list[tuple[str, str]] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class GangTry:
    """One attempt to place a gang: its plan and the LMs' answers so far."""

    wait: GangWait
    plan: GangPlan
    answers: dict[str, GangVerdict] = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class EvictionTry:
    """A waiting gang's preemption: the victims' LMs still to answer, and how many of
    the victims they stopped."""

    wait: GangWait
    eviction: Eviction
    waiting: int
    stopped: int = 0


@dataclass
class Counters:
    inconsistencies: int = 0  # LM replies that carried state (the live GM's counter)
    rejected_placements: int = 0
    repartitions: int = 0  # repartition requests sent (the live GM's counter)
    repartitions_accepted: int = 0
    preemption_attempts: int = 0
    preemptions: int = 0
    rounds: int = 0
    matches: int = 0
    heartbeats: int = 0
    full_snapshots: int = 0
    finish_notices: int = 0
    gangs_started: int = 0
    gang_refusals: int = 0  # attempts an LM refused (all their pieces released)
    gangs_infeasible: int = 0


class MeghaSim:
    """G simulated GMs and L simulated LMs over ``workers`` nodes (``central``: 1 x 1)."""

    # Run an end only through the GMs it can change (``_blind_to_ends``); a test turns
    # it off to show the decisions are the same.
    SKIP_IDLE_ENDS = True

    def __init__(
        self,
        config: SimConfig,
        workload: Workload,
        engine: Engine,
        rng: np.random.Generator,
        num_constraints: int = DEFAULT_NUM_CONSTRAINTS,
        machine_masks: np.ndarray | None = None,
    ):
        """``machine_masks[w]``: the constraints worker ``w`` satisfies (bit c = constraint
        c); none by default, as ``.tr`` traces have no constraints."""
        self.config = config = config.effective()
        if machine_masks is not None and len(machine_masks) != config.workers:
            raise ValueError(
                f"{len(machine_masks)} machine constraint masks for {config.workers} workers"
            )
        self.workload = workload
        self.engine = engine
        self.rng = rng
        self.log = TaskLog(workload.tasks)
        self.counters = Counters()
        self.delay = ns(config.network_delay_s)
        self.match_ns = ns(config.gm_match_s)
        self.validate_ns = ns(config.lm_validate_s)
        self.heartbeat_ns = ns(config.heartbeat_interval_s)
        self.backlog_ns = ns(config.backlog_interval_s)
        self.remaining = workload.tasks
        self._orders = _Orders(rng, config.gms)
        self.total_capacity = resources(
            cpu_milli=config.cores_per_worker * 1000 * config.workers,
            memory_mb=config.memory_per_worker_mb * config.workers,
        )
        self.specs: list[TaskSpec | None] = [None] * workload.tasks
        # Victims come back from an LM by task id; only preemption needs the reverse map.
        self._task_index: dict[str, int] | None = {} if config.fair_share else None
        gm_ids = [f"gm{g}" for g in range(config.gms)]
        # User queues: the configured ones (tasks spread by ``assign_queues``), else one
        # per GM with equal shares and whole jobs round-robin over the GMs.
        self.queues = config.queues or tuple(
            QueueConfig(name=f"user{g}", share=1 / config.gms, gm=f"gm-{g + 1}")
            for g in range(config.gms)
        )
        self.queue_of: np.ndarray | None = (
            assign_queues(workload.users, workload.first, config.queues) if config.queues else None
        )
        names = [q.name for q in self.queues]
        self.queue_gm = np.array([gm_index(q.gm) for q in self.queues], dtype=np.int32)
        self.queue_names = names
        self.limits = QueueLimits.parse((q.name, q.limit) for q in self.queues)
        self.fair = FairShare([q.as_share() for q in self.queues], slack=config.preemption_slack)
        self.gms = [
            SimGM(
                index=g,
                gm_id=gm_ids[g],
                scheduler=Scheduler(
                    GlobalView(
                        gm_ids[g],
                        make_policy(config.policy),
                        num_constraints,
                        owner_grace_s=config.owner_grace_s,
                        claims=config.claims,
                    ),
                    UserQueues(n for n, at in zip(names, self.queue_gm, strict=True) if at == g),
                    self.fair if config.fair_share else None,
                    self.limits,
                    round_per_queue=config.round_size,
                    max_rejections=config.max_rejections,
                    explain=False,
                ),
            )
            for g in range(config.gms)
        ]
        # What fairness runs report: per queue, attempts lost to preemption, and every
        # preempted attempt's (task, queued, started, ended) for the measured shares.
        self.preempted_by_queue = np.zeros(len(names), dtype=np.int64)
        self.preempted_attempts: list[tuple[int, int, int, int]] = []
        self.lms = [
            SimLM(
                index,
                Lifecycle(
                    ClusterState(
                        f"lm{index}",
                        gm_ids,
                        num_constraints,
                        make_policy(config.policy),
                        delta_history=config.lm_delta_history,
                    )
                ),
            )
            for index in range(config.lms)
        ]
        capacity = resources(
            cpu_milli=config.cores_per_worker * 1000,
            memory_mb=config.memory_per_worker_mb,
            net_mbps=config.uplink_mbps,
        )
        base, extra = divmod(config.workers, config.lms)
        worker = 0
        for lm in self.lms:
            for _ in range(base + (lm.index < extra)):
                # No partition given: the node joins the smallest one, so every LM's nodes
                # are split evenly (interleaved) over the GMs.
                mask = 0 if machine_masks is None else int(machine_masks[worker])
                lm.state.add_node(f"w{worker}", capacity, constraint_mask=mask)
                worker += 1
        self._lm_index = {lm.state.lm_id: lm.index for lm in self.lms}
        self._gang_queues = frozenset(config.gang_queues)
        # Under ``OwnerFirst`` and ``OldestFirst`` (no shares, limits or gangs) a GM that
        # neither placed a task, nor owns its node, nor is named claimant of the room its
        # end frees holds that room for another until a snapshot shows the node, and the
        # snapshot shows it freed whether or not the GM heard the end: the end changes
        # none of its decisions, so the simulator only counts its claim there
        # (``GlobalView.count_end``; every GM must, to name the same claimants) and does
        # not run it through that GM (an end heard by every GM was a third of a run's
        # time at 10,000 workers). Sound while every snapshot comes within the grace.
        rule = self.gms[0].view.owner_first
        self._blind_to_ends = (
            self.SKIP_IDLE_ENDS
            and isinstance(rule, OwnerFirst)
            and not config.gangs
            and not config.fair_share
            and not any(q.limit for q in self.queues)
            and config.heartbeat_interval_s + 4 * config.network_delay_s < config.owner_grace_s
        )
        self.vdc = Vdc(*config.vdc) if config.vdc is not None else None
        self._empty: GlobalView | None = None
        # Gang members' task ids -> task index, from planning to commit.
        self._gang_task: dict[str, int] = {}
        if config.gangs:
            for lm in self.lms:
                lm.reservations = Reservations(lm.state, lm.life.cancelled)
            # The federation with nothing running: a gang this cannot hold never runs
            # (the simulated nodes never change).
            self._empty = GlobalView("gm0", num_constraints=num_constraints)
            for lm in self.lms:
                self._empty.apply(lm.state.snapshot(), 0.0)

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        engine = self.engine
        for lm in self.lms:
            self._heartbeat(lm, reschedule=False)  # full state before the first job
            phase = int(self.rng.integers(0, self.heartbeat_ns))
            engine.at(phase or self.heartbeat_ns, self._heartbeat, lm)
        for job in range(self.workload.jobs):
            engine.at(int(self.workload.arrival_ns[job]), self._arrive, job)
        if self.config.claims == "oldest" and len(self.gms) > 1:
            engine.at(self.backlog_ns, self._report_backlogs, ())

    def _report_backlogs(self, last: Sequence[Backlog]) -> None:
        """Every ``backlog_interval_s`` each GM reports its oldest waiting work to every
        GM, itself too (``OldestFirst``); while none has any, and none had, nothing is
        sent. A GM whose work did not change sends the same ``Backlog`` again, which
        a GM with nothing claimed on it since skips (``OldestFirst.backlogs``)."""
        if self.engine.stopped:
            return
        reports = []
        for i, gm in enumerate(self.gms):
            runs = gm.scheduler.backlog()
            report = Backlog.of(gm.gm_id, runs, gm.scheduler.room(q for _, _, q in runs))
            if last and (last[i].lanes, last[i].room) == (report.lanes, report.room):
                report = last[i]
            reports.append(report)
        if any(r.lanes for r in reports) or any(r.lanes for r in last):
            self.engine.at(self.engine.now + self.delay, self._learn_backlogs, reports)
        self.engine.at(self.engine.now + self.backlog_ns, self._report_backlogs, reports)

    def _learn_backlogs(self, reports: list[Backlog]) -> None:
        for gm in self.gms:
            if gm.scheduler.heard_backlogs(reports):
                self._wake(gm)

    # ------------------------------------------------------------- job arrival
    def _arrive(self, job: int) -> None:
        now = self.engine.now
        wl, log = self.workload, self.log
        lo, hi = int(wl.first[job]), int(wl.first[job + 1])
        if self.queue_of is None:
            queue_of = [job % len(self.gms)] * (hi - lo)
        else:
            if self._is_gang(int(self.queue_of[lo])):  # one queue's: its first task's
                self.queue_of[lo:hi] = self.queue_of[lo]
            queue_of = self.queue_of[lo:hi].tolist()
        log.stamps["submitted"][lo:hi] = now
        log.stamps["queued"][lo:hi] = now
        log.gm[lo:hi] = self.queue_gm[queue_of]
        job_id = wl.job_ids[job]
        if self._is_gang(queue_of[0]):
            self._arrive_gang(job, lo, hi, queue_of)
            return
        runs: dict[int, TaskRun] = {}  # the open run of each queue
        woken: dict[int, SimGM] = {}
        for task, q in zip(range(lo, hi), queue_of, strict=True):
            gm = self.gms[self.queue_gm[q]]
            queue = self.queue_names[q]
            shape = int(wl.shape_of[task])
            spec = TaskSpec(
                task_id=f"{job_id}.{task - lo}",
                resources=wl.shapes[shape].resources,
                constraint_mask=wl.shapes[shape].constraint_mask,
                queue=queue,
                job_id=job_id,
                duration_s=wl.duration_ns[task] / 1e9,
            )
            self.specs[task] = spec
            if self._task_index is not None:
                self._task_index[spec.task_id] = task
            if self._infeasible(gm, shape, spec):
                log.infeasible[task] = True
                self._finish_count()
                continue
            run = runs.get(q)
            if run is None or run.shape != shape:
                run = runs[q] = TaskRun([], shape, self.specs, log.stamps["queued"])
                gm.scheduler.submit(queue, run)
            run.tasks.append(task)
            woken[gm.index] = gm
        for gm in woken.values():
            self._wake(gm)

    def _is_gang(self, queue: int) -> bool:
        """Whether a job whose first task is in user queue ``queue`` is a gang."""
        return self.config.gangs and (
            not self._gang_queues or self.queue_names[queue] in self._gang_queues
        )

    def _specs(self, job: int, lo: int, hi: int, queue_of: list[int]) -> list[TaskSpec]:
        """A gang's members (the LM marks them so: never a preemption's victim)."""
        wl = self.workload
        specs = []
        for task, q in zip(range(lo, hi), queue_of, strict=True):
            shape = int(wl.shape_of[task])
            spec = TaskSpec(
                task_id=f"{wl.job_ids[job]}.{task - lo}",
                resources=wl.shapes[shape].resources,
                constraint_mask=wl.shapes[shape].constraint_mask,
                queue=self.queue_names[q],
                job_id=wl.job_ids[job],
                duration_s=wl.duration_ns[task] / 1e9,
                gang=True,
            )
            self.specs[task] = spec
            if self._task_index is not None:
                self._task_index[spec.task_id] = task
            specs.append(spec)
        return specs

    def _arrive_gang(self, job: int, lo: int, hi: int, queue_of: list[int]) -> None:
        """A job as one gang (one per VDC of at most ``peak_vdc`` tasks, with a VDC) of
        its first task's queue, planned by that queue's GM within its limit."""
        gm = self.gms[self.queue_gm[queue_of[0]]]
        self.log.gm[lo:hi] = gm.index
        specs = self._specs(job, lo, hi, queue_of)
        job_id = self.workload.job_ids[job]
        size = self.config.peak_vdc if self.vdc is not None and self.config.peak_vdc else hi - lo
        assert self._empty is not None
        for start in range(0, hi - lo, size):
            members = tuple(specs[start : start + size])
            gang_id = job_id if size == hi - lo else f"{job_id}:vdc{start // size}"
            gang = Gang(gang_id, members, 0, self.vdc)
            first = lo + start
            never = plan_gang(gang, self._empty)
            if gang_never_fits(gang, members[0].queue, self.limits) is not None or (
                isinstance(never, Verdict) and never.schedulability is Schedulability.INFEASIBLE
            ):
                self.counters.gangs_infeasible += 1
                self.log.infeasible[first : first + len(members)] = True
                for _ in members:
                    self._finish_count()
                continue
            gm.gangs.append(GangWait(gang, first))
        if gm.gangs:
            self._wake(gm)

    def _gang_round(self, gm: SimGM, now: int) -> int:
        """Plan the waiting gangs, oldest first, until one does not fit: a younger gang
        does not overtake an older one (it would starve a big gang). Returns the time the
        GM is busy until."""
        t = now
        view = gm.view
        lm_index = {lm.state.lm_id: lm for lm in self.lms}
        while gm.gangs:
            wait = gm.gangs[0]
            stamp = tuple((v.table, v.table.version) for v in view.lms.values())
            if wait.missed == stamp:
                if wait.evict_due and t >= wait.evict_after:  # the live loop's retry
                    self._evict_or_later(gm, wait, t)
                break
            t += self.match_ns * len(wait.gang.members)
            # Judged "never" at arrival (the simulated nodes never change).
            queue = wait.gang.members[0].queue
            outcome = gm.scheduler.plan_gang(
                queue, wait.gang, t / 1e9, judge_never=False, held=wait.held
            )
            if not isinstance(outcome, GangPlan):
                wait.missed = stamp
                if self.config.fair_share:
                    self._evict_or_later(gm, wait, t)
                break
            gm.gangs.popleft()
            wait.tries += 1
            gang_id = f"{wait.gang.gang_id}/{wait.tries}"
            book(view, outcome, t / 1e9)
            stamps = self.log.stamps
            for piece in outcome.pieces:
                task = wait.first + piece.member
                stamps["dequeued"][task] = now
                stamps["decided"][task] = t
                self._gang_task[piece.task.task_id] = task
            gm.reserving[gang_id] = GangTry(wait, outcome)
            self.counters.repartitions += sum(p.repartition for p in outcome.pieces)
            for lm_id, pieces in outcome.by_lm().items():
                lm = lm_index[lm_id]
                known = view.lms[lm_id].version
                self.engine.at(
                    t + self.delay, self._lm_reserve, lm, gm, gang_id, pieces, outcome, known
                )
        return t

    def _lm_reserve(
        self,
        lm: SimLM,
        gm: SimGM,
        gang_id: str,
        pieces: list[GangPiece],
        plan: GangPlan,
        known: int,
    ) -> None:
        assert lm.reservations is not None
        t = max(self.engine.now, lm.busy_until) + self.validate_ns * len(pieces)
        lm.busy_until = t
        verdict = lm.reservations.reserve(
            gang_id,
            pieces,
            t / 1e9,
            held_for(self.config.gang_ttl_s),
            gm_id=gm.gm_id,
            layout=plan.layout,
        )
        state = None if verdict.ok else lm.state.snapshot(known)
        self.engine.at(t + self.delay, self._gm_reserved, gm, lm, gang_id, verdict, state)

    def _gm_reserved(
        self, gm: SimGM, lm: SimLM, gang_id: str, verdict: GangVerdict, state: Snapshot | None
    ) -> None:
        attempt = gm.reserving[gang_id]
        attempt.answers[lm.state.lm_id] = verdict
        if state is not None:
            self.counters.inconsistencies += 1
        lms = attempt.plan.by_lm()
        if len(attempt.answers) < len(lms):
            if state is not None:
                self._apply(gm, lm, state)
            return
        del gm.reserving[gang_id]
        by_id = {held.state.lm_id: held for held in self.lms}
        now = self.engine.now
        if all(answer.ok for answer in attempt.answers.values()):
            for lm_id in lms:
                self.engine.at(now + self.delay, self._lm_commit, by_id[lm_id], gm, gang_id)
            return
        # Any refusal releases every piece: the LMs that hold theirs let go, the view
        # gives the plan back, and the gang waits for the next view change.
        self.counters.gang_refusals += 1
        for lm_id, answer in attempt.answers.items():
            if answer.ok:
                self.engine.at(now + self.delay, self._lm_release, by_id[lm_id], gang_id)
        unbook(gm.view, attempt.plan)
        if state is not None:
            self._apply(gm, lm, state)
        gm.gangs.appendleft(attempt.wait)
        self._wake(gm)

    def _lm_expire(self, lm: SimLM) -> None:
        assert lm.reservations is not None
        lm.reservations.expire(self.engine.now / 1e9)

    def _lm_release(self, lm: SimLM, gang_id: str) -> None:
        assert lm.reservations is not None
        lm.reservations.release(gang_id, self.engine.now / 1e9)

    def _lm_commit(self, lm: SimLM, gm: SimGM, gang_id: str) -> None:
        assert lm.reservations is not None
        now = self.engine.now
        t = max(now, lm.busy_until) + self.validate_ns
        lm.busy_until = t
        verdict = lm.reservations.commit(gang_id, t / 1e9)
        if not verdict.ok:
            # No failures are simulated and the ttl outlasts the round trip (``check``).
            raise RuntimeError(
                f"gang {gang_id} failed to commit on {lm.state.lm_id}: {verdict.reason}"
            )
        for allocation in verdict.allocations:
            task = self._gang_task.pop(allocation.task_id)
            self._start(lm, task, allocation.node, now, t)
            gm.view.accepted(lm.state.lm_id, allocation.task_id)
        self.counters.gangs_started += 1

    def _evict_or_later(self, gm: SimGM, wait: GangWait, t: int) -> None:
        """A gang found no room: it preempts now if it may, else a round comes when it
        may (the live gang's loop plans again every ``GANG_RETRY_S``)."""
        wait.evict_due = False
        if t >= wait.evict_after:
            self._evict_for(gm, wait, t)
        if t < wait.evict_after:
            wait.evict_due = True
            self.engine.at(wait.evict_after, self._wake, gm)

    def _evict_for(self, gm: SimGM, wait: GangWait, t: int) -> None:
        """A gang with no room preempts as one unit, if fairness lets it: the live GM's
        ``Gangs._evict`` (``Scheduler.gang_evictions``; StopTasks with preempt to each
        victim's LM; at most once per ``GANG_EVICT_S``)."""
        queue = wait.gang.members[0].queue
        eviction = gm.scheduler.gang_evictions(queue, wait.gang, t / 1e9)
        if not isinstance(eviction, Eviction):
            return
        wait.evict_after = t + ns(GANG_EVICT_S)
        wait.held = []
        by_lm: dict[str, list[tuple[str, int]]] = {}
        for lm_id, task_id, attempt in eviction.victims:
            by_lm.setdefault(lm_id, []).append((task_id, attempt))
        asked = EvictionTry(wait, eviction, len(by_lm))
        for lm_id, victims in by_lm.items():
            lm = self.lms[self._lm_index[lm_id]]
            known = gm.view.lms[lm_id].version
            self.engine.at(t + self.delay, self._lm_evict, lm, gm, asked, victims, known)

    def _lm_evict(
        self, lm: SimLM, gm: SimGM, asked: EvictionTry, victims: list[tuple[str, int]], known: int
    ) -> None:
        """The LM ends each victim PREEMPTED if it too finds it evictable
        (``Lifecycle.evictable``: that attempt, no gang's, its queue over its share), and
        answers with its state."""
        now = self.engine.now
        t = max(now, lm.busy_until) + self.validate_ns * len(victims)
        lm.busy_until = t
        over = self._over_share_now()
        job_id = asked.wait.gang.members[0].job_id
        assert lm.reservations is not None
        # Its room is the gang's until the gang reserves here (the live LM's StopTasks
        # with ``for_job_id``): a gang comes for it a round trip later.
        room_for = RoomFor(lm.reservations, job_id, t / 1e9, GANG_EVICT_S)
        stopped: list[tuple[str, int, Allocation]] = []
        for task_id, attempt in victims:
            allocation = lm.life.evict_books(task_id, attempt, over, room_for)
            if allocation is None:
                continue
            asked.wait.held.append((lm.state.lm_id, room_id(task_id, job_id)))
            stopped.append((task_id, attempt, allocation))
            # Its next attempt is queued once its worker reports the kill took effect
            # (``Lifecycle`` ``stopping``): a kill there and the report back.
            self._requeue(task_id, t, after=2 * self.delay)
        if stopped:  # what no reserve took is released then (the live LM's timer)
            self.engine.at(t + ns(GANG_EVICT_S), self._lm_expire, lm)
        if self.config.finish_notify == "all":  # the PREEMPTED events of the live LM
            for task_id, attempt, allocation in stopped:
                self.engine.at(
                    t + self.delay,
                    self._gms_learn_end,
                    lm,
                    task_id,
                    attempt,
                    lm.state.table.node_ids[allocation.node],
                    allocation.queue,
                    self.gms,
                )
        state = lm.state.snapshot(known)
        self.engine.at(t + self.delay, self._gm_evicted, gm, lm, asked, len(stopped), state)

    def _gm_evicted(
        self, gm: SimGM, lm: SimLM, asked: EvictionTry, stopped: int, state: Snapshot
    ) -> None:
        self.counters.preemptions += stopped
        asked.stopped += stopped
        asked.waiting -= 1
        self._apply(gm, lm, state)
        if asked.waiting:
            return
        gm.scheduler.evictions_replied(asked.eviction)
        if not asked.stopped:
            # None was over its share on its LM's word: asked again soon.
            asked.wait.evict_after = self.engine.now + ns(GANG_RETRY_S)
        self._wake(gm)

    def _infeasible(self, gm: SimGM, shape: int, spec: TaskSpec) -> bool:
        """The live GM refuses a task that can never run at submission (remembered per
        queue and shape: the simulated nodes never change)."""
        key = (spec.queue, shape)
        known = gm.infeasible_shapes.get(key)
        if known is None:
            never = gm.scheduler.never_runs(spec.queue, spec, None)
            known = gm.infeasible_shapes[key] = never is not None
        return known

    # ------------------------------------------------------------ GM rounds
    def _wake(self, gm: SimGM) -> None:
        if not gm.round_pending:
            gm.round_pending = True
            self.engine.at(max(self.engine.now, gm.busy_until), self._round, gm)

    def _round(self, gm: SimGM) -> None:
        """One scheduling round of the scheduler core, in virtual time: the GM is busy
        ``gm_match_s`` per match, and sends one message per (LM, launch|repartition)."""
        gm.round_pending = False
        now = self.engine.now
        if gm.gangs:
            # Gangs first (oldest first), then the queues' single tasks, if any.
            now = gm.busy_until = self._gang_round(gm, now)
            if not gm.scheduler.ready():
                return
        plan = gm.scheduler.round(now / 1e9)
        dequeued, decided = self.log.stamps["dequeued"], self.log.stamps["decided"]
        lm_index = self._lm_index
        end = now + plan.matches * self.match_ns
        gm.busy_until = end
        self.counters.rounds += 1
        self.counters.matches += plan.matches
        sent = end + self.delay
        view = gm.view
        for (lm_id, repartition), items in plan.launches.items():
            for d in items:
                dequeued[d.handle] = now
                decided[d.handle] = now + d.match * self.match_ns
            lm = self.lms[lm_index[lm_id]]
            if repartition:
                self.counters.repartitions += len(items)
            known = view.lms[lm_id].version
            self.engine.at(sent, self._lm_place, lm, gm, repartition, items, known)
        for p in plan.preemptions:
            dequeued[p.handle] = now
            decided[p.handle] = now + p.match * self.match_ns
            lm = self.lms[lm_index[p.plan.lm_id]]
            known = view.lms[p.plan.lm_id].version
            self.counters.preemption_attempts += 1
            self.engine.at(sent, self._lm_preempt, lm, gm, p.handle, p.spec, p.plan, known)
        if plan.more:
            self._wake(gm)
        if plan.recheck_in is not None:
            at = now + ns(plan.recheck_in)
            if gm.recheck_at is None or at < gm.recheck_at:
                gm.recheck_at = at
                self.engine.at(at, self._recheck, gm, at)

    def _recheck(self, gm: SimGM, at: int) -> None:
        """The live GM's ``_unpark_all`` timer: parked work is tried again."""
        if gm.recheck_at != at:
            return  # an earlier recheck took its place
        gm.recheck_at = None
        if gm.scheduler.recheck():
            self._wake(gm)

    # ------------------------------------------------------------- LM requests
    def _lm_place(
        self,
        lm: SimLM,
        gm: SimGM,
        repartition: bool,
        items: list[Decided],
        known: int,
    ) -> None:
        now = self.engine.now
        t = max(now, lm.busy_until)
        rejected: list[tuple[int, TaskSpec, PlacementStatus]] = []
        for d in items:
            t += self.validate_ns
            decision, _ = lm.life.place(gm.gm_id, d.spec, d.placement.node, repartition)
            if decision.status is ACCEPTED:
                if repartition:
                    self.counters.repartitions_accepted += 1
                self._start(lm, d.handle, d.placement.node, now, t)
            elif not decision.ok:
                rejected.append((d.handle, d.spec, decision.status))
        lm.busy_until = t
        state = lm.state.snapshot(known) if rejected else None
        if state is not None and state.full:
            self.counters.full_snapshots += 1
        self.engine.at(t + self.delay, self._gm_reply, gm, lm, rejected, state)

    def _start(self, lm: SimLM, task: int, node: int, received: int, decided: int) -> None:
        stamps = self.log.stamps
        stamps["lm_received"][task] = received
        stamps["lm_decided"][task] = decided
        arrives = decided + self.delay
        stamps["worker_received"][task] = arrives
        stamps["started"][task] = arrives
        self.log.lm[task] = lm.index
        self.log.node[task] = node
        if self.config.uplink_mbps:
            # What the LM booked on the node's uplink (a VDC member books its share).
            spec = self.specs[task]
            assert spec is not None
            allocation = lm.state.allocations.get(spec.task_id)
            if allocation is not None:
                self.log.net_mbps[task] = int(allocation.resources[NET])
        finish = arrives + int(self.workload.duration_ns[task])
        # The worker's report reaches the LM one delay after the task ends.
        self.engine.at(
            finish + self.delay, self._lm_task_ended, lm, task, int(self.log.attempt[task]), finish
        )

    def _lm_task_ended(self, lm: SimLM, task: int, attempt: int, finished: int) -> None:
        if self.log.attempt[task] != attempt:
            return  # that attempt was preempted; its resources went back then
        spec = self.specs[task]
        assert spec is not None
        lm.state.release(spec.task_id)
        self.log.stamps["finished"][task] = finished
        self._finish_count()
        notify = self.config.finish_notify
        if notify == "all":
            gms = self.gms
        elif notify == "owner":
            gms = [self.gms[int(self.log.gm[task])]]
        else:
            return
        # Who must act on the end: the task's GM, the node's owner and the claimant
        # (``_gms_learn_end``); every other GM would hold the room until the next
        # snapshot, which shows it anyway (``_blind_to_ends``).
        needs = None
        if self._blind_to_ends and len(gms) > 1:
            needs = (int(self.log.gm[task]), int(lm.state.table.owner[int(self.log.node[task])]))
        self.engine.at(
            self.engine.now + self.delay,
            self._gms_learn_end,
            lm,
            spec.task_id,
            attempt,
            lm.state.table.node_ids[int(self.log.node[task])],
            spec.queue,
            gms,
            needs,
        )

    def _finish_count(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.engine.stop()

    def _gms_learn_end(
        self,
        lm: SimLM,
        task_id: str,
        attempt: int,
        node: str,
        queue: str,
        gms: list[SimGM],
        needs: tuple[int, int] | None = None,
    ) -> None:
        """The live GM's ``_on_events``: credit a finished task back before the heartbeat.
        ``needs``: the task's GM and its node's owner (``_lm_task_ended``); of the others
        only the claimant of the room runs the end, the rest count its claim alone
        (``_blind_to_ends``), each counted as told, as live. A GM runs the ends it only
        counted on a node before it runs one there itself: as the claimant of a later end
        it takes room its view must know freed (``GlobalView.replay_end``)."""
        lm_id = lm.state.lm_id
        now = self.engine.now / 1e9
        for gm in self._orders.shuffled(gms):
            self.counters.finish_notices += 1
            counted = needs is not None and gm.index not in needs
            if counted:
                named = gm.view.count_end(task_id, attempt, queue)
                if named != gm.gm_id:
                    gm.put_off.setdefault(lm_id, {}).setdefault(node, []).append(
                        (task_id, attempt, now, named)
                    )
                    continue
            put_off = gm.put_off.get(lm_id)
            if put_off and node in put_off:
                for earlier, tried, heard, claimant in put_off.pop(node):
                    gm.view.replay_end(lm_id, earlier, tried, heard, node, claimant)
            if counted:  # this GM is the claimant
                woke = gm.scheduler.ended_counted(lm_id, task_id, attempt, node, named, now)
            else:
                woke = gm.scheduler.ended([(lm_id, task_id, attempt, node, queue)], now)
            if woke or gm.gangs:
                self._wake(gm)

    def _lm_preempt(
        self, lm: SimLM, gm: SimGM, task: int, spec: TaskSpec, plan: PreemptionPlan, known: int
    ) -> None:
        now = self.engine.now
        state = lm.state
        t = max(now, lm.busy_until) + self.validate_ns
        lm.busy_until = t
        decision, _ = lm.life.preempt(
            gm.gm_id, spec, plan.victims.node, list(plan.victims.task_ids), self._over_share_now()
        )
        victims: list[str] = []
        if decision.status is ACCEPTED:
            for victim in decision.preempted:
                victims.append(victim.task_id)
                self._requeue(victim.task_id, t)
            self._start(lm, task, plan.victims.node, now, t)
            if self.config.finish_notify == "all":  # the PREEMPTED events of the live LM
                for victim in decision.preempted:
                    self.engine.at(
                        t + self.delay,
                        self._gms_learn_end,
                        lm,
                        victim.task_id,
                        victim.attempt,
                        state.table.node_ids[victim.node],
                        victim.queue,
                        self.gms,
                    )
        snap = state.snapshot(known) if not decision.ok else None
        self.engine.at(
            t + self.delay,
            self._gm_preempt_reply,
            gm,
            lm,
            task,
            spec,
            plan,
            decision.status,
            victims,
            snap,
        )

    def _over_share_now(self) -> Callable[[str], bool]:
        """Whether a queue is over its share on the federation's usage now. The live LM
        judges on its own books plus its peers' heartbeats; here every LM's books are at
        hand, so on the exact federation-wide usage (fixed when asked, as live)."""
        usage = usage_by_queue(
            itertools.chain.from_iterable(other.state.allocations.values() for other in self.lms)
        )
        total = self.total_capacity
        return lambda queue: self.fair.is_over_share(queue, usage, total)

    def _requeue(self, task_id: str, now: int, after: int = 0) -> None:
        """A preempted task goes back to its user queue as the next attempt (LM ``_owe``),
        ``after`` ns later than the one delay its message takes."""
        assert self._task_index is not None
        task = self._task_index[task_id]
        old = self.specs[task]
        assert old is not None
        log = self.log
        stamps = log.stamps
        self.preempted_attempts.append(
            (task, int(stamps["queued"][task]), int(stamps["started"][task]), now)
        )
        self.preempted_by_queue[self.queue_names.index(old.queue)] += 1
        log.attempt[task] += 1
        self.specs[task] = TaskSpec(
            task_id=old.task_id,
            resources=old.resources,
            constraint_mask=old.constraint_mask,
            queue=old.queue,
            job_id=old.job_id,
            attempt=int(log.attempt[task]),
            duration_s=old.duration_s,
        )
        submitted = log.stamps["submitted"][task]
        for name in log.stamps:
            log.stamps[name][task] = 0
        log.stamps["submitted"][task] = submitted
        log.stamps["queued"][task] = now + self.delay + after
        log.lm[task] = -1
        log.node[task] = -1
        owner = self.gms[int(log.gm[task])]
        self.engine.at(now + self.delay + after, self._requeued, owner, task)

    def _requeued(self, gm: SimGM, task: int) -> None:
        spec = self.specs[task]
        assert spec is not None
        queued = self.log.stamps["queued"]
        run = TaskRun([task], int(self.workload.shape_of[task]), self.specs, queued)
        gm.scheduler.submit(spec.queue, run)
        self._wake(gm)

    # ------------------------------------------------------------- GM replies
    def _gm_reply(
        self,
        gm: SimGM,
        lm: SimLM,
        rejected: list[tuple[int, TaskSpec, PlacementStatus]],
        state: Snapshot | None,
    ) -> None:
        lm_id = lm.state.lm_id
        for _, spec, _ in rejected:
            gm.scheduler.refused(lm_id, spec.task_id)
        if state is not None:
            self.counters.inconsistencies += 1
            self._apply(gm, lm, state)
        for task, _, status in rejected:
            self.counters.rejected_placements += 1
            self._rejected(gm, task, status)
        if rejected:
            self._wake(gm)

    def _gm_preempt_reply(
        self,
        gm: SimGM,
        lm: SimLM,
        task: int,
        spec: TaskSpec,
        plan: PreemptionPlan,
        status: PlacementStatus,
        victims: list[str],
        state: Snapshot | None,
    ) -> None:
        gm.scheduler.preempt_replied(plan, spec.task_id, status.ok)
        if state is not None:
            self._apply(gm, lm, state)
        if status.ok:
            self.counters.preemptions += len(victims)
        else:
            self._rejected(gm, task, status)
            self._wake(gm)

    def _rejected(self, gm: SimGM, task: int, status: PlacementStatus) -> None:
        log = self.log
        run = TaskRun([task], int(self.workload.shape_of[task]), self.specs, log.stamps["queued"])
        run.rejections = int(log.rejections[task])
        spec = self.specs[task]
        assert spec is not None
        gm.scheduler.rejected(spec.queue, run, status)
        log.rejections[task] = run.rejections

    # ------------------------------------------------------------- heartbeats
    def _heartbeat(self, lm: SimLM, reschedule: bool = True) -> None:
        if self.engine.stopped:
            return
        state = lm.state
        if lm.reservations is not None:
            lm.reservations.expire(self.engine.now / 1e9)
        # An LM whose books did not change since the last beat would send an empty delta
        # that every GM ignores (STALE): skipping it changes no decision.
        if state.version != lm.published:
            snap = state.snapshot(lm.published)
            lm.published = snap.version
            self.counters.heartbeats += 1
            if snap.full:
                self.counters.full_snapshots += 1
            self.engine.at(self.engine.now + self.delay, self._deliver_heartbeat, lm, snap)
        if reschedule:
            self.engine.at(self.engine.now + self.heartbeat_ns, self._heartbeat, lm)

    def _deliver_heartbeat(self, lm: SimLM, snap: Snapshot) -> None:
        for gm in self._orders.shuffled(self.gms):
            self._apply(gm, lm, snap)

    def _apply(self, gm: SimGM, lm: SimLM, snap: Snapshot) -> None:
        """The live GM's ``_apply_state``: fold in, fetch full state if the delta is too new."""
        result, wake = gm.scheduler.apply(snap, self.engine.now / 1e9)
        if gm.put_off and result is ApplyResult.APPLIED:
            gm.put_off.pop(snap.lm_id, None)  # what those ends would have told, it shows
        if result is ApplyResult.NEEDS_FULL:
            self.engine.at(self.engine.now + self.delay, self._get_state, gm, lm)
        elif wake or (gm.gangs and result is ApplyResult.APPLIED):
            self._wake(gm)

    def _get_state(self, gm: SimGM, lm: SimLM) -> None:
        self.counters.full_snapshots += 1
        self.engine.at(self.engine.now + self.delay, self._apply, gm, lm, lm.state.snapshot())

    # ------------------------------------------------------------- reporting
    def queue_report(self) -> tuple[dict, float]:
        """summary.json's ``"queues"`` (configured vs measured share, preemptions) and how
        long every queue was backlogged, from the task log and the preempted attempts."""
        log = self.log
        queue_of = (
            self.queue_of
            if self.queue_of is not None
            else np.repeat(
                np.arange(self.workload.jobs) % len(self.gms), np.diff(self.workload.first)
            )
        )
        feasible = np.flatnonzero(~log.infeasible)
        shapes = self.workload.shapes
        cpu_of = np.array([int(s.resources[0]) for s in shapes], dtype=np.int64)
        mem_of = np.array([int(s.resources[1]) for s in shapes], dtype=np.int64)
        pre = np.array(self.preempted_attempts, dtype=np.int64).reshape(-1, 4)
        tasks = np.concatenate([feasible, pre[:, 0]])
        shape = self.workload.shape_of[tasks]
        attempts = Attempts(
            queue=queue_of[tasks],
            enqueued=np.concatenate([log.stamps["queued"][feasible], pre[:, 1]]),
            started=np.concatenate([log.stamps["started"][feasible], pre[:, 2]]),
            ended=np.concatenate([log.stamps["finished"][feasible], pre[:, 3]]),
            cpu_milli=cpu_of[shape],
            memory_mb=mem_of[shape],
        )
        measured, window = measured_shares(
            attempts,
            len(self.queue_names),
            float(self.total_capacity[0]),
            float(self.total_capacity[1]),
        )
        counts = np.bincount(queue_of, minlength=len(self.queue_names))
        peaks = peak_held(attempts, len(self.queue_names))
        # Work thrown away: how long each preempted attempt had run (one preempted before
        # it started, its start stamp unset, lost none).
        ran = pre[:, 2] > 0
        lost = np.bincount(
            queue_of[pre[ran, 0]],
            weights=(pre[ran, 3] - pre[ran, 2]) / 1e9,
            minlength=len(self.queue_names),
        )
        rows = summary_queues(
            self.queues, measured, self.preempted_by_queue, counts, peaks, lost.tolist()
        )
        return rows, window
