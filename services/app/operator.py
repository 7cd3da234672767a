"""What an operator runs by hand: ``megha up`` and the client commands.

``megha up`` starts the federation of a config (default: 2 GMs, 3 LMs, 8 workers per LM,
one predictor) as child processes against RabbitMQ, waits until every service is
healthy and every GM sees every worker, prints the endpoints, and stops everything
cleanly on Ctrl-C / SIGTERM. A child that dies after that is started again (every role
recovers from a restart), unless it keeps dying: then everything stops. Without a
reachable RabbitMQ (or with ``--embedded``) it runs all services in this one process on
an in-memory bus, and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Protocol

import grpc

from services._proto.megha.v1 import (
    common_pb2,
    global_master_pb2,
    local_master_pb2,
    local_master_pb2_grpc,
)
from services.app.supervisor import (
    ChildDied,
    Children,
    broker_reachable,
    start_federation,
    wait_until_ready,
    write_federation,
)
from services.common.authz import use_authz
from services.common.client import (
    BUSY_TRIES,
    OUTAGE_S,
    STATE_NAMES,
    FollowStalled,
    GlobalMasterClient,
    TaskTemplate,
    unreached,
)
from services.common.config import (
    FederationConfig,
    default_config,
    load_config,
    parse_config,
)
from services.common.convert import resources_from_proto
from services.common.jobfile import JobFileError, JobFileTask, build_template, load_job
from services.common.reports import (
    job_record,
    job_summary_record,
    plan_record,
    served_by,
    status_record,
)
from services.common.server import channel, endpoints, use_tls, wait_all_healthy
from services.core.constraints import ConstraintError
from services.core.limits import describe_held, limit_from_wire
from services.core.resources import ResourceError, format_resources
from services.core.states import TERMINAL

JOB_ROWS = 50  # tasks ``megha job`` lists without --all
FOLLOW_POLL_S = 0.5  # megha logs --follow: how often it asks for more
DRAIN_POLL_S = 1.0  # megha drain --wait: how often it asks again


class WorkloadError(ValueError):
    """Why a workload cannot run; ``megha up`` stops before anything starts."""


class Workload(Protocol):
    """What ``megha up`` runs once its federation is ready, then stops (``--replay``: a
    trace, replayed by the load generator). The CLI hands it in: the load generator sits
    above this layer, which does not import it."""

    def load(self) -> None:
        """Read it before anything starts; raise ``WorkloadError`` if it cannot run."""

    async def run(self, config: FederationConfig) -> int:
        """Run it against the ready federation: the exit code of ``megha up``."""


def _federation(args: argparse.Namespace) -> FederationConfig:
    """The federation ``megha up`` starts; its TLS files, if any, serve this process too
    (its clients, and every service with ``--embedded``)."""
    if args.config:
        config = load_config(args.config)
    else:
        config = parse_config(default_config(args.gms, args.lms, args.workers, args.base_port))
    use_tls(config.tls)  # the operator's identity; every embedded service's too
    use_authz(config.authz, None, config.effective_queues()[0].name)
    return config


# --------------------------------------------------------------------------- up
def up(args: argparse.Namespace, workload: Workload | None = None) -> int:
    config = _federation(args)
    if workload is not None:  # one that cannot run stops us before anything starts
        try:
            workload.load()
        except WorkloadError as err:
            print(f"megha: {err}", file=sys.stderr)
            return 2
    embedded = args.embedded
    if not embedded and not broker_reachable(config.rabbitmq_url):
        print(
            f"megha: RabbitMQ is not reachable at {config.rabbitmq_url}; falling back to "
            "--embedded (every service in this process, in-memory bus)",
            file=sys.stderr,
        )
        embedded = True
    if embedded:
        if config.autoscale is not None:
            print(
                "megha: the autoscale pools are not run with --embedded (each of their "
                "nodes is a process); run megha up against RabbitMQ for them",
                file=sys.stderr,
            )
        return asyncio.run(_up_embedded(config, workload, args.console_port))
    return asyncio.run(_up_processes(config, args, workload))


def _print_endpoints(config: FederationConfig, mode: str) -> None:
    workers = sum(g.count for g in config.workers)
    print(
        f"megha: federation up ({mode}): {len(config.gms)} GMs, {len(config.lms)} LMs, "
        f"{workers} workers",
        flush=True,
    )
    for name, target in endpoints(config):
        print(f"  {name:<12} {target}", flush=True)


@contextlib.asynccontextmanager
async def _console(config: FederationConfig, port: int):
    """The web console of the federation ``megha up`` started, on ``port`` (another one
    if it is taken; 0: none), its URL printed with the endpoints."""
    if not port:
        yield
        return
    from services.console.server import bind, running_console

    sock = bind("127.0.0.1", port, fallback=True)
    async with running_console(config, sock) as url:
        print(f"  {'console':<12} {url}", flush=True)
        yield


async def _up_embedded(
    config: FederationConfig, workload: Workload | None, console_port: int = 0
) -> int:
    from services.app.runner import serve_embedded

    ready = asyncio.Event()
    server = asyncio.create_task(serve_embedded(config, ready))
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait({server, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if server in done:
        server.result()
        return 1
    await wait_until_ready(config)
    _print_endpoints(config, "embedded")
    code = 0
    async with _console(config, console_port):
        if workload is not None:
            code = await workload.run(config)
            server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
    return code


async def _up_processes(
    config: FederationConfig, args: argparse.Namespace, workload: Workload | None
) -> int:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="megha-up-"))
    config, config_path = write_federation(config, log_dir)
    children = Children(log_dir)
    try:
        start_federation(config, config_path, children)
        await children.guard(wait_all_healthy(config, timeout_s=60))
        await children.guard(wait_until_ready(config))
        stop = asyncio.Event()
        if workload is None:
            # Before the endpoints are printed: a caller that reads them may stop us at
            # once, while the console is still starting.
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        _print_endpoints(config, f"processes, logs in {log_dir}")
        async with _console(config, args.console_port):
            # From here on a child that dies is started again: the federation recovers.
            if workload is not None:
                return await children.guard(workload.run(config), restart=True)
            await children.guard(stop.wait(), restart=True)
            return 0
    except ChildDied as err:
        print(f"megha: {err}", file=sys.stderr)
        return 1
    finally:
        children.stop()


# ------------------------------------------------------------------- clients
async def client_command(args: argparse.Namespace, config: FederationConfig) -> int:
    target = args.gm or config.gms[0].target
    try:
        async with GlobalMasterClient(target) as client:
            if args.command == "submit":
                return await _submit(client, args, config)
            if args.command == "job":
                return await _job(client, args)
            if args.command == "jobs":
                return await _jobs(client, args)
            if args.command == "logs":
                return await _logs(client, args)
            if args.command == "cancel":
                return await _cancel(client, args, config)
            if args.command == "status":
                return await _status(client, config, target, getattr(args, "json", False))
    except grpc.aio.AioRpcError as err:
        print(f"megha: {err.code().name}: {err.details()}", file=sys.stderr)
        # Not for UNAVAILABLE answers of a running GM (no LM heard from, broker down).
        if unreached(err):
            print(
                f"megha: no Global Master answers at {target}; start a federation with "
                "`megha up`, or name a running GM with --gm HOST:PORT",
                file=sys.stderr,
            )
        return 1
    return 2


async def drain(args: argparse.Namespace, config: FederationConfig) -> int:
    """``megha drain``: asks the node's LM (``--lm``, else each LM in turn, until one
    knows it) to drain it, or to stop (``--undo``); with ``--wait``, until no task runs
    on it; with ``--list``, which nodes every LM drains."""
    if args.list == bool(args.node_id) or (args.list and (args.undo or args.wait)):
        print("megha: name a NODE_ID, or --list (alone)", file=sys.stderr)
        return 2
    failed = found = False
    for lm in [config.lm(args.lm)] if args.lm else config.lms:
        ask = local_master_pb2.DrainNodeRequest(
            node_id=args.node_id, undo=args.undo, query=args.list
        )
        try:
            async with channel(lm.target) as chan:
                stub = local_master_pb2_grpc.LocalMasterStub(chan)
                reply = await stub.DrainNode(ask, timeout=10)
                if args.list:
                    print(f"{lm.id}: {', '.join(reply.draining_node_ids) or 'no node draining'}")
                    continue
                found = True
                return await _drained(stub, ask, reply, lm.id, args)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND and not args.lm:
                continue  # another LM's node
            print(f"megha: {lm.id}: {err.code().name}: {err.details()}", file=sys.stderr)
            failed = True
            if args.lm or found:
                return 1
    if args.list:
        return 1 if failed else 0
    also = " (and not every LM answered)" if failed else ""
    print(f"megha: no LM has a node {args.node_id!r}{also}", file=sys.stderr)
    return 1


async def _drained(stub, ask, reply, lm_id: str, args: argparse.Namespace) -> int:
    node = f"node {args.node_id} ({lm_id})"
    if args.undo:
        print(f"{node} takes tasks again")
        return 0
    told = -1
    while reply.running:
        if reply.running != told:
            print(f"{node} draining: {reply.running} tasks still run", flush=True)
            told = reply.running
        if not args.wait:
            return 0
        await asyncio.sleep(DRAIN_POLL_S)
        ask.query = True  # only asks: an --undo meanwhile is not undone
        try:
            reply = await stub.DrainNode(ask, timeout=10)
        except grpc.aio.AioRpcError as err:  # e.g. the LM restarting: ask again
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            continue
        if not reply.draining:
            print(f"megha: {node} was let take tasks again meanwhile", file=sys.stderr)
            return 1
    print(f"{node} drained: no task runs on it")
    return 0


# megha submit's options that describe the tasks (not given with --file).
_TASK_OPTIONS = ("resources", "count", "duration", "argv", "image", "env", "timeout")
_TASK_OPTIONS += ("constraints", "retries", "priority")


async def _submit(client: GlobalMasterClient, args, config: FederationConfig) -> int:
    if args.wait and (getattr(args, "dry_run", False) or getattr(args, "json", False)):
        print("megha: --wait follows a queued job: not with --dry-run or --json", file=sys.stderr)
        return 2
    if args.file:
        return await _submit_file(client, args, config)
    if args.env and not (args.argv or args.image):
        print("megha: --env is for a process (--command) or a container (--image)", file=sys.stderr)
        return 2
    spec = JobFileTask(
        command=args.argv or None,
        image=args.image or None,
        duration=args.duration,
        resources=args.resources,
        constraints=args.constraints,
        timeout=args.timeout,
        retries=args.retries,
        priority=args.priority,
        env=dict(args.env) or None,
    )
    try:
        template = build_template(spec, config.num_constraints, None, config.constraint_names)
    except (ResourceError, ConstraintError) as err:
        print(f"megha: {err}", file=sys.stderr)
        return 2
    tasks = [template] * (args.count or 1)
    each = f"{format_resources(template.resources)} each"
    return await _queue_job(client, args, config, tasks, args.queue, args.job_id, each)


async def _submit_file(client: GlobalMasterClient, args, config: FederationConfig) -> int:
    """A job of the tasks a job file lists (``jobfile.py``); ``--queue`` and ``--job-id``
    win over the file's."""
    given = [name for name in _TASK_OPTIONS if getattr(args, name) not in (None, [], "")]
    if given:
        options = ", ".join("--" + ("command" if name == "argv" else name) for name in given)
        print(f"megha: the job file describes the tasks: no {options} with it", file=sys.stderr)
        return 2
    name = "stdin" if args.file == "-" else args.file
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except (OSError, UnicodeDecodeError) as err:
        why = getattr(err, "strerror", None) or err
        print(f"megha: cannot read {name}: {why}", file=sys.stderr)
        return 2
    try:
        job, templates = load_job(text, config.num_constraints, config.constraint_names)
    except JobFileError as err:
        for line in str(err).splitlines():
            print(f"megha: {name}: {line}", file=sys.stderr)
        return 2
    kinds = _by_state(Counter(_kind(template) for template in templates))
    queue, job_id = args.queue or job.queue, args.job_id or job.job_id
    return await _queue_job(client, args, config, templates, queue, job_id, kinds)


