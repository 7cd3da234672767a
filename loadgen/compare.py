"""``megha-loadgen compare DIR...``: several runs' reports in one table and one CDF plot.
The table's "GM spread" is max/min of the per-GM mean allocation time (``per_gm``): 1.0
when every GM's users wait alike.

    DIR/summary.json ──▶ table row     DIR/tasks.csv (alloc_s) ──▶ one CDF curve each

Any run that wrote the DESIGN.md §5 report can be compared: live replay, bench-live and
simulation alike.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadgen import report

COMPARE_PNG = "compare.png"


class CompareError(ValueError):
    """A run directory cannot be read; the message says which and why."""


@dataclass
class Run:
    label: str
    summary: dict[str, Any]
    alloc_s: np.ndarray


def load_run(directory: Path, label: str | None = None) -> Run:
    path = directory / report.SUMMARY_FILE
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise CompareError(
            f"{directory}: no {report.SUMMARY_FILE} (not a report directory)"
        ) from None
    except (OSError, json.JSONDecodeError) as err:
        raise CompareError(f"{path}: cannot read: {err}") from None
    missing = [k for k in report.SUMMARY_KEYS if k not in summary]
    if missing:
        raise CompareError(f"{path}: not a Megha summary (missing {', '.join(missing)})")
    return Run(label or directory.name, summary, _alloc_values(directory / report.TASKS_FILE))


def _alloc_values(path: Path) -> np.ndarray:
    if not path.exists():
        return np.empty(0)
    with path.open(newline="") as f:
        values = [float(row["alloc_s"]) for row in csv.DictReader(f) if row.get("alloc_s")]
    return np.asarray(values, dtype=float)


def describe(summary: dict[str, Any]) -> str:
    shape = f"{summary['workers']} workers"
    if summary["scheduler"] != "sparrow":
        shape += f", {summary['gms']}x{summary['lms']}"
    return f"{summary['target']} {summary['scheduler']}, {shape}"


def mean_s(run: Run) -> float | None:
    """Mean allocation time: the summary's, else from tasks.csv (older reports)."""
    mean = run.summary.get("alloc_mean_s")
    if mean is None and run.alloc_s.size:
        mean = float(run.alloc_s.mean())
    return mean


def spread(summary: dict[str, Any]) -> str:
    """Max/min of the per-GM mean allocation time (``per_gm``), or "-"."""
    value = report.gm_spread(summary)
    return "-" if value is None else f"{value:.2f}"


def table(runs: Sequence[Run]) -> str:
    header = ["run", "what", "tasks", "mean ms", *[f"{k} ms" for k in report.PERCENTILE_KEYS]]
    header += ["GM spread", "incons.", "repart.", "preempt.", "wall s"]
    rows = [header]
    for run in runs:
        s = run.summary
        rows.append(
            [
                run.label,
                describe(s),
                f"{s['completed']}/{s['tasks']}",
                report.ms(mean_s(run)),
                *[report.ms(s["alloc_s"][k]) for k in report.PERCENTILE_KEYS],
                spread(s),
                str(s["inconsistencies"]),
                str(s["repartitions"]),
                str(s["preemptions"]),
                f"{s['wall_s']:.1f}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(runs: Sequence[Run]) -> str:
    """The same table in Markdown, for docs/results.md."""
    head = "| run | what | tasks | mean ms | "
    head += " | ".join(f"{k} ms" for k in report.PERCENTILE_KEYS)
    head += " | GM spread | inconsistencies | repartitions | wall s |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for run in runs:
        s = run.summary
        cells = [run.label, describe(s), f"{s['completed']}/{s['tasks']}", report.ms(mean_s(run))]
        cells += [report.ms(s["alloc_s"][k]) for k in report.PERCENTILE_KEYS]
        cells += [spread(s), str(s["inconsistencies"]), str(s["repartitions"])]
        cells.append(f"{s['wall_s']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: Sequence[Run], path: Path, title: str = "") -> Path | None:
    """Overlaid allocation-time CDFs (log x axis, ms); None when nothing can be drawn."""
    curves = [
        (f"{r.label} (p99 {report.ms(r.summary['alloc_s']['p99'])} ms)", r.alloc_s) for r in runs
    ]
    return report.plot_cdfs(curves, path, title or "allocation time CDF")


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "compare",
        help="overlay several runs' reports in one table and one CDF plot",
        description="Read DIR/summary.json and DIR/tasks.csv of each run; print a table "
        "and draw the allocation-time CDFs in one plot.",
    )
    parser.add_argument("dirs", nargs="+", type=Path, help="report directories (--out of a run)")
    parser.add_argument(
        "--label", action="append", default=[], help="a label per directory, in order"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(COMPARE_PNG), help=f"plot file (default {COMPARE_PNG})"
    )
    parser.add_argument("--title", default="", help="plot title")
    parser.add_argument("--markdown", action="store_true", help="print the table in Markdown")
    return parser


def main(args: argparse.Namespace) -> int:
    if args.label and len(args.label) != len(args.dirs):
        print(
            f"megha-loadgen compare: {len(args.label)} labels for {len(args.dirs)} directories",
            file=sys.stderr,
        )
        return 2
    labels = args.label or [None] * len(args.dirs)
    try:
        runs = [load_run(d, label) for d, label in zip(args.dirs, labels, strict=True)]
    except CompareError as err:
        print(f"megha-loadgen compare: {err}", file=sys.stderr)
        return 2
    print(markdown_table(runs) if args.markdown else table(runs))
    written = plot(runs, args.out, args.title)
    if written is not None:
        print(f"wrote {written}")
    return 0
