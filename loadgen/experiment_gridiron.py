"""Gridiron's VDCs (issue 33 item 3): per-task ``net_mbps`` placement against VDC-aware
gang placement, on the Yahoo sample and an Azure-format VM table, as the workers' uplink
grows.

    gridiron() ──per (trace, uplink, mode): SimConfig──▶ ``megha-loadgen experiment gridiron``
        ──▶ OUT/gridiron/{yahoo,azure}-{pertask,vdc}-{1,2,5,10}g/summary.json (+ "gridiron")
        ──▶ OUT/gridiron/gridiron.png + table.md (``markdown_table``) + ``verdicts``

Both modes replay the same jobs, augmented as ``--gridiron`` does (``gridiron_bandwidth``:
each job split into VDCs of at most ``PEAK_VDC`` tasks, vlink ``bpc x min(cores)`` capped
at Gridiron's ``4C / P**2`` for a C = 40,000 Mbit/s datacenter, i.e. 177 Mbit/s):

- ``pertask``: ``--gridiron`` alone. Every task books its worst case, every vlink crossing
  its uplink, and is placed on its own; a task whose ``net_mbps`` exceeds an empty uplink
  never runs (infeasible).
- ``vdc``: ``--gridiron --gangs``. Every VDC is a gang placed whole by the core's
  ``plan_gang`` (``Colocate``): each member books only its vlinks to members on other
  nodes, so colocation saves uplink; a VDC no placement fits on the empty federation is
  infeasible.

Per run: VDCs and jobs that could not be placed (infeasible: some member never runs),
VDCs admitted (every member started), jobs completed, the booked uplink utilisation
(``summary["uplink"]``, time-weighted over the run), the allocation time of whole VDCs
(submission to the last member's start, in both modes) against per-task allocation, wall
time. The workers are multi-core (colocation needs room for several members on a node):
16 cores for the Yahoo sample's 1-core tasks, 32 for the Azure VMs (2-32 cores).

The Azure table is SYNTHETIC unless one is given (``--azure``): ``loadgen/synth_azure.py``
(seeded) writes OUT/gridiron/vmtable.csv in the published layout.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from loadgen import compare, report
from loadgen.augment import gridiron_bandwidth, vlink_cap_mbps
from loadgen.readers.dispatch import read_trace
from loadgen.sim.config import SimConfig
from loadgen.synth_azure import synth_vmtable
from loadgen.trace import ReadStats, TraceJob
from services.common.progress import Progress

UPLINKS_MBPS = (1_000, 2_000, 5_000, 10_000)
MODES = ("pertask", "vdc")
BPC_MBPS = 100.0  # loadgen.readers.options.DEFAULT_BPC_MBPS: --gridiron's default
PEAK_VDC = 30
DATACENTER_UPLINK_MBPS = 40_000.0  # Gridiron's C for the vlink cap (--uplink-mbps)
GMS = LMS = 2
DEFAULT_MAX_JOBS = {"yahoo": 60, "azure": 400}
AZURE_SEED = 0


@dataclass(frozen=True)
class TraceSetup:
    """A trace and the workers it runs on."""

    name: str
    workers: int
    cores_per_worker: int
    memory_per_worker_mb: int
    fmt: str | None = None


TRACES = (
    TraceSetup("yahoo", workers=1000, cores_per_worker=16, memory_per_worker_mb=64 * 1024),
    TraceSetup(
        "azure", workers=250, cores_per_worker=32, memory_per_worker_mb=256 * 1024, fmt="azure"
    ),
)


def label(trace: str, mode: str, uplink: int) -> str:
    return f"{trace}-{mode}-{uplink / 1000:g}g"


def configs(setup: TraceSetup, uplinks: Sequence[int] = UPLINKS_MBPS) -> dict[str, SimConfig]:
    """Both modes at every uplink, the scarcest uplink first."""
    cap = float(vlink_cap_mbps(PEAK_VDC, DATACENTER_UPLINK_MBPS))
    base = SimConfig(
        scheduler="megha",
        workers=setup.workers,
        gms=GMS,
        lms=LMS,
        cores_per_worker=setup.cores_per_worker,
        memory_per_worker_mb=setup.memory_per_worker_mb,
    )
    runs = {}
    for uplink in uplinks:
        runs[label(setup.name, "pertask", uplink)] = replace(base, uplink_mbps=uplink)
        runs[label(setup.name, "vdc", uplink)] = replace(
            base,
            uplink_mbps=uplink,
            gangs=True,
            vdc=(BPC_MBPS, cap),
            peak_vdc=PEAK_VDC,
        )
    return runs


def read_jobs(path: Path, fmt: str | None, max_jobs: int | None) -> list[TraceJob]:
    """The trace's jobs with Gridiron's per-task bandwidth (as ``--gridiron``)."""
    stats = ReadStats()
    jobs = list(read_trace(path, fmt, False, max_jobs, stats))
    stats.require_jobs(jobs, path)
    return gridiron_bandwidth(jobs, BPC_MBPS, PEAK_VDC, DATACENTER_UPLINK_MBPS)


def vdc_of(first: np.ndarray, peak_vdc: int = PEAK_VDC) -> tuple[np.ndarray, np.ndarray]:
    """Each task's VDC (jobs split in task order into VDCs of at most ``peak_vdc``, as
    ``gridiron_bandwidth``) and each VDC's job."""
    counts = np.diff(first)
    per_job = -(-counts // peak_vdc)
    offset = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(per_job, out=offset[1:])
    within = np.arange(int(first[-1])) - np.repeat(first[:-1], counts)
    vdc = np.repeat(offset[:-1], counts) + within // peak_vdc
    job = np.repeat(np.arange(len(counts)), per_job)
    return vdc, job


def _stats(values: np.ndarray) -> dict[str, float | None]:
    if not values.size:
        return {"mean": None, "p50": None, "p99": None}
    return {
        "mean": float(values.mean()),
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
    }


def measure(result: Any) -> dict[str, Any]:
    """summary.json's ``"gridiron"``: VDCs and jobs placed or not, whole-VDC allocation."""
    wl, log = result.workload, result.log
    vdc, job_of_vdc = vdc_of(wl.first)
    n_vdcs = len(job_of_vdc)
    stamps = log.stamps
    started = stamps["started"] > 0
    finished = stamps["finished"] > 0
    bad = np.bincount(vdc, weights=log.infeasible, minlength=n_vdcs) > 0
    size = np.bincount(vdc, minlength=n_vdcs)
    admitted = np.bincount(vdc, weights=started, minlength=n_vdcs) == size
    last = np.zeros(n_vdcs, dtype=np.int64)
    np.maximum.at(last, vdc, stamps["started"])
    submitted = wl.arrival_ns[job_of_vdc]  # every member is submitted with its job
    gang_alloc = (last[admitted] - submitted[admitted]) / 1e9
    job_bad = np.bincount(job_of_vdc, weights=bad, minlength=wl.jobs) > 0
    counts = np.diff(wl.first)
    done = np.add.reduceat(finished.astype(np.int64), wl.first[:-1]) == counts
    return {
        "vdcs": int(n_vdcs),
        "vdcs_infeasible": int(bad.sum()),
        "vdcs_admitted": int(admitted.sum()),
        "jobs_infeasible": int(job_bad.sum()),
        "jobs_completed": int(done.sum()),
        "tasks_infeasible": int(log.infeasible.sum()),
        "vdc_alloc_s": _stats(gang_alloc),
    }


def run(
    out: Path,
    trace: Path,
    azure: Path | None = None,
    max_jobs: int | None = None,
    progress: bool = True,
    reuse: bool = False,
    arrival_scale: float = 1.0,
    timeout_s: float | None = None,
    uplinks: Sequence[int] = UPLINKS_MBPS,
    traces: Sequence[TraceSetup] = TRACES,
) -> tuple[list[compare.Run], list[str]]:
    """Every run on both traces (``traces``: their worker setups); returns the runs and
    their labels."""
    from loadgen.sim.run import simulate, write_report

    where = out / "gridiron"
    if azure is None:
        azure = where / "vmtable.csv"
        if not (reuse and azure.exists()):
            synth_vmtable(azure, seed=AZURE_SEED)
    paths = {"yahoo": trace, "azure": azure}
    plan = [(setup, configs(setup, uplinks)) for setup in traces]
    total = sum(len(c) for _, c in plan)
    runs, labels = [], []
    n = 0
    for setup, runs_of in plan:
        jobs: list[TraceJob] | None = None
        for name, config in runs_of.items():
            n += 1
            directory = where / name
            labels.append(name)
            if reuse and (directory / report.SUMMARY_FILE).exists():
                runs.append(compare.load_run(directory, name))
                continue
            if jobs is None:
                limit = max_jobs if max_jobs is not None else DEFAULT_MAX_JOBS[setup.name]
                jobs = read_jobs(paths[setup.name], setup.fmt, limit)
            if progress:
                print(f"[{n}/{total}] gridiron {name}", file=sys.stderr)
            result = simulate(
                replace(config, arrival_scale=arrival_scale),
                jobs,
                Progress(enabled=progress),
                trace_name=str(paths[setup.name]),
                wall_limit_s=timeout_s,
            )
            result.summary["gridiron"] = measure(result)
            write_report(directory, result)
            runs.append(compare.load_run(directory, name))
    return runs, labels


def row(label_: str, summary: dict[str, Any]) -> dict[str, Any]:
    trace, mode, _ = label_.split("-")
    g = summary["gridiron"]
    uplink = summary.get("uplink", {})
    return {
        "trace": trace,
        "mode": mode,
        "uplink_mbps": summary["model"]["uplink_mbps"],
        "jobs": summary["jobs"],
        "vdcs": g["vdcs"],
        "vdcs_infeasible": g["vdcs_infeasible"],
        "vdcs_admitted": g["vdcs_admitted"],
        "jobs_infeasible": g["jobs_infeasible"],
        "tasks_infeasible": g["tasks_infeasible"],
        "jobs_completed": g["jobs_completed"],
        "tasks": summary["tasks"],
        "utilisation": uplink.get("utilisation"),
        "peak_utilisation": uplink.get("peak_utilisation"),
        "vdc_alloc_s": g["vdc_alloc_s"],
        "task_alloc_s": {
            "mean": summary.get("alloc_mean_s"),
            "p50": summary["alloc_s"]["p50"],
            "p99": summary["alloc_s"]["p99"],
        },
        "wall_s": summary["wall_s"],
        "timed_out": bool(summary.get("timed_out")),
    }


def _s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:,.0f}"


