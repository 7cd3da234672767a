"""Demand forecast one interval ahead, and the scale-up plan built on it (predictive
autoscaling, after Gao 2020).

    bucket counts (T, B), one row per interval ──▶ forecaster ──▶ forecast (B,) for T
    forecast, demand now, nodes allocated ──▶ scale_plan ──▶ target, nodes to add

Forecasters (all answer ``forecast(series, unix_s, at)``: for every target index ``a`` in
``at``, a forecast of ``series[a]`` from ``series[:a]`` only, so one call can replay a
whole evaluation period without peeking):

- ``NaiveForecaster``: the last value. What a reactive autoscaler implicitly assumes.
- ``SeasonalForecaster``: the larger of "same time yesterday" and "same time last week"
  (max of the last seasons: erring high is cheaper than a pending task). Needs a day.
- ``GradientBoostedForecaster``: scikit-learn's HistGradientBoostingRegressor, one model
  for all buckets, on lag features: lags 1..k, same time last day and last week, the
  seasonal-difference forecasts ``y[a-1] + y[a-s] - y[a-1-s]`` for s = day and week, the
  mean of the last day, hour of day and day of week of the target. Counts are divided by
  each bucket's mean level so shapes of very different sizes share one model, and the
  model learns the change from the last value (trees cannot extrapolate a level they
  never saw). Missing lags (too little history) are NaN, which the model handles.

The time features come from the caller's timestamps (seconds since the Unix epoch, UTC):
the core reads no clock.

Fits and predictions run on one OpenMP thread: the data are small (thousands of rows),
and on a shared two-core machine a second thread made a fit 10x slower, not faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

DAY_S = 86_400.0


class ForecastError(ValueError):
    """A demand series the forecaster cannot use; the message says why."""


@dataclass(frozen=True)
class Seasons:
    """Season lengths in intervals."""

    day: int
    week: int

    @classmethod
    def for_interval(cls, interval_s: float) -> Seasons:
        """Intervals per day and week for ``interval_s`` (rounded when it does not divide
        a day evenly)."""
        if not interval_s > 0:
            raise ForecastError(f"interval_s must be > 0, got {interval_s}")
        day = max(1, round(DAY_S / interval_s))
        return cls(day=day, week=7 * day)


def check_series(series: np.ndarray, unix_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(T, B) float counts and (T,) float seconds, or ``ForecastError`` with the reason."""
    counts = np.asarray(series, dtype=np.float64)
    stamps = np.asarray(unix_s, dtype=np.float64)
    if counts.ndim != 2 or counts.shape[0] == 0 or counts.shape[1] == 0:
        raise ForecastError("need a (intervals, buckets) series with at least one interval")
    if stamps.shape != (counts.shape[0],):
        raise ForecastError(
            f"need one timestamp per interval ({counts.shape[0]}), got {stamps.shape}"
        )
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise ForecastError("bucket counts must be finite and >= 0")
    if stamps.size > 1 and np.any(np.diff(stamps) <= 0):
        raise ForecastError("timestamps must increase strictly (oldest first)")
    return counts, stamps


def _at(at: Sequence[int] | np.ndarray | None, length: int) -> np.ndarray:
    idx = np.array([length] if at is None else at, dtype=np.intp).reshape(-1)
    if idx.size and (idx.min() < 1 or idx.max() > length):
        raise ForecastError(f"targets must lie in 1..{length} (some history before each)")
    return idx


