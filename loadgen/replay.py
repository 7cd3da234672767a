"""Replay a trace against a live federation: submit at the trace's arrival times (compressed
by ``speedup``), follow every job's task events, and report as the simulator does.

    jobs ──SubmitJob at arrival/speedup──▶ GMs (round-robin)
    GM WatchJob stream per job ──▶ EventLog ──task_row──▶ tasks.csv rows + stamps
        ──report.make_summary──▶ summary.json (target "live"), CDF plot

Allocation time is paper eq. 1 (submission to start) from the stamps the task carries.
Sim tasks hold their resources for ``duration / speedup`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from loadgen import report
from loadgen.events import AcceptedTasks, EventLog, TaskRows
from loadgen.trace import ReadStats, TraceError, TraceJob
from services._proto.megha.v1 import common_pb2
from services.app.operator import WorkloadError
from services.common.argtypes import positive_float, positive_int
from services.common.client import (
    BUSY_PAUSE_MAX_S,
    BUSY_PAUSE_S,
    BUSY_TRIES,
    OUTAGE_S,
    GlobalMasterClient,
    OutageWait,
    jittered,
)
from services.common.config import FederationConfig
from services.common.convert import resources_to_proto
from services.common.progress import Progress, bar
from services.core.resources import resources

DEFAULT_MEMORY_MB = 128  # .tr tasks ask for no memory; a live node validates > 0


@dataclass
class ReplayResult:
    summary: dict[str, Any]
    rows: Iterable[dict[str, Any]]  # made when iterated (TaskRows)
    alloc_values: list[float]
    files: list[Path] = field(default_factory=list)

    @property
    def tasks(self) -> int:
        return self.summary["tasks"]

    @property
    def completed(self) -> int:
        return self.summary["completed"]

    def render(self) -> str:
        s = self.summary
        lines = [report.render_summary(s)]
        behind = s["arrival_lag_s"]
        lines.append(
            f"replay                 {s['jobs']} jobs at speedup {s['speedup']:g}; "
            f"submissions behind the trace: p50 {report.ms(behind['p50'])} ms, "
            f"max {report.ms(behind['max'])} ms"
        )
        asked, slots = s.get("asked_at_once"), s.get("slots")
        if asked is not None and slots:
            lines.append(
                f"load                   the trace asks for {asked:,.0f} tasks running at once "
                f"on average (its task-seconds over its span); the federation holds {slots:,}"
            )
            if asked > slots:
                lines.append(
                    f"                       saturated ({asked / slots:,.1f}x): tasks waited for "
                    "a free node, which framework_queuing measures; the speedup does not "
                    "change this ratio, more nodes do"
                )
        if s["submit_errors"]:
            lines.append(f"submit errors          {s['submit_errors']}")
        if s.get("rerouted_submissions"):
            lines.append(
                f"rerouted               {s['rerouted_submissions']} submissions to another "
                "GM (the first could not take them)"
            )
        if s.get("retried_submissions"):
            lines.append(
                f"retried                {s['retried_submissions']} submissions after a pause "
                "(a GM was too busy for them)"
            )
        if s.get("outage_retries"):
            lines.append(
                f"waited out             {s['outage_retries']} rounds in which no GM could take "
                f"a job (down, restarting, no broker): each tried again after a pause, for up "
                f"to {OUTAGE_S:g} s, under its job id"
            )
        if s["timed_out"]:
            lines.append(
                f"gave up after {s['timeout_s']:g} s: {s['tasks'] - s['completed']} tasks "
                "had not completed"
            )
        if s["skipped_lines"]:
            lines.append(f"skipped trace lines    {s['skipped_lines']} malformed")
        for path in self.files:
            lines.append(f"wrote {path}")
        return "\n".join(lines)


# A GM that answers so is down, restarting or without LMs yet: another may take the job.
_ELSEWHERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# A job no GM took in a whole round of them (every GM down, restarting or cut off from
# its broker) is taken round again after a pause that doubles (``OutageWait``: from
# BUSY_PAUSE_S up to BUSY_PAUSE_MAX_S) for up to OUTAGE_S, as ``megha submit`` does,
# under the same job id: an outage of a few seconds (a GM restarting, a broker node
# dying) costs the job its wait, not its run. Such an answer does not say the job was not
# queued (a lost confirm), so giving up early would report as refused a job that may run
# anyway; the same id never runs it twice.

# A GM that answers so was too busy to take the job (RESOURCE_EXHAUSTED), or its gRPC
# dropped the call before the GM read it (a bare CANCELLED, from GMs that predate
# server.MAX_PENDING_CALLS): the job is tried again, through the next GM, after a pause
# that doubles, a bounded number of times. It keeps its job id, so it never runs twice.
_BUSY = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)


async def _first_answer(clients: Sequence[GlobalMasterClient]):
    """The cluster view from the first GM that answers; the last one's error if none does."""
    for client in clients[:-1]:
        with contextlib.suppress(grpc.aio.AioRpcError):
            return await client.cluster()
    return await clients[-1].cluster()


