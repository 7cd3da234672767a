"""One seeded run: the federation, its clients, the faults the seed draws, and the check.

seed ──▶ Kernel.rng ──▶ weather (message faults), fault plan, jobs
GMs (Scheduler) ⇄ Net ⇄ LMs (Lifecycle over ClusterState) ⇄ Streams ⇄ workers
         ⇅ Broker (durable user queues, heartbeat and event fanouts)
fault window: crashes, restarts, pauses, broker restarts, broken streams, lossy net
then calm: every process up, no faults, until every acknowledged task ended
check: ground truth runs + the LMs' ends ──▶ loadgen.invariants.check; books empty;
       every GM's view of every LM equal to the LM's books
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from loadgen.chaos.broker import Broker
from loadgen.chaos.gm import GM
from loadgen.chaos.kernel import NS, Kernel
from loadgen.chaos.lm import LM, NODE_CAPACITY
from loadgen.chaos.net import Net, Weather
from loadgen.chaos.wire import Batch, Event, Task
from loadgen.chaos.worker import Worker
from loadgen.invariants import Violation, check
from services._proto.megha.v1 import common_pb2
from services.core import states
from services.core.fairness import FairShare, QueueShare

FAULT_KINDS = (
    "gm crash",
    "lm crash",
    "lm pause",
    "worker crash",
    "stream break",
    "broker restart",
)


@dataclass(frozen=True)
class ChaosConfig:
    gms: int = 2
    lms: int = 3
    nodes_per_lm: int = 3
    jobs: int = 32  # 4.5 tasks each on average
    submit_window_s: float = 40.0
    fault_window_s: float = 90.0
    horizon_s: float = 500.0  # virtual; past it what has not ended is stuck
    heartbeat_interval_s: float = 1.0
    full_state_every: int = 10
    worker_heartbeat_interval_s: float = 2.0
    worker_timeout_s: float = 10.0
    worker_fence_s: float = 6.0
    lm_call_timeout_s: float = 5.0
    event_batch_s: float = 0.05
    fail_p: float = 0.1  # a run fails (its task retries once)
    # An LM crash loses its journal too (a lost disk): outside the exactly-once promise
    # (the LM forgets what ended on it), so off unless asked for.
    lose_journal_p: float = 0.0
    faults: bool = True
    # Which faults the seed may draw (all by default; see FAULT_KINDS).
    fault_kinds: frozenset[str] = frozenset()
    # Worker streams take the weather's slow path too (a stream delayed by seconds: a
    # kill that reaches its worker late).
    slow_streams: bool = True
    # Messages to and from the broker take the weather's slow path too (a re-queue that
    # takes seconds to be confirmed).
    slow_broker: bool = True
    # Planted bugs, to show the checker catches what they break.
    no_fencing: bool = False  # LookupTasks fences nothing
    # Queue failover (``queue_failover``): every GM consumes every queue, one at a time
    # (the broker's single active consumer), its own first.
    failover: bool = False
    # A job comes with the one before it (same instant, same queue) with this chance, as
    # a client's stream message carries several: a GM then publishes them as one queue
    # message (``TaskBatch.more_jobs``). 0: none (and nothing drawn for it).
    bursts: float = 0.0

    @property
    def gm_ids(self) -> tuple[str, ...]:
        return tuple(f"gm-{i}" for i in range(self.gms))


@dataclass
class Result:
    seed: int
    violations: list[Violation]
    tasks: int
    attempts: int
    ended_at_s: float
    events: int
    faults: list[str]
    trace: list[str] = field(default_factory=list)
    preemptions: int = 0
    taken_over: int = 0  # queue failover: messages delivered to a GM the queue does not name

    @property
    def ok(self) -> bool:
        return not self.violations


class World:
    def __init__(self, seed: int, cfg: ChaosConfig, trace: bool = False) -> None:
        self.seed = seed
        self.cfg = cfg
        self.k = Kernel(seed, trace)
        weather = Weather.draw(self.k, calm=not cfg.faults)
        self.net = Net(self.k, weather)
        self.broker = Broker(self.k, self.net)
        self.broker.slow = cfg.slow_broker
        self.node_capacity = NODE_CAPACITY
        gm_ids = cfg.gm_ids
        # Two queues, each served by one GM (``FederationConfig.queues_of``: the live GM
        # consumes only its own queues), or with ``failover`` by whichever GM the broker
        # delivers it to (each GM consumes every queue, its own first).
        self.queue_names = ("a", "b")
        self.preferred = {q: gm_ids[i % len(gm_ids)] for i, q in enumerate(self.queue_names)}
        self.fair = FairShare([QueueShare(q, 0.5) for q in self.queue_names])
        self.recorded: list[Event] = []  # every event an LM published, as it made it
        self.runs: dict[tuple[str, int, str, int], list] = {}  # ground truth
        self.unexpected: list[str] = []
        self.acknowledged: set[str] = set()
        self.tasks: dict[str, Task] = {}
        self.fault_log: list[str] = []
        self.lms: dict[str, LM] = {}
        for i in range(cfg.lms):
            self.lms[f"lm-{i}"] = LM(self, f"lm-{i}", journal=True)
        self.gms = {gm_id: GM(self, gm_id) for gm_id in gm_ids}
        self.workers: dict[str, Worker] = {}
        for lm in self.lms.values():
            for n in range(cfg.nodes_per_lm):
                node_id = f"{lm.name}-w{n}"
                self.workers[node_id] = Worker(self, node_id, lm)
                self.workers[node_id].link.slow = cfg.slow_streams
        if cfg.no_fencing:
            for lm in self.lms.values():
                lm.lookup = _unfenced(lm)  # type: ignore[method-assign]

    def queues_of(self, gm_id: str) -> list[str]:
        if self.cfg.failover:
            return list(self.queue_names)
        return [q for q in self.queue_names if self.preferred[q] == gm_id]

    # ------------------------------------------------------------ ground truth
    def run_started(self, task: Task, node_id: str) -> None:
        key = (task.task_id, task.attempt, node_id, task.timestamps.started_unix_nanos)
        self.runs[key] = [task.cpu, 0, 0]
        if self.k.tracing:
            self.k.log(node_id, f"RUN {task.task_id}#{task.attempt}")

    def run_ended(self, task: Task, node_id: str, state: int, at_ns: int) -> None:
        key = (task.task_id, task.attempt, node_id, task.timestamps.started_unix_nanos)
        run = self.runs.get(key)
        if run is not None and not run[1]:
            run[1], run[2] = at_ns, state
            if self.k.tracing:
                self.k.log(node_id, f"END {task.task_id}#{task.attempt} {state}")

    # ------------------------------------------------------------------ jobs
    def _jobs(self) -> list[tuple[float, Batch]]:
        k, cfg = self.k, self.cfg
        out: list[tuple[float, Batch]] = []
        for j in range(cfg.jobs):
            # Queue a comes first and fills the federation; b comes later, under its
            # share, and preempts a.
            queue = "a" if k.rng.random() < (0.8 if j < cfg.jobs // 2 else 0.3) else "b"
            at = k.uniform(0.0, cfg.submit_window_s * (0.5 if queue == "a" else 1.0)) + 2.0
            if out and cfg.bursts > 0 and k.chance(cfg.bursts):
                at, queue = out[-1][0], out[-1][1].queue
            n = int(k.rng.integers(1, 9))
            tasks = []
            for i in range(n):
                cpu = int(k.rng.choice([500, 1000, 1000, 2000]))
                task = Task(
                    f"j{j}.{i}",
                    f"j{j}",
                    queue,
                    cpu,
                    int(k.rng.choice([256, 512, 1024, 2048])),
                    k.log_uniform(1.0, 30.0),
                )
                tasks.append(task)
                self.tasks[task.task_id] = task
            out.append((at, Batch(f"j{j}", queue, tuple(tasks))))
        return out

    def _submit_group(self, batches: list[Batch]) -> None:
        """Jobs submitted together (one SubmitStream message): one call, each job
        answered on its own; one not queued is asked again alone (``_submit``)."""
        if len(batches) == 1:
            self._submit(batches[0], 0)
            return
        alive = [gm for gm in self.gms.values() if gm.alive]
        gm = alive[int(self.k.rng.integers(len(alive)))] if alive else self.gms["gm-0"]
        answer = self.net.rpc(
            self.client, gm, gm.submit_jobs, (tuple(batches),), 10.0, faults=False
        )

        def answered(oks) -> None:
            for batch, ok in zip(batches, oks or [False] * len(batches), strict=True):
                if ok:
                    self.acknowledged.update(t.task_id for t in batch.tasks)
                else:
                    self.k.after(0.5, self._submit, batch, 1)

        answer.on(answered)

    def _submit(self, batch: Batch, attempt: int) -> None:
        """A client: SubmitJob to a GM, again (another GM, backing off) until told queued."""
        alive = [gm for gm in self.gms.values() if gm.alive]
        gm = alive[int(self.k.rng.integers(len(alive)))] if alive else self.gms["gm-0"]
        answer = self.net.rpc(self.client, gm, gm.submit_job, (batch,), 10.0, faults=False)

        def answered(ok) -> None:
            if ok:
                self.acknowledged.update(t.task_id for t in batch.tasks)
                if self.k.tracing:
                    self.k.log("client", f"acked {batch.job_id} via {gm.name}")
            else:
                self.k.after(min(5.0, 0.5 * 2**attempt), self._submit, batch, attempt + 1)

        answer.on(answered)

    # ---------------------------------------------------------------- faults
    def _plan_faults(self) -> None:
        k, cfg = self.k, self.cfg
        window = cfg.fault_window_s
        rate = k.log_uniform(0.5, 8.0)  # faults of each kind per fault window, on average

        def times(scale: float = 1.0) -> list[float]:
            return sorted(k.uniform(1.0, window) for _ in range(int(k.rng.poisson(rate * scale))))

        for gm in self.gms.values():
            for at in times(0.5):
                self._fault(at, k.log_uniform(0.5, 20.0), "gm crash", gm.name)
        for lm in self.lms.values():
            for at in times(0.5):
                self._fault(at, k.log_uniform(0.5, 30.0), "lm crash", lm.name)
            for at in times(0.5):
                self._fault(at, k.log_uniform(0.5, 40.0), "lm pause", lm.name)
        for worker in self.workers.values():
            for at in times(0.15):
                self._fault(at, k.log_uniform(0.5, 30.0), "worker crash", worker.name)
            for at in times(0.3):
                self._fault(at, k.log_uniform(0.05, 3.0), "stream break", worker.name)
        for at in times(0.3):
            self._fault(at, k.log_uniform(1.0, 15.0), "broker restart", "broker")

    def _fault(self, at: float, lasting: float, kind: str, who: str) -> None:
        if not self.cfg.fault_kinds or kind in self.cfg.fault_kinds:
            self.k.after(at, self._inject, kind, who, lasting)

    def _inject(self, kind: str, who: str, lasting: float) -> None:
        k = self.k
        if kind == "gm crash":
            gm = self.gms[who]
            if not gm.alive:
                return
            gm.crash()
            self.broker.consumer_gone(gm)
            k.after(lasting, self._heal, kind, who)
        elif kind == "lm crash":
            lm = self.lms[who]
            if not lm.alive:
                return
            lm.crash()
            for worker in self.workers.values():
                if worker.lm is lm:
                    worker.link.cut()
                    self.net.send(worker, worker.stream_ended, -1)
            keep = lm.journal is not None and not k.chance(self.cfg.lose_journal_p)
            k.after(lasting, self._heal, kind, who, keep)
        elif kind == "lm pause":
            lm = self.lms[who]
            if not lm.alive or lm.paused:
                return
            lm.pause()
            k.after(lasting, self._heal, kind, who)
        elif kind == "worker crash":
            worker = self.workers[who]
            if not worker.alive:
                return
            worker.crash_worker()
            k.after(lasting, self._heal, kind, who)
        elif kind == "stream break":
            worker = self.workers[who]
            if not worker.alive or not worker.stream:
                return
            k.log(who, "STREAM BREAK")
            worker.link.cut()
            k.after(lasting, worker.gate, worker.life, worker.stream_ended, -1)
            self.net.send(worker.lm, worker.lm.stream_broken, who)
            return
        elif kind == "broker restart":
            if not self.broker.alive:
                return
            self.broker.restart_down()
            k.after(lasting, self._heal, kind, who)
        self.fault_log.append(f"{k.now:.2f}s {kind} {who} for {lasting:.2f}s")

    def _heal(self, kind: str, who: str, keep: bool = True) -> None:
        if kind == "gm crash":
            self.gms[who].restart()
        elif kind == "lm crash":
            self.lms[who].restart(keep)
        elif kind == "lm pause":
            self.lms[who].resume()
        elif kind == "worker crash":
            self.workers[who].restart()
        elif kind == "broker restart":
            self.broker.restart_up()

    def _calm(self) -> None:
        """The fault window is over: the network stops losing and slowing messages."""
        self.net.calm = True
        self.k.log("world", "CALM")

    # ------------------------------------------------------------------- run
    def run(self) -> Result:
        from loadgen.chaos.kernel import Actor

        k, cfg = self.k, self.cfg
        self.client = Actor(k, "client")
        jobs = self._jobs()
        if cfg.faults:
            self._plan_faults()
            k.after(cfg.fault_window_s, self._calm)
        for lm in self.lms.values():
            lm.start()
        for gm in self.gms.values():
            gm.start()
        for worker in self.workers.values():
            worker.start()
        # Jobs of a burst (``bursts``) go together, as a stream message carries them.
        groups: list[list[Batch]] = []
        for i, (at, batch) in enumerate(jobs):
            if i and at == jobs[i - 1][0]:
                groups[-1].append(batch)
            else:
                groups.append([batch])
                k.after(at, self._submit_group, groups[-1])
        total = sum(len(b.tasks) for _, b in jobs)
        ended_at = self._until_done(total)
        try:
            return self._check(total, ended_at)
        finally:
            k.close()

    def _until_done(self, total: int) -> float:
        """Run until every task ended and the federation settled, or the horizon."""
        k, cfg = self.k, self.cfg
        done_at: list[float] = []
        terminal: set[str] = set()
        seen = 0

        def poll() -> None:
            nonlocal seen
            for event in self.recorded[seen:]:
                if event.state in states.TERMINAL:
                    terminal.add(event.task_id)
            seen = len(self.recorded)
            quiet = k.now > cfg.fault_window_s + 20.0
            if len(terminal) >= total and len(self.acknowledged) >= total and quiet:
                if not done_at:
                    done_at.append(k.now)
                    k.after(3 * cfg.worker_timeout_s, k.engine.stop)
                return
            if k.now < cfg.horizon_s:
                k.after(1.0, poll)
            else:
                k.engine.stop()

        k.after(1.0, poll)
        k.engine.run()
        return done_at[0] if done_at else k.now

    def _check(self, total: int, ended_at: float) -> Result:
        events = []
        cpu: dict[str, int] = {}
        for (task_id, attempt, node_id, started), (task_cpu, finished, _) in self.runs.items():
            task = self.tasks[task_id]
            cpu[task_id] = task_cpu
            stamps = common_pb2.TaskTimestamps(started_unix_nanos=started)
            events.append(
                common_pb2.TaskEvent(
                    task_id=task_id,
                    job_id=task.job_id,
                    state=states.RUNNING,
                    node_id=node_id,
                    attempt=attempt,
                    timestamps=stamps,
                )
            )
            if finished:
                stamps = common_pb2.TaskTimestamps(
                    started_unix_nanos=started, finished_unix_nanos=finished
                )
                # The run's end as its worker saw it, neutral: how the attempt ended is
                # the federation's word (a run that succeeded as the LM preempted it
                # ended PREEMPTED), told by the LMs' events below.
                events.append(
                    common_pb2.TaskEvent(
                        task_id=task_id,
                        job_id=task.job_id,
                        state=states.LOST,
                        node_id=node_id,
                        attempt=attempt,
                        timestamps=stamps,
                    )
                )
        for event in self.recorded:  # the federation's word, with its workers' stamps
            if event.state in states.TERMINAL:
                stamps = common_pb2.TaskTimestamps(
                    started_unix_nanos=event.started, finished_unix_nanos=event.finished
                )
                events.append(
                    common_pb2.TaskEvent(
                        task_id=event.task_id,
                        job_id=event.job_id,
                        state=event.state,
                        lm_id=event.lm_id,
                        node_id=event.node_id,
                        attempt=event.attempt,
                        timestamps=stamps,
                    )
                )
        capacity = {node_id: int(NODE_CAPACITY[0]) for node_id in self.workers}
        report = check(events, self.acknowledged, cpu, capacity)
        violations = list(report.violations)
        unacked = set(self.tasks) - self.acknowledged
        for task_id in sorted(unacked):
            violations.append(Violation("never acknowledged", task_id, "the client gave up"))
        for (task_id, attempt, node_id, _), (_, finished, _) in sorted(self.runs.items()):
            if not finished:
                violations.append(
                    Violation("still running", task_id, f"attempt {attempt} on {node_id}")
                )
        violations += [Violation("unexpected", "-", what) for what in self.unexpected]
        if not any(v.kind == "stuck" for v in violations):
            violations += self._books()
        return Result(
            self.seed,
            violations,
            total,
            report.attempts_started,
            ended_at,
            self.k.engine.events,
            self.fault_log,
            self.k.trace,
            sum(gm.counters["preemptions"] for gm in self.gms.values()),
            sum(gm.counters["taken_over"] for gm in self.gms.values()),
        )

    def _books(self) -> list[Violation]:
        """Every ended task's resources released: the LMs' books empty, and each GM's
        view of each LM what the LM's books say."""
        out = [Violation("not released", "-", why) for lm in self.lms.values() for why in lm.idle()]
        for gm in self.gms.values():
            for lm_id, view in gm.view.lms.items():
                lm = self.lms[lm_id]
                if view.allocations:
                    out.append(
                        Violation(
                            "view inconsistent",
                            "-",
                            f"{gm.name} sees {sorted(view.allocations)} on {lm_id}",
                        )
                    )
                free = lm.state.table.free
                seen = view.table.free
                if seen.shape != free.shape or not np.array_equal(seen, free):
                    out.append(
                        Violation("view inconsistent", "-", f"{gm.name}'s free on {lm_id} differs")
                    )
        return out


def _unfenced(lm: LM):
    original = lm.lookup

    def lookup(task_ids: list[str], fence_lease: int):
        return original(task_ids, 0)

    return lookup


# What CI runs: a smaller federation (a few hundred seeds in seconds), every fault.
SMALL = ChaosConfig(
    gms=2, lms=2, nodes_per_lm=2, jobs=14, submit_window_s=25.0, fault_window_s=50.0
)


def run_seed(seed: int, cfg: ChaosConfig | None = None, trace: bool = False) -> Result:
    return World(seed, cfg or ChaosConfig(), trace).run()


_ = NS
