"""A simulated Local Master: ``services/local_master/service.py``'s driver logic over the
very ``Lifecycle`` and ``ClusterState`` the live LM runs.

    GM ──place / preempt / lookup / get_state / list_tasks──▶ Lifecycle ──▶ actions
    worker ──register (inventory) / heartbeat stream (reports)──▶ take_back / report
    actions: Start, Kill ──▶ the worker's command queue (written while a stream is open)
             Publish ──▶ events (batched to the broker) + journal + the run's recorder
             Requeue ──▶ broker.enqueue of the next attempt, retried until it is stored
             Journal ──▶ the journal's accepted rows
    timers: heartbeats (fanout), event flushes, the watchdog, the orphans' grace

A crash loses everything but the ``Journal`` (when the LM has one); the next life has a
new incarnation and empty books, and learns its nodes as the workers register again.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loadgen.chaos.kernel import Actor, Proc
from loadgen.chaos.wire import (
    EXPIRED,
    RELEASED,
    Batch,
    Beat,
    Event,
    Known,
    PlaceReply,
    PlaceRequest,
    PreemptReply,
    PreemptRequest,
    Report,
    Task,
)
from services.core import states
from services.core.cancels import CancelledJobs
from services.core.cluster_state import ClusterState, Decision
from services.core.fairness import usage_by_queue
from services.core.global_view import GlobalView
from services.core.lm_lifecycle import (
    Held,
    Journal,
    Kill,
    Lifecycle,
    Owe,
    Publish,
    ReportVerdict,
    Requeue,
    Start,
)
from services.core.resources import resources
from services.core.snapshot import Snapshot
from services.core.status import PlacementStatus

if TYPE_CHECKING:
    from loadgen.chaos.world import World

RESTART_GRACE_S = 5.0  # services.common.requeue
ENQUEUE_RETRY_S = 0.5  # EVENT_RETRY_S


class JournalFile:
    """``services/local_master/journal.py`` in memory: what survives a crash."""

    def __init__(self) -> None:
        self.ended: dict[str, int] = {}
        self.events: list[tuple[int, Event]] = []
        self.accepted: dict[str, Task] = {}
        # Re-queues not confirmed (``owe``), with when they were first queued: sent again,
        # a message keeps its tasks' ``queued_unix_nanos``.
        self.owed: dict[tuple[str, int], tuple[Task, float]] = {}
        self.stopping: dict[tuple[str, int], Task] = {}  # killed attempts (``stop``)
        self.seq = 0
        self.published = 0

    def accept(self, tasks: Iterable[Task]) -> None:
        for task in tasks:
            self.accepted[task.task_id] = task.copy()

    def stop(self, task: Task) -> None:
        self.stopping[task.task_id, task.attempt] = task.copy()

    def stopped(self, task: Task) -> None:
        self.stopping.pop((task.task_id, task.attempt), None)

    def append(self, event: Event) -> None:
        self.seq += 1
        self.ended[event.task_id] = event.attempt
        self.events.append((self.seq, event))
        row = self.accepted.get(event.task_id)
        if row is not None and row.attempt <= event.attempt:
            del self.accepted[event.task_id]

    def load(
        self,
    ) -> tuple[dict[str, int], dict[str, Event], list[Task], list[Event], list[Task]]:
        latest: dict[str, Event] = {}
        for _, event in self.events:
            latest[event.task_id] = event
        accepted = [
            t.copy() for t in self.accepted.values() if self.ended.get(t.task_id, -1) < t.attempt
        ]
        unpublished = [e for seq, e in self.events if seq > self.published]
        stopping = [t.copy() for t in self.stopping.values()]
        return dict(self.ended), latest, accepted, unpublished, stopping


@dataclass(eq=False)
class Session:
    node: int
    node_id: str
    commands: deque = field(default_factory=deque)  # ("start", Task) | ("kill", ...) | ("ack", t)
    stream: int = 0  # the stream commands are written to (0: none open)
    acked_at: float = -1e9
    newer_than: int = 0  # streams up to this one are of earlier registrations
    inbox: deque = field(default_factory=deque)  # heartbeats waiting to be handled
    busy: bool = False


class LM(Actor):
    def __init__(self, world: World, lm_id: str, journal: bool) -> None:
        super().__init__(world.k, lm_id)
        self.world = world
        self.cfg = world.cfg
        self.journal = JournalFile() if journal else None
        self._boot()

    # ------------------------------------------------------------ lifecycle
    def _boot(self) -> None:
        cfg = self.cfg
        self.state = ClusterState(
            self.name, cfg.gm_ids, incarnation=self.k.engine.now + 1 + self.life
        )
        self.cancelled = CancelledJobs()
        self.lc: Lifecycle[Task] = Lifecycle(
            self.state,
            self.cancelled,
            worker_timeout_s=cfg.worker_timeout_s,
            orphan_grace_s=cfg.worker_timeout_s + RESTART_GRACE_S,
        )
        self.sessions: dict[int, Session] = {}
        self.endings: dict[str, Event] = {}
        self.events: list[Event] = []
        self.flushing = False
        self.published_version = -1
        self.beats = 0
        self.peers = GlobalView("")
        if self.journal is not None:
            ended, latest, accepted, unpublished, stopping = self.journal.load()
            for task_id, attempt in ended.items():
                job = latest[task_id].job_id if task_id in latest else ""
                self.state.remember_ended(task_id, attempt, job)
            self.endings.update(latest)
            self.lc.recall(accepted, stopping)
            self.events.extend(unpublished)
        self.owed = {} if self.journal is None else dict(self.journal.owed)

    def start(self) -> None:
        broker = self.world.broker
        broker.subscribe("heartbeat", self, self._on_peer_heartbeat)
        self.later(0.0, self._heartbeat_loop)
        self.spawn(self._watchdog_loop())
        if self.events:
            self._events_ready()
        if self.lc.unclaimed:
            self.spawn(self._orphans_loop())
        for again, queued_at in list(self.owed.values()):
            self.spawn(self._send_owed(again, queued_at))

    def restart(self, journal_kept: bool) -> None:
        if not journal_kept:
            self.journal = None
        self.alive = True
        if self.k.tracing:
            self.k.log(self.name, f"RESTART ({'journal' if self.journal else 'no journal'})")
        self._boot()
        self.start()

    # -------------------------------------------------------------- GM RPCs
    def place_all(self, request: PlaceRequest) -> PlaceReply:
        if 0 < request.expires < self.k.now:
            late = Decision(EXPIRED, "read after it expired")
            return PlaceReply([late for _ in request.placements])
        results, rejected, accepted = [], False, []
        for task, node, repartition in request.placements:
            spec = task.spec()
            decision, actions = self.lc.place(request.gm_id, spec, node, repartition)
            if self.k.tracing:
                self.k.log(
                    self.name,
                    f"place {task.task_id}#{task.attempt} n{node} lease={task.lease} "
                    f"{decision.status.name}",
                )
            results.append(decision)
            if decision.status is PlacementStatus.ACCEPTED:
                self._apply(actions)
                accepted.append(self._start(task, decision))
            rejected |= (
                not decision.ok and decision.status is not PlacementStatus.REJECTED_CANCELLED
            )
        reply = PlaceReply(results)
        if rejected:
            reply.state = self.state.snapshot(request.known_version or None)
        self._journal_accepted(accepted)
        return reply

    def preempt(self, request: PreemptRequest) -> Proc:
        if 0 < request.expires < self.k.now:
            return PreemptReply(Decision(EXPIRED, "read after it expired"), [])
        spec = request.task.spec()
        usage, total = self.global_usage()
        fair = self.world.fair
        decision, actions = self.lc.preempt(
            request.gm_id,
            spec,
            request.node,
            request.victims,
            lambda queue: fair.is_over_share(queue, usage, total),
        )
        if self.k.tracing:
            self.k.log(
                self.name,
                f"preempt {spec.task_id}#{spec.attempt} victims={request.victims} "
                f"{decision.status.name}",
            )
        reply = PreemptReply(decision, [])
        if decision.status is PlacementStatus.ACCEPTED:
            # As the live LM: the victims' kills and this task's start, then any
            # re-queue (a broker that is away holds them back; the task must be held
            # meanwhile, or a second preemption of it re-queues nothing). A victim's
            # next attempt waits for its end (``Lifecycle.stopping``), not for this.
            requeues = [a for a in actions if isinstance(a, Requeue)]
            self._apply([a for a in actions if not isinstance(a, Requeue)])
            started = self._start(request.task, decision)
            reply.preempted = [v.task_id for v in decision.preempted]
            self._journal_accepted([started])
            yield from self._carry_out(requeues)
        if not decision.ok and decision.status is not PlacementStatus.REJECTED_CANCELLED:
            reply.state = self.state.snapshot(request.known_version or None)
        return reply

    def global_usage(self):
        peers = [v for lm_id, v in self.peers.lms.items() if lm_id != self.name]
        allocations = itertools.chain(
            self.state.allocations.values(), *(v.allocations.values() for v in peers)
        )
        total = self.state.table.capacity.sum(axis=1)
        for view in peers:
            total = total + view.table.capacity.sum(axis=1)
        return usage_by_queue(allocations), total

    def lookup(self, task_ids: list[str], fence_lease: int) -> list[Known]:
        found = self.lc.lookup(task_ids, fence_lease)
        if self.k.tracing:
            self.k.log(
                self.name,
                f"lookup lease={fence_lease} {sorted(task_ids)} -> "
                f"{[(f.task_id, f.attempt, f.running) for f in found]}",
            )
        return [Known(f.task_id, f.attempt, f.running, self.endings.get(f.task_id)) for f in found]

    def get_state(self, since: int | None) -> Snapshot:
        return self.state.snapshot(since)

    def list_tasks(self) -> list[Event]:
        out = list(self.endings.values())
        for task, state, node in self.lc.listing():
            out.append(self._event_of(task, int(state), node))
        return out

    def _on_peer_heartbeat(self, snapshot: Snapshot) -> None:
        if snapshot.lm_id != self.name:
            self.peers.apply(snapshot, self.k.now)

    # ---------------------------------------------------------- worker RPCs
    def register_worker(self, node_id: str, running: list[Task], finished: list[Task]) -> Proc:
        node = self.state.table.index_of(node_id)
        if node is None:
            node = self.state.add_node(node_id, self.world.node_capacity)
        else:
            self.state.set_alive(node, True)
        session = self.sessions.get(node)
        if session is None:
            session = self.sessions[node] = Session(node, node_id)
        # ``WorkerSession.generation``: the worker left its stream; what is sent from now
        # on waits for the stream it opens next.
        session.stream = 0
        session.newer_than = self.world.workers[node_id].link.id
        self.lc.heard(node, self.k.now)
        pending = [c[1].task_id for c in session.commands if c[0] == "start"]
        held = [Held(t.copy(), t.spec(), True) for t in running]
        held += [Held(t.copy(), t.spec(), False) for t in finished]
        plan = self.lc.take_back(node, held, pending)
        if self.k.tracing:
            self.k.log(self.name, f"register {node_id}: {[(t, v.value) for t, v in plan.verdicts]}")
        yield from self._carry_out(plan.actions)
        return node

    def stream_open(self, node_id: str, stream: int, beat: Beat) -> None:
        node = self.state.table.index_of(node_id)
        session = self.sessions.get(node) if node is not None else None
        worker = self.world.workers[node_id]
        if session is not None and stream <= session.newer_than:
            return  # of an earlier registration
        if session is None or not self.state.table.is_alive(node):
            worker.link.cut()  # "register first" / "taken for dead: register"
            self.world.net.send(worker, worker.stream_ended, stream)
            return
        if self.k.tracing:
            self.k.log(self.name, f"stream {node_id} s{stream} opens (was s{session.stream})")
        session.stream = stream
        self.on_beat(node_id, stream, beat)
        self._write(session)

    def on_beat(self, node_id: str, stream: int, beat: Beat) -> None:
        node = self.state.table.index_of(node_id)
        session = self.sessions.get(node) if node is not None else None
        if session is None or session.stream != stream:
            return
        session.inbox.append(beat)
        if not session.busy:
            self.spawn(self._read(session))

    def _read(self, session: Session) -> Proc:
        session.busy = True
        try:
            while session.inbox:
                beat = session.inbox.popleft()
                node = session.node
                if not self.state.table.is_alive(node):
                    # Taken for dead meanwhile: ending the stream makes it register again.
                    worker = self.world.workers[session.node_id]
                    worker.link.cut()
                    session.stream = 0
                    self.world.net.send(worker, worker.stream_ended, -1)
                    session.inbox.clear()
                    return
                self.lc.heard(node, self.k.now)
                for report in beat.reports:
                    yield from self._on_report(node, report)
                if beat.want_ack and self.k.now - session.acked_at >= 0.5:
                    session.acked_at = self.k.now
                    session.commands.append(("ack", beat.sent_at))
                    self._write(session)
        finally:
            session.busy = False

    def _on_report(self, node: int, report: Report) -> Proc:
        outcome = self.lc.report(node, report)
        if self.k.tracing:
            self.k.log(
                self.name,
                f"report n{node} {report.task_id}#{report.attempt} {states_name(report.state)} "
                f"-> {outcome.verdict.value}",
            )
        if outcome.task is not None:
            stamps = outcome.task.timestamps
            stamps.started_unix_nanos = report.started or stamps.started_unix_nanos
            stamps.finished_unix_nanos = report.finished or stamps.finished_unix_nanos
        if outcome.verdict is ReportVerdict.STOPPED:
            self.spawn(self._carry_out(outcome.actions))  # as the live LM: not awaited
        elif outcome.actions:
            yield from self._carry_out(outcome.actions)

    def stream_broken(self, node_id: str) -> None:
        node = self.state.table.index_of(node_id)
        session = self.sessions.get(node) if node is not None else None
        if session is not None:
            session.stream = 0

    # -------------------------------------------------------------- actions
    def _start(self, task: Task, decision: Decision) -> Task:
        assert decision.allocation is not None
        own = task.copy()
        own.timestamps.started_unix_nanos = 0
        own.timestamps.finished_unix_nanos = 0
        self._apply(self.lc.hold(own, decision.allocation))
        return own

    def _journal_accepted(self, tasks: list[Task]) -> None:
        if self.journal is not None and tasks:
            self.journal.accept(t for t in tasks if self.lc.tasks.get(t.task_id) is t)

    def _carry_out(self, actions) -> Proc:
        """``LocalMaster._carry_out``: the re-queues owed, the rest of the plan, then the
        re-queues sent."""
        actions = list(actions)
        requeues = [a for a in actions if isinstance(a, Requeue)]
        owed = [self._owe(a.task) for a in requeues]
        for action in actions:
            if not isinstance(action, Requeue):
                self._apply_one(action)
        for action, again in zip(requeues, owed, strict=True):
            if action.owed and self.journal is not None:  # owed now (``_stopped``)
                self.journal.stopped(action.task)
            if again is not None:
                yield from self._send_owed(again, self.k.now)

    def _apply(self, actions) -> None:
        for action in actions:
            self._apply_one(action)

    def _apply_one(self, action) -> None:
        if isinstance(action, Publish):
            self._event(action.task, int(action.state), action.node, action.reason)
        elif isinstance(action, Kill):
            if self._withdraw(action):
                # Never sent: the attempt never ran. Its next attempt (if it waits for
                # this one) is queued after this step, as the live LM's is.
                then = self.lc.withdrawn(action.task_id, action.attempt)
                if then:
                    self.spawn(self._carry_out(then))
                return
            self._send(action.node, ("kill", action.task_id, action.attempt, action.reason))
        elif isinstance(action, Start):
            self._send(action.node, ("start", action.task))
        elif isinstance(action, Journal):
            if self.journal is not None:
                self.journal.accept([action.task])
        elif isinstance(action, Owe):
            if self.journal is not None:
                self.journal.stop(action.task)
        else:
            raise TypeError(f"{action!r} must be carried out by _carry_out")

    def _withdraw(self, kill: Kill) -> bool:
        """Take back the start of the attempt ``kill`` names if it still waits here for
        a stream: the worker never reads it (nor the kill)."""
        session = self.sessions.get(kill.node)
        if session is None:
            return False
        for command in session.commands:
            if command[0] != "start":
                continue
            task = command[1]
            if task.task_id == kill.task_id and task.attempt == kill.attempt:
                session.commands.remove(command)
                if self.k.tracing:
                    self.k.log(self.name, f"withdrew the start of {task.task_id}#{task.attempt}")
                return True
        return False

    def _send(self, node: int, command: tuple) -> None:
        session = self.sessions.get(node)
        if session is None:
            return
        if command[0] == "kill":  # as the live LM: ahead of the starts not yet written
            commands = session.commands
            at = next((i for i, c in enumerate(commands) if c[0] != "kill"), len(commands))
            commands.insert(at, command)
        else:
            session.commands.append(command)
        self._write(session)

    def _write(self, session: Session) -> None:
        """The stream's writer: what waits goes out, in order, while a stream is open."""
        if not session.stream:
            return
        worker = self.world.workers[session.node_id]
        while session.commands:
            command = session.commands.popleft()
            worker.link.carry(
                False, session.stream, worker, worker.on_command, session.stream, command
            )

    def _owe(self, task: Task) -> Task | None:
        """``LocalMaster._owe``: the next attempt, journalled as owed; None if an earlier
        life owed it and sent it again at start."""
        if self.owed.pop((task.task_id, task.attempt + 1), None) is not None:
            return None
        again = task.next_attempt()
        if self.journal is not None:
            self.journal.owed[again.task_id, again.attempt] = (again.copy(), self.k.now)
            row = self.journal.accepted.get(again.task_id)  # ``TaskJournal.owe``
            if row is not None and row.attempt < again.attempt:
                del self.journal.accepted[again.task_id]
        return again

    def _send_owed(self, again: Task, queued_at: float) -> Proc:
        """``_enqueue_owed``."""
        body = Batch(again.job_id, again.queue, (again,), queued_at)
        while True:
            stored = yield self.world.broker.enqueue(again.queue, body)
            if stored:
                if self.k.tracing:
                    self.k.log(self.name, f"requeued {again.task_id}#{again.attempt}")
                break
            yield self.k.sleep(ENQUEUE_RETRY_S)
        if self.journal is not None:
            self.journal.owed.pop((again.task_id, again.attempt), None)

    def _event_of(self, task: Task, state: int, node: int, reason: str = "") -> Event:
        node_id = self.state.table.node_ids[node] if node >= 0 else ""
        stamps = task.timestamps
        return Event(
            task.task_id,
            task.job_id,
            task.queue,
            state,
            self.name,
            node_id,
            task.attempt,
            reason,
            stamps.started_unix_nanos,
            stamps.finished_unix_nanos,
        )

    def _event(self, task: Task, state: int, node: int, reason: str) -> None:
        event = self._event_of(task, state, node, reason)
        if self.k.tracing:
            self.k.log(
                self.name, f"event {task.task_id}#{task.attempt} {states_name(state)} {reason}"
            )
        self.world.recorded.append(event)
        self.events.append(event)
        self._events_ready()
        if state in RELEASED:
            self.endings[task.task_id] = event
            if self.journal is not None:
                self.journal.append(event)

    # ---------------------------------------------------------------- loops
    def _heartbeat_loop(self) -> None:
        cfg = self.cfg
        full = self.beats % cfg.full_state_every == 0 or self.published_version < 0
        self.beats += 1
        snapshot = self.state.snapshot(None if full else self.published_version)
        self.published_version = snapshot.version
        self.world.broker.fanout("heartbeat", snapshot)
        self.later(cfg.heartbeat_interval_s, self._heartbeat_loop)

    def _events_ready(self) -> None:
        if not self.flushing:
            self.flushing = True
            self.later(self.cfg.event_batch_s, self._flush)

    def _flush(self) -> None:
        self.flushing = False
        if not self.events:
            return
        published = self.journal.seq if self.journal is not None else 0
        if self.world.broker.fanout("events", list(self.events)):
            self.events.clear()
            if self.journal is not None:
                self.journal.published = published
        else:
            self.flushing = True
            self.later(ENQUEUE_RETRY_S, self._flush)

    def _watchdog_loop(self) -> Proc:
        timeout = self.cfg.worker_timeout_s
        while True:
            yield self.k.sleep(min(timeout / 4, 1.0))
            for node in self.lc.silent(self.k.now):
                yield from self.mark_dead(node, f"no heartbeat for {timeout:g} s")

    def mark_dead(self, node: int, reason: str) -> Proc:
        if self.k.tracing:
            self.k.log(self.name, f"node n{node} dead: {reason}")
        loss = self.lc.node_lost(node, reason)
        session = self.sessions.get(node)
        if session is not None:
            session.commands.clear()
        yield from self._carry_out(loss.actions)

    def _orphans_loop(self) -> Proc:
        due = self.lc.arm_orphans(self.k.now)
        while (now := self.k.now) < due:  # (a timer may fire a little early)
            yield self.k.sleep(max(due - now, 1e-9))
        while (actions := self.lc.expire_orphan(self.k.now)) is not None:
            yield from self._carry_out(actions)

    # ---------------------------------------------------------------- checks
    def idle(self) -> list[str]:
        """What the books still hold when every task has ended (should be nothing)."""
        out = []
        if self.state.allocations:
            out.append(f"{self.name} books hold {sorted(self.state.allocations)}")
        if self.lc.tasks:
            out.append(f"{self.name} lifecycle holds {sorted(self.lc.tasks)}")
        if self.lc.stopping:
            out.append(f"{self.name} waits for the end of {sorted(self.lc.stopping)}")
        if self.lc.orphans:
            out.append(f"{self.name} orphans {sorted(self.lc.orphans)}")
        table = self.state.table
        if (table.free != table.capacity).any():
            out.append(f"{self.name} free != capacity on nodes with nothing booked")
        return out


def states_name(state: int) -> str:
    return states.TaskState(state).name


NODE_CAPACITY = resources(4000, 8192, 1000, 1000)
