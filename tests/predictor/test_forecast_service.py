"""ForecastDemand over real gRPC: a loopback server answering with the core's forecast and
scale plan, and INVALID_ARGUMENT with the field and the reason for bad requests."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from services._proto.megha.v1 import common_pb2, predictor_pb2
from services.core.forecast import (
    GradientBoostedForecaster,
    SeasonalForecaster,
    Seasons,
    scale_plan,
)
from services.predictor.service import PredictorService
from tests.predictor.test_service import stub_of

MONDAY_NS = 1_704_067_200 * 10**9
INTERVAL = 3600.0
BUCKETS = [
    common_pb2.Resources(cpu_milli=4000, memory_mb=16384),
    common_pb2.Resources(cpu_milli=16000, memory_mb=65536),
]


def history(days: float, seed: int = 0) -> tuple[np.ndarray, list[predictor_pb2.DemandSample]]:
    rng = np.random.default_rng(seed)
    t = np.arange(int(days * 24))
    base = 12 + 8 * np.sin(2 * np.pi * (t % 24 - 9) / 24)
    counts = rng.poisson(np.stack([base, base / 3], axis=1)).astype(np.int64)
    samples = [
        predictor_pb2.DemandSample(unix_nanos=MONDAY_NS + int(i * INTERVAL * 1e9), bucket_counts=c)
        for i, c in enumerate(counts.tolist())
    ]
    return counts, samples


def request(samples, **extra) -> predictor_pb2.ForecastDemandRequest:
    return predictor_pb2.ForecastDemandRequest(
        history=samples, buckets=BUCKETS, interval_s=INTERVAL, **extra
    )


async def test_round_trip_matches_the_core_forecast_and_plan():
    counts, samples = history(days=3)
    unix_s = (MONDAY_NS / 1e9) + np.arange(len(counts)) * INTERVAL
    allocated = [counts[-1, 0] + 1, 0]
    async with stub_of(PredictorService()) as stub:
        reply = await stub.ForecastDemand(request(samples, allocated_bucket_counts=allocated))
        seasonal = await stub.ForecastDemand(
            request(samples, method=predictor_pb2.FORECAST_METHOD_SEASONAL)
        )
    assert reply.method == predictor_pb2.FORECAST_METHOD_GRADIENT_BOOSTED  # 3 days: enough
    seasons = Seasons.for_interval(INTERVAL)
    forecast = (
        GradientBoostedForecaster(seasons, INTERVAL, lags=6)
        .fit(counts, unix_s)
        .forecast(counts, unix_s)[0]
    )
    plan = scale_plan(forecast, counts[-1], np.array(allocated))
    assert list(reply.forecast_bucket_counts) == np.rint(forecast).astype(int).tolist()
    assert list(reply.target_bucket_counts) == plan.target.tolist()
    assert list(reply.scale_plan) == plan.add.tolist()
    assert all(t >= d for t, d in zip(reply.target_bucket_counts, counts[-1], strict=True))
    expected = SeasonalForecaster(seasons).forecast(counts, unix_s)[0]
    assert list(seasonal.forecast_bucket_counts) == np.rint(expected).astype(int).tolist()
    assert list(seasonal.scale_plan) == list(seasonal.target_bucket_counts)  # empty pool


async def test_short_history_gets_the_last_value_and_a_named_method_needs_its_history():
    counts, samples = history(days=0.5)
    async with stub_of(PredictorService()) as stub:
        reply = await stub.ForecastDemand(request(samples))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ForecastDemand(
                request(samples, method=predictor_pb2.FORECAST_METHOD_GRADIENT_BOOSTED)
            )
    assert reply.method == predictor_pb2.FORECAST_METHOD_NAIVE
    assert list(reply.forecast_bucket_counts) == counts[-1].tolist()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "FORECAST_METHOD_GRADIENT_BOOSTED needs 30 intervals of history" in err.value.details()


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda r: r.ClearField("history"), "history is empty"),
        (lambda r: r.ClearField("buckets"), "buckets is empty"),
        (lambda r: setattr(r, "interval_s", 0.0), "interval_s must be > 0"),
        (
            lambda r: r.history[2].bucket_counts.append(1),
            "history[2] has 3 bucket_counts, expected 2",
        ),
        (lambda r: setattr(r.history[3], "unix_nanos", 0), "history[3] is not later"),
        (lambda r: r.allocated_bucket_counts.append(4), "allocated_bucket_counts has 1 entries"),
        (lambda r: r.buckets.append(common_pb2.Resources()), "buckets[2] must have quantities"),
    ],
)
async def test_bad_requests_are_invalid_argument_with_the_reason(mutate, reason):
    _, samples = history(days=0.25)
    bad = request(samples)
    mutate(bad)
    async with stub_of(PredictorService()) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ForecastDemand(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in err.value.details()