def build_tasks(job: TraceJob, speedup: float, memory_mb: int) -> list[common_pb2.Task]:
    tasks = []
    for t in job.tasks:
        duration = t.duration_s / speedup
        request = resources(t.cpu_milli, t.memory_mb or memory_mb, t.disk_mb, t.net_mbps)
        task = common_pb2.Task(resources=resources_to_proto(request), expected_duration_s=duration)
        task.constraints.extend(t.constraints)
        task.sim.duration_s = duration
        tasks.append(task)
    return tasks


async def replay_jobs(
    jobs: Sequence[TraceJob],
    gms: Sequence[str],
    speedup: float = 1.0,
    queues: Sequence[str] = (),
    memory_mb: int = DEFAULT_MEMORY_MB,
    timeout_s: float | None = None,
    progress: Progress | None = None,
    skipped_lines: int = 0,
) -> ReplayResult:
    """Submit ``jobs`` to ``gms`` (round-robin, with ``queues`` round-robin when given),
    wait until every task ended or ``timeout_s`` passed, and summarise."""
    if not gms:
        raise ValueError("no GM address given")
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    progress = progress or Progress(enabled=False)
    clients = [GlobalMasterClient(target, streaming=True) for target in gms]
    view = await _first_answer(clients)
    workers = sum(p.node_count for lm in view.lms for p in lm.partitions)
    # What the federation holds at once against what the trace asks for at once on
    # average (its task-seconds over its span: the speedup divides both), so a report
    # of a saturated pool says why its tasks waited.
    pool_cpu = sum(p.free.cpu_milli for lm in view.lms for p in lm.partitions)
    task_cpu = [t.cpu_milli for j in jobs for t in j.tasks if t.cpu_milli > 0]
    slots = pool_cpu // (sum(task_cpu) / len(task_cpu)) if task_cpu else 0
    trace_span = max((j.arrival_s for j in jobs), default=0.0) - (jobs[0].arrival_s if jobs else 0)
    work = sum(t.duration_s for j in jobs for t in j.tasks)
    asked_at_once = work / trace_span if trace_span > 0 else None
    events = EventLog()
    accepted = AcceptedTasks()  # task id -> (job id, GM)
    errors: dict[str, int] = {}
    rerouted = 0  # submissions a GM could not take, handed to the next one
    retried = 0  # submissions tried again after a pause: a GM was too busy for them
    outage_retries = 0  # rounds of the GMs tried again after a pause: none could take it
    # Job ids of this replay: a job handed to another GM keeps its id, so the federation
    # never runs it twice even if the first GM queued it after all.
    run_id = uuid.uuid4().hex[:8]
    lags: list[float] = []
    submitted_tasks = 0
    queue_cycle = itertools.cycle(queues or [""])
    client_cycle = itertools.cycle(zip(gms, clients, strict=True))
    first_arrival = jobs[0].arrival_s if jobs else 0.0
    span = (max((j.arrival_s for j in jobs), default=0.0) - first_arrival) / speedup
    longest = max((t.duration_s for j in jobs for t in j.tasks), default=0.0) / speedup
    timeout_s = timeout_s or 60 + 3 * (span + longest)
    total = sum(len(j.tasks) for j in jobs)
    watchers: list[asyncio.Task[None]] = []

    def line() -> str:
        done = len(events.ended)
        return (
            f"replay {bar(done / max(1, total))} {done}/{total} tasks ended, "
            f"{len(events.running)} started, {submitted_tasks} submitted, "
            f"wall {time.monotonic() - began:.0f} s"
        )

    async def follow(client: GlobalMasterClient, job_id: str, task_ids: Sequence[str]) -> None:
        # Through the other GMs when this one dies; what a new watch replays is not
        # counted twice (client.follow), so a second SUCCEEDED still means a second run.
        others = [c for c in clients if c is not client]
        async for event in client.follow(job_id, task_ids, timeout_s, others):
            events.add_event(event)

    async def submit(tasks: list[common_pb2.Task], queue: str, job_id: str):
        """Through the next GM; one that cannot take it (down, restarting, no answer in
        time) hands it to the one after, under the same job id, and one too busy has it
        tried again after a pause (``_BUSY``); when no GM of a whole round could take it,
        the round is tried again after a pause, for up to ``OUTAGE_S``. (gm, client,
        reply), or None once a GM refused it for good or the retries ran out (counted in
        ``errors``)."""
        nonlocal rerouted, retried, outage_retries
        elsewhere, busy, pause = 0, 0, BUSY_PAUSE_S
        outage = OutageWait()
        while True:
            gm, client = next(client_cycle)
            try:
                return gm, client, await client.submit(tasks, queue=queue, job_id=job_id)
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code in _BUSY and busy < BUSY_TRIES:
                    busy += 1
                    retried += 1
                    await asyncio.sleep(jittered(pause))
                    pause = min(BUSY_PAUSE_MAX_S, 2 * pause)
                    continue
                if code in _ELSEWHERE:
                    elsewhere += 1
                    if elsewhere % len(gms):  # the next GM of this round may take it
                        rerouted += 1
                        continue
                    wait = outage.pause(time.monotonic())
                    if wait is not None:
                        outage_retries += 1
                        await asyncio.sleep(wait)
                        continue
                errors[code.name] = errors.get(code.name, 0) + 1
                return None

    async def redraw() -> None:
        while True:
            progress.show(line)
            await asyncio.sleep(0.5)

    began = time.monotonic()
    began_ns = time.time_ns()
    reporter = asyncio.create_task(redraw())
    timed_out = False
    try:
        for index, job in enumerate(jobs):
            due = (job.arrival_s - first_arrival) / speedup
            delay = due - (time.monotonic() - began)
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(max(0.0, time.monotonic() - began - due))
            tasks = build_tasks(job, speedup, memory_mb)
            taken = await submit(tasks, next(queue_cycle), f"replay-{run_id}-{index}")
            if taken is None:
                continue
            gm, client, reply = taken
            submitted_tasks += len(tasks)
            job_id = reply.job_id  # one string for all its tasks
            for task_id in reply.task_ids:
                accepted.add(task_id, job_id, gm)
            watchers.append(asyncio.create_task(follow(client, job_id, reply.task_ids)))
        remaining = timeout_s - (time.monotonic() - began)
        if watchers:
            _, pending = await asyncio.wait(watchers, timeout=max(1.0, remaining))
            timed_out = bool(pending)
    finally:
        wall_s = time.monotonic() - began
        for watcher in watchers:
            watcher.cancel()
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*watchers, reporter, return_exceptions=True)
        progress.show(line, force=True)
        progress.done()
        for client in clients:
            await client.close()
    rows = TaskRows(events, accepted)
    measured = events.measure(accepted)
    jobs_done: dict[str, list[int]] = {}  # job -> [first submit, last finish, tasks left]
    for row in rows:
        job = jobs_done.setdefault(row["job_id"], [row["submitted_unix_nanos"], 0, 0])
        job[0] = min(job[0], row["submitted_unix_nanos"])
        if row["state"] == "succeeded":
            job[1] = max(job[1], row["finished_unix_nanos"])
        else:
            job[2] += 1
    job_completion = [(end - start) / 1e9 for start, end, left in jobs_done.values() if not left]
    throughput = report.placement_rate(measured.started_ns)
    summary = report.make_summary(
        target="live",
        scheduler="megha",
        workers=workers,
        gms=len(gms),
        lms=len(view.lms),
        jobs=len(jobs),
        tasks=total,
        completed=sum(1 for t in accepted if t in events.successes),
        alloc_s=report.percentiles(measured.alloc_s),
        components_s=report.component_medians(map(events.stamps, measured.task_ids)),
        throughput_tasks_per_s=round(throughput, 3),
        wall_s=round(wall_s, 3),
        speedup=speedup,
        offered_rate=round(total / span, 3) if span > 0 else None,
        asked_at_once=round(asked_at_once, 1) if asked_at_once is not None else None,
        slots=int(slots),
        accepted=len(accepted),
        submit_errors=errors,
        rerouted_submissions=rerouted,
        retried_submissions=retried,
        outage_retries=outage_retries,
        failed=sum(1 for t in accepted if t in events.ended and t not in events.successes),
        duplicates=events.duplicates,
        preemptions=events.preempted,
        timed_out=timed_out,
        timeout_s=round(timeout_s, 3),
        skipped_lines=skipped_lines,
        arrival_lag_s=report.percentiles(lags),
        job_completion_s=report.percentiles(job_completion),
        detail_s=report.detail_percentiles(map(events.stamps, measured.task_ids)),
        started_unix_nanos=began_ns,
    )
    return ReplayResult(summary, rows, measured.alloc_s)


