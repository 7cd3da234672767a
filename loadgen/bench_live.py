"""``megha-loadgen bench-live``: start a private federation, offer short tasks at a fixed
rate, and measure allocation time (paper eq. 1-2) and placement throughput.

    free ports + a unique exchange prefix ──▶ federation.yaml ──▶ child processes (as megha up)
    events topic "task.#" ──▶ EventLog                 (subscribed before any load is offered)
    one job every tasks_per_job/rate s, round-robin over the GMs, never waiting for a reply
    wait until every accepted task has ended (bounded) ──▶ report.py: summary, tasks.csv, CDF
    stop the children; delete the prefix's durable queues and exchanges

Every process runs on this host, so stamps taken by different processes share one clock and
their differences are the components of eq. 2. The offer schedule uses absolute deadlines:
a slow reply never delays the next submission, and a load generator that falls behind shows
up as ``offer_lag_s`` instead of silently offering less.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aio_pika
import grpc
from aio_pika.exceptions import AMQPError
from prometheus_client.parser import text_string_to_metric_families

from loadgen import report
from loadgen.events import AcceptedTasks, EventLog, TaskRows
from loadgen.queues import (
    LiveAttempts,
    QueueFileError,
    check_gms,
    measured_shares,
    peak_held,
    summary_queues,
)
from loadgen.queues import render as render_queues
from loadgen.saturation import EXACTLY_ONCE, SATURATED, verdict
from services._proto.megha.v1 import common_pb2
from services.app.supervisor import (
    ChildDied,
    Children,
    amqp_port,
    broker_reachable,
    start_federation,
    wait_until_ready,
    write_federation,
)
from services.common.bus import RabbitBus
from services.common.client import BUSY_TRIES, GlobalMasterClient
from services.common.config import (
    ConfigError,
    FederationConfig,
    QueueConfig,
    default_config,
    parse_config,
)
from services.common.convert import resources_to_proto
from services.common.gate import IN_FLIGHT
from services.common.names import (
    CANCEL_EXCHANGE,
    EVENT_EXCHANGE,
    EVERY_TASK_EVENT,
    HEARTBEAT_EXCHANGE,
    cancel_queue,
    user_queue,
)
from services.common.progress import Progress
from services.common.request_stream import SEND_WITHIN_S
from services.common.server import TlsError, broker_ssl_context, use_tls, wait_all_healthy
from services.common.stalls import STALL_S, StallTally, settle
from services.common.stalls import watch as watch_stalls
from services.core.resources import parse_resources, resources

T = TypeVar("T")
DRAIN_EXTRA_S = 30.0  # the wait after the offer is bounded by seconds + this
TURN_WAITED_S = 0.001  # a job that waited longer than this at its client's gate waited
STARTUP_TIMEOUT_S = 90.0
MEMORY_SAMPLE_S = 5.0  # at most, between two samples of every process's resident memory
# Below Linux's ephemeral ports (32768-60999 by default): a port probed free there can be
# taken by one of the federation's own outgoing connections before its server binds it
# (seen: a worker host's metrics port, "Address already in use", mid-sweep).
PORT_RANGE = (20_000, 32_000)
# submit_errors' key for submissions still unanswered when the wait after the offer ended.
UNANSWERED = "UNANSWERED_AT_END"


class BenchError(RuntimeError):
    """The benchmark cannot run; the message says why in one line."""


@dataclass(frozen=True)
class BenchOptions:
    rate: float = 200.0
    """Tasks offered per second."""
    seconds: float = 10.0
    """How long load is offered."""
    gms: int = 2
    lms: int = 3
    workers_per_lm: int = 100
    task_duration_s: float = 0.05
    """How long each ``sim`` task holds its resources."""
    tasks_per_job: int = 1
    warmup_s: float = 2.0
    """Tasks that start within this long of the first offer are left out of the stats."""
    out: Path | None = None
    """Where summary.json, tasks.csv and the CDF go; None = print only."""
    log_dir: Path | None = None
    """Where the config and the children's logs go; None = a new temp dir."""
    rabbitmq_url: str = ""
    """Empty = the config default (or MEGHA_RABBITMQ_URL)."""
    queues: str = "per-gm"
    """``per-gm``: one user queue per GM, each GM schedules what is submitted to it;
    ``default``: the one ``default`` queue, scheduled by the first GM alone; ``file``:
    ``file_queues`` (``--queues FILE``), jobs round-robin over them."""
    file_queues: tuple[QueueConfig, ...] = ()
    """The queues of ``--queues FILE``: each job goes to the GM serving its queue, and the
    summary reports every queue's measured share."""
    cpu_milli: int = 1000
    memory_mb: int = 64
    service_log_level: str = "INFO"
    submit: str = "stream"
    secure: bool = False
    """Per-process certificates (``megha certs``), mutual TLS and authorization on: the
    load generator submits as user ``bench`` (submit and watch on every queue), each
    process writes an audit log beside its log, work messages are signed and tasks
    sealed (docs/security.md)."""
    certs_dir: str = ""  # made by ``run_bench`` when ``secure``
    queue_failover: bool = False
    """Queue failover on (``queue_failover``): every GM consumes every queue, one at a
    time by the broker's choice; jobs are scheduled from their delivery, never from
    memory (what failover costs: docs/failover.md)."""
    """How jobs reach the GMs: ``stream`` (one ``SubmitStream`` per GM, as a program
    submitting many jobs would) or ``unary`` (one ``SubmitJob`` call each, as the CLI)."""

    def check(self) -> None:
        problems = []
        if not self.rate > 0:
            problems.append("--rate must be positive")
        if not self.seconds > 0:
            problems.append("--seconds must be positive")
        for name, value in (("--gms", self.gms), ("--lms", self.lms)):
            if value < 1:
                problems.append(f"{name} must be at least 1")
        if not 1 <= self.workers_per_lm <= 10_000:
            problems.append("--workers-per-lm must be in 1..10000")
        if self.tasks_per_job < 1:
            problems.append("--tasks-per-job must be at least 1")
        if self.task_duration_s < 0:
            problems.append("--task-duration must not be negative")
        if not 0 <= self.warmup_s < self.seconds:
            problems.append("--warmup must be at least 0 and shorter than --seconds")
        if self.submit not in ("stream", "unary"):
            problems.append("--submit must be 'stream' or 'unary'")
        if self.queues not in ("per-gm", "default", "file"):
            problems.append("--queues must be 'per-gm', 'default' or a queue file")
        if self.queues == "file":
            try:
                check_gms(self.file_queues, self.gms)
            except QueueFileError as err:
                problems.append(str(err))
            if not self.file_queues:
                problems.append("--queues FILE names no queue")
        if self.cpu_milli < 1 or self.memory_mb < 0:
            problems.append("task resources must be positive")
        if problems:
            raise BenchError("; ".join(problems))

    @property
    def jobs(self) -> int:
        return max(1, round(self.rate * self.seconds / self.tasks_per_job))


