"""Demand forecast and scale plan: the forecasters see no future, the gradient-boosted
model beats the last value on a seasonal series, and a plan never shrinks below demand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from services.core.forecast import (
    ForecastError,
    GradientBoostedForecaster,
    NaiveForecaster,
    SeasonalForecaster,
    Seasons,
    choose_forecaster,
    lag_features,
    scale_plan,
    whole_nodes,
)

MONDAY = 1_704_067_200.0  # 2024-01-01 00:00 UTC
INTERVAL = 3600.0
SEASONS = Seasons.for_interval(INTERVAL)


def seasonal_series(days: int, seed: int = 0, buckets: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Hourly counts with a daily cycle, quieter weekends, and Poisson noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(days * 24)
    hour, weekday = t % 24, (t // 24) % 7
    shape = 20 + 15 * np.sin(2 * np.pi * (hour - 9) / 24)
    shape = shape * np.where(weekday >= 5, 0.6, 1.0)
    scale = np.array([1.0, 0.3])[:buckets]
    counts = rng.poisson(shape[:, None] * scale[None, :])
    return counts.astype(np.float64), MONDAY + t * INTERVAL


def test_seasons_from_the_interval():
    assert Seasons.for_interval(900) == Seasons(day=96, week=672)
    assert Seasons.for_interval(3600) == Seasons(day=24, week=168)
    with pytest.raises(ForecastError, match="interval_s must be > 0"):
        Seasons.for_interval(0)


def test_naive_and_seasonal_baselines():
    counts, unix_s = seasonal_series(days=9)
    at = np.array([24 * 8 + 5])
    assert NaiveForecaster().forecast(counts, unix_s, at).tolist() == [counts[at[0] - 1].tolist()]
    expected = np.maximum(counts[at[0] - 24], counts[at[0] - 168])
    assert SeasonalForecaster(SEASONS).forecast(counts, unix_s, at)[0].tolist() == expected.tolist()
    # less than a day of history: the seasonal baseline falls back to the last value
    assert (
        SeasonalForecaster(SEASONS).forecast(counts[:5], unix_s[:5])[0].tolist()
        == counts[4].tolist()
    )


def test_features_use_only_the_past():
    counts, unix_s = seasonal_series(days=9)
    at = np.array([100, 200])
    level = counts.mean(axis=0) + 1
    before = lag_features(counts, unix_s, at, SEASONS, 4, level, INTERVAL)
    future = counts.copy()
    future[100:] += 1000  # rewrite everything from the first target on
    after = lag_features(future, unix_s, at[:1], SEASONS, 4, level, INTERVAL)
    assert np.array_equal(before[:2], after, equal_nan=True)
    # hour of day and day of week of the target (index 100 = day 4, 04:00: a Friday)
    assert before[0, -2] == pytest.approx(4.0) and before[0, -1] == 4


def test_gradient_boosted_beats_the_last_value_on_a_seasonal_series():
    counts, unix_s = seasonal_series(days=35, seed=3)
    train = 28 * 24
    at = np.arange(train, len(counts))
    model = GradientBoostedForecaster(SEASONS, INTERVAL, max_iter=120).fit(
        counts[:train], unix_s[:train]
    )
    gbm = np.abs(model.forecast(counts, unix_s, at) - counts[at]).mean()
    naive = np.abs(NaiveForecaster().forecast(counts, unix_s, at) - counts[at]).mean()
    assert gbm < 0.8 * naive
    # deterministic for a seed
    again = GradientBoostedForecaster(SEASONS, INTERVAL, max_iter=120).fit(
        counts[:train], unix_s[:train]
    )
    assert np.array_equal(again.forecast(counts, unix_s, at), model.forecast(counts, unix_s, at))


def test_a_quantile_model_forecasts_higher_than_the_mean_model():
    counts, unix_s = seasonal_series(days=21, seed=4)
    at = np.arange(14 * 24, len(counts))
    mean = GradientBoostedForecaster(SEASONS, INTERVAL, max_iter=60).fit(
        counts[: at[0]], unix_s[: at[0]]
    )
    high = GradientBoostedForecaster(SEASONS, INTERVAL, max_iter=60, quantile=0.9)
    high.fit(counts[: at[0]], unix_s[: at[0]])
    assert (high.forecast(counts, unix_s, at) >= counts[at]).mean() > 0.75
    assert high.forecast(counts, unix_s, at).mean() > mean.forecast(counts, unix_s, at).mean()


def test_short_history_fits_without_the_missing_lags():
    counts, unix_s = seasonal_series(days=2)  # no week of history: the week lags are NaN
    model = GradientBoostedForecaster(SEASONS, INTERVAL, max_iter=20).fit(counts, unix_s)
    assert model.forecast(counts, unix_s).shape == (1, 2)


def test_choose_forecaster_by_history():
    assert isinstance(choose_forecaster(10, INTERVAL), NaiveForecaster)
    assert isinstance(choose_forecaster(25, INTERVAL), SeasonalForecaster)
    assert isinstance(choose_forecaster(30, INTERVAL), GradientBoostedForecaster)


def test_bad_series_are_refused_with_a_reason():
    counts, unix_s = seasonal_series(days=2)
    with pytest.raises(ForecastError, match="increase strictly"):
        NaiveForecaster().forecast(counts, unix_s[::-1])
    with pytest.raises(ForecastError, match=">= 0"):
        NaiveForecaster().forecast(-counts, unix_s)
    with pytest.raises(ForecastError, match="fit the forecaster"):
        GradientBoostedForecaster(SEASONS, INTERVAL).forecast(counts, unix_s)
    with pytest.raises(ForecastError, match="targets must lie"):
        NaiveForecaster().forecast(counts, unix_s, [0])


def test_scale_plan_examples():
    plan = scale_plan(np.array([7.4, 2.0, 0.6]), np.array([5, 4, 0]), np.array([3, 9, 0]))
    assert plan.target.tolist() == [7, 4, 1]  # forecast 2 but 4 running now: keep 4
    assert plan.add.tolist() == [4, 0, 1]  # 9 allocated already: add none, never -5
    assert whole_nodes(np.array([-3.0, 2.49, 2.5001])).tolist() == [0, 2, 3]


counts_b = hnp.arrays(np.int64, 4, elements=st.integers(0, 10_000))


@given(
    forecast=hnp.arrays(np.float64, 4, elements=st.floats(-1e4, 1e4)),
    demand=counts_b,
    allocated=counts_b,
)
def test_plan_is_never_negative_and_never_below_demand(forecast, demand, allocated):
    plan = scale_plan(forecast, demand, allocated)
    assert np.all(plan.add >= 0)
    assert np.all(plan.target >= demand)
    assert np.all(allocated + plan.add >= plan.target)  # the pool reaches the target
    assert np.all((plan.add == 0) | (allocated + plan.add == plan.target))  # and no more
