"""The Local Master process: authoritative books (``ClusterState``) behind gRPC.

    GM ──Launch/Repartition/Preempt──▶ Lifecycle.place | preempt ──▶ StartTask on the worker stream
       ◀── results (+ full state if any rejected)
    worker ──register / heartbeats + reports──▶ Lifecycle.take_back | report ──▶ plan
    plan (Kill, Start, Publish, Requeue, Journal) ──▶ worker streams, topic exchange,
                                                     user queues (attempt + 1), journal
    every interval ──▶ LocalMasterState (full or delta) on the heartbeat fanout exchange

Every decision is the core's (``services.core.lm_lifecycle``, over ``ClusterState``):
this module moves bytes, keeps worker sessions, and carries out the plans it returns, in
their order (``_carry_out``).

An LM that restarts is a new ``incarnation`` with empty books; each worker, registering
again, names what it runs and what it has not reported, and the LM books that again
(``Lifecycle.take_back``). What it remembers of ended tasks (``endings``) answers GMs that missed
an event (``LookupTasks``) or restarted (``ListTasks``). With a ``journal`` file in its
config, those endings are also on disk (``journal.py``), so a restarted LM still refuses
to run an ended attempt again and still knows how it ended; and so is every task it
accepted, before it answers ACCEPTED, so a restarted LM gives back to its queue what it
had accepted and no worker names again (``orphans``: the workers died too, or never got
it) instead of losing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import grpc
import numpy as np

from services._proto.megha.v1 import common_pb2, local_master_pb2, local_master_pb2_grpc
from services.common import metrics
from services.common.bus import Bus
from services.common.config import FederationConfig
from services.common.convert import (
    InvalidTask,
    layout_from_proto,
    next_attempt,
    parse_task,
    partition_totals,
    placement_status_to_proto,
    resources_from_proto,
    snapshot_from_proto,
    snapshot_to_proto,
)
from services.common.names import (
    CANCEL_EXCHANGE,
    EVENT_EXCHANGE,
    HEARTBEAT_EXCHANGE,
    LIST_BATCH,
    cancel_queue,
    event_key,
)
from services.common.requeue import RESTART_GRACE_S, enqueue_attempt
from services.common.tasks import long_lived
from services.core.cancels import CancelledJobs
from services.core.cluster_state import ClusterState, Decision
from services.core.constraints import to_mask
from services.core.fairness import FairShare, usage_by_queue
from services.core.gang import GANG_EVICT_S, GangPiece
from services.core.global_view import GlobalView
from services.core.lm_lifecycle import (
    Action,
    Held,
    InventoryVerdict,
    Journal,
    Kill,
    Lifecycle,
    Owe,
    Publish,
    ReportOutcome,
    ReportVerdict,
    Requeue,
    RoomFor,
    Start,
)
from services.core.reservations import Reservations, held_for
from services.core.resources import (
    NET,
    ResourceError,
    above_bound,
    format_resources,
    validate_capacity,
)
from services.core.snapshot import Allocation
from services.core.states import RELEASED
from services.core.status import PlacementStatus
from services.core.task import TaskSpec
from services.local_master.host_streams import serve_host
from services.local_master.journal import FLUSH_S, TaskJournal

log = logging.getLogger("megha.lm")

EVENT_RETRY_S = 0.5  # between tries to publish events while the broker is away
REQUEUE_DRAIN_S = 5.0  # a stopping LM waits this long for its re-queues to be stored
# A refusal that says nothing about the GM's view: no fresh state goes with it.
CANCELLED = PlacementStatus.REJECTED_CANCELLED


@functools.cache
def _state_label(state: int) -> str:
    """A final state as its metric label: ``succeeded``."""
    return common_pb2.TaskState.Name(state).removeprefix("TASK_STATE_").lower()


def _expired(request, now: int) -> bool:
    """A GM's request read after its ``expires_unix_nanos``: the GM has given up on it."""
    return 0 < request.expires_unix_nanos < now


@dataclass(eq=False)
class WorkerSession:
    """An attached worker: the commands waiting for its stream, and when we last heard."""

    node: int
    node_id: str
    commands: deque[local_master_pb2.WorkerCommand] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set when commands wait
    streams: int = 0
    acked_at: float = 0.0  # when a HeartbeatAck was last queued (monotonic)
    # Registrations so far: a worker registers only once its stream ended, so a stream
    # of an earlier registration writes nothing more (``WorkerHeartbeats``).
    generation: int = 0
    # Commands whose write began (by id): they may have reached the worker, so a kill
    # does not take such a start back (``LocalMaster._withdraw``).
    written: set[int] = field(default_factory=set)


MAX_STARTS_PER_MESSAGE = 64
STREAM_DRAIN_S = 1.0  # an ending heartbeat stream waits this long for a write under way
OUTPUT_TIMEOUT_S = 5.0  # for a worker to answer a GetTaskOutput
# A worker that fences itself (worker_fence_s) asks for acks; it gets at most one per this
# long, so a busy worker's many heartbeats do not double the messages sent to it.
ACK_EVERY_S = 0.5


def _leading_starts(commands: deque) -> list:
    """The start commands at the head of a worker's queue, up to a message's worth."""
    starts = []
    for command in itertools.islice(commands, MAX_STARTS_PER_MESSAGE):
        if not command.HasField("start"):
            break
        starts.append(command)
    return starts


def drop_superseded(events: list[common_pb2.TaskEvent]) -> list[common_pb2.TaskEvent]:
    """One batch's events less each PLACED whose attempt has a later event in the batch
    (its RUNNING or its end: the same node, every stamp the PLACED had and more). At
    light load a task starts within the batch's window (``event_batch_s``) of its
    placement, so every subscriber (each GM, each watcher) parses a third fewer events
    per task; a task that starts later still shows PLACED. Order kept."""
    placed = common_pb2.TASK_STATE_PLACED
    later = {(e.task_id, e.attempt) for e in events if e.state != placed}
    if not later or len(later) == len(events):
        return events
    return [e for e in events if e.state != placed or (e.task_id, e.attempt) not in later]


