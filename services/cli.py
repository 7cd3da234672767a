"""``megha``: the operator CLI. Each subcommand is a thin shell over a library call."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from services.common.argtypes import (
    bounded,
    env_pair,
    non_negative_float,
    non_negative_int,
    number_list,
    port,
    port_or_off,
    positive_float,
    positive_int,
)
from services.common.pipes import quiet_on_broken_pipe

ROLES = ("gm", "lm", "worker", "predictor")
# services.common.client.OUTAGE_S, not imported here: the CLI starts without gRPC loaded.
_OUTAGE_S = 30.0


_sizes = number_list(bounded(int, "size", 1, high=10**9))
_constraint_count = bounded(int, "constraint_count", 1, high=64)
_job_limit = bounded(int, "limit", 1, high=1000)
_retries = bounded(int, "retries", 0, high=100)
_min_tasks = bounded(int, "min-tasks", 0, high=100_000)
_priority = bounded(int, "priority", -(2**31), high=2**31 - 1)


def _vdc(text: str):
    """``--vdc 100,1000``: bandwidth per core and vlink cap, Mbit/s (a ``Vdc`` message)."""
    from services._proto.megha.v1 import common_pb2
    from services.core.vdc import Vdc, VdcError

    parts = text.split(",")
    try:
        bpc, cap = (float(p) for p in parts) if len(parts) == 2 else (None, None)
        Vdc(bpc, cap)  # type: ignore[arg-type]
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected BPC,CAP (Mbit/s per core, vlink cap in Mbit/s), e.g. 100,1000"
            + (f" ({err})" if isinstance(err, VdcError) else "")
        ) from None
    return common_pb2.Vdc(bandwidth_per_core_mbps=bpc, vlink_cap_mbps=cap)


# 0 = back to back
_rates = number_list(bounded(float, "rate", 0, high=100_000))


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=os.environ.get("MEGHA_CONFIG"),
        help="federation file (YAML or TOML; env MEGHA_CONFIG); default: built-in federation",
    )


def _add_gm(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gm",
        default=os.environ.get("MEGHA_GM"),
        help="GM address HOST:PORT (env MEGHA_GM); default: the config's first GM",
    )


def _add_json(parser: argparse.ArgumentParser, text: str) -> None:
    parser.add_argument("--json", action="store_true", help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megha", description="Megha: decentralized fair scheduling for federated clusters"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    for role, text in (
        ("gm", "run one Global Master"),
        ("lm", "run one Local Master"),
        ("worker", "run worker agents for one LM (or every group in the config)"),
        ("predictor", "run the predictor sidecar"),
    ):
        p = commands.add_parser(role, help=text)
        _add_config(p)
        if role in ("gm", "lm"):
            p.add_argument("--id", required=True, help=f"the {role.upper()} id in the config")
        if role == "worker":
            p.add_argument("--lm", help="attach to this LM (default: every worker group)")
            p.add_argument("--count", type=positive_int, help="agents in this process")
            p.add_argument(
                "--pool",
                default="",
                help="be one node of this autoscale pool (what autoscale runs)",
            )
            p.add_argument(
                "--slot", type=non_negative_int, default=0, help="with --pool: the node's number"
            )
        if role == "predictor":
            _add_predictor_train(p)
        p.add_argument("--log-level", default="INFO")

    certs = commands.add_parser(
        "certs",
        help="make a CA and a certificate per process and user (tls.dir), or a user token",
    )
    _add_config(certs)
    certs.add_argument("--out", default="certs", help="directory to write (default: certs)")
    certs.add_argument(
        "--user", action="append", default=[], help="a user certificate too (repeatable)"
    )
    certs.add_argument("--days", type=positive_int, default=365, help="validity (days)")
    certs.add_argument(
        "--token",
        metavar="USER",
        help="print a new bearer token for USER and the token_sha256 line for the "
        "federation file instead (writes nothing)",
    )

    scale = commands.add_parser(
        "autoscale", help="grow the config's autoscale pools ahead of demand, shrink idle ones"
    )
    _add_config(scale)
    scale.add_argument("--log-dir", default="", help="the nodes' logs (default: its state dir)")
    scale.add_argument("--log-level", default="INFO")

    up = commands.add_parser("up", help="start a whole local federation")
    _add_config(up)
    up.add_argument("--embedded", action="store_true", help="one process, in-memory bus")
    up.add_argument("--gms", type=positive_int, default=2, help="without --config: number of GMs")
    up.add_argument("--lms", type=positive_int, default=3, help="without --config: number of LMs")
    up.add_argument(
        "--workers", type=positive_int, default=8, help="without --config: workers per LM"
    )
    up.add_argument("--base-port", type=port, default=50050)
    up.add_argument("--log-dir", default="", help="child process logs (default: a temp dir)")
    up.add_argument(
        "--console-port",
        type=port_or_off,
        default=8080,
        help="serve the web console on 127.0.0.1:PORT (another port if it is taken; 0: no "
        "console; default 8080)",
    )
    up.add_argument("--replay", default="", help="after start-up, replay this trace and stop")
    up.add_argument(
        "--max-jobs", type=positive_int, default=10, help="with --replay: jobs to replay"
    )
    up.add_argument(
        "--out", default="", help="with --replay: write summary.json, tasks.csv and a CDF here"
    )
    up.add_argument(
        "--speedup",
        type=positive_float,
        default=20000.0,
        help="with --replay: compress time by this",
    )
    up.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        help="with --replay: give up after this many seconds (default: 60 s + 3x the "
        "trace's compressed span and longest task)",
    )

    console = commands.add_parser(
        "console",
        help="serve the web console: federation, queues, jobs and allocation times, "
        "read-only, live",
    )
    _add_config(console)
    console.add_argument("--host", default="127.0.0.1", help="listen here (default 127.0.0.1)")
    console.add_argument("--port", type=port, default=8080, help="default 8080")
    console.add_argument(
        "--refresh",
        type=positive_float,
        default=2.0,
        help="seconds between an open page's updates (default 2)",
    )

    submit = commands.add_parser(
        "submit", help="submit a job of identical tasks, or of those a job file lists"
    )
    _add_config(submit)
    _add_gm(submit)
    submit.add_argument(
        "--file",
        "-f",
        default="",
        metavar="JOB.yaml",
        help="submit the tasks this job file lists, each its own (YAML or JSON; - reads "
        "stdin): job_id, queue, defaults, and tasks, each with command, image, duration, "
        "resources, constraints, timeout, retries, env, priority and count; without the "
        "task options below",
    )
    # The task options default to None, so that one given with --file can be told.
    submit.add_argument("--resources", help="per task (default cpu=1,mem=512Mi)")
    submit.add_argument("--count", type=positive_int, help="tasks in the job (default 1)")
    submit.add_argument(
        "--duration", type=non_negative_float, help="sim executor seconds (default 1)"
    )
    submit.add_argument(
        "--command", dest="argv", nargs=argparse.REMAINDER, default=[], help="run a process"
    )
    submit.add_argument("--image", default="", help="run a docker image")
    submit.add_argument(
        "--env",
        type=env_pair,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable of the process or container (repeat it; before "
        "--command); each task also gets MEGHA_JOB_ID, MEGHA_TASK_ID, MEGHA_TASK_INDEX, "
        "MEGHA_ATTEMPT, MEGHA_CPU_MILLI and MEGHA_MEMORY_MB",
    )
    submit.add_argument("--timeout", type=non_negative_float, help="seconds (default: none)")
    submit.add_argument(
        "--constraints", help="ids or the config's constraint_names, e.g. 1,4,7 or ssd,gpu"
    )
    submit.add_argument("--queue", default="", help="user queue (default: the first)")
    submit.add_argument(
        "--job-id",
        default="",
        help="name the job (default: the GM picks one, or this client when it may ask "
        "again, --retry-for); submitting again with the same id is safe: tasks already "
        "queued, running or ended are not queued again",
    )
    submit.add_argument(
        "--retry-for",
        type=non_negative_float,
        default=_OUTAGE_S,
        metavar="SECONDS",
        help="how long to keep asking a GM that answers it cannot take the job now "
        "(UNAVAILABLE: its broker away, no LM heard from yet) or does not answer in time, "
        f"under one job id, so the job runs once (default {_OUTAGE_S:g}; 0: fail at once)",
    )
    submit.add_argument(
        "--retries",
        type=_retries,
        help="queue a task that failed (its own failure) again, up to this many times (0-100)",
    )
    submit.add_argument(
        "--priority",
        type=_priority,
        help="within its queue, tasks of a higher priority are served first (default 0)",
    )
    submit.add_argument(
        "--gang",
        action="store_true",
        help="all the job's tasks start together or none does (refused at once if the "
        "federation could never hold them all)",
    )
    submit.add_argument(
        "--min-tasks",
        type=_min_tasks,
        default=0,
        help="a gang of at least this many of the tasks: as many as fit start together, "
        "the others as room frees",
    )
    submit.add_argument(
        "--vdc",
        type=_vdc,
        metavar="BPC,CAP",
        help="the gang is a Gridiron VDC (implies --gang): each two members' vlink is BPC "
        "Mbit/s per core of the smaller, capped at CAP Mbit/s, and must fit the nodes' "
        "uplinks (their net capacity); members on one node send nothing over it",
    )
    submit.add_argument("--wait", action="store_true", help="follow the job until it ends")
    submit.add_argument(
        "--dry-run",
        action="store_true",
        help="queue nothing: say where each task would go now, or why it would wait or "
        "never run, as the GM serving the queue judges it (exit 0: all would start, "
        "1: some would wait, 2: some never)",
    )
    _add_json(submit, "print the queued job (or with --dry-run, the plan) as JSON")

    job = commands.add_parser("job", help="show (or --watch) a job")
    _add_config(job)
    _add_gm(job)
    job.add_argument("job_id")
    job.add_argument("--watch", action="store_true")
    job.add_argument(
        "--all",
        action="store_true",
        help="list every task (default: a job of over 50 lists 50, those not succeeded first)",
    )
    _add_json(job, "print the job and every task as JSON")

    logs = commands.add_parser(
        "logs", help="what a task wrote to stdout (or --stderr), read from its worker host"
    )
    _add_config(logs)
    _add_gm(logs)
    logs.add_argument("job_id")
    logs.add_argument("task_id", nargs="?", default="", help="needed for a job of many tasks")
    logs.add_argument("--attempt", type=non_negative_int, default=None, help="default: the latest")
    logs.add_argument("--stderr", action="store_true", help="stderr instead of stdout")
    logs.add_argument(
        "-f", "--follow", action="store_true", help="go on until the attempt ends (like tail -f)"
    )
    logs.add_argument(
        "--all", action="store_true", help="every task's, each under a ==> TASK <== line"
    )
    logs.add_argument(
        "--tail", type=positive_int, default=None, metavar="BYTES", help="only the last BYTES"
    )

    jobs = commands.add_parser("jobs", help="the jobs a GM remembers, newest first")
    _add_config(jobs)
    _add_gm(jobs)
    jobs.add_argument("--queue", default="", help="only this user queue's jobs")
    jobs.add_argument("--limit", type=_job_limit, default=20, help="at most this many (1-1000)")
    jobs.add_argument("--unfinished", action="store_true", help="only jobs not ended yet")
    _add_json(jobs, "print a JSON list of the jobs")

    cancel = commands.add_parser(
        "cancel", help="cancel a job: its queued tasks are dropped, its running ones killed"
    )
    _add_config(cancel)
    _add_gm(cancel)
    cancel.add_argument("job_id")
    cancel.add_argument("--reason", default="", help="shown in the tasks' CANCELLED events")
    cancel.add_argument("--wait", action="store_true", help="follow the job until it ends")

    status = commands.add_parser("status", help="LMs, partitions, queues, allocation times")
    _add_config(status)
    _add_gm(status)
    _add_json(status, "print one JSON object")

    drain = commands.add_parser(
        "drain",
        help="drain a worker node: its tasks run to their end, it takes no new ones (for "
        "maintenance); --undo lets it take tasks again",
    )
    _add_config(drain)
    drain.add_argument("node_id", nargs="?", default="", help="e.g. lm-1-w3")
    drain.add_argument("--lm", default="", help="the node's LM (default: asks every LM)")
    drain.add_argument("--undo", action="store_true", help="let the node take tasks again")
    drain.add_argument(
        "--wait", action="store_true", help="until no task runs on the node any more"
    )
    drain.add_argument("--list", action="store_true", help="the nodes every LM drains")

    nodes = commands.add_parser(
        "nodes", help="every worker node as its LM holds it: state, free, tasks, constraints"
    )
    _add_config(nodes)
    nodes.add_argument("--lm", default="", help="one LM's nodes (default: every LM's)")
    nodes.add_argument(
        "--constraint", default="", help="only nodes with these constraints (ids or names)"
    )
    nodes.add_argument("--json", action="store_true", help="one JSON object a node")

    users = commands.add_parser(
        "broker-users",
        help="create the config's RabbitMQ vhost and per-role users with their permissions "
        "(rabbitmqctl; docs/security.md)",
    )
    _add_config(users)
    users.add_argument("--remove-guest", action="store_true", help="delete the guest user too")
    users.add_argument("--node", default=None, help="rabbitmqctl -n NODE (default: its own)")

    bench = commands.add_parser("bench", help="micro-benchmarks of the scheduling hot path")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    bm = bench_kinds.add_parser("match", help="time one match on partitions of N nodes")
    bm.add_argument("--nodes", type=_sizes, default=(1_000, 5_000, 50_000), help="e.g. 1000,5000")
    bm.add_argument(
        "--constraints", type=_constraint_count, default=21, help="constraint vectors per node"
    )
    bm.add_argument("--samples", type=positive_int, default=2000, help="matches timed per size")
    bm.add_argument("--policy", default="first-fit", help="first-fit or best-fit")
    bm.add_argument("--seed", type=non_negative_int, default=7)
    bm.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    bp = bench_kinds.add_parser(
        "predict", help="lifetime prediction: in-process us/VM and sidecar p99 on loopback"
    )
    bp.add_argument("--model", help="lifetime model file (default: train one first)")
    bp.add_argument("--batch", type=positive_int, default=10_000, help="in-process batch size")
    bp.add_argument("--rpcs", type=positive_int, default=2_000, help="sidecar round trips timed")
    bp.add_argument("--json", action="store_true", help="print JSON instead of text")
    bh = bench_kinds.add_parser(
        "hops",
        help="one message between two processes: asyncio TCP vs gRPC unary vs gRPC stream",
    )
    bh.add_argument(
        "--rates",
        type=_rates,
        default=(200.0, 0.0),
        help="round trips per second, comma-separated; 0 = back to back (default 200,0)",
    )
    bh.add_argument("--count", type=positive_int, default=2000, help="round trips timed per run")
    bh.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _add_predictor_train(p: argparse.ArgumentParser) -> None:
    """``megha predictor`` serves; ``megha predictor train`` builds a lifetime model."""
    p.add_argument(
        "action", nargs="?", choices=("train",), help="train: build a lifetime model and exit"
    )
    p.add_argument(
        "--trace",
        help="train: VM trace, CSV (format: loadgen/vm_trace.py) or Azure's vmtable.csv[.gz]",
    )
    p.add_argument(
        "--synthetic",
        type=non_negative_int,
        default=0,
        help="train: on N VMs of the synthetic trace instead",
    )
    p.add_argument("--out", help="train: model file to write")
    p.add_argument(
        "--max-iter", type=positive_int, default=100, help="train: boosting rounds per model"
    )
    p.add_argument("--seed", type=non_negative_int, default=0)


@quiet_on_broken_pipe
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        if args.bench == "hops":
            return _bench_hops(args)
        return _bench_predict(args) if args.bench == "predict" else _bench(args)
    if args.command == "predictor" and args.action == "train":
        return _predictor_train(args)

    from services.common.authz import use_authz
    from services.common.bus import BrokerUnreachable, QueueTypeMismatch
    from services.common.config import ConfigError, load_config
    from services.common.server import TlsError, use_tls
    from services.local_master.journal import JournalError

    try:
        if args.command == "up":
            from services.app import operator

            workload = None
            if args.replay:  # the load generator's, handed down: the app does not import it
                from loadgen.replay import TraceReplay

                workload = TraceReplay(args)
            return operator.up(args, workload)
        config = load_config(args.config)
        if args.command == "certs":
            return _certs(args, config)
        if args.command == "broker-users":
            return _broker_users(args, config)
        identity = _identity(args, config)
        if config.authz is not None and identity == "worker/any":
            print("megha: with authz, a worker process serves one LM: pass --lm", file=sys.stderr)
            return 2
        use_tls(config.tls, identity)
        use_authz(config.authz, identity, config.effective_queues()[0].name)
        if args.command in ROLES:
            from services.app.runner import serve_role
            from services.common.logs import setup_logging

            setup_logging(f"{args.command}:{getattr(args, 'id', None) or ''}", args.log_level)
            if args.command in ("gm", "lm"):
                (config.gm if args.command == "gm" else config.lm)(args.id)  # known id?
            ident = getattr(args, "id", None) or getattr(args, "lm", None)
            pool = None
            if getattr(args, "pool", ""):
                config.pool(args.pool)  # known pool?
                pool = (args.pool, args.slot)
            asyncio.run(serve_role(config, args.command, ident, getattr(args, "count", None), pool))
            return 0
        if args.command == "autoscale":
            from services.autoscaler.service import serve
            from services.common.logs import setup_logging

            setup_logging("autoscale", args.log_level)
            path = str(Path(args.config).resolve()) if args.config else ""
            return asyncio.run(serve(config, path, Path(args.log_dir) if args.log_dir else None))
        if args.command == "console":
            from services.console.server import serve

            return asyncio.run(serve(config, args.host, args.port, args.refresh))
        from services.app import operator

        if args.command == "drain":
            return asyncio.run(operator.drain(args, config))
        if args.command == "nodes":
            from services.common.nodes import nodes

            return asyncio.run(nodes(args, config))
        return asyncio.run(operator.client_command(args, config))
    except (ConfigError, TlsError) as err:
        print(f"megha: {err}", file=sys.stderr)
        return 2
    # the operator's to mend (or to wait for)
    except (JournalError, BrokerUnreachable, QueueTypeMismatch) as err:
        print(f"megha: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _certs(args: argparse.Namespace, config) -> int:
    from services.app.certs import issue, new_token

    if args.token:
        token, digest = new_token()
        print(f"token for user {args.token} (give it to them; it is not stored):\n{token}")
        print(f"\nin the federation file:\nauthz:\n  users:\n    {args.token}:")
        print(f"      token_sha256: {digest}")
        return 0
    out = Path(args.out)
    written = issue(out, config, args.user, args.days)
    print(f"wrote {len(written)} certificates and keys under {out}/ (CA: {out}/ca.crt)")
    for path in written:
        print(f"  {path.relative_to(out).with_suffix('')}")
    print(f"\nin the federation file:\ntls:\n  ca: {out / 'ca.crt'}\n  dir: {out}")
    return 0


def _identity(args: argparse.Namespace, config) -> str | None:
    """Who this process is (``role/name``, for its certificate and its audit lines): a
    service from its command; the CLI from $MEGHA_IDENTITY (None: ``admin/operator``)."""
    if args.command in ("gm", "lm"):
        return f"{args.command}/{args.id}"
    if args.command == "worker":  # the worker hosts of one LM share its identity
        lm = config.pool(args.pool).lm if getattr(args, "pool", "") else args.lm
        return f"worker/{lm or 'any'}"
    if args.command == "predictor":
        return "predictor/predictor"
    if args.command in ("autoscale", "console"):
        return "autoscaler/autoscaler" if args.command == "autoscale" else "console/console"
    return None


def _broker_users(args: argparse.Namespace, config) -> int:
    from services.app.broker_users import BrokerUsersError, broker_users

    try:
        for line in broker_users(config, args.remove_guest, args.node):
            print(line)
    except (BrokerUsersError, OSError) as err:
        print(f"megha: {err}", file=sys.stderr)
        return 1
    return 0


def _bench(args: argparse.Namespace) -> int:
    from services.bench import bench_match, render_match

    results = bench_match(args.nodes, args.constraints, args.samples, args.policy, args.seed)
    print(render_match(results, args.json))
    return 0


def _bench_hops(args: argparse.Namespace) -> int:
    from services.bench_hops import bench_hops, render_hops

    print(render_hops(bench_hops(args.rates, args.count), args.json))
    return 0


def _bench_predict(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.bench_predict import bench_predict, render_predict
    from services.predictor.lifetime_model import ModelError

    try:
        result = bench_predict(Path(args.model) if args.model else None, args.batch, args.rpcs)
    except ModelError as err:
        print(f"megha: {err}", file=sys.stderr)
        return 2
    print(render_predict(result, args.json))
    return 0


def _predictor_train(args: argparse.Namespace) -> int:
    from loadgen.vm_trace import TraceError, read_vm_trace, synthetic_vm_trace
    from services.predictor.lifetime_model import train_lifetime_model

    if not args.out or bool(args.trace) == bool(args.synthetic):
        print(
            "megha: predictor train needs --out MODEL and one of --trace FILE or --synthetic N",
            file=sys.stderr,
        )
        return 2
    try:
        trace = (
            read_vm_trace(args.trace)
            if args.trace
            else synthetic_vm_trace(args.synthetic, prehistory_days=0)
        )
        model = train_lifetime_model(
            trace.features, trace.lifetime_s, max_iter=args.max_iter, seed=args.seed
        )
        path = model.save(args.out)
    except (TraceError, ValueError, OSError) as err:
        print(f"megha: {err}", file=sys.stderr)
        return 2
    print(
        f"wrote {path}: lifetime model on {len(trace)} VMs "
        f"({int(model.trained_on['rows'])} uptime-augmented rows), "
        f"features {', '.join(model.schema.names)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
