"""The Global Master process: a stateless matcher over an eventually-consistent view.

    SubmitJob ──validate──▶ lifetime predictions (sidecar, predictions.py; never waited on
        past a short deadline) ──▶ durable user queue (broker confirm) ──▶ ack to the client
    user queues it serves ──consume──▶ UserQueues (round-robin) ──match──▶ Launch / Repartition
        rejected → apply the LM's state, retry;  no node → fairness (Alg. 2) → park
        accepted → the broker message is acked once every task in it has launched
    heartbeats (fanout) ──▶ GlobalView.apply      lifecycle events (topic) ──▶ JobBook

Nothing here decides: matching, fairness and validation are ``services.core``. A GM can
be killed at any moment: unacked queue messages go back to the broker and the restarted
GM re-launches them; LMs answer DUPLICATE for tasks that already run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import OrderedDict, defaultdict, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import grpc
import numpy as np

from services._proto.megha.v1 import (
    common_pb2,
    global_master_pb2,
    global_master_pb2_grpc,
    local_master_pb2,
    local_master_pb2_grpc,
)
from services.common import authz, metrics, queue_messages, stalls
from services.common.bus import Bus, Delivery
from services.common.client import BUSY_PAUSE_MAX_S, BUSY_PAUSE_S, new_job_id
from services.common.coalesce import Gatherer
from services.common.config import FederationConfig
from services.common.convert import (
    InvalidTask,
    check_submitted,
    parse_task,
    placement_status_from_proto,
    resources_to_proto,
    snapshot_from_proto,
    vdc_from_proto,
)
from services.common.names import (
    BACKLOG_EXCHANGE,
    CANCEL_EXCHANGE,
    EVENT_EXCHANGE,
    EVERY_TASK_EVENT,
    HEARTBEAT_EXCHANGE,
    LIST_BATCH,
    cancel_queue,
    event_key,
    user_queue,
)
from services.common.queue_signing import seal, sealed
from services.common.request_stream import MAX_COALESCED, Launcher
from services.common.requeue import RESTART_GRACE_S, enqueue_next_attempt
from services.common.server import channel
from services.common.tasks import long_lived
from services.core.admission import Admission, QueueingDelay
from services.core.autoscale import waiting_shapes
from services.core.dry_run import dry_run, dry_run_gang
from services.core.fairness import FairShare, dominant_share
from services.core.gang import GangError
from services.core.gang_restart import ends_gang, gang_failed
from services.core.global_view import (
    ApplyResult,
    GlobalView,
    Placement,
    PreemptionPlan,
    silent_after,
)
from services.core.ids import id_problem, shown
from services.core.limits import UNLIMITED, LimitLedger, QueueLimits, limit_to_wire
from services.core.resources import NUM_RESOURCES, RESOURCE_NAMES
from services.core.round_budget import RoundBudget
from services.core.scheduler import (
    MAX_REJECTIONS,
    ROUND_PER_QUEUE,
    Drop,
    OneTask,
    Reply,
    RoundPlan,
    Scheduler,
)
from services.core.states import RELEASED, TERMINAL, TaskState
from services.core.status import PlacementStatus
from services.core.task import TaskSpec
from services.core.user_queues import UserQueues
from services.core.vdc import Vdc, VdcError
from services.global_master.gangs import GANG_RETRY_S, GangJob, Gangs, gang_fields, gang_of
from services.global_master.jobs import JobBook, Watch, status_event
from services.global_master.predictions import LifetimePredictions

log = logging.getLogger("megha.gm")

MAX_TASKS_PER_JOB = 100_000
DEFAULT_LISTED_JOBS = 20  # ListJobs without a limit
MAX_LISTED_JOBS = 1_000
# Submissions under way at once (SubmitJob calls and SubmitStream messages, each until
# the broker confirmed its job); past this one is refused RESOURCE_EXHAUSTED, telling
# the client to retry: an overloaded GM says so at once instead of answering ever later.
MAX_SUBMISSIONS = 10_000
# Answers a SubmitStream may owe its client (jobs read and not yet answered, or answered
# and not yet read by the client): past this the GM reads no more of that stream until
# the client reads, so a client that sends without reading is held back by gRPC's flow
# control instead of the GM keeping its answers (and taking its jobs) without bound.
STREAM_ANSWERS_OWED = 4_096
# A big job's tasks are checked, booked and scheduled this many at a time, the GM's other
# work let run between (a 100,000-task job held its loop for seconds).
TASKS_BETWEEN_TURNS = 512
# Jobs of up to this many tasks are scheduled while the broker confirms them, bigger ones
# once it has (see SubmitJob).
SCHEDULE_BEFORE_CONFIRM = 16
# A queue's jobs taken here while its publishes await their confirms go together in its
# next publish (``TaskBatch.more_jobs``): at most PUBLISHES_IN_FLIGHT publishes under way per
# queue, each of at most JOBS_PER_MESSAGE jobs and MESSAGE_BYTES (a bigger job alone).
PUBLISHES_IN_FLIGHT = 2
JOBS_PER_MESSAGE = 256
MESSAGE_BYTES = 1 << 20
# How long after an LM restarted a task no node in the view fits is queued, not refused.
CATCH_UP_S = 60.0  # how long a starting GM keeps asking an LM that does not answer
RECOVER_EVERY_S = 2.0  # how often a GM looks for task ends it never heard of
# A task relayed from here with no event for this long is asked about (``_recover_relayed``),
# at most this many per round.
RELAYED_ASK_AFTER_S = 10.0
RELAYED_ASKED_MAX = 2_000
UNSTARTED_KEPT = 100_000  # accepted launches remembered until they start
# A launch, repartition or preemption the LM has not answered within lm_call_timeout_s
# (config; or whose call broke) is in doubt: the LM may have read it, or may read it late (frozen,
# overloaded). Before its tasks are placed again, the GM fences them on that LM
# (LookupTasks with a fence lease): the LM says which it holds, and refuses the request
# if it reads it afterwards (its lease is older). No clock is trusted for that. Only an
# LM that answers nothing for IN_DOUBT_S has its tasks placed elsewhere unfenced; a late
# read is then refused by the request's expiry (LM_ACCEPT_S after it was sent, by the
# wall clock), which holds while the clocks differ by less than the gap between the two.
LM_ACCEPT_S = 30.0
IN_DOUBT_S = 60.0
FENCE_RETRY_S = 0.5  # between tries to fence tasks on an LM that does not answer
# Queue failover (queue_failover): a GM subscribes to the queues it does not prefer this
# long after its own, so that the preferred GM, started with it, is first in the broker's
# line of single active consumers; and it sends each queue an empty message (a probe)
# this often, which reaches the GM the broker delivers to, so that GM knows it serves the
# queue even while no work comes (``GlobalMaster.serves``).
STANDBY_AFTER_S = 2.0
PROBE_EVERY_S = 2.0
SERVING_WINDOW_S = 3 * PROBE_EVERY_S
PROBE = b""  # never a job: a job has at least one task
OUTPUT_TIMEOUT_S = 8.0  # GetTaskOutput through an LM (which waits 5 s for its worker)


@dataclass(eq=False)
class Batch:
    """One broker message; acked when every task in it has launched.

    ``delivery`` is None while a job this GM enqueued and scheduled from memory waits for
    its message to come back from the broker.
    """

    delivery: Delivery | None
    remaining: int
    cancelled: bool = False  # the broker refused it: its unlaunched tasks are dropped
    # Later deliveries of the same message that joined it while its tasks waited here (its
    # first delivery's channel closed: a broker restart); acked with it.
    joined: list[Delivery] = field(default_factory=list)
    out: int = 0  # its tasks in launch or preempt requests not answered yet
    # Batches of later copies that skipped, as taken, tasks this one holds queued
    # (``GlobalMaster._holders``): each is one task nearer its ack once this one is done.
    followers: list[Batch] = field(default_factory=list)
    _landed: asyncio.Event | None = field(default=None, repr=False)

    def launching(self) -> None:
        self.out += 1

    def landed(self) -> None:
        self.out -= 1
        if self.out == 0 and self._landed is not None:
            self._landed.set()

    async def all_landed(self) -> None:
        """Until no request with a task of this message is still out at an LM."""
        while self.out:
            self._landed = asyncio.Event()
            await self._landed.wait()


def _deliveries(batch: Batch) -> list[Delivery]:
    """Take the deliveries a batch holds back (to hand them on)."""
    out = [d for d in (batch.delivery, *batch.joined) if d is not None]
    batch.delivery, batch.joined = None, []
    return out


def _one_done(batch: Batch) -> list[Delivery]:
    """One more of the message's tasks is accounted for (launched or dropped); its
    deliveries, to ack, once that was the last."""
    batch.remaining -= 1
    if batch.remaining:
        return []
    done = [d for d in (batch.delivery, *batch.joined) if d is not None]
    for follower in batch.followers:
        done.extend(_one_done(follower))
    return done


@dataclass(eq=False, slots=True)
class _Whole:
    """A user-queue message of several jobs: acked once each of its parts is."""

    delivery: Delivery
    unsettled: int


class _Part:
    """One job of a message that carries several (``TaskBatch.more_jobs``): to the GM, a
    delivery of its own. Its ack counts towards the message's, which goes once every
    part was acked; its nack gives the whole message back (its other jobs come again,
    marked redelivered, and are checked against what launched like any redelivery)."""

    __slots__ = ("_settled", "_whole", "batch")

    def __init__(self, whole: _Whole, batch: common_pb2.TaskBatch) -> None:
        self._whole = whole
        self._settled = False
        self.batch = batch

    @property
    def body(self) -> bytes:
        return self.batch.SerializeToString()

    @property
    def redelivered(self) -> bool:
        return self._whole.delivery.redelivered

    @property
    def headers(self):
        return self._whole.delivery.headers

    @property
    def message_id(self) -> str:
        return self._whole.delivery.message_id

    async def ack(self) -> None:
        if self._settled:
            return
        self._settled = True
        self._whole.unsettled -= 1
        if self._whole.unsettled == 0:
            await self._whole.delivery.ack()

    async def nack(self, requeue: bool = True) -> None:
        if not self._settled:
            self._settled = True
            await self._whole.delivery.nack(requeue=requeue)


def _fits_a_message(bodies) -> int:
    """How many of the waiting jobs' bodies go in the next message (at least one)."""
    size = 0
    for count, body in enumerate(bodies[:JOBS_PER_MESSAGE]):
        size += len(body)
        if size > MESSAGE_BYTES:
            return max(1, count)
    return min(len(bodies), JOBS_PER_MESSAGE)


def _owner() -> str:
    """Who submits the job being served (``user/alice``), as its tasks carry it; "" when
    callers are not identified (no authorization)."""
    who = authz.caller.get()
    return str(who) if who.role else ""


def _message_key(batch: common_pb2.TaskBatch) -> tuple:
    """Tells one queue message from any other: a re-queued task is a new attempt."""
    return (batch.job_id, tuple((t.task_id, t.attempt) for t in batch.tasks))


