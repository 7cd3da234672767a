"""Synthetic ``.tr`` traces unlike the Yahoo sample, to check a scheduling rule on more
than the one trace it was measured on (issue 29: "keep a rule only if it helps across a
sweep").

    python scripts/synth_tr.py --out traces/        # heavy.tr, bursty.tr, bimodal.tr

- ``heavy``: Poisson arrivals (mean gap 8 s), Pareto job sizes (1-800 tasks), lognormal
  durations (median 55 s): a few huge jobs among many small ones;
- ``bursty``: one gap in ten is long (mean 60 s), the rest short (mean 1 s), 1-59 tasks,
  lognormal durations (median 90 s): bursts that fill the federation, then lulls;
- ``bimodal``: Poisson arrivals (mean gap 6 s), 1-119 tasks, 80 % of tasks 5-30 s and
  20 % 10-30 minutes: short work stuck behind long work.

2,500 jobs each, seeded (the same files every run). The line it prints per trace gives
the busy workers the trace needs on average (work / span): at a little below that, the
federation is overloaded in its bursts (the sizes used in docs/results.md: 180, 500 and
2,300 workers).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

KINDS = {"heavy": 1, "bursty": 2, "bimodal": 3}  # name -> seed


def jobs_of(kind: str, count: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(arrival times, each job's task durations) of one kind."""
    rng = np.random.default_rng(KINDS[kind])
    n = count
    if kind == "heavy":
        gaps = rng.exponential(8.0, n)
        sizes = np.minimum(1 + rng.pareto(1.2, n) * 5, 800).astype(int)
        jobs = [rng.lognormal(4.0, 1.0, s) for s in sizes]
    elif kind == "bursty":
        gaps = np.where(rng.random(n) < 0.1, rng.exponential(60.0, n), rng.exponential(1.0, n))
        sizes = rng.integers(1, 60, n)
        jobs = [rng.lognormal(4.5, 0.8, s) for s in sizes]
    else:
        gaps = rng.exponential(6.0, n)
        sizes = rng.integers(1, 120, n)
        jobs = [
            np.where(rng.random(s) < 0.8, rng.uniform(5, 30, s), rng.uniform(600, 1800, s))
            for s in sizes
        ]
    return np.cumsum(gaps), jobs


def write(path: Path, arrivals: np.ndarray, jobs: list[np.ndarray]) -> None:
    with path.open("w") as out:
        for at, durations in zip(arrivals, jobs, strict=True):
            listed = " ".join(f"{d:.3f}" for d in durations)
            out.write(f"{at:.3f} {len(durations)} {float(np.mean(durations)):.3f} {listed}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("traces"), help="directory")
    parser.add_argument("--jobs", type=int, default=2500, help="jobs per trace")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    for kind in KINDS:
        arrivals, jobs = jobs_of(kind, args.jobs)
        work = sum(float(j.sum()) for j in jobs)
        write(args.out / f"{kind}.tr", arrivals, jobs)
        tasks = sum(len(j) for j in jobs)
        print(
            f"{args.out / (kind + '.tr')}: {len(jobs):,} jobs, {tasks:,} tasks over "
            f"{arrivals[-1]:,.0f} s: {work / arrivals[-1]:,.0f} busy workers on average"
        )


if __name__ == "__main__":
    main()
