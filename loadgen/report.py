"""The report every measuring command writes (DESIGN.md §5): ``summary.json``, ``tasks.csv``
and a CDF plot of allocation times, from per-task timestamps.

    per-task timestamps ──allocation_s / components_s──▶ percentiles, medians
        ──make_summary──▶ summary dict ──write_summary──▶ summary.json
    rows ──write_tasks_csv──▶ tasks.csv        allocation times ──write_cdf_png──▶ alloc_cdf.png

The live benchmark and the simulator both call these functions, so their files compare
line by line. The definitions of allocation time (paper eq. 1) and of its components
(eq. 2) live here, once.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SUMMARY_FILE = "summary.json"
TASKS_FILE = "tasks.csv"
CDF_FILE = "alloc_cdf.png"

# The DESIGN.md §5 keys, in its order. Keys may be added after them, never removed or renamed.
SUMMARY_KEYS = (
    "target",
    "scheduler",
    "workers",
    "gms",
    "lms",
    "jobs",
    "tasks",
    "completed",
    "alloc_s",
    "components_s",
    "inconsistencies",
    "repartitions",
    "preemption_attempts",
    "preemptions",
    "throughput_tasks_per_s",
    "wall_s",
)
PERCENTILE_KEYS = ("p50", "p90", "p99", "p999", "max")
COMPONENT_KEYS = ("framework_queuing", "processing", "communication", "worker_queuing")
_QUANTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p999": 99.9}

# The stamps of common.proto's TaskTimestamps that a report uses, without the suffix.
STAMPS = (
    "submitted",
    "queued",
    "dequeued",
    "decided",
    "lm_received",
    "lm_decided",
    "worker_received",
    "started",
    "finished",
)
# tasks.csv: one row per task. The first columns are the contract; the last ones extras.
TASK_COLUMNS = (
    "task_id",
    "job_id",
    "gm",
    "lm_id",
    "node_id",
    "submitted_unix_nanos",
    "dequeued_unix_nanos",
    "decided_unix_nanos",
    "lm_received_unix_nanos",
    "lm_decided_unix_nanos",
    "worker_received_unix_nanos",
    "started_unix_nanos",
    "finished_unix_nanos",
    "alloc_s",
    "queued_unix_nanos",
    "attempt",
    "state",
)

Stamps = Mapping[str, int]
"""Unix nanoseconds by stamp name (``"submitted"``, ``"started"``, ...); 0 = not reached."""


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """p50, p90, p99, p99.9 and max (linear interpolation); every value None when empty."""
    array = np.fromiter(values, dtype=float)
    if array.size == 0:
        return dict.fromkeys(PERCENTILE_KEYS)
    points = np.percentile(array, list(_QUANTILES.values()))
    out: dict[str, float | None] = {
        key: float(v) for key, v in zip(_QUANTILES, points, strict=True)
    }
    out["max"] = float(array.max())
    return out


def median(values: Iterable[float]) -> float | None:
    array = np.fromiter(values, dtype=float)
    return float(np.median(array)) if array.size else None


def allocation_s(stamps: Stamps) -> float | None:
    """Paper eq. 1: submission to start on a worker; None until the task started."""
    if not stamps.get("started") or not stamps.get("submitted"):
        return None
    return (stamps["started"] - stamps["submitted"]) / 1e9


def components_s(stamps: Stamps) -> dict[str, float] | None:
    """Paper eq. 2 for one task, or None unless every stamp it needs is set.

    - framework_queuing: submitted → dequeued (client → GM, the durable queue, the broker)
    - processing: dequeued → decided (the GM's match)
    - communication: decided → lm_received plus lm_decided → worker_received (GM → LM,
      LM → worker). The LM's own validation (lm_received → lm_decided) is in no component;
      ``detail_s`` has it as ``lm_processing``.
    - worker_queuing: worker_received → started
    """
    needed = ("submitted", "dequeued", "decided", "lm_received", "lm_decided")
    needed += ("worker_received", "started")
    if not all(stamps.get(name) for name in needed):
        return None
    s = stamps
    return {
        "framework_queuing": (s["dequeued"] - s["submitted"]) / 1e9,
        "processing": (s["decided"] - s["dequeued"]) / 1e9,
        "communication": (
            (s["lm_received"] - s["decided"]) + (s["worker_received"] - s["lm_decided"])
        )
        / 1e9,
        "worker_queuing": (s["started"] - s["worker_received"]) / 1e9,
    }


# Finer steps than eq. 2, to see where time goes: (name, from stamp, to stamp).
DETAIL_STEPS = (
    ("submit_rpc", "submitted", "queued"),
    ("broker", "queued", "dequeued"),
    ("gm_match", "dequeued", "decided"),
    ("gm_to_lm", "decided", "lm_received"),
    ("lm_processing", "lm_received", "lm_decided"),
    ("lm_to_worker", "lm_decided", "worker_received"),
    ("worker_start", "worker_received", "started"),
)


def detail_s(stamps: Stamps) -> dict[str, float]:
    """Seconds of each step of ``DETAIL_STEPS`` whose two stamps are set."""
    return {
        name: (stamps[end] - stamps[begin]) / 1e9
        for name, begin, end in DETAIL_STEPS
        if stamps.get(begin) and stamps.get(end)
    }


def placement_rate(started_ns: Iterable[int]) -> float:
    """Placements per second: tasks started over the span from the first start to the last
    (0 with fewer than two distinct start times)."""
    starts = np.fromiter(started_ns, dtype=np.int64)
    if starts.size < 2 or starts.max() <= starts.min():
        return 0.0
    return starts.size / ((starts.max() - starts.min()) / 1e9)


def component_medians(tasks: Iterable[Stamps]) -> dict[str, float | None]:
    """Median of each eq. 2 component over the tasks that have all their stamps."""
    columns: dict[str, list[float]] = {key: [] for key in COMPONENT_KEYS}
    for stamps in tasks:
        parts = components_s(stamps)
        if parts is not None:
            for key, value in parts.items():
                columns[key].append(value)
    return {key: median(values) for key, values in columns.items()}


def detail_percentiles(tasks: Iterable[Stamps]) -> dict[str, dict[str, float | None]]:
    """``percentiles`` of each ``DETAIL_STEPS`` step over the tasks."""
    columns: dict[str, list[float]] = {name: [] for name, _, _ in DETAIL_STEPS}
    for stamps in tasks:
        for name, value in detail_s(stamps).items():
            columns[name].append(value)
    return {name: percentiles(values) for name, values in columns.items()}


def per_gm(gms: Sequence[str], alloc: Sequence[float]) -> dict[str, dict[str, Any]]:
    """summary.json's ``per_gm``: for each GM (the one serving the task's user queue), its
    started tasks and their mean and p99 allocation time. Decentralization is only fair if
    these stay close: a GM that always loses the race for freed workers shows here first.
    ``gms[i]`` names task ``i``'s GM ("" for none: left out)."""
    values = np.asarray(alloc, dtype=float)
    names = np.asarray(gms, dtype=object)
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({str(g) for g in names if g}, key=_natural):
        mine = values[names == name]
        if mine.size:
            p99 = float(np.percentile(mine, 99.0))
            out[name] = {"tasks": int(mine.size), "mean_s": float(mine.mean()), "p99_s": p99}
    return out