# ----------------------------------------------------------------------- federation
def free_config(options: BenchOptions, prefix: str, attempts: int = 200) -> FederationConfig:
    """``bench_config`` at a base port where every port it uses is free now (probed)."""
    return free_ports_config(lambda base: bench_config(options, base, prefix), attempts)


def free_ports_config(
    build: Callable[[int], FederationConfig], attempts: int = 200
) -> FederationConfig:
    """``build(base_port)`` at a base port where every port the config uses is free now."""
    rng = uuid.uuid4().int
    low, high = PORT_RANGE
    for i in range(attempts):
        base = low + (rng + i * 7919) % (high - low - 1000)
        config = build(base)
        if all(_port_free(port) for port in config_ports(config)):
            return config
    raise BenchError(f"found no free set of TCP ports for the federation in {low}..{high}")


def config_ports(config: FederationConfig) -> list[int]:
    """Every gRPC and Prometheus port the config's processes listen on."""
    endpoints = [*config.gms, *config.lms, *([config.predictor] if config.predictor else [])]
    ports = [p for e in endpoints for p in (e.port, e.metrics_port)]
    ports += [getattr(group, "metrics_port", 0) for group in config.workers]
    return [p for p in ports if p]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            # 0.0.0.0 also covers the metrics servers, which listen on every address.
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def bench_config(options: BenchOptions, base_port: int, prefix: str) -> FederationConfig:
    """``default_config`` plus the prefix, GM/LM metrics ports and the benchmark's queues."""
    data = default_config(options.gms, options.lms, options.workers_per_lm, base_port)
    # The GM and LM counters (inconsistencies, repartitions, preemptions) are read from
    # their Prometheus endpoints, so each needs one.
    spare = iter(range(base_port + 900, base_port + 1000))
    for endpoint in (*data["gms"], *data["lms"]):
        endpoint.setdefault("metrics_port", 0)
        endpoint["metrics_port"] = endpoint["metrics_port"] or next(spare)
    data["exchange_prefix"] = prefix
    if options.secure:
        certs = Path(options.certs_dir)
        data["tls"] = {"ca": str(certs / "ca.crt"), "dir": str(certs)}
        bench_user = {"queues": {"*": ["submit", "watch", "cancel"]}}
        audit = str(certs.parent / "audit-{process}.log")
        data["authz"] = {"users": {"bench": bench_user}, "audit": audit}
        # Signed work messages and sealed tasks (not broker users: they need rabbitmqctl).
        keys = {"queue_signing_key": certs / "queue.key", "task_seal_key": certs / "seal.key"}
        data["broker"] = {name: str(path) for name, path in keys.items()}
    if options.rabbitmq_url:
        data["rabbitmq_url"] = options.rabbitmq_url
    data["queue_failover"] = options.queue_failover
    if options.queues == "file":
        data["queues"] = [q.model_dump() for q in options.file_queues]
    elif options.queues == "per-gm":
        share = 1.0 / options.gms
        data["queues"] = [
            {"name": f"q-{gm['id']}", "share": share, "gm": gm["id"]} for gm in data["gms"]
        ]
    env = dict(os.environ)
    if options.rabbitmq_url:  # the flag wins over MEGHA_RABBITMQ_URL
        env.pop("MEGHA_RABBITMQ_URL", None)
    try:
        config = parse_config(data, env)
    except ConfigError as err:
        raise BenchError(str(err)) from None
    if config.exchange_prefix != prefix:
        # The children read the same environment: they would share a prefix with other runs.
        raise BenchError(
            "MEGHA_EXCHANGE_PREFIX is set; bench-live needs a prefix of its own: unset it"
        )
    try:  # MEGHA_TLS: the children and this process's clients on mutual TLS
        use_tls(config.tls, "user/bench" if options.secure else None)
    except TlsError as err:
        raise BenchError(str(err)) from None
    return config


@contextlib.asynccontextmanager
async def running_federation(
    config: FederationConfig, log_dir: Path, log_level: str = "INFO"
) -> AsyncIterator[Children]:
    """The federation of ``config`` as child processes, started in ``megha up``'s order.

    On exit (Ctrl-C and errors included) the children are stopped, and the durable queues
    and exchanges of the config's prefix are deleted from the broker.
    """
    config, config_path = write_federation(config, log_dir)
    children = Children(log_dir)
    try:
        start_federation(config, config_path, children, ["--log-level", log_level])
        await children.guard(wait_all_healthy(config, timeout_s=STARTUP_TIMEOUT_S))
        await children.guard(wait_until_ready(config, timeout_s=STARTUP_TIMEOUT_S))
        yield children
    finally:
        children.stop()
        with contextlib.suppress(Exception):
            await delete_broker_objects(config)


async def delete_broker_objects(config: FederationConfig, timeout_s: float = 10.0) -> None:
    """Delete the durable queues (user queues, the GMs' and LMs' kept cancel queues) and
    the exchanges of the config's prefix."""
    async with asyncio.timeout(timeout_s):
        bus = RabbitBus(
            config.rabbitmq_url,
            prefix=config.exchange_prefix,
            queue_type=config.queue_type,
            single_active=config.queue_failover,
        )
        async with bus:
            for queue in config.effective_queues():
                await bus.delete_queue(user_queue(queue.name))
            for process in (*config.gms, *config.lms):
                await bus.delete_queue(cancel_queue(process.id))
        node = config.rabbitmq_urls[0]  # exchanges are the cluster's: any node will do
        connection = await aio_pika.connect(node, ssl_context=broker_ssl_context(node))
        async with connection:
            channel = await connection.channel()
            for exchange in (EVENT_EXCHANGE, HEARTBEAT_EXCHANGE, CANCEL_EXCHANGE):
                await channel.exchange_delete(bus.exchange_name(exchange))


