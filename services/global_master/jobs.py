"""What a GM remembers about jobs: each task's latest state, for GetJob and WatchJob.

Built from the GM's own submissions and from the lifecycle events every LM publishes,
so any GM can answer for any job it has heard of (an end whose event was lost comes from
the LM instead: ``open`` lists the tasks whose end is awaited). Bounded: past ``max_jobs``
jobs or ``max_tasks`` tasks (about 0.23 KB each), the jobs least recently heard of are
forgotten first. Task ids are global: the book knows which job each of its task ids is of
(``holder``), so that a GM refuses a second job's task with the same id.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services._proto.megha.v1 import common_pb2, global_master_pb2
from services.core.states import REQUEUED, TERMINAL

# States in which a task's end is still to come, from the LM that holds it.
_OPEN = {common_pb2.TASK_STATE_PLACED, common_pb2.TASK_STATE_RUNNING}
# States after which a task with the same id and attempt may be queued again.
_NOT_TAKEN = {common_pb2.TASK_STATE_UNSPECIFIED, common_pb2.TASK_STATE_REJECTED}
# A GM's own word on an attempt, not an LM's: queued here, or dropped here.
_NOT_LAUNCHED = _NOT_TAKEN | {common_pb2.TASK_STATE_QUEUED}
# Events a WatchJob stream may have waiting to be sent (``Watch``): about 2.5 MB of them.
WATCH_BACKLOG = 10_000
# Lifecycle order: a late, older event never overwrites a newer state of the same attempt.
_RANK = {
    common_pb2.TASK_STATE_QUEUED: 1,
    common_pb2.TASK_STATE_PLACED: 2,
    common_pb2.TASK_STATE_RUNNING: 3,
    common_pb2.TASK_STATE_LOST: 4,
    common_pb2.TASK_STATE_RETRYING: 4,
    common_pb2.TASK_STATE_PREEMPTED: 4,
    common_pb2.TASK_STATE_SUCCEEDED: 5,
    common_pb2.TASK_STATE_FAILED: 5,
    common_pb2.TASK_STATE_REJECTED: 5,
    common_pb2.TASK_STATE_CANCELLED: 5,
}


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SHORT = [bytes((n,)) for n in range(0x80)]  # a length under 128 is one byte


def _length(value: int) -> bytes:
    return _SHORT[value] if value < 0x80 else _varint(value)


def _tag(message, name: str) -> bytes:
    """The key of the length-delimited field ``name`` (wire type 2) of ``message``."""
    return _varint(message.DESCRIPTOR.fields_by_name[name].number << 3 | 2)


_TASKS_TAG = _tag(global_master_pb2.Job, "tasks")
_JOB_TAG = _tag(global_master_pb2.GetJobResponse, "job")


class Watch:
    """The events of a job one WatchJob stream has not sent yet, at most ``bound``.

    The stream sends as fast as its client reads (gRPC flow control); a client that
    reads slower than the job's tasks change state would have the GM keep every event
    of a 100,000-task job for it (three or more a task, ~250 bytes each, per watcher).
    A watch that falls ``bound`` events behind is cut instead: its events are dropped
    at once and the stream ends RESOURCE_EXHAUSTED, and the client watches again (a new
    watch starts with each task's current state, so nothing is missed: ``follow``).
    """

    __slots__ = ("_events", "_ready", "bound", "cut")

    def __init__(self, bound: int | None = None):
        self.bound = WATCH_BACKLOG if bound is None else bound
        self.cut = False
        self._events: deque[common_pb2.TaskEvent] = deque()
        self._ready = asyncio.Event()

    def put(self, event: common_pb2.TaskEvent) -> None:
        if self.cut:
            return
        if len(self._events) >= self.bound:
            self.cut = True
            self._events.clear()
        else:
            self._events.append(event)
        self._ready.set()

    def empty(self) -> bool:
        return not self._events

    async def get(self) -> common_pb2.TaskEvent | None:
        """The next event; None once the watch is cut."""
        while not self._events and not self.cut:
            self._ready.clear()
            await self._ready.wait()
        return None if self.cut else self._events.popleft()


@dataclass(eq=False)
class JobRecord:
    """A job and its tasks' latest statuses.

    Each status is kept serialized. Bytes are not tracked by the garbage collector, so a
    GM's 500,000 remembered tasks add almost nothing to its full collections (2.7 ms;
    as messages, 81.7 ms), and they take 0.20 KB a task instead of 1.09 KB (0.23 KB
    with the book's index of task ids, ``JobBook.holder``); an update parses and
    serializes one status, 3.5 instead of 2.4 us (``python scripts/jobbook_bench.py``)."""

    job_id: str
    queue: str
    owner: str = ""  # who submitted it (Task.owner), where this GM was told
    # Tasks booked QUEUED here only because they were submitted here to a queue whose
    # message this GM was not (yet) delivered (``JobBook.queued(relayed=True)``).
    relayed: set[str] | None = None
    _statuses: dict[str, bytes] = field(default_factory=dict)
    _by_state: dict[int, int] = field(default_factory=dict)  # tasks in each state
    watchers: list[Watch] = field(default_factory=list)

    @property
    def size(self) -> int:
        """How many tasks the job has (not ``__len__``: an empty record stays truthy)."""
        return len(self._statuses)

    def task_ids(self) -> Iterable[str]:
        return self._statuses.keys()

    def status(self, task_id: str) -> global_master_pb2.TaskStatus | None:
        """A copy of the task's status (None if the job has no such task)."""
        data = self._statuses.get(task_id)
        return None if data is None else global_master_pb2.TaskStatus.FromString(data)

    def statuses(self) -> list[global_master_pb2.TaskStatus]:
        parse = global_master_pb2.TaskStatus.FromString
        return [parse(data) for data in self._statuses.values()]

    def kept(self) -> list[bytes]:
        """Every task's status as kept now, serialized: the same bytes objects the record
        holds (a reference each, 8 bytes a task), to be parsed one at a time later."""
        return list(self._statuses.values())

    def store(
        self, status: global_master_pb2.TaskStatus, before: int | None, task_id: str = ""
    ) -> None:
        """Keep ``status`` as its task's latest; ``before`` is the state it replaces (None
        for a task new to the job). ``task_id``, when given, is the string a new task is
        kept by (the book's index of task ids then shares it)."""
        if before != status.state:
            if before is not None:
                left = self._by_state[before] - 1
                if left:
                    self._by_state[before] = left
                else:
                    del self._by_state[before]
            self._by_state[status.state] = self._by_state.get(status.state, 0) + 1
        self._statuses[task_id or status.task_id] = status.SerializeToString()

    def counts(self) -> dict[int, int]:
        """How many of its tasks are in each state (states with none left out)."""
        return dict(self._by_state)

    @property
    def unfinished(self) -> int:
        """How many of its tasks have not ended."""
        return sum(n for state, n in self._by_state.items() if state not in TERMINAL)

    @property
    def done(self) -> bool:
        return bool(self._statuses) and self.unfinished == 0

    def serialized(self) -> bytes:
        """The job as a serialized ``Job``, written from the kept statuses' bytes: a
        repeated message field is its elements, each tagged and length-prefixed, so no
        status is parsed. A 100,000-task job's GetJob held its GM's loop 0.4 s, parsing
        every status into the message; written so and parsed at once, 0.1 s."""
        head = global_master_pb2.Job(job_id=self.job_id, queue=self.queue).SerializeToString()
        tag, kept = _TASKS_TAG, self._statuses.values()
        return head + b"".join([tag + _length(len(data)) + data for data in kept])

    def to_proto(self) -> global_master_pb2.Job:
        return global_master_pb2.Job.FromString(self.serialized())

    def response(self) -> global_master_pb2.GetJobResponse:
        """GetJob's answer, parsed once from ``serialized`` (not a copy of ``to_proto``)."""
        job = self.serialized()
        return global_master_pb2.GetJobResponse.FromString(_JOB_TAG + _length(len(job)) + job)

    def summary(self) -> global_master_pb2.JobSummary:
        states = [
            global_master_pb2.StateCount(state=state, tasks=tasks)
            for state, tasks in sorted(self._by_state.items())
        ]
        return global_master_pb2.JobSummary(
            job_id=self.job_id, queue=self.queue, tasks=self.size, states=states
        )


class JobBook:
    def __init__(self, max_jobs: int = 100_000, max_tasks: int = 500_000):
        self.max_jobs = max_jobs
        self.max_tasks = max_tasks
        self.jobs: OrderedDict[str, JobRecord] = OrderedDict()  # least recently heard first
        self.task_count = 0
        # Tasks placed or running, by (job id, task id): their ends are awaited. Each
        # status is as of the task's last event (lm, node, attempt).
        self.open: dict[tuple[str, str], global_master_pb2.TaskStatus] = {}
        # The job each task id was first heard of with (``holder``).
        self._job_of: dict[str, str] = {}
        # Tasks relayed from here (``queued(relayed=True)``) by (job id, task id), with
        # when they were last asked about (monotonic s), oldest first: ``relayed_unheard``.
        self._relayed: OrderedDict[tuple[str, str], float] = OrderedDict()

    def get(self, job_id: str) -> JobRecord | None:
        return self.jobs.get(job_id)

    def newest(
        self,
        limit: int,
        queue: str = "",
        unfinished_only: bool = False,
        visible: Callable[[str], bool] | None = None,
    ) -> list[JobRecord]:
        """Up to ``limit`` jobs, the most recently heard of first (only of the queues
        ``visible`` admits, when given); scans only as far as it must."""
        found: list[JobRecord] = []
        for job in reversed(self.jobs.values()):
            if len(found) >= limit:
                break
            if (queue and job.queue != queue) or (unfinished_only and job.done):
                continue
            if visible is not None and not visible(job.queue):
                continue
            found.append(job)
        return found

    def record(self, job_id: str, queue: str) -> JobRecord:
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = JobRecord(job_id, queue)
            self._trim(job)
        else:
            self.jobs.move_to_end(job_id)
        return job

    def _counted(self, job: JobRecord, task_id: str) -> None:
        """One more task, ``task_id`` of ``job``, is about to be recorded."""
        self.task_count += 1
        if self.task_count > self.max_tasks:
            self._trim(job)
        self._job_of.setdefault(task_id, job.job_id)

    def holder(self, task_id: str, job_id: str) -> str | None:
        """The job other than ``job_id`` this book knows ``task_id`` of, if any: task ids
        are global, and an LM takes a second job's task for the first's."""
        holder = self._job_of.get(task_id)
        return holder if holder is not None and holder != job_id else None

    def _trim(self, keep: JobRecord) -> None:
        """Forget the jobs least recently heard of, never ``keep``, until within bounds."""
        while len(self.jobs) > self.max_jobs or self.task_count > self.max_tasks:
            gone = next(iter(self.jobs.values()))
            if gone is keep:
                return
            del self.jobs[gone.job_id]
            self.task_count -= gone.size
            for task_id in gone.task_ids():
                self.open.pop((gone.job_id, task_id), None)
                if self._job_of.get(task_id) == gone.job_id:
                    del self._job_of[task_id]

    def queued(self, task: common_pb2.Task, relayed: bool = False) -> None:
        """``task`` is queued: held here (its message delivered here, or scheduled from
        memory), or, ``relayed``, only sent to its queue from here, for whichever GM the
        broker delivers it to (with queue failover, maybe this one later: ``taken``)."""
        job = self.record(task.job_id, task.queue)
        if task.owner and not job.owner:
            job.owner = task.owner
        task_id = task.task_id
        if relayed:
            if job.relayed is None:
                job.relayed = set()
            job.relayed.add(task_id)
            self._relayed[(task.job_id, task_id)] = time.monotonic()
            self._relayed.move_to_end((task.job_id, task_id))
        elif job.relayed is not None:
            job.relayed.discard(task_id)
        # A task rejected before (its job's first message was refused) is queued again;
        # a preempted or lost one comes back as its next attempt.
        status = job.status(task_id)
        if not _holds(status, task):
            if status is None:
                self._counted(job, task_id)
            queued = global_master_pb2.TaskStatus(
                task_id=task.task_id,
                state=common_pb2.TASK_STATE_QUEUED,
                timestamps=task.timestamps,
                attempt=task.attempt,
                predicted_lifetime_s=task.predicted_lifetime_s,
            )
            if status is not None:
                _carry_previous_end(status, queued, job)
                queued.earlier_attempts.extend(status.earlier_attempts)
                _remember_node(queued, status.attempt, status.lm_id, status.node_id)
            job.store(queued, None if status is None else status.state, task_id)
            self.open.pop((job.job_id, task.task_id), None)

    def apply(self, event: common_pb2.TaskEvent) -> None:
        job = self.record(event.job_id, event.queue)
        task_id = event.task_id
        status = job.status(task_id)
        before = None if status is None else status.state
        if status is None:
            self._counted(job, task_id)
            status = global_master_pb2.TaskStatus(task_id=event.task_id)
        newer_attempt = event.attempt > status.attempt
        same_attempt_later = event.attempt == status.attempt and _RANK.get(
            event.state, 0
        ) >= _RANK.get(status.state, 0)
        if not (newer_attempt or same_attempt_later or status.state == 0):
            # An earlier attempt's event, after a later attempt was heard of.
            remembered = _remember_node(status, event.attempt, event.lm_id, event.node_id)
            if event.state in REQUEUED and event.attempt + 1 == status.attempt:
                # The previous attempt's end.
                status.previous_end.CopyFrom(event)
                job.store(status, before)
                for watcher in job.watchers:
                    watcher.put(event)
            elif remembered:
                job.store(status, before)
            return
        if newer_attempt:
            _carry_previous_end(status, status, job, event.attempt)
            _remember_node(status, status.attempt, status.lm_id, status.node_id, event.attempt)
        status.state = event.state
        status.lm_id = event.lm_id
        status.node_id = event.node_id
        status.attempt = event.attempt
        status.timestamps.CopyFrom(event.timestamps)
        status.pending_reason = event.reason if event.state != common_pb2.TASK_STATE_RUNNING else ""
        status.peak_memory_mb = event.peak_memory_mb
        job.store(status, before, task_id)
        if event.state in _OPEN:
            self.open[job.job_id, task_id] = status
        else:
            self.open.pop((job.job_id, task_id), None)
        for watcher in job.watchers:
            watcher.put(event)

    def accepted(self, task: common_pb2.Task, lm_id: str) -> None:
        """An LM accepted ``task``: PLACED there, unless an event already told as much
        or more. Should every event of the task be lost (a broker restart while it ran),
        the book still names the LM to ask how it ended (``GlobalMaster._recover_lost_ends``);
        shown QUEUED, with no LM, it would stay so for ever."""
        job = self.jobs.get(task.job_id)
        status = job.status(task.task_id) if job is not None else None
        if status is not None and (
            status.attempt > task.attempt
            or (status.attempt == task.attempt and status.state != common_pb2.TASK_STATE_QUEUED)
        ):
            return
        self.apply(
            common_pb2.TaskEvent(
                task_id=task.task_id,
                job_id=task.job_id,
                queue=task.queue,
                state=common_pb2.TASK_STATE_PLACED,
                lm_id=lm_id,
                attempt=task.attempt,
                timestamps=task.timestamps,
            )
        )

    def relayed_unheard(self, older_than_s: float, limit: int, now: float) -> list[tuple[str, str]]:
        """Up to ``limit`` tasks relayed from here, still waiting as far as this GM heard
        (queued, or an attempt ended and the next one not heard of: preempted, lost,
        retrying), ``older_than_s`` after they were relayed or last returned by this:
        (job id, task id), oldest first. Each returned is due again only ``older_than_s``
        later. The events of a relayed task come from whichever GM serves its queue,
        through the broker: a subscription that missed them (a broker node's death) would
        leave this GM's watchers of it waiting for ever, or showing a preempted attempt
        as the task's last word."""
        due: list[tuple[str, str]] = []
        for key, at in list(self._relayed.items()):
            if len(due) >= limit or now - at < older_than_s:
                break
            job = self.jobs.get(key[0])
            status = None if job is None else job.status(key[1])
            if status is None or not _waiting(status.state):
                # Heard of placed, running or ended (or forgotten): nothing to ask. A lost
                # end of one placed or running is found from the LMs' books
                # (``GlobalMaster._recover_lost_ends``, by ``open``).
                del self._relayed[key]
                continue
            due.append(key)
            self._relayed[key] = now
            self._relayed.move_to_end(key)
        return due

    def taken(
        self, job_id: str, tasks: Iterable[common_pb2.Task], relayed: bool = True
    ) -> set[str]:
        """The ids of ``tasks`` this GM already knows as queued, placed, running or ended,
        at their attempt or a later one: queueing them again would run them twice. A
        task never heard of, or rejected (e.g. dropped when the broker refused its job),
        is not taken: a retry queues it. Without ``relayed``, a task only relayed from
        here and still QUEUED is not taken either: its message, delivered here, is the
        one that queues it (queue failover: this GM took its queue over)."""
        job = self.jobs.get(job_id)
        if job is None:
            return set()
        found = {task.task_id for task in tasks if _holds(job.status(task.task_id), task)}
        if not relayed and job.relayed:
            found -= {
                task_id
                for task_id in found & job.relayed
                if job.status(task_id).state == common_pb2.TASK_STATE_QUEUED
            }
        return found

    def launched(self, task: common_pb2.Task) -> bool:
        """Whether events told this GM that an LM took ``task``'s attempt (placed,
        running or ended) or that a later attempt exists: the attempt is not this GM's to
        place again, whatever a fence that went unanswered says."""
        job = self.jobs.get(task.job_id)
        status = job.status(task.task_id) if job is not None else None
        return _launched(status, task)

    def set_reason(self, job_id: str, task_id: str, reason: str) -> None:
        job = self.jobs.get(job_id)
        status = job.status(task_id) if job is not None else None
        if status is not None and status.pending_reason != reason:
            status.pending_reason = reason
            job.store(status, before=status.state)


def status_event(job: JobRecord, status: global_master_pb2.TaskStatus) -> common_pb2.TaskEvent:
    """The event that left the task in ``status`` (as a watch replays it)."""
    return common_pb2.TaskEvent(
        task_id=status.task_id,
        job_id=job.job_id,
        queue=job.queue,
        state=status.state,
        lm_id=status.lm_id,
        node_id=status.node_id,
        reason=status.pending_reason,
        timestamps=status.timestamps,
        attempt=status.attempt,
        peak_memory_mb=status.peak_memory_mb,
    )


def _carry_previous_end(
    old: global_master_pb2.TaskStatus,
    new: global_master_pb2.TaskStatus,
    job: JobRecord,
    attempt: int | None = None,
) -> None:
    """``new`` (of attempt ``attempt``, default its own) follows ``old``: keep how the
    attempt just before it ended, if ``old`` is that end, else drop what ``new`` kept."""
    attempt = new.attempt if attempt is None else attempt
    if old.state in REQUEUED and old.attempt + 1 == attempt:
        new.previous_end.CopyFrom(status_event(job, old))
    elif old.HasField("previous_end") and old.previous_end.attempt + 1 == attempt:
        if new is not old:
            new.previous_end.CopyFrom(old.previous_end)
    else:
        new.ClearField("previous_end")


EARLIER_KEPT = 32  # attempts' nodes a task's status keeps (TaskStatus.earlier_attempts)


def _remember_node(
    status: global_master_pb2.TaskStatus,
    attempt: int,
    lm_id: str,
    node_id: str,
    current: int | None = None,
) -> bool:
    """Note in ``status.earlier_attempts`` where ``attempt`` ran, if it is before the
    current attempt (``current``, default the status's own) and ran on a node; whether
    it did."""
    current = status.attempt if current is None else current
    earlier = status.earlier_attempts
    if not node_id or attempt >= current or any(e.attempt == attempt for e in earlier):
        return False
    earlier.add(attempt=attempt, lm_id=lm_id, node_id=node_id)
    if len(earlier) > EARLIER_KEPT:
        del earlier[min(range(len(earlier)), key=lambda i: earlier[i].attempt)]
    return True


def _launched(status: global_master_pb2.TaskStatus | None, task: common_pb2.Task) -> bool:
    """Whether ``status`` shows ``task``'s attempt taken by an LM, or a later attempt."""
    if status is None or status.attempt < task.attempt:
        return False
    return status.attempt > task.attempt or status.state not in _NOT_LAUNCHED


def _holds(status: global_master_pb2.TaskStatus | None, task: common_pb2.Task) -> bool:
    """Whether a task whose status is ``status`` is queued, placed, running or ended at
    ``task``'s attempt or a later one (not rejected, not an earlier attempt)."""
    return status is not None and status.state not in _NOT_TAKEN and status.attempt >= task.attempt


def _waiting(state: int) -> bool:
    """Whether a task in ``state`` waits for an attempt to be placed: queued, or its
    last attempt ended and it is queued again (``REQUEUED``)."""
    return state == common_pb2.TASK_STATE_QUEUED or state in REQUEUED
