"""A simulated Global Master: ``services/global_master/service.py``'s driver logic over
the very ``Scheduler`` the live GM runs. Every decision is the scheduler's; what is here
is the protocol around it, await for await:

    SubmitJob ──▶ publish: with the queue's other jobs taken while its publishes await
                  their confirms, one message (``TaskBatch.more_jobs``) ──▶ broker.enqueue
                  (own queue: scheduled from memory meanwhile, ``_local``)
    delivery ──▶ each job of it a delivery of its own (``Part``; the message is acked
                 once every part is)
             ──▶ redelivered (or in doubt)? fence on every LM, skip what they hold
             ──▶ the job book's ``taken`` skipped ──▶ Scheduler.submit
    round ──▶ launches ──▶ _send ──answer──▶ accepted / refused + state / _rejected
                                  ──none──▶ unanswered; fence on that LM (lease + 1);
                                            held: accepted, else retry
          ──▶ preemptions ──▶ _preempt (the same, with preempt_replied / preempt_unanswered)
    heartbeats ──▶ Scheduler.apply (NEEDS_FULL: GetState)    events ──▶ book, ended
    every 4 s: ends never heard of (LookupTasks), tasks an LM lost before they started

A crash loses all of it; the restarted GM's lease is its start time in ns (above every
lease of its earlier life), its view comes from heartbeats, its book from ``ListTasks``.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from loadgen.chaos.broker import Delivery
from loadgen.chaos.kernel import Actor, Future, Proc
from loadgen.chaos.wire import (
    Batch,
    Event,
    PlaceReply,
    PlaceRequest,
    PreemptReply,
    PreemptRequest,
    Task,
)
from services.core import states
from services.core.global_view import ApplyResult, GlobalView, Placement, PreemptionPlan
from services.core.limits import QueueLimits
from services.core.scheduler import Drop, OneTask, Reply, RoundPlan, Scheduler
from services.core.snapshot import Snapshot
from services.core.status import PlacementStatus
from services.core.user_queues import UserQueues

if TYPE_CHECKING:
    from loadgen.chaos.world import World

CATCH_UP_S = 60.0
STANDBY_AFTER_S = 2.0  # as the live GM's (queue failover)
IN_DOUBT_S = 60.0
LM_ACCEPT_S = 30.0
FENCE_RETRY_S = 0.5
LOOKUP_TIMEOUT_S = 5.0
# The live GM's is 16; the simulated jobs have 1-8 tasks, so that both ways (scheduled
# while the broker confirms, or after) are taken, the line is drawn lower here.
SCHEDULE_BEFORE_CONFIRM = 4
PUBLISHES_IN_FLIGHT = 2  # as the live GM's, per queue
JOBS_PER_MESSAGE = 256
RECOVER_EVERY_S = 2.0
RESTART_GRACE_S = 5.0
ROUND_EVERY_S = 0.02

_NOT_TAKEN = {0, states.REJECTED}
_NOT_LAUNCHED = _NOT_TAKEN | {states.QUEUED}
_OPEN = {states.PLACED, states.RUNNING}
_RANK = {
    states.QUEUED: 1,
    states.PLACED: 2,
    states.RUNNING: 3,
    states.LOST: 4,
    states.RETRYING: 4,
    states.PREEMPTED: 4,
    states.SUCCEEDED: 5,
    states.FAILED: 5,
    states.REJECTED: 5,
    states.CANCELLED: 5,
}


@dataclass(eq=False, slots=True)
class Status:
    attempt: int
    state: int
    lm_id: str = ""


class Book:
    """The GM's job book (``services/global_master/jobs.py``), the part the protocol
    reads: each task's latest attempt and state, ``taken`` and ``open``."""

    def __init__(self) -> None:
        self.tasks: dict[str, Status] = {}
        self.relayed: set[str] = set()  # booked QUEUED only as sent to another GM's queue

    def holds(self, task: Task) -> bool:
        status = self.tasks.get(task.task_id)
        return (
            status is not None and status.state not in _NOT_TAKEN and status.attempt >= task.attempt
        )

    def launched(self, task: Task) -> bool:
        """As ``JobBook.launched``: an LM took this attempt (placed, running, ended), or
        a later attempt exists."""
        status = self.tasks.get(task.task_id)
        if status is None or status.attempt < task.attempt:
            return False
        return status.attempt > task.attempt or status.state not in _NOT_LAUNCHED

    def taken(self, tasks, relayed: bool = True) -> set[str]:
        """As ``JobBook.taken``: without ``relayed``, a task only relayed from here and
        still QUEUED is not taken (its message, delivered here, queues it)."""
        found = {t.task_id for t in tasks if self.holds(t)}
        if not relayed:
            found = {
                t for t in found if t not in self.relayed or self.tasks[t].state != states.QUEUED
            }
        return found

    def queued(self, task: Task, relayed: bool = False) -> None:
        if relayed:
            self.relayed.add(task.task_id)
        else:
            self.relayed.discard(task.task_id)
        if not self.holds(task):
            self.tasks[task.task_id] = Status(task.attempt, states.QUEUED)

    def apply(self, event: Event) -> None:
        status = self.tasks.get(event.task_id)
        if status is None:
            self.tasks[event.task_id] = Status(event.attempt, event.state, event.lm_id)
            return
        newer = event.attempt > status.attempt
        later = event.attempt == status.attempt and _RANK.get(event.state, 0) >= _RANK.get(
            status.state, 0
        )
        if newer or later or status.state == 0:
            status.attempt, status.state, status.lm_id = event.attempt, event.state, event.lm_id

    def open(self) -> dict[str, Status]:
        return {t: s for t, s in self.tasks.items() if s.state in _OPEN}


