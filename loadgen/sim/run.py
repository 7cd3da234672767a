"""One simulation run, from a trace to the DESIGN.md §5 report.

trace ──Workload──▶ MeghaSim | SparrowSim on an Engine ──TaskLog──▶ summary (report.py)
                                                         ──▶ summary.json, tasks.csv, CDF
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from loadgen import report
from loadgen.queues import gm_index
from loadgen.queues import render as render_queues
from loadgen.sim.config import SimConfig, SimConfigError
from loadgen.sim.engine import Engine
from loadgen.sim.megha import MeghaSim
from loadgen.sim.sparrow import SparrowSim
from loadgen.sim.workload import TaskLog, Workload
from loadgen.trace import ReadStats, TraceJob, read_tr
from services.common.progress import Progress, bar
from services.common.stalls import settle

# Summary keys that depend on the machine, not on the model: left out when runs are
# compared for determinism.
WALL_KEYS = ("wall_s", "sim_wall_s", "cpu_s", "sim_tasks_per_wall_s")


@dataclass
class SimResult:
    summary: dict[str, Any]
    log: TaskLog
    workload: Workload
    files: list[Path] = field(default_factory=list)

    def alloc_values_s(self) -> np.ndarray:
        started = self.log.started()
        stamps = self.log.stamps
        return (stamps["started"][started] - stamps["submitted"][started]) / 1e9


def load_trace(path: str | Path, max_jobs: int | None = None) -> tuple[list[TraceJob], ReadStats]:
    stats = ReadStats()
    jobs = list(read_tr(path, max_jobs=max_jobs, stats=stats))
    return jobs, stats


@contextlib.contextmanager
def _collector_settled() -> Iterator[None]:
    """The garbage collector as a long-lived service has it (``stalls.settle``) while
    the engine runs: the model and the workload, built once, are frozen out of its scans,
    and its thresholds raised (the engine makes and drops millions of small objects, few
    in cycles). Put back after, for a caller that goes on (tests run many simulations)."""
    before = gc.get_threshold()
    settle()
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def simulate(
    config: SimConfig,
    jobs: Iterable[TraceJob],
    progress: Progress | None = None,
    trace_name: str = "",
    machine_masks: np.ndarray | None = None,
    wall_limit_s: float | None = None,
) -> SimResult:
    """Run ``jobs`` through the configured scheduler; deterministic for a seed.

    ``wall_limit_s``: stop after this much wall time (a sweep stays bounded); the summary
    then says ``"timed_out": true`` and counts only what was done by then."""
    config.check()
    began = time.monotonic()
    cpu_began = time.process_time()
    progress = progress or Progress(enabled=False)
    workload = Workload.from_jobs(jobs)
    workload.scale_arrivals(config.arrival_scale)
    engine = Engine()
    rng = np.random.default_rng(config.seed)
    model: MeghaSim | SparrowSim
    if config.scheduler == "sparrow":
        if machine_masks is not None:
            raise SimConfigError("the sparrow model has no placement constraints")
        model = SparrowSim(config, workload, engine, rng)
    else:
        model = MeghaSim(config, workload, engine, rng, machine_masks=machine_masks)
    model.start()
    sim_began = time.monotonic()
    started = model.log.stamps["started"]
    span = max(1, int(workload.arrival_ns[-1]))

    def line() -> str:
        done = workload.tasks - model.remaining
        return (
            f"simulate {config.scheduler} {bar(done / workload.tasks)} "
            f"{done}/{workload.tasks} tasks done, {int(np.count_nonzero(started))} started, "
            f"virtual {engine.now / 1e9:,.0f} s ({min(1.0, engine.now / span):.0%} of arrivals), "
            f"{engine.events:,} events, wall {time.monotonic() - began:.0f} s"
        )

    deadline = None if wall_limit_s is None else began + wall_limit_s
    timed_out = False

    def tick() -> None:
        nonlocal timed_out
        progress.show(line)
        if deadline is not None and time.monotonic() > deadline:
            timed_out = True
            engine.stop()

    with _collector_settled():
        engine.run(tick=tick)
    sim_wall = time.monotonic() - sim_began
    progress.show(line, force=True)
    progress.done()
    summary = summarise(config, workload, model, engine, trace_name)
    wall = time.monotonic() - began
    summary["wall_s"] = round(wall, 3)
    summary["sim_wall_s"] = round(sim_wall, 3)
    # CPU seconds of this process: what the run costs when the machine is shared.
    summary["cpu_s"] = round(time.process_time() - cpu_began, 3)
    summary["sim_tasks_per_wall_s"] = round(workload.tasks / wall, 1) if wall > 0 else 0.0
    if timed_out:
        summary["timed_out"] = True
        summary["wall_limit_s"] = wall_limit_s
    return SimResult(summary, model.log, workload)


def summarise(
    config: SimConfig,
    workload: Workload,
    model: MeghaSim | SparrowSim,
    engine: Engine,
    trace_name: str,
) -> dict[str, Any]:
    log = model.log
    effective = config.effective()
    stamps = log.stamps
    started = log.started()
    finished = log.finished()
    alloc = (stamps["started"][started] - stamps["submitted"][started]) / 1e9
    throughput = report.placement_rate(stamps["started"][started])
    measured = list(_stamp_dicts(log, np.flatnonzero(started)))
    extra: dict[str, Any] = {}
    if isinstance(model, MeghaSim):
        c = model.counters
        counters = {
            "inconsistencies": c.inconsistencies,
            "repartitions": c.repartitions,
            "preemption_attempts": c.preemption_attempts,
            "preemptions": c.preemptions,
        }
        extra["megha"] = {
            "rejected_placements": c.rejected_placements,
            "repartitions_accepted": c.repartitions_accepted,
            "rounds": c.rounds,
            "matches": c.matches,
            "heartbeats": c.heartbeats,
            "full_snapshots": c.full_snapshots,
            "finish_notices": c.finish_notices,
        }
        if effective.gangs:
            extra["gangs"] = {
                "started": c.gangs_started,
                "refused_attempts": c.gang_refusals,
                "infeasible": c.gangs_infeasible,
            }
        if effective.uplink_mbps:
            extra["uplink"] = uplink_use(
                log, workload, effective.workers * effective.uplink_mbps, engine.now
            )
        gms, lms = effective.gms, effective.lms
        extra["per_gm"] = report.per_gm([f"gm{g}" for g in log.gm[started].tolist()], alloc)
        if effective.queues:
            extra["queues"], extra["queues_backlogged_s"] = model.queue_report()
            extra["preempted_work_s"] = round(
                sum(q["preempted_work_s"] for q in extra["queues"].values()), 3
            )
    else:
        counters = {}
        extra["sparrow"] = {
            "probes": model.probes,
            "noops": model.noops,
            "late_binding_rtts": model.late_binding_rtts,
        }
        gms = lms = 0  # Sparrow has neither: every scheduler talks to workers directly
    return report.make_summary(
        target="sim",
        scheduler=config.scheduler,
        workers=config.workers,
        gms=gms,
        lms=lms,
        jobs=workload.jobs,
        tasks=workload.tasks,
        completed=int(np.count_nonzero(finished)),
        alloc_s=report.percentiles(alloc),
        alloc_mean_s=float(alloc.mean()) if alloc.size else None,
        components_s=report.component_medians(measured),
        **counters,
        throughput_tasks_per_s=round(throughput, 3),
        wall_s=0.0,
        infeasible=int(np.count_nonzero(log.infeasible)),
        job_completion_s=report.percentiles(_job_completion_s(workload, log)),
        detail_s=report.detail_percentiles(measured),
        virtual_s=round((engine.now - int(workload.arrival_ns[0])) / 1e9, 6),
        events=engine.events,
        trace=trace_name,
        model=_model(effective),
        **extra,
    )


def uplink_use(log: TaskLog, workload: Workload, capacity_mbps: int, end_ns: int) -> dict:
    """summary.json's ``"uplink"``: the net_mbps the LMs booked on the workers' uplinks
    against their total capacity, time-weighted from the first arrival to ``end_ns``.

    What is booked, not traffic measured: a per-task ``net_mbps`` books the worst case
    (every vlink crossing the uplink), a VDC member its share for the actual placement.
    Each task's last attempt counts (preempted attempts, fair share only, do not)."""
    started = log.stamps["started"]
    ran = np.flatnonzero((started > 0) & (log.net_mbps > 0))
    begin = int(workload.arrival_ns[0])
    span = max(1, end_ns - begin)
    booked = log.net_mbps[ran].astype(np.float64)
    start = started[ran]
    stop = np.where(log.stamps["finished"][ran] > 0, log.stamps["finished"][ran], end_ns)
    # Peak: the running sum over start (+) and stop (-) events in time order (a stop
    # before a start at the same instant).
    times = np.concatenate([stop, start])
    steps = np.concatenate([-booked, booked])
    order = np.lexsort((steps, times))
    peak = float(np.cumsum(steps[order]).max()) if ran.size else 0.0
    mbps_s = float((booked * (stop - start)).sum()) / 1e9
    mean = mbps_s / (span / 1e9)
    return {
        "capacity_mbps": capacity_mbps,
        "booked_mbps_s": round(mbps_s, 3),
        "mean_booked_mbps": round(mean, 3),
        "utilisation": round(mean / capacity_mbps, 6),
        "peak_utilisation": round(peak / capacity_mbps, 6),
    }