def write_report(out_dir: Path, result: ReplayResult) -> list[Path]:
    s = result.summary
    files = [
        report.write_summary(out_dir, s),
        report.write_tasks_csv(out_dir, result.rows),
    ]
    title = f"live replay: {s['gms']} GMs x {s['lms']} LMs, {s['workers']} workers"
    cdf = report.write_cdf_png(out_dir, result.alloc_values, title=title)
    if cdf is not None:
        files.append(cdf)
    return files


def read_replay(path: str | Path, max_jobs: int | None = None) -> tuple[list[TraceJob], ReadStats]:
    """The jobs of a trace file (any format ``loadgen.readers`` knows), malformed lines
    skipped and counted; ``TraceError`` (or ``OSError``) when there is nothing to replay."""
    from loadgen.readers.dispatch import read_trace

    stats = ReadStats()
    jobs = list(read_trace(path, None, False, max_jobs, stats))
    stats.require_jobs(jobs, path)
    return jobs, stats


async def replay_trace(
    path: str | Path,
    gms: Sequence[str],
    speedup: float = 1.0,
    max_jobs: int | None = None,
    queues: Sequence[str] = (),
    timeout_s: float | None = None,
    out: Path | None = None,
    progress: Progress | None = None,
    loaded: tuple[list[TraceJob], ReadStats] | None = None,
) -> ReplayResult:
    """Read a trace file (``read_replay``; or take ``loaded``, what it read before) and
    replay it."""
    jobs, stats = loaded if loaded is not None else read_replay(path, max_jobs)
    result = await replay_jobs(
        jobs,
        gms,
        speedup,
        queues,
        timeout_s=timeout_s,
        progress=progress,
        skipped_lines=stats.skipped,
    )
    if out is not None:
        result.files = write_report(out, result)
    return result