def markdown_table(runs: Sequence[compare.Run]) -> str:
    head = (
        "| trace | uplink Mbit/s | mode | VDCs infeasible / admitted / all | jobs infeasible "
        "| tasks infeasible | jobs completed / all | uplink booked mean (peak) "
        "| whole VDC alloc s mean / p50 / p99 | per-task alloc s mean / p50 / p99 | wall s |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in sorted(
        (row(run.label, run.summary) for run in runs),
        key=lambda r: (r["trace"] != "yahoo", r["uplink_mbps"], MODES.index(r["mode"])),
    ):
        util = "-" if r["utilisation"] is None else f"{r['utilisation']:.1%}"
        if r["peak_utilisation"] is not None:
            util += f" ({r['peak_utilisation']:.0%})"
        v, t = r["vdc_alloc_s"], r["task_alloc_s"]
        lines.append(
            f"| {r['trace']} | {r['uplink_mbps']:,} | {r['mode']} | "
            f"{r['vdcs_infeasible']} / {r['vdcs_admitted']} / {r['vdcs']} | "
            f"{r['jobs_infeasible']} | {r['tasks_infeasible']:,} | "
            f"{r['jobs_completed']} / {r['jobs']} | {util} | "
            f"{_s(v['mean'])} / {_s(v['p50'])} / {_s(v['p99'])} | "
            f"{_s(t['mean'])} / {_s(t['p50'])} / {_s(t['p99'])} | "
            f"{r['wall_s']:.1f}{' (timed out)' if r['timed_out'] else ''} |"
        )
    return "\n".join(lines)


