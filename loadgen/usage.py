"""Per-task CPU usage samples for ``gpa-eval``: a synthetic generator and a CSV reader.

Both give a float64 array ``(tasks, realisations)``: row i holds task i's usage at
successive time steps, in units of one machine's CPU capacity (1.0 = a whole machine, the
normalisation of the Google 2011 trace v2.1 the GPA paper used).

The synthetic generator follows what Janus & Rzadca (SoCC'17, Sec. 3) found in the
trace's 1-second usage samples: task usage follows *no single distribution*. Each task
gets one of four shapes, with its own parameters, so every instance mixes them:

=============  ======================================================================
shape          a task's samples (L = the task's usage level)
=============  ======================================================================
near-zero      idle most of the time: Exp(mean 0.05 L), with a burst U(0, 2 L) in 10 %
               of the steps (a spike of activity in a mostly sleeping task)
exponential    Gamma(k, L / k), k ~ U(0.6, 1.5): exponential-like, skewed right
uniform        U(L (1 - w), L (1 + w)), w ~ U(0.2, 1)
bimodal        a mixture of two Gaussians at L (1 - d) and L (1 + d'), weights p and
               1 - p with p ~ U(0.2, 0.8), each with std 0.1 L (two working modes)
=============  ======================================================================

L is log-uniform on [0.002, 0.05] of a machine, so a machine holds tens of tasks, the
regime where the paper finds the Gaussian approximation of a *sum* good. Samples are
clipped to [0, 1]. Steps are independent over time and across tasks; the trace has time
correlations this generator does not model.

The CSV reader takes rows ``task_id,sample`` (an optional header line; samples of one
task in time order, tasks in any order and interleaved).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SHAPES: tuple[str, ...] = ("near-zero", "exponential", "uniform", "bimodal")
DEFAULT_SHAPE_WEIGHTS: tuple[float, ...] = (0.2, 0.3, 0.25, 0.25)
LEVEL_RANGE: tuple[float, float] = (0.002, 0.05)


class UsageError(ValueError):
    """Usage samples could not be read; the message says where and why."""


def synthetic_usage(
    tasks: int,
    realisations: int,
    rng: np.random.Generator,
    shape_weights: Sequence[float] = DEFAULT_SHAPE_WEIGHTS,
) -> np.ndarray:
    """``(tasks, realisations)`` usage samples, shapes mixed by ``shape_weights``."""
    if tasks < 1 or realisations < 1:
        raise ValueError("need at least one task and one realisation")
    weights = np.asarray(shape_weights, dtype=np.float64)
    shapes = rng.choice(len(SHAPES), size=tasks, p=weights / weights.sum())
    low, high = np.log(LEVEL_RANGE[0]), np.log(LEVEL_RANGE[1])
    level = np.exp(rng.uniform(low, high, size=tasks))[:, None]
    shape = (tasks, realisations)
    out = np.empty(shape)

    rows = shapes == 0  # near-zero
    k = int(rows.sum())
    lv = level[rows]
    idle = rng.exponential(1.0, (k, realisations)) * 0.05 * lv
    burst = rng.random((k, realisations)) < 0.1
    out[rows] = np.where(burst, rng.uniform(0.0, 2.0, (k, realisations)) * lv, idle)

    rows = shapes == 1  # exponential-like
    k = int(rows.sum())
    a = rng.uniform(0.6, 1.5, (k, 1))
    out[rows] = rng.gamma(a, 1.0, (k, realisations)) * level[rows] / a

    rows = shapes == 2  # uniform
    k = int(rows.sum())
    w = rng.uniform(0.2, 1.0, (k, 1))
    out[rows] = level[rows] * (1 + w * rng.uniform(-1.0, 1.0, (k, realisations)))

    rows = shapes == 3  # bimodal
    k = int(rows.sum())
    lv = level[rows]
    p = rng.uniform(0.2, 0.8, (k, 1))
    lo = lv * (1 - rng.uniform(0.4, 0.9, (k, 1)))
    hi = lv * (1 + rng.uniform(0.4, 1.5, (k, 1)))
    centre = np.where(rng.random((k, realisations)) < p, lo, hi)
    out[rows] = centre + rng.normal(0.0, 1.0, (k, realisations)) * 0.1 * lv

    return np.clip(out, 0.0, 1.0)


def read_usage_csv(
    path: str | Path, realisations: int | None = None
) -> tuple[list[str], np.ndarray]:
    """Task ids and their ``(tasks, realisations)`` samples from ``task_id,sample`` rows.

    Every task keeps its first ``realisations`` samples; tasks with fewer are left out.
    Without ``realisations``, all tasks are cut to the shortest one's count.
    """
    path = Path(path)
    samples: dict[str, list[float]] = {}
    try:
        with path.open(newline="") as handle:
            for line, row in enumerate(csv.reader(handle), start=1):
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if len(row) != 2:
                    raise UsageError(f"{path}:{line}: expected task_id,sample, got {row}")
                task_id, raw = row[0].strip(), row[1].strip()
                try:
                    value = float(raw)
                except ValueError:
                    if line == 1:
                        continue  # a header
                    raise UsageError(f"{path}:{line}: sample {raw!r} is not a number") from None
                if not np.isfinite(value) or value < 0:
                    raise UsageError(f"{path}:{line}: sample {raw!r} must be finite and >= 0")
                samples.setdefault(task_id, []).append(value)
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror}") from None
    if not samples:
        raise UsageError(f"{path}: no task_id,sample rows")
    counts = [len(v) for v in samples.values()]
    r = min(counts) if realisations is None else realisations
    if r < 2:
        shortest = min(samples, key=lambda t: len(samples[t]))
        raise UsageError(
            f"{path}: need at least 2 samples per task, to split them in two; task "
            f"{shortest!r} has {len(samples[shortest])} (give a number of realisations to "
            "leave out shorter tasks)"
        )
    ids = [t for t, v in samples.items() if len(v) >= r]
    if not ids:
        raise UsageError(f"{path}: no task has {r} samples (the most any has: {max(counts)})")
    return ids, np.array([samples[t][:r] for t in ids], dtype=np.float64)