def _natural(name: str) -> tuple[str, int]:
    """``gm2`` before ``gm10``."""
    head = name.rstrip("0123456789")
    tail = name[len(head) :]
    return head, int(tail) if tail else -1


def gm_spread(summary: Mapping[str, Any]) -> float | None:
    """Max over min of the per-GM mean allocation time (1.0: every GM's users wait alike);
    None without two GMs that placed tasks, or when the fastest GM's mean is zero."""
    means = [g["mean_s"] for g in (summary.get("per_gm") or {}).values() if g.get("tasks")]
    if len(means) < 2 or min(means) <= 0:
        return None
    return max(means) / min(means)


def make_summary(
    *,
    target: str,
    scheduler: str,
    workers: int,
    gms: int,
    lms: int,
    jobs: int,
    tasks: int,
    completed: int,
    alloc_s: Mapping[str, float | None],
    components_s: Mapping[str, float | None],
    inconsistencies: int = 0,
    repartitions: int = 0,
    preemption_attempts: int = 0,
    preemptions: int = 0,
    throughput_tasks_per_s: float = 0.0,
    wall_s: float = 0.0,
    **extra: Any,
) -> dict[str, Any]:
    """The DESIGN.md §5 summary, in its key order, followed by ``extra`` keys."""
    if target not in ("live", "sim"):
        raise ValueError(f"target must be 'live' or 'sim', got {target!r}")
    summary: dict[str, Any] = {
        "target": target,
        "scheduler": scheduler,
        "workers": int(workers),
        "gms": int(gms),
        "lms": int(lms),
        "jobs": int(jobs),
        "tasks": int(tasks),
        "completed": int(completed),
        "alloc_s": {key: _number(alloc_s.get(key)) for key in PERCENTILE_KEYS},
        "components_s": {key: _number(components_s.get(key)) for key in COMPONENT_KEYS},
        "inconsistencies": int(inconsistencies),
        "repartitions": int(repartitions),
        "preemption_attempts": int(preemption_attempts),
        "preemptions": int(preemptions),
        "throughput_tasks_per_s": float(throughput_tasks_per_s),
        "wall_s": float(wall_s),
    }
    summary.update(extra)  # every DESIGN key is a named parameter, so none is overwritten
    return summary


def _number(value: float | None) -> float | None:
    """JSON has no NaN: a value that cannot be measured is null."""
    if value is None or math.isnan(value):
        return None
    return float(value)