class Refused(Exception):
    """A submission turned down: the gRPC status and the reason the client is given."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code = code
        self.details = details


def _no_lm_yet() -> Refused:
    return Refused(grpc.StatusCode.UNAVAILABLE, "no Local Master heard from yet; retry shortly")


@dataclass(eq=False)
class Pending(OneTask):
    """One task waiting in a user queue: the scheduler core's ``Work`` of one task."""

    task: common_pb2.Task
    spec: TaskSpec
    batch: Batch
    rejections: int = 0
    # When the task was queued, on the wall clock every GM shares (``OldestFirst``
    # compares it across GMs; the queues keep their work in its order). Read once: the
    # stamp is set before a task is queued and a queued task's never changes.
    enqueued: float = field(init=False)

    def __post_init__(self) -> None:
        stamps = self.task.timestamps
        self.enqueued = (stamps.queued_unix_nanos or stamps.submitted_unix_nanos) / 1e9


@dataclass
class RecentAllocations:
    """Recent allocation times (seconds) of tasks this GM scheduled."""

    values: deque = field(default_factory=lambda: deque(maxlen=10_000))


def _vdc_of(request) -> Vdc | None:
    """A request's VDC (``SubmitJobRequest.vdc``, ``PlanJobRequest.vdc``), or ``Refused``
    (INVALID_ARGUMENT) saying what is wrong with it."""
    if not request.HasField("vdc"):
        return None
    try:
        return vdc_from_proto(request.vdc)
    except VdcError as err:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"vdc: {err}") from None


def _too_few_tasks(request) -> str:
    return f"min_tasks {request.min_tasks} is more than the job's {len(request.tasks)} tasks"