class TraceReplay:
    """``megha up --replay TRACE``: the trace replayed once the federation is ready, its
    report printed (a ``services.app.operator.Workload``; ``megha up`` then stops)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.loaded: tuple[list[TraceJob], ReadStats] | None = None

    def load(self) -> None:
        try:
            self.loaded = read_replay(self.args.replay, self.args.max_jobs)
        except (TraceError, OSError) as err:
            raise WorkloadError(f"--replay: {err}") from err

    async def run(self, config: FederationConfig) -> int:
        args = self.args
        result = await replay_trace(
            args.replay,
            [g.target for g in config.gms],
            speedup=args.speedup,
            max_jobs=args.max_jobs,
            queues=[q.name for q in config.effective_queues()],
            out=Path(args.out) if getattr(args, "out", "") else None,
            progress=Progress(),
            loaded=self.loaded,
            timeout_s=getattr(args, "timeout", None),
        )
        print(result.render(), flush=True)
        return 0 if result.completed == result.tasks else 1


# ---------------------------------------------------------------------------- CLI
def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from loadgen.readers.options import add_trace_arguments

    parser = subparsers.add_parser(
        "replay",
        help="replay a trace against a live federation",
        description=(
            "Submit TRACE's jobs to the GMs at the trace's arrival times (divided by "
            "--speedup, as are task durations), follow every task's events and report "
            "allocation times as the simulator does. Exit 0 when every task completed, 1 "
            "when not, 2 when the replay could not run."
        ),
    )
    parser.add_argument("trace", type=Path, help="trace file (.tr, Google, Alibaba, Azure)")
    parser.add_argument(
        "--gm",
        required=True,
        help="GM address(es), HOST:PORT[,HOST:PORT...]; jobs go round-robin",
    )
    parser.add_argument("--speedup", type=positive_float, default=1.0, help="compress time by this")
    parser.add_argument(
        "--queue",
        action="append",
        default=[],
        help="user queue to submit to (repeat for round-robin; default: each GM's own)",
    )
    parser.add_argument(
        "--memory-mb",
        type=positive_int,
        default=DEFAULT_MEMORY_MB,
        help="memory of a task whose trace gives none",
    )
    parser.add_argument("--timeout", type=positive_float, help="give up after this many seconds")
    parser.add_argument("--out", type=Path, help="write summary.json, tasks.csv and a CDF here")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument(
        "--config",
        type=Path,
        help="the federation file, for its tls (a federation on mutual TLS); nothing else "
        "of it is used",
    )
    add_trace_arguments(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    from loadgen.readers.options import jobs_from_args

    try:
        jobs, stats = jobs_from_args(args)
        stats.require_jobs(jobs, args.trace)
    except (TraceError, ValueError, OSError) as err:
        print(f"megha-loadgen replay: {err}", file=sys.stderr)
        return 2
    for note in stats.notes:
        print(note, file=sys.stderr)
    if args.config is not None:
        from services.common.config import ConfigError, load_config
        from services.common.server import TlsError, use_tls

        try:
            use_tls(load_config(args.config).tls)
        except (ConfigError, TlsError) as err:
            print(f"megha-loadgen replay: {err}", file=sys.stderr)
            return 2
    gms = [g.strip() for g in args.gm.split(",") if g.strip()]
    try:
        result = asyncio.run(
            replay_jobs(
                jobs,
                gms,
                args.speedup,
                args.queue,
                memory_mb=args.memory_mb,
                timeout_s=args.timeout,
                progress=Progress(enabled=not args.quiet),
                skipped_lines=stats.skipped,
            )
        )
    except ValueError as err:
        print(f"megha-loadgen replay: {err}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as err:
        print(
            f"megha-loadgen replay: no GM of {', '.join(gms)} answered: {err.code().name}: "
            f"{err.details()}",
            file=sys.stderr,
        )
        return 2
    if args.out is not None:
        try:
            result.files = write_report(args.out, result)
        except OSError as err:
            print(f"megha-loadgen replay: cannot write {args.out}: {err}", file=sys.stderr)
            return 2
    print(result.render())
    return 0 if result.completed == result.tasks else 1
