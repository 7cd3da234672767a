"""Task demand for ``forecast-eval``: a synthetic trace with daily and weekly seasonality,
and the bucket-count series built from any trace.

The synthetic generator (``synthetic_demand``), every choice seeded:

- **arrivals**: an inhomogeneous Poisson process, one rate per interval:
  ``base x daily(hour) x weekly(day) x exp(noise)``. ``daily`` is a smooth working-day
  curve (a cosine: trough 0.35 at 04:00, peak 1.0 at 16:00); ``weekly`` is 1
  on Monday-Friday and 0.55 on the weekend; ``noise`` is an AR(1) process (phi 0.9,
  stationary sd 0.15), so busy and quiet spells last hours, not one interval.
- **bursts**: on average ``bursts_per_day`` unannounced batch jobs (Poisson, uniform in
  time), each 40-400 tasks of one shape arriving within one interval and running 1-3 h:
  the spikes neither a seasonal model nor lags can see coming.
- **tasks**: one of five shapes (cores / GiB: 0.5/1, 1/4, 2/8, 8/32, 32/128, drawn
  40/25/20/10/5 %) and a log-normal duration (median 20 min, sigma 1, capped at 12 h).
- the trace starts on a Monday 00:00 UTC (2024-01-01) so hour-of-day and day-of-week
  features mean what they say.

``bucket_series`` embeds every task once (``services/core/buckets.py``, Alg. 2), then
sums, per interval and bucket, the vectors of the tasks running at any time in the
interval (difference arrays: O(tasks + intervals)), and rounds to nodes per bucket.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from loadgen.trace import TraceJob
from services.core.buckets import UNFIT, assign_buckets, counts_from_sums

START_UNIX_S = 1_704_067_200.0  # Monday 2024-01-01 00:00 UTC
# (cpu_milli, memory_mb) of the synthetic task shapes and how often each is drawn.
TASK_SHAPES = np.array([[500, 1024], [1000, 4096], [2000, 8192], [8000, 32768], [32000, 131072]])
SHAPE_WEIGHTS = np.array([0.40, 0.25, 0.20, 0.10, 0.05])
# Default node shapes ("resource buckets"), cheapest first: 4, 16 and 64 cores.
DEFAULT_BUCKETS = np.array(
    [[4000, 16384, 0, 0], [16000, 65536, 0, 0], [64000, 262144, 0, 0]], dtype=np.int64
)


@dataclass(frozen=True)
class TaskDemand:
    """Tasks as columns: start and end (seconds since the trace start) and (N, 4) vectors."""

    start_s: np.ndarray
    end_s: np.ndarray
    vectors: np.ndarray
    start_unix_s: float = START_UNIX_S

    def __len__(self) -> int:
        return len(self.start_s)


def daily_profile(hour: np.ndarray) -> np.ndarray:
    """0.35 at 04:00, 1.0 at 16:00: a cosine over the day's hours."""
    return 0.675 - 0.325 * np.cos(2 * np.pi * (np.asarray(hour) - 4.0) / 24.0)


def weekly_profile(weekday: np.ndarray) -> np.ndarray:
    """1 on Monday-Friday (0-4), 0.55 on the weekend."""
    return np.where(np.asarray(weekday) >= 5, 0.55, 1.0)


