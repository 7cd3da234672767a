"""``megha-loadgen experiment NAME``: the paper's simulation experiments as commands.

    NAME ──runs (SimConfig each)──▶ simulate ──▶ OUT/NAME/RUN/{summary.json,tasks.csv,CDF}
         ──▶ OUT/NAME/NAME.png (overlaid CDFs or a sweep plot) + a Markdown table on stdout

| name   | paper  | what                                                        |
| ------ | ------ | ----------------------------------------------------------- |
| fig3   | 3-4    | Megha (10 GMs x 10 LMs) vs Sparrow at 10,000 workers        |
| fig6   | 6      | decentralized (10 x 10) vs centralized (1 x 1), 10k and 20k |
| fig8   | 8      | cluster size 1k-50k workers with 10 GMs x 10 LMs            |
| fig9   | 9      | GM and LM counts at 30,000 workers                          |
| fig10  | 10-11  | fairness: 4 user queues on 3 GMs                            |
| contention | —  | 3k-10k workers: Megha 10x10 vs central vs Sparrow (issue 29) |
| gridiron | —    | per-task net_mbps vs VDC-aware gangs, uplink 1-10 Gbit/s (issue 33) |

``gridiron`` replays two traces (``--trace``, the Yahoo sample, and ``--azure``, an
Azure-format vmtable, synthetic when not given); ``--max-jobs`` caps both.

``--arrival-scale`` compresses every run's arrivals; ``--timeout-s`` bounds every run's
wall time (a run that hits it is reported, marked timed out, with what it did by then).

Every run is an ordinary ``simulate`` run, so ``megha-loadgen compare OUT/NAME/*`` works
on the results too. ``docs/results.md`` shows the plots with the commands that made them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from loadgen import compare, report
from loadgen import experiment_contention as contention
from loadgen import experiment_gridiron as gridiron
from loadgen.experiment_fairness import fig10
from loadgen.sim.config import SimConfig
from loadgen.trace import ReadStats, TraceError, read_tr
from services.common.argtypes import positive_float, positive_int
from services.common.progress import Progress

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "yahoo_YH1_sub.tr"
# The paper's runs keep ``claims: owner``, the default when they were recorded:
# ``oldest`` decides alike at this light load (the contention sweep's 10,000-worker rows).
MEGHA = SimConfig(scheduler="megha", workers=10_000, gms=10, lms=10, claims="owner")


@dataclass(frozen=True)
class Experiment:
    title: str
    runs: Callable[[], dict[str, SimConfig]]
    plot: str  # "cdf": overlaid CDFs; "sweep:FIELD": p50/p99 against a config field;
    # "contention": experiment_contention's panels and table; "gridiron": its own runs
    # over two traces (experiment_gridiron)


def _fig3() -> dict[str, SimConfig]:
    return {"megha": MEGHA, "sparrow": SimConfig(scheduler="sparrow", workers=10_000)}


def _fig6() -> dict[str, SimConfig]:
    runs = {}
    for workers in (10_000, 20_000):
        runs[f"megha-{workers // 1000}k"] = replace(MEGHA, workers=workers)
        runs[f"central-{workers // 1000}k"] = SimConfig(scheduler="central", workers=workers)
    return runs


def _fig8() -> dict[str, SimConfig]:
    sizes = (1_000, 5_000, 10_000, 20_000, 30_000, 50_000)
    return {f"{w // 1000}k": replace(MEGHA, workers=w) for w in sizes}


def _fig9() -> dict[str, SimConfig]:
    runs = {}
    for gms in (1, 2, 5, 10, 20):
        runs[f"gms{gms}-lms10"] = replace(MEGHA, workers=30_000, gms=gms, lms=10)
    for lms in (1, 2, 5, 20):
        runs[f"gms10-lms{lms}"] = replace(MEGHA, workers=30_000, gms=10, lms=lms)
    return runs


EXPERIMENTS: dict[str, Experiment] = {
    "fig3": Experiment("Megha vs Sparrow, 10,000 workers (paper Fig. 3-4)", _fig3, "cdf"),
    "fig6": Experiment("decentralized vs centralized (paper Fig. 6)", _fig6, "cdf"),
    "fig8": Experiment("cluster size, 10 GMs x 10 LMs (paper Fig. 8)", _fig8, "sweep:workers"),
    "fig9": Experiment("GM and LM counts at 30,000 workers (paper Fig. 9)", _fig9, "cdf"),
    "fig10": Experiment(
        "fairness: 4 user queues on 3 GMs, 200-1,500 workers (paper Fig. 10-11)",
        fig10,
        "cdf",
    ),
    "contention": Experiment(
        "contention: Yahoo sample, 10 GMs x 10 LMs vs central vs Sparrow (issue 29)",
        contention.contention,
        "contention",
    ),
    "gridiron": Experiment(
        "Gridiron VDCs: per-task net_mbps vs VDC-aware gangs (issue 33)",
        lambda: {
            name: config
            for setup in gridiron.TRACES
            for name, config in gridiron.configs(setup).items()
        },
        "gridiron",
    ),
}


def run_experiment(
    name: str,
    trace: Path,
    out: Path,
    max_jobs: int | None = None,
    progress: bool = True,
    reuse: bool = False,
    arrival_scale: float = 1.0,
    timeout_s: float | None = None,
    azure: Path | None = None,
) -> list[compare.Run]:
    """Run (or with ``reuse``, read back) every run of ``name``; write the plot.
    ``arrival_scale`` goes into every run's config; ``timeout_s`` bounds each run.
    ``azure``: gridiron's Azure-format vmtable (synthetic when None)."""
    from loadgen.sim.run import simulate, write_report

    experiment = EXPERIMENTS[name]
    if experiment.plot == "gridiron":
        runs, _ = gridiron.run(
            out, trace, azure, max_jobs, progress, reuse, arrival_scale, timeout_s
        )
        gridiron.plot(runs, out / name / f"{name}.png", experiment.title)
        (out / name / "table.md").write_text(markdown_table(name, runs) + "\n")
        return runs
    stats = ReadStats()
    jobs = list(read_tr(trace, max_jobs=max_jobs, stats=stats))
    stats.require_jobs(jobs, trace)
    runs = []
    configs = experiment.runs()
    for n, (label, config) in enumerate(configs.items(), 1):
        where = out / name / label
        if reuse and (where / report.SUMMARY_FILE).exists():
            runs.append(compare.load_run(where, label))
            continue
        if progress:
            print(f"[{n}/{len(configs)}] {name} {label}", file=sys.stderr)
        config = replace(config, arrival_scale=arrival_scale)
        result = simulate(
            config,
            jobs,
            Progress(enabled=progress),
            trace_name=str(trace),
            wall_limit_s=timeout_s,
        )
        write_report(where, result)
        runs.append(compare.load_run(where, label))
    plot_path = out / name / f"{name}.png"
    if experiment.plot == "contention":
        for run, label in zip(runs, configs, strict=True):
            means = contention.group_means(out / name / label)
            run.summary["job_group_means"] = means
            run.summary["job_group_spread"] = contention.group_spread(means)
    if experiment.plot == "cdf":
        compare.plot(runs, plot_path, experiment.title)
    elif experiment.plot == "contention":
        contention.plot([r.summary for r in runs], plot_path, experiment.title)
    else:
        sweep_plot(runs, experiment.plot.split(":", 1)[1], plot_path, experiment.title)
    (out / name / "table.md").write_text(markdown_table(name, runs) + "\n")
    return runs