class LocalMaster(local_master_pb2_grpc.LocalMasterServicer):
    def __init__(self, config: FederationConfig, lm_id: str, bus: Bus):
        self.config = config
        self.lm_id = lm_id
        self.bus = bus
        # Per task: each child looked up once (``metrics.children``).
        self._finished = metrics.children(metrics.TASKS_FINISHED, lm_id)
        self._placements = metrics.children(metrics.LM_PLACEMENTS, lm_id)
        self.state = ClusterState(
            lm_id,
            config.gm_ids,
            config.num_constraints,
            config.placement_policy(),
            incarnation=time.time_ns(),  # a restart is a new life, told apart by GMs
            ended_kept=config.lm_ended_kept,
        )
        self.fair = FairShare(
            [q.as_share() for q in config.effective_queues()], slack=config.preemption_slack
        )
        self.sessions: dict[int, WorkerSession] = {}
        # GetTaskOutput calls waiting for their worker's SendTaskOutput, by request id.
        self._output_waiters: dict[int, asyncio.Future] = {}
        self._output_ids = itertools.count(1)
        self.cancelled = CancelledJobs()  # jobs whose tasks must not run here
        # Gangs' two-phase starts (ReserveGang / CommitGang) over the same books: the
        # room a reservation holds is booked as placeholder allocations, which the
        # lifecycle never holds as tasks (no worker runs them, no watchdog re-queues
        # them) and heartbeats show as room taken.
        self.gangs = Reservations(self.state, self.cancelled)
        # The wire tasks of each gang reserved here and not yet started, by gang id:
        # what CommitGang hands to the workers.
        self._gang_tasks: dict[str, list[common_pb2.Task]] = {}
        self._gangs_changed = asyncio.Event()  # wakes the expiry timer (``_gang_loop``)
        # What happens to the tasks held here (requests, reports, inventories, dead
        # nodes, cancels, orphans) is decided there; this class carries out its actions.
        self.life: Lifecycle[common_pb2.Task] = Lifecycle(
            self.state,
            self.cancelled,
            worker_timeout_s=config.worker_timeout_s,
            orphan_grace_s=config.worker_timeout_s + RESTART_GRACE_S,
        )
        # Each task's final event, newest last, serialized: a quarter of the memory of
        # the message (0.27 against 0.99 KB with its key), and read only by LookupTasks
        # and ListTasks, which parse what they send.
        self.endings: OrderedDict[str, bytes] = OrderedDict()
        self._events: list[common_pb2.TaskEvent] = []
        self._events_ready = asyncio.Event()
        self._published_version = -1
        self._beats = 0
        self._loops: list[asyncio.Task] = []
        self._subscriptions: list = []
        # Other LMs' heartbeats: the usage of every queue federation-wide, so a preemption
        # is verified against global shares, not this LM's slice of them.
        self.peers = GlobalView("", num_constraints=config.num_constraints)
        self._closed = False
        self._requeues: set[asyncio.Task] = set()  # re-queues on their way (``_send_requeue``)
        # Re-queues an earlier life owed (its journal's), as (task id, next attempt): sent
        # again at start; a later re-queue of the same attempt is not sent twice.
        self._owed: dict[tuple[str, int], common_pb2.Task] = {}
        # Nodes an operator drains (DrainNode), by id: drained again when they register.
        self.draining: set[str] = set()
        path = config.lm(lm_id).journal
        self.journal = (
            TaskJournal(path, config.lm_ended_kept, config.lm_endings_kept) if path else None
        )
        # The journal loop's thread, for checkpoints; shutdown waits for the one running.
        self._journal_thread = ThreadPoolExecutor(1, "lm-journal") if path else None
        # Endings and accepted tasks (adopted, or whose write failed) not yet journalled;
        # written on the next turn of the loop (``_write_pending``).
        self._unjournaled: list[common_pb2.TaskEvent] = []
        self._unaccepted: list[common_pb2.Task] = []
        self._write_scheduled = False
        self._journal_failing = False
        if self.journal is not None:
            self._recall(self.journal)

    def _recall(self, journal: TaskJournal) -> None:
        """Take back, from the journal, what ended here in earlier lives and what was
        accepted and never ended (``orphans`` until a worker names it)."""
        began = time.monotonic()
        recalled = journal.load()
        # The journal keeps whole events (with their job) of the newest endings only: of
        # older ones the job is not known, and another job's task with that id is then
        # taken for a repeat (a DUPLICATE), as before task ids were checked.
        jobs = {event.task_id: event.job_id for event in recalled.events}
        for task_id, attempt in recalled.attempts:
            self.state.remember_ended(task_id, attempt, jobs.get(task_id, ""))
        for event in recalled.events:
            self.endings[event.task_id] = event.SerializeToString()
        self.life.recall(recalled.accepted, recalled.stopping)
        for job_id, reason in recalled.cancelled:
            self.cancelled.add(job_id, reason)
        self.draining = set(recalled.draining)
        self._owed = {(t.task_id, t.attempt): t for t in recalled.owed}
        # Ended and journalled, but the LM died before the broker had them: published
        # again (a GM learns them anyway, with LookupTasks; the event stream would not).
        self._events.extend(recalled.unpublished)
        log.info(
            "recalled the tasks that ended here",
            extra={
                "lm": self.lm_id,
                "tasks": len(recalled.attempts),
                "unfinished": len(self.life.orphans),
                "unpublished": len(recalled.unpublished),
                "owed_requeues": len(recalled.owed),
                "stopping": len(recalled.stopping),
                "cancelled_jobs": len(recalled.cancelled),
                "journal": str(journal.path),
                "seconds": round(time.monotonic() - began, 3),
            },
        )

    # ----------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._subscriptions.append(
            await self.bus.subscribe_fanout(
                HEARTBEAT_EXCHANGE, self._on_peer_heartbeat, ttl_s=self.config.heartbeat_interval_s
            )
        )
        # Kept while this LM is away: a cancel made meanwhile reaches it when it is back.
        keep = cancel_queue(self.lm_id)
        cancels = await self.bus.subscribe_fanout(CANCEL_EXCHANGE, self._on_cancel, keep_as=keep)
        self._subscriptions.append(cancels)
        if self._events:
            self._events_ready.set()  # the endings an earlier life did not publish
        self._loops = [
            long_lived(self._heartbeat_loop, "lm-heartbeats"),
            long_lived(self._event_loop, "lm-events"),
            long_lived(self._watchdog_loop, "lm-watchdog"),
            long_lived(self._gang_loop, "lm-gangs"),
        ]
        if self.journal is not None:
            self._loops.append(long_lived(self._journal_loop, "lm-journal"))
        if self.life.unclaimed:
            self._loops.append(long_lived(self._orphans_loop, "lm-orphans"))
        for again in self._owed.values():  # the broker may not have them: sent again
            self._send_requeue(again)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in self._subscriptions:
            with contextlib.suppress(Exception):
                await sub.cancel()
        for loop in self._loops:
            loop.cancel()
        for loop in self._loops:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await loop
        if self._requeues:  # what is on its way to the broker gets there, if it can
            await asyncio.wait(set(self._requeues), timeout=REQUEUE_DRAIN_S)
            for job in set(self._requeues):  # the rest stay owed: the next life sends them
                job.cancel()
        if self.journal is not None:
            with contextlib.suppress(Exception):
                self._write_pending()  # before the flush, which marks them published
        with contextlib.suppress(Exception):
            await self._flush_events()
        if self.journal is not None:
            assert self._journal_thread is not None
            self._journal_thread.shutdown(wait=True)  # a checkpoint may be running
            self.journal.close()

    # ------------------------------------------------------------- GM RPCs
    async def Launch(self, request, context):
        results = await self._place_all(request, context, "launch")
        return local_master_pb2.LaunchResponse(**results)

    async def LaunchStream(self, request_iterator, context):
        async for request in request_iterator:
            results = await self._place_all(request.launch, context, "launch", stream=True)
            yield local_master_pb2.LaunchStreamResponse(
                request_id=request.request_id,
                launch=local_master_pb2.LaunchResponse(**results),
            )

    async def Repartition(self, request, context):
        results = await self._place_all(request, context, "repartition")
        return local_master_pb2.RepartitionResponse(**results)

    async def _place_all(self, request, context, kind: str, stream: bool = False) -> dict:
        """Validate and place every placement of a request. A malformed task fails a call
        whole (INVALID_ARGUMENT, nothing placed); on a stream, where an error would end
        the stream for every launch on it, that task alone is REJECTED_INVALID."""
        received = time.time_ns()
        if _expired(request, received):
            late = self._refuse_late(request, received, kind)
            return {
                "results": [self._result(p.task.task_id, late, kind) for p in request.placements]
            }
        specs: list[TaskSpec | Decision] = []
        for p in request.placements:
            try:
                specs.append(parse_task(p.task, self.config.num_constraints))
            except InvalidTask as err:
                if not stream:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
                specs.append(Decision(PlacementStatus.REJECTED_INVALID, str(err)))
        results, rejected, accepted = [], False, []
        for placement, spec in zip(request.placements, specs, strict=True):
            # A launch request carries repartitions too, each marked (Placement.repartition).
            how = "repartition" if placement.repartition else kind
            if isinstance(spec, Decision):  # malformed: the books are not involved
                results.append(self._result(placement.task.task_id, spec, how))
                continue
            decision, actions = self.life.place(
                request.gm_id, spec, placement.node_index, how == "repartition"
            )
            results.append(self._result(spec.task_id, decision, how))
            if decision.status is PlacementStatus.ACCEPTED:
                self._apply(actions)  # an older attempt it replaced: killed, LOST
                accepted.append(self._start(placement.task, decision.allocation, received))
            rejected |= not decision.ok and decision.status is not CANCELLED
        reply: dict = {"results": results}
        if rejected:
            reply["state"] = self._state_proto(request.known_version or None)
        # Journalled before the GM hears ACCEPTED (and acks the queue message). This
        # also gives the workers' streams the turn of the loop in which they write the
        # starts just queued, before this reply: the starts are on the tasks' path.
        await self._journal_accepted(accepted)
        return reply

    async def Preempt(self, request, context):
        received = time.time_ns()
        if _expired(request, received):
            late = self._refuse_late(request, received, "preempt")
            result = self._result(request.task.task_id, late, "preempt")
            return local_master_pb2.PreemptResponse(results=[result])
        spec = await self._spec(request.task, context)
        usage, total = self.global_usage()
        decision, actions = self.life.preempt(
            request.gm_id,
            spec,
            request.node_index,
            list(request.victim_task_ids),
            lambda queue: self.fair.is_over_share(queue, usage, total),
        )
        reply = local_master_pb2.PreemptResponse(
            results=[self._result(spec.task_id, decision, "preempt")]
        )
        if decision.status is PlacementStatus.ACCEPTED:
            # The victims' kills and this task's start before any re-queue is awaited: a
            # broker that is away holds the re-queues back for as long as it is, and
            # meanwhile the task must be held here, started (a later preemption of it
            # re-queues only a held task; a fence must find it held). A victim's next
            # attempt waits for its end (``Lifecycle.stopping``), not for this call.
            requeues = [a for a in actions if isinstance(a, Requeue)]
            self._apply(a for a in actions if not isinstance(a, Requeue))
            started = self._start(request.task, decision.allocation, received)
            metrics.PREEMPTIONS.labels(self.lm_id).inc(len(decision.preempted))
            reply.preempted_task_ids.extend(v.task_id for v in decision.preempted)
            await self._journal_accepted([started])
            await self._carry_out(requeues)
        if not decision.ok and decision.status is not CANCELLED:  # the GM's view was wrong
            reply.state.CopyFrom(self._state_proto(request.known_version or None))
        return reply

    # ------------------------------------------------------------- gangs
    async def ReserveGang(self, request, context):
        """Hold room for this LM's pieces of a gang, all or none (``Reservations``)."""
        reply = local_master_pb2.ReserveGangResponse(gang_id=request.gang_id)
        received = time.time_ns()
        if not request.gang_id or not request.placements:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "a gang needs a gang_id and placements"
            )
        if _expired(request, received):
            late = self._refuse_late(request, received, "gang reservation")
            reply.status, reply.reason = placement_status_to_proto(late.status), late.reason
            return reply
        layout = None
        if request.HasField("layout"):
            try:
                layout = layout_from_proto(request.layout)
            except ValueError as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"layout: {err}")
        pieces = []
        for p in request.placements:
            spec = replace(await self._spec(p.task, context), gang=True)
            if layout is not None:  # the member's uplink share is what it books
                booked = spec.resources.copy()
                booked[NET] = p.net_mbps
                spec = replace(spec, resources=booked)
            pieces.append(
                GangPiece(p.member, spec, self.lm_id, p.node_index, p.node_id, p.repartition)
            )
        verdict = self.gangs.reserve(
            request.gang_id,
            pieces,
            time.monotonic(),
            held_for(request.ttl_s),
            gm_id=request.gm_id,
            layout=layout,
        )
        reply.status = placement_status_to_proto(verdict.status)
        reply.reason = verdict.reason
        metrics.LM_PLACEMENTS.labels(self.lm_id, "gang_reserve", verdict.status.name.lower()).inc(
            len(pieces)
        )
        if verdict.ok:
            # A retry of a held gang keeps the tasks it was first given.
            self._gang_tasks.setdefault(request.gang_id, [p.task for p in request.placements])
            self._gangs_changed.set()
        elif verdict.status is not CANCELLED:
            reply.state.CopyFrom(self._state_proto(request.known_version or None))
        return reply

    async def CommitGang(self, request, context):
        """Turn a held gang into its tasks, started like launched ones (journalled before
        the answer); committing again answers the same and starts nothing again."""
        received = time.time_ns()
        held = self._gang_tasks.get(request.gang_id, ())
        doomed = next((t.job_id for t in held if t.job_id in self.cancelled), None)
        if doomed is not None:  # cancelled while held: nothing of it starts
            self.gangs.release(request.gang_id, time.monotonic())
            self._gang_tasks.pop(request.gang_id, None)
            refused = self.life.refusal(doomed)
            assert refused is not None
            return local_master_pb2.CommitGangResponse(
                gang_id=request.gang_id,
                status=placement_status_to_proto(refused.status),
                reason=refused.reason,
            )
        verdict = self.gangs.commit(request.gang_id, time.monotonic())
        reply = local_master_pb2.CommitGangResponse(
            gang_id=request.gang_id,
            status=placement_status_to_proto(verdict.status),
            reason=verdict.reason,
        )
        tasks = self._gang_tasks.pop(request.gang_id, None)
        if not verdict.ok:
            reply.state.CopyFrom(self._state_proto(request.known_version or None))
            return reply
        started = []
        if tasks is not None:  # None: committed before, its tasks started then
            by_id = {t.task_id: t for t in tasks}
            for allocation in verdict.allocations:
                started.append(self._start(by_id[allocation.task_id], allocation, received))
            metrics.LM_PLACEMENTS.labels(self.lm_id, "gang_commit", "accepted").inc(len(started))
            # Cancelled while it was held: ended at once, as a cancel ends held tasks.
            doomed = {t.job_id for t in started if t.job_id in self.cancelled}
            if doomed:
                self._apply(self.life.cancel(doomed))
        await self._journal_accepted(started)
        return reply

    async def ReleaseGang(self, request, context):
        """Give back the room a gang holds here (nothing if it holds none)."""
        released = self.gangs.release(request.gang_id, time.monotonic())
        self._gang_tasks.pop(request.gang_id, None)
        if released:
            self._gangs_changed.set()
        return local_master_pb2.ReleaseGangResponse(
            released=released, state=self._state_proto(request.known_version or None)
        )

    async def StopTasks(self, request, context):
        """Kill these attempts where they are held here (``Lifecycle.stop``): a GM
        restarts their gang whole. Each one's next attempt is queued once its kill took
        effect, by the same path as a preempted victim's."""
        reply = local_master_pb2.StopTasksResponse()
        reason = request.reason or f"stopped by {request.gm_id}"
        over = None
        if request.preempt:  # a waiting gang's victims: only of queues over their share
            usage, total = self.global_usage()
            over = lambda queue: self.fair.is_over_share(queue, usage, total)  # noqa: E731
        for known in request.tasks:
            if over is None:
                actions = self.life.stop(known.task_id, known.attempt, reason)
            else:
                # Its room is the gang's until the gang reserves here (or GANG_EVICT_S).
                room_for = None
                if request.for_job_id:
                    now = time.monotonic()
                    room_for = RoomFor(self.gangs, request.for_job_id, now, GANG_EVICT_S)
                actions = self.life.evict(known.task_id, known.attempt, over, reason, room_for)
                if actions and room_for is not None:
                    self._gangs_changed.set()  # the expiry timer learns the deadline
            if actions:
                reply.stopped_task_ids.append(known.task_id)
                self._apply(actions)  # no re-queue in it: that follows the kill
        if request.preempt:  # the GM plans its gang in the room at once
            reply.state.CopyFrom(self._state_proto(request.known_version or None))
        if reply.stopped_task_ids:
            if request.preempt:
                metrics.PREEMPTIONS.labels(self.lm_id).inc(len(reply.stopped_task_ids))
            log.info(
                "preempted tasks for a waiting gang"
                if request.preempt
                else "stopped tasks for their gang's restart",
                extra={"gm": request.gm_id, "tasks": list(reply.stopped_task_ids)},
            )
        return reply

    async def _gang_loop(self) -> None:
        """Release the reservations not committed in time (``Reservations.expire``),
        woken at the next deadline or when a reservation is made."""
        while True:
            deadline = self.gangs.next_deadline()
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gangs_changed.wait(), wait)
            self._gangs_changed.clear()
            for gang_id in self.gangs.expire(time.monotonic()):
                self._gang_tasks.pop(gang_id, None)
                log.info("a gang's reservation expired", extra={"gang_id": gang_id})

    def global_usage(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Per-queue usage and total capacity of the federation: this LM's own books
        (exact) plus every other LM's last heartbeat (eventually consistent)."""
        peers = [v for lm_id, v in self.peers.lms.items() if lm_id != self.lm_id]
        allocations = itertools.chain(
            self.state.allocations.values(), *(v.allocations.values() for v in peers)
        )
        total = self.state.table.capacity.sum(axis=1)
        for view in peers:
            total = total + view.table.capacity.sum(axis=1)
        return usage_by_queue(allocations), total

    async def _on_peer_heartbeat(self, body: bytes) -> None:
        msg = common_pb2.LocalMasterState.FromString(body)
        # A delta whose base this LM missed is dropped; the next full state catches up.
        if msg.lm_id != self.lm_id:
            self.peers.apply(
                snapshot_from_proto(msg, self.config.num_constraints), time.monotonic()
            )

    async def _on_cancel(self, body: bytes) -> None:
        msg = common_pb2.JobCancel.FromString(body)
        reason = msg.reason or "cancelled"
        if not self.cancelled.add(msg.job_id, reason):
            return
        if self.journal is not None:  # a restart must still refuse the job's tasks
            try:
                self.journal.cancel(msg.job_id, reason)
            except Exception as err:
                self._journal_failed(err)
        # The job's booked tasks end CANCELLED, journalled like any end (a restart does
        # not queue them again), and are killed; a worker's report of the kill finds
        # nothing held.
        actions = self.life.cancel({msg.job_id})
        self._apply(actions)
        self._count_cancelled({msg.job_id}, sum(isinstance(a, Kill) for a in actions))

    def _count_cancelled(self, job_ids: set[str], killed: int) -> None:
        if killed:
            metrics.TASKS_FINISHED.labels(self.lm_id, "cancelled").inc(killed)
            log.info(
                "killed the tasks of a cancelled job",
                extra={"jobs": ",".join(sorted(job_ids)), "tasks": killed},
            )

    async def DrainNode(self, request, context):
        node = self.state.table.index_of(request.node_id)
        known = node is not None or request.node_id in self.draining
        if not known and not (request.query and not request.node_id):
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"{self.lm_id} has no node {request.node_id!r}"
            )
        on = request.node_id in self.draining if request.query else not request.undo
        if (request.node_id in self.draining) != on:
            if on:
                self.draining.add(request.node_id)
            else:
                self.draining.discard(request.node_id)
            if self.journal is not None:
                try:
                    self.journal.drain(request.node_id, on)
                except Exception as err:
                    self._journal_failed(err)
            if node is not None:
                self.state.drain(node, on)  # the next heartbeat shows it to the GMs
                self._count_workers()
            log.info(
                "node draining" if on else "node takes tasks again",
                extra={"lm": self.lm_id, "node_id": request.node_id},
            )
        running = len(self.state.task_ids_on(node)) if node is not None else 0
        return local_master_pb2.DrainNodeResponse(
            node_id=request.node_id,
            draining=on,
            running=running,
            draining_node_ids=sorted(self.draining),
        )

    async def GetState(self, request, context):
        since = request.since_version or None
        return local_master_pb2.GetStateResponse(state=self._state_proto(since))

    # --------------------------------------------------------- worker RPCs
    async def RegisterWorker(self, request, context):
        if not request.node_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node_id is required")
        capacity = resources_from_proto(request.capacity)
        refused = self._capacity_refused(request.node_id, capacity)
        if refused:
            log.warning(
                "refused a worker's registration",
                extra={"node_id": request.node_id, "peer": context.peer(), "why": refused},
            )
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
        try:
            mask = to_mask(request.constraints, self.config.num_constraints)
            node = self.state.table.index_of(request.node_id)
            if node is None:
                node = self.state.add_node(
                    request.node_id, capacity, mask, address=request.worker_address
                )
            else:  # a known worker reconnecting: it may take work again
                self.state.set_alive(node, True)
            if request.node_id in self.draining:  # drained before this LM restarted
                self.state.drain(node, True)
        except ValueError as err:  # ResourceError, ConstraintError: a malformed worker
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        session = self.sessions.get(node)
        if session is None:
            session = self.sessions[node] = WorkerSession(node, request.node_id)
        # The worker left its stream, though this end may not know yet: a command written
        # to it from now on would be lost, so the stream stops writing, and what waits
        # goes out on the stream the worker opens next.
        session.generation += 1
        session.ready.set()
        self.life.heard(node, time.monotonic())
        # Square the books with what the worker holds (see Lifecycle.take_back): what it
        # runs unbooked is adopted (journalled, so a later restart knows it too), what
        # it runs of cancelled jobs is cancelled, what the books saw end is killed, and
        # what the books hold on it that it lost is re-queued.
        pending = (c.start.task.task_id for c in session.commands if c.HasField("start"))
        plan = self.life.take_back(node, self._inventory(request), pending)
        adopted = plan.count(InventoryVerdict.ADOPTED)
        if adopted:
            log.info(
                "took back tasks a worker holds",
                extra={"node": node, "tasks": adopted, "incarnation": self.state.incarnation},
            )
            metrics.TASKS_ADOPTED.labels(self.lm_id).inc(adopted)
        self._count_cancelled(plan.cancelled_jobs, plan.cancelled)
        await self._carry_out(plan.actions)
        self._count_workers()
        log.info("worker registered", extra={"node_id": request.node_id, "node": node})
        return local_master_pb2.RegisterWorkerResponse(
            lm_id=self.lm_id,
            node_index=node,
            heartbeat_interval_s=self.config.worker_heartbeat_interval_s,
        )

    def _capacity_refused(self, node_id: str, capacity: np.ndarray) -> str:
        """Why a worker may not register with ``capacity`` ("" if it may): a nonsense
        vector (negative, no cpu or memory) or one above this LM's max_node_capacity. Asked
        of every registration, a known node's too: a forged one must not revive a node."""
        bound = self.config.node_capacity_bound(self.lm_id)  # at most MAX_VALUE: first
        why = above_bound(capacity, bound)
        if why:
            return (
                f"worker {node_id!r} advertises more than one node may on {self.lm_id}: "
                f"{why}; the bound is max_node_capacity in the federation config (per LM: "
                f"lms[].max_node_capacity), now {format_resources(bound)}"
            )
        try:
            validate_capacity(capacity)
        except ResourceError as err:
            return f"worker {node_id!r}: {err}"
        return ""

    def _inventory(self, request) -> list[Held[common_pb2.Task]]:
        """What a registering worker names, read: running first, then the ended tasks
        whose final report it owes. A task that cannot be read is named (its id counts)
        but left alone; one that can is our own copy (it may be held from now on)."""
        held: list[Held[common_pb2.Task]] = []
        for tasks, running in ((request.running_tasks, True), (request.finished_tasks, False)):
            for task in tasks:
                try:
                    spec = parse_task(task, self.config.num_constraints)
                except InvalidTask as err:
                    log.warning(
                        "worker holds a malformed task",
                        extra={"task_id": task.task_id, "error": str(err)},
                    )
                    held.append(Held(task, None, running))
                    continue
                own = common_pb2.Task.FromString(task.SerializeToString())
                held.append(Held(own, spec, running))
        return held

    async def WorkerHeartbeats(self, request_iterator, context):
        """Bidirectional: reports in, commands out, for as long as the worker stays."""
        await self._serve_worker(context)

    async def HostHeartbeats(self, request_iterator, context):
        """A worker host's nodes' streams on one call, each served as WorkerHeartbeats."""
        await serve_host(context, self._serve_worker)

    async def _serve_worker(self, context) -> None:
        """One worker's heartbeat stream: a call's context, or a node stream of a host's
        call (``host_streams.NodeContext``); it reads, writes and aborts the same."""
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        session = self.sessions.get(first.node_index)
        if session is None or session.node_id != first.node_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "register first")
        if not self.state.table.is_alive(session.node):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "taken for dead: register")
        session.streams += 1
        generation = session.generation
        await asyncio.shield(self._on_heartbeat(session, first))  # whole: see read()

        async def read() -> None:
            while True:
                beat = await context.read()
                if beat is grpc.aio.EOF:
                    return
                if (
                    not self.state.table.is_alive(session.node)
                    or self.sessions.get(session.node) is not session
                ):
                    # Taken for dead meanwhile, its tasks re-queued: ending the stream
                    # makes it register again and say what it still runs, so what it
                    # runs of those tasks is killed (see _take_back), not run twice.
                    # (Or forgotten since: its row may be another node's now.)
                    return
                try:
                    # Whole, though the stream ends meanwhile (this reader is cancelled
                    # then): a report read is one the worker counts as delivered once
                    # its redelivery window passed, and the reports after an await
                    # (a re-queue waiting for the broker) would be dropped unread.
                    await asyncio.shield(self._on_heartbeat(session, beat))
                except Exception:
                    # A fault here, not in the stream: said, or the worker's stream would
                    # just end, as a broken one does, with nothing in any log.
                    log.exception(
                        "handling a worker's heartbeat failed; ending its stream",
                        extra={"node_id": session.node_id},
                    )
                    raise

        ending = asyncio.Event()  # the call ends: no new write

        async def write() -> None:
            commands = session.commands
            while session.generation == generation and not ending.is_set():
                if not commands:
                    session.ready.clear()
                    await session.ready.wait()
                    continue
                # Leaves the queue only once written: a stream that breaks mid-write
                # leaves it for the worker's next stream (a repeated start is ignored).
                # Two streams of one worker (a reconnect overlapping the old stream) may
                # both write it; only the one that finds it still at the head removes it.
                # Starts waiting together go as one message (a job packed onto a node).
                sent = _leading_starts(commands) or [commands[0]]
                session.written.update(id(command) for command in sent)
                if len(sent) == 1:
                    await context.write(sent[0])
                else:
                    batch = local_master_pb2.StartTasks(tasks=[c.start.task for c in sent])
                    await context.write(local_master_pb2.WorkerCommand(starts=batch))
                for command in sent:
                    if commands and commands[0] is command:
                        commands.popleft()
                        session.written.discard(id(command))

        reader = asyncio.create_task(read())
        writer = asyncio.create_task(write())
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:  # a broken stream just ends the call
                if not finished.cancelled():
                    finished.exception()
        finally:
            session.streams -= 1
            reader.cancel()
            if not writer.done():
                # A write under way finishes before the call does: cancelled mid-write, it
                # left an operation pending that gRPC then refused to end the call with
                # (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS, seen as a stream replaced).
                ending.set()
                session.ready.set()
                with contextlib.suppress(Exception):
                    await asyncio.wait({writer}, timeout=STREAM_DRAIN_S)
                writer.cancel()

    async def ReportTask(self, request, context):
        node = self.state.table.index_of(request.node_id)
        if node is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown node {request.node_id}")
        accepted = 0
        for report in request.reports:
            accepted += await self._on_report(node, report)
        return local_master_pb2.ReportTaskResponse(accepted=accepted)

    async def GetTaskOutput(self, request, context):
        """Ask the worker of ``request.node_id`` for a task attempt's output."""
        node = self.state.table.index_of(request.node_id)
        session = self.sessions.get(node) if node is not None else None
        if session is None or not self.state.table.is_alive(node):
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"worker {request.node_id} is not connected to {self.lm_id}: its output "
                "stays on its host until it is back",
            )
        request_id = next(self._output_ids)
        answer = self._output_waiters[request_id] = asyncio.get_running_loop().create_future()
        order = local_master_pb2.OutputRequest(request_id=request_id, request=request)
        session.commands.append(local_master_pb2.WorkerCommand(output=order))
        session.ready.set()
        try:
            async with asyncio.timeout(OUTPUT_TIMEOUT_S):
                reply = await answer
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"worker {request.node_id} did not send the output within {OUTPUT_TIMEOUT_S:g} s",
            )
        finally:
            self._output_waiters.pop(request_id, None)
        reply.lm_id, reply.node_id = self.lm_id, request.node_id
        return reply

    async def SendTaskOutput(self, request, context):
        answer = self._output_waiters.get(request.request_id)
        if answer is not None and not answer.done():
            answer.set_result(request.output)
        return local_master_pb2.SendTaskOutputResponse()

    async def LookupTasks(self, request, context):
        reply = local_master_pb2.LookupTasksResponse()
        # Fenced (with a lease) in the same step as the answer: see Lifecycle.lookup.
        for found in self.life.lookup(request.task_ids, request.fence_lease):
            ended = self.endings.get(found.task_id)
            reply.tasks.add(
                task_id=found.task_id,
                attempt=found.attempt,
                running=found.running,
                last_ended=None if ended is None else common_pb2.TaskEvent.FromString(ended),
            )
        return reply

    async def ListTasks(self, request, context):
        ended = list(self.endings.values())  # parsed a batch at a time, as sent
        events = [self._event_of(task, state, node) for task, state, node in self.life.listing()]
        for start in range(0, len(ended), LIST_BATCH):
            batch = [common_pb2.TaskEvent.FromString(e) for e in ended[start : start + LIST_BATCH]]
            yield local_master_pb2.ListTasksResponse(events=batch)
        for start in range(0, len(events), LIST_BATCH):
            yield local_master_pb2.ListTasksResponse(events=events[start : start + LIST_BATCH])

    async def _on_heartbeat(self, session: WorkerSession, beat) -> None:
        now = time.monotonic()
        node = session.node
        self.life.heard(node, now)
        # The whole heartbeat is decided before any of it is carried out: its reports on
        # the books, then, if its worker leaves, its node taken out. Carried out report by
        # report, a leaving worker's node took tasks while a report's re-queue waited for
        # the broker: the GM placed that very next attempt back on the node (its room
        # just freed), and the node's loss ended it LOST again a moment later (two LOST
        # events for one graceful stop, the attempt run elsewhere only after that).
        outcomes = [self._judge(node, report) for report in beat.reports]
        loss: list[Action] | None = None
        if beat.leaving and self.state.table.is_alive(node):
            loss = self._take_out(node, f"its worker {session.node_id} shut down", left=True)
        for outcome in outcomes:
            await self._follow(outcome)
        if loss is not None:
            await self._carry_out(loss)
        elif beat.want_ack and now - session.acked_at >= ACK_EVERY_S:
            # Queued after the commands this heartbeat caused: what the worker reads
            # before it is what the LM decided knowing the heartbeat.
            session.acked_at = now
            ack = local_master_pb2.HeartbeatAck(heartbeat_sent_unix_nanos=beat.sent_unix_nanos)
            session.commands.append(local_master_pb2.WorkerCommand(ack=ack))
            session.ready.set()

    async def _on_report(self, node: int, report) -> bool:
        """A worker's report: what it does is the lifecycle's (``ReportVerdict``)."""
        outcome = self._judge(node, report)
        await self._follow(outcome)
        return outcome.verdict.accepted

    def _judge(self, node: int, report) -> ReportOutcome[common_pb2.Task]:
        """A worker's report on the books (``Lifecycle.report``); nothing carried out yet."""
        outcome = self.life.report(node, report)
        if outcome.task is not None:  # the report counts: its times are the task's
            outcome.task.timestamps.MergeFrom(report.timestamps)
        verdict = outcome.verdict
        if verdict is ReportVerdict.RETRYING:
            self._finished("retrying").inc()
        elif verdict is ReportVerdict.ENDED:
            self._finished(_state_label(report.state)).inc()
        return outcome

    async def _follow(self, outcome: ReportOutcome[common_pb2.Task]) -> None:
        """Carry out what a judged report (``_judge``) decided."""
        if outcome.verdict is ReportVerdict.STOPPED:
            # A killed attempt's next one: not awaited here, where a broker that is away
            # would hold back every later report of this worker (the preempting task's
            # start among them).
            self._in_background(self._carry_out(outcome.actions))
        elif outcome.actions:
            await self._carry_out(outcome.actions)

    # --------------------------------------------------------------- helpers
    async def _spec(self, task: common_pb2.Task, context) -> TaskSpec:
        """The task's spec; a malformed task ends the call with INVALID_ARGUMENT."""
        try:
            return parse_task(task, self.config.num_constraints)
        except InvalidTask as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    def _refuse_late(self, request, received: int, kind: str) -> Decision:
        late_s = (received - request.expires_unix_nanos) / 1e9
        log.warning(
            "refused a request read after the GM gave up on it",
            extra={"gm": request.gm_id, "kind": kind, "late_s": round(late_s, 3)},
        )
        return Decision(
            PlacementStatus.REJECTED_EXPIRED,
            f"{self.lm_id} read this {kind} {late_s:.1f} s after it expired; nothing was done",
        )

    def _result(self, task_id: str, decision: Decision, kind: str):
        self._placements(kind, decision.status.name.lower()).inc()
        return local_master_pb2.PlacementResult(
            task_id=task_id,
            status=placement_status_to_proto(decision.status),
            reason=decision.reason,
        )

    def _start(
        self, task: common_pb2.Task, allocation: Allocation | None, received: int
    ) -> common_pb2.Task:
        """Book an accepted task, send it to its worker; returns our copy of it."""
        assert allocation is not None
        task = common_pb2.Task().FromString(task.SerializeToString())  # our own copy
        task.timestamps.lm_received_unix_nanos = received
        task.timestamps.lm_decided_unix_nanos = time.time_ns()
        self._apply(self.life.hold(task, allocation))
        return task

    async def _carry_out(self, actions: Iterable[Action]) -> None:
        """Carry out a lifecycle plan: every re-queue of it is journalled as owed first
        (the LM may die while one waits for the broker), then the rest of the plan, in
        its order (the endings the re-queues follow are written with it), then the
        re-queues, each awaited until the broker has it (``_enqueue_owed``). Sent in the
        plan's order, an ending after a re-queue waiting for a broker that was away was
        lost with an LM that died meanwhile, and its attempt, owed again but not known
        ended, was placed again beside the next."""
        actions = list(actions)
        requeues = [a for a in actions if isinstance(a, Requeue)]
        owed = [self._owe(a.task) for a in requeues]
        for action in actions:
            if not isinstance(action, Requeue):
                self._apply_one(action)
        sending = []
        for action, again in zip(requeues, owed, strict=True):
            if action.owed:  # owed now, no longer stopping (``_owe`` wrote it)
                self._stopped(action.task)
            if again is not None:
                sending.append(self._send_requeue(again))
        # Every re-queue is on its way before any is awaited: sent one after the other, a
        # caller cancelled while the first waited for the broker (a worker's registration
        # past its deadline) never sent the rest, and those tasks, ended on the books and
        # no longer stopping, waited for this LM's next restart (the chaos suite's LM
        # kill left a preempted task stuck).
        if sending:
            await asyncio.shield(asyncio.gather(*sending))

    def _apply(self, actions: Iterable[Action]) -> None:
        """``_carry_out`` for a plan that re-queues nothing (a start, a cancel, a
        superseded attempt)."""
        for action in actions:
            self._apply_one(action)

    def _apply_one(self, action: Action) -> None:
        if isinstance(action, Publish):
            a = action
            self._event(a.task, a.state, a.node, a.reason, a.peak_memory_mb)
        elif isinstance(action, Kill):
            if self._withdraw(action):
                # Never sent: the attempt never ran. Its next attempt (if it waits for
                # this one) is queued in the background: the caller may not await.
                then = self.life.withdrawn(action.task_id, action.attempt)
                if then:
                    self._in_background(self._carry_out(then))
                return
            self._send(action.node, kill=(action.task_id, action.attempt, action.reason))
        elif isinstance(action, Start):
            self._send(action.node, start=action.task)
        elif isinstance(action, Journal):
            if self.journal is not None:  # a later restart must know it too
                self._unaccepted.append(action.task)
                self._schedule_write()
        elif isinstance(action, Owe):
            if self.journal is not None:  # a restart meanwhile must still queue it
                try:
                    self.journal.stop([action.task])
                except Exception as err:
                    self._journal_failed(err)
        else:
            raise TypeError(f"{action!r} must be awaited: use _carry_out")

    def _withdraw(self, kill: Kill) -> bool:
        """Take back the start of the attempt ``kill`` names if it still waits for the
        worker's stream, its write not begun: the worker never reads it (nor the kill)."""
        session = self.sessions.get(kill.node)
        if session is None:
            return False
        for command in session.commands:
            if not command.HasField("start") or id(command) in session.written:
                continue
            task = command.start.task
            if task.task_id == kill.task_id and task.attempt == kill.attempt:
                session.commands.remove(command)
                log.info(
                    "took back a start not yet sent",
                    extra={"task_id": task.task_id, "attempt": task.attempt},
                )
                return True
        return False

    def _in_background(self, plan) -> None:
        """Carry out ``plan`` (a coroutine) in a task of the LM's own, waited for at
        shutdown like a re-queue."""
        job = asyncio.create_task(plan)
        self._requeues.add(job)
        job.add_done_callback(self._requeues.discard)

    def _send(self, node: int, start=None, kill: tuple[str, int, str] | None = None) -> None:
        session = self.sessions.get(node)
        if session is None:
            return
        if start is not None:
            command = local_master_pb2.WorkerCommand(start=local_master_pb2.StartTask(task=start))
        else:
            assert kill is not None
            task_id, attempt, reason = kill
            command = local_master_pb2.WorkerCommand(
                kill=local_master_pb2.KillTask(task_id=task_id, attempt=attempt, reason=reason)
            )
        commands = session.commands
        if kill is None:
            commands.append(command)
        else:
            # Ahead of the starts not yet written (in order among kills): a start may
            # take the room this kill frees, and the worker runs what it reads in order.
            # Behind them, a start that waited for a new stream (the old one broke)
            # overtook the kill of a stale attempt the registration found still running,
            # and the node held both (``chaos-sim --small --seed 7277``).
            at = next(
                (
                    i
                    for i, c in enumerate(commands)
                    if id(c) not in session.written and not c.HasField("kill")
                ),
                len(commands),
            )
            commands.insert(at, command)
        session.ready.set()

    def _owe(self, task: common_pb2.Task) -> common_pb2.Task | None:
        """``task``'s next attempt, journalled as owed (a restarted LM sends it again:
        the attempt has ended on the books, and this message is the task's only way on);
        None if an earlier life owed it and sent it again at start. Then sent in a task of
        the LM's own (``_send_requeue``), awaited but not cancelled with its caller: a
        GM's Preempt whose deadline passes while the broker is away, or a worker's stream
        that ends, cancels its handler, and a re-queue cancelled with it lost the task
        for good (the chaos suite's broker restart left it stuck)."""
        if self._owed.pop((task.task_id, task.attempt + 1), None) is not None:
            return None
        try:
            again = next_attempt(task, time.time_ns())
        except InvalidTask as err:
            log.error(
                "a task has no next attempt", extra={"task_id": task.task_id, "error": str(err)}
            )
            return None
        if self.journal is not None:
            try:
                self.journal.owe(again)
            except Exception:
                log.exception("could not journal a re-queue; it is lost should this LM die")
        return again

    def _stopped(self, task: common_pb2.Task) -> None:
        """A killed attempt (``Lifecycle.stopping``, journalled by ``Owe``) can no longer
        run: struck from the journal's stopping attempts, its next attempt owed now."""
        if self.journal is not None:
            try:
                self.journal.stopped(task.task_id, task.attempt)
            except Exception as err:
                self._journal_failed(err)

    def _send_requeue(self, again: common_pb2.Task) -> asyncio.Task:
        job = asyncio.create_task(self._enqueue_owed(again))
        self._requeues.add(job)
        job.add_done_callback(self._requeues.discard)
        return job

    async def _enqueue_owed(self, again: common_pb2.Task) -> None:
        """Put ``again`` in its queue, tried again while the broker is away (a restart),
        then strike it from the owed re-queues. Before, a re-queue that failed lost the
        task (the chaos suite's broker restart left one stuck)."""
        while True:
            try:
                await enqueue_attempt(self.bus, again)
                break
            except Exception as err:
                if self._closed:
                    raise
                log.warning(
                    "re-queue failed; trying again",
                    extra={"task_id": again.task_id, "error": repr(err)},
                )
                await asyncio.sleep(EVENT_RETRY_S)
        if self.journal is not None:
            try:
                self.journal.paid(again.task_id, again.attempt)
            except Exception:
                log.exception("could not journal a re-queue's confirm; a restart sends it again")

    def _event_of(
        self, task: common_pb2.Task, state: int, node: int, reason: str = ""
    ) -> common_pb2.TaskEvent:
        return common_pb2.TaskEvent(
            task_id=task.task_id,
            job_id=task.job_id,
            queue=task.queue,
            state=state,
            lm_id=self.lm_id,
            node_id=self.state.table.node_ids[node] if node >= 0 else "",
            reason=reason,
            timestamps=task.timestamps,
            attempt=task.attempt,
            gang=bool(task.gang_task_ids),
        )

    def _event(
        self, task: common_pb2.Task, state: int, node: int, reason: str, peak_memory_mb: int = 0
    ) -> None:
        event = self._event_of(task, state, node, reason)
        event.peak_memory_mb = peak_memory_mb
        self._events.append(event)
        self._events_ready.set()
        if state in RELEASED:
            self.endings[task.task_id] = event.SerializeToString()
            self.endings.move_to_end(task.task_id)
            if len(self.endings) > self.config.lm_endings_kept:
                self.endings.popitem(last=False)
            if self.journal is not None:
                self._unjournaled.append(event)
                self._schedule_write()

    def _state_proto(self, since: int | None = None) -> common_pb2.LocalMasterState:
        msg = snapshot_to_proto(self.state.snapshot(since), partition_totals(self.state))
        msg.sent_unix_nanos = time.time_ns()
        return msg

    def _count_workers(self) -> None:
        alive = self.state.table.alive.count()
        metrics.WORKERS.labels(self.lm_id, "alive").set(alive)
        nodes = self.state.table.size - len(self.state.table.vacant)  # forgotten: no node
        metrics.WORKERS.labels(self.lm_id, "dead").set(nodes - alive)
        metrics.WORKERS.labels(self.lm_id, "draining").set(len(self.state.draining))

    # ----------------------------------------------------------------- loops
    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        while True:
            try:
                await self.publish_heartbeat()
            except Exception:
                log.exception("heartbeat publish failed")
            await asyncio.sleep(interval)

    async def publish_heartbeat(self) -> None:
        """Full state at start and every ``full_state_every`` beats, deltas between."""
        full = self._beats % self.config.full_state_every == 0 or self._published_version < 0
        self._beats += 1
        since = None if full else self._published_version
        msg = self._state_proto(since)
        self._published_version = msg.version
        await self.bus.publish_fanout(
            HEARTBEAT_EXCHANGE, msg.SerializeToString(), ttl_s=self.config.heartbeat_interval_s
        )

    async def _event_loop(self) -> None:
        while True:
            await self._events_ready.wait()
            await asyncio.sleep(self.config.event_batch_s)  # gather events into one message
            try:
                await self._flush_events()
            except Exception as err:
                log.warning("event publish failed; trying again", extra={"error": repr(err)})
                await asyncio.sleep(EVENT_RETRY_S)

    async def _flush_events(self) -> None:
        self._events_ready.clear()
        events, self._events = self._events, []
        # Every ending journalled so far is in this batch or was published before it
        # (an ending joins the events when it is made, and is written a turn later).
        journalled = self.journal.seq if self.journal is not None else 0
        if events:
            body = common_pb2.TaskEventBatch(events=drop_superseded(events)).SerializeToString()
            try:
                await self.bus.publish_topic(EVENT_EXCHANGE, event_key(self.lm_id), body)
            except BaseException:
                # Kept, in order, for the next try (the broker may be restarting). What
                # is lost anyway (sent into a dying connection) GMs recover: LookupTasks.
                self._events[:0] = events
                self._events_ready.set()
                raise
            if self.journal is not None:
                try:
                    self.journal.mark_published(journalled)
                except Exception as err:  # a restart publishes a few endings twice
                    self._journal_failed(err)

    async def _journal_accepted(self, tasks: list[common_pb2.Task]) -> None:
        """Write ``tasks`` as accepted before the caller answers ACCEPTED: on the event
        loop, as a thread hop would cost several times the write (``TaskJournal``). A
        write that fails (a full disk) is kept for the journal loop to retry, and the
        answer goes anyway: the task runs, and only a crash of this LM before the retry,
        with its GM, would lose it."""
        if self.journal is not None and tasks:
            self._unaccepted.extend(tasks)
            self._write_pending()
        await asyncio.sleep(0)

    def _schedule_write(self) -> None:
        """Write what is pending on the loop's next turn, with whatever else that turn
        adds: an ending is on disk within a fraction of a millisecond, not a flush
        interval, so an LM killed with its workers does not run again a task that had
        just ended (with a flush every 0.2 s, all 8 tasks of the test did, 1 run in 3)."""
        if not self._write_scheduled:
            self._write_scheduled = True
            asyncio.get_running_loop().call_soon(self._write_pending)

    def _write_pending(self) -> None:
        """Write the pending accepted tasks and endings, on the loop (a thread hop costs
        more than the write: ``TaskJournal``). What fails is kept for the next try (a
        full disk may get room again): bounded, past that many the oldest endings are
        kept in memory only, and the accepted tasks by what runs here."""
        self._write_scheduled = False
        if self.journal is None or not (self._unaccepted or self._unjournaled):
            return
        accepted, self._unaccepted = self._still_held(self._unaccepted), []
        ended, self._unjournaled = self._unjournaled, []
        try:
            self.journal.accept(accepted)  # first: an ending strikes its accepted row
            self.journal.append(ended)
        except Exception as err:
            self._unaccepted[:0] = accepted
            self._unjournaled[:0] = ended
            del self._unjournaled[: -self.config.lm_endings_kept]
            self._journal_failed(err)
        else:
            self._journal_failing = False

    def _still_held(self, tasks: list[common_pb2.Task]) -> list[common_pb2.Task]:
        """The tasks of ``tasks`` whose attempt this LM still holds: one that ended needs
        no accepted row (and its ending may be among those a failing journal dropped,
        which would leave the row standing for ever)."""
        return [t for t in tasks if self.life.tasks.get(t.task_id) is t]

    def _journal_failed(self, err: Exception) -> None:
        """One warning per spell of failures (a full disk may get room again)."""
        if not self._journal_failing:
            log.warning("journal write failed", extra={"error": repr(err)})
        self._journal_failing = True

    async def _journal_loop(self) -> None:
        """Every ``FLUSH_S``: try again what failed to be written, and checkpoint the
        journal (in its thread: that fsyncs) when something was written."""
        assert self.journal is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(FLUSH_S)
            self._write_pending()
            if not self.journal.written:
                continue  # no thread hop for nothing
            try:
                await asyncio.shield(
                    loop.run_in_executor(self._journal_thread, self.journal.checkpoint)
                )
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self._journal_failed(err)

    async def _orphans_loop(self) -> None:
        """Tasks accepted in an earlier life that no worker named within the grace
        period: their workers died too, or never got them. Each goes back to its queue
        as the next attempt, this one ended LOST (so a late worker's copy is killed):
        ``Lifecycle.expire_orphan``, one at a time, oldest first."""
        due = self.life.arm_orphans(time.monotonic())
        while (now := time.monotonic()) < due:  # (a timer may fire a little early)
            await asyncio.sleep(due - now)
        if self.life.orphans:
            log.warning(
                "re-queueing tasks accepted before a restart that no worker holds",
                extra={"lm": self.lm_id, "tasks": len(self.life.orphans)},
            )
        while (actions := self.life.expire_orphan(time.monotonic())) is not None:
            await self._carry_out(actions)

    async def _watchdog_loop(self) -> None:
        """A worker silent for longer than the timeout is dead; its tasks are re-queued.
        A node dead for longer than ``forget_lost_after_s`` is forgotten (``forget``)."""
        timeout = self.config.worker_timeout_s
        forget_after = self.config.forget_lost_after_s
        while True:
            await asyncio.sleep(min(timeout / 4, 1.0))
            for node in self.life.silent(time.monotonic()):
                await self.mark_dead(node, f"no heartbeat for {timeout:g} s")
            for node in self.life.forgettable(time.monotonic(), forget_after):
                self.forget(node)

    def forget(self, node: int) -> bool:
        """Drop a node that stayed lost from the books (``Lifecycle.forget``): the next
        heartbeat's delta shows its row vacant and full states leave it out, so GMs stop
        listing it. Its worker, should it come back, registers as a new node."""
        node_id = self.state.table.node_ids[node]
        since = self.life.lost_at.get(node)
        if not self.life.forget(node):
            return False
        session = self.sessions.pop(node, None)
        if session is not None:  # a stream of it still open writes no more, reads no more
            session.generation += 1
            session.ready.set()
        self._count_workers()
        log.info(
            "forgot a lost node",
            extra={
                "lm": self.lm_id,
                "node_id": node_id,
                "node": node,
                "lost_s": None if since is None else round(time.monotonic() - since, 1),
            },
        )
        return True

    async def mark_dead(self, node: int, reason: str, left: bool = False) -> None:
        """Take ``node`` out and re-queue its tasks; ``left``: its worker said it shuts
        down (an operator's stop, a scale-down), which is no fault: said at info level
        when it ran nothing, so that stopping a federation is quiet."""
        await self._carry_out(self._take_out(node, reason, left))

    def _take_out(self, node: int, reason: str, left: bool = False) -> list[Action]:
        """``mark_dead`` up to its plan, which is returned to be carried out: from here
        on the node takes no task."""
        loss = self.life.node_lost(node, reason, time.monotonic())
        lost = loss.lost
        self._count_workers()
        session = self.sessions.get(node)
        if session is not None:
            # Its tasks go back to their queues: a start still waiting for the worker's
            # stream must not reach it if it comes back, or the task would run twice.
            session.commands.clear()
            session.written.clear()
        quiet = left and not lost
        (log.info if quiet else log.warning)(
            "worker left" if left else "worker lost",
            extra={"node_id": self.state.table.node_ids[node], "tasks": len(lost), "why": reason},
        )
        return loss.actions