def synthetic_demand(
    days: float = 35.0,
    interval_s: float = 900.0,
    tasks_per_hour: float = 900.0,
    bursts_per_day: float = 1.0,
    seed: int = 0,
) -> TaskDemand:
    """The synthetic trace described in the module doc; ``tasks_per_hour`` is the weekday
    peak rate before noise. Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    intervals = round(days * 86_400 / interval_s)
    t0 = np.arange(intervals) * interval_s
    hour = (t0 % 86_400) / 3600.0
    weekday = (t0 // 86_400) % 7  # day 0 is a Monday
    phi, sd = 0.9, 0.15
    shocks = rng.normal(0.0, sd * np.sqrt(1 - phi**2), intervals)
    noise = np.empty(intervals)
    level = rng.normal(0.0, sd)
    for i, shock in enumerate(shocks):  # AR(1); a few thousand steps, not worth a filter
        level = phi * level + shock
        noise[i] = level
    rate = tasks_per_hour / 3600.0 * daily_profile(hour) * weekly_profile(weekday)
    arrivals = rng.poisson(rate * np.exp(noise) * interval_s)
    start = np.repeat(t0, arrivals) + rng.uniform(0, interval_s, arrivals.sum())
    shape = rng.choice(len(TASK_SHAPES), size=start.size, p=SHAPE_WEIGHTS)
    duration = np.minimum(rng.lognormal(np.log(1200.0), 1.0, start.size), 12 * 3600.0)

    n_bursts = rng.poisson(bursts_per_day * days)
    b_start = rng.uniform(0, intervals * interval_s, n_bursts)
    b_size = rng.integers(40, 401, n_bursts)
    b_shape = rng.choice(len(TASK_SHAPES), size=n_bursts, p=SHAPE_WEIGHTS)
    b_dur = rng.uniform(3600.0, 3 * 3600.0, n_bursts)
    burst_start = np.repeat(b_start, b_size) + rng.uniform(0, interval_s, b_size.sum())
    start = np.concatenate([start, burst_start])
    shape = np.concatenate([shape, np.repeat(b_shape, b_size)])
    duration = np.concatenate([duration, np.repeat(b_dur, b_size)])

    vectors = np.zeros((start.size, 4), dtype=np.int64)
    vectors[:, :2] = TASK_SHAPES[shape]
    order = np.argsort(start, kind="stable")
    return TaskDemand(start[order], (start + duration)[order], vectors[order])


def demand_from_jobs(jobs: Iterable[TraceJob]) -> TaskDemand:
    """A trace's tasks as ``TaskDemand``: every task starts at its job's arrival (the
    demand is what was asked for, not when a scheduler got to it)."""
    start, end, vectors = [], [], []
    for job in jobs:
        for task in job.tasks:
            start.append(job.arrival_s)
            end.append(job.arrival_s + task.duration_s)
            vectors.append((task.cpu_milli, task.memory_mb, task.disk_mb, task.net_mbps))
    if not start:
        raise ValueError("the trace has no tasks")
    s = np.array(start, dtype=np.float64)
    origin = float(s.min())
    # Trace clocks are not wall clocks: anchor the first arrival at the synthetic start
    # so time features are at least consistent across runs.
    return TaskDemand(
        s - origin,
        np.array(end, dtype=np.float64) - origin,
        np.array(vectors, dtype=np.int64).reshape(-1, 4),
    )


@dataclass(frozen=True)
class BucketSeries:
    """Nodes per bucket per interval, and what went into it."""

    counts: np.ndarray  # (T, B) int64
    unix_s: np.ndarray  # (T,) start of each interval
    interval_s: float
    buckets: np.ndarray  # (B, 4)
    unfit_tasks: int  # tasks no bucket could hold, left out


def bucket_series(
    demand: TaskDemand, buckets: np.ndarray, interval_s: float, intervals: int | None = None
) -> BucketSeries:
    """Per interval, the nodes of each shape the tasks running in it need (see module doc)."""
    buckets = np.asarray(buckets, dtype=np.int64)
    bucket, _ = assign_buckets(demand.vectors, buckets)
    if intervals is None:
        intervals = int(np.ceil(max(demand.end_s.max(), interval_s) / interval_s))
    placed = bucket != UNFIT
    first = np.floor(demand.start_s[placed] / interval_s).astype(np.int64)
    # A task ending exactly on a boundary does not occupy the next interval.
    last = np.ceil(demand.end_s[placed] / interval_s).astype(np.int64)
    last = np.maximum(last, first + 1)
    first, last = np.clip(first, 0, intervals), np.clip(last, 0, intervals)
    diff = np.zeros((intervals + 1, len(buckets), buckets.shape[1]), dtype=np.int64)
    np.add.at(diff, (first, bucket[placed]), demand.vectors[placed])
    np.add.at(diff, (last, bucket[placed]), -demand.vectors[placed])
    sums = np.cumsum(diff[:-1], axis=0)
    return BucketSeries(
        counts=counts_from_sums(sums, buckets),
        unix_s=demand.start_unix_s + np.arange(intervals) * interval_s,
        interval_s=interval_s,
        buckets=buckets,
        unfit_tasks=int((~placed).sum()),
    )