def markdown_table(name: str, runs: list[compare.Run]) -> str:
    if EXPERIMENTS[name].plot == "contention":
        return contention.markdown_table([r.summary for r in runs])
    if EXPERIMENTS[name].plot == "gridiron":
        return gridiron.markdown_table(runs)
    return compare.markdown_table(runs)


def sweep_plot(runs: list[compare.Run], field: str, path: Path, title: str) -> Path:
    """p50, p99 and p99.9 allocation time against ``field`` of the summary (log y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.summary[field] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for key, style in (("p50", "o-"), ("p99", "s-"), ("p999", "^-")):
            ys = [r.summary["alloc_s"][key] * 1e3 for r in runs]
            ax.plot(xs, ys, style, label=key)
        ax.set_yscale("log")
        ax.set_xlabel(field)
        ax.set_ylabel("allocation time (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        ax.set_title(title)
        report.save_figure(fig, path)
    finally:
        plt.close(fig)
    return path


def headline(name: str, runs: list[compare.Run]) -> list[str]:
    """The ratios the paper's claims are about, computed from the runs."""
    by = {r.label: r.summary for r in runs}
    lines = []

    def ratio(a: str, b: str, key: str) -> str:
        x, y = by[a]["alloc_s"][key], by[b]["alloc_s"][key]
        return "-" if not x or y is None else f"{y / x:,.1f}x"

    if name == "fig3":
        lines.append(f"Sparrow/Megha p50 {ratio('megha', 'sparrow', 'p50')}")
        lines.append(f"Sparrow/Megha p99 {ratio('megha', 'sparrow', 'p99')}")
    if name == "contention":
        lines += contention.targets([r.summary for r in runs])
    if name == "gridiron":
        lines += gridiron.verdicts(runs)
    if name == "fig6":
        for size in ("10k", "20k"):
            for key in ("p50", "p99"):
                lines.append(
                    f"centralized/decentralized {key} at {size}: "
                    f"{ratio(f'megha-{size}', f'central-{size}', key)}"
                )
    return lines


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "experiment",
        help="run a simulation experiment (paper figures, contention, gridiron)",
        description="Run the simulations of one paper figure, write each run's report "
        "under OUT/NAME/, the figure as OUT/NAME/NAME.png and a Markdown table.",
    )
    parser.add_argument("name", choices=sorted(EXPERIMENTS))
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="a .tr trace")
    parser.add_argument("--out", type=Path, default=Path("results"), help="output directory")
    parser.add_argument("--max-jobs", type=positive_int, help="replay only the first N jobs")
    parser.add_argument(
        "--reuse", action="store_true", help="keep runs whose summary.json already exists"
    )
    parser.add_argument(
        "--arrival-scale",
        type=positive_float,
        default=1.0,
        help="multiply every arrival time by this in every run (0.5: twice the load)",
    )
    parser.add_argument(
        "--timeout-s",
        type=positive_float,
        help="stop any run after this much wall time (reported as timed out)",
    )
    parser.add_argument(
        "--azure",
        type=Path,
        help="gridiron: an Azure-format vmtable.csv (default: a synthetic, seeded one "
        "written to OUT/gridiron/vmtable.csv)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress")
    return parser


def main(args: argparse.Namespace) -> int:
    try:
        runs = run_experiment(
            args.name,
            args.trace,
            args.out,
            args.max_jobs,
            not args.quiet,
            args.reuse,
            args.arrival_scale,
            args.timeout_s,
            args.azure,
        )
    except (TraceError, OSError, compare.CompareError) as err:
        print(f"megha-loadgen experiment: {err}", file=sys.stderr)
        return 2
    print(f"## {EXPERIMENTS[args.name].title}\n")
    print(markdown_table(args.name, runs))
    for line in headline(args.name, runs):
        print(f"\n{line}", end="")
    print(f"\n\nwrote {args.out / args.name}")
    summary = {r.label: r.summary["alloc_s"] for r in runs}
    (args.out / args.name / "alloc_s.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0