def _lagged(series: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``series[idx]`` with NaN rows where ``idx`` < 0."""
    out = series[np.clip(idx, 0, None)]
    out[idx < 0] = np.nan
    return out


class NaiveForecaster:
    """The last value: tomorrow looks like now."""

    name = "naive"

    def forecast(self, series, unix_s, at=None) -> np.ndarray:
        counts, _ = check_series(series, unix_s)
        return counts[_at(at, len(counts)) - 1]


@dataclass(frozen=True)
class SeasonalForecaster:
    """max(same time yesterday, same time last week); the last value while there is not
    a day of history."""

    seasons: Seasons
    name = "seasonal"

    def forecast(self, series, unix_s, at=None) -> np.ndarray:
        counts, _ = check_series(series, unix_s)
        idx = _at(at, len(counts))
        past = np.stack(
            [_lagged(counts, idx - self.seasons.day), _lagged(counts, idx - self.seasons.week)]
        )
        out = np.nanmax(np.where(np.isnan(past).all(axis=0), counts[idx - 1], past), axis=0)
        return out


def lag_features(
    series: np.ndarray,
    unix_s: np.ndarray,
    at: np.ndarray,
    seasons: Seasons,
    lags: int,
    level: np.ndarray,
    interval_s: float,
) -> np.ndarray:
    """Feature rows (len(at) x B, F) for targets ``at``, bucket-major within a target:
    row ``i * B + b`` describes ``series[at[i], b]``. Counts are divided by ``level``."""
    scaled = series / level
    cols = [_lagged(scaled, at - j) for j in range(1, lags + 1)]
    last = cols[0]
    for season in (seasons.day, seasons.week):
        same = _lagged(scaled, at - season)
        cols += [same, last + same - _lagged(scaled, at - 1 - season)]
    # Mean over the last day from a cumulative sum: O(1) per target.
    csum = np.vstack([np.zeros((1, scaled.shape[1])), np.cumsum(scaled, axis=0)])
    start = np.clip(at - seasons.day, 0, None)
    cols.append((csum[at] - csum[start]) / (at - start)[:, None])
    target_s = unix_s[at - 1] + interval_s
    hour = (target_s % DAY_S) / 3600.0
    weekday = ((target_s // DAY_S) + 3) % 7  # 1970-01-01 was a Thursday; Monday = 0
    buckets = series.shape[1]
    cols.append(np.repeat(hour[:, None], buckets, axis=1))
    cols.append(np.repeat(weekday[:, None], buckets, axis=1))
    return np.stack(cols, axis=2).reshape(len(at) * buckets, len(cols))


@dataclass
class GradientBoostedForecaster:
    """HistGradientBoostingRegressor on lag features; ``fit`` then ``forecast``.

    ``quantile`` None fits the mean (squared error); a level such as 0.9 fits that
    quantile instead, which trades over-provisioning for fewer pending tasks.
    """

    seasons: Seasons
    interval_s: float
    lags: int = 6
    max_iter: int = 200
    learning_rate: float = 0.05
    quantile: float | None = None
    seed: int = 0
    name = "gbm"

    def __post_init__(self) -> None:
        if self.lags < 1:
            raise ForecastError(f"lags must be >= 1, got {self.lags}")
        if self.quantile is not None and not 0.0 < self.quantile < 1.0:
            raise ForecastError(f"quantile must be in (0, 1), got {self.quantile}")
        self._model = None
        self._level: np.ndarray | None = None
        self._columns = np.empty(0, dtype=np.intp)

    def fit(self, series, unix_s) -> GradientBoostedForecaster:
        """Train on every interval of ``series`` after the first, as a target."""
        from sklearn.ensemble import HistGradientBoostingRegressor

        counts, stamps = check_series(series, unix_s)
        if len(counts) < 3:
            raise ForecastError(f"need at least 3 intervals of history to fit, got {len(counts)}")
        self._level = counts.mean(axis=0) + 1.0
        at = np.arange(1, len(counts))
        x = lag_features(counts, stamps, at, self.seasons, self.lags, self._level, self.interval_s)
        y = ((counts[at] - counts[at - 1]) / self._level).reshape(-1)
        # A lag longer than the history is NaN throughout (last week's value with days
        # of history): useless, and scikit-learn's binning rejects such a column.
        self._columns = np.flatnonzero(~np.isnan(x).all(axis=0))
        x = x[:, self._columns]
        loss = {"loss": "quantile", "quantile": self.quantile} if self.quantile else {}
        self._model = HistGradientBoostingRegressor(
            max_iter=self.max_iter,
            learning_rate=self.learning_rate,
            min_samples_leaf=20,
            early_stopping=False,  # no random validation split: same seed, same model
            random_state=self.seed,
            **loss,
        )
        with threadpool_limits(1):
            self._model.fit(x, y)
        return self

    def forecast(self, series, unix_s, at=None) -> np.ndarray:
        if self._model is None or self._level is None:
            raise ForecastError("fit the forecaster before asking for a forecast")
        counts, stamps = check_series(series, unix_s)
        if counts.shape[1] != len(self._level):
            raise ForecastError(
                f"fitted on {len(self._level)} buckets, asked about {counts.shape[1]}"
            )
        idx = _at(at, len(counts))
        x = lag_features(counts, stamps, idx, self.seasons, self.lags, self._level, self.interval_s)
        x = x[:, self._columns]
        with threadpool_limits(1):
            change = self._model.predict(x)
        change = change.reshape(len(idx), counts.shape[1])
        return np.maximum(counts[idx - 1] + change * self._level, 0.0)


@dataclass(frozen=True)
class ScalePlan:
    """``target``: nodes per bucket for the next interval, never below current demand;
    ``add``: nodes to grow by now (placeholders until real tasks take them), never
    negative. Nodes beyond the target are the scale-down side, which is not this plan's
    business."""

    target: np.ndarray
    add: np.ndarray


def whole_nodes(forecast: np.ndarray) -> np.ndarray:
    """Whole nodes for a forecast: the nearest integer, negatives to 0. Nearest, not up:
    a mean forecast of 3.02 for a bucket steady at 3 nodes is noise, not a fourth node;
    a caller that prefers erring high forecasts a quantile instead."""
    f = np.maximum(np.asarray(forecast, dtype=np.float64), 0.0)
    return np.rint(f).astype(np.int64)


def scale_plan(
    forecast: np.ndarray, current_demand: np.ndarray, allocated: np.ndarray
) -> ScalePlan:
    """target = max(whole_nodes(forecast), demand now); add = max(target - allocated, 0)."""
    demand = np.asarray(current_demand, dtype=np.int64)
    nodes = np.asarray(allocated, dtype=np.int64)
    if np.any(demand < 0) or np.any(nodes < 0):
        raise ForecastError("current demand and allocated nodes must be >= 0")
    target = np.maximum(whole_nodes(forecast), demand)
    return ScalePlan(target=target, add=np.maximum(target - nodes, 0))


def choose_forecaster(
    history: int, interval_s: float, lags: int = 6, seed: int = 0
) -> NaiveForecaster | SeasonalForecaster | GradientBoostedForecaster:
    """The best forecaster ``history`` intervals support: the gradient-boosted model from
    a day plus ``lags`` intervals on, the seasonal baseline from a day, else the last value."""
    seasons = Seasons.for_interval(interval_s)
    if history >= seasons.day + lags:
        return GradientBoostedForecaster(seasons, interval_s, lags=lags, seed=seed)
    if history > seasons.day:
        return SeasonalForecaster(seasons)
    return NaiveForecaster()