def _model(config: SimConfig) -> dict[str, Any]:
    """summary.json's ``model``: the config the run used, each queue's GM by its number
    as summaries have always written it (``queues[].gm``: 1, not gm-1)."""
    model = asdict(replace(config, queues=()))
    model["queues"] = [{**q.model_dump(), "gm": gm_index(q.gm) + 1} for q in config.queues]
    return model


def _job_completion_s(workload: Workload, log: TaskLog) -> np.ndarray:
    """Arrival to the end of the job's last task, for jobs whose every task finished."""
    finished = log.stamps["finished"]
    counts = np.diff(workload.first)
    done = np.add.reduceat(log.finished().astype(np.int64), workload.first[:-1]) == counts
    last = np.maximum.reduceat(finished, workload.first[:-1])
    return (last[done] - workload.arrival_ns[done]) / 1e9


def _stamp_dicts(log: TaskLog, tasks: np.ndarray) -> Iterator[dict[str, int]]:
    columns = {name: values[tasks].tolist() for name, values in log.stamps.items()}
    names = list(columns)
    for row in zip(*columns.values(), strict=True):
        yield dict(zip(names, row, strict=True))


def task_rows(result: SimResult) -> Iterator[dict[str, Any]]:
    """One ``tasks.csv`` row per task (virtual nanoseconds in the ``*_unix_nanos`` columns)."""
    wl, log = result.workload, result.log
    job_of = wl.job_of().tolist()
    first = wl.first.tolist()
    stamps = {name: values.tolist() for name, values in log.stamps.items()}
    gm, lm, node = log.gm.tolist(), log.lm.tolist(), log.node.tolist()
    attempt, infeasible = log.attempt.tolist(), log.infeasible.tolist()
    for task in range(wl.tasks):
        job = job_of[task]
        started, submitted = stamps["started"][task], stamps["submitted"][task]
        if infeasible[task]:
            state = "rejected"
        elif stamps["finished"][task]:
            state = "succeeded"
        else:
            state = "running" if started else "pending"
        yield {
            "task_id": f"{wl.job_ids[job]}.{task - first[job]}",
            "job_id": wl.job_ids[job],
            "gm": f"gm{gm[task]}" if gm[task] >= 0 else "",
            "lm_id": f"lm{lm[task]}" if lm[task] >= 0 else "",
            "node_id": f"w{node[task]}" if node[task] >= 0 else "",
            **{f"{name}_unix_nanos": stamps[name][task] for name in report.STAMPS},
            "alloc_s": (started - submitted) / 1e9 if started else None,
            "attempt": attempt[task],
            "state": state,
        }


