"""The worker agent: one node of an LM. It registers, keeps a heartbeat stream open, runs
the tasks the LM starts on it and reports how they go.

::

    RegisterWorker ──▶ node_index, heartbeat interval
    WorkerHeartbeats (one bidi stream per connection; on a worker host, a node stream
                      of the host's one HostHeartbeats call: services/worker/link.py)
       up:   WorkerHeartbeat(reports) every interval, and at once when a task changes state
       down: WorkerCommand start ──▶ executor.run in an asyncio task ──▶ RUNNING, then
                                     SUCCEEDED / FAILED (or PREEMPTED / FAILED when killed)
             WorkerCommand kill  ──▶ cancel that asyncio task

Reports wait in an outbox until a heartbeat carries them. When the LM or the stream goes
away, tasks keep running and reports keep collecting; the agent reconnects with
exponential backoff, registers again under the same node id and sends what it owes.

What the LM can rely on:

- A registration names every task running here and every task whose final report is
  still owed (``RegisterWorkerRequest.running_tasks`` / ``finished_tasks``): an LM that
  restarted, its books lost, books them again from that.
- The first heartbeat of every stream is an inventory: it carries a RUNNING report for
  each task running here and the terminal reports still owed (a resync after an LM
  restart or a disconnect). A RUNNING report for a task already RUNNING is a no-op. (Over
  ``MAX_REPORTS_PER_HEARTBEAT`` reports span several heartbeats sent back to back.)
- Terminal reports are sent at least once: reports written shortly before a stream broke
  (within ``REDELIVERY_WINDOW_S``) are sent again on the next stream, because a
  completed write does not mean the LM received it. Drop a terminal report for a task
  that has already ended.
- A task killed on shutdown is reported LOST: the node is going away, like a crash.
- With ``fence_s`` (config ``worker_fence_s``), an agent whose LM has not read a heartbeat
  of it for that long kills its tasks (reported LOST): the LM takes a worker it has not
  heard from for ``worker_timeout_s`` for dead and runs its tasks elsewhere, and a worker
  cut off from it (a network partition) must not run them meanwhile, nor start one whose
  start reaches it meanwhile (reported LOST). Heartbeats then ask for a ``HeartbeatAck``
  naming the newest one the LM read; the agent counts from when it sent that one (or
  began its last registration), so it always fences first. The LM counts on this: it
  queues the next attempt of a task it killed on a worker it then takes for dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType

import grpc
import numpy as np

from services._proto.megha.v1 import common_pb2, local_master_pb2, local_master_pb2_grpc
from services.common.config import WORKER_STREAM_LIFE_S
from services.common.convert import resources_to_proto
from services.core.resources import validate_capacity
from services.worker.executors import (
    EXECUTOR_NAMES,
    ExecutionResult,
    Executor,
    executor_for,
)
from services.worker.link import HostLink
from services.worker.outputs import READ_LIMIT, TaskOutputs

log = logging.getLogger("megha.worker")

RUNNING = common_pb2.TASK_STATE_RUNNING
FAILED = common_pb2.TASK_STATE_FAILED
PREEMPTED = common_pb2.TASK_STATE_PREEMPTED
NEVER_KEPT = 4096  # attempts killed before their start came, remembered (newest)
LOST = common_pb2.TASK_STATE_LOST

BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 2.0
REGISTER_TIMEOUT_S = 5.0
# Terminal reports written this long before a stream broke are sent again (see module doc).
REDELIVERY_WINDOW_S = 3.0
# Keeps a heartbeat far below gRPC's 4 MiB message limit after a long disconnect.
MAX_REPORTS_PER_HEARTBEAT = 2000
# A heartbeat stream is replaced by a new one (no new registration) after about
# ``stream_life_s`` (config ``worker_stream_life_s``): grpc holds ~370 B of native memory
# per message written on a stream until the stream ends, so one that lived for ever grew
# a worker host without bound (+366 B per heartbeat, `python scripts/probes.py
# idle-worker`). Each stream's life is drawn in [0.75, 1.25] of it, so a host's agents do
# not all replace their streams at once.
#
# How long a replaced stream waits for the LM to end it: commands the LM wrote before it
# saw our end are still read (a start read nowhere would be lost).
STREAM_HANDOVER_S = 10.0
# Heartbeats sent and not yet acked that a fencing agent remembers (an LM that never acks
# would otherwise grow it): far more than are sent between two acks.
MAX_UNACKED = 1000
OUTPUT_SEND_TIMEOUT_S = 5.0  # for a SendTaskOutput (the LM waits as long)


class RegistrationRefused(RuntimeError):
    """The LM refused this node for good (e.g. constraints it does not know)."""


@dataclass
class _Running:
    task: common_pb2.Task
    runner: asyncio.Task[None]
    # Set when the agent cancels the runner, so the runner knows what to report.
    kill_state: common_pb2.TaskState.ValueType | None = None
    kill_message: str = ""

    def kill_result(self) -> ExecutionResult:
        assert self.kill_state is not None
        return ExecutionResult(exit_code=-1, message=self.kill_message, state=self.kill_state)


@dataclass
class _Sent:
    report: local_master_pb2.TaskReport
    at: float = field(default_factory=time.monotonic)


class Backoff:
    """Exponential backoff with full jitter in the upper half: 0.1 s doubling to 2 s."""

    def __init__(
        self,
        initial_s: float = BACKOFF_INITIAL_S,
        max_s: float = BACKOFF_MAX_S,
        rng: random.Random | None = None,
    ) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self._rng = rng or random.Random()
        self._next = initial_s

    def next(self) -> float:
        delay = self._next
        self._next = min(self.max_s, self._next * 2)
        return delay * self._rng.uniform(0.5, 1.0)

    def reset(self) -> None:
        self._next = self.initial_s


class WorkerAgent:
    """One worker node: registers with its LM, runs the tasks it is given, reports on them.

    Use ``async with WorkerAgent(...)`` (runs in the background until the block ends) or
    ``await agent.run()`` with ``await agent.shutdown()`` from elsewhere.

    ``executors`` (name -> executor) lets agents of one process share executor instances;
    ``registration_slots`` caps how many agents sharing it register at the same moment.
    """

    def __init__(
        self,
        node_id: str,
        capacity: np.ndarray,
        constraints: list[int],
        channel: grpc.aio.Channel,
        default_executor: str = "sim",
        heartbeat_interval_s: float = 1.0,
        address: str = "",
        *,
        executors: Mapping[str, Executor] | None = None,
        registration_slots: asyncio.Semaphore | None = None,
        rng: random.Random | None = None,
        stream_life_s: float = WORKER_STREAM_LIFE_S,
        fence_s: float = 0.0,
        outputs: TaskOutputs | None = None,
        link: HostLink | None = None,
    ) -> None:
        if default_executor not in EXECUTOR_NAMES:
            raise ValueError(
                f"unknown default executor {default_executor!r}; "
                f"choose one of {', '.join(EXECUTOR_NAMES)}"
            )
        validate_capacity(np.asarray(capacity, dtype=np.int64))
        self.node_id = node_id
        self.capacity = np.asarray(capacity, dtype=np.int64)
        self.constraints = list(constraints)
        self.address = address
        self.default_executor = default_executor
        self.heartbeat_interval_s = heartbeat_interval_s
        self.stream_life_s = stream_life_s
        self.fence_s = fence_s
        self.fenced = 0  # tasks killed because the LM had not heard from us for fence_s
        self.streams = 0  # heartbeat streams opened, replacements included
        self.registrations = 0
        self.lm_id = ""
        self.node_index: int | None = None
        self.channel = channel
        self._stub = local_master_pb2_grpc.LocalMasterStub(channel)
        # The host's one heartbeat call (services.worker.link), or None: a stream of its own.
        self._link = link
        self._executors = executors
        self._outputs = outputs  # what the host's tasks wrote (megha logs)
        self._answers: set[asyncio.Task[None]] = set()  # SendTaskOutput calls under way
        self._registration_slots = registration_slots
        self._rng = rng or random.Random()
        self._running: dict[str, _Running] = {}
        # Starts of a task's next attempt that came while an older attempt of it still
        # ran here (the LM ended that one on its books: preempted, lost, retried): the
        # older one is killed and the newer starts once it has ended, so two attempts of
        # one task never run at once.
        self._next: dict[str, common_pb2.Task] = {}
        self._outbox: list[local_master_pb2.TaskReport] = []
        self._sent: deque[_Sent] = deque()  # written on the current stream, newest last
        # The tasks of the final reports in the outbox or in _sent, by (id, attempt): a
        # registration names them, so an LM that restarted can book them and take the
        # reports (see RegisterWorkerRequest.finished_tasks).
        self._owed: dict[tuple[str, int], common_pb2.Task] = {}
        self._never: dict[tuple[str, int], None] = {}  # attempts killed before they came
        # Fencing: when the LM had certainly heard from us last (monotonic; None before
        # the first registration), and the heartbeats of this stream it has not acked
        # yet, as (sent_unix_nanos, monotonic time just before the write).
        self._contact: float | None = None
        self._unacked: deque[tuple[int, float]] = deque(maxlen=MAX_UNACKED)
        # Created lazily: asyncio primitives belong to the loop that runs the agent.
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._connected: asyncio.Event | None = None
        self._run_task: asyncio.Task[None] | None = None
        self._shutdown_task: asyncio.Task[None] | None = None
        self._closing = False
        self._report_outage = True

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> WorkerAgent:
        self._run_task = asyncio.create_task(self.run(), name=f"worker {self.node_id}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    @property
    def running_task_ids(self) -> list[str]:
        return list(self._running)

    @property
    def connected(self) -> bool:
        return self._connected is not None and self._connected.is_set()

    async def wait_connected(self) -> None:
        """Return once the heartbeat stream is open (after a successful registration)."""
        self._events()
        assert self._connected is not None
        await self._connected.wait()

    async def run(self) -> None:
        """Register and serve the LM until ``shutdown()``; reconnects on its own.

        Raises ``RegistrationRefused`` if the LM rejects the node's registration as invalid.
        """
        current = asyncio.current_task()
        if self._run_task not in (None, current) and not self._run_task.done():
            raise RuntimeError(f"worker {self.node_id} is already running")
        self._run_task = current
        wake, stop, connected = self._events()
        fencing = asyncio.create_task(self._fence_loop()) if self.fence_s > 0 else None
        try:
            await self._serve(wake, stop, connected)
        finally:
            if fencing is not None:
                fencing.cancel()

    async def _serve(
        self, wake: asyncio.Event, stop: asyncio.Event, connected: asyncio.Event
    ) -> None:
        backoff = Backoff(rng=self._rng)
        replaced = False  # the last stream ended by being replaced: no need to register
        while not self._closing:
            began = time.monotonic()
            registered, replaced = replaced, False
            try:
                if not registered:
                    await self._register()
                replaced = await self._session(wake, connected)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.INVALID_ARGUMENT and self.node_index is None:
                    raise RegistrationRefused(
                        f"LM refused node {self.node_id}: {err.details()}"
                    ) from None
                # One warning per outage, not one per retry: a host runs many agents.
                log.log(
                    logging.WARNING if self._report_outage else logging.DEBUG,
                    "lost the LM; reconnecting" if connected.is_set() else "cannot reach the LM",
                    extra={
                        "node_id": self.node_id,
                        "code": err.code().name,
                        "details": err.details(),
                    },
                )
                self._report_outage = False
            except asyncio.InvalidStateError:
                # A write raced with the LM closing the stream cleanly.
                log.warning("the LM ended the heartbeat stream", extra={"node_id": self.node_id})
            finally:
                if self._closing:
                    connected.clear()
                    self._sent.clear()
                    self._owed.clear()
                elif not replaced:
                    connected.clear()
                    self._requeue_recent()
            if self._closing:
                break
            if replaced:
                continue  # the LM read all we wrote and we read all it wrote: go straight on
            # A stream that lived a while broke by accident: retry quickly. One that broke
            # at once probably breaks again: back off.
            if time.monotonic() - began >= BACKOFF_MAX_S:
                backoff.reset()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff.next())

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Kill running tasks (reported LOST), flush reports, close the stream. Idempotent."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.create_task(self._shutdown(timeout))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        wake, stop, connected = self._events()
        self._closing = True
        for entry in list(self._running.values()):
            self._kill(entry, LOST, f"worker {self.node_id} shut down while the task ran")
        runners = [e.runner for e in self._running.values()]
        if runners:
            await asyncio.wait(runners, timeout=max(0.0, deadline - time.monotonic()))
        stop.set()
        wake.set()  # the sender flushes the outbox and closes its side of the stream
        run_task = self._run_task
        if run_task is not None and not run_task.done():
            # Without a live stream there is nothing to flush: don't wait out a registration.
            timeout = max(0.1, deadline - time.monotonic()) if connected.is_set() else 0
            _, pending = await asyncio.wait([run_task], timeout=timeout)
            if pending:
                run_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await run_task
        for entry in list(self._running.values()):  # runners that ignored the grace period
            entry.runner.cancel()
        if self._outbox:
            log.warning(
                "shut down with unsent reports",
                extra={"node_id": self.node_id, "reports": len(self._outbox)},
            )
        log.info("worker shut down", extra={"node_id": self.node_id})

    def _events(self) -> tuple[asyncio.Event, asyncio.Event, asyncio.Event]:
        if self._wake is None:
            self._wake, self._stop, self._connected = (
                asyncio.Event(),
                asyncio.Event(),
                asyncio.Event(),
            )
        assert self._stop is not None and self._connected is not None
        return self._wake, self._stop, self._connected

    # --------------------------------------------------------------- the LM link
    async def _register(self) -> None:
        began = time.monotonic()
        self.registrations += 1
        request = local_master_pb2.RegisterWorkerRequest(
            node_id=self.node_id,
            worker_address=self.address,
            capacity=resources_to_proto(self.capacity),
            constraints=self.constraints,
            running_tasks=[
                *(entry.task for entry in self._running.values()),
                *self._next.values(),
            ],
            finished_tasks=list(self._owed.values()),
        )
        async with self._registration_slots or contextlib.nullcontext():
            reply: local_master_pb2.RegisterWorkerResponse = await self._stub.RegisterWorker(
                request, timeout=REGISTER_TIMEOUT_S
            )
        # The LM read the request after we sent it: it has heard from us since ``began``.
        self._contact = began if self._contact is None else max(self._contact, began)
        self.lm_id = reply.lm_id
        self.node_index = reply.node_index
        if reply.heartbeat_interval_s > 0:
            self.heartbeat_interval_s = reply.heartbeat_interval_s
        log.info(
            "registered",
            extra={"node_id": self.node_id, "lm_id": self.lm_id, "node_index": self.node_index},
        )

    async def _session(self, wake: asyncio.Event, connected: asyncio.Event) -> bool:
        """One heartbeat stream, until it breaks, we shut down, or its life is over.
        True when it ended by being replaced, cleanly: every report we wrote was read
        and every command the LM wrote was read here."""
        call = self._stub.WorkerHeartbeats() if self._link is None else self._link.open()
        self.streams += 1
        self._unacked.clear()  # an ack on this stream names a heartbeat of this stream
        if not connected.is_set():
            self._resync()
        connected.set()
        self._report_outage = True
        life = self.stream_life_s * (0.75 + 0.5 * self._rng.random())
        sender = asyncio.create_task(self._send_loop(call, wake, time.monotonic() + life))
        receiver = asyncio.create_task(self._receive_loop(call))
        try:
            done, _ = await asyncio.wait([sender, receiver], return_when=asyncio.FIRST_COMPLETED)
            if sender in done and sender.exception() is None:
                # We closed our side (shut down, or replaced): the LM ends the stream once
                # it has read it all; read what it wrote until then.
                replacing = sender.result()
                wait_s = STREAM_HANDOVER_S if replacing else 1.0
                with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError):
                    await asyncio.wait_for(asyncio.shield(receiver), wait_s)
                if replacing and receiver.done() and receiver.exception() is None:
                    return True
            for finished in done:
                finished.result()  # re-raise a stream error
            if receiver in done:
                log.warning("the LM ended the heartbeat stream", extra={"node_id": self.node_id})
            return False
        finally:
            sender.cancel()
            receiver.cancel()
            call.cancel()
            await asyncio.gather(sender, receiver, return_exceptions=True)

    def _resync(self) -> None:
        """Queue a RUNNING report for every running task the outbox says nothing about."""
        owed = {r.task_id for r in self._outbox}
        for task_id, entry in self._running.items():
            if task_id not in owed:
                self._outbox.append(_report(entry.task, RUNNING))

    def _requeue_recent(self) -> None:
        """Put reports that may have died with the stream back at the head of the outbox."""
        horizon = time.monotonic() - REDELIVERY_WINDOW_S
        again = [s.report for s in self._sent if s.at >= horizon and s.report.state != RUNNING]
        self._outbox[:0] = again
        for sent in self._sent:
            if sent.at < horizon:
                self._delivered(sent.report)
        self._sent.clear()

    def _delivered(self, report: local_master_pb2.TaskReport) -> None:
        """A report sent long enough ago to count as received: its task is owed no more."""
        if report.state != RUNNING:
            self._owed.pop((report.task_id, report.attempt), None)

    async def _send_loop(
        self, call: grpc.aio.StreamStreamCall, wake: asyncio.Event, until: float
    ) -> bool:
        """Write heartbeats until we shut down (False) or past ``until`` with nothing left
        to send (True: the stream is to be replaced); our side is closed either way."""
        while True:
            wake.clear()  # before draining: a report added from here on wakes us again
            reports = self._outbox[:MAX_REPORTS_PER_HEARTBEAT]
            del self._outbox[:MAX_REPORTS_PER_HEARTBEAT]
            if self._outbox:
                wake.set()  # the rest goes in the next heartbeat, right away
            closing = self._closing and not self._running and not self._outbox
            sent_ns = time.time_ns()
            if self.fence_s > 0:
                self._unacked.append((sent_ns, time.monotonic()))
            try:
                await call.write(
                    local_master_pb2.WorkerHeartbeat(
                        node_id=self.node_id,
                        node_index=self.node_index or 0,
                        sent_unix_nanos=sent_ns,
                        reports=reports,
                        leaving=closing,
                        want_ack=self.fence_s > 0,
                    )
                )
            except BaseException:
                # Not written (the stream broke under the write, or we are cancelled):
                # back at the head of the outbox for the next stream. Dropped here, a
                # final report would be owed (named by the next registration, so a
                # restarted LM books the task) yet never sent: the task held for good.
                self._outbox[:0] = reports
                raise
            now = time.monotonic()
            self._sent.extend(_Sent(r, now) for r in reports)
            horizon = now - REDELIVERY_WINDOW_S
            while self._sent and self._sent[0].at < horizon:
                self._delivered(self._sent.popleft().report)
            if closing:
                await call.done_writing()
                return False
            if now >= until and not self._outbox and not self._closing:
                await call.done_writing()
                return True
            # asyncio.timeout, not wait_for: no task per heartbeat (hundreds of agents).
            # On a host's link, on the host's clock: its idle nodes' heartbeats go together.
            interval = self.heartbeat_interval_s
            loop = asyncio.get_running_loop()
            if self._link is None:
                when = loop.time() + interval
            else:
                when = self._link.next_beat(interval, self.node_id)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(when):
                    await wake.wait()

    async def _receive_loop(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            command = await call.read()
            if command is grpc.aio.EOF:
                return
            kind = command.WhichOneof("command")
            if kind == "start":
                self._start(command.start.task)
            elif kind == "starts":
                for task in command.starts.tasks:
                    self._start(task)
            elif kind == "kill":
                kill = command.kill
                self._on_kill(kill.task_id, kill.attempt, kill.reason)
            elif kind == "ack":
                self._acked(command.ack.heartbeat_sent_unix_nanos)
            elif kind == "output":
                answer = asyncio.create_task(self._send_output(command.output))
                self._answers.add(answer)
                answer.add_done_callback(self._answers.discard)
            else:
                log.warning("ignored an empty command", extra={"node_id": self.node_id})

    async def _send_output(self, order: local_master_pb2.OutputRequest) -> None:
        """Read what the LM asked for from the host's output files and send it back."""
        want = order.request
        entry = self._running.get(want.task_id)
        reply = common_pb2.GetTaskOutputResponse(
            attempt=want.attempt,
            node_id=self.node_id,
            running=entry is not None and entry.task.attempt == want.attempt,
        )
        if self._outputs is not None:
            chunk = await asyncio.to_thread(
                self._outputs.read,
                want.task_id,
                want.attempt,
                "err" if want.stderr else "out",
                want.offset,
                want.limit or READ_LIMIT,
            )
            if chunk is not None:
                reply.found, reply.data = True, chunk.data
                reply.offset, reply.size, reply.dropped = chunk.offset, chunk.size, chunk.dropped
        answer = local_master_pb2.SendTaskOutputRequest(request_id=order.request_id, output=reply)
        try:
            await self._stub.SendTaskOutput(answer, timeout=OUTPUT_SEND_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:  # the LM gives up on its own after a while
            log.info(
                "task output not sent",
                extra={"node_id": self.node_id, "task_id": want.task_id, "why": err.code().name},
            )

    def _acked(self, sent_unix_nanos: int) -> None:
        """The LM read our heartbeat stamped ``sent_unix_nanos``, and every one before it.
        Found by its stamp, not compared with it: the wall clock may step back."""
        unacked = self._unacked
        if not any(stamp == sent_unix_nanos for stamp, _ in unacked):
            return  # an ack written on an earlier stream
        while True:
            stamp, contact = unacked.popleft()
            if stamp == sent_unix_nanos:
                break
        if self._contact is None or contact > self._contact:
            self._contact = contact

    def _cut_off(self) -> bool:
        """The LM has not read a heartbeat of ours for ``fence_s`` (the fence is on)."""
        contact, fence = self._contact, self.fence_s
        return fence > 0 and contact is not None and time.monotonic() - contact >= fence

    async def _fence_loop(self) -> None:
        """Kill every running task once the LM has not heard from us for ``fence_s``."""
        while True:
            contact = self._contact
            age = None if contact is None else time.monotonic() - contact
            if age is not None and age >= self.fence_s and self._running:
                self._fence(age)
            if age is not None and age < self.fence_s:
                wait = self.fence_s - age  # when the newest contact will be too old
            else:
                wait = min(1.0, self.fence_s / 4)  # not registered yet, or cut off
            await asyncio.sleep(max(wait, 0.05))

    def _fence(self, age: float) -> None:
        message = (
            f"worker {self.node_id} was cut off from its LM for {age:.1f} s "
            f"(worker_fence_s {self.fence_s:g}): killed, as the LM runs it elsewhere"
        )
        doomed = [e for e in self._running.values() if e.kill_state is None]
        for entry in doomed:
            self._kill(entry, LOST, message)
        for task in self._next.values():  # never to start: the LM runs them elsewhere
            task.timestamps.finished_unix_nanos = time.time_ns()
            self._send(task, LOST, message=message)
        self._next.clear()
        if doomed:
            self.fenced += len(doomed)
            log.warning(
                "cut off from the LM: killed the tasks running here",
                extra={"node_id": self.node_id, "tasks": len(doomed), "seconds": round(age, 1)},
            )

    # ---------------------------------------------------------------- the tasks
    def _start(self, task: common_pb2.Task) -> None:
        task_id = task.task_id
        entry = self._running.get(task_id)
        parked = self._next.get(task_id)
        known = [e.task.attempt for e in (entry,) if e is not None]
        known += [parked.attempt] if parked is not None else []
        if task.attempt in known or (task_id, task.attempt) in self._owed:
            # A start the LM wrote again: on its worker's next stream, after the old one
            # ended during the write (a replaced or broken stream). An attempt that ended
            # here is owed its report, not a second run.
            log.info(
                "duplicate start ignored",
                extra={"node_id": self.node_id, "task_id": task_id, "attempt": task.attempt},
            )
            return
        if (task_id, task.attempt) in self._never:
            log.warning(
                "start of an attempt killed before it came ignored",
                extra={"node_id": self.node_id, "task_id": task_id, "attempt": task.attempt},
            )
            return
        if known and max(known) > task.attempt:
            log.warning(
                "start of an older attempt ignored",
                extra={"node_id": self.node_id, "task_id": task_id, "attempt": task.attempt},
            )
            return
        if entry is not None:
            # The LM ended the attempt running here (its kill may still be on its way)
            # and granted the next: that one waits until this one is gone.
            if parked is not None:  # superseded before it could start: it never ran
                task_ended = parked.timestamps
                task_ended.finished_unix_nanos = time.time_ns()
                self._send(parked, LOST, message=f"superseded by attempt {task.attempt}")
            self._next[task_id] = task
            self._kill(entry, LOST, f"superseded by attempt {task.attempt}")
            log.info(
                "next attempt waits for the older one to end",
                extra={"node_id": self.node_id, "task_id": task_id, "attempt": task.attempt},
            )
            return
        stamps = task.timestamps
        stamps.worker_received_unix_nanos = time.time_ns()
        if self._cut_off():
            # The fence would kill it at once: the LM may have taken this worker for dead
            # and queued the task's next attempt (this start waited in a slow stream).
            stamps.finished_unix_nanos = time.time_ns()
            self._send(task, LOST, message=f"worker {self.node_id} is cut off from its LM")
            return
        if self._closing:
            stamps.finished_unix_nanos = time.time_ns()
            self._send(task, LOST, message=f"worker {self.node_id} is shutting down")
            return
        try:
            executor = executor_for(task, self.default_executor, self._executors)
        except ValueError as err:
            stamps.finished_unix_nanos = time.time_ns()
            self._send(task, FAILED, exit_code=-1, message=str(err))
            log.warning("task refused", extra={"node_id": self.node_id, "task_id": task_id})
            return
        runner = asyncio.create_task(self._execute(task, executor), name=f"task {task_id}")
        self._running[task_id] = _Running(task, runner)
        runner.add_done_callback(functools.partial(self._runner_done, task_id))
        stamps.started_unix_nanos = time.time_ns()
        self._send(task, RUNNING)
        log.debug(
            "task started",
            extra={"node_id": self.node_id, "task_id": task_id, "executor": executor.name},
        )

    async def _execute(self, task: common_pb2.Task, executor: Executor) -> None:
        task_id = task.task_id
        try:
            result = await executor.run(task)
        except asyncio.CancelledError:
            entry = self._running.get(task_id)
            if entry is None or entry.kill_state is None:
                raise  # not our cancellation (the loop is going down)
            result = entry.kill_result()
        except Exception as err:  # a broken executor must still end the task visibly
            log.exception("executor crashed", extra={"node_id": self.node_id, "task_id": task_id})
            result = ExecutionResult.failed(-1, f"{executor.name} executor error: {err!r}")
        self._finish(task, result)

    def _runner_done(self, task_id: str, runner: asyncio.Task[None]) -> None:
        # A runner cancelled before its first step never enters _execute, so nothing
        # reported it: do it here.
        entry = self._running.get(task_id)
        if entry is not None and entry.runner is runner and entry.kill_state is not None:
            self._finish(entry.task, entry.kill_result())

    def _finish(self, task: common_pb2.Task, result: ExecutionResult) -> None:
        task_id = task.task_id
        entry = self._running.get(task_id)
        if entry is not None and entry.task is task:
            del self._running[task_id]
        task.timestamps.finished_unix_nanos = time.time_ns()
        self._send(task, result.state, result.exit_code, result.message, result.peak_memory_mb)
        log.debug(
            "task ended",
            extra={
                "node_id": self.node_id,
                "task_id": task_id,
                "state": common_pb2.TaskState.Name(result.state),
                "exit_code": result.exit_code,
            },
        )
        waiting = self._next.pop(task_id, None)
        if waiting is not None and task_id not in self._running:
            self._start(waiting)

    def _on_kill(self, task_id: str, attempt: int, reason: str) -> None:
        """Kill ``attempt`` of ``task_id``; another attempt of it is not touched (the
        LM may have granted the next one on this very node before the kill arrived)."""
        state = PREEMPTED if reason.lower().startswith("preempt") else FAILED
        parked = self._next.get(task_id)
        if parked is not None and parked.attempt == attempt:  # killed before it started
            del self._next[task_id]
            parked.timestamps.finished_unix_nanos = time.time_ns()
            self._send(parked, state, exit_code=-1, message=f"killed: {reason}")
            return
        entry = self._running.get(task_id)
        if entry is None or entry.task.attempt != attempt:
            log.info(
                "kill for an attempt not running here",
                extra={"node_id": self.node_id, "task_id": task_id, "attempt": attempt},
            )
            if (task_id, attempt) not in self._owed:
                # Its start went out on a stream this agent had left, or never came: said
                # (LOST), as the LM waits for its end to queue the next attempt, and
                # remembered, so that a late copy of the start is ignored.
                self._never[task_id, attempt] = None
                while len(self._never) > NEVER_KEPT:
                    del self._never[next(iter(self._never))]
                self._outbox.append(
                    local_master_pb2.TaskReport(
                        task_id=task_id, attempt=attempt, state=LOST, message="not here"
                    )
                )
                if self._wake is not None:
                    self._wake.set()
            return
        self._kill(entry, state, f"killed: {reason}" if reason else "killed")
        log.info("task killed", extra={"node_id": self.node_id, "task_id": task_id})

    def _kill(self, entry: _Running, state: common_pb2.TaskState.ValueType, message: str) -> None:
        if entry.kill_state is None:
            entry.kill_state, entry.kill_message = state, message
            entry.runner.cancel()

    def _send(
        self,
        task: common_pb2.Task,
        state: common_pb2.TaskState.ValueType,
        exit_code: int = 0,
        message: str = "",
        peak_memory_mb: int = 0,
    ) -> None:
        """Queue a report and wake the sender: state changes do not wait for the interval."""
        self._outbox.append(_report(task, state, exit_code, message, peak_memory_mb))
        if state != RUNNING:
            self._owed[task.task_id, task.attempt] = task
        if self._wake is not None:
            self._wake.set()


def _report(
    task: common_pb2.Task,
    state: common_pb2.TaskState.ValueType,
    exit_code: int = 0,
    message: str = "",
    peak_memory_mb: int = 0,
) -> local_master_pb2.TaskReport:
    # The constructor copies the timestamps: later stamps do not change a queued report.
    return local_master_pb2.TaskReport(
        task_id=task.task_id,
        state=state,
        exit_code=exit_code,
        message=message,
        timestamps=task.timestamps,
        attempt=task.attempt,
        peak_memory_mb=peak_memory_mb,
    )