def verdicts(runs: Sequence[compare.Run]) -> list[str]:
    """Issue 33's target per (trace, uplink): VDC-aware admits at least as many VDCs as
    per-task ``net_mbps``; by how many more (or fewer)."""
    rows = [row(x.label, x.summary) for x in runs]
    by = {(r["trace"], r["uplink_mbps"], r["mode"]): r for r in rows}
    lines = []
    for trace, uplink in sorted({(t, u) for t, u, _ in by}, key=lambda k: (k[0] != "yahoo", k[1])):
        a, b = by.get((trace, uplink, "pertask")), by.get((trace, uplink, "vdc"))
        if a is None or b is None:
            continue
        more = b["vdcs_admitted"] - a["vdcs_admitted"]
        ok = "holds" if more >= 0 else "MISSED"
        pct = f" ({more / a['vdcs_admitted']:+.0%})" if a["vdcs_admitted"] else ""
        late = " (a run timed out)" if a["timed_out"] or b["timed_out"] else ""
        lines.append(
            f"{trace} at {uplink:,} Mbit/s: VDC-aware admitted {b['vdcs_admitted']} VDCs, "
            f"per-task {a['vdcs_admitted']}: {more:+d}{pct}; infeasible "
            f"{b['vdcs_infeasible']} vs {a['vdcs_infeasible']}: {ok}{late}"
        )
    return lines


def plot(runs: Sequence[compare.Run], path: Path, title: str) -> Path | None:
    """Per trace (columns): VDCs admitted, booked uplink utilisation and whole-VDC
    allocation time (mean, log) against the uplink, one line per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [row(r.label, r.summary) for r in runs]
    traces = [t.name for t in TRACES if any(r["trace"] == t.name for r in rows)]
    fig, axes = plt.subplots(3, len(traces), figsize=(5 * len(traces), 9), squeeze=False)
    panels = (
        (lambda r: r["vdcs_admitted"] / max(1, r["vdcs"]), "VDCs admitted (share)", False),
        (lambda r: r["utilisation"], "uplink booked, time mean", False),
        (lambda r: r["vdc_alloc_s"]["mean"], "whole-VDC allocation, mean s", True),
    )
    try:
        for col, trace in enumerate(traces):
            for line, (value, ylabel, log) in enumerate(panels):
                ax = axes[line][col]
                for mode, style in zip(MODES, ("o-", "s--"), strict=True):
                    points = sorted(
                        (r["uplink_mbps"], value(r))
                        for r in rows
                        if r["trace"] == trace and r["mode"] == mode and value(r) is not None
                    )
                    if points:
                        xs, ys = zip(*points, strict=True)
                        ax.plot(xs, ys, style, label=mode)
                ax.set_xscale("log")
                if log:
                    ax.set_yscale("log")
                ax.set_xlabel("worker uplink (Mbit/s)")
                ax.set_ylabel(ylabel)
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=8)
                if line == 0:
                    ax.set_title(trace)
        fig.suptitle(title)
        report.save_figure(fig, path)
    finally:
        plt.close(fig)
    return path
