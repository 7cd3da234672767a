"""A small client for the GM's gRPC API (what ``megha submit/job/status`` and the load
generator use). Any GM accepts any job; jobs go to the queue's own GM via the broker."""

from __future__ import annotations

import asyncio
import functools
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from services._proto.megha.v1 import common_pb2, global_master_pb2, global_master_pb2_grpc
from services.common.convert import resources_to_proto
from services.common.gate import IN_FLIGHT, Gate
from services.common.request_stream import NotSent, Submitter, rpc_error
from services.common.server import channel
from services.core.states import TERMINAL
from services.core.throttle import WINDOW_S, AdaptiveThrottle

# Errors after which GlobalMasterClient.follow watches again (NOT_FOUND too, for a job
# it knows exists: a GM that restarted learns of it shortly). RESOURCE_EXHAUSTED: a GM
# too busy for the call now.
FOLLOW_AGAIN = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FOLLOW_PAUSE_S, FOLLOW_PAUSE_MAX_S = 0.2, 2.0
# A GM whose intake is full refuses a job with RESOURCE_EXHAUSTED before queuing any of
# it, and its message asks the client to retry after a pause of BUSY_PAUSE_S, doubling up
# to BUSY_PAUSE_MAX_S (the GM quotes these). ``submit(busy_tries=...)`` does so: 8 tries
# wait about 16 s in all (up to 24 s while its throttle holds tries back), after which the
# refusal is the caller's to report.
BUSY_PAUSE_S, BUSY_PAUSE_MAX_S, BUSY_TRIES = 0.1, 5.0, 8
# A GM that answers UNAVAILABLE (cut off from its broker, no LM heard from yet, a confirm
# lost) or whose answer did not come in time (DEADLINE_EXCEEDED) may or may not have
# queued the job. Asked again under the same job id it queues only what it does not know
# as taken, so a client that keeps the id may try again: ``submit(unsure_for_s=...)`` does
# so after pauses doubling as the busy ones, for up to this long (an outage of a few
# seconds, a GM restarting or its broker node failing over, then costs a wait, not the job).
OUTAGE_S = 30.0
SUBMIT_TIMEOUT_S = 30.0  # the most a try waits for its answer
ANSWER_S = 1.0  # a GM answers every submission within this (issue 32)
# Failures that say nothing of whether the GM took the try (it is away, the call was
# cancelled, or no answer came): not counted by a client's throttle (``AdaptiveThrottle``).
# Any other answer, a bad request's too, is the GM taking the try.
NOT_COUNTED = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


def busy_pauses(tries: int = BUSY_TRIES) -> list[float]:
    """The pauses before each retry of a job a busy GM refused: 0.1, 0.2, 0.4 ... 5 s."""
    return [min(BUSY_PAUSE_MAX_S, BUSY_PAUSE_S * 2**n) for n in range(tries)]


@functools.cache
def _pauses(tries: int) -> tuple[float, ...]:
    """``busy_pauses``, made once per count: every job a client submits asks for them."""
    return tuple(busy_pauses(tries))


@functools.cache
def _turn_bound_s(busy_tries: int) -> float:
    """How long a job may wait its turn at its client's gate: as long as its tries could
    take in all (their pauses, each answered within ANSWER_S), or, without busy tries,
    as long as a try waits for its answer."""
    pauses = _pauses(busy_tries)
    return sum(pauses) + ANSWER_S * len(pauses) if pauses else SUBMIT_TIMEOUT_S


def unreached(err: grpc.aio.AioRpcError) -> bool:
    """Whether the call reached no GM at all (none listens at the address)."""
    return err.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (
        err.details() or ""
    )


def unsure(err: grpc.aio.AioRpcError) -> bool:
    """Whether a failed submission may have been queued, by a GM that is there: its
    UNAVAILABLE answer or no answer in time, not a GM that none could connect to."""
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    return err.code() == grpc.StatusCode.UNAVAILABLE and not unreached(err)


