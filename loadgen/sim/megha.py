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
    no node anywhere ──▶ fairness (Alg. 2, when on) else the task waits (parked) until the
        view changes, exactly as the live GM (services/global_master/service.py)

The only liberty taken with the live GM is bookkeeping: queue items are runs of a job's
tasks of one shape instead of single tasks, so a backlog of N identical tasks costs one
park, not N. Decisions, their order, and the per-round shape cache are the live GM's.
"""

from __future__ import annotations

import itertools
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from loadgen.queues import (
    Attempts,
    QueueSpec,
    assign_queues,
    measured_shares,
    peak_held,
    summary_queues,
)
from loadgen.sim.config import SimConfig, ns
from loadgen.sim.engine import Engine
from loadgen.sim.workload import TaskLog, Workload
from services.core.cluster_state import ClusterState
from services.core.constraints import DEFAULT_NUM_CONSTRAINTS
from services.core.fairness import FairShare, QueueShare, usage_by_queue
from services.core.global_view import ApplyResult, GlobalView, Placement, PreemptionPlan
from services.core.limits import LimitLedger, QueueLimits
from services.core.match import make_policy
from services.core.resources import resources
from services.core.snapshot import Snapshot
from services.core.status import PlacementStatus, Schedulability
from services.core.task import TaskSpec
from services.core.user_queues import UserQueues

ACCEPTED = PlacementStatus.ACCEPTED


@dataclass(eq=False, slots=True)
class TaskRun:
    """Consecutive tasks of one job with one shape, waiting in a user queue, in order."""

    tasks: list[int]
    shape: int
    pos: int = 0

    def __len__(self) -> int:
        return len(self.tasks) - self.pos


@dataclass(eq=False)
class SimLM:
    index: int
    state: ClusterState
    busy_until: int = 0
    published: int | None = None  # version of the last heartbeat; None: send a full one


@dataclass(eq=False)
class SimGM:
    index: int
    gm_id: str
    view: GlobalView
    queues: UserQueues[TaskRun]
    busy_until: int = 0
    round_pending: bool = False
    # Per user queue, the tail of its parked deque if it waits for "no node" and nothing
    # was unparked since: a later run of its shape can join it (same order, one item
    # instead of many).
    last_parked: dict[str, TaskRun] = field(default_factory=dict)
    infeasible_shapes: dict[int, bool] = field(default_factory=dict)
    pledged: set[str] = field(default_factory=set)  # victims of preemptions under way
    pledge_epoch: int = 0  # bumped whenever ``pledged`` changes
    # (queue, shape) -> the view (table versions) and pledge epoch Alg. 2 refused it in
    refused: dict[tuple[str, int, bytes], tuple] = field(default_factory=dict)


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


class MeghaSim:
    """G simulated GMs and L simulated LMs over ``workers`` nodes (``central``: 1 x 1)."""

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
        self.remaining = workload.tasks
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
        if config.queues:
            names = [q.name for q in config.queues]
            shares = [q.share for q in config.queues]
            self.queue_gm = np.array([q.gm - 1 for q in config.queues], dtype=np.int32)
            self.queue_of: np.ndarray | None = assign_queues(
                workload.users, workload.first, config.queues
            )
        else:
            names = [f"user{g}" for g in range(config.gms)]
            shares = [1 / config.gms] * config.gms
            self.queue_gm = np.arange(config.gms, dtype=np.int32)
            self.queue_of = None
        self.queue_names = names
        self.limits = QueueLimits.parse((q.name, q.limit) for q in config.queues)
        self.fair = FairShare(
            [
                QueueShare(n, s, gm_ids[g])
                for n, s, g in zip(names, shares, self.queue_gm, strict=True)
            ]
        )
        self.gms = [
            SimGM(
                index=g,
                gm_id=gm_ids[g],
                view=GlobalView(gm_ids[g], make_policy(config.policy), num_constraints),
                queues=UserQueues(n for n, at in zip(names, self.queue_gm, strict=True) if at == g),
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
                ClusterState(
                    f"lm{index}",
                    gm_ids,
                    num_constraints,
                    make_policy(config.policy),
                    delta_history=config.lm_delta_history,
                ),
            )
            for index in range(config.lms)
        ]
        capacity = resources(
            cpu_milli=config.cores_per_worker * 1000, memory_mb=config.memory_per_worker_mb
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

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        engine = self.engine
        for lm in self.lms:
            self._heartbeat(lm, reschedule=False)  # full state before the first job
            phase = int(self.rng.integers(0, self.heartbeat_ns))
            engine.at(phase or self.heartbeat_ns, self._heartbeat, lm)
        for job in range(self.workload.jobs):
            engine.at(int(self.workload.arrival_ns[job]), self._arrive, job)

    # ------------------------------------------------------------- job arrival
    def _arrive(self, job: int) -> None:
        now = self.engine.now
        wl, log = self.workload, self.log
        lo, hi = int(wl.first[job]), int(wl.first[job + 1])
        if self.queue_of is None:
            queue_of = [job % len(self.gms)] * (hi - lo)
        else:
            queue_of = self.queue_of[lo:hi].tolist()
        log.stamps["submitted"][lo:hi] = now
        log.stamps["queued"][lo:hi] = now
        log.gm[lo:hi] = self.queue_gm[queue_of]
        job_id = wl.job_ids[job]
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
                run = runs[q] = TaskRun([], shape)
                gm.queues.push(queue, run)
            run.tasks.append(task)
            woken[gm.index] = gm
        for gm in woken.values():
            self._wake(gm)

    def _infeasible(self, gm: SimGM, shape: int, spec: TaskSpec) -> bool:
        """The live GM refuses a task no node could ever hold at submission."""
        known = gm.infeasible_shapes.get(shape)
        if known is None:
            verdict = gm.view.assess(spec).schedulability
            known = gm.infeasible_shapes[shape] = verdict is Schedulability.INFEASIBLE
        return known

    # ------------------------------------------------------------ GM rounds
    def _wake(self, gm: SimGM) -> None:
        if not gm.round_pending:
            gm.round_pending = True
            self.engine.at(max(self.engine.now, gm.busy_until), self._round, gm)

    def _round(self, gm: SimGM) -> None:
        """One scheduling round of the live GM (``_schedule_round``), in virtual time."""
        gm.round_pending = False
        now = self.engine.now
        view, queues, log = gm.view, gm.queues, self.log
        dequeued, decided = log.stamps["dequeued"], log.stamps["decided"]
        specs, shape_of = self.specs, self.workload.shape_of
        groups: dict[tuple[int, bool], list[tuple[int, TaskSpec, Placement]]] = defaultdict(list)
        preempts: list[tuple[int, TaskSpec, PreemptionPlan]] = []
        failed: set[tuple[str, int]] = set()  # (queue, shape)s that found no node this round
        budget = self.config.round_size
        matches = 0
        lm_index = {lm.state.lm_id: lm.index for lm in self.lms}
        popped: deque[tuple[str, TaskRun]] = deque()  # one run from each queue of the GM
        # Queue limits as the live GM checks them (there, a GM that has not heard from
        # every LM waits; the simulated GMs know every LM from the start).
        ledger = LimitLedger(self.limits, view.queue_usage()) if self.limits else None
        while budget > 0:
            if not popped:
                popped.extend(queues.pop_round(1))
                if not popped:
                    break
            queue, run = popped.popleft()
            if (queue, run.shape) in failed:
                self._park(gm, queue, run, no_node=True)
                continue
            at_limit = False
            while budget > 0 and run.pos < len(run.tasks):
                task = run.tasks[run.pos]
                spec = specs[task]
                if ledger is not None and ledger.check(queue, spec.resources) is not None:
                    at_limit = True
                    break
                matches += 1
                placement = view.match(spec)
                if placement is None:
                    plan = self._preemption_plan(gm, spec)
                    if plan is None:
                        failed.add((queue, int(shape_of[task])))
                        break
                    if ledger is not None:
                        ledger.take(queue, spec.resources)
                    run.pos += 1
                    budget -= 1
                    dequeued[task] = now
                    decided[task] = now + matches * self.match_ns
                    preempts.append((task, spec, plan))
                    continue
                view.reserve(placement, spec)
                if ledger is not None:
                    ledger.take(queue, spec.resources)
                run.pos += 1
                budget -= 1
                dequeued[task] = now
                decided[task] = now + matches * self.match_ns
                groups[(lm_index[placement.lm_id], placement.repartition)].append(
                    (task, spec, placement)
                )
            if run.pos < len(run.tasks):
                if (queue, run.shape) in failed:
                    self._park(gm, queue, run, no_node=True)
                elif at_limit:  # until a task of the queue ends (a view change)
                    self._park(gm, queue, run, no_node=False)
                else:
                    queues.push_front(queue, run)
        for queue, run in reversed(popped):  # popped, but the budget ran out first
            queues.push_front(queue, run)
        end = now + matches * self.match_ns
        gm.busy_until = end
        self.counters.rounds += 1
        self.counters.matches += matches
        sent = end + self.delay
        for (lm_i, repartition), items in groups.items():
            lm = self.lms[lm_i]
            known = view.lms[lm.state.lm_id].version
            if repartition:
                self.counters.repartitions += len(items)
            self.engine.at(sent, self._lm_place, lm, gm, repartition, items, known)
        for task, spec, plan in preempts:
            lm = self.lms[lm_index[plan.lm_id]]
            known = view.lms[plan.lm_id].version
            self.counters.preemption_attempts += 1
            self.engine.at(sent, self._lm_preempt, lm, gm, task, spec, plan, known)
        if any(queues.ready(name) for name in queues.names):
            self._wake(gm)

    def _park(self, gm: SimGM, queue: str, run: TaskRun, no_node: bool) -> None:
        """``UserQueues.park``, merging into the parked tail when both wait for no node.

        Sound because a shape that found no node keeps finding none until the view
        changes, and every view change unparks (and forgets ``last_parked``).
        """
        last = gm.last_parked.get(queue)
        if no_node and last is not None and last.shape == run.shape:
            last.tasks.extend(run.tasks[run.pos :])
            return
        gm.queues.park(queue, run)
        if no_node:
            gm.last_parked[queue] = run
        else:
            gm.last_parked.pop(queue, None)

    def _unpark(self, gm: SimGM) -> int:
        gm.last_parked.clear()
        return gm.queues.unpark()

    def _preemption_plan(self, gm: SimGM, spec: TaskSpec) -> PreemptionPlan | None:
        """The live GM's ``_unplaceable``: Alg. 2 when shares are configured, else wait."""
        if not self.config.fair_share or len(self.fair.queues) < 2:
            return None
        # Alg. 2 is a function of the view and the pledged victims: while neither changed,
        # a (queue, shape) it refused is refused again, so the answer is remembered (the
        # decisions are the live GM's; only the repeated work is saved).
        key = (spec.queue, spec.constraint_mask, spec.resources.tobytes())
        token = (
            gm.pledge_epoch,
            tuple((id(v.table), v.table.version) for v in gm.view.lms.values()),
        )
        if gm.refused.get(key) == token:
            return None
        plan = gm.view.preemption_plan(spec, self.fair, gm.pledged)
        if not isinstance(plan, PreemptionPlan):
            gm.refused[key] = token
            return None
        gm.pledge_epoch += 1
        # As the live GM: pledge the victims so no other task picks them while the
        # request is out, and book the task on the node in their place.
        gm.pledged.update(plan.victims.task_ids)
        gm.view.reserve_preemption(plan, spec)
        return plan

    # ------------------------------------------------------------- LM requests
    def _lm_place(
        self,
        lm: SimLM,
        gm: SimGM,
        repartition: bool,
        items: list[tuple[int, TaskSpec, Placement]],
        known: int,
    ) -> None:
        now = self.engine.now
        place = lm.state.repartition if repartition else lm.state.launch
        t = max(now, lm.busy_until)
        rejected: list[tuple[int, TaskSpec]] = []
        for task, spec, placement in items:
            t += self.validate_ns
            decision = place(gm.gm_id, spec, placement.node)
            if decision.status is ACCEPTED:
                if repartition:
                    self.counters.repartitions_accepted += 1
                self._start(lm, task, placement.node, now, t)
            elif not decision.ok:
                rejected.append((task, spec))
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
        self.engine.at(self.engine.now + self.delay, self._gms_learn_end, lm, spec.task_id, gms)

    def _finish_count(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.engine.stop()

    def _gms_learn_end(self, lm: SimLM, task_id: str, gms: list[SimGM]) -> None:
        """The live GM's ``_on_events``: credit a finished task back before the heartbeat."""
        lm_id = lm.state.lm_id
        for gm in gms:
            self.counters.finish_notices += 1
            if gm.view.release(lm_id, task_id) and self._unpark(gm):
                self._wake(gm)

    def _lm_preempt(
        self, lm: SimLM, gm: SimGM, task: int, spec: TaskSpec, plan: PreemptionPlan, known: int
    ) -> None:
        now = self.engine.now
        state = lm.state
        t = max(now, lm.busy_until) + self.validate_ns
        lm.busy_until = t
        # The live LM judges shares on its own books plus its peers' heartbeats; here
        # every LM's books are at hand, so it judges on the exact federation-wide usage.
        usage = usage_by_queue(
            itertools.chain.from_iterable(other.state.allocations.values() for other in self.lms)
        )
        total = self.total_capacity
        decision = state.preempt(
            gm.gm_id,
            spec,
            plan.victims.node,
            list(plan.victims.task_ids),
            lambda queue: self.fair.is_over_share(queue, usage, total),
        )
        victims: list[str] = []
        if decision.status is ACCEPTED:
            for victim in decision.preempted:
                victims.append(victim.task_id)
                self._requeue(victim.task_id, t)
            self._start(lm, task, plan.victims.node, now, t)
            if self.config.finish_notify == "all":  # the PREEMPTED events of the live LM
                for victim_id in victims:
                    self.engine.at(t + self.delay, self._gms_learn_end, lm, victim_id, self.gms)
        snap = state.snapshot(known) if not decision.ok else None
        self.engine.at(
            t + self.delay,
            self._gm_preempt_reply,
            gm,
            lm,
            task,
            spec,
            plan,
            decision.ok,
            victims,
            snap,
        )

    def _requeue(self, task_id: str, now: int) -> None:
        """A preempted task goes back to its user queue as the next attempt (LM ``_requeue``)."""
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
        log.stamps["queued"][task] = now + self.delay
        log.lm[task] = -1
        log.node[task] = -1
        owner = self.gms[int(log.gm[task])]
        self.engine.at(now + self.delay, self._requeued, owner, task)

    def _requeued(self, gm: SimGM, task: int) -> None:
        spec = self.specs[task]
        assert spec is not None
        gm.queues.push(spec.queue, TaskRun([task], int(self.workload.shape_of[task])))
        self._wake(gm)

    # ------------------------------------------------------------- GM replies
    def _gm_reply(
        self, gm: SimGM, lm: SimLM, rejected: list[tuple[int, TaskSpec]], state: Snapshot | None
    ) -> None:
        lm_id = lm.state.lm_id
        for _, spec in rejected:
            # Undo the optimistic reservation first; the LM's state then overwrites every
            # node that really changed.
            gm.view.release(lm_id, spec.task_id)
        if state is not None:
            self.counters.inconsistencies += 1
            self._apply(gm, lm, state)
        for task, _ in rejected:
            self.counters.rejected_placements += 1
            self._rejected(gm, task)
        if rejected:
            self._wake(gm)

    def _gm_preempt_reply(
        self,
        gm: SimGM,
        lm: SimLM,
        task: int,
        spec: TaskSpec,
        plan: PreemptionPlan,
        ok: bool,
        victims: list[str],
        state: Snapshot | None,
    ) -> None:
        gm.pledged.difference_update(plan.victims.task_ids)
        gm.pledge_epoch += 1
        if not ok:
            gm.view.release(plan.lm_id, spec.task_id)  # the booking made with the plan
        if state is not None:
            self._apply(gm, lm, state)
        if ok:
            self.counters.preemptions += len(victims)
            for victim in victims:
                gm.view.release(plan.lm_id, victim)
        else:
            self._rejected(gm, task)
            self._wake(gm)

    def _rejected(self, gm: SimGM, task: int) -> None:
        self.log.rejections[task] += 1
        run = TaskRun([task], int(self.workload.shape_of[task]))
        spec = self.specs[task]
        assert spec is not None
        if self.log.rejections[task] >= self.config.max_rejections:
            self._park(gm, spec.queue, run, no_node=False)
        else:
            gm.queues.push_front(spec.queue, run)

    # ------------------------------------------------------------- heartbeats
    def _heartbeat(self, lm: SimLM, reschedule: bool = True) -> None:
        if self.engine.stopped:
            return
        state = lm.state
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
        for gm in self.gms:
            self._apply(gm, lm, snap)

    def _apply(self, gm: SimGM, lm: SimLM, snap: Snapshot) -> None:
        """The live GM's ``_apply_state``: fold in, fetch full state if the delta is too new."""
        result = gm.view.apply(snap, self.engine.now / 1e9)
        if result is ApplyResult.NEEDS_FULL:
            self.engine.at(self.engine.now + self.delay, self._get_state, gm, lm)
            return
        if result is ApplyResult.APPLIED and self._unpark(gm):
            self._wake(gm)

    def _get_state(self, gm: SimGM, lm: SimLM) -> None:
        self.counters.full_snapshots += 1
        self.engine.at(self.engine.now + self.delay, self._apply, gm, lm, lm.state.snapshot())

    # ------------------------------------------------------------- reporting
    def queue_report(self) -> tuple[dict, float]:
        """summary.json's ``"queues"`` (configured vs measured share, preemptions) and how
        long every queue was backlogged, from the task log and the preempted attempts."""
        log, config = self.log, self.config
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
        specs = config.queues or tuple(
            QueueSpec(name, 1 / len(self.gms), g + 1) for g, name in enumerate(self.queue_names)
        )
        counts = np.bincount(queue_of, minlength=len(self.queue_names))
        peaks = peak_held(attempts, len(self.queue_names))
        return summary_queues(specs, measured, self.preempted_by_queue, counts, peaks), window