@dataclass(eq=False)
class MessageBatch:
    """One broker message; acked once every task in it has launched."""

    delivery: Delivery | Part | None
    remaining: int
    cancelled: bool = False
    out: int = 0
    landed: list[Future] = field(default_factory=list)
    key: tuple = ()
    joined: list[Delivery | Part] = field(default_factory=list)
    # Batches of later copies that skipped tasks this one holds queued (``_delivered``):
    # each is one task nearer its ack once this one is done.
    followers: list[MessageBatch] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class Part:
    """As the live GM's ``_Part``: one job of a message that carries several, a delivery
    of its own; the message is acked once every part is."""

    whole: Delivery
    body: Batch
    unsettled: list[int]  # the message's parts not acked yet, shared by them
    settled: bool = False

    @property
    def redelivered(self) -> bool:
        return self.whole.redelivered


@dataclass(eq=False)
class Pending(OneTask):
    """The scheduler core's ``Work`` of one task (the live GM's ``Pending``)."""

    task: Task
    batch: MessageBatch
    enqueued: float = 0.0  # when it was queued here (the model's clock)
    rejections: int = 0

    def __post_init__(self) -> None:
        self.spec = self.task.spec()


class GM(Actor):
    def __init__(self, world: World, gm_id: str) -> None:
        super().__init__(world.k, gm_id)
        self.world = world
        self.cfg = world.cfg
        self._boot()

    def _boot(self) -> None:
        world = self.world
        self.view = GlobalView(
            self.name, silent_after_s=max(5 * self.cfg.heartbeat_interval_s, 2.0)
        )
        self.preferred = [q for q in world.queue_names if world.preferred[q] == self.name]
        self.my_queues = list(world.queues_of(self.name))
        # As the live GM: with queue failover nothing is scheduled from memory.
        self.from_memory = frozenset() if world.cfg.failover else frozenset(self.preferred)
        self.queues: UserQueues[Pending] = UserQueues(self.my_queues)
        self.scheduler: Scheduler[Pending] = Scheduler(
            self.view,
            self.queues,
            world.fair,
            QueueLimits.parse(()),
            lm_ids=list(world.lms),
            started_at=self.k.now,
            withdrawn=lambda item: item.batch.cancelled,
            explain=False,
        )
        self.scheduler.lease = self.k.engine.now + 1  # time.time_ns()
        self.book = Book()
        self.local: dict[tuple, MessageBatch] = {}
        self.held: dict[tuple, MessageBatch] = {}
        # As the live GM's ``_holding``: the batch each task queued here was last given to.
        self.holding: weakref.WeakValueDictionary[str, MessageBatch] = weakref.WeakValueDictionary()
        self.started_at = self.k.now
        self.failed: dict[str, MessageBatch] = {}
        self.submitting: dict[str, Future] = {}
        self.unstarted: OrderedDict[str, tuple[str, float, Task]] = OrderedDict()
        self.round_due = False
        self.recheck_at: float | None = None  # the parked work's recheck timer, when set
        self.counters: dict[str, int] = defaultdict(int)
        # As the live GM's ``_publishers``: per queue, the jobs waiting for a publish
        # (with the futures their submissions wait on) and the publishes under way.
        self.to_publish: dict[str, list[tuple[Batch, Future]]] = defaultdict(list)
        self.publishing: dict[str, int] = defaultdict(int)

    def start(self) -> None:
        broker = self.world.broker
        broker.subscribe("heartbeat", self, self._on_heartbeat)
        broker.subscribe("events", self, self._on_events)
        for queue in self.preferred:
            broker.consume(queue, self, self._on_delivery)
        if self.cfg.failover:
            self.spawn(self._standby())
        self.spawn(self._recover_loop())
        self.catching_up = len(self.world.lms)
        self.caught_up: list[Future] = []
        for lm_id in self.world.lms:
            self.spawn(self._catch_up(lm_id))

    def _standby(self) -> Proc:
        """As the live GM: line up for the other GMs' queues a little later."""
        yield self.k.sleep(STANDBY_AFTER_S)
        for queue in self.my_queues:
            if queue not in self.preferred:
                self.world.broker.consume(queue, self, self._on_delivery)

    def restart(self) -> None:
        self.alive = True
        self.k.log(self.name, "RESTART")
        self._boot()
        self.start()

    @property
    def lease(self) -> int:
        return self.scheduler.lease

    # ------------------------------------------------------------ submissions
    def submit_job(self, batch: Batch) -> Proc:
        """SubmitJob: True once the broker stored the job (the client's ack). One
        submission of a job id at a time (``GlobalMaster._submitting``): a retry that
        overtook a submission still under way took its tasks for queued, and was told
        so, while that one's message was then refused (``--small --seed 25``)."""
        if not self.view.lms or not self.world.broker.alive:
            return False
        while (under_way := self.submitting.get(batch.job_id)) is not None:
            yield under_way
        done = self.submitting[batch.job_id] = Future()
        try:
            stored = yield from self._submit_job(batch)
        finally:  # (a crash drops the proc: another life's entry is left alone)
            if self.submitting.get(batch.job_id) is done:
                del self.submitting[batch.job_id]
            done.set(True)
        return stored

    def submit_jobs(self, batches: tuple[Batch, ...]) -> Proc:
        """A SubmitStream message of several jobs: each submitted as ``submit_job``,
        concurrently (``GlobalMaster.SubmitStream``); their answers, in order."""
        answers = [Future() for _ in batches]
        for batch, answer in zip(batches, answers, strict=True):
            self.spawn(self._answer_job(batch, answer))
        oks = []
        for answer in answers:
            oks.append((yield answer))
        return oks

    def _answer_job(self, batch: Batch, answer: Future) -> Proc:
        answer.set((yield from self.submit_job(batch)))

    def _submit_job(self, batch: Batch) -> Proc:
        if self.failed.get(batch.job_id) is not None:
            yield from self._all_landed(self.failed[batch.job_id])
        if self.catching_up:  # ``GlobalMaster._submit_job``: a retry's tasks may run
            caught_up = Future()
            self.caught_up.append(caught_up)
            yield caught_up
        taken = self.book.taken(batch.tasks)
        if len(taken) == len(batch.tasks):
            return True  # a retry of a job queued already
        batch = Batch(
            batch.job_id,
            batch.queue,
            tuple(t.copy() for t in batch.tasks if t.task_id not in taken),
            queued_at=self.k.now,
        )
        if batch.queue not in self.from_memory:
            stored = yield self._publish(batch)
            if stored:
                for task in batch.tasks:
                    self.book.queued(task, relayed=True)
            return stored
        key = batch.key()
        local = self.local[key] = self.held[key] = MessageBatch(
            None, remaining=len(batch.tasks), key=key
        )
        pending = [Pending(t.copy(), local, self.k.now) for t in batch.tasks]
        for task in batch.tasks:
            self.book.queued(task)
            self.holding[task.task_id] = local
        early = len(pending) <= SCHEDULE_BEFORE_CONFIRM
        if early:
            self._push(batch.queue, pending)
        stored = yield self._publish(batch)
        if stored:
            if not early:
                self._push(batch.queue, pending)
            return True
        local.cancelled = True
        self.failed[batch.job_id] = local
        self.spawn(self._forget_failed(key, local))
        for item in self.scheduler.withdraw(batch.queue, lambda item: item.batch is local):
            self._drop(item, Drop.WITHDRAWN)
        if not early:  # as the live GM: none was pushed, all were only booked as queued
            for task in batch.tasks:
                self.book.apply(
                    Event(
                        task.task_id, task.job_id, task.queue, states.REJECTED, "", "", task.attempt
                    )
                )
        # As the live GM: deliveries that joined it (stored after all) are taken anew.
        again = [d for d in (local.delivery, *local.joined) if d is not None]
        local.delivery, local.joined = None, []
        for delivery in again:
            self.spawn(self._delivered(delivery))
        return False

    def _publish(self, batch: Batch) -> Future:
        """``GlobalMaster._enqueue``: stored or not (the broker's confirm) once the
        message carrying ``batch`` is; the jobs that come while PUBLISHES_IN_FLIGHT
        publishes to the queue are under way go together in the next."""
        stored = Future()
        self.to_publish[batch.queue].append((batch, stored))
        if self.publishing[batch.queue] < PUBLISHES_IN_FLIGHT:
            self.publishing[batch.queue] += 1
            self.spawn(self._publisher(batch.queue))
        return stored

    def _publisher(self, queue: str) -> Proc:
        # As the live GM's publishing task, which first runs a loop turn after it is
        # made: the jobs of one stream message go together.
        yield self.k.sleep(0.0)
        waiting = self.to_publish[queue]
        while waiting:
            taken = waiting[:JOBS_PER_MESSAGE]
            del waiting[:JOBS_PER_MESSAGE]
            jobs = [job for job, _ in taken]
            self.counters["messages"] += 1
            self.counters["jobs_in_messages"] += len(jobs)
            message = jobs[0] if len(jobs) == 1 else replace(jobs[0], more_jobs=tuple(jobs[1:]))
            stored = yield self.world.broker.enqueue(queue, message)
            for _, future in taken:
                future.set(stored)
        self.publishing[queue] -= 1

    def _forget_failed(self, key: tuple, local: MessageBatch) -> Proc:
        yield from self._all_landed(local)
        if self.local.get(key) is local:
            del self.local[key]

    def _all_landed(self, batch: MessageBatch) -> Proc:
        while batch.out:
            landed = Future()
            batch.landed.append(landed)
            yield landed

    def _push(self, queue: str, items: list[Pending]) -> None:
        for item in items:
            self.scheduler.submit(queue, item)
        self._wake()

    # ------------------------------------------------------------ broker input
    def _on_delivery(self, delivery: Delivery) -> None:
        msg: Batch = delivery.body
        if not msg.more_jobs:
            self.spawn(self._delivered(delivery))
            return
        unsettled = [1 + len(msg.more_jobs)]
        for job in (replace(msg, more_jobs=()), *msg.more_jobs):
            self.spawn(self._delivered(Part(delivery, job, unsettled)))

    def _ack(self, delivery: Delivery | Part) -> None:
        """Ack a delivery; a part's counts towards its message's (``_Part.ack``)."""
        if not isinstance(delivery, Part):
            self.world.broker.ack(delivery)
        elif not delivery.settled:
            delivery.settled = True
            delivery.unsettled[0] -= 1
            if delivery.unsettled[0] == 0:
                self.world.broker.ack(delivery.whole)

    def _delivered(self, delivery: Delivery | Part) -> Proc:
        msg: Batch = delivery.body
        key = msg.key()
        if msg.queue not in self.preferred:
            self.counters["taken_over"] += 1
        local = self.local.pop(key, None)
        if local is not None and not local.cancelled:
            local.delivery = delivery
            if local.remaining == 0:
                self._ack(delivery)
            return
        held = self.held.get(key)
        if held is not None and held.remaining and not held.cancelled:
            held.joined.append(delivery)
            if self.k.tracing:
                self.k.log(self.name, f"delivery {msg.job_id} joins {held.remaining} held")
            return
        batch = self.held[key] = MessageBatch(delivery, remaining=len(msg.tasks), key=key)
        while (under_way := self.submitting.get(msg.job_id)) is not None:
            yield under_way  # as the live GM: its confirm may yet drop the tasks it holds
        failed = self.failed.get(msg.job_id)
        if local is not None:
            yield from self._all_landed(local)
        if failed is not None:
            yield from self._all_landed(failed)
            if self.failed.get(msg.job_id) is failed:
                del self.failed[msg.job_id]
        check = (
            delivery.redelivered
            or local is not None
            or failed is not None
            or 0 < msg.queued_at < self.started_at
            # As the live GM: until every LM said what it holds, a launch of an earlier
            # life may still be on its way to one (``--seed 1178``).
            or self.catching_up > 0
        )
        launched: set[str] = set()
        if check:
            attempts = {t.task_id: t.attempt for t in msg.tasks}
            holders = yield from self._fence(list(self.world.lms), attempts, CATCH_UP_S)
            for task in msg.tasks:
                if (lm_id := holders.get(task.task_id)) is not None:
                    self._book_accepted(task, lm_id)
            launched = set(holders)
        launched |= self.book.taken(msg.tasks, relayed=False)
        if self.k.tracing:
            self.k.log(
                self.name,
                f"delivery {msg.job_id} {[f'{t.task_id}#{t.attempt}' for t in msg.tasks]} "
                f"redelivered={delivery.redelivered} skip={sorted(launched)}",
            )
        # As the live GM: a task skipped as taken but only queued here waits in another
        # batch's memory (a dead delivery's, across a broker restart): this copy, maybe
        # the broker's only one now, is acked once that batch is done (``--seed 3888``).
        holders = self._holders(msg.tasks, launched, batch)
        for holder in holders:
            holder.followers.append(batch)
        batch.remaining += len(holders)
        if batch.remaining == len(launched):
            batch.remaining = 0
            # Only its own entry: a submission of the same message since (a client's
            # retry) holds the key now, with tasks still to launch (``--seed 1505``).
            if self.held.get(key) is batch:
                del self.held[key]
            for done in (delivery, *batch.joined):
                self._ack(done)
            return
        batch.remaining -= len(launched)
        for task in msg.tasks:
            if task.task_id in launched:
                continue
            self.book.queued(task)
            self.holding[task.task_id] = batch
            self.scheduler.submit(msg.queue, Pending(task.copy(), batch, self.k.now))
        self._wake()

    def _holders(self, tasks, skipped: set[str], batch: MessageBatch) -> set[MessageBatch]:
        """``GlobalMaster._holders``: the live batches holding those of ``skipped`` that
        are only queued here."""
        found = set()
        for task in tasks:
            if task.task_id not in skipped or self.book.launched(task):
                continue
            holder = self.holding.get(task.task_id)
            live = holder is not None and holder.remaining > 0 and not holder.cancelled
            if live and holder is not batch:
                found.add(holder)
        return found

    def _fence(self, lm_ids: list[str], attempts: dict[str, int], wait_s: float) -> Proc:
        # As the live GM: above every lease any GM has sent (a start's clock, plus fences).
        self.scheduler.lease = max(self.scheduler.lease + 1, self.k.engine.now + 1)
        lease = self.scheduler.lease
        answers = [self._answer(lm_id, attempts, lease, wait_s) for lm_id in lm_ids]
        held: dict[str, str] = {}  # task id -> the LM that holds it
        for lm_id, answer in zip(lm_ids, answers, strict=True):  # asked at once, gathered
            reply = yield answer
            if reply is None:
                continue
            for known in reply:
                if known.attempt >= attempts[known.task_id]:
                    held[known.task_id] = lm_id
        return held

    def _answer(self, lm_id: str, attempts: dict[str, int], lease: int, wait_s: float) -> Future:
        done = Future()

        def ask() -> Proc:
            deadline = self.k.now + wait_s
            while True:
                reply = yield self._lookup(lm_id, list(attempts), lease)
                if reply is not None:
                    done.set(reply)
                    return
                if self.k.now > deadline:
                    if self.k.tracing:
                        self.k.log(self.name, f"gave up fencing {sorted(attempts)} on {lm_id}")
                    done.set(None)
                    return
                yield self.k.sleep(FENCE_RETRY_S)

        self.spawn(ask())
        return done

    def _lookup(self, lm_id: str, task_ids: list[str], fence_lease: int = 0) -> Future:
        lm = self.world.lms[lm_id]
        return self.world.net.rpc(self, lm, lm.lookup, (task_ids, fence_lease), LOOKUP_TIMEOUT_S)

    def _on_heartbeat(self, snapshot: Snapshot) -> None:
        self.spawn(self._apply_state(snapshot))

    def _apply_state(self, snapshot: Snapshot) -> Proc:
        result, wake = self.scheduler.apply(snapshot, self.k.now)
        if result is ApplyResult.NEEDS_FULL:
            lm = self.world.lms.get(snapshot.lm_id)
            full = yield self.world.net.rpc(self, lm, lm.get_state, (None,), 5.0)
            if full is None:
                return
            result, wake = self.scheduler.apply(full, self.k.now)
        if wake:
            self._wake()

    def _on_events(self, events: list[Event]) -> None:
        self._take_events(events)

    def _take_events(self, events: list[Event]) -> None:
        ends = []
        for event in events:
            self.book.apply(event)
            if event.state not in (states.QUEUED, states.PLACED):
                unstarted = self.unstarted.get(event.task_id)
                if unstarted is not None and event.attempt >= unstarted[2].attempt:
                    del self.unstarted[event.task_id]
            if event.state in states.RELEASED:
                ends.append((event.lm_id, event.task_id, event.attempt, event.node_id, event.queue))
        if ends and self.scheduler.ended(ends, self.k.now):
            self._wake()

    def _catch_up(self, lm_id: str) -> Proc:
        deadline = self.k.now + CATCH_UP_S
        while lm_id not in self.view.lms and self.k.now < deadline:
            yield self.k.sleep(0.2)
        lm = self.world.lms[lm_id]
        while True:
            events = yield self.world.net.rpc(self, lm, lm.list_tasks, (), 5.0)
            if events is not None:
                for event in events:
                    self.book.apply(event)
                break
            if self.k.now > deadline:
                break
            yield self.k.sleep(1.0)
        self.catching_up -= 1
        if not self.catching_up:
            for waiter in self.caught_up:
                waiter.set(True)
            self.caught_up.clear()

    def _recover_loop(self) -> Proc:
        interval = max(RECOVER_EVERY_S, 4 * self.cfg.heartbeat_interval_s)
        suspects: set[str] = set()
        while True:
            yield self.k.sleep(interval)
            suspects = yield from self._recover_lost_ends(suspects)

    def _recover_lost_ends(self, suspects: set[str]) -> Proc:
        now: dict[str, Status] = {}
        for task_id, status in self.book.open().items():
            view = self.view.lms.get(status.lm_id)
            held = view.allocations.get(task_id) if view is not None else None
            if held is None or held.attempt < status.attempt:
                now[task_id] = status
        ask: dict[str, dict[str, int]] = defaultdict(dict)
        for task_id in now.keys() & suspects:
            if now[task_id].lm_id in self.world.lms:
                ask[now[task_id].lm_id][task_id] = now[task_id].attempt
        recovered = []
        for lm_id, attempts in sorted(ask.items()):
            reply = yield self._lookup(lm_id, sorted(attempts))
            if reply is None:
                continue
            for known in reply:
                ended = known.last_ended
                if ended is not None and ended.attempt >= attempts[known.task_id]:
                    recovered.append(ended)
            unknown = set(attempts) - {known.task_id for known in reply}
            yield from self._requeue_lost_starts(lm_id, unknown)
        if recovered:
            self._take_events(recovered)
        return set(now) - suspects

    def _requeue_lost_starts(self, lm_id: str, task_ids: set[str]) -> Proc:
        view = self.view.lms.get(lm_id)
        if view is None or view.restarted_at is None:
            return
        if self.k.now - view.restarted_at < self.cfg.worker_timeout_s + RESTART_GRACE_S:
            return
        for task_id in sorted(task_ids):
            unstarted = self.unstarted.get(task_id)
            if unstarted is None or unstarted[0] != lm_id or unstarted[1] > view.restarted_at:
                continue
            del self.unstarted[task_id]
            task = unstarted[2]
            if self.k.tracing:
                self.k.log(
                    self.name, f"re-queues {task_id}#{task.attempt}: {lm_id} lost it unstarted"
                )
            self.book.apply(
                Event(task.task_id, task.job_id, task.queue, states.LOST, "", "", task.attempt)
            )
            again = task.next_attempt()
            while not (
                yield self.world.broker.enqueue(
                    again.queue, Batch(again.job_id, again.queue, (again,), self.k.now)
                )
            ):
                yield self.k.sleep(0.5)

    # -------------------------------------------------------------- scheduling
    def _wake(self) -> None:
        if not self.round_due:
            self.round_due = True
            # Wakes within ROUND_EVERY_S share a round (the live loop runs one per wake
            # burst: replies and heartbeats land between rounds).
            self.later(ROUND_EVERY_S, self._schedule)

    def _schedule(self) -> None:
        self.round_due = False
        while True:
            plan = self.scheduler.round(self.k.now)
            self._carry_out(plan)
            if not plan.taken:
                break

    def _recheck(self, at: float) -> None:
        """The live GM's ``_unpark_all`` timer: parked work is tried again."""
        if self.recheck_at != at:
            return  # an earlier recheck took its place
        self.recheck_at = None
        if self.scheduler.unpark():
            self._wake()

    def _carry_out(self, plan: RoundPlan[Pending]) -> None:
        if plan.recheck_in is not None:
            at = self.k.now + plan.recheck_in
            if self.recheck_at is None or at < self.recheck_at:
                self.recheck_at = at
                self.later(plan.recheck_in, self._recheck, at)
        for item, drop in plan.dropped:
            self._drop(item, drop)
        for lm_id, decided in plan.per_lm().items():
            items = [(d.handle, d.placement) for d in decided]
            self._spawn_launch([d.handle for d in decided], self._send(lm_id, items))
        for p in plan.preemptions:
            self._spawn_launch([p.handle], self._preempt(p.queue, p.handle, p.plan))

    def _drop(self, item: Pending, drop: Drop | None) -> bool:
        if drop is Drop.WITHDRAWN:
            if self.k.tracing:
                self.k.log(self.name, f"withdrew {item.task.task_id}")
            self.book.apply(
                Event(
                    item.task.task_id,
                    item.task.job_id,
                    item.task.queue,
                    states.REJECTED,
                    "",
                    "",
                    item.task.attempt,
                )
            )
        elif drop is Drop.CANCELLED:
            raise AssertionError("cancels are not simulated")
        return drop is not None

    def _spawn_launch(self, items: list[Pending], proc: Proc) -> None:
        for item in items:
            item.batch.out += 1

        def run() -> Proc:
            yield from proc  # (a crash drops it: no landing to count then)
            if True:
                for item in items:
                    item.batch.out -= 1
                    if item.batch.out == 0:
                        landed, item.batch.landed = item.batch.landed, []
                        for future in landed:
                            future.set(None)

        self.spawn(run())

    def _expiry(self) -> float:
        return self.k.now + max(LM_ACCEPT_S, 2 * self.cfg.lm_call_timeout_s)

    def _send(self, lm_id: str, items: list[tuple[Pending, Placement]]) -> Proc:
        lm = self.world.lms[lm_id]
        lmv = self.view.lms.get(lm_id)
        known = lmv.version if lmv is not None else 0
        for item, _ in items:
            item.task.lease = self.lease
        request = PlaceRequest(
            self.name,
            [(item.task.copy(), p.node, p.repartition) for item, p in items],
            known,
            self._expiry(),
        )
        if self.k.tracing:
            self.k.log(
                self.name,
                f"send {lm_id} {[(i.task.task_id, i.task.attempt, p.node) for i, p in items]} "
                f"lease={self.lease}",
            )
        reply: PlaceReply | None = yield self.world.net.rpc(
            self, lm, lm.place_all, (request,), self.cfg.lm_call_timeout_s
        )
        if reply is None:
            if self.k.tracing:
                self.k.log(self.name, f"launch on {lm_id} unanswered: fencing")
            self.scheduler.unanswered(lm_id)
            held = yield from self._settle(lm_id, [item for item, _ in items])
            for item, _ in items:
                if item.task.task_id in held:
                    self._accepted(lm_id, item)
                else:
                    self._drop(item, self.scheduler.retry(item.task.queue, item))
            self._wake()
            return
        rejected = []
        for (item, _), decision in zip(items, reply.results, strict=True):
            if decision.status.ok:
                self._accepted(lm_id, item)
            else:
                self.scheduler.refused(lm_id, item.task.task_id)
                rejected.append((item, decision.status))
        if reply.state is not None:
            yield from self._apply_state(reply.state)
        for item, status in rejected:
            self._rejected(lm_id, item, status)
        if rejected:
            self._wake()

    def _settle(self, lm_id: str, items: list[Pending]) -> Proc:
        attempts = {item.task.task_id: item.task.attempt for item in items}
        held = yield from self._fence([lm_id], attempts, IN_DOUBT_S)
        # As the live GM: what events said an LM took is not placed again (``--seed 2614``).
        return set(held) | {item.task.task_id for item in items if self.book.launched(item.task)}

    def _accepted(self, lm_id: str, item: Pending) -> None:
        self.scheduler.accepted(lm_id, item.task.task_id)
        self._book_accepted(item.task, lm_id)
        self.unstarted[item.task.task_id] = (lm_id, self.k.now, item.task.copy())
        self.unstarted.move_to_end(item.task.task_id)
        self._launched(item.batch)

    def _launched(self, batch: MessageBatch) -> None:
        batch.remaining -= 1
        if batch.remaining:
            return
        if self.held.get(batch.key) is batch:
            del self.held[batch.key]
        for delivery in (batch.delivery, *batch.joined):
            if delivery is not None:
                self._ack(delivery)
        for follower in batch.followers:
            self._launched(follower)

    def _book_accepted(self, task: Task, lm_id: str) -> None:
        """``JobBook.accepted``: PLACED on ``lm_id`` unless the book knows as much."""
        status = self.book.tasks.get(task.task_id)
        if status is not None and (
            status.attempt > task.attempt
            or (status.attempt == task.attempt and status.state != states.QUEUED)
        ):
            return
        self.book.apply(
            Event(task.task_id, task.job_id, task.queue, states.PLACED, lm_id, "", task.attempt)
        )

    def _rejected(self, lm_id: str, item: Pending, status: PlacementStatus) -> None:
        verdict = self.scheduler.rejected(item.task.queue, item, status)
        if self.k.tracing:
            self.k.log(
                self.name,
                f"{item.task.task_id}#{item.task.attempt} refused {status.name} -> {verdict.value}",
            )
        if verdict in (Reply.INVALID, Reply.ID_TAKEN):
            self.world.unexpected.append(f"{self.name}: {item.task.task_id} {verdict.value}")
            self.book.apply(
                Event(
                    item.task.task_id,
                    item.task.job_id,
                    item.task.queue,
                    states.REJECTED,
                    lm_id,
                    "",
                    item.task.attempt,
                )
            )
            self._launched(item.batch)
        elif verdict is Reply.WITHDRAWN:
            self._drop(item, Drop.WITHDRAWN)
        elif verdict is Reply.CANCELLED:
            raise AssertionError("cancels are not simulated")
        elif verdict is Reply.RECHECK:
            self.spawn(self._recheck(item))

    def _recheck(self, item: Pending) -> Proc:
        """As the live GM's ``_recheck``: fenced by another GM, fence higher and look."""
        task = item.task
        holders = yield from self._fence(
            list(self.world.lms), {task.task_id: task.attempt}, CATCH_UP_S
        )
        holder = holders.get(task.task_id)
        held = holder is not None or self.book.launched(task)  # as ``_settle``
        verdict = self.scheduler.rechecked(task.queue, item, held=held)
        if self.k.tracing:
            self.k.log(self.name, f"{task.task_id}#{task.attempt} rechecked -> {verdict.value}")
        if verdict is Reply.LET_GO:
            if holder is not None:
                self._book_accepted(task, holder)
            self._launched(item.batch)
        elif verdict is Reply.WITHDRAWN:
            self._drop(item, Drop.WITHDRAWN)
        else:
            self._wake()

    def _preempt(self, queue: str, item: Pending, plan: PreemptionPlan) -> Proc:
        self.counters["preemption_attempts"] += 1
        lm = self.world.lms[plan.lm_id]
        lmv = self.view.lms.get(plan.lm_id)
        item.task.lease = self.lease
        request = PreemptRequest(
            self.name,
            item.task.copy(),
            plan.victims.node,
            list(plan.victims.task_ids),
            lmv.version if lmv is not None else 0,
            self._expiry(),
        )
        if self.k.tracing:
            self.k.log(
                self.name,
                f"preempt {plan.lm_id} {item.task.task_id}#{item.task.attempt} "
                f"victims={list(plan.victims.task_ids)} lease={self.lease}",
            )
        reply: PreemptReply | None = yield self.world.net.rpc(
            self, lm, lm.preempt, (request,), self.cfg.lm_call_timeout_s
        )
        status = reply.result.status if reply is not None else None
        self.scheduler.preempt_replied(
            plan, item.task.task_id, None if status is None else status.ok
        )
        if reply is None:
            held = yield from self._settle(plan.lm_id, [item])
            if item.task.task_id in held:
                self._accepted(plan.lm_id, item)
            else:
                self._drop(item, self.scheduler.preempt_unanswered(queue, item))
                self._wake()  # a round arms the recheck of what parked blind
            return
        if reply.state is not None:
            yield from self._apply_state(reply.state)
        if status.ok:
            self.counters["preemptions"] += len(reply.preempted)
            self._accepted(plan.lm_id, item)
        else:
            self._rejected(plan.lm_id, item, status)
            self._wake()