def check_summary(summary: Mapping[str, Any]) -> None:
    """Raise ValueError naming what is missing if ``summary`` lacks a DESIGN.md §5 key."""
    missing = [key for key in SUMMARY_KEYS if key not in summary]
    for key, inner in (("alloc_s", PERCENTILE_KEYS), ("components_s", COMPONENT_KEYS)):
        if isinstance(summary.get(key), Mapping):
            missing += [f"{key}.{k}" for k in inner if k not in summary[key]]
    if missing:
        raise ValueError(f"summary lacks the DESIGN.md §5 keys {missing}")


def write_summary(out_dir: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write ``summary.json`` (after ``check_summary``); returns its path."""
    check_summary(summary)
    path = Path(out_dir) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return path


def write_tasks_csv(
    out_dir: str | Path, rows: Iterable[Mapping[str, Any]], columns: Sequence[str] = TASK_COLUMNS
) -> Path:
    """Write ``tasks.csv``: one row per task, ``columns`` in order, missing values empty."""
    path = Path(out_dir) / TASKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _cell(row.get(key)) for key in columns})
    return path


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.9f}"
    return value


def write_cdf_png(
    out_dir: str | Path, alloc_values_s: Sequence[float], title: str = ""
) -> Path | None:
    """A CDF of allocation times (log x axis, milliseconds) as ``alloc_cdf.png``.

    Returns None, writing nothing, when matplotlib is not installed or there is no value.
    """
    title = title or f"allocation time CDF ({len(alloc_values_s)} tasks)"
    return plot_cdfs([("", alloc_values_s)], Path(out_dir) / CDF_FILE, title)


def plot_cdfs(curves: Sequence[tuple[str, Sequence[float]]], path: Path, title: str) -> Path | None:
    """Allocation-time CDFs, one per ``(label, seconds)``, on a log millisecond axis.

    Returns None, writing nothing, when matplotlib is missing or no curve has a value.
    """
    curves = [(label, values) for label, values in curves if len(values)]
    if not curves:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: render straight to a file
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        positive = True
        for label, values in curves:
            values_ms = np.sort(np.asarray(values, dtype=float)) * 1e3
            fraction = np.arange(1, values_ms.size + 1) / values_ms.size
            positive = positive and bool(values_ms.min() > 0)
            ax.step(values_ms, fraction, where="post", label=label or None)
        if positive:
            ax.set_xscale("log")
            plain = FuncFormatter(lambda v, _pos: f"{v:g}")  # "20", not "2x10^1"
            ax.xaxis.set_major_formatter(plain)
        ax.set_xlabel("allocation time (ms)")
        ax.set_ylabel("fraction of tasks")
        ax.set_ylim(0, 1.01)
        ax.grid(True, which="both", alpha=0.3)
        if any(label for label, _ in curves):
            ax.legend(loc="lower right", fontsize=8)
        ax.set_title(title)
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return path


def plot_series(
    x: Sequence[float],
    lines: Mapping[str, Sequence[float]],
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
) -> Path | None:
    """One line per ``lines`` entry over ``x``; None, writing nothing, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # a dozen lines stay apart
        for label, values in sorted(lines.items()):
            ax.plot(x, values, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize=7, ncol=2)
        ax.set_title(title)
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return path


def save_figure(fig: Any, path: Path) -> None:
    """Write a matplotlib figure as a PNG, making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def render_summary(summary: Mapping[str, Any]) -> str:
    """A short human-readable table of a summary (the extras it knows about, if present)."""
    alloc = summary["alloc_s"]
    parts = summary["components_s"]
    lines = []
    if summary.get("offered_rate") is not None:
        lines.append(f"offered rate           {summary['offered_rate']:.0f} tasks/s")
    lines.append(f"placement throughput   {summary['throughput_tasks_per_s']:.0f} tasks/s")
    lines.append(
        "allocation time (ms)   " + "  ".join(f"{k} {ms(alloc[k])}" for k in PERCENTILE_KEYS)
    )
    lines.append(
        "components, median ms  " + "  ".join(f"{k} {ms(parts[k])}" for k in COMPONENT_KEYS)
    )
    detail = summary.get("detail_s")
    if detail:
        lines.append(
            "steps p50/p99 ms       "
            + "  ".join(f"{k} {ms(v['p50'])}/{ms(v['p99'])}" for k, v in detail.items())
        )
    lines.append(f"completed / offered    {summary['completed']} / {summary['tasks']}")
    if "duplicates" in summary:
        lines.append(f"exactly-once breaches  {summary['duplicates']}")
    lines.append(
        f"inconsistencies        {summary['inconsistencies']}  repartitions "
        f"{summary['repartitions']}  preemptions {summary['preemptions']}"
        f"/{summary['preemption_attempts']} attempts"
    )
    lines.append(f"wall time              {summary['wall_s']:.1f} s")
    return "\n".join(lines)
