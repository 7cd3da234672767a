"""``megha-loadgen simulate``: replay a trace through the in-process simulator.

    TRACE ──jobs_from_args──▶ jobs ──sim.run.simulate(SimConfig)──▶ SimResult
        ──render──▶ stdout      ──write_report──▶ --out DIR (summary.json, tasks.csv, CDF)

The simulator drives the same ``services/core`` classes as the live services
(``loadgen/sim/``); this module only turns flags into a ``SimConfig``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loadgen.augment import vlink_cap_mbps
from loadgen.queues import load_queues
from loadgen.readers.options import (
    DEFAULT_BPC_MBPS,
    add_trace_arguments,
    jobs_from_args,
    machines_from_args,
)
from loadgen.sim.config import FINISH_NOTIFY, SCHEDULERS, SimConfig, SimConfigError
from loadgen.trace import TraceError
from services.common.argtypes import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from services.core.contention import CLAIMS
from services.core.match import POLICIES


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    defaults = SimConfig()
    parser = subparsers.add_parser(
        "simulate",
        help="replay a trace through the in-process discrete-event simulator",
        description=(
            "Replay TRACE on a virtual clock through Megha (G GMs x L LMs, the very "
            "services/core classes the live services run), Sparrow (batch sampling with "
            "late binding) or a centralized scheduler (1 GM x 1 LM). Prints the allocation-"
            "time summary; --out writes summary.json, tasks.csv and a CDF plot. Exit 0 when "
            "every feasible task completed, 1 when not, 2 on bad input."
        ),
    )
    parser.add_argument("trace", type=Path, help="trace file (.tr, Google, Alibaba, Azure)")
    parser.add_argument("--scheduler", choices=SCHEDULERS, default=defaults.scheduler)
    parser.add_argument(
        "--workers", type=positive_int, default=defaults.workers, help="worker nodes"
    )
    parser.add_argument("--gms", type=positive_int, default=defaults.gms, help="Global Masters")
    parser.add_argument("--lms", type=positive_int, default=defaults.lms, help="Local Masters")
    parser.add_argument(
        "--cores-per-worker",
        type=positive_int,
        default=defaults.cores_per_worker,
        help="CPUs per worker (a .tr task asks for one)",
    )
    parser.add_argument(
        "--memory-per-worker-mb", type=positive_int, default=defaults.memory_per_worker_mb
    )
    parser.add_argument(
        "--network-delay-ms",
        type=non_negative_float,
        default=defaults.network_delay_s * 1e3,
        help="one-way delay of every message (default 0.5, as the Sparrow simulator)",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=positive_float,
        default=defaults.heartbeat_interval_s,
        help="LM heartbeat interval (default 10, as the paper)",
    )
    parser.add_argument(
        "--backlog-s",
        type=positive_float,
        default=defaults.backlog_interval_s,
        help="how often each GM reports its waiting work to every GM, with --claims oldest "
        "(default 1, as the live GM)",
    )
    parser.add_argument(
        "--finish-notify",
        choices=FINISH_NOTIFY,
        default=defaults.finish_notify,
        help="who hears of a finished task before the next heartbeat",
    )
    parser.add_argument(
        "--arrival-scale",
        type=positive_float,
        default=defaults.arrival_scale,
        help="multiply every arrival time by this (0.5: the jobs arrive in half the span, "
        "twice the load)",
    )
    parser.add_argument(
        "--claims",
        choices=CLAIMS,
        default=defaults.claims,
        help="who has the first claim on room a finished task freed: the GM whose work "
        "waited oldest, within its queue's share (default; backlogs reported every "
        "heartbeat) or the node's owner GM",
    )
    parser.add_argument(
        "--preemption-slack",
        type=non_negative_float,
        default=defaults.preemption_slack,
        help="with --queues: a queue preempts only when more than this below its share "
        "(0.01 = 1 pp; pairs with --claims oldest)",
    )
    parser.add_argument("--policy", choices=sorted(POLICIES), default=defaults.policy)
    parser.add_argument("--probe-ratio", type=positive_float, default=defaults.probe_ratio)
    parser.add_argument(
        "--fair-share",
        action="store_true",
        help="paper Alg. 2: under-share users may preempt over-share ones",
    )
    parser.add_argument(
        "--queues",
        type=Path,
        metavar="FILE",
        help="user queues: a YAML list of name, share, gm (gm-1 or 1) and optionally limit "
        "(cpu=8,mem=16Gi); tasks go round-robin over them unless the trace names users; "
        "implies --fair-share; summary.json gets each queue's measured share and peak",
    )
    parser.add_argument(
        "--gangs",
        action="store_true",
        help="every job starts all together or waits (gang scheduling, issue 33); with "
        "--gridiron or --bpc each of its VDCs is a gang whose vlinks must fit the uplinks",
    )
    parser.add_argument(
        "--gang-queues",
        default="",
        metavar="Q1,Q2",
        help="with --gangs and --queues: only these queues' jobs are gangs; with shares a "
        "waiting gang preempts, as one unit, tasks of queues over their share",
    )
    parser.add_argument(
        "--worker-uplink-mbps",
        type=non_negative_int,
        default=defaults.uplink_mbps,
        help="each worker's uplink (its net_mbps), Mbit/s (default 0: tasks asking for "
        "network never fit)",
    )
    parser.add_argument("--out", type=Path, help="write summary.json, tasks.csv and a CDF here")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    add_trace_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    vdc = None
    if args.gangs and (args.gridiron or args.bpc is not None):
        bpc = DEFAULT_BPC_MBPS if args.bpc is None else args.bpc
        vdc = (bpc, float(vlink_cap_mbps(args.peak_vdc, args.uplink_mbps)))
    return SimConfig(
        scheduler=args.scheduler,
        workers=args.workers,
        gms=args.gms,
        lms=args.lms,
        cores_per_worker=args.cores_per_worker,
        memory_per_worker_mb=args.memory_per_worker_mb,
        network_delay_s=args.network_delay_ms / 1e3,
        heartbeat_interval_s=args.heartbeat_s,
        backlog_interval_s=args.backlog_s,
        finish_notify=args.finish_notify,
        policy=args.policy,
        probe_ratio=args.probe_ratio,
        arrival_scale=args.arrival_scale,
        claims=args.claims,
        preemption_slack=args.preemption_slack,
        fair_share=args.fair_share or args.queues is not None,
        queues=load_queues(args.queues) if args.queues is not None else (),
        seed=args.seed,
        uplink_mbps=args.worker_uplink_mbps,
        gangs=args.gangs,
        gang_queues=tuple(q for q in args.gang_queues.split(",") if q),
        vdc=vdc,
        peak_vdc=args.peak_vdc if vdc is not None else 0,
    )


def main(args: argparse.Namespace) -> int:
    from loadgen.sim.run import render, simulate, write_report
    from services.common.progress import Progress

    try:
        config = config_from_args(args)
        config.check()
        jobs, stats = jobs_from_args(args)
        machines = machines_from_args(args, config.workers)
    except (SimConfigError, TraceError, ValueError, OSError) as err:
        print(f"megha-loadgen simulate: {err}", file=sys.stderr)
        return 2
    if stats.skipped:
        print(
            f"skipped {stats.skipped} malformed lines of {args.trace} (--strict stops at the "
            "first): " + "; ".join(stats.problems),
            file=sys.stderr,
        )
    try:
        stats.require_jobs(jobs, args.trace)
    except TraceError as err:
        print(f"megha-loadgen simulate: {err}", file=sys.stderr)
        return 2
    for note in stats.notes:
        print(note, file=sys.stderr)
    try:
        result = simulate(
            config,
            jobs,
            Progress(enabled=not args.quiet),
            trace_name=str(args.trace),
            machine_masks=machines,
        )
    except SimConfigError as err:
        print(f"megha-loadgen simulate: {err}", file=sys.stderr)
        return 2
    if args.out is not None:
        try:
            result.files = write_report(args.out, result)
        except OSError as err:
            print(f"megha-loadgen simulate: cannot write {args.out}: {err}", file=sys.stderr)
            return 2
    print(render(result))
    s = result.summary
    return 0 if s["completed"] + s.get("infeasible", 0) == s["tasks"] else 1