async def _queue_job(
    client: GlobalMasterClient,
    args,
    config: FederationConfig,
    templates: list[TaskTemplate],
    queue: str,
    job_id: str,
    what: str,
) -> int:
    """Submit a task for each template, say so, and with ``--wait`` follow the job; with
    ``--dry-run``, say where each would go instead (``_dry_run``)."""
    if getattr(args, "dry_run", False):
        return await _dry_run(client, args, config, templates, queue)

    # A GM whose intake is full asks for a retry after a pause: wait as it says, a
    # bounded number of times, saying so on stderr (stdout may be --json).
    def busy(pause: float) -> None:
        print(f"megha: the GM is busy; trying again in {pause:.1f} s", file=sys.stderr)

    # A GM that cannot take it now (its broker away, no LM heard from yet) or whose
    # answer did not come may have queued it: asked again under the same job id, for a
    # while (OUTAGE_S), it runs once; a GM none can connect to is said at once.
    def unsure(err: grpc.aio.AioRpcError, job: str, pause: float) -> None:
        print(
            f"megha: {err.code().name}: {err.details()}; trying again in {pause:.1f} s "
            f"under job id {job} (it runs once however many tries reach the GM)",
            file=sys.stderr,
        )

    reply = await client.submit(
        [t.build() for t in templates],
        queue=queue,
        job_id=job_id,
        busy_tries=BUSY_TRIES,
        on_busy=busy,
        unsure_for_s=getattr(args, "retry_for", OUTAGE_S),
        on_unsure=unsure,
        gang=getattr(args, "gang", False),
        min_tasks=getattr(args, "min_tasks", 0) or 0,
        vdc=getattr(args, "vdc", None),
    )
    if getattr(args, "json", False):
        _print_json({"job_id": reply.job_id, "task_ids": list(reply.task_ids)})
        return 0
    print(f"job {reply.job_id}: {len(reply.task_ids)} tasks queued ({what})")
    if args.wait:
        return await _follow(client, reply.job_id, reply.task_ids)
    return 0


