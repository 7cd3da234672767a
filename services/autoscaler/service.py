"""``megha autoscale``: grows the pools of ``autoscale`` ahead of demand and shrinks them
when their nodes idle. Each node is a ``megha worker --pool P --slot S`` process.

    every interval_s:
      each GM ──GetClusterView(pending_shapes)──▶ waiting tasks by shape and constraints
      each pool's LM ──GetState, DrainNode(query)──▶ the pool's nodes: alive, draining, tasks
        ──services/core/autoscale.pool_demand──▶ nodes needed now (waiting + busy)
        ──history file──▶ ForecastDemand (the predictor sidecar; in-process without one)
        ──▶ target per pool = max(forecast, demand now) ──decide──▶
      start processes · DrainNode(undo) · DrainNode idle ones · stop drained ones (SIGTERM)

What it keeps in ``state_dir``: ``history.jsonl`` (demand per interval: the forecast's
input, so daily and weekly seasons survive a restart) and ``nodes.json`` (the processes it
started). Its nodes run in their own sessions: a crashed autoscaler leaves them running and
the next one adopts them. A stopped one (SIGTERM, Ctrl-C) stops them, as ``megha up``
stops its workers; their tasks are re-queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from prometheus_client import Gauge

from services._proto.megha.v1 import (
    local_master_pb2,
    local_master_pb2_grpc,
    predictor_pb2,
    predictor_pb2_grpc,
)
from services.common.client import GlobalMasterClient
from services.common.config import AutoscaleConfig, FederationConfig
from services.common.convert import resources_from_proto, resources_to_proto
from services.common.nodes import NodeRow, lm_nodes, node_rows
from services.common.server import channel, wait_all_healthy
from services.core.autoscale import (
    ALIVE,
    DRAINING,
    STARTING,
    Pool,
    PoolNode,
    ScaleDecision,
    active_nodes,
    busy_nodes,
    decide,
    pool_demand,
)
from services.core.constraints import to_mask
from services.core.forecast import Seasons
from services.core.resources import NUM_RESOURCES, parse_resources
from services.predictor.demand import (
    LAGS,
    MAX_HISTORY_DAYS,
    MAX_HISTORY_INTERVALS,
    METHOD_NAMES,
    forecast_demand,
)
from services.worker.leftovers import proc_stat

log = logging.getLogger("megha.autoscaler")

NODES = Gauge("megha_autoscale_nodes", "Nodes of an autoscale pool, by state.", ["pool", "state"])
DEMAND = Gauge("megha_autoscale_demand_nodes", "Nodes a pool's demand needs now.", ["pool"])
TARGET = Gauge("megha_autoscale_target_nodes", "Nodes a pool is sized to.", ["pool"])
UNPLACED = Gauge(
    "megha_autoscale_unplaced_tasks", "Waiting tasks no pool can hold (too big, constraints)."
)

_METHODS = {
    "auto": predictor_pb2.FORECAST_METHOD_UNSPECIFIED,
    "reactive": predictor_pb2.FORECAST_METHOD_NAIVE,
    "seasonal": predictor_pb2.FORECAST_METHOD_SEASONAL,
    "gradient-boosted": predictor_pb2.FORECAST_METHOD_GRADIENT_BOOSTED,
}
STOP_GRACE_S = 8.0  # a node's process that outlives SIGTERM this long is killed (within
# the 10 s megha up gives its children to stop, so none outlives the autoscaler)
# A node whose process exits this soon after its start failed to start. After
# QUICK_EXITS such failures of a pool within QUICK_EXIT_WINDOW_S, no node of the pool is
# started for BACKOFF_S: a pool that cannot start (a bad capacity for this host, a
# config the worker cannot read) is said once a while, not restarted every interval.
QUICK_EXIT_S = 30.0
QUICK_EXITS = 3
QUICK_EXIT_WINDOW_S = 300.0
BACKOFF_S = 120.0
STARTUP_WAIT_S = 60.0  # for the federation to answer before the first look


def state_dir(config: FederationConfig) -> Path:
    auto = config.autoscale
    assert auto is not None
    if auto.state_dir:
        return Path(auto.state_dir)
    return (
        Path(tempfile.gettempdir()) / f"megha-{os.getuid()}" / f"{config.exchange_prefix}-autoscale"
    )


def pools_of(auto: AutoscaleConfig) -> list[Pool]:
    return [
        Pool(
            name=p.name,
            shape=parse_resources(p.capacity),
            mask=to_mask(p.constraints),
            low=p.min,
            high=p.max,
        )
        for p in auto.pools
    ]


# ------------------------------------------------------------------------ processes
@dataclass
class NodeProcess:
    pool: str
    slot: int
    pid: int
    popen: subprocess.Popen | None = None  # None: adopted from an earlier autoscaler
    started: float = field(default_factory=time.monotonic)

    def running(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _is_node_process(self.pid, self.pool, self.slot)


def _is_node_process(pid: int, pool: str, slot: int) -> bool:
    """``pid`` is alive and is that pool's node (not a pid the kernel reused)."""
    fields = proc_stat(pid)
    if fields is None or fields[0] in (b"Z", b"X"):  # gone, or a zombie
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    want = [b"--pool", pool.encode(), b"--slot", str(slot).encode()]
    return any(argv[i : i + 4] == want for i in range(len(argv)))


