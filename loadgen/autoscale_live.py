"""``megha-loadgen autoscale-live``: the same bursts of tasks against a live federation
with a fixed pool of nodes, and with ``megha autoscale`` growing a pool beside it.

    per mode (static, autoscale): a private federation (1 GM, 1 LM, a predictor, the
    static nodes; in autoscale mode an ``autoscale`` section and its process)
      events topic ──▶ each task's submission and start stamps
      every 0.5 s: the LM's nodes ──▶ pool nodes up (alive or draining), tasks waiting
      --bursts jobs of --burst-tasks one-CPU sim tasks, --gap-s apart
      ──▶ allocation time (submission to start), makespan, pool node-seconds (the price)

With ``--out DIR`` it writes ``autoscale.json`` (one row a mode) and ``autoscale.png``
(waiting tasks and pool nodes over time). Needs RabbitMQ, as ``bench-live`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from loadgen.bench_live import BenchError, free_ports_config, running_federation
from services._proto.megha.v1 import common_pb2
from services.common.argtypes import non_negative_float, positive_float, positive_int
from services.common.bus import RabbitBus
from services.common.client import GlobalMasterClient
from services.common.config import ConfigError, FederationConfig, default_config, parse_config
from services.common.names import EVENT_EXCHANGE, EVERY_TASK_EVENT
from services.common.nodes import lm_rows
from services.core.resources import ResourceError, parse_resources

POOL = "burst"
SAMPLE_S = 0.5
MODES = ("static", "autoscale")


@dataclass
class Options:
    static: int = 2
    static_capacity: str = "cpu=2,mem=4Gi"
    pool_capacity: str = "cpu=4,mem=8Gi"
    pool_max: int = 4
    bursts: int = 3
    burst_tasks: int = 16
    task_s: float = 20.0
    gap_s: float = 60.0
    interval_s: float = 2.0
    idle_s: float = 10.0
    method: str = "reactive"
    modes: tuple[str, ...] = MODES
    out: Path | None = None


@dataclass
class ModeResult:
    mode: str
    tasks: int
    completed: int
    alloc_s: dict[str, float]
    makespan_s: float
    pool_node_s: float
    pool_peak: int
    static_nodes: int
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # t, waiting, pool


def mode_config(options: Options, mode: str, base_port: int, prefix: str, state: Path):
    data = default_config(gms=1, lms=1, workers_per_lm=options.static, base_port=base_port)
    data["workers"] = [{"lm": "lm-1", "count": options.static, "capacity": options.static_capacity}]
    data["exchange_prefix"] = prefix
    data["worker_heartbeat_interval_s"] = 0.5
    if mode == "autoscale":
        data["autoscale"] = {
            "interval_s": options.interval_s,
            "idle_s": options.idle_s,
            "method": options.method,
            "state_dir": str(state),
            "pools": [
                {
                    "name": POOL,
                    "lm": "lm-1",
                    "capacity": options.pool_capacity,
                    "max": options.pool_max,
                }
            ],
        }
    try:
        config = parse_config(data)
    except ConfigError as err:
        raise BenchError(str(err)) from None
    if config.exchange_prefix != prefix:
        raise BenchError("MEGHA_EXCHANGE_PREFIX is set; autoscale-live needs its own: unset it")
    return config


def burst_tasks(options: Options, burst: int) -> list[common_pb2.Task]:
    return [
        common_pb2.Task(
            task_id=f"b{burst}-t{i}",
            resources=common_pb2.Resources(cpu_milli=1000, memory_mb=256),
            sim=common_pb2.SimExecutor(duration_s=options.task_s),
        )
        for i in range(options.burst_tasks)
    ]


class Stamps:
    """Each task's start and end, from the lifecycle events."""

    def __init__(self) -> None:
        self.started: dict[str, int] = {}
        self.finished: dict[str, int] = {}

    async def on_batch(self, _key: str, body: bytes) -> None:
        for event in common_pb2.TaskEventBatch.FromString(body).events:
            if event.timestamps.started_unix_nanos:
                self.started.setdefault(event.task_id, event.timestamps.started_unix_nanos)
            if event.state == common_pb2.TASK_STATE_SUCCEEDED:
                self.finished[event.task_id] = event.timestamps.finished_unix_nanos