async def _dry_run(
    client: GlobalMasterClient,
    args,
    config: FederationConfig,
    templates: list[TaskTemplate],
    queue: str,
) -> int:
    """Where each task would go now, or why not, as the GM judges it (``PlanJob``);
    nothing is queued. Asked of the GM that serves the queue (another GM matches its own
    partition first), unless ``--gm`` names one. Exit 0 if every task would start now
    (placed, or by preemption), 1 if some would wait, 2 if some could never run."""
    target = client.target if args.gm else (_queue_gm(config, queue) or client.target)
    tasks = [t.build() for t in templates]
    gang = {
        "gang": getattr(args, "gang", False),
        "min_tasks": getattr(args, "min_tasks", 0) or 0,
        "vdc": getattr(args, "vdc", None),
    }
    if target == client.target:
        plan = await client.plan(tasks, queue, **gang)
    else:
        async with GlobalMasterClient(target) as serving:
            plan = await serving.plan(tasks, queue, **gang)
    if getattr(args, "json", False):
        _print_json(plan_record(plan))
    else:
        note = "" if plan.served_here else " (not the GM serving the queue: it would differ)"
        print(f"dry run on {plan.gm_id} for queue {plan.queue}{note}; nothing was queued")
        rows = plan_record(plan)["tasks"]
        for outcome, group in _runs(rows):
            first, last = group[0]["index"], group[-1]["index"]
            which = f"task {first}" if first == last else f"tasks {first}-{last}"
            if outcome == "preempts" and not group[0]["lm_id"]:  # a gang, as a whole
                print(f"  {which:<10} would start by preemption: {group[0]['reason']}")
            elif outcome in ("placed", "preempts"):
                for row in group:  # one line each: each goes to its own node
                    how = " (repartition)" if row["repartition"] else ""
                    why = f": {row['reason']}" if outcome == "preempts" else ""
                    where = f"{row['lm_id']}/{row['node_id']}"
                    verb = "would run on" if outcome == "placed" else "would preempt on"
                    print(f"  task {row['index']:<5} {verb} {where}{how}{why}")
            else:
                verb = "would wait" if outcome == "waits" else "would never run"
                print(f"  {which:<10} {verb}: {group[0]['reason']}")
    outcomes = {t.outcome for t in plan.tasks}
    if global_master_pb2.PLAN_OUTCOME_NEVER in outcomes:
        return 2
    return 1 if global_master_pb2.PLAN_OUTCOME_WAITS in outcomes else 0