class NodeProcesses:
    """The worker processes this autoscaler runs, by node id; ``nodes.json`` records them."""

    def __init__(
        self, config: FederationConfig, config_path: str, directory: Path, log_dir: Path
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.file = directory / "nodes.json"
        self.log_dir = log_dir
        self.procs: dict[str, NodeProcess] = {}

    def adopt(self) -> list[str]:
        """Take over the nodes an earlier autoscaler started that still run."""
        try:
            recorded = json.loads(self.file.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as err:
            log.warning("ignoring %s: %s", self.file, err)
            return []
        for node_id, entry in recorded.items():
            try:  # ConfigError (a pool no longer configured) is a ValueError
                proc = NodeProcess(str(entry["pool"]), int(entry["slot"]), int(entry["pid"]))
                self.config.pool(proc.pool)
            except (KeyError, TypeError, ValueError) as err:
                log.warning("%s: %s: %s; not adopted", self.file, node_id, err)
                continue
            if proc.running():
                self.procs[node_id] = proc
        self._save()
        return sorted(self.procs)

    def start(self, pool: str, slot: int) -> str:
        node_id = self.config.pool(pool).node_id(slot)
        config = ["--config", self.config_path] if self.config_path else []
        argv = [sys.executable, "-m", "services.cli", "worker", *config, "--pool", pool]
        argv += ["--slot", str(slot)]
        with open(self.log_dir / f"{node_id}.log", "ab") as out:
            popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs[node_id] = NodeProcess(pool, slot, popen.pid, popen)
        self._save()
        return node_id

    def gone(self) -> list[tuple[str, NodeProcess]]:
        """Forget the nodes whose process ended by itself (crashed); them."""
        ended = [(n, p) for n, p in self.procs.items() if not p.running()]
        for node_id, _ in ended:
            del self.procs[node_id]
        if ended:
            self._save()
        return ended

    def log_tail(self, node_id: str, chars: int = 400) -> str:
        try:
            text = (self.log_dir / f"{node_id}.log").read_text(errors="replace")
        except OSError:
            return ""
        return " ".join(text[-chars:].split())

    async def stop(self, node_id: str) -> None:
        proc = self.procs.pop(node_id, None)
        self._save()
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while proc.running() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if proc.running():
            log.warning("node %s did not stop in %g s: killing it", node_id, STOP_GRACE_S)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        if proc.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(1)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(n) for n in list(self.procs)))

    def _save(self) -> None:
        data = {n: {"pool": p.pool, "slot": p.slot, "pid": p.pid} for n, p in self.procs.items()}
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.file)


# ------------------------------------------------------------------------ history
class History:
    """Demand per interval (nodes per pool), oldest first, appended to ``history.jsonl``.
    A file written for other pools is set aside, not mixed in."""

    def __init__(self, path: Path, pools: Sequence[str], keep: int) -> None:
        self.path = path
        self.pools = list(pools)
        self.keep = keep
        self.samples: list[tuple[float, list[int]]] = []
        self._load()

    def _load(self) -> None:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
                if row["pools"] != self.pools:
                    raise ValueError(f"pools {row['pools']}, not {self.pools}")
                rows.append((float(row["t"]), [int(c) for c in row["nodes"]]))
            except (ValueError, KeyError, TypeError) as err:
                aside = self.path.with_suffix(f".{int(time.time())}.old")
                log.warning("history %s does not fit these pools (%s): moved to %s",
                            self.path, err, aside)  # fmt: skip
                os.replace(self.path, aside)
                return
        self.samples = rows[-self.keep :]

    def _line(self, unix_s: float, nodes: Sequence[int]) -> str:
        return json.dumps({"t": unix_s, "pools": self.pools, "nodes": list(nodes)}) + "\n"

    def add(self, unix_s: float, nodes: Sequence[int]) -> None:
        if self.samples and unix_s <= self.samples[-1][0]:
            unix_s = self.samples[-1][0] + 1e-3  # the clock stepped back: keep the order
        self.samples.append((unix_s, [int(n) for n in nodes]))
        with self.path.open("a") as out:
            out.write(self._line(unix_s, nodes))
        if len(self.samples) > 2 * self.keep:  # rewrite now and then, not every interval
            self.samples = self.samples[-self.keep :]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(self._line(t, n) for t, n in self.samples))
            os.replace(tmp, self.path)


