"""``megha-loadgen``: load generation and measurement against Megha.

Subcommands:
- ``bench-live``: start a private federation, offer short tasks at a fixed rate, and report
  allocation time and placement throughput (``loadgen/bench_live.py``).
- ``simulate``, ``replay``, ``compare``, ``experiment``: a trace through the in-process
  simulator or against a live federation, their reports side by side, the paper's figures.
- ``gpa-eval``, ``vm-sim``, ``forecast-eval``: the predictor's evaluations (issue 5).
- ``autoscale-live``: bursts against a live federation, a fixed pool vs ``megha autoscale``.
- ``chaos-sim``: the deterministic fault-injection simulation of the protocol (issue 27).

Without a subcommand it describes itself. Errors come out as one line and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from services.common.argtypes import non_negative_float, positive_float, positive_int
from services.common.pipes import quiet_on_broken_pipe

# Modules that each add one subcommand, named like the module with "-" for "_": every one
# has ``add_subcommand(subparsers)`` and ``main(args) -> int``.
SUBCOMMAND_MODULES = (
    "simulate",
    "replay",
    "compare",
    "experiment",
    "gpa_eval",
    "vm_sim",
    "forecast_eval",
    "autoscale_live",
    "chaos_sim",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megha-loadgen",
        description="Replay traces against a Megha federation or the in-process simulator.",
    )
    commands = parser.add_subparsers(dest="command")
    bench = commands.add_parser(
        "bench-live",
        help="throughput/latency benchmark against a federation it starts itself",
        description=(
            "Start a private federation (its own ports and exchange prefix), offer short "
            "sim tasks at a fixed rate, and report allocation time (paper eq. 1-2) and "
            "placement throughput. Needs RabbitMQ. Exit 0 when every task a GM acknowledged "
            "completed exactly once (an overloaded run reports its refused submissions and "
            "their gRPC codes), 1 when one was lost or ran twice, 2 when the benchmark could "
            "not run."
        ),
    )
    bench.add_argument(
        "--rate",
        default="200",
        help="tasks offered per second; a comma-separated list (e.g. 50,100,150,200) runs "
        "the benchmark once per rate and writes sweep.json and sweep.png",
    )
    bench.add_argument(
        "--seconds", type=positive_float, default=10.0, help="how long load is offered"
    )
    bench.add_argument(
        "--sweep",
        action="store_true",
        help="search for the highest rate meeting --target-p99-ms with every offered task "
        "placed: from --rate, doubling, then bisecting; writes saturation.json, sweep.json "
        "and sweep.png under --out",
    )
    bench.add_argument(
        "--target-p99-ms",
        type=positive_float,
        default=10.0,
        help="--sweep: the allocation-time p99 a rate must meet (default 10)",
    )
    bench.add_argument(
        "--sweep-runs",
        type=positive_int,
        default=6,
        help="--sweep: at most this many runs of --seconds each (default 6)",
    )
    bench.add_argument("--gms", type=positive_int, default=2, help="Global Masters")
    bench.add_argument("--lms", type=positive_int, default=3, help="Local Masters")
    bench.add_argument(
        "--workers-per-lm", type=positive_int, default=100, help="worker nodes per LM"
    )
    bench.add_argument(
        "--task-duration", type=non_negative_float, default=0.05, help="seconds each sim task runs"
    )
    bench.add_argument(
        "--tasks-per-job", type=positive_int, default=1, help="tasks per submitted job"
    )
    bench.add_argument(
        "--warmup",
        type=non_negative_float,
        default=2.0,
        help="tasks starting within this many seconds are left out of the statistics",
    )
    bench.add_argument("--out", type=Path, help="write summary.json, tasks.csv and a CDF here")
    bench.add_argument("--log-dir", type=Path, help="config and service logs (default: temp)")
    bench.add_argument(
        "--rabbitmq-url", default="", help="broker (default: MEGHA_RABBITMQ_URL or localhost)"
    )
    bench.add_argument(
        "--queues",
        default="per-gm",
        metavar="{per-gm,default,FILE}",
        help="per-gm: one user queue per GM (every GM schedules); default: one queue, "
        "scheduled by the first GM; FILE: a YAML list of name, share, gm (gm-1 or 1) and "
        "optionally limit (cpu=8,mem=16Gi), jobs round-robin over the queues, summary.json "
        "gets each queue's measured share and peak",
    )
    bench.add_argument(
        "--cpu-milli", type=positive_int, default=1000, help="CPU each task requests"
    )
    bench.add_argument(
        "--memory-mb", type=positive_int, default=64, help="memory each task requests"
    )
    bench.add_argument(
        "--service-log-level", default="INFO", help="log level of the started services"
    )
    bench.add_argument(
        "--submit",
        choices=("stream", "unary"),
        default="stream",
        help="stream: jobs go over one SubmitStream per GM (default); unary: one SubmitJob "
        "call per job, as `megha submit` does",
    )
    bench.add_argument(
        "--secure",
        action="store_true",
        help="per-process certificates, mutual TLS and authorization on (what they cost): "
        "the load generator submits as a user, each process writes an audit log",
    )
    bench.add_argument(
        "--queue-failover",
        action="store_true",
        help="queue failover on: every GM consumes every queue (RabbitMQ single active "
        "consumer), jobs scheduled from their delivery (what it costs)",
    )
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"loadgen.{name}").add_subcommand(commands)
    return parser


@quiet_on_broken_pipe
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench-live":
        return _bench_live(args)
    for name in SUBCOMMAND_MODULES:
        if args.command == name.replace("_", "-"):
            return importlib.import_module(f"loadgen.{name}").main(args)
    parser.print_help()
    return 0


def _bench_live(args: argparse.Namespace) -> int:
    from loadgen import bench_sweep
    from loadgen.bench_live import BenchError, BenchOptions, run
    from loadgen.queues import QueueFileError, load_queues

    try:
        rates = bench_sweep.parse_rates(args.rate)
    except BenchError as err:
        print(f"megha-loadgen: {err}", file=sys.stderr)
        return 2

    queues, file_queues = args.queues, ()
    if queues not in ("per-gm", "default"):
        try:
            file_queues = load_queues(queues)
        except (QueueFileError, OSError) as err:
            print(f"megha-loadgen: --queues: {err}", file=sys.stderr)
            return 2
        queues = "file"
    options = BenchOptions(
        rate=rates[0],
        seconds=args.seconds,
        gms=args.gms,
        lms=args.lms,
        workers_per_lm=args.workers_per_lm,
        task_duration_s=args.task_duration,
        tasks_per_job=args.tasks_per_job,
        warmup_s=args.warmup,
        out=args.out,
        log_dir=args.log_dir,
        rabbitmq_url=args.rabbitmq_url,
        queues=queues,
        file_queues=file_queues,
        cpu_milli=args.cpu_milli,
        memory_mb=args.memory_mb,
        service_log_level=args.service_log_level,
        submit=args.submit,
        secure=args.secure,
        queue_failover=args.queue_failover,
    )
    if args.sweep and len(rates) > 1:
        print("megha-loadgen: --sweep starts from one --rate, not a list", file=sys.stderr)
        return 2
    try:
        if args.sweep:
            return bench_sweep.run_search(options, args.target_p99_ms, args.sweep_runs)
        return run(options) if len(rates) == 1 else bench_sweep.run(options, rates)
    except BenchError as err:
        print(f"megha-loadgen: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. the output directory cannot be written
        print(f"megha-loadgen: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