def write_report(out_dir: Path, result: SimResult) -> list[Path]:
    s = result.summary
    files = [
        report.write_summary(out_dir, s),
        report.write_tasks_csv(out_dir, task_rows(result)),
    ]
    title = f"sim {s['scheduler']}: {s['workers']} workers"
    if s["scheduler"] != "sparrow":
        title += f", {s['gms']} GMs x {s['lms']} LMs"
    cdf = report.write_cdf_png(out_dir, result.alloc_values_s(), title=title)
    if cdf is not None:
        files.append(cdf)
    return files


def render(result: SimResult) -> str:
    s = result.summary
    lines = [report.render_summary(s)]
    jct = s["job_completion_s"]
    lines.append(
        "job completion (s)     "
        + "  ".join(
            f"{k} {'-' if jct[k] is None else f'{jct[k]:.1f}'}" for k in report.PERCENTILE_KEYS
        )
    )
    lines.append(
        f"simulated              {s['tasks']} tasks, {s['events']:,} events, "
        f"{s['virtual_s']:,.0f} virtual s in {s['sim_wall_s']:.1f} wall s "
        f"({s['sim_tasks_per_wall_s']:,.0f} tasks per wall s)"
    )
    if s.get("queues"):
        lines.append(render_queues(s["queues"], s["queues_backlogged_s"]))
    if s.get("infeasible"):
        lines.append(f"infeasible tasks       {s['infeasible']} (no node could ever hold them)")
    for path in result.files:
        lines.append(f"wrote {path}")
    return "\n".join(lines)