def forecast_method(method: str, history: int, interval_s: float) -> int:
    """The method to ask for: the configured one once the history supports it, the
    demand now (reactive) until then."""
    wanted = _METHODS[method]
    day = Seasons.for_interval(interval_s).day
    need = {
        predictor_pb2.FORECAST_METHOD_SEASONAL: day + 1,
        predictor_pb2.FORECAST_METHOD_GRADIENT_BOOSTED: day + LAGS,
    }.get(wanted, 0)
    return wanted if history >= need else predictor_pb2.FORECAST_METHOD_NAIVE


# ------------------------------------------------------------------------ the loop
@dataclass
class Look:
    """One interval: what was seen, what was asked for, what was done."""

    demand: np.ndarray  # nodes needed now, per pool: busy ones + the waiting tasks'
    waiting: np.ndarray  # waiting tasks counted for each pool
    unplaced: int  # waiting tasks no pool can hold
    target: np.ndarray  # max(forecast, demand), within the pool's min and max
    method: str
    nodes: list[PoolNode]
    decision: ScaleDecision


class Autoscaler:
    def __init__(
        self,
        config: FederationConfig,
        config_path: str,
        log_dir: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert config.autoscale is not None, "the config has no autoscale section"
        self.config = config
        self.auto: AutoscaleConfig = config.autoscale
        self.pools = pools_of(self.auto)
        self.dir = state_dir(config)
        self.dir.mkdir(parents=True, exist_ok=True)
        log_dir = log_dir or self.dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs = NodeProcesses(config, config_path, self.dir, log_dir)
        day = Seasons.for_interval(self.auto.interval_s).day
        self.history = History(
            self.dir / "history.jsonl",
            [p.name for p in self.pools],
            min(day * MAX_HISTORY_DAYS, MAX_HISTORY_INTERVALS),  # what ForecastDemand uses
        )
        self.clock = clock
        self.idle_since: dict[str, float] = {}
        self.drained: set[str] = set()  # nodes this autoscaler drained (it may undo those)
        self._quick_exits: dict[str, deque[float]] = {}  # per pool: nodes that failed to start
        self._held_until: dict[str, float] = {}  # per pool: no start before (monotonic)
        self._gms = [GlobalMasterClient(gm.target) for gm in config.gms]

    async def close(self) -> None:
        for client in self._gms:
            await client.close()

    # ---- looking
    async def _waiting(self) -> tuple[np.ndarray, list[int], list[int]]:
        """Waiting tasks of every GM: (shapes (N, R), masks, counts)."""
        views = await asyncio.gather(
            *(c.cluster(pending_shapes=True) for c in self._gms), return_exceptions=True
        )
        shapes, masks, counts = [], [], []
        for gm, view in zip(self.config.gms, views, strict=True):
            if isinstance(view, BaseException):
                log.warning("GM %s did not answer (%s): its waiting tasks are not counted",
                            gm.id, _why(view))  # fmt: skip
                continue
            for shape in view.pending_shapes:
                shapes.append(resources_from_proto(shape.resources))
                masks.append(shape.constraint_mask)
                counts.append(shape.count)
        matrix = np.array(shapes, dtype=np.int64).reshape(len(shapes), NUM_RESOURCES)
        return matrix, masks, counts

    async def _rows(self) -> tuple[dict[str, NodeRow], set[str]] | None:
        """The pools' LMs' nodes by id, and the ids they hold drained; None when one of
        them does not answer (nothing is decided on half a picture)."""
        rows: dict[str, NodeRow] = {}
        draining: set[str] = set()
        for lm_id in sorted({p.lm for p in self.auto.pools}):
            try:
                state, drained = await lm_nodes(self.config.lm(lm_id).target)
            except grpc.aio.AioRpcError as err:
                log.warning(
                    "LM %s did not answer (%s): no decision this interval", lm_id, _why(err)
                )
                return None
            rows.update((r.node_id, r) for r in node_rows(state, drained))
            draining |= drained
        return rows, draining

    def _nodes(self, rows: dict[str, NodeRow], now: float) -> list[PoolNode]:
        for node_id, proc in self.procs.gone():
            self.idle_since.pop(node_id, None)
            self.drained.discard(node_id)
            code = proc.popen.returncode if proc.popen is not None else None
            log.warning("node %s: its process ended (exit %s): %s", node_id, code,
                        self.procs.log_tail(node_id))  # fmt: skip
            self._failed(proc)
        index = {p.name: i for i, p in enumerate(self.pools)}
        nodes = []
        for node_id, proc in sorted(self.procs.procs.items()):
            row = rows.get(node_id)
            if row is None or row.state == "dead":
                state, tasks = STARTING, 0
            else:
                state = DRAINING if row.state == "draining" else ALIVE
                tasks = row.tasks
            if state == ALIVE and tasks == 0:
                self.idle_since.setdefault(node_id, now)
            else:
                self.idle_since.pop(node_id, None)
            if state != DRAINING:
                self.drained.discard(node_id)
            nodes.append(
                PoolNode(
                    node_id=node_id,
                    pool=index[proc.pool],
                    slot=proc.slot,
                    state=state,
                    tasks=tasks,
                    idle_since=self.idle_since.get(node_id),
                    drained_here=node_id in self.drained,
                )
            )
        return nodes

    def _failed(self, proc: NodeProcess) -> None:
        """Count a node that exited soon after its start; hold its pool back after
        ``QUICK_EXITS`` of them."""
        now = time.monotonic()
        if now - proc.started > QUICK_EXIT_S:
            return
        exits = self._quick_exits.setdefault(proc.pool, deque())
        exits.append(now)
        while exits and now - exits[0] > QUICK_EXIT_WINDOW_S:
            exits.popleft()
        if len(exits) >= QUICK_EXITS:
            exits.clear()
            self._held_until[proc.pool] = now + BACKOFF_S
            log.error(
                "pool %s: %d nodes exited within %g s of their start; starting none for %g s "
                "(the last node's log is quoted above)",
                proc.pool, QUICK_EXITS, QUICK_EXIT_S, BACKOFF_S,
            )  # fmt: skip

    def _held(self, pool: str) -> bool:
        return time.monotonic() < self._held_until.get(pool, 0.0)

    # ---- forecasting
    async def _target(self, demand: np.ndarray, allocated: np.ndarray) -> tuple[np.ndarray, str]:
        method = forecast_method(self.auto.method, len(self.history.samples), self.auto.interval_s)
        request = predictor_pb2.ForecastDemandRequest(
            history=[
                predictor_pb2.DemandSample(unix_nanos=int(t * 1e9), bucket_counts=n)
                for t, n in self.history.samples
            ],
            buckets=[resources_to_proto(p.shape) for p in self.pools],
            interval_s=self.auto.interval_s,
            allocated_bucket_counts=allocated.tolist(),
            method=method,
        )
        reply = None
        if self.config.predictor is not None:
            try:
                async with channel(self.config.predictor.target) as chan:
                    stub = predictor_pb2_grpc.PredictorStub(chan)
                    reply = await stub.ForecastDemand(request, timeout=30)
            except grpc.aio.AioRpcError as err:
                log.warning("predictor did not answer (%s): forecasting in-process", _why(err))
        if reply is None:
            reply = await asyncio.to_thread(forecast_demand, request)
        target = np.maximum(np.array(reply.target_bucket_counts, dtype=np.int64), demand)
        return target, METHOD_NAMES.get(reply.method, "naive")

    # ---- one interval
    async def step(self) -> Look | None:
        now = self.clock()
        shapes, masks, counts = await self._waiting()
        seen = await self._rows()
        if seen is None:
            return None
        rows, draining = seen
        nodes = self._nodes(rows, now)
        waiting = pool_demand(self.pools, shapes, masks, counts)
        demand = waiting.nodes + busy_nodes(self.pools, nodes)
        self.history.add(now, demand.tolist())
        target, method = await self._target(demand, active_nodes(self.pools, nodes))
        target = np.clip(target, [p.low for p in self.pools], [p.high for p in self.pools])
        decision = decide(self.pools, nodes, target, now, self.auto.idle_s)
        await self._act(decision, draining)
        look = Look(demand, waiting.tasks, waiting.unplaced, target, method, nodes, decision)
        self._report(look)
        return look

    async def _act(self, decision: ScaleDecision, draining: set[str]) -> None:
        """Carry out ``decision``; ``draining``: the ids the pools' LMs hold drained (an
        LM keeps a drain by node id, so a slot's next node would start drained)."""
        for p, slot in decision.start:
            pool = self.pools[p].name
            if self._held(pool):
                continue
            node_id = self.config.pool(pool).node_id(slot)
            if node_id in draining:  # a stopped node of this slot was drained
                await self._drain(pool, node_id, undo=True)
            self.procs.start(pool, slot)
            log.info("starting node %s (pool %s)", node_id, pool)
        for node_id, undo in [
            *((n, True) for n in decision.undrain),
            *((n, False) for n in decision.drain),
        ]:
            pool = self.procs.procs[node_id].pool
            if await self._drain(pool, node_id, undo):
                (self.drained.discard if undo else self.drained.add)(node_id)
                log.info("%s node %s", "taking back" if undo else "draining idle", node_id)
        for node_id in decision.stop:
            log.info("stopping node %s: drained and idle", node_id)
            pool = self.procs.procs[node_id].pool
            await self.procs.stop(node_id)
            self.idle_since.pop(node_id, None)
            self.drained.discard(node_id)
            # The LM keeps the drain by id: lift it, so the slot's next node takes tasks.
            await self._drain(pool, node_id, undo=True)

    async def _drain(self, pool: str, node_id: str, undo: bool) -> bool:
        lm_id = self.config.pool(pool).lm
        request = local_master_pb2.DrainNodeRequest(node_id=node_id, undo=undo)
        try:
            async with channel(self.config.lm(lm_id).target) as chan:
                stub = local_master_pb2_grpc.LocalMasterStub(chan)
                await stub.DrainNode(request, timeout=10)
        except grpc.aio.AioRpcError as err:
            log.warning("%s node %s: %s", "undraining" if undo else "draining", node_id, _why(err))
            return False
        return True

    def _report(self, look: Look) -> None:
        UNPLACED.set(look.unplaced)
        for p, pool in enumerate(self.pools):
            mine = [n for n in look.nodes if n.pool == p]
            for state in (STARTING, ALIVE, DRAINING):
                NODES.labels(pool.name, state).set(sum(n.state == state for n in mine))
            DEMAND.labels(pool.name).set(int(look.demand[p]))
            TARGET.labels(pool.name).set(int(look.target[p]))
        if look.decision or look.unplaced:
            active = active_nodes(self.pools, look.nodes)
            parts = [
                f"{pool.name}: {active[p]} nodes, demand {look.demand[p]} "
                f"({look.waiting[p]} waiting tasks), target {look.target[p]}"
                for p, pool in enumerate(self.pools)
            ]
            extra = f"; {look.unplaced} waiting tasks fit no pool" if look.unplaced else ""
            log.info("%s [%s]%s", "; ".join(parts), look.method, extra)

    async def run(self, stop: asyncio.Event) -> None:
        adopted = self.procs.adopt()
        if adopted:
            log.info("adopted the nodes an earlier autoscaler started: %s", ", ".join(adopted))
        # Started beside the federation (megha up): give the GMs, LMs and predictor a
        # while to come up before the first look, instead of a warning for each.
        healthy = asyncio.ensure_future(wait_all_healthy(self.config, timeout_s=STARTUP_WAIT_S))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({healthy, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not healthy.done():
            healthy.cancel()
        elif healthy.exception() is not None:
            log.warning("starting without every service up: %s", healthy.exception())
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    await self.step()
                except Exception:  # one bad interval must not end the autoscaler
                    log.exception("autoscale step failed")
                left = self.auto.interval_s - (time.monotonic() - started)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(left, 0.05))
        finally:
            await self.procs.stop_all()
            await self.close()


def _why(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return repr(err)


async def serve(config: FederationConfig, config_path: str, log_dir: Path | None = None) -> int:
    """``megha autoscale``: run until SIGINT or SIGTERM, then stop the nodes it started."""
    from services.common.server import start_metrics

    if config.autoscale is None:
        print("megha: the config has no autoscale section: nothing to scale", file=sys.stderr)
        return 2
    start_metrics(config.autoscale.metrics_port)
    scaler = Autoscaler(config, config_path, log_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pools = ", ".join(f"{p.name} ({p.min}-{p.max} on {p.lm})" for p in config.autoscale.pools)
    log.info(
        "autoscaling %s every %g s; state in %s", pools, config.autoscale.interval_s, scaler.dir
    )
    await scaler.run(stop)
    return 0
