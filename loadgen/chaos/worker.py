"""A simulated worker agent (``services/worker/agent.py``): registers with its inventory,
keeps a heartbeat stream, runs attempts, kills by attempt, parks a newer attempt until
the older one ended, re-sends recent final reports after a broken stream, and (with
``worker_fence_s``) kills what it runs when its LM has read nothing of it for that long,
and starts nothing while so cut off.

Every run is written to the world's ground truth (``World.runs``) as it starts and ends:
that, not any process's word, is what the invariants are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loadgen.chaos.kernel import Actor
from loadgen.chaos.net import Stream
from loadgen.chaos.wire import Beat, Report, Task
from services.core import states

if TYPE_CHECKING:
    from loadgen.chaos.lm import LM
    from loadgen.chaos.world import World

BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 2.0
REGISTER_TIMEOUT_S = 5.0
REDELIVERY_WINDOW_S = 3.0


@dataclass(eq=False, slots=True)
class Run:
    task: Task
    token: int
    kill_state: int = 0
    kill_message: str = ""


class Worker(Actor):
    def __init__(self, world: World, node_id: str, lm: LM) -> None:
        super().__init__(world.k, node_id)
        self.world = world
        self.cfg = world.cfg
        self.lm = lm
        self.link = Stream(world.net, node_id, lm.name)
        self._tokens = 0
        self._boot()

    def _boot(self) -> None:
        self.running: dict[str, Run] = {}
        self.next: dict[str, Task] = {}
        self.owed: dict[tuple[str, int], Task] = {}
        self.never: dict[tuple[str, int], None] = {}  # killed before they came
        self.outbox: list[Report] = []
        self.sent: list[tuple[Report, float]] = []
        self.stream = 0
        self.contact: float | None = None
        self.backoff = BACKOFF_INITIAL_S
        self.unacked: list[float] = []
        self.waking = False

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self.connect()
        if self.cfg.worker_fence_s:
            self.later(0.5, self._fence_loop)

    def crash_worker(self) -> None:
        """The host dies: its runs die with it (no report), its state is gone."""
        now = self.k.engine.now
        for run in self.running.values():
            self.world.run_ended(run.task, self.name, states.LOST, now)
        self.crash()
        self.link.cut()
        self.world.net.send(self.lm, self.lm.stream_broken, self.name)

    def restart(self) -> None:
        self.alive = True
        self.k.log(self.name, "RESTART")
        self._boot()
        self.start()

    # ------------------------------------------------------------ the LM link
    def connect(self) -> None:
        began = self.k.now
        running = [r.task.copy() for r in self.running.values()]
        running += [t.copy() for t in self.next.values()]
        finished = [t.copy() for t in self.owed.values()]
        answer = self.world.net.rpc(
            self,
            self.lm,
            self.lm.register_worker,
            (self.name, running, finished),
            REGISTER_TIMEOUT_S,
            faults=False,
            lane="stream",
        )
        life = self.life
        answer.on(lambda node: self.gate(life, self._registered, node, began))

    def _registered(self, node: int | None, began: float) -> None:
        if node is None:
            self.later(self._next_backoff(), self.connect)
            return
        self.backoff = BACKOFF_INITIAL_S
        self.contact = began if self.contact is None else max(self.contact, began)
        self.stream = self.link.open()
        self.unacked.clear()
        # The first heartbeat of a stream is an inventory (``_resync``).
        owed = {r.task_id for r in self.outbox}
        for task_id, run in self.running.items():
            if task_id not in owed:
                self.outbox.append(self._report(run.task, states.RUNNING))
        self._beat(first=True)
        self.later(self.cfg.worker_heartbeat_interval_s, self._tick, self.stream)

    def _next_backoff(self) -> float:
        wait = self.backoff
        self.backoff = min(BACKOFF_MAX_S, self.backoff * 2)
        return wait

    def stream_ended(self, stream: int) -> None:
        """The stream broke or the LM ended it: re-send recent final reports, register
        again (``-1``: whatever stream is open)."""
        if not self.stream or (stream != -1 and stream != self.stream):
            return
        self.stream = 0
        horizon = self.k.now - REDELIVERY_WINDOW_S
        again = [r for r, at in self.sent if at >= horizon and r.state != states.RUNNING]
        self.outbox[:0] = again
        for report, at in self.sent:
            if at < horizon and report.state != states.RUNNING:
                self.owed.pop((report.task_id, report.attempt), None)
        self.sent.clear()
        self.later(self._next_backoff(), self.connect)

    def _beat(self, first: bool = False) -> None:
        if not self.stream:
            return
        now = self.k.now
        reports, self.outbox = self.outbox, []
        self.sent += [(r, now) for r in reports]
        want_ack = bool(self.cfg.worker_fence_s)
        if want_ack:
            self.unacked.append(now)
        beat = Beat(self.name, reports, now, want_ack)
        fn = self.lm.stream_open if first else self.lm.on_beat
        self.link.carry(True, self.stream, self.lm, fn, self.name, self.stream, beat)

    def _tick(self, stream: int) -> None:
        if stream == self.stream:
            self._beat()
            self.later(self.cfg.worker_heartbeat_interval_s, self._tick, stream)

    def _wake(self) -> None:
        self.waking = False
        if self.stream and self.outbox:
            self._beat()

    def on_command(self, stream: int, command: tuple) -> None:
        if stream != self.stream:
            return
        kind = command[0]
        if kind == "start":
            self._start(command[1].copy())
        elif kind == "kill":
            self._on_kill(command[1], command[2], command[3])
        elif kind == "ack":
            self.contact = command[1] if self.contact is None else max(self.contact, command[1])

    def _cut_off(self) -> bool:
        fence = self.cfg.worker_fence_s
        return bool(fence) and self.contact is not None and self.k.now - self.contact > fence

    def _fence_loop(self) -> None:
        if self._cut_off():
            doomed = [r for r in self.running.values() if not r.kill_state]
            for run in doomed:
                self._kill(run, states.LOST, "cut off from the LM")
        self.later(0.5, self._fence_loop)

    # ------------------------------------------------------------- the tasks
    def _start(self, task: Task) -> None:
        task_id = task.task_id
        entry = self.running.get(task_id)
        parked = self.next.get(task_id)
        known = [entry.task.attempt] if entry is not None else []
        known += [parked.attempt] if parked is not None else []
        if task.attempt in known or (task_id, task.attempt) in self.owed:
            return  # duplicate start ignored
        if (task_id, task.attempt) in self.never:
            return  # killed before it came
        if known and max(known) > task.attempt:
            return  # start of an older attempt ignored
        if entry is not None:
            if parked is not None:
                self._send(parked, states.LOST, "superseded")
            self.next[task_id] = task
            self._kill(entry, states.LOST, f"superseded by attempt {task.attempt}")
            return
        if self._cut_off():
            # As the fence loop would kill it: the LM may have taken this worker for dead
            # and queued the task's next attempt (a start that waited in a slow stream).
            task.timestamps.finished_unix_nanos = self.k.engine.now
            self._send(task, states.LOST, "cut off from the LM")
            return
        self._tokens += 1
        run = Run(task, self._tokens)
        self.running[task_id] = run
        task.timestamps.started_unix_nanos = self.k.engine.now
        self.world.run_started(task, self.name)
        self._send(task, states.RUNNING)
        self.later(task.duration_s, self._done, task_id, run.token)

    def _done(self, task_id: str, token: int) -> None:
        run = self.running.get(task_id)
        if run is None or run.token != token or run.kill_state:
            return
        failed = self.k.chance(self.world.cfg.fail_p)
        self._finish(run, states.FAILED if failed else states.SUCCEEDED, "")

    def _finish(self, run: Run, state: int, message: str) -> None:
        task = run.task
        if self.running.get(task.task_id) is run:
            del self.running[task.task_id]
        task.timestamps.finished_unix_nanos = self.k.engine.now
        self.world.run_ended(task, self.name, state, self.k.engine.now)
        self._send(task, state, message)
        waiting = self.next.pop(task.task_id, None)
        if waiting is not None and task.task_id not in self.running:
            self._start(waiting)

    def _on_kill(self, task_id: str, attempt: int, reason: str) -> None:
        state = states.PREEMPTED if reason.lower().startswith("preempt") else states.FAILED
        parked = self.next.get(task_id)
        if parked is not None and parked.attempt == attempt:
            del self.next[task_id]
            self._send(parked, state, f"killed: {reason}")
            return
        entry = self.running.get(task_id)
        if entry is None or entry.task.attempt != attempt:
            if (task_id, attempt) not in self.owed:
                # Not here (its start went out on a stream this worker had left): said,
                # so the LM queues the next attempt, and remembered, so a late copy of
                # the start is ignored.
                self.never[task_id, attempt] = None
                self.outbox.append(Report(task_id, attempt, states.LOST, "not here", 0, 0, 0))
                self._wake_soon()
            return
        self._kill(entry, state, f"killed: {reason}")

    def _kill(self, run: Run, state: int, message: str) -> None:
        if not run.kill_state:
            run.kill_state, run.kill_message = state, message
            self._finish(run, state, message)

    def _report(self, task: Task, state: int, message: str = "") -> Report:
        stamps = task.timestamps
        return Report(
            task.task_id,
            task.attempt,
            state,
            message,
            0,
            stamps.started_unix_nanos,
            stamps.finished_unix_nanos,
        )

    def _send(self, task: Task, state: int, message: str = "") -> None:
        self.outbox.append(self._report(task, state, message))
        if state != states.RUNNING:
            self.owed[task.task_id, task.attempt] = task
        self._wake_soon()

    def _wake_soon(self) -> None:
        if not self.waking:
            self.waking = True
            self.later(0.0, self._wake)