class GlobalMaster(global_master_pb2_grpc.GlobalMasterServicer):
    def __init__(self, config: FederationConfig, gm_id: str, bus: Bus):
        self.config = config
        self.seal_key = config.task_seal_key()  # seals of the tasks it accepts (GMs only)
        self.gm_id = gm_id
        self.bus = bus
        self.view = GlobalView(
            gm_id,
            config.placement_policy(),
            config.num_constraints,
            config.constraint_labels,
            silent_after_s=silent_after(config.heartbeat_interval_s),
            owner_grace_s=config.owner_grace_s,
            claims=config.claims,
        )
        self.fair = FairShare(
            [q.as_share() for q in config.effective_queues()], slack=config.preemption_slack
        )
        self.failover = config.queue_failover
        self.preferred = [q.name for q in config.queues_of(gm_id)]
        # The queues this GM consumes: its own; with queue failover every queue, which the
        # broker delivers to one of their consumers at a time (single active consumer).
        everything = [q.name for q in config.effective_queues()]
        self.my_queues = everything if self.failover else self.preferred
        # Where a job submitted here is scheduled from memory, before its delivery comes
        # back (``_queue_job``): only where no other GM can be delivered its message.
        self._from_memory = frozenset() if self.failover else frozenset(self.preferred)
        self._delivered_at: dict[str, float] = {}  # queue -> when its last message came
        # Every queue's limit: checked at submission here whatever GM serves the queue,
        # enforced when placing by the one that does.
        self.limits = QueueLimits.parse((q.name, q.limit) for q in config.effective_queues())
        self._limited_here = any(q in self.limits for q in self.my_queues)
        self._started_at = time.monotonic()
        self._started_unix_nanos = time.time_ns()
        self._settle_timer: asyncio.TimerHandle | None = None
        # Within a queue, a task of a higher priority is served first.
        self.queues: UserQueues[Pending] = UserQueues(
            self.my_queues, priority=lambda item: item.task.priority
        )
        self.jobs = JobBook(max_tasks=config.gm_job_history_tasks)
        # Jobs submitted here to our own queues, scheduled from memory, whose broker
        # delivery has not arrived yet (see SubmitJob).
        self._local: dict[tuple, Batch] = {}
        # Messages whose tasks this GM holds, by message key, while they are held: a
        # delivery of the same message again joins them (``_on_delivery``).
        self._held: weakref.WeakValueDictionary[tuple, Batch] = weakref.WeakValueDictionary()
        # The batch each task queued here was last given to, by task id: a copy of a
        # message that skips a task as taken while it is only queued here waits for it
        # (``_holders``). Weak: gone with the batch.
        self._holding: weakref.WeakValueDictionary[str, Batch] = weakref.WeakValueDictionary()
        # Jobs whose publish failed here, by job id, so the broker may or may not hold
        # their message: its delivery, if it ever comes, must first ask the LMs what
        # launched, and a retry must first wait for the launches still out to land, so
        # that it knows which tasks ran and which were dropped (``JobBook.taken``). Kept
        # until the delivery comes; the ``_local`` entry goes once nothing is out
        # (``_forget_failed``).
        self._failed: dict[str, Batch] = {}
        # A publisher per user queue (``_enqueue``).
        self._publishers: dict[str, Gatherer[bytes]] = {}
        # Client-named jobs (SubmitJob.job_id) whose submission is under way here: a retry
        # of the same id waits for it (``_submit``).
        self._submitting: dict[str, asyncio.Event] = {}
        # Set once every LM said what it holds, or was given up on (``_catch_up``).
        self._caught_up = asyncio.Event()
        # How many submissions are under way at once (read, not answered): adapted to
        # answer each within a second (``services/core/admission.py``).
        self.admission = Admission(max_limit=MAX_SUBMISSIONS)
        self._overloaded = False  # refusing submissions (said once per spell)
        self.recent = RecentAllocations()
        self.preempted: defaultdict[str, int] = defaultdict(int)  # queue -> tasks preempted
        # Every decision about the queued tasks: the round, replies, the view's changes.
        self.scheduler: Scheduler[Pending] = Scheduler(
            self.view,
            self.queues,
            self.fair,
            self.limits,
            round_per_queue=ROUND_PER_QUEUE,
            max_rejections=MAX_REJECTIONS,
            lm_ids=[lm.id for lm in config.lms],
            started_at=self._started_at,
            limit_settle_s=self.limit_settle_s,
            withdrawn=lambda item: item.batch.cancelled,
            charge_taken=True,  # a round is as long as the work it takes (RoundBudget)
        )
        self.round_budget = RoundBudget(most=ROUND_PER_QUEUE)  # sets round_per_queue
        self._round_seconds = metrics.SCHEDULE_ROUND_SECONDS.labels(gm_id)
        self._stubs = {
            lm.id: local_master_pb2_grpc.LocalMasterStub(channel(lm.target)) for lm in config.lms
        }
        self._launchers = {lm_id: Launcher(stub) for lm_id, stub in self._stubs.items()}
        predictor = config.predictor.target if config.predictor is not None else None
        self.predictions = LifetimePredictions(gm_id, predictor)
        self._wake = asyncio.Event()
        self._loops: list[asyncio.Task] = []
        self._inflight: set[asyncio.Task] = set()
        self.cancelled = self.scheduler.cancelled  # dropped wherever they turn up
        # The fencing token of this GM's requests (Task.lease): above every lease of an
        # earlier life (a restart takes far longer than the nanoseconds counted), raised
        # by each fence, so a request older than a fence is refused wherever it lands.
        self.scheduler.lease = time.time_ns()
        self._early_expiry_warned: set[str] = set()  # LMs whose clocks look off
        # Tasks an LM accepted from this GM that no event has shown started yet, by id:
        # (LM, when, the wire task). If that LM dies before passing one to its worker,
        # this is the only copy left (see _requeue_lost_starts).
        self._unstarted: OrderedDict[str, tuple[str, float, common_pb2.Task]] = OrderedDict()
        self._subscriptions: list = []
        self._closed = False
        self.counters: dict[str, int] = defaultdict(int)
        # Gang jobs: planned and started whole, never through the scheduler's queues.
        self.gangs = Gangs(self)

    @property
    def _lease(self) -> int:
        return self.scheduler.lease

    @_lease.setter
    def _lease(self, lease: int) -> None:
        self.scheduler.lease = lease

    # ----------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._subscriptions.append(
            await self.bus.subscribe_fanout(
                HEARTBEAT_EXCHANGE, self._on_heartbeat, ttl_s=self.config.heartbeat_interval_s
            )
        )
        self._subscriptions.append(
            await self.bus.subscribe_topic(EVENT_EXCHANGE, EVERY_TASK_EVENT, self._on_events)
        )
        self._subscriptions.append(
            await self.bus.subscribe_fanout(
                CANCEL_EXCHANGE, self._on_cancel_message, keep_as=cancel_queue(self.gm_id)
            )
        )
        if self.config.claims == "oldest":
            self._subscriptions.append(
                await self.bus.subscribe_fanout(
                    BACKLOG_EXCHANGE, self._on_backlog, ttl_s=self.config.heartbeat_interval_s
                )
            )
            self._loops.append(long_lived(self._backlog_loop, "gm-backlog"))
        if self.bus.signing_key is None and self.config.tls is not None:
            log.warning(
                "tls is set but broker.queue_signing_key is not: this GM schedules any "
                "message a broker user can put in its queues (docs/security.md, The broker)"
            )
        for queue in self.preferred:
            await self._consume(queue)
        if self.failover:
            self._loops.append(long_lived(self._standby, "gm-standby"))
        self._loops.append(long_lived(self._schedule_loop, "gm-schedule"))
        self._loops.append(long_lived(self._gauge_loop, "gm-gauges"))
        self._loops.append(long_lived(self._recover_loop, "gm-recover"))
        self._loops.append(long_lived(self._catch_up, "gm-catch-up"))
        stalls.LAG_LISTENERS.append(self._on_lag)

    def _on_lag(self, lag_s: float) -> None:
        self.admission.lagged(lag_s, time.monotonic())

    async def _consume(self, queue: str) -> None:
        self._subscriptions.append(
            await self.bus.consume(user_queue(queue), self._authenticated(queue), prefetch=1000)
        )

    async def _standby(self) -> None:
        """Queue failover: line up for the other GMs' queues, then probe every queue
        consumed, so that whichever GM the broker delivers it to knows it serves it."""
        await asyncio.sleep(STANDBY_AFTER_S)
        waiting = [queue for queue in self.my_queues if queue not in self.preferred]
        while waiting and not self._closed:
            try:
                await self._consume(waiting[0])
                waiting.pop(0)
            except Exception as err:  # the broker away: try again, or no standby here
                log.warning(
                    "could not line up for a queue; trying again",
                    extra={"queue": waiting[0], "error": repr(err)},
                )
                await asyncio.sleep(PROBE_EVERY_S)
        while not self._closed:
            for queue in self.my_queues:
                try:
                    await self.bus.enqueue(user_queue(queue), PROBE)
                except Exception as err:  # the broker away: the reconnection says so
                    log.debug("probe not sent", extra={"queue": queue, "error": repr(err)})
            await asyncio.sleep(PROBE_EVERY_S)

    def serves(self, queue: str) -> bool:
        """Whether this GM serves ``queue`` now: its own queue, or with queue failover one
        whose messages (work or probes) the broker delivered here lately or whose tasks
        wait here (a GM whose prefetch is full of a backlog gets nothing new for a while)."""
        if not self.failover:
            return queue in self._from_memory
        at = self._delivered_at.get(queue)
        if at is not None and time.monotonic() - at < SERVING_WINDOW_S:
            return True
        return queue in self.my_queues and self.queues.pending(queue) > 0

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(ValueError):
            stalls.LAG_LISTENERS.remove(self._on_lag)
        if self._settle_timer is not None:
            self._settle_timer.cancel()
        for sub in self._subscriptions:
            with contextlib.suppress(Exception):
                await sub.cancel()
        for loop in [*self._loops, *self._inflight]:
            loop.cancel()
        for loop in [*self._loops, *self._inflight]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await loop
        for launcher in self._launchers.values():
            await launcher.close()
        for queue, publisher in self._publishers.items():
            publisher.stop()
            log.info(
                "published %d jobs to queue %s in %d messages",
                publisher.items,
                queue,
                publisher.calls,
                extra={"queue": queue, "jobs": publisher.items, "messages": publisher.calls},
            )
        await self.predictions.close()

    # ------------------------------------------------------------ client API
    async def SubmitJob(self, request, context):
        try:
            return await self._submit(request)
        except Refused as refused:
            await context.abort(refused.code, refused.details)

    async def SubmitStream(self, request_iterator, context):
        """Jobs as stream messages, each handled as its own SubmitJob (concurrently: one
        waiting for its broker confirm does not hold up the next); answers in any order."""
        answers: asyncio.Queue = asyncio.Queue()
        done_reading = object()

        def refused_reply(message, refused: Refused) -> global_master_pb2.SubmitStreamResponse:
            return global_master_pb2.SubmitStreamResponse(
                request_id=message.request_id,
                error_code=refused.code.value[0],
                error_message=refused.details,
            )

        async def handle(message) -> None:
            reply = global_master_pb2.SubmitStreamResponse(request_id=message.request_id)
            try:
                reply.submit.CopyFrom(await self._submit_admitted(message.submit))
            except Refused as refused:
                reply = refused_reply(message, refused)
            except Exception as err:  # answered, so the client's request does not hang
                log.exception("SubmitStream request failed")
                reply.error_code = grpc.StatusCode.INTERNAL.value[0]
                reply.error_message = repr(err)
            answers.put_nowait(reply)

        outstanding = 0
        owed_fewer = asyncio.Event()  # set as answers go out: a paused read goes on
        queueing = QueueingDelay()  # this client's clock against ours
        read_waits = metrics.SUBMISSION_READ_WAIT_SECONDS.labels(self.gm_id)

        async def read() -> None:
            nonlocal outstanding
            try:
                async for message in request_iterator:
                    if outstanding >= STREAM_ANSWERS_OWED:
                        metrics.SUBMIT_STREAMS_PAUSED.labels(self.gm_id).inc()
                        while outstanding >= STREAM_ANSWERS_OWED:
                            owed_fewer.clear()
                            await owed_fewer.wait()
                    read_ns = time.time_ns()
                    # A message may carry more submissions (``more_jobs``): each its own job.
                    for one in (message, *message.more_jobs):
                        outstanding += 1
                        # How long it waited in front of this read (the client's stream,
                        # flow control), for the reports (not counted by the intake:
                        # ``QueueingDelay``).
                        waited_s = queueing.wait_s(one.asked_unix_nanos, read_ns)
                        read_waits.observe(waited_s)
                        # Refused here and now, without a task: under overload most are.
                        refused = self._refusal(one.submit)
                        if refused is not None:
                            answers.put_nowait(refused_reply(one, refused))
                            continue
                        # Not tied to the stream: a job being queued finishes queueing
                        # even if the client goes (it learns of it through GetJob, as
                        # after a lost unary answer).
                        self._spawn(handle(one))
            except Exception as err:  # the stream broke; answers still owed are dropped
                log.debug("SubmitStream ended", extra={"error": repr(err)})
            finally:
                answers.put_nowait(done_reading)

        reader = asyncio.create_task(read())
        reading = True
        try:
            while reading or outstanding:
                answer = await answers.get()
                if answer is done_reading:
                    reading = False
                    continue
                # The answers ready meanwhile go in the same message (``more_answers``).
                more = []
                while not answers.empty() and len(more) < MAX_COALESCED:
                    ready = answers.get_nowait()
                    if ready is done_reading:
                        reading = False
                        break
                    more.append(ready)
                if more:
                    answer.more_answers.extend(more)
                yield answer
                # Owed until the client has read it (the yield returns once gRPC took it).
                outstanding -= 1 + len(more)
                owed_fewer.set()
        finally:
            reader.cancel()

    async def _submit(self, request) -> global_master_pb2.SubmitJobResponse:
        """Queue one job, or raise ``Refused`` (what the client is told): RESOURCE_EXHAUSTED
        when the GM's intake is full (``Admission``)."""
        refused = self._refusal(request)
        if refused is not None:
            raise refused
        return await self._submit_admitted(request)

    def _refusal(self, request) -> Refused | None:
        """Why ``request`` is refused at once (a bad id, or the intake full), or None: then
        it is taken on (``Admission``) and ``_submit_admitted`` must follow. Cheap and
        synchronous, so that a stream's reader refuses without a task per submission."""
        for name in ("job_id", "queue"):  # a SubmitStream's are not checked on arrival
            if problem := id_problem(name, getattr(request, name)):
                return Refused(grpc.StatusCode.INVALID_ARGUMENT, problem)
        refusal = self.admission.admit(request.queue)
        if refusal is None:
            self._overloaded = False
            return None
        metrics.SUBMISSIONS_REFUSED.labels(self.gm_id).inc()
        if not self._overloaded:
            self._overloaded = True
            log.warning(
                "refusing submissions: %s",
                refusal,
                extra={"under_way": refusal.under_way, "limit": refusal.limit},
            )
        named = f"job {shown(request.job_id)}" if request.job_id else "the job"
        return Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{refusal}: {named} was not queued; retry it in a moment, backing off "
            f"(from {BUSY_PAUSE_S:g} s, doubling, up to {BUSY_PAUSE_MAX_S:g} s)",
        )

    async def _submit_admitted(self, request) -> global_master_pb2.SubmitJobResponse:
        """``_submit`` once ``_refusal`` took it on: the intake counts it until answered."""
        queue = request.queue
        began = time.monotonic()
        try:
            return await self._submit_job(request)
        finally:
            now = time.monotonic()
            self.admission.ended(queue, now - began, now)
            metrics.SUBMISSION_ANSWER_SECONDS.labels(self.gm_id).observe(now - began)

    async def _submit_job(self, request) -> global_master_pb2.SubmitJobResponse:
        """``_submit`` once admitted.

        A job the client names (``job_id``) may be a retry, e.g. after a timeout: one
        submission of an id at a time, and a retry queues only the tasks this GM does not
        know as queued, running or ended; an exact retry of a queued job queues nothing
        and gets the same answer. A duplicate message that reaches the queue anyway (a
        retry through another GM) is dropped on delivery by the GM serving the queue.
        Retries are recognised within a GM's memory of jobs (``JobBook``: the newest
        100,000, since the GM started, and what the LMs hold): a GM that started lately
        takes a named job only once it has heard from every LM (``_catch_up``), or the
        tasks an earlier life of it launched, or another GM, would run again.
        """
        job_id = request.job_id
        if not job_id:
            return await self._queue_job(request, new_job_id())
        if not self.view.lms:
            # Said at once, as to a job without an id: catching up (below) waits for
            # every LM, up to CATCH_UP_S, and none was heard from yet.
            raise _no_lm_yet()
        await self._caught_up.wait()
        while (under_way := self._submitting.get(job_id)) is not None:
            await under_way.wait()
        self._submitting[job_id] = done = asyncio.Event()
        try:
            if (failed := self._failed.get(job_id)) is not None:
                await failed.all_landed()
            return await self._queue_job(request, job_id)
        finally:
            del self._submitting[job_id]
            done.set()

    def _job_queue(self, request) -> str:
        """The queue a job (a SubmitJob or PlanJob request) goes to, once its task count
        and queue are checked; else ``Refused``."""
        if not request.tasks:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a job needs at least one task")
        if len(request.tasks) > MAX_TASKS_PER_JOB:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a job may have at most {MAX_TASKS_PER_JOB} tasks, got {len(request.tasks)}",
            )
        queue = request.queue or self.config.effective_queues()[0].name
        if self.config.queue(queue) is None:
            known = ", ".join(q.name for q in self.config.effective_queues())
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT, f"unknown queue {queue!r}; known: {known}"
            )
        return queue

    async def _queue_job(self, request, job_id: str) -> global_master_pb2.SubmitJobResponse:
        """Queue the tasks of one job not already taken, or raise ``Refused`` having
        changed nothing."""
        now = time.time_ns()
        queue = self._job_queue(request)
        if not self.view.lms:
            raise _no_lm_yet()
        owner = _owner()
        known = self.jobs.get(job_id)
        if known is not None and known.owner and owner and known.owner != owner:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"job {shown(job_id)} is {known.owner}'s: name your job otherwise",
            )
        vdc = _vdc_of(request)
        gang = request.gang or request.min_tasks > 0 or vdc is not None
        if request.min_tasks > len(request.tasks):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, _too_few_tasks(request))
        batch = common_pb2.TaskBatch(
            job_id=job_id, queue=queue, gang=gang, min_tasks=request.min_tasks
        )
        batch.tasks.extend(request.tasks)
        specs: list[TaskSpec] = []
        for i, task in enumerate(batch.tasks):
            if i and not i % TASKS_BETWEEN_TURNS:
                # A big job is checked in turns with the GM's other work (nothing has
                # changed yet: a call cancelled here, its client gone, leaves nothing).
                await asyncio.sleep(0)
            task.task_id = task.task_id or f"{job_id}.{i}"
            task.job_id, task.queue, task.index = job_id, queue, i
            task.owner = owner  # the caller's, whatever the client wrote
            task.ClearField("vdc")  # the job's, whatever the client wrote
            if vdc is not None:
                task.vdc.CopyFrom(request.vdc)
            try:
                check_submitted(task)
                spec = parse_task(task, self.config.num_constraints)
            except InvalidTask as err:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
            never = self.scheduler.never_runs(queue, spec, time.monotonic())
            if never is not None:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"task {task.task_id} can never run here: {never}",
                )
            specs.append(spec)
            if not task.timestamps.submitted_unix_nanos:
                task.timestamps.submitted_unix_nanos = now
        ids = [t.task_id for t in batch.tasks]
        if len(set(ids)) != len(ids):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "task ids must be unique")
        never = self.gangs.never(job_id, queue, specs, request.min_tasks, vdc) if gang else None
        if never is not None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"gang job {shown(job_id)} can never start whole here: {never} (a gang "
                "starts all its tasks at once, or min_tasks of them)",
            )
        for task_id in ids:
            # An LM would take it for the other job's task (two GMs racing are told
            # apart there: REJECTED_TASK_ID_TAKEN).
            if (holder := self.jobs.holder(task_id, job_id)) is not None:
                raise Refused(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"task id {shown(task_id)} is taken by job {shown(holder)}: task ids "
                    "are unique across the federation; name the task otherwise, or leave "
                    "its task_id empty",
                )
        if taken := self.jobs.taken(job_id, batch.tasks):
            if len(taken) == len(ids):  # a retry of a job queued already
                return global_master_pb2.SubmitJobResponse(job_id=job_id, task_ids=ids)
            kept = [
                (t, spec)
                for t, spec in zip(batch.tasks, specs, strict=True)
                if t.task_id not in taken
            ]
            batch = common_pb2.TaskBatch(
                job_id=job_id,
                queue=queue,
                tasks=[t for t, _ in kept],
                gang=gang,
                min_tasks=request.min_tasks,
            )
            specs = [spec for _, spec in kept]
        # Before the durable enqueue, so the prediction travels with the task; bounded by
        # a short deadline and skipped while the sidecar is down.
        await self.predictions.annotate(batch.tasks)
        if self.seal_key is not None:
            for task in batch.tasks:
                task.seal = seal(self.seal_key, task)
        if not self.bus.can_enqueue:
            # Known before anything is scheduled: refuse the job whole (a failure found
            # only while publishing is handled below, after tasks may have launched).
            raise Refused(
                grpc.StatusCode.UNAVAILABLE,
                f"the broker is unreachable: this try queued nothing of job {job_id}; "
                f"retry it naming job_id {job_id} (an earlier try through another GM may "
                "have been queued: the same id never runs a task twice)",
            )
        queued = time.time_ns()
        for task in batch.tasks:
            task.timestamps.queued_unix_nanos = queued
        body = batch.SerializeToString()
        if queue not in self._from_memory:
            try:
                await self._enqueue(queue, body)
            except Exception as err:  # nacked, or unknown: the client's retry settles it
                raise Refused(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the broker did not confirm job {job_id} ({err!r}), so it may or may "
                    f"not have been queued: retry it naming job_id {job_id} (the same id "
                    "never runs a task twice)",
                ) from err
            for task in batch.tasks:
                self.jobs.queued(task, relayed=True)
            return global_master_pb2.SubmitJobResponse(job_id=job_id, task_ids=ids)
        # Our own queue: schedule from memory while the broker stores the message, instead
        # of after its delivery comes back to us. The client is still answered only once
        # the broker confirmed, and the message is still acked only once every task in it
        # has launched: its delivery, whenever it arrives, just joins this Batch. A task
        # an LM launched before the confirm is as safe as any launched task. Registered
        # before publishing: the delivery may overtake the confirm.
        # A big job is scheduled after the confirm instead: its scheduling rounds would
        # otherwise delay the answer (a client submitting one job after another waits for
        # it), and the confirm is small next to the time its own tasks take to place.
        key = _message_key(batch)
        local = self._local[key] = self._held[key] = Batch(None, remaining=len(batch.tasks))
        # A gang is one plan, not rounds of its tasks: started at once whatever its size.
        early = gang or len(batch.tasks) <= SCHEDULE_BEFORE_CONFIRM
        pending: list[Pending] = []
        if early:
            # Booked in one go: a call cancelled while a gang was half booked would
            # leave its booked tasks counted as taken (a retry's would never run).
            pending = [
                Pending(task, spec, local) for task, spec in zip(batch.tasks, specs, strict=True)
            ]
            self._book(batch.tasks, local)
            if gang:
                self.gangs.start(GangJob(job_id, queue, pending, request.min_tasks))
            else:
                self._push(queue, pending)
            # Two turns of the loop: the scheduling round runs, then the launch it spawned
            # writes to the LM, before the publish below, which frames and writes the
            # message (a few hundred µs of CPU) before it first yields.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        try:
            if not early:
                # A big job is booked in turns with the GM's other work; cut short (its
                # client gone), what was booked is undone below like a failed publish.
                for start in range(0, len(batch.tasks), TASKS_BETWEEN_TURNS):
                    if start:
                        await asyncio.sleep(0)
                    part = batch.tasks[start : start + TASKS_BETWEEN_TURNS]
                    pending.extend(
                        Pending(task, spec, local)
                        for task, spec in zip(part, specs[start : start + len(part)], strict=True)
                    )
                    self._book(part, local)
            await self._enqueue(queue, body)
            if not early and len(pending) > TASKS_BETWEEN_TURNS:
                # Stored: scheduled in turns too, whatever becomes of this call.
                self._spawn(self._push_in_turns(queue, pending))
            elif not early:
                self._push(queue, pending)
        except BaseException as err:
            # Unknown whether the broker stored it (a lost confirm, a client gone). Tasks
            # not launched yet are dropped here; if the message was stored after all, its
            # delivery is then scheduled like a redelivered one, skipping what launched.
            # Those still queued here go now; one out at an LM is dropped if it comes back.
            local.cancelled = True
            self._failed[job_id] = local
            self._spawn(self._forget_failed(key, local))
            for item in self.scheduler.withdraw(queue, lambda item: item.batch is local):
                self._drop(item, Drop.WITHDRAWN)
            if not early:
                # None was pushed to the scheduler: all are only booked as queued. Left so,
                # a retry's message (through another GM) would find them "taken" here and
                # be acked with nothing run (the two-queue preemption replay: a 33-task
                # job stuck after a confirm timed out on a loaded machine).
                for task in batch.tasks:
                    self._event(task, common_pb2.TASK_STATE_REJECTED, "the broker refused it")
            # Stored after all, its delivery may be here already (it overtook the lost
            # confirm, or a client's retry through another GM published it again): those
            # joined this batch and would wait for it forever. Each is taken as a delivery
            # anew, checked against what launched (``chaos-sim --small --seed 4767``).
            for delivery in _deliveries(local):
                self._spawn(self._on_delivery(delivery))
            log.warning(
                "enqueue failed; dropping the job's unlaunched tasks",
                extra={"job_id": job_id, "error": repr(err)},
            )
            if isinstance(err, Exception):
                raise Refused(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the broker did not confirm job {job_id} ({err!r}); its tasks that "
                    "had not launched yet were dropped (GetJob shows which ran): retry it "
                    f"naming job_id {job_id}, which queues only the tasks not taken",
                ) from err
            raise
        return global_master_pb2.SubmitJobResponse(job_id=job_id, task_ids=ids)

    async def _enqueue(self, queue: str, body: bytes) -> None:
        """Store one job's message (a serialized TaskBatch) in user queue ``queue``; return
        once the broker confirmed it, or raise. The jobs taken for the queue while its
        publishes await their confirms go together in its next one (``Gatherer``,
        ``queue_messages.join``): under load a publish, a confirm, a delivery and an ack
        for many jobs, not for each. Those of a failed publish all fail with it, each
        then handled as a job whose publish failed alone."""
        publisher = self._publishers.get(queue)
        if publisher is None:
            name = user_queue(queue)

            messages = metrics.QUEUE_MESSAGES.labels(self.gm_id)
            jobs = metrics.QUEUE_MESSAGE_JOBS.labels(self.gm_id)

            async def publish(bodies: list[bytes]) -> None:
                messages.inc()
                jobs.inc(len(bodies))
                await self.bus.enqueue(name, queue_messages.join(bodies))

            publisher = self._publishers[queue] = Gatherer(
                publish, _fits_a_message, f"publish {queue}", PUBLISHES_IN_FLIGHT
            )
        await publisher.send(body)

    async def _forget_failed(self, key: tuple, local: Batch) -> None:
        """A failed submission's message may never arrive: once none of its launches is
        out, its entry (which holds every task id) leaves ``_local``; ``_failed`` keeps
        its job id, enough for a late delivery to check what launched."""
        await local.all_landed()
        if self._local.get(key) is local:
            del self._local[key]

    def _push(self, queue: str, items: list[Pending]) -> None:
        for item in items:
            self.scheduler.submit(queue, item)
        self._wake.set()

    async def _push_in_turns(self, queue: str, items: list[Pending]) -> None:
        """``_push``, ``TASKS_BETWEEN_TURNS`` at a time, the GM's other work let run between
        (the first part is scheduled meanwhile)."""
        for start in range(0, len(items), TASKS_BETWEEN_TURNS):
            if start:
                await asyncio.sleep(0)
            self._push(queue, items[start : start + TASKS_BETWEEN_TURNS])

    def _book(self, tasks, batch: Batch) -> None:
        """``tasks`` are queued here, held by ``batch`` (scheduled from memory)."""
        for task in tasks:
            self.jobs.queued(task)
            self._holding[task.task_id] = batch

    async def GetJob(self, request, context):
        job = self.jobs.get(request.job_id)
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id!r} known here")
        return job.response()

    async def GetTaskOutput(self, request, context):
        """A task attempt's output, asked of the LM and node it ran on (see below)."""
        job = self.jobs.get(request.job_id)
        status = job.status(request.task_id) if job is not None else None
        if status is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no task {request.task_id!r} of job {request.job_id!r} known here",
            )
        attempt = status.attempt if request.latest_attempt else request.attempt
        # Where that attempt ran: the latest node, or an earlier attempt's (kept in
        # ``earlier_attempts``, the previous one's too); an attempt this GM never heard
        # ran is looked for on the latest node's host.
        where = next((e for e in status.earlier_attempts if e.attempt == attempt), status)
        if not where.lm_id or not where.node_id or where.lm_id not in self._stubs:
            if status.state in TERMINAL:  # ended (cancelled, rejected) without running
                return common_pb2.GetTaskOutputResponse(attempt=attempt, state=status.state)
            state = common_pb2.TaskState.Name(status.state).removeprefix("TASK_STATE_")
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"task {request.task_id!r} has not run on a worker yet ({state.lower()})",
            )
        ask = common_pb2.GetTaskOutputRequest()
        ask.CopyFrom(request)
        ask.node_id, ask.attempt = where.node_id, attempt
        try:
            reply = await self._stubs[where.lm_id].GetTaskOutput(ask, timeout=OUTPUT_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            await context.abort(err.code(), f"{where.lm_id}: {err.details()}")
        reply.attempt, reply.state = attempt, status.state
        return reply

    async def WatchJob(self, request, context):
        job = self.jobs.get(request.job_id)
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id!r} known here")
        updates = Watch()
        job.watchers.append(updates)
        # Copy every status now, with no await between subscribing and copying: an event
        # applied later reaches this watcher through ``updates`` only, so none comes twice.
        # The copy is of references to the kept bytes, each parsed as it is sent: a
        # client slow to read a 100,000-task job holds 0.8 MB here, not every status.
        current = job.kept()
        try:
            for data in current:
                if updates.cut:
                    break
                status = global_master_pb2.TaskStatus.FromString(data)
                # A later attempt's status first replays how the attempt before it ended.
                if status.HasField("previous_end"):
                    yield global_master_pb2.WatchJobResponse(event=status.previous_end)
                yield global_master_pb2.WatchJobResponse(event=status_event(job, status))
            del current
            # The record may turn done while events are still queued for this watcher:
            # deliver everything queued before ending the stream.
            while not updates.cut and not (job.done and updates.empty()):
                event = await updates.get()
                if event is None:
                    break
                yield global_master_pb2.WatchJobResponse(event=event)
        finally:
            job.watchers.remove(updates)
        if updates.cut:
            metrics.WATCHES_CUT.labels(self.gm_id).inc()
            log.info("watch cut", extra={"job_id": request.job_id, "behind": updates.bound})
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this watch of job {shown(request.job_id)} fell {updates.bound:,} events "
                "behind: watch again (a new watch starts with each task's current state)",
            )

    async def ListJobs(self, request, context):
        if not 0 <= request.limit <= MAX_LISTED_JOBS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"limit must be between 0 (the default, {DEFAULT_LISTED_JOBS}) and "
                f"{MAX_LISTED_JOBS}, got {request.limit}",
            )
        policy, who = authz.policy(), authz.caller.get()
        visible = None if policy is None else (lambda queue: policy.may(who, "watch", queue))
        if policy is not None and who.role not in ("user", "admin"):
            visible = None  # services (the console, the autoscaler) see every queue
        jobs = self.jobs.newest(
            request.limit or DEFAULT_LISTED_JOBS, request.queue, request.unfinished_only, visible
        )
        return global_master_pb2.ListJobsResponse(jobs=[job.summary() for job in jobs])

    def job_access(self, job_id: str) -> authz.Job | None:
        """A job's queue and owner, for the authorizer (None: not known here)."""
        job = self.jobs.get(job_id)
        return None if job is None else authz.Job(job.queue, job.owner)

    async def CancelJob(self, request, context):
        if not request.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id is required")
        try:
            await self._publish_cancel(request.job_id, request.reason or "cancelled")
        except Exception as err:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"could not publish the cancel ({err!r}); nothing was cancelled: try again",
            )
        job = self.jobs.get(request.job_id)
        unfinished = 0 if job is None else job.unfinished
        self._cancel(request.job_id, request.reason or "cancelled")  # at once here
        log.info(
            "job cancelled",
            extra={"job_id": request.job_id, "known": job is not None, "unfinished": unfinished},
        )
        return global_master_pb2.CancelJobResponse(known=job is not None, unfinished=unfinished)

    async def GetClusterView(self, request, context):
        now = time.monotonic()
        reply = global_master_pb2.GetClusterViewResponse()
        for lm_id in sorted(self.view.lms):
            lmv = self.view.lms[lm_id]
            free = lmv.table.partition_free()
            sizes = lmv.table.partition_sizes()
            out = reply.lms.add(
                lm_id=lm_id,
                version=lmv.version,
                age_s=now - lmv.updated_at,
                silent=self.view.silent(lm_id, now),
            )
            for p, gm in enumerate(lmv.gm_ids):
                out.partitions.add(
                    partition=p,
                    gm_id=gm,
                    node_count=int(sizes[p]),
                    free=resources_to_proto(free[p]),
                )
        usage, total = self.view.queue_usage(accepted=True), self.view.total_capacity()
        running: dict[str, int] = defaultdict(int)
        for allocation in self.view.allocations(accepted=True):
            running[allocation.queue] += 1
        for q in self.config.effective_queues():
            held = usage.get(q.name)
            status = reply.queues.add(
                queue=q.name,
                gm_id=q.gm,
                share=q.share,
                usage_share=dominant_share(held, total) if held is not None else 0.0,
                pending_tasks=self.queues.pending(q.name),
                running_tasks=running[q.name],
                preempted_tasks=self.preempted[q.name],
                served_here=self.serves(q.name),
            )
            if held is not None:
                status.held.CopyFrom(resources_to_proto(held))
            limit = self.limits.get(q.name)
            if limit is not None:
                status.limit.CopyFrom(resources_to_proto(limit_to_wire(limit)))
        if self.recent.values:
            values = np.fromiter(self.recent.values, dtype=float)
            p50, p90, p99 = np.percentile(values, [50, 90, 99])
            reply.recent_allocation_times.p50_s = p50
            reply.recent_allocation_times.p90_s = p90
            reply.recent_allocation_times.p99_s = p99
            reply.recent_allocation_times.count = values.size
            if request.allocation_samples:
                reply.recent_allocation_times.samples_s.extend(self.recent.values)
        if request.pending_shapes:
            self._pending_shapes(reply)
        return reply

    async def PlanJob(self, request, context):
        """A dry run of a job (``services.core.dry_run``): nothing is queued or kept."""
        try:
            queue = self._job_queue(request)
        except Refused as refused:
            await context.abort(refused.code, refused.details)
        specs = []
        for i, given in enumerate(request.tasks):
            task = common_pb2.Task()
            task.CopyFrom(given)
            task.task_id = task.task_id or f"dry-run.{i}"
            task.job_id, task.queue, task.index = "dry-run", queue, i
            try:
                check_submitted(task)
                specs.append(parse_task(task, self.config.num_constraints))
            except InvalidTask as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"task {i}: {err}")
        reply = global_master_pb2.PlanJobResponse(
            gm_id=self.gm_id, queue=queue, served_here=self.serves(queue)
        )
        now = time.monotonic()
        try:
            vdc = _vdc_of(request)
        except Refused as refused:
            await context.abort(refused.code, refused.details)
        if not (request.gang or request.min_tasks or vdc is not None):
            outlooks = dry_run(self.scheduler, queue, specs, now)
        elif request.min_tasks > len(specs):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _too_few_tasks(request))
        else:
            try:
                gang = gang_of("dry-run", specs, request.min_tasks, vdc)
            except GangError as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            outlooks = dry_run_gang(self.scheduler, queue, gang, now)
        for i, outlook in enumerate(outlooks):
            reply.tasks.add(
                index=i,
                outcome=int(outlook.outcome),
                lm_id=outlook.lm_id,
                node_id=outlook.node_id,
                repartition=outlook.repartition,
                reason=outlook.reason,
            )
        return reply

    def _pending_shapes(self, reply: global_master_pb2.GetClusterViewResponse) -> None:
        """The waiting tasks of the queues this GM serves, grouped by request and
        constraints, less those a queue limit holds back (what the autoscaler sizes its
        pools by)."""
        ledger = LimitLedger(self.limits, self.view.queue_usage()) if self._limited_here else None
        specs = ((q, (item.spec for item in self.queues.items(q))) for q in self.queues.names)
        for queue, vector, mask, count in waiting_shapes(specs, ledger):
            reply.pending_shapes.add(
                queue=queue,
                resources=resources_to_proto(np.array(vector, dtype=np.int64)),
                constraint_mask=mask,
                count=count,
            )

    # ------------------------------------------------------------ broker input
    def _authenticated(self, queue: str) -> Callable[[Delivery], Awaitable[None]]:
        """``_on_message`` for the messages of user queue ``queue`` that a GM or an LM
        signed; any other is dropped unread (rejected, not requeued: dead-lettered if the
        operator gave the queue a dead-letter exchange) and counted."""

        async def on_delivery(delivery: Delivery) -> None:
            why = "without a valid signature"
            if self.bus.authentic(user_queue(queue), delivery):
                self._delivered_at[queue] = time.monotonic()
                if delivery.body == PROBE:  # queue failover: tells this GM it serves it
                    await delivery.ack()
                    return
                if self.seal_key is None or self._all_sealed(delivery.body):
                    await self._on_message(delivery)
                    return
                why = "with a task whose seal does not hold"
            metrics.UNAUTHENTICATED_MESSAGES.labels(self.gm_id, queue).inc()
            log.warning(
                "dropped a message %s from %s (message id %r)",
                why,
                self.bus.queue_name(user_queue(queue)),
                delivery.message_id,
                extra={"queue": queue, "message_id": delivery.message_id},
            )
            await delivery.nack(requeue=False)

        return on_delivery

    def _all_sealed(self, body: bytes) -> bool:
        """Whether every task of a queued message carries a GM's seal (``seal_key``)."""
        assert self.seal_key is not None
        try:
            batch = common_pb2.TaskBatch.FromString(body)
        except Exception:  # not a batch: ``_on_message`` says so as before
            return True
        return all(
            sealed(self.seal_key, task) for job in (batch, *batch.more_jobs) for task in job.tasks
        )

    async def _on_message(self, delivery: Delivery) -> None:
        """A user-queue message: one job, or several (``TaskBatch.more_jobs``, ``_enqueue``),
        each then taken as a delivery of its own (``_Part``), concurrently."""
        batch = common_pb2.TaskBatch.FromString(delivery.body)
        if not batch.more_jobs:
            await self._on_delivery(delivery, batch)
            return
        jobs = queue_messages.split(batch)
        whole = _Whole(delivery, len(jobs))
        await asyncio.gather(*(self._on_delivery(_Part(whole, job), job) for job in jobs))

    async def _on_delivery(
        self, delivery: Delivery, batch_msg: common_pb2.TaskBatch | None = None
    ) -> None:
        """One job's message (``batch_msg``, else read from ``delivery.body``)."""
        if batch_msg is None:
            batch_msg = common_pb2.TaskBatch.FromString(delivery.body)
        key = _message_key(batch_msg)
        local = self._local.pop(key, None)
        if local is not None and not local.cancelled:  # scheduled from memory at submit
            local.delivery = delivery
            if local.remaining == 0:
                await delivery.ack()
            return
        held = self._held.get(key)
        if held is not None and held.remaining and not held.cancelled:
            # The same message again while its tasks wait here (the channel of its first
            # delivery closed: a broker restart). It joins them and is acked once they
            # launch: acked now, it would be lost with them should this GM die first.
            held.joined.append(delivery)
            log.info(
                "a message delivered again joins its tasks waiting here",
                extra={"job_id": batch_msg.job_id, "waiting": held.remaining},
            )
            return
        batch = Batch(delivery, remaining=len(batch_msg.tasks))
        self._held[key] = batch
        # Redelivered, or stored although its submission failed here: some of its tasks
        # may already run. Of a failed submission, launches still out must be answered
        # first, or the LMs would not know of tasks about to start and they would run twice.
        # A submission of the job under way here holds its tasks queued on a confirm that
        # may yet fail (and drop them): what this message skips as taken is known once
        # it is settled (``chaos-sim --small --seed 6719``).
        while (under_way := self._submitting.get(batch_msg.job_id)) is not None:
            await under_way.wait()
        failed = self._failed.get(batch_msg.job_id)
        if local is not None:
            await local.all_landed()
        if failed is not None:  # gone once landed: a retry meanwhile still waits for it
            await failed.all_landed()
            if self._failed.get(batch_msg.job_id) is failed:
                del self._failed[batch_msg.job_id]
        check = (
            delivery.redelivered
            or local is not None
            or failed is not None
            or self._queued_before_start(batch_msg)
            # Until every LM said what it holds (``_catch_up``), a launch of an earlier
            # life of this GM may still reach one (an LM frozen with it): a message
            # queued since (a client's retry relayed by another GM) names tasks this
            # GM's book does not know, and placed again they would run twice
            # (``chaos-sim --seed 1178``). Its tasks are fenced on every LM first.
            or not self._caught_up.is_set()
        )
        if delivery.redelivered:
            log.info(
                "a message redelivered (its GM went away before acking it): asking the LMs "
                "what of it launched",
                extra={"job_id": batch_msg.job_id, "tasks": len(batch_msg.tasks)},
            )
        launched = await self._already_launched(batch_msg) if check else set()
        # A second message of a job whose tasks this GM already holds (a client retried
        # it through another GM, or its first message was stored after all): not again.
        launched |= self.jobs.taken(batch_msg.job_id, batch_msg.tasks, relayed=False)
        reason = self.cancelled.reason(batch_msg.job_id)
        if reason is not None:  # cancelled: what did not run ends here
            ends = [
                self._event(task, common_pb2.TASK_STATE_CANCELLED, reason)
                for task in batch_msg.tasks
                if task.task_id not in launched
            ]
            if ends:
                metrics.TASKS_CANCELLED.labels(self.gm_id).inc(len(ends))
                self._publish_ends(ends)
            launched = {task.task_id for task in batch_msg.tasks}
        # Skipped as taken but only queued here, in another batch's memory (a dead
        # delivery's, across a broker restart; the message key in ``_held`` taken since by
        # a retry's batch): acked now, this copy, maybe the broker's only one, would be
        # lost with them should this GM die first. It is acked once that batch is done
        # (``chaos-sim --seed 3888``).
        holders = self._holders(batch_msg.tasks, launched, batch)
        for holder in holders:
            holder.followers.append(batch)
        batch.remaining += len(holders)
        if batch.remaining == len(launched):
            batch.remaining = 0
            for done in (delivery, *batch.joined):
                await done.ack()
            return
        batch.remaining -= len(launched)
        is_gang, min_tasks = gang_fields(batch_msg)
        members: list[Pending] = []
        for task in batch_msg.tasks:
            if task.task_id in launched:
                continue
            try:
                spec = parse_task(task, self.config.num_constraints)
                # Queued before its queue's limit was lowered below it: it would wait for ever.
                never = self.limits.never_fits(batch_msg.queue or task.queue, spec.resources)
                if never is not None:
                    raise InvalidTask(f"can never run here: {never}")
            except InvalidTask as err:
                log.error("dropping invalid queued task", extra={"task_id": task.task_id})
                self._publish_ends([self._event(task, common_pb2.TASK_STATE_REJECTED, str(err))])
                await self._launched(batch)
                continue
            self.jobs.queued(task)
            self._holding[task.task_id] = batch
            members.append(Pending(task, spec, batch))
        queue = batch_msg.queue or (members[0].task.queue if members else "")
        if is_gang and members:
            # Whole, or not at all: never one by one through the scheduler's round. (A
            # redelivered gang whose part some LM launched before its GM died plans the
            # rest as a gang.)
            self.gangs.start(GangJob(batch_msg.job_id, queue, members, min_tasks))
            return
        rejoining = [item for item in members if item.task.gang_task_ids]
        for item in rejoining:  # a started gang's member came back: the gang restarts
            self.gangs.rejoin(item, batch_msg.queue or item.task.queue)
        members = [item for item in members if not item.task.gang_task_ids]
        for item in members:
            self.scheduler.submit(batch_msg.queue or item.task.queue, item)
        self._wake.set()

    def _holders(
        self, tasks: Iterable[common_pb2.Task], skipped: set[str], batch: Batch
    ) -> set[Batch]:
        """The batches holding, queued here and not launched yet, those of ``tasks`` a
        delivery skips (``skipped``). None is cancelled: a submission of the job under
        way here, the only batch that may yet be, was waited for (``_submitting``)."""
        found: set[Batch] = set()
        for task in tasks:
            if task.task_id not in skipped or self.jobs.launched(task):
                continue
            holder = self._holding.get(task.task_id)
            live = holder is not None and holder.remaining > 0 and not holder.cancelled
            if live and holder is not batch:
                found.add(holder)
        return found

    def _queued_before_start(self, batch: common_pb2.TaskBatch) -> bool:
        """Queued before this GM started: an earlier life of it may have scheduled the
        message from memory (``SubmitJob``) and died before the broker confirmed it, so
        that its first delivery here, not marked redelivered, holds tasks that run."""
        return any(
            0 < t.timestamps.queued_unix_nanos < self._started_unix_nanos for t in batch.tasks
        )

    async def _already_launched(self, batch: common_pb2.TaskBatch) -> set[str]:
        """Tasks of a redelivered message that some LM already launched: a GM died after
        launching them but before acking the message. Launches are idempotent per LM,
        so without this check a retry on another LM would run them twice. The book
        records them placed where they are held, so that a second message of the job
        (a client's retry through another GM) skips them too."""
        # Fenced too: a launch of the GM that died, still on its way to an LM, must not
        # start there after this GM has placed the task elsewhere.
        attempts = {t.task_id: t.attempt for t in batch.tasks}
        holders = await self._fence(list(self._stubs), attempts, CATCH_UP_S)
        for task in batch.tasks:
            if (lm_id := holders.get(task.task_id)) is not None:
                self.jobs.accepted(task, lm_id)
        return set(holders)

    async def _fence(
        self, lm_ids: list[str], attempts: dict[str, int], wait_s: float
    ) -> dict[str, str]:
        """Fence these tasks (id -> attempt) on ``lm_ids`` under a new lease: each LM
        says which it holds (at that attempt or a later one), and refuses from then on
        any older request of the others. Returns the ids some LM holds, with that LM. An
        LM is asked again until it answers, for up to ``wait_s`` (``_answer``)."""
        # Above every lease a GM has sent (each is its start's wall clock plus its fences):
        # with queue failover the GM whose message this is may have started after this one.
        self._lease = max(self._lease + 1, time.time_ns())
        lease = self._lease
        replies = await asyncio.gather(
            *(self._answer(lm_id, attempts, lease, wait_s) for lm_id in lm_ids)
        )
        return {
            known.task_id: lm_id
            for lm_id, reply in zip(lm_ids, replies, strict=True)
            if reply is not None
            for known in reply.tasks
            if known.attempt >= attempts[known.task_id]
        }

    async def _lookup(
        self, lm_id: str, task_ids: Iterable[str], quiet: bool = False, fence_lease: int = 0
    ) -> local_master_pb2.LookupTasksResponse | None:
        """What ``lm_id`` knows of these tasks; None (logged unless ``quiet``) if it did
        not answer. With ``fence_lease``, the LM also refuses from then on any request of
        these tasks with an older lease."""
        request = local_master_pb2.LookupTasksRequest(
            task_ids=list(task_ids), fence_lease=fence_lease
        )
        try:
            return await self._stubs[lm_id].LookupTasks(request, timeout=5)
        except grpc.aio.AioRpcError as err:
            if not quiet:
                log.warning("LookupTasks failed", extra={"lm": lm_id, "code": err.code().name})
            return None

    async def _answer(
        self, lm_id: str, attempts: dict[str, int], fence_lease: int, wait_s: float
    ) -> local_master_pb2.LookupTasksResponse | None:
        """``_lookup``, asked again until ``lm_id`` answers, for up to ``wait_s``: a
        GM and its LMs restarting together (a host, a whole federation) get a message
        back before the LMs serve, and an LM that did not answer has not said that it
        launched none of its tasks. Taken for that, tasks that ended on it ran again
        on another LM (``tests/integration/test_whole_crash.py``)."""
        deadline = time.monotonic() + wait_s
        while True:
            reply = await self._lookup(lm_id, attempts, quiet=True, fence_lease=fence_lease)
            if reply is not None:
                return reply
            if time.monotonic() > deadline or self._closed:
                log.error(
                    "an LM did not say which of these tasks it holds, nor took their fence; "
                    "they are placed again, and those it holds may run twice (a request "
                    "it reads late is refused by its expiry)",
                    extra={"lm": lm_id, "tasks": len(attempts), "waited_s": wait_s},
                )
                return None
            await asyncio.sleep(FENCE_RETRY_S)

    async def _publish_cancel(self, job_id: str, reason: str) -> None:
        """Tell every GM and LM that ``job_id`` is cancelled (the cancels fan-out); this
        GM's own queues are ``_cancel``'s (the broadcast finds them done)."""
        msg = common_pb2.JobCancel(
            job_id=job_id, reason=reason, gm_id=self.gm_id, cancelled_unix_nanos=time.time_ns()
        )
        await self.bus.publish_fanout(CANCEL_EXCHANGE, msg.SerializeToString())

    def _end_gang(self, event: common_pb2.TaskEvent) -> None:
        """A started gang's member FAILED for good (``ends_gang``): its job is cancelled
        here at once and then everywhere, so its other members end CANCELLED wherever
        they run or wait. Published until the broker takes it (a GM that dies first
        leaves the rest to run out: its members end by themselves)."""
        reason = gang_failed(event.task_id, event.reason)
        log.warning(
            "a gang member failed: cancelling its gang",
            extra={"job_id": event.job_id, "task_id": event.task_id, "why": event.reason},
        )
        self._cancel(event.job_id, reason)

        async def publish() -> None:
            while not self._closed:
                try:
                    await self._publish_cancel(event.job_id, reason)
                    return
                except Exception as err:
                    log.warning("could not publish a gang's cancel", extra={"error": repr(err)})
                    await asyncio.sleep(GANG_RETRY_S)

        self._spawn(publish())

    async def _on_cancel_message(self, body: bytes) -> None:
        msg = common_pb2.JobCancel.FromString(body)
        self._cancel(msg.job_id, msg.reason or "cancelled")

    def _cancel(self, job_id: str, reason: str) -> None:
        """Drop the job's tasks from this GM's queues, ready or parked. Those out in a
        request come back refused (REJECTED_CANCELLED: the LMs heard it too) or are
        killed where they landed; later deliveries are dropped when they arrive. Also
        when the job is known cancelled already (an LM's refusal told first)."""
        self._drop_cancelled(self.scheduler.cancel(job_id, reason))
        if job_id in self.gangs.waiting:
            self.gangs.view_changed()  # its driver drops it

    def _drop_cancelled(self, items: list[Pending]) -> None:
        """End ``items`` CANCELLED; a message whose tasks are all done now is acked."""
        if not items:
            return
        events, done = [], []
        for item in items:
            reason = self.cancelled.reason(item.task.job_id) or "cancelled"
            events.append(self._event(item.task, common_pb2.TASK_STATE_CANCELLED, reason))
            done.extend(_one_done(item.batch))
        metrics.TASKS_CANCELLED.labels(self.gm_id).inc(len(events))
        self._publish_ends(events)
        for delivery in done:
            self._spawn(delivery.ack())

    def _publish_ends(self, events: list[common_pb2.TaskEvent]) -> None:
        """Ends decided here, not on an LM (queued tasks cancelled, or rejected when they
        came off the broker): on the events exchange too, for the other GMs and whoever
        watches the federation."""

        async def publish() -> None:
            try:
                for start in range(0, len(events), LIST_BATCH):
                    batch = common_pb2.TaskEventBatch(events=events[start : start + LIST_BATCH])
                    body = batch.SerializeToString()
                    await self.bus.publish_topic(EVENT_EXCHANGE, event_key(self.gm_id), body)
            except Exception as err:  # this GM's own book has them all the same
                log.warning("could not publish task ends", extra={"error": repr(err)})

        self._spawn(publish())

    async def _on_heartbeat(self, body: bytes) -> None:
        msg = common_pb2.LocalMasterState.FromString(body)
        await self._apply_state(msg)

    async def _apply_state(self, msg: common_pb2.LocalMasterState) -> None:
        snapshot = snapshot_from_proto(msg, self.config.num_constraints)
        result, wake = self.scheduler.apply(snapshot, time.monotonic())
        if result is ApplyResult.NEEDS_FULL:
            stub = self._stubs.get(msg.lm_id)
            if stub is None:
                return
            try:
                reply = await stub.GetState(local_master_pb2.GetStateRequest(), timeout=5)
            except grpc.aio.AioRpcError as err:
                log.warning("GetState failed", extra={"lm": msg.lm_id, "code": err.code().name})
                return
            snapshot = snapshot_from_proto(reply.state, self.config.num_constraints)
            result, wake = self.scheduler.apply(snapshot, time.monotonic())
        metrics.HEARTBEATS_APPLIED.labels(self.gm_id, result.value).inc()
        if result is ApplyResult.APPLIED and self.gangs.waiting:
            self.gangs.view_changed()
        if msg.sent_unix_nanos:
            age = max(0.0, (time.time_ns() - msg.sent_unix_nanos) / 1e9)
            metrics.HEARTBEAT_AGE_SECONDS.labels(self.gm_id).observe(age)
        if wake:
            self._wake.set()

    async def _on_events(self, routing_key: str, body: bytes) -> None:
        self._take_events(common_pb2.TaskEventBatch.FromString(body).events)

    def _take_events(self, events: Iterable[common_pb2.TaskEvent]) -> None:
        ends = []
        for event in events:
            self.jobs.apply(event)
            if event.state == common_pb2.TASK_STATE_PREEMPTED:
                self.preempted[event.queue] += 1
            if event.state not in (common_pb2.TASK_STATE_QUEUED, common_pb2.TASK_STATE_PLACED):
                unstarted = self._unstarted.get(event.task_id)
                if (
                    unstarted is not None
                    and event.attempt >= unstarted[2].attempt
                    and event.job_id == unstarted[2].job_id  # not another job's, refused
                ):
                    del self._unstarted[event.task_id]
            if (
                event.gang
                and ends_gang(TaskState(event.state))
                and self.serves(event.queue)
                and self.cancelled.reason(event.job_id) is None
            ):
                self._end_gang(event)
            if event.state in RELEASED:
                ends.append((event.lm_id, event.task_id, event.attempt, event.node_id, event.queue))
            elif event.state == common_pb2.TASK_STATE_RUNNING and self.serves(event.queue):
                stamps = event.timestamps
                if stamps.started_unix_nanos and stamps.submitted_unix_nanos:
                    seconds = (stamps.started_unix_nanos - stamps.submitted_unix_nanos) / 1e9
                    self.recent.values.append(seconds)
                    metrics.ALLOCATION_SECONDS.labels(self.gm_id).observe(seconds)
        if ends and self.scheduler.ended(ends, time.monotonic()):
            self._wake.set()
        if ends and self.gangs.waiting:
            self.gangs.view_changed()

    async def _catch_up(self) -> None:
        """Learn what the LMs hold of tasks (running, and recent endings), so that a GM
        that restarted still knows the jobs it had heard of. Events that arrive meanwhile
        are newer or the same: the book keeps the latest state of each attempt."""

        async def from_lm(lm_id: str) -> None:
            deadline = time.monotonic() + CATCH_UP_S
            # Not before the LM is heard from: a call to an LM not listening yet would
            # leave the channel backing off, and the first launches would fail.
            while lm_id not in self.view.lms and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            while True:
                try:
                    call = self._stubs[lm_id].ListTasks(local_master_pb2.ListTasksRequest())
                    async for batch in call:
                        for event in batch.events:
                            self.jobs.apply(event)
                    return
                except grpc.aio.AioRpcError as err:
                    if time.monotonic() > deadline:
                        log.warning(
                            "could not learn an LM's tasks",
                            extra={"lm": lm_id, "code": err.code().name},
                        )
                        return
                    await asyncio.sleep(1.0)

        try:
            await asyncio.gather(*(from_lm(lm_id) for lm_id in self._stubs))
        finally:
            self._caught_up.set()

    async def _recover_loop(self) -> None:
        """Ends whose events never arrived: a broker restart drops what is published
        meanwhile, an LM that dies takes unpublished events with it. Without this a task
        would show RUNNING for ever, and its job never end."""
        interval = max(RECOVER_EVERY_S, 4 * self.config.heartbeat_interval_s)
        suspects: set[tuple[str, str]] = set()
        while True:
            await asyncio.sleep(interval)
            try:
                suspects = await self._recover_lost_ends(suspects)
                await self._recover_relayed()
            except Exception:
                log.exception("recovering lost task events failed")

    async def _recover_relayed(self) -> None:
        """Tasks relayed from here (submitted here to another GM's queue) of which no
        event came for ``RELAYED_ASK_AFTER_S``: every LM is asked, and the end of one
        that ended is taken as its event (its watchers here hear it). One still waiting
        where it is served (queued, or preempted with no later attempt heard of) is asked
        about again later; one heard placed or running is followed from the LMs' books
        (``_recover_lost_ends``)."""
        due = self.jobs.relayed_unheard(RELAYED_ASK_AFTER_S, RELAYED_ASKED_MAX, time.monotonic())
        if not due or not self._stubs:
            return
        task_ids = [task_id for _, task_id in due]
        jobs = dict((task_id, job_id) for job_id, task_id in due)
        replies = await asyncio.gather(
            *(self._lookup(lm_id, task_ids, quiet=True) for lm_id in list(self._stubs))
        )
        recovered = []
        for reply in replies:
            for known in () if reply is None else reply.tasks:
                job_id = jobs.get(known.task_id)
                ended = known.last_ended
                if not known.HasField("last_ended") or ended.job_id not in ("", job_id):
                    continue
                if not ended.job_id:  # an ending the LM recalled from its journal
                    ended = common_pb2.TaskEvent()
                    ended.CopyFrom(known.last_ended)
                    ended.job_id = job_id
                recovered.append(ended)
        self._take_recovered(recovered, "recovered the events of tasks relayed from here")

    async def _recover_lost_ends(self, suspects: set[tuple[str, str]]) -> set[tuple[str, str]]:
        """Tasks this GM's books show placed or running that their LM's books (as this
        GM's view has them) do not hold: a suspect once, asked about if still so a round
        later (the view may just lag), from the LM, which remembers how they ended.
        Returns this round's new suspects."""
        open_ = self.jobs.open
        unheld = self.scheduler.unheld(
            {key: (s.lm_id, s.task_id, s.attempt) for key, s in open_.items()}
        )
        now = {key: open_[key] for key in unheld}
        ask: dict[str, list[global_master_pb2.TaskStatus]] = defaultdict(list)
        for key in now.keys() & suspects:
            if now[key].lm_id in self._stubs:
                ask[now[key].lm_id].append(now[key])
        recovered = []
        for lm_id, statuses in ask.items():
            attempts = {t.task_id: t.attempt for t in statuses}
            reply = await self._lookup(lm_id, attempts)
            if reply is None:
                continue
            for known in reply.tasks:
                ended = known.last_ended
                if known.HasField("last_ended") and ended.attempt >= attempts[known.task_id]:
                    recovered.append(ended)
            unknown = set(attempts) - {known.task_id for known in reply.tasks}
            await self._requeue_lost_starts(lm_id, unknown)
        self._take_recovered(recovered, "recovered lost task events")
        return now.keys() - suspects

    def _take_recovered(self, events: list[common_pb2.TaskEvent], what: str) -> None:
        """Ends an LM remembered that this GM never heard as events: taken as them."""
        if events:
            log.warning(what, extra={"events": len(events)})
            metrics.EVENTS_RECOVERED.labels(self.gm_id).inc(len(events))
            self._take_events(events)

    async def _accepted(self, lm_id: str, item: Pending) -> None:
        """An LM took the task (launch or preemption): booked in the view, kept until an
        event shows it started, one task of its message landed."""
        self.scheduler.accepted(lm_id, item.task.task_id)
        self.jobs.accepted(item.task, lm_id)
        self._unstarted[item.task.task_id] = (lm_id, time.monotonic(), item.task)
        self._unstarted.move_to_end(item.task.task_id)
        while len(self._unstarted) > UNSTARTED_KEPT:
            self._unstarted.popitem(last=False)
        await self._launched(item.batch)

    async def _requeue_lost_starts(self, lm_id: str, task_ids: set[str]) -> None:
        """Tasks ``lm_id`` accepted from this GM, never started, and no longer knows
        (``Scheduler.lost_starts``): queued again as their next attempt. One the broker
        did not take is tried again at the next recovery round."""
        grace_s = self.config.worker_timeout_s + RESTART_GRACE_S
        lost = self.scheduler.lost_starts(
            lm_id, task_ids, self._unstarted, time.monotonic(), grace_s
        )
        for task_id in lost:
            task = self._unstarted[task_id][2]
            try:
                await enqueue_next_attempt(self.bus, task)
            except Exception as err:
                log.warning(
                    "could not re-queue a task its LM lost; trying again later",
                    extra={"lm": lm_id, "task_id": task_id, "error": repr(err)},
                )
                continue
            self._unstarted.pop(task_id, None)
            self._event(task, common_pb2.TASK_STATE_LOST, f"{lm_id} restarted before it started")
            log.warning("re-queued a task its LM lost", extra={"lm": lm_id, "task_id": task_id})

    async def _backlog_loop(self) -> None:
        """Tell every GM (this one too, through the broker, so that all count the same
        claims) this GM's oldest waiting work, every ``backlog_interval_s``
        (``OldestFirst``)."""
        interval = self.config.backlog_interval_s
        while True:
            runs = self.scheduler.backlog()
            room = self.scheduler.room(queue for _, _, queue in runs)
            msg = common_pb2.GmBacklog(
                gm_id=self.gm_id,
                enqueued_unix_s=[at for at, _, _ in runs],
                tasks=[n for _, n, _ in runs],
                queues=[queue for _, _, queue in runs],
                sent_unix_nanos=time.time_ns(),
                room_queues=list(room),
                room_tasks=list(room.values()),
            )
            try:
                await self.bus.publish_fanout(
                    BACKLOG_EXCHANGE,
                    msg.SerializeToString(),
                    ttl_s=interval,
                )
            except Exception as err:  # the next one will do; holds end by themselves
                log.warning("could not publish the backlog", extra={"error": repr(err)})
            await asyncio.sleep(interval)

    async def _on_backlog(self, body: bytes) -> None:
        msg = common_pb2.GmBacklog.FromString(body)
        runs = zip(msg.enqueued_unix_s, msg.tasks, msg.queues, strict=False)
        room = dict(zip(msg.room_queues, msg.room_tasks, strict=False))
        if self.scheduler.heard_backlog(msg.gm_id, runs, room):
            self._wake.set()

    async def _gauge_loop(self) -> None:
        """Gauges for Prometheus: this GM's intake limit, its queues' pending tasks and
        usage share, and what its limited queues hold against their limits."""
        while True:
            metrics.SUBMISSION_LIMIT.labels(self.gm_id).set(self.admission.current)
            usage, total = self.view.queue_usage(accepted=True), self.view.total_capacity()
            for queue in self.my_queues:
                if not self.serves(queue):
                    continue
                held = usage.get(queue, np.zeros(NUM_RESOURCES, dtype=np.int64))
                metrics.QUEUE_USAGE_SHARE.labels(queue).set(dominant_share(held, total))
                metrics.QUEUE_PENDING.labels(queue).set(self.queues.pending(queue))
                limit = self.limits.get(queue)
                if limit is None:
                    continue
                for i, name in enumerate(RESOURCE_NAMES):
                    if limit[i] < UNLIMITED:
                        metrics.QUEUE_HELD.labels(queue, name).set(int(held[i]))
                        metrics.QUEUE_LIMIT.labels(queue, name).set(int(limit[i]))
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------ scheduling
    async def _schedule_loop(self) -> None:
        self._wake.set()  # (started again after an error: what waits gets a round)
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                began = time.perf_counter()
                plan = self.scheduler.round(time.monotonic())
                self._carry_out(plan)  # an empty plan may still ask for a recheck
                # The next round takes what fits in a share of the loop (``RoundBudget``).
                took = time.perf_counter() - began
                budget = self.round_budget.observe(len(plan.taken), took)
                self.scheduler.round_per_queue = budget
                if not plan.taken:
                    break
                self._round_seconds.observe(took)
                await asyncio.sleep(0)  # let replies and heartbeats in between rounds

    def _carry_out(self, plan: RoundPlan[Pending]) -> None:
        """Send what a round decided, and tell the tasks that wait why."""
        now = time.time_ns()
        for item in plan.taken:
            item.task.timestamps.dequeued_unix_nanos = now
        for item, drop in plan.dropped:
            self._drop(item, drop)
        for item, why in plan.waiting:
            self.jobs.set_reason(item.task.job_id, item.task.task_id, why)
        if plan.waiting:
            metrics.SCHEDULE_ATTEMPTS.labels(self.gm_id, "unschedulable").inc(len(plan.waiting))
        if plan.placed:
            metrics.SCHEDULE_ATTEMPTS.labels(self.gm_id, "placed").inc(plan.placed)
        if plan.recheck_in is not None and self._settle_timer is None:
            self._settle_timer = asyncio.get_running_loop().call_later(
                plan.recheck_in, self._unpark_all
            )
        for lm_id, decided in plan.per_lm().items():
            for d in decided:
                d.handle.task.timestamps.decided_unix_nanos = now
            items = [(d.handle, d.placement) for d in decided]
            self._spawn_launch([d.handle for d in decided], self._send(lm_id, items))
        for p in plan.preemptions:
            self._spawn_launch([p.handle], self._preempt(p.queue, p.handle, p.plan))

    def _drop(self, item: Pending, drop: Drop | None) -> bool:
        """End a task the scheduler dropped from its queue; True if it was."""
        if drop is Drop.WITHDRAWN:
            self._event(item.task, common_pb2.TASK_STATE_REJECTED, "the broker refused it")
        elif drop is Drop.CANCELLED:
            self._drop_cancelled([item])
        return drop is not None

    @property
    def limit_settle_s(self) -> float:
        """How long a started GM waits to hear from every LM before it places tasks of a
        limited queue: three full states."""
        return 3 * self.config.full_state_every * self.config.heartbeat_interval_s

    def _unpark_all(self) -> None:
        self._settle_timer = None
        if self.scheduler.recheck():
            self._wake.set()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    def _spawn_launch(self, items: list[Pending], coro) -> None:
        """A request that may start ``items``: their messages count it as out until it
        has been answered or given up (see ``_on_delivery``)."""
        for item in items:
            item.batch.launching()

        def landed(_task: asyncio.Task) -> None:
            for item in items:
                item.batch.landed()

        self._spawn(coro).add_done_callback(landed)

    async def _send(self, lm_id: str, items: list[tuple[Pending, Placement]]):
        """Launch ``items`` on ``lm_id``: one message on its launch stream, those on other
        GMs' nodes marked as repartitions."""
        lmv = self.view.lms.get(lm_id)
        known = lmv.version if lmv is not None else 0
        for item, _ in items:
            item.task.lease = self._lease
        placements = [
            local_master_pb2.Placement(
                task=item.task, node_index=placement.node, repartition=placement.repartition
            )
            for item, placement in items
        ]
        repartitions = sum(placement.repartition for _, placement in items)
        if repartitions:
            metrics.REPARTITIONS.labels(self.gm_id).inc(repartitions)
            self.counters["repartitions"] += repartitions
        try:
            reply = await self._launchers[lm_id].launch(
                local_master_pb2.LaunchRequest(
                    gm_id=self.gm_id,
                    placements=placements,
                    known_version=known,
                    expires_unix_nanos=self._expiry(lm_id),
                ),
                timeout=self.config.lm_call_timeout_s,
            )
        except grpc.aio.AioRpcError as err:
            log.warning(
                "launch not answered; fencing it before placing its tasks again",
                extra={"lm": lm_id, "code": err.code().name, "tasks": len(items)},
            )
            self.scheduler.unanswered(lm_id)
            held = await self._settle(lm_id, [item for item, _ in items])
            for item, _ in items:
                if item.task.task_id in held:  # it took it after all
                    await self._accepted(lm_id, item)
                else:
                    self._drop(item, self.scheduler.retry(item.task.queue, item))
            self._wake.set()
            return
        rejected = []
        for (item, _), result in zip(items, reply.results, strict=True):
            status = placement_status_from_proto(result.status)
            if status.ok:
                await self._accepted(lm_id, item)
            else:
                self.scheduler.refused(lm_id, item.task.task_id)
                rejected.append((item, status, result.reason))
        if reply.HasField("state"):
            self.counters["inconsistencies"] += 1
            metrics.INCONSISTENCIES.labels(self.gm_id, lm_id).inc()
            await self._apply_state(reply.state)
        for item, status, reason in rejected:
            self._rejected(lm_id, item, status, reason)
        if rejected:
            self._wake.set()

    def _expiry(self, lm_id: str) -> int:
        """``expires_unix_nanos`` for a request to ``lm_id`` sent now."""
        accept_s = max(LM_ACCEPT_S, 2 * self.config.lm_call_timeout_s)
        return time.time_ns() + int(accept_s * 1e9)

    async def _settle(self, lm_id: str, items: list[Pending]) -> set[str]:
        """Fence ``items`` on ``lm_id`` after a request of them went unanswered; the ids
        it holds. Asked for up to ``IN_DOUBT_S``: an LM that said nothing has not said
        it will not run them."""
        self.counters["fences"] += 1
        attempts = {item.task.task_id: item.task.attempt for item in items}
        held = set(await self._fence([lm_id], attempts, IN_DOUBT_S))
        # A fence given up on (the LM's answers lost for IN_DOUBT_S) says nothing; the
        # events may have said meanwhile that the LM took the attempt, ran it, even ended
        # it: placed again it would run twice (``chaos-sim --seed 2614``).
        return held | {item.task.task_id for item in items if self.jobs.launched(item.task)}

    def _rejected(self, lm_id: str, item: Pending, status: PlacementStatus, reason: str) -> None:
        if status is PlacementStatus.REJECTED_EXPIRED and lm_id not in self._early_expiry_warned:
            # Refused as expired, yet answered before this GM gave up on it: delivered late
            # (the LM was paused or overloaded), or the two clocks disagree. Retried like
            # any refusal; nothing is inferred from it (a fence, not a clock, keeps a
            # late request from running twice).
            self._early_expiry_warned.add(lm_id)
            log.error(
                "an LM refused a request as expired before this GM gave up on it: it read "
                f"it late, or its clock is more than {LM_ACCEPT_S:g} s ahead of this GM's "
                "(if every request to it is refused, sync the clocks)",
                extra={"lm": lm_id, "why": reason},
            )
        verdict = self.scheduler.rejected(item.task.queue, item, status)
        if verdict is Reply.INVALID:
            # This LM cannot read the task (a federation file that differs between GM and
            # LM): it can never run here, so it leaves its queue.
            log.error("an LM refused a malformed task", extra={"lm": lm_id, "why": reason})
            self._event(item.task, common_pb2.TASK_STATE_REJECTED, f"{lm_id}: {reason}")
            self._spawn(self._launched(item.batch))
        elif verdict is Reply.ID_TAKEN:
            self._spawn(self._id_taken(lm_id, item, reason))
        elif verdict is Reply.RECHECK:
            self._spawn(self._recheck(item))
        elif verdict is Reply.WITHDRAWN:
            self._drop(item, Drop.WITHDRAWN)
        elif verdict is Reply.CANCELLED:  # known here, or the LM heard it first
            self._cancel(item.task.job_id, reason)
            self._drop_cancelled([item])
        elif verdict is Reply.PARKED:
            self.jobs.set_reason(item.task.job_id, item.task.task_id, f"LM rejected: {reason}")

    async def _preempt(self, queue: str, item: Pending, plan: PreemptionPlan) -> None:
        metrics.PREEMPTION_ATTEMPTS.labels(self.gm_id).inc()
        self.counters["preemption_attempts"] += 1
        self.jobs.set_reason(item.task.job_id, item.task.task_id, "waiting for preemption")
        lmv = self.view.lms.get(plan.lm_id)
        reply = None
        try:
            reply = await self._preempt_call(plan, item, lmv)
        finally:
            status = placement_status_from_proto(reply.results[0].status) if reply else None
            self.scheduler.preempt_replied(
                plan, item.task.task_id, None if status is None else status.ok
            )
        if reply is None:
            if item.task.task_id in await self._settle(plan.lm_id, [item]):
                await self._accepted(plan.lm_id, item)  # it took it after all
            else:
                self._drop(item, self.scheduler.preempt_unanswered(queue, item))
                self._wake.set()  # a round arms the recheck of what parked blind
            return
        if reply.HasField("state"):
            await self._apply_state(reply.state)
        if status.ok:
            self.counters["preemptions"] += len(reply.preempted_task_ids)
            await self._accepted(plan.lm_id, item)
        else:
            self._rejected(plan.lm_id, item, status, reply.results[0].reason)
            self._wake.set()

    async def _preempt_call(self, plan: PreemptionPlan, item: Pending, lmv):
        item.task.lease = self._lease
        try:
            return await self._stubs[plan.lm_id].Preempt(
                local_master_pb2.PreemptRequest(
                    gm_id=self.gm_id,
                    task=item.task,
                    node_index=plan.victims.node,
                    victim_task_ids=list(plan.victims.task_ids),
                    known_version=lmv.version if lmv is not None else 0,
                    expires_unix_nanos=self._expiry(plan.lm_id),
                ),
                timeout=self.config.lm_call_timeout_s,
            )
        except grpc.aio.AioRpcError as err:
            log.warning("Preempt failed", extra={"lm": plan.lm_id, "code": err.code().name})
            return None

    async def _recheck(self, item: Pending) -> None:
        """Another GM fenced the task above this GM's lease (``Reply.RECHECK``): fence it
        higher on every LM and look. Held somewhere, it runs (launched by that GM, or by
        an earlier attempt of ours it fenced): counted launched here. Else it is sent
        again, and no launch but this GM's can land any more."""
        task = item.task
        holders = await self._fence(list(self._stubs), {task.task_id: task.attempt}, CATCH_UP_S)
        holder = holders.get(task.task_id)
        # An LM that did not answer the fence may hold it: the events said so (as
        # ``_settle``).
        held = holder is not None or self.jobs.launched(task)
        verdict = self.scheduler.rechecked(task.queue, item, held=held)
        log.warning(
            "a task was fenced by another GM: %s",
            f"held by {holder or 'an LM'}, counted launched" if held else verdict.value,
            extra={"task_id": task.task_id, "job_id": task.job_id},
        )
        if verdict is Reply.LET_GO:
            if holder is not None:
                self.jobs.accepted(task, holder)
            await self._launched(item.batch)
        elif verdict is Reply.WITHDRAWN:
            self._drop(item, Drop.WITHDRAWN)
        elif verdict is Reply.CANCELLED:
            self._drop_cancelled([item])
        else:
            self._wake.set()

    async def _id_taken(self, lm_id: str, item: Pending, reason: str) -> None:
        """An LM holds the task's id as another job's (two GMs took the two jobs at once,
        or this GM has forgotten the other): it can never run as that id, so it ends
        REJECTED, for every GM to see, instead of waiting in its queue for ever."""
        log.warning(
            "an LM holds a task's id as another job's; the task is rejected",
            extra={"lm": lm_id, "job_id": item.task.job_id, "task_id": item.task.task_id},
        )
        why = f"{lm_id}: {reason}"
        self._publish_ends([self._event(item.task, common_pb2.TASK_STATE_REJECTED, why)])
        await self._launched(item.batch)

    async def _launched(self, batch: Batch) -> None:
        for delivery in _one_done(batch):
            await delivery.ack()

    def _event(self, task: common_pb2.Task, state: int, reason: str) -> common_pb2.TaskEvent:
        event = common_pb2.TaskEvent(
            task_id=task.task_id,
            job_id=task.job_id,
            queue=task.queue,
            state=state,
            reason=reason,
            timestamps=task.timestamps,
            attempt=task.attempt,
        )
        self.jobs.apply(event)
        return event