class OutageWait:
    """The pauses before a job is asked again after answers that leave unknown whether it
    was queued (``unsure``; ``OUTAGE_S``): ``BUSY_PAUSE_S`` doubling to
    ``BUSY_PAUSE_MAX_S``, each ``jittered``, for up to ``for_s`` from the first."""

    def __init__(self, for_s: float = OUTAGE_S) -> None:
        self.for_s = for_s
        self._next = BUSY_PAUSE_S
        self._until: float | None = None

    def pause(self, now: float) -> float | None:
        """The next pause, or None once it would end past the bound."""
        if self._until is None:
            self._until = now + self.for_s
        pause = jittered(self._next)
        if now + pause > self._until:
            return None
        self._next = min(BUSY_PAUSE_MAX_S, 2 * self._next)
        return pause


def new_job_id() -> str:
    """A job id as a GM makes one for a job that names none (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def jittered(pause: float, rng: random.Random | None = None) -> float:
    """``pause`` spread over [0.5, 1.5) of itself: the jobs a GM refused in one burst do
    not all come back at the same instant ("equal jitter", as AWS's backoff guidance)."""
    return pause * (0.5 + (rng or _JITTER).random())


_JITTER = random.Random()


def throttled_error(requests: int, accepts: int) -> grpc.aio.AioRpcError:
    """The refusal a client gives itself for a try it kept back (``AdaptiveThrottle``):
    the same code as a GM's, so callers handle both alike."""
    return rpc_error(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"not sent: of this client's last {requests} tries within {WINDOW_S:g} s the GM "
        f"took {accepts} and refused the rest as too busy, so this client holds some "
        "back (client-side throttling); retry it in a moment",
    )


def not_admitted_error(waited_s: float, in_flight: int) -> grpc.aio.AioRpcError:
    """The refusal a client gives itself for a job whose turn at its gate (``Gate``) did
    not come in time: the same code as a GM's, so callers handle both alike."""
    return rpc_error(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"not sent: waited {waited_s:.1f} s behind this client's {in_flight} jobs in flight "
        "(the GM takes fewer than it is offered); retry it later",
    )


class FollowStalled(RuntimeError):
    """A GM keeps ending the watch of a job whose tasks it does not all know ended."""


STATE_NAMES = {
    v.number: v.name.removeprefix("TASK_STATE_").lower()
    for v in common_pb2.TaskState.DESCRIPTOR.values
}


@dataclass(frozen=True)
class TaskTemplate:
    """What ``megha submit`` builds N identical tasks from."""

    resources: Sequence[int]
    duration_s: float = 1.0
    command: Sequence[str] = ()
    image: str = ""
    timeout_s: float = 0.0
    constraints: Sequence[int] = ()
    retries: int = 0
    env: Mapping[str, str] = field(default_factory=dict)  # a process's or container's
    priority: int = 0  # within its queue, higher goes first

    def build(self) -> common_pb2.Task:
        task = common_pb2.Task(
            resources=resources_to_proto(self.resources),
            constraints=list(self.constraints),
            expected_duration_s=self.duration_s,
            max_retries=self.retries,
            priority=self.priority,
        )
        if self.image:
            task.docker.image = self.image
            task.docker.args.extend(self.command)
            task.docker.timeout_s = self.timeout_s
            task.docker.env.update(self.env)
        elif self.command:
            task.process.args.extend(self.command)
            task.process.timeout_s = self.timeout_s
            task.process.env.update(self.env)
        else:
            task.sim.duration_s = self.duration_s
        return task


class GlobalMasterClient:
    """``streaming=True`` sends jobs over one ``SubmitStream`` instead of a ``SubmitJob``
    call each: the same answers and errors, for about 60 % of the round trip and 70 % of
    the CPU (``megha bench hops``)."""

    def __init__(self, target: str, streaming: bool = False):
        self.target = target
        self._channel = channel(target)
        self.stub = global_master_pb2_grpc.GlobalMasterStub(self._channel)
        self._submitter = Submitter(self.stub) if streaming else None
        # Submissions a GM keeps refusing as too busy are partly kept back here, answered
        # at once as refused (``AdaptiveThrottle``); ``throttled`` counts them.
        self.throttle = AdaptiveThrottle()
        self.throttled = 0
        # Tries a streaming client did not send within ``SEND_WITHIN_S`` (``NotSent``).
        self.unsent = 0
        # At most IN_FLIGHT jobs try at once; the rest wait their turn (``Gate``), and
        # those whose turn did not come within their bound are refused unsent (counted).
        self.gate = Gate(IN_FLIGHT)
        self.not_admitted = 0
        self._refused_at_once: grpc.aio.AioRpcError | None = None  # ``refused_unsent``

    async def __aenter__(self) -> GlobalMasterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._submitter is not None:
            await self._submitter.close()
        await self._channel.close()

    def refused_unsent(self, busy_tries: int = 0) -> grpc.aio.AioRpcError | None:
        """The refusal ``submit`` would give at once, unsent, to a job offered now with
        ``busy_tries`` (its turn at the gate could not come within its bound:
        ``Gate.refuses``), counted in ``not_admitted``; None when the job would go or wait
        its turn. A caller offering jobs faster than its GMs take them asks first: a job
        refused here costs it no call and no coroutine (at 20,000 one-task jobs a second
        offered, most of the load generator's work). The same error each time."""
        if not self.gate.refuses(_turn_bound_s(busy_tries)):
            return None
        self.not_admitted += 1
        if self._refused_at_once is None:
            self._refused_at_once = not_admitted_error(0.0, self.gate.limit)
        return self._refused_at_once

    async def submit(
        self,
        tasks: Sequence[common_pb2.Task],
        queue: str = "",
        job_id: str = "",
        busy_tries: int = 0,
        on_busy: Callable[[float], None] | None = None,
        gang: bool = False,
        min_tasks: int = 0,
        vdc: common_pb2.Vdc | None = None,
        on_answer: Callable[[float], None] | None = None,
        unsure_for_s: float = 0.0,
        on_unsure: Callable[[grpc.aio.AioRpcError, str, float], None] | None = None,
        on_turn: Callable[[float, bool], None] | None = None,
    ) -> global_master_pb2.SubmitJobResponse:
        """Queue a job (``gang``: all its tasks start together, or ``min_tasks`` of
        them; SubmitJobRequest.gang; ``vdc``: a gang that is a Gridiron VDC). A GM too
        busy to take it (RESOURCE_EXHAUSTED: nothing of it was queued) is asked again up
        to ``busy_tries`` times after the pauses it asks for (``busy_pauses``, each
        ``jittered``), each announced to ``on_busy``; then its refusal is raised. A try
        this client's throttle keeps back (``AdaptiveThrottle``: the GM refused most of
        its recent tries) is refused here at once, without a message, and counted in
        ``throttled``. On a stream, a try not sent within ``SEND_WITHIN_S`` (the GM reads
        slower than this client asks: ``NotSent``) waits and asks again as a kept-back
        one, counted in ``unsent``. ``on_answer`` is told how long each try sent waited
        for its answer (seconds), whatever the answer. With ``unsure_for_s``, an answer that leaves
        unknown whether the job was queued (``unsure``) is asked again under the same job
        id (one made here if none is given, ``new_job_id``) after pauses as the busy ones,
        for up to that long, each announced to ``on_unsure`` (the error, the job id, the
        pause). A job waits its turn behind the client's other jobs in flight first
        (``Gate``), at most as long as its tries could take (with no busy tries, as long
        as a try waits for its answer); ``on_turn`` is told how long it waited and whether
        its turn came (it is refused unsent, ``not_admitted``, if not)."""
        if unsure_for_s > 0 and not job_id:
            job_id = new_job_id()  # kept by every try: a GM runs the job once
        pauses = _pauses(busy_tries)
        # A try kept back is no try: the job waits as after a refusal and asks again, for
        # at most as long as its busy tries would take in all (without busy tries it
        # does not ask again).
        give_up = time.monotonic() + _turn_bound_s(busy_tries)
        refused = waited = 0  # tries the GM refused; pauses taken (the backoff's step)
        outage = OutageWait(unsure_for_s)

        def held_back() -> bool:
            """A try not sent (kept back, or not sent in time): counted as one the GM did
            not take; whether the job gives up now."""
            self.throttle.record(time.monotonic(), accepted=False)
            return not pauses or time.monotonic() >= give_up

        waited_from = time.monotonic()
        admitted = await self.gate.enter(_turn_bound_s(busy_tries))
        turn_s = time.monotonic() - waited_from
        if on_turn is not None:
            on_turn(turn_s, admitted)
        if not admitted:
            self.not_admitted += 1
            raise not_admitted_error(turn_s, self.gate.limit)
        try:
            # Built once, past the gate: each try only stamps its own time (the tasks are
            # copies made here).
            request = global_master_pb2.SubmitJobRequest(
                job_id=job_id, queue=queue, gang=gang, min_tasks=min_tasks, vdc=vdc
            )
            request.tasks.extend(tasks)
            unstamped = [t for t in request.tasks if not t.timestamps.submitted_unix_nanos]
            while True:
                if self.throttle.allow(time.monotonic(), _JITTER.random()):
                    began = time.perf_counter()
                    now = time.time_ns()
                    for task in unstamped:
                        task.timestamps.submitted_unix_nanos = now
                    sent = True
                    try:
                        reply = await self._submit_once(request)
                    except NotSent:
                        # Not sent in time: the GM reads slower than this client asks. Waited
                        # out as a kept-back try (the throttle then keeps more back).
                        sent = False
                        self.unsent += 1
                        if held_back():
                            raise
                    except grpc.aio.AioRpcError as err:
                        busy = err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        if busy or err.code() not in NOT_COUNTED:
                            self.throttle.record(time.monotonic(), accepted=not busy)
                        if not busy and unsure_for_s > 0 and unsure(err):
                            pause = outage.pause(time.monotonic())
                            if pause is not None:
                                if on_unsure is not None:
                                    on_unsure(err, job_id, pause)
                                await asyncio.sleep(pause)
                                continue
                        if not busy or refused == len(pauses):
                            raise
                        refused += 1
                    else:
                        self.throttle.record(time.monotonic(), accepted=True)
                        return reply
                    finally:
                        if on_answer is not None and sent:
                            on_answer(time.perf_counter() - began)
                else:
                    self.throttled += 1
                    if held_back():
                        raise throttled_error(*self.throttle.counts(time.monotonic()))
                pause = jittered(pauses[min(waited, len(pauses) - 1)])
                waited += 1
                if on_busy is not None:
                    on_busy(pause)
                await asyncio.sleep(pause)
        finally:
            self.gate.leave()

    async def _submit_once(
        self, request: global_master_pb2.SubmitJobRequest
    ) -> global_master_pb2.SubmitJobResponse:
        if self._submitter is not None:
            return await self._submitter.request(request, timeout=SUBMIT_TIMEOUT_S)
        return await self.stub.SubmitJob(request, timeout=SUBMIT_TIMEOUT_S)

    async def job(self, job_id: str) -> global_master_pb2.Job:
        reply = await self.stub.GetJob(global_master_pb2.GetJobRequest(job_id=job_id), timeout=10)
        return reply.job

    async def jobs(
        self, queue: str = "", limit: int = 0, unfinished_only: bool = False
    ) -> list[global_master_pb2.JobSummary]:
        request = global_master_pb2.ListJobsRequest(
            queue=queue, limit=limit, unfinished_only=unfinished_only
        )
        return list((await self.stub.ListJobs(request, timeout=10)).jobs)

    async def output(
        self,
        job_id: str,
        task_id: str,
        attempt: int | None = None,
        stderr: bool = False,
        offset: int = 0,
        limit: int = 0,
    ) -> common_pb2.GetTaskOutputResponse:
        """Part of what a task attempt (None: its latest) wrote to stdout or stderr, read
        from its worker host; ``offset`` < 0 counts from the end."""
        request = common_pb2.GetTaskOutputRequest(
            job_id=job_id,
            task_id=task_id,
            attempt=attempt or 0,
            latest_attempt=attempt is None,
            stderr=stderr,
            offset=offset,
            limit=limit,
        )
        return await self.stub.GetTaskOutput(request, timeout=15)

    async def cancel(self, job_id: str, reason: str = "") -> global_master_pb2.CancelJobResponse:
        request = global_master_pb2.CancelJobRequest(job_id=job_id, reason=reason)
        return await self.stub.CancelJob(request, timeout=10)

    async def watch(self, job_id: str) -> AsyncIterator[common_pb2.TaskEvent]:
        call = self.stub.WatchJob(global_master_pb2.WatchJobRequest(job_id=job_id))
        async for reply in call:
            yield reply.event

    async def follow(
        self,
        job_id: str,
        task_ids: Iterable[str] = (),
        give_up_s: float = 60.0,
        fallbacks: Sequence[GlobalMasterClient] = (),
    ) -> AsyncIterator[common_pb2.TaskEvent]:
        """``watch`` that outlives the GM: when the stream breaks (the GM restarted, the
        network blinked) it watches again, through the next of ``fallbacks`` if any,
        until every task of ``task_ids`` has ended (without them: until the GM ends the
        watch, which it does once every task it knows of has ended). A GM that does not
        know the job (yet: it restarted) is asked again. A new watch first replays each
        task's current state: what was yielded already is not yielded again (a second
        SUCCEEDED of a task that ran twice still is: its stamps differ).

        Raises the last error once ``give_up_s`` pass without a GM answering, and
        ``FollowStalled`` once they pass with GMs ending the watch while some of
        ``task_ids`` have not ended.
        """
        expected = set(task_ids)
        clients = [self, *fallbacks]
        seen: dict[str, set[tuple]] = {}  # task -> what was yielded of it
        ended: set[str] = set()
        pause, since, turn = FOLLOW_PAUSE_S, time.monotonic(), 0
        while True:
            try:
                async for event in clients[turn % len(clients)].watch(job_id):
                    stamps = event.timestamps.SerializeToString(deterministic=True)
                    key = (event.attempt, event.state, event.node_id, stamps)
                    yielded = seen.setdefault(event.task_id, set())
                    if key not in yielded:
                        yielded.add(key)
                        pause, since = FOLLOW_PAUSE_S, time.monotonic()
                        if event.state in TERMINAL:
                            ended.add(event.task_id)
                        yield event
                        if expected and expected <= ended:
                            return
                if expected <= ended:
                    return
                if time.monotonic() - since > give_up_s:
                    missing = sorted(expected - ended)
                    raise FollowStalled(
                        f"job {job_id}: the GM says it is done, but {len(missing)} of its "
                        f"tasks never ended there, e.g. {missing[:3]}"
                    )
                turn += 1  # another GM may know more
            except grpc.aio.AioRpcError as err:
                known = bool(expected or seen)  # a job id never heard of fails at once
                again = err.code() in FOLLOW_AGAIN or (
                    known and err.code() == grpc.StatusCode.NOT_FOUND
                )
                if not again or time.monotonic() - since > give_up_s:
                    raise
                turn += 1
            await asyncio.sleep(pause)
            pause = min(FOLLOW_PAUSE_MAX_S, pause * 2)

    async def cluster(
        self,
        pending_shapes: bool = False,
        timeout_s: float = 10.0,
        allocation_samples: bool = False,
    ) -> global_master_pb2.GetClusterViewResponse:
        request = global_master_pb2.GetClusterViewRequest(
            pending_shapes=pending_shapes, allocation_samples=allocation_samples
        )
        return await self.stub.GetClusterView(request, timeout=timeout_s)

    async def plan(
        self,
        tasks: Sequence[common_pb2.Task],
        queue: str = "",
        gang: bool = False,
        min_tasks: int = 0,
        vdc: common_pb2.Vdc | None = None,
    ) -> global_master_pb2.PlanJobResponse:
        """Where each task would go now, or why not; nothing is queued (``PlanJob``).
        ``gang``/``min_tasks``/``vdc``: judged whole, as ``submit`` would queue it."""
        request = global_master_pb2.PlanJobRequest(
            queue=queue, tasks=tasks, gang=gang, min_tasks=min_tasks, vdc=vdc
        )
        return await self.stub.PlanJob(request, timeout=10)