def _runs(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """Consecutive rows of the same outcome and reason, grouped (a job of 1,000 tasks
    that all wait for the same thing says so once)."""
    runs: list[tuple[str, list[dict]]] = []
    for row in rows:
        if runs and runs[-1][0] == row["outcome"] and runs[-1][1][-1]["reason"] == row["reason"]:
            runs[-1][1].append(row)
        else:
            runs.append((row["outcome"], [row]))
    return runs


def _queue_gm(config: FederationConfig, queue: str) -> str | None:
    """The target of the GM serving ``queue`` (empty: the first), if the config knows."""
    known = config.queue(queue) if queue else config.effective_queues()[0]
    return None if known is None else config.gm(known.gm).target


def _print_json(record) -> None:
    print(json.dumps(record, indent=1))


def _kind(template: TaskTemplate) -> str:
    return "container" if template.image else "process" if template.command else "simulated"


# Events of a big job that ``--wait`` / ``--watch`` print one by one; the rest show only
# in the progress line and the closing counts.
_ROUTINE = {"queued", "placed", "running", "succeeded"}
_TERMINAL_NAMES = {STATE_NAMES[state] for state in TERMINAL}  # succeeded, failed, ...


def _by_state(counts: Counter[str]) -> str:
    """'52 succeeded, 8 running': how many tasks are in each state, most first."""
    return ", ".join(f"{n} {state}" for state, n in counts.most_common() if n)


async def _follow(client: GlobalMasterClient, job_id: str, task_ids=()) -> int:
    """Print a job's events until it ends, through GM restarts (``client.follow``). A job
    of over ``JOB_ROWS`` tasks prints only the events that are not routine, a progress
    line on stderr, and its counts by state at the end."""
    from services.common.progress import Progress, bar

    if not task_ids:
        with contextlib.suppress(grpc.aio.AioRpcError):  # follow() says what went wrong
            task_ids = [t.task_id for t in (await client.job(job_id)).tasks]
    big = len(task_ids) > JOB_ROWS
    progress = Progress(enabled=big)
    latest: dict[str, str] = {}  # task -> its state now

    def line() -> str:
        counts = Counter(latest.values())  # only when the line is drawn
        ended = sum(counts[s] for s in _TERMINAL_NAMES)
        progressed = f"{bar(ended / len(task_ids))} {ended}/{len(task_ids)}"
        return f"job {job_id} {progressed} ended: {_by_state(counts)}"

    failed = False
    try:
        async for event in client.follow(job_id, task_ids):
            state = STATE_NAMES.get(event.state, "?")
            failed |= state in _TERMINAL_NAMES and state != "succeeded"
            latest[event.task_id] = state
            if big and state in _ROUTINE:
                progress.show(line)
                continue
            progress.done()
            where = f" on {event.lm_id}/{event.node_id}" if event.node_id else ""
            why = f" ({event.reason})" if event.reason else ""
            peak = f" [peak {event.peak_memory_mb} MiB]" if event.peak_memory_mb else ""
            print(f"{event.task_id:<24} {state:<10}{where}{why}{peak}", flush=True)
    except FollowStalled as err:
        progress.done()
        print(f"megha: {err}", file=sys.stderr)
        return 1
    progress.done()
    if big:
        print(f"job {job_id}: {len(task_ids)} tasks: {_by_state(Counter(latest.values()))}")
    return 1 if failed else 0


async def _logs(client: GlobalMasterClient, args) -> int:
    """Copy a task attempt's output from its worker host to stdout, a chunk at a time;
    with ``--follow``, until the attempt has ended (waiting for it to start first); with
    ``--all``, every task's latest attempt in turn, each under a ``==> TASK <==`` line."""
    if args.all and (args.task_id or args.follow or args.attempt is not None):
        print(
            "megha: --all reads every task's latest attempt: no TASK_ID, --attempt "
            "or --follow with it",
            file=sys.stderr,
        )
        return 2
    task_id = args.task_id
    if args.all or not task_id:
        tasks = (await client.job(args.job_id)).tasks
        if args.all:
            worst = 0
            for task in tasks:
                print(f"==> {task.task_id} <==", flush=True)
                try:
                    worst = max(worst, await _copy_output(client, args, task.task_id))
                except grpc.aio.AioRpcError as err:  # e.g. not run yet: the next one
                    print(f"megha: {task.task_id}: {err.details()}", file=sys.stderr)
                    worst = 1
            return worst
        if len(tasks) != 1:
            print(f"megha: job {args.job_id} has {len(tasks)} tasks: name one", file=sys.stderr)
            return 2
        task_id = tasks[0].task_id
    return await _copy_output(client, args, task_id)


async def _copy_output(client: GlobalMasterClient, args, task_id: str) -> int:
    stream = "stderr" if args.stderr else "stdout"
    offset = -args.tail if args.tail else 0
    attempt = args.attempt
    out = sys.stdout.buffer
    while True:
        try:
            part = await client.output(args.job_id, task_id, attempt, args.stderr, offset)
        except grpc.aio.AioRpcError as err:
            if args.follow and err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                await asyncio.sleep(FOLLOW_POLL_S)  # not on a worker yet
                continue
            raise
        attempt = part.attempt  # the same attempt, even if a newer one starts
        if not part.found:
            if args.follow and (part.running or part.state not in TERMINAL):
                await asyncio.sleep(FOLLOW_POLL_S)  # its start is on its way
                continue
            if not part.node_id:
                state = STATE_NAMES.get(part.state, "?")
                print(f"megha: task {task_id} ended {state} without running", file=sys.stderr)
                return 1
            print(
                f"megha: no {stream} of task {task_id} attempt {part.attempt} on "
                f"{part.lm_id}/{part.node_id}: a simulated task writes none, an attempt "
                "that ran on another node is not there, a host keeps only its newest "
                "attempts (worker_output_keep), and one that cannot write its "
                "worker_output_dir keeps none (its log says why)",
                file=sys.stderr,
            )
            return 1
        wanted = max(0, part.size + offset) if offset < 0 else offset
        if part.offset > wanted:
            out.flush()  # the note goes where the gap is
            print(
                f"megha: [{part.offset - wanted} bytes of {stream} not kept here: a host "
                "keeps the last worker_output_max_mb MiB of each]",
                file=sys.stderr,
                flush=True,
            )
        out.write(part.data)
        offset = part.offset + len(part.data)
        if part.data and offset < part.size:
            continue  # more is there already
        out.flush()
        if not (args.follow and part.running):
            return 0
        await asyncio.sleep(FOLLOW_POLL_S)


async def _job(client: GlobalMasterClient, args) -> int:
    if args.watch:
        if getattr(args, "json", False):
            print("megha: --watch prints events as they come: not with --json", file=sys.stderr)
            return 2
        return await _follow(client, args.job_id)
    job = await client.job(args.job_id)
    if getattr(args, "json", False):
        _print_json(job_record(job))
        return 0
    counts = Counter(STATE_NAMES.get(t.state, "?") for t in job.tasks)
    print(f"job {job.job_id} (queue {job.queue}): {len(job.tasks)} tasks: {_by_state(counts)}")
    peaks = sorted(t.peak_memory_mb for t in job.tasks if t.peak_memory_mb)
    if peaks:  # what to ask for next time
        print(
            f"peak memory of {len(peaks)} process tasks: median {peaks[len(peaks) // 2]} MiB, "
            f"max {peaks[-1]} MiB"
        )
    rows = list(job.tasks)
    if not args.all and len(rows) > JOB_ROWS:
        # The tasks worth a look first: those that have not succeeded.
        rows.sort(key=lambda t: t.state == common_pb2.TASK_STATE_SUCCEEDED)
        rows = rows[:JOB_ROWS]
    for task in rows:
        state = STATE_NAMES.get(task.state, "?")
        where = f"{task.lm_id}/{task.node_id}" if task.node_id else "-"
        print(f"  {task.task_id:<24} {state:<10} {where:<24} {_note(task)}".rstrip())
    if len(rows) < len(job.tasks):
        print(f"  ... {len(job.tasks) - len(rows)} more (--all lists every task)")
    return 0


def _note(task: global_master_pb2.TaskStatus) -> str:
    """Why a task waits, and for a later attempt, how the one before it ended; the
    peak memory of one that ended."""
    peak = f"[peak {task.peak_memory_mb} MiB] " if task.peak_memory_mb else ""
    if not task.attempt:
        return peak + task.pending_reason
    before = ""
    if task.HasField("previous_end"):
        end = task.previous_end
        why = f" ({end.reason})" if end.reason else ""
        before = f", after attempt {end.attempt} {STATE_NAMES.get(end.state, '?')}{why}"
    return f"{peak}[attempt {task.attempt}{before}] {task.pending_reason}"


async def _jobs(client: GlobalMasterClient, args) -> int:
    jobs = await client.jobs(args.queue, args.limit, args.unfinished)
    if getattr(args, "json", False):
        _print_json([job_summary_record(job) for job in jobs])
        return 0
    if not jobs:
        print("no job (a GM remembers the jobs submitted through it and those it heard run)")
        return 0
    print(f"{'job':<24} {'queue':<12} {'tasks':>7}  states")
    for job in jobs:
        counts: Counter[str] = Counter()
        for count in job.states:
            counts[STATE_NAMES.get(count.state, "?")] = count.tasks
        print(f"{job.job_id:<24} {job.queue:<12} {job.tasks:>7}  {_by_state(counts)}")
    return 0


async def _cancel(client: GlobalMasterClient, args, config: FederationConfig) -> int:
    reply = await client.cancel(args.job_id, args.reason)
    if reply.known:
        print(f"job {args.job_id}: cancelled ({reply.unfinished} tasks had not ended)")
    else:
        print(f"job {args.job_id}: cancel sent to every GM and LM (this GM does not know the job)")
    if not args.wait:
        return 0
    # Followed through the GM serving the job's queue: another GM knows only the tasks
    # that reached an LM, and could end the watch before the queued ones are dropped.
    serving = await _serving_gm(client, args.job_id, config)
    if serving is None or serving == client.target:
        await _follow(client, args.job_id)
        return 0
    async with GlobalMasterClient(serving) as owner:
        await _follow(owner, args.job_id)
    return 0


async def _serving_gm(
    client: GlobalMasterClient, job_id: str, config: FederationConfig
) -> str | None:
    """The target of the GM serving ``job_id``'s queue, if the job and queue are known."""
    try:
        queue = config.queue((await client.job(job_id)).queue)
    except grpc.aio.AioRpcError:
        return None
    return None if queue is None else config.gm(queue.gm).target


def _free(cpu_milli: int, memory_mb: int) -> str:
    return f"cpu={cpu_milli / 1000:g} mem={memory_mb}Mi"


async def _status(
    client: GlobalMasterClient, config: FederationConfig, target: str, json_out: bool = False
) -> int:
    view = await client.cluster()
    served = await served_by(view, config, target)
    if json_out:
        _print_json(status_record(view, served, config, target))
        return 0
    print(f"{'LM':<10} {'version':>8} {'age s':>6}  partitions (gm: nodes, free)")
    # Per GM partition: nodes and free room over the LMs the GM hears from. A silent LM's
    # room is what it last said it had: not counted, it may be gone.
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for lm in view.lms:
        parts = "; ".join(
            f"{p.gm_id}: {p.node_count}, {_free(p.free.cpu_milli, p.free.memory_mb)}"
            for p in lm.partitions
        )
        if lm.silent:
            parts = f"SILENT: not heard from, not counted (it said: {parts})"
        else:
            for p in lm.partitions:
                total = totals[p.gm_id]
                total[0] += p.node_count
                total[1] += p.free.cpu_milli
                total[2] += p.free.memory_mb
        print(f"{lm.lm_id:<10} {lm.version:>8} {lm.age_s:>6.1f}  {parts}")
    for lm_id in sorted({lm.id for lm in config.lms} - {lm.lm_id for lm in view.lms}):
        print(f"{lm_id:<10} {'-':>8} {'-':>6}  NOT HEARD FROM by this GM")
    total = "; ".join(f"{gm}: {n}, {_free(cpu, mem)}" for gm, (n, cpu, mem) in totals.items())
    print(f"{'total':<10} {'':>8} {'':>6}  {total or 'no LM heard from'}")
    print(
        f"\n{'queue':<12} {'gm':<8} {'share':>6} {'usage':>6} {'pending':>8} {'running':>8}"
        "  limit (held/limit)"
    )
    for q in view.queues:
        limit = "-"
        if q.HasField("limit"):
            wanted = limit_from_wire(resources_from_proto(q.limit))
            limit = describe_held(resources_from_proto(q.held), wanted)
        who, waiting = served[q.queue].gm_id, served[q.queue].pending
        gm = who or "?"
        if who != q.gm_id:  # queue failover: another serves it, or none says it does
            gm += f" (prefers {q.gm_id})"
        print(
            f"{q.queue:<12} {gm:<8} {q.share:>6.0%} {q.usage_share:>6.0%} "
            f"{'?' if waiting is None else waiting:>8} "
            f"{q.running_tasks:>8}  {limit}"
        )
    times = view.recent_allocation_times
    if times.count:
        print(
            f"\nallocation time (last {times.count} tasks of this GM): "
            f"p50 {times.p50_s * 1e3:.1f} ms  p90 {times.p90_s * 1e3:.1f} ms  "
            f"p99 {times.p99_s * 1e3:.1f} ms"
        )
    return 0