async def run_mode(options: Options, mode: str, log_dir: Path) -> ModeResult:
    prefix = f"as-{uuid.uuid4().hex[:8]}"
    state = log_dir / "autoscale-state"
    config = free_ports_config(lambda base: mode_config(options, mode, base, prefix, state))
    async with running_federation(config, log_dir) as children:
        bus = RabbitBus(config.broker_url("reader"), prefix=prefix)
        stamps = Stamps()
        await bus.connect()
        try:  # subscribed before the first burst is offered
            await bus.subscribe_topic(EVENT_EXCHANGE, EVERY_TASK_EVENT, stamps.on_batch)
            return await children.guard(_offer(options, mode, config, stamps))
        finally:
            await bus.close()


async def _offer(
    options: Options, mode: str, config: FederationConfig, stamps: Stamps
) -> ModeResult:
    submitted: dict[str, int] = {}
    timeline: list[tuple[float, int, int]] = []
    node_s = 0.0
    t0 = time.monotonic()
    total = options.bursts * options.burst_tasks
    last_burst = (options.bursts - 1) * options.gap_s
    bound = last_burst + 10 * options.task_s + 180
    async with GlobalMasterClient(config.gms[0].target) as client:
        next_burst = 0
        settled_at = None
        while True:
            now = time.monotonic() - t0
            if next_burst < options.bursts and now >= next_burst * options.gap_s:
                job = burst_tasks(options, next_burst)
                reply = await client.submit(job)
                stamp = time.time_ns()
                submitted.update((t.task_id, stamp) for t in job)
                assert len(reply.task_ids) == len(job)
                next_burst += 1
            rows = await lm_rows(config.lm("lm-1").target, "lm-1")
            pool = sum(r.node_id.startswith(f"lm-1-{POOL}-") and r.state != "dead" for r in rows)
            waiting = len(submitted) - len(stamps.started.keys() & submitted.keys())
            timeline.append((round(now, 2), waiting, pool))
            node_s += pool * SAMPLE_S
            done = next_burst == options.bursts and len(stamps.finished) >= total
            if done and settled_at is None:
                settled_at = now
            # Autoscale: also wait for the pool to drain back, part of what it costs.
            idle_wait = options.idle_s + 4 * options.interval_s + 20
            if done and (pool == 0 or now - settled_at > idle_wait):
                break
            if now > bound:
                print(
                    f"autoscale-live: {mode}: stopped waiting after {bound:.0f} s", file=sys.stderr
                )
                break
            await asyncio.sleep(SAMPLE_S)
    waits = np.array(
        [(stamps.started[t] - submitted[t]) / 1e9 for t in submitted if t in stamps.started]
    )
    ends = [stamps.finished[t] for t in submitted if t in stamps.finished]
    first = min(submitted.values())
    return ModeResult(
        mode=mode,
        tasks=total,
        completed=sum(t in stamps.finished for t in submitted),
        alloc_s={
            "p50": float(np.percentile(waits, 50)) if waits.size else float("nan"),
            "p90": float(np.percentile(waits, 90)) if waits.size else float("nan"),
            "max": float(waits.max()) if waits.size else float("nan"),
        },
        makespan_s=(max(ends) - first) / 1e9 if ends else float("nan"),
        pool_node_s=node_s,
        pool_peak=max((p for _, _, p in timeline), default=0),
        static_nodes=options.static,
        timeline=timeline,
    )


def render(results: Sequence[ModeResult]) -> str:
    lines = [
        f"{'mode':<10} {'done':>9} {'alloc p50':>10} {'p90':>8} {'max':>8} "
        f"{'makespan':>9} {'pool node-s':>12} {'pool peak':>9}"
    ]
    for r in results:
        lines.append(
            f"{r.mode:<10} {f'{r.completed}/{r.tasks}':>9} {r.alloc_s['p50']:>9.1f}s "
            f"{r.alloc_s['p90']:>7.1f}s {r.alloc_s['max']:>7.1f}s {r.makespan_s:>8.1f}s "
            f"{r.pool_node_s:>12.0f} {r.pool_peak:>9}"
        )
    return "\n".join(lines)