async def scrape(config: FederationConfig) -> dict[str, str] | None:
    """Each GM's and LM's Prometheus text, by id; None when an endpoint cannot be read
    (the summary then says the counts are unknown)."""
    endpoints = [e for e in (*config.gms, *config.lms) if e.metrics_port]

    def fetch(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as reply:
            return reply.read().decode()

    try:
        texts = await asyncio.gather(*(asyncio.to_thread(fetch, e.metrics_port) for e in endpoints))
    except OSError:
        return None
    return {e.id: text for e, text in zip(endpoints, texts, strict=True)}


def counters_from(texts: dict[str, str]) -> dict[str, int]:
    """Totals over every process of the GM/LM counters the summary reports."""
    wanted = {
        "megha_inconsistencies_total": "inconsistencies",
        "megha_repartitions_total": "repartitions",
        "megha_preemption_attempts_total": "preemption_attempts",
        "megha_preemptions_total": "preemptions",
        # What the GMs published to the user queues: jobs, in how many messages.
        "megha_queue_message_jobs_total": "queue_message_jobs",
        "megha_queue_messages_total": "queue_messages",
    }
    totals = dict.fromkeys(wanted.values(), 0)
    for text in texts.values():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    totals[wanted[sample.name]] += int(sample.value)
    return totals


def histogram_from(texts: dict[str, str], name: str) -> dict[str, Any] | None:
    """One histogram summed over every process that has it: its count and, for p50 and
    p99, the upper edge of the bucket the quantile falls in (an upper bound, within the
    buckets' factor of 2); None when no process has one observation."""
    buckets: dict[float, float] = {}
    for text in texts.values():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == f"{name}_bucket":
                    edge = float(sample.labels["le"])
                    buckets[edge] = buckets.get(edge, 0.0) + sample.value
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return None
    edges = sorted(buckets)

    def below(q: float) -> float | None:
        edge = next(e for e in edges if buckets[e] >= q * total)
        return None if edge == float("inf") else edge

    return {"count": int(total), "p50_le": below(0.5), "p99_le": below(0.99)}


def stalls_from(
    texts: dict[str, str], before: dict[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """Per process: how often its event loop ran more than ``STALL_S`` late, how many of
    those its own work caused (``busy_stalls``; the rest were waits for a core), a bound
    on the worst lag (the histogram bucket it fell in), and its garbage collections by
    generation as [count, seconds]. With ``before`` (the same scrape when the load
    began), only what came after it: a process's start-up (connecting, its one full
    collection in ``settle``) is not the run's."""
    out: dict[str, dict[str, Any]] = {}
    for name, text in texts.items():
        figures = _loop_figures(text)
        if not figures.lags:
            continue  # a service without the watcher
        if before is not None and name in before:
            figures = figures.since(_loop_figures(before[name]))
        lags = figures.lags
        total = lags[float("inf")]
        worst = min((edge for edge, n in lags.items() if n >= total), default=0.0)
        tally = StallTally(
            int(total),
            _over(lags, STALL_S),
            worst,
            {g: entry for g, entry in figures.gc.items() if entry[0] > 0},
            _over(figures.busy, STALL_S),
        )
        out[name] = tally.as_dict()
    return out


def _over(buckets: dict[float, float], edge: float) -> int:
    """How many observations of a cumulative histogram fell above ``edge``."""
    if not buckets:
        return 0
    below = max((n for e, n in buckets.items() if e <= edge), default=0.0)
    return int(buckets[float("inf")] - below)


@dataclass
class _LoopFigures:
    """A process's loop-lag histograms (bucket edge -> cumulative count: every lag, and
    the lags its own work caused) and its collections by generation ([count, seconds])."""

    lags: dict[float, float]
    busy: dict[float, float]
    gc: dict[str, list[float]]

    def since(self, earlier: _LoopFigures) -> _LoopFigures:
        gc = {g: list(entry) for g, entry in self.gc.items()}
        for generation, (count, seconds) in earlier.gc.items():
            entry = gc.get(generation)
            if entry is not None:
                entry[0] -= count
                entry[1] -= seconds
        return _LoopFigures(
            {edge: n - earlier.lags.get(edge, 0.0) for edge, n in self.lags.items()},
            {edge: n - earlier.busy.get(edge, 0.0) for edge, n in self.busy.items()},
            gc,
        )


def _loop_figures(text: str) -> _LoopFigures:
    """A process's loop figures from its Prometheus text."""
    figures = _LoopFigures({}, {}, {})
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "megha_event_loop_lag_seconds_bucket":
                figures.lags[float(sample.labels["le"])] = sample.value
            elif sample.name == "megha_event_loop_busy_lag_seconds_bucket":
                figures.busy[float(sample.labels["le"])] = sample.value
            elif sample.name.startswith("megha_gc_pause_seconds_"):
                kind = sample.name.rsplit("_", 1)[1]
                if kind in ("count", "sum"):
                    entry = figures.gc.setdefault(sample.labels["generation"], [0, 0.0])
                    entry[1 if kind == "sum" else 0] = sample.value
    return figures


# --------------------------------------------------------------------------- events
# ---------------------------------------------------------------------------- offer
@dataclass(eq=False)
class Target:
    """One GM the load generator submits to, and the queue it submits there."""

    gm_id: str
    client: GlobalMasterClient
    queue: str
    scheduler_gm: str
    """The GM that serves ``queue``, hence matches its tasks."""


@dataclass
class Offer:
    """What the load generator sent and what the GMs acknowledged."""

    jobs: int = 0
    tasks: int = 0
    accepted: AcceptedTasks = field(default_factory=AcceptedTasks)  # task -> (job, gm)
    attempts: LiveAttempts | None = None  # --queues FILE: when each task was acknowledged
    errors: Counter[str] = field(default_factory=Counter)  # gRPC code -> failed jobs
    busy_retries: int = 0  # jobs sent again after a GM refused them RESOURCE_EXHAUSTED
    throttled: int = 0  # tries the clients kept back, no message sent (AdaptiveThrottle)
    unsent: int = 0  # tries a stream did not send within SEND_WITHIN_S (NotSent)
    not_admitted: int = 0  # jobs whose turn at a client's gate did not come in time
    lags_s: list[float] = field(default_factory=list)  # send time - deadline, per job
    rpc_s: list[float] = field(default_factory=list)  # SubmitJob round trips
    answer_s: list[float] = field(default_factory=list)  # each try's wait for its answer
    # How long each job that waited its turn at its client's gate waited, by whether its
    # turn came (a job that found a place free at once is not in either).
    turn_s: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    inflight: set[asyncio.Task[None]] = field(default_factory=set)
    started_ns: int = 0
    ended_ns: int = 0


class LoadOffer:
    """Submits ``options.jobs`` jobs, one per deadline, round-robin over ``targets``."""

    def __init__(self, options: BenchOptions, targets: list[Target]) -> None:
        self.options = options
        self.targets = targets
        self.offer = Offer()
        template = common_pb2.Task(
            resources=resources_to_proto(resources(options.cpu_milli, options.memory_mb)),
            expected_duration_s=options.task_duration_s,
        )
        template.sim.duration_s = options.task_duration_s
        self._tasks = [template] * options.tasks_per_job  # the client stamps a copy of each

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.options.tasks_per_job / self.options.rate
        start = loop.time()
        self.offer.started_ns = time.time_ns()
        k, jobs = 0, self.options.jobs
        while k < jobs:
            now = loop.time()
            due = start + k * interval
            if due > now:
                await asyncio.sleep(due - now)
                continue
            while k < jobs and start + k * interval <= now:  # catch up on every due job
                self._send(k, now - (start + k * interval))
                k += 1
        self.offer.ended_ns = time.time_ns()

    def _send(self, k: int, lag_s: float) -> None:
        target = self.targets[k % len(self.targets)]
        self.offer.jobs += 1
        self.offer.tasks += len(self._tasks)
        self.offer.lags_s.append(lag_s)
        refusal = target.client.refused_unsent(BUSY_TRIES)
        if refusal is not None:  # its turn could not come in time: no call, no coroutine
            self.offer.errors[refusal.code().name] += 1
            return
        task = asyncio.create_task(self._submit(f"j{k:07d}", target))
        self.offer.inflight.add(task)
        task.add_done_callback(self.offer.inflight.discard)

    def _on_busy(self, _pause_s: float) -> None:
        self.offer.busy_retries += 1

    def _on_turn(self, waited_s: float, admitted: bool) -> None:
        if waited_s > TURN_WAITED_S:
            self.offer.turn_s[admitted].append(waited_s)

    async def _submit(self, job_id: str, target: Target) -> None:
        began = time.perf_counter()
        try:
            # A GM whose intake is full refuses at once and asks for a retry after a
            # pause: as a client would, within bounds; what still fails is reported.
            reply = await target.client.submit(
                self._tasks,
                queue=target.queue,
                job_id=job_id,
                busy_tries=BUSY_TRIES,
                on_busy=self._on_busy,
                on_answer=self.offer.answer_s.append,
                on_turn=self._on_turn,
            )
        except grpc.aio.AioRpcError as err:
            self.offer.errors[err.code().name] += 1
            return
        self.offer.rpc_s.append(time.perf_counter() - began)  # with any busy pauses
        acked = time.time_ns()
        for task_id in reply.task_ids:
            self.offer.accepted.add(task_id, job_id, target.scheduler_gm)
            if self.offer.attempts is not None:
                self.offer.attempts.submitted(task_id, target.queue, acked)


# ------------------------------------------------------------------------ progress
async def _keep_showing(progress: Progress, line: Callable[[], str]) -> None:
    """Redraw the progress line until cancelled (``Progress`` paces the redraws)."""
    try:
        while True:
            await asyncio.sleep(0.5)
            progress.show(line)
    finally:
        progress.done()


# --------------------------------------------------------------------------- the run
@dataclass
class BenchResult:
    summary: dict[str, Any]
    rows: Iterable[dict[str, Any]]  # made when iterated (TaskRows)
    alloc_values_s: list[float]
    files: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every task a GM acknowledged ran exactly once (refused submissions allowed:
        an overloaded run is a measurement, ``loadgen.saturation.verdict``)."""
        return verdict(self.summary).exit_code == 0


async def run_bench(
    options: BenchOptions, progress: Progress | None = None, say: Callable[[str], None] = print
) -> BenchResult:
    """Start the federation, offer the load, measure, write the report, stop everything."""
    options.check()
    prefix = f"bench-{uuid.uuid4().hex[:10]}"
    log_dir = options.log_dir or Path(tempfile.mkdtemp(prefix="megha-bench-"))
    if options.secure:
        from services.app.certs import issue

        options = dataclasses.replace(options, certs_dir=str(log_dir / "certs"))
        fed = parse_config(default_config(options.gms, options.lms))
        issue(Path(options.certs_dir), fed, users=["bench"])
        for key in ("queue.key", "seal.key"):
            (Path(options.certs_dir) / key).write_text(secrets.token_hex(32))
    config = free_config(options, prefix)
    if not broker_reachable(config.rabbitmq_url):
        raise BenchError(
            f"RabbitMQ is not reachable at {config.rabbitmq_url}; start it "
            "(e.g. 'rabbitmq-server -detached') or pass --rabbitmq-url"
        )
    progress = progress or Progress()
    workers = sum(group.count for group in config.workers)
    say(
        f"bench-live: starting {len(config.gms)} GMs, {len(config.lms)} LMs, {workers} workers "
        f"(prefix {prefix}, logs in {log_dir})"
    )
    load_before = _loadavg()
    setup_began = time.monotonic()
    try:
        async with running_federation(config, log_dir, options.service_log_level) as children:
            setup_s = time.monotonic() - setup_began
            say(f"bench-live: federation ready in {setup_s:.1f} s; offering load")
            result = await children.guard(_measure(options, config, progress, children))
            result.summary["setup_s"] = round(setup_s, 3)
            # Every process shares this host's CPUs: a busy host makes every hop slower.
            result.summary["host"] = {
                "cpus": os.cpu_count(),
                "loadavg_1m_before": load_before,
                "loadavg_1m_after": _loadavg(),
            }
            result.summary["log_dir"] = str(log_dir)
    except ChildDied as err:
        head, _, tail = str(err).partition("\n")
        last = next((ln for ln in reversed(tail.splitlines()) if ln.strip()), "")
        raise BenchError(f"{head} (last log line: {last[:300]}; logs in {log_dir})") from None
    except TimeoutError as err:
        raise BenchError(f"the federation did not get ready: {err} (logs in {log_dir})") from None
    except grpc.aio.AioRpcError as err:
        raise BenchError(
            f"a GM did not answer: {err.code().name}: {err.details()} (logs in {log_dir})"
        ) from None
    except (AMQPError, ConnectionError) as err:
        raise BenchError(f"RabbitMQ at {config.rabbitmq_url} failed: {err!r}") from None
    if options.out is not None:
        result.files = write_report(options.out, result)
    return result


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


_HOST = "(host)"  # ProcessMeter's key for the whole host's busy CPU time


class ProcessMeter:
    """CPU seconds each process used over a window, and its resident memory at both ends,
    read from /proc (Linux only).

    Every process of the run shares this host's CPUs, so "who burns the CPU" tells where
    the time goes better than a profile of one process. RabbitMQ is included when it runs
    here (it may also serve other clients). Memory that grows with the tasks run is what
    a long-lived federation must have room for (GMs and LMs remember ended tasks, up to
    their bounds).
    """

    def __init__(self, pids: dict[str, int], broker_url: str = "") -> None:
        self.pids = dict(pids)
        broker = _broker_pid(broker_url)
        if broker is not None:
            self.pids["rabbitmq"] = broker
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._page_mb = (os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096) / 2**20
        self._began: dict[str, float] = {}
        self._began_at = 0.0
        self._rss_began: dict[str, float] = {}
        self._samples: list[tuple[float, dict[str, float]]] = []

    def start(self) -> None:
        self._began, self._began_at = self._read(), time.monotonic()
        self._rss_began = self._rss()
        self._samples = [(0.0, self._rss_began)]

    def sample(self) -> None:
        """Note every process's resident memory now (``memory`` reports the series)."""
        self._samples.append((time.monotonic() - self._began_at, self._rss()))

    def memory(self, tasks: int) -> dict[str, Any] | None:
        """Each process's resident MB at ``start`` and now, its growth in KB per task, and
        the series of ``sample`` calls (seconds since ``start``, MB per process)."""
        self.sample()
        ended = self._samples[-1][1]
        both = [n for n in ended if n in self._rss_began]
        if not both:
            return None
        return {
            "rss_mb": {n: [round(self._rss_began[n], 1), round(ended[n], 1)] for n in both},
            "kb_per_task": {
                n: round(1024 * (ended[n] - self._rss_began[n]) / max(1, tasks), 3) for n in both
            },
            "series": {
                "t_s": [round(t, 1) for t, _ in self._samples],
                "rss_mb": {n: [round(r.get(n, 0.0), 1) for _, r in self._samples] for n in both},
            },
        }

    def _rss(self) -> dict[str, float]:
        out = {}
        for name, pid in self.pids.items():
            with contextlib.suppress(OSError, IndexError, ValueError):
                pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
                out[name] = pages * self._page_mb
        return out

    def stop(self, tasks: int) -> dict[str, Any] | None:
        """``cores`` (CPU seconds per second) of the run, per process % of one core and ms
        per task, and ``other_cores``: what the rest of the host used meanwhile."""
        ended, window = self._read(), time.monotonic() - self._began_at
        used = {n: ended[n] - self._began[n] for n in ended if n in self._began}
        if not used or window <= 0:
            return None
        host = ended.pop(_HOST, None), self._began.get(_HOST)
        used.pop(_HOST, None)
        ours = sum(used.values())
        other = None if None in host else max(0.0, host[0] - host[1] - ours) / window
        return {
            "window_s": round(window, 3),
            "cores": round(ours / window, 3),
            "other_cores": None if other is None else round(other, 3),
            "percent_of_core": {n: round(100 * v / window, 1) for n, v in used.items()},
            "ms_per_task": {n: round(1e3 * v / max(1, tasks), 3) for n, v in used.items()},
        }

    def _read(self) -> dict[str, float]:
        out = {}
        with contextlib.suppress(OSError, IndexError, ValueError):
            # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
            ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
            out[_HOST] = (sum(ticks) - ticks[3] - ticks[4]) / self._ticks
        for name, pid in self.pids.items():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            out[name] = (int(fields[11]) + int(fields[12])) / self._ticks  # utime + stime
        return out


async def _keep_sampling(meter: ProcessMeter, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        meter.sample()


def _broker_pid(url: str) -> int | None:
    """The local RabbitMQ node serving ``url``: the ``beam.smp`` that listens on its
    port (another node may run beside it), else the first ``beam.smp``; None if none."""
    port = amqp_port(url) if url else 0
    listening = _listening_inodes(port) if port else set()
    first = None
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if b"beam.smp" not in (entry / "cmdline").read_bytes().split(b"\0")[0]:
                    continue
                first = first or int(entry.name)
                sockets = {os.readlink(fd) for fd in (entry / "fd").iterdir()}
                if any(f"socket:[{inode}]" in sockets for inode in listening):
                    return int(entry.name)
    return first


def _listening_inodes(port: int) -> set[str]:
    """Inodes of the TCP sockets listening on ``port`` (/proc/net/tcp and tcp6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                # local address "ADDR:PORT" in hex, state 0A is LISTEN, inode is field 9
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    inodes.add(fields[9])
    return inodes


async def _measure(
    options: BenchOptions, config: FederationConfig, progress: Progress, children: Children
) -> BenchResult:
    events = EventLog()
    bus = RabbitBus(config.broker_url("reader"), prefix=config.exchange_prefix)
    streaming = options.submit == "stream"
    if options.file_queues:
        # Jobs round-robin over the queues, each submitted to the GM that serves it.
        endpoints = {gm.id: gm.target for gm in config.gms}
        targets = [
            Target(q.gm, GlobalMasterClient(endpoints[q.gm], streaming), q.name, q.gm)
            for q in options.file_queues
        ]
    else:
        targets = [
            Target(
                gm.id,
                GlobalMasterClient(gm.target, streaming),
                queue=_queue_for(config, gm.id),
                scheduler_gm=config.queue(_queue_for(config, gm.id)).gm,  # type: ignore[union-attr]
            )
            for gm in config.gms
        ]
    offer = LoadOffer(options, targets)
    attempts = LiveAttempts(options.file_queues) if options.file_queues else None
    offer.offer.attempts = attempts

    async def on_batch(key: str, body: bytes) -> None:
        await events.on_batch(key, body)
        if attempts is not None:
            now = time.time_ns()
            for event in common_pb2.TaskEventBatch.FromString(body).events:
                attempts.add_event(event, now)

    phase = ["offering"]

    def line() -> str:
        o = offer.offer
        errors = sum(o.errors.values())
        return (
            f"[{phase[0]}] offered {o.tasks}  accepted {len(o.accepted)}  "
            f"running {len(events.running)}  done {events.succeeded}"
            + (f"  submit errors {errors}" if errors else "")
        )

    async with bus:
        await bus.subscribe_topic(EVENT_EXCHANGE, EVERY_TASK_EVENT, on_batch)
        reporter = asyncio.create_task(_keep_showing(progress, line))
        pids = {"loadgen": os.getpid()} | {n: p.pid for n, p in children.procs.items()}
        texts_before = await scrape(config)  # the services' stalls count from here
        meter = ProcessMeter(pids, config.rabbitmq_urls[0])
        meter.start()
        every_s = max(0.2, min(MEMORY_SAMPLE_S, options.seconds / 10))  # 10 or more samples
        sampler = asyncio.create_task(_keep_sampling(meter, every_s))
        # The load generator's own stalls delay the load it offers, then bunch it up.
        settle()
        tally = StallTally()
        watcher = asyncio.create_task(watch_stalls(tally=tally))
        began = time.monotonic()
        drained = False
        try:
            await offer.run()
            phase[0] = "draining"
            drained = await _drain(offer.offer, events, options.seconds + DRAIN_EXTRA_S)
        finally:
            wall_s = time.monotonic() - began
            clients = {id(t.client): t.client for t in targets}.values()
            offer.offer.throttled = sum(client.throttled for client in clients)
            offer.offer.unsent = sum(client.unsent for client in clients)
            offer.offer.not_admitted = sum(client.not_admitted for client in clients)
            cpu = meter.stop(len(offer.offer.accepted))
            memory = meter.memory(len(offer.offer.accepted))
            for loop_task in (reporter, sampler, watcher):
                loop_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop_task
            if offer.offer.inflight:  # given up on at the drain's bound: never answered
                offer.offer.errors[UNANSWERED] += len(offer.offer.inflight)
            for task in list(offer.offer.inflight):
                task.cancel()
            await asyncio.gather(*offer.offer.inflight, return_exceptions=True)
            for target in targets:
                await target.client.close()
        texts = await scrape(config)
    counters = counters_from(texts) if texts is not None else None
    result = summarise(options, config, offer.offer, events, wall_s, counters)
    result.summary["stalls"] = {
        **(stalls_from(texts, texts_before) if texts is not None else {}),
        "loadgen": tally.as_dict(),
    }
    if texts is not None:  # where a try's wait went: the GM's part of it, and the broker's
        result.summary["gm_answer_s"] = histogram_from(texts, "megha_submission_answer_seconds")
        result.summary["gm_round_s"] = histogram_from(texts, "megha_schedule_round_seconds")
        result.summary["broker_confirm_s"] = histogram_from(texts, "megha_broker_confirm_seconds")
        result.summary["gm_read_wait_s"] = histogram_from(
            texts, "megha_submission_read_wait_seconds"
        )
    result.summary["cpu"] = cpu
    result.summary["memory"] = memory
    result.summary["submit_api"] = "SubmitStream" if streaming else "SubmitJob"
    result.summary["drain_timed_out"] = not drained
    if attempts is not None:
        add_queue_report(result.summary, options, config, attempts)
    return result


def add_queue_report(
    summary: dict[str, Any],
    options: BenchOptions,
    config: FederationConfig,
    attempts: LiveAttempts,
) -> None:
    """summary.json's ``"queues"`` (replacing the mode keyword ``file``): configured vs
    measured share while every queue was backlogged."""
    total = sum((parse_resources(g.capacity) * g.count for g in config.workers), start=0)
    rows = attempts.attempts(options.cpu_milli, options.memory_mb)
    measured, window = measured_shares(rows, attempts.queues, float(total[0]), float(total[1]))
    summary["queues"] = summary_queues(
        options.file_queues,
        measured,
        attempts.preempted,
        attempts.tasks_per_queue(),
        peak_held(rows, attempts.queues),
    )
    summary["queues_backlogged_s"] = window


def _queue_for(config: FederationConfig, gm_id: str) -> str:
    own = config.queues_of(gm_id)
    return own[0].name if own else config.effective_queues()[0].name


async def _drain(offer: Offer, events: EventLog, bound_s: float) -> bool:
    """Until every accepted task has ended and no submission is in flight (True), or the
    bound passed (False)."""
    deadline = time.monotonic() + bound_s
    waiting: set[str] | None = None
    while time.monotonic() < deadline:
        if offer.inflight:
            waiting = None  # accepted may still grow
        else:
            if waiting is None:
                waiting = await _not_ended(offer.accepted, events)
            else:
                waiting = {t for t in waiting if t not in events.ended}
            if not waiting:
                return True
        await asyncio.sleep(0.05)
    return False


async def _not_ended(task_ids: Iterable[str], events: EventLog, chunk: int = 20_000) -> set[str]:
    """The tasks of ``task_ids`` that have not ended, yielding to the loop every ``chunk``
    tasks: one pass over 540,000 of them held it 0.3 s while events arrived."""
    out: set[str] = set()
    for n, task_id in enumerate(task_ids, 1):
        if task_id not in events.ended:
            out.add(task_id)
        if n % chunk == 0:
            await asyncio.sleep(0)
    return out


def summarise(
    options: BenchOptions,
    config: FederationConfig,
    offer: Offer,
    events: EventLog,
    wall_s: float,
    counters: dict[str, int] | None,
) -> BenchResult:
    warmup_end = offer.started_ns + int(options.warmup_s * 1e9)
    measured = events.measure(offer.accepted, started_from_ns=warmup_end)
    throughput = report.placement_rate(measured.started_ns)
    offer_s = max(1e-9, (offer.ended_ns - offer.started_ns) / 1e9)
    failed = sum(1 for t in offer.accepted if t in events.ended and t not in events.successes)
    completed = sum(1 for t in offer.accepted if t in events.successes)
    summary = report.make_summary(
        target="live",
        scheduler="megha",
        workers=sum(group.count for group in config.workers),
        gms=len(config.gms),
        lms=len(config.lms),
        jobs=offer.jobs,
        tasks=offer.tasks,
        completed=completed,
        alloc_s=report.percentiles(measured.alloc_s),
        components_s=report.component_medians(map(events.stamps, measured.task_ids)),
        **(counters or {}),
        throughput_tasks_per_s=round(throughput, 3),
        wall_s=round(wall_s, 3),
        offered_rate=options.rate,
        achieved_offer_rate=round(offer.tasks / offer_s, 3),
        seconds=options.seconds,
        warmup_s=options.warmup_s,
        tasks_per_job=options.tasks_per_job,
        task_duration_s=options.task_duration_s,
        queues=options.queues,
        accepted=len(offer.accepted),
        submit_errors=dict(offer.errors),
        refused_tasks=offer.tasks - len(offer.accepted),
        busy_retries=offer.busy_retries,
        # Tries a client kept back, answered by itself without a message (AdaptiveThrottle).
        throttled_tries=offer.throttled,
        # Tries a client's stream did not send in time, answered by itself (NotSent).
        unsent_tries=offer.unsent,
        not_admitted_jobs=offer.not_admitted,
        failed=failed,
        duplicates=events.duplicates,
        # Tasks of submissions never acknowledged (e.g. DEADLINE_EXCEEDED) that ran
        # anyway: the GM queued them after all; at most once each, as ``duplicates`` says.
        unacknowledged_ran=max(0, events.succeeded - completed),
        measured_tasks=len(measured.task_ids),
        excluded_warmup=measured.allocated - len(measured.task_ids),
        counters_source="prometheus" if counters is not None else "unavailable (left 0)",
        detail_s=report.detail_percentiles(map(events.stamps, measured.task_ids)),
        offer_lag_s=report.percentiles(offer.lags_s),
        submit_rpc_s=report.percentiles(offer.rpc_s),
        # Each try's wait for its answer (accepted or refused), without the busy pauses:
        # issue 32 asks every one within 1 s.
        submit_answer_s=report.percentiles(offer.answer_s),
        answers_over_1s=sum(1 for took in offer.answer_s if took > 1.0),
        tries_sent=len(offer.answer_s),  # each one a message a GM read and answered
        # Jobs that waited their turn at a client's gate, and how long: those whose turn
        # came, and those refused unsent after waiting (those refused at once are in
        # ``not_admitted_jobs`` only).
        turn_waited_s=report.percentiles(offer.turn_s[True]),
        turn_waited_jobs=len(offer.turn_s[True]),
        turn_refused_s=report.percentiles(offer.turn_s[False]),
        turn_refused_jobs=len(offer.turn_s[False]),
        events_seen=events.events,
        # What every subscriber of the events exchange (each GM too) reads, in messages.
        event_messages_seen=events.batches,
        exchange_prefix=config.exchange_prefix,
    )
    judged = verdict(summary)
    summary["verdict"] = {"kind": judged.kind, "reasons": list(judged.reasons)}
    return BenchResult(summary, TaskRows(events, offer.accepted), measured.alloc_s)


def write_report(out_dir: Path, result: BenchResult) -> list[Path]:
    files = [
        report.write_summary(out_dir, result.summary),
        report.write_tasks_csv(out_dir, result.rows),
    ]
    s = result.summary
    cdf = report.write_cdf_png(
        out_dir,
        result.alloc_values_s,
        title=f"megha live: {s['offered_rate']:g} tasks/s offered, {s['gms']} GMs, "
        f"{s['lms']} LMs, {s['workers']} workers",
    )
    if cdf is not None:
        files.append(cdf)
    memory = (s.get("memory") or {}).get("series")
    if memory and len(memory["t_s"]) >= 3:
        plotted = report.plot_series(
            memory["t_s"],
            memory["rss_mb"],
            out_dir / "memory.png",
            title=f"resident memory, {s['offered_rate']:g} tasks/s offered",
            xlabel="seconds since the offer began",
            ylabel="MB",
        )
        if plotted is not None:
            files.append(plotted)
    return files


def _answers_line(s: dict[str, Any]) -> str:
    answer = s.get("submit_answer_s") or {}
    if answer.get("max") is None:
        return "answers                none"
    return (
        f"answers                each try's wait p50 {report.ms(answer['p50'])} ms, "
        f"p99 {report.ms(answer['p99'])} ms, max {report.ms(answer['max'])} ms; "
        f"{s.get('answers_over_1s', 0)} of {s.get('tries_sent', '?')} over 1 s"
        f"{_at_the_gms(s)}{_turns(s)}"
    )


def _turns(s: dict[str, Any]) -> str:
    """How long jobs waited their turn at the clients' gates before their first try."""
    said = ""
    for key, what in (("turn_waited", "had it"), ("turn_refused", "were refused unsent")):
        waited = s.get(f"{key}_s") or {}
        if waited.get("max") is not None:
            jobs = s.get(f"{key}_jobs", "?")
            said += (
                f"; {jobs} jobs waited their turn at a client and {what}: p50 "
                f"{report.ms(waited['p50'])} ms, max {report.ms(waited['max'])} ms"
            )
    return said


def _at_the_gms(s: dict[str, Any]) -> str:
    """Where a try's wait went, as bucket bounds from the GMs' histograms: in front of
    their read (streamed jobs), from their read to their answer (jobs they took on), and
    the broker's confirm within that."""

    gm, confirm = s.get("gm_answer_s"), s.get("broker_confirm_s")
    if not gm:
        return ""
    said = ""
    if wait := s.get("gm_read_wait_s"):
        said += f"; before the GMs' read p50 {_bound(wait['p50_le'])}, p99 {_bound(wait['p99_le'])}"
    said += f"; at the GMs p50 {_bound(gm['p50_le'])}, p99 {_bound(gm['p99_le'])}"
    if confirm:
        said += (
            f" (broker confirm p50 {_bound(confirm['p50_le'])}, p99 {_bound(confirm['p99_le'])})"
        )
    return said


def _events_line(s: dict[str, Any]) -> str:
    """What each subscriber of the events exchange read, per task that ran."""
    ran = max(1, s["completed"] + s.get("unacknowledged_ran", 0))
    messages = s.get("event_messages_seen", 0)
    return (
        f"task events            {s['events_seen']} in {messages} messages to every "
        f"subscriber (each GM too): {s['events_seen'] / ran:.2f} events and "
        f"{messages / ran:.3f} messages per task"
    )


def _queue_messages_line(s: dict[str, Any]) -> str | None:
    """How many jobs each durable queue message carried (``TaskBatch.more_jobs``)."""
    messages = s.get("queue_messages", 0)
    if not messages:
        return None
    jobs = s.get("queue_message_jobs", 0)
    return (
        f"queue messages         {jobs} jobs in {messages} messages to the user queues: "
        f"{jobs / messages:.2f} jobs a message (a publish, a confirm, a delivery and an ack "
        "each)"
    )


def render(result: BenchResult) -> str:
    s = result.summary
    lag = s["offer_lag_s"]
    lines = [
        report.render_summary(s),
        f"load generator         offered {s['achieved_offer_rate']:.0f} tasks/s "
        f"(lag p99 {report.ms(lag['p99'])} ms, max {report.ms(lag['max'])} ms), "
        f"{s.get('submit_api', 'SubmitJob')} p50 {report.ms(s['submit_rpc_s']['p50'])} ms",
        _answers_line(s),
        _events_line(s),
        *filter(None, [_queue_messages_line(s)]),
        f"percentiles over {s['measured_tasks']} tasks that started after the "
        f"{s['warmup_s']:g} s warm-up ({s['excluded_warmup']} warm-up tasks excluded)",
    ]
    if s.get("drain_timed_out"):
        lines.append(
            f"gave up waiting {s['seconds'] + DRAIN_EXTRA_S:g} s after the offer: "
            f"{s['accepted'] - s['completed'] - s['failed']} accepted tasks had not ended"
        )
    if s["submit_errors"] or s.get("busy_retries"):
        codes = "  ".join(f"{code} {n}" for code, n in sorted(s["submit_errors"].items()))
        lines.append(
            f"refused submissions    {s['refused_tasks']} tasks not acknowledged "
            f"(jobs by gRPC code: {codes or 'none'}); {s.get('busy_retries', 0)} busy retries"
            + (
                f"; {s['throttled_tries']} tries kept back by the clients (throttled: no "
                "message sent)"
                if s.get("throttled_tries")
                else ""
            )
            + (
                f"; {s['unsent_tries']} tries not sent within {SEND_WITHIN_S:g} s (the GMs "
                "read slower than the clients asked)"
                if s.get("unsent_tries")
                else ""
            )
            + (
                f"; {s['not_admitted_jobs']} jobs never sent (their turn among a client's "
                f"{IN_FLIGHT} jobs in flight did not come in time)"
                if s.get("not_admitted_jobs")
                else ""
            )
            + (
                f"; {s['unacknowledged_ran']} unacknowledged tasks ran anyway"
                if s.get("unacknowledged_ran")
                else ""
            )
        )
    judged = s.get("verdict")
    if judged:
        if judged["kind"] == EXACTLY_ONCE:
            text = "every offered task ran exactly once"
        elif judged["kind"] == SATURATED:
            text = (
                f"saturated: offered {s['achieved_offer_rate']:.0f} tasks/s, placed "
                f"{s['throughput_tasks_per_s']:.0f}/s; every acknowledged task ran exactly "
                "once; " + "; ".join(judged["reasons"])
            )
        else:
            text = "EXACTLY-ONCE BREACH: " + "; ".join(judged["reasons"])
        lines.append(f"verdict                {text}")
    if s["failed"]:
        lines.append(f"failed tasks           {s['failed']}")
    cpu = s.get("cpu")
    if cpu:
        busiest = sorted(cpu["percent_of_core"].items(), key=lambda kv: -kv[1])
        cores = os.cpu_count() or 1
        lines.append(
            f"CPU, % of one core     total {100 * cpu['cores']:.0f} of {100 * cores}: "
            + "  ".join(f"{n} {v:.0f}" for n, v in busiest)
            + (
                f"  (rest of the host {100 * cpu['other_cores']:.0f})"
                if cpu.get("other_cores") is not None
                else ""
            )
        )
    memory = s.get("memory")
    if memory:
        grew = sorted(memory["rss_mb"].items(), key=lambda kv: kv[1][1] - kv[1][0], reverse=True)
        lines.append(
            "memory, MB resident    "
            + "  ".join(f"{n} {a:.0f}->{b:.0f}" for n, (a, b) in grew[:6])
            + "  (KB per task: "
            + ", ".join(f"{n} {memory['kb_per_task'][n]:.2f}" for n, _ in grew[:3])
            + ")"
        )
    stalls = s.get("stalls")
    if stalls:
        lines.append(render_stalls(stalls) + _rounds_said(s.get("gm_round_s")))
    other = (cpu or {}).get("other_cores")
    if other is not None and other > 0.2:
        lines.append(
            f"note: other processes on this host used {100 * other:.0f}% of a core meanwhile; "
            "every hop waits for CPU, so these latencies are pessimistic"
        )
    if isinstance(s.get("queues"), dict):  # --queues FILE; else the keyword
        lines.append(render_queues(s["queues"], s["queues_backlogged_s"]))
    if s["counters_source"] != "prometheus":
        lines.append("inconsistency/repartition/preemption counts unavailable (left 0)")
    for path in result.files:
        lines.append(f"wrote {path}")
    return "\n".join(lines)


def _bound(edge: float | None) -> str:
    """A histogram bucket's upper edge as the reports print it (None: past the last)."""
    return "> 100 s" if edge is None else f"<= {report.ms(edge)} ms"


def _rounds_said(rounds: dict[str, Any] | None) -> str:
    """How long the GMs' scheduling rounds held their loops (``RoundBudget``)."""
    if not rounds or not rounds["count"]:
        return ""

    p50, p99 = _bound(rounds["p50_le"]), _bound(rounds["p99_le"])
    return f"; GM rounds {rounds['count']}, p50 {p50}, p99 {p99}"


def render_stalls(stalls: dict[str, dict[str, Any]]) -> str:
    """One line: each process's event-loop stalls and the time its full collections took."""

    def one(name: str, st: dict[str, Any]) -> str:
        count, seconds = st["gc"].get("2", [0, 0.0])
        stalled = f"{st['stalls']} stalls" + (
            f" ({st.get('busy_stalls', 0)} the loop's own work, worst <= "
            f"{st['worst_lag_le_s']:g} s)"
            if st["stalls"]
            else ""
        )
        return f"{name} {stalled}, gen-2 gc {count}x {seconds:.2f} s"

    return f"loop stalls > {STALL_S:g} s    " + "  ".join(one(n, st) for n, st in stalls.items())


def run(options: BenchOptions) -> int:
    """The CLI entry: 0 = every acknowledged task completed exactly once (submissions a
    saturated federation refused are reported, not failed), 1 = an acknowledged task was
    lost or ran twice, 2 = could not run."""
    return run_main(lambda: run_bench(options), lambda result: (render(result), result.ok))


def run_main(
    measure: Callable[[], Coroutine[Any, Any, T]], show: Callable[[T], tuple[str, bool]]
) -> int:
    """Run ``measure()`` with SIGTERM/Ctrl-C stopping the federation, then print ``show``'s
    text; 0 when it says ok, 1 when not, 130 when interrupted."""

    async def main() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)  # SIGINT: asyncio.run cancels
        try:
            return await measure()
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        result = asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("megha-loadgen: interrupted; the federation was stopped", file=sys.stderr)
        return 130
    text, ok = show(result)
    print(text, flush=True)
    return 0 if ok else 1
