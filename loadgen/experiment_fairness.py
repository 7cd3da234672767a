"""The paper's fairness experiment (Fig. 10-11) as simulation runs, and its counts.

    fig10() ──SimConfig per data-center size──▶ ``megha-loadgen experiment fig10``
        ──▶ OUT/fig10/{200,500,1500}/summary.json + OUT/fig10/fig10.png (allocation CDFs)
    ``python -m loadgen.experiment_fairness OUT/fig10`` ──▶ counts.png (Fig. 11: repartitions,
        preemption attempts, preemptions against data-center size) + a Markdown table with
        every queue's configured and measured share

Sec. VI-E of the paper: four users with shares 10 / 25 / 15 / 50 % on three GMs (user 1 on
GM 1, users 2 and 3 on GM 2, user 4 on GM 3), data centers of 200, 500 and 1,500 workers.
The trace's tasks go round-robin over the four queues (a ``.tr`` trace names no users).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadgen import report
from loadgen.sim.config import SimConfig
from services.common.config import QueueConfig

PAPER_QUEUES = (
    QueueConfig(name="q1", share=0.10, gm="gm-1"),
    QueueConfig(name="q2", share=0.25, gm="gm-2"),
    QueueConfig(name="q3", share=0.15, gm="gm-2"),
    QueueConfig(name="q4", share=0.50, gm="gm-3"),
)
SIZES = (200, 500, 1_500)
# The paper's Alg. 2 alone (with shares ``claims: owner`` turns every contention rule off).
FAIR = SimConfig(
    scheduler="megha", gms=3, lms=3, fair_share=True, queues=PAPER_QUEUES, claims="owner"
)


def fig10() -> dict[str, SimConfig]:
    """One run per data-center size, labelled by its worker count."""
    return {str(workers): replace(FAIR, workers=workers) for workers in SIZES}


COUNTS = ("repartitions", "preemption_attempts", "preemptions")


def load_summaries(directory: Path) -> list[dict[str, Any]]:
    """Every run's summary.json under ``directory``, by worker count."""
    found = [json.loads(p.read_text()) for p in sorted(directory.glob(f"*/{report.SUMMARY_FILE}"))]
    return sorted(found, key=lambda s: s["workers"])


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    names = list(summaries[0].get("queues", {})) if summaries else []
    head = (
        "| workers | tasks | p50 ms | p99 ms | repartitions | preemption attempts | "
        "preemptions | backlogged s | "
        + " | ".join(f"{n} ({summaries[0]['queues'][n]['share']:.0%})" for n in names)
        + " |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for s in summaries:
        shares = []
        for n in names:
            got = s["queues"][n]["measured_share"]
            shares.append("-" if got is None else f"{got:.1%}")
        cells = [
            str(s["workers"]),
            f"{s['completed']}/{s['tasks']}",
            report.ms(s["alloc_s"]["p50"]),
            report.ms(s["alloc_s"]["p99"]),
            *(f"{s[k]:,}" for k in COUNTS),
            f"{s.get('queues_backlogged_s', 0):,.0f}",
            *shares,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def counts_plot(summaries: list[dict[str, Any]], path: Path) -> Path:
    """Paper Fig. 11: repartitions, preemption attempts and preemptions per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(s["workers"]) for s in summaries]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        width = 0.27
        for i, key in enumerate(COUNTS):
            xs = [j + (i - 1) * width for j in range(len(summaries))]
            ax.bar(xs, [max(s[key], 0.5) for s in summaries], width, label=key.replace("_", " "))
        ax.set_xticks(range(len(summaries)), labels)
        ax.set_yscale("log")
        ax.set_xlabel("workers (data-center size)")
        ax.set_ylabel("count")
        ax.set_title("fairness: repartitions and preemptions (paper Fig. 11)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen.experiment_fairness",
        description="Counts plot (Fig. 11) and table of a 'megha-loadgen experiment fig10' run.",
    )
    parser.add_argument("dir", type=Path, help="OUT/fig10 of the experiment")
    args = parser.parse_args(argv)
    summaries = load_summaries(args.dir)
    if not summaries:
        print(f"no */summary.json under {args.dir}", file=sys.stderr)
        return 2
    table = markdown_table(summaries)
    (args.dir / "counts.md").write_text(table + "\n")
    plot = counts_plot(summaries, args.dir / "counts.png")
    print(table)
    print(f"\nwrote {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