def write(out: Path, results: Sequence[ModeResult], options: Options) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = [{k: v for k, v in asdict(r).items() if k != "timeline"} for r in results]
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}
    path = out / "autoscale.json"
    path.write_text(json.dumps({"options": meta, "modes": rows}, indent=1))
    timeline = out / "timeline.json"
    timeline.write_text(json.dumps({r.mode: r.timeline for r in results}))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.6 * len(results)), sharex=True)
    for ax, r in zip(np.atleast_1d(axes), results, strict=True):
        t = [p[0] for p in r.timeline]
        ax.plot(t, [p[1] for p in r.timeline], label="tasks waiting")
        ax.step(t, [p[2] for p in r.timeline], where="post", label="pool nodes up")
        ax.set_title(
            f"{r.mode}: allocation p50 {r.alloc_s['p50']:.1f} s, max {r.alloc_s['max']:.1f} s, "
            f"{r.pool_node_s:.0f} pool node-s"
        )
        ax.legend(loc="upper right")
    np.atleast_1d(axes)[-1].set_xlabel("seconds since the first burst")
    fig.tight_layout()
    png = out / "autoscale.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [path, timeline, png]


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = Options()
    parser = subparsers.add_parser(
        "autoscale-live",
        help="bursts against a live federation, fixed pool vs megha autoscale",
        description=(
            "Start a private federation per mode (static: a fixed set of nodes; autoscale: "
            "the same plus megha autoscale growing a pool beside it), submit the same "
            "bursts of one-CPU sim tasks, and compare allocation time (submission to "
            "start) with the node-seconds the pool cost. Needs RabbitMQ."
        ),
    )
    add = parser.add_argument
    add("--static", type=positive_int, default=d.static, help="fixed nodes (default %(default)s)")
    add("--static-capacity", default=d.static_capacity, help="each (default %(default)s)")
    add("--pool-capacity", default=d.pool_capacity, help="each pool node (default %(default)s)")
    add("--pool-max", type=positive_int, default=d.pool_max, help="default %(default)s")
    add("--bursts", type=positive_int, default=d.bursts, help="default %(default)s")
    add("--burst-tasks", type=positive_int, default=d.burst_tasks, help="default %(default)s")
    add("--task-s", type=positive_float, default=d.task_s, help="default %(default)s")
    add("--gap-s", type=non_negative_float, default=d.gap_s, help="default %(default)s")
    add("--interval-s", type=positive_float, default=d.interval_s, help="default %(default)s")
    add("--idle-s", type=non_negative_float, default=d.idle_s, help="default %(default)s")
    add("--method", choices=("auto", "reactive", "seasonal", "gradient-boosted"),
        default=d.method, help="forecast (default %(default)s)")  # fmt: skip
    add("--modes", default=",".join(d.modes), help="static,autoscale or one of them")
    add("--out", type=Path, help="write autoscale.json, timeline.json and autoscale.png here")
    return parser


def main(args: argparse.Namespace) -> int:
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or any(m not in MODES for m in modes):
        print(f"megha-loadgen: --modes: choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    for flag, capacity in (("--static-capacity", args.static_capacity),
                           ("--pool-capacity", args.pool_capacity)):  # fmt: skip
        try:
            parse_resources(capacity)
        except ResourceError as err:
            print(f"megha-loadgen: {flag} {capacity}: {err}", file=sys.stderr)
            return 2
    options = Options(
        static=args.static,
        static_capacity=args.static_capacity,
        pool_capacity=args.pool_capacity,
        pool_max=args.pool_max,
        bursts=args.bursts,
        burst_tasks=args.burst_tasks,
        task_s=args.task_s,
        gap_s=args.gap_s,
        interval_s=args.interval_s,
        idle_s=args.idle_s,
        method=args.method,
        modes=modes,
        out=args.out,
    )
    results = []
    try:
        for mode in modes:
            log_dir = Path(tempfile.mkdtemp(prefix=f"megha-autoscale-{mode}-"))
            print(f"autoscale-live: {mode} (logs in {log_dir}) ...", flush=True)
            results.append(asyncio.run(run_mode(options, mode, log_dir)))
    except BenchError as err:
        print(f"megha-loadgen: {err}", file=sys.stderr)
        return 2
    print(render(results))
    if args.out:
        for path in write(args.out, results, options):
            print(f"wrote {path}")
    return 0 if all(r.completed == r.tasks for r in results) else 1
