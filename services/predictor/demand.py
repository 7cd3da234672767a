"""``ForecastDemand`` without the gRPC: check a request, forecast, plan.

    ForecastDemandRequest ──check──▶ counts (T, B), seconds (T,), allocated (B,)
        ──forecaster (services/core/forecast.py)──▶ forecast (B,) ──scale_plan──▶ response

Every problem with a request is a ``ValueError`` whose message names the field, so the
servicer can answer INVALID_ARGUMENT with it as is. Only the newest ``MAX_HISTORY_DAYS``
(and at most ``MAX_HISTORY_INTERVALS``) of the history are used: older weeks stop
helping a one-interval-ahead forecast and make every call slower.
"""

from __future__ import annotations

import numpy as np

from services._proto.megha.v1 import predictor_pb2
from services.common.convert import resources_from_proto
from services.core.forecast import (
    ForecastError,
    GradientBoostedForecaster,
    NaiveForecaster,
    SeasonalForecaster,
    Seasons,
    choose_forecaster,
    scale_plan,
    whole_nodes,
)

MAX_HISTORY_DAYS = 28
MAX_HISTORY_INTERVALS = 20_000
LAGS = 6
METHOD_NAMES = {
    predictor_pb2.FORECAST_METHOD_NAIVE: "naive",
    predictor_pb2.FORECAST_METHOD_SEASONAL: "seasonal",
    predictor_pb2.FORECAST_METHOD_GRADIENT_BOOSTED: "gradient_boosted",
}
_METHOD_OF = {
    NaiveForecaster: predictor_pb2.FORECAST_METHOD_NAIVE,
    SeasonalForecaster: predictor_pb2.FORECAST_METHOD_SEASONAL,
    GradientBoostedForecaster: predictor_pb2.FORECAST_METHOD_GRADIENT_BOOSTED,
}


def parse_request(
    request: predictor_pb2.ForecastDemandRequest,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(counts (T, B), unix seconds (T,), allocated (B,)), newest history kept; raises
    ``ValueError`` naming the field that is wrong."""
    if not request.buckets:
        raise ValueError("buckets is empty: name the node shapes the counts refer to")
    buckets = np.array([resources_from_proto(b) for b in request.buckets])
    for i, shape in enumerate(buckets):
        if np.any(shape < 0) or not np.any(shape > 0):
            raise ValueError(f"buckets[{i}] must have quantities >= 0, not all zero")
    if not (np.isfinite(request.interval_s) and request.interval_s > 0):
        raise ValueError(f"interval_s must be > 0, got {request.interval_s}")
    if not request.history:
        raise ValueError("history is empty: send at least the demand now")
    width = len(buckets)
    keep = min(
        MAX_HISTORY_INTERVALS,
        Seasons.for_interval(request.interval_s).day * MAX_HISTORY_DAYS,
        len(request.history),
    )
    samples = request.history[len(request.history) - keep :]
    for i, sample in enumerate(samples, start=len(request.history) - keep):
        if len(sample.bucket_counts) != width:
            raise ValueError(
                f"history[{i}] has {len(sample.bucket_counts)} bucket_counts, expected "
                f"{width} (one per bucket)"
            )
    counts = np.array([s.bucket_counts for s in samples], dtype=np.float64).reshape(keep, width)
    unix_s = np.array([s.unix_nanos for s in samples], dtype=np.float64) / 1e9
    if keep > 1 and np.any(np.diff(unix_s) <= 0):
        first = int(np.flatnonzero(np.diff(unix_s) <= 0)[0]) + len(request.history) - keep + 1
        raise ValueError(
            f"history must be oldest first with increasing unix_nanos; history[{first}] "
            "is not later than the sample before it"
        )
    allocated = request.allocated_bucket_counts
    if len(allocated) not in (0, width):
        raise ValueError(
            f"allocated_bucket_counts has {len(allocated)} entries, expected {width} "
            "(one per bucket) or none (an empty pool)"
        )
    alloc = np.array(allocated, dtype=np.int64) if allocated else np.zeros(width, np.int64)
    return counts, unix_s, alloc


def forecaster_for(method: int, history: int, interval_s: float, seed: int = 0):
    """The forecaster ``method`` names, or the best ``history`` supports (UNSPECIFIED);
    ``ValueError`` when the named method needs more history."""
    seasons = Seasons.for_interval(interval_s)
    if method == predictor_pb2.FORECAST_METHOD_UNSPECIFIED:
        return choose_forecaster(history, interval_s, lags=LAGS, seed=seed)
    if method == predictor_pb2.FORECAST_METHOD_NAIVE:
        return NaiveForecaster()
    if method == predictor_pb2.FORECAST_METHOD_SEASONAL:
        need, why = seasons.day + 1, "a day and one interval"
        forecaster = SeasonalForecaster(seasons)
    elif method == predictor_pb2.FORECAST_METHOD_GRADIENT_BOOSTED:
        need, why = seasons.day + LAGS, f"a day plus {LAGS} lags"
        forecaster = GradientBoostedForecaster(seasons, interval_s, lags=LAGS, seed=seed)
    else:
        raise ValueError(f"unknown method {method}")
    if history < need:
        name = predictor_pb2.ForecastMethod.Name(method)
        raise ValueError(
            f"{name} needs {need} intervals of history ({why} at {interval_s:g} s per "
            f"interval), got {history}; send more or leave method unset"
        )
    return forecaster


def forecast_demand(
    request: predictor_pb2.ForecastDemandRequest,
) -> predictor_pb2.ForecastDemandResponse:
    """Forecast the next interval's nodes per bucket and the scale-up plan."""
    counts, unix_s, allocated = parse_request(request)
    forecaster = forecaster_for(request.method, len(counts), request.interval_s)
    try:
        if isinstance(forecaster, GradientBoostedForecaster):
            forecaster.fit(counts, unix_s)
        forecast = forecaster.forecast(counts, unix_s)[0]
    except ForecastError as err:
        raise ValueError(str(err)) from err
    plan = scale_plan(forecast, counts[-1].astype(np.int64), allocated)
    return predictor_pb2.ForecastDemandResponse(
        forecast_bucket_counts=whole_nodes(forecast).tolist(),
        scale_plan=plan.add.tolist(),
        target_bucket_counts=plan.target.tolist(),
        method=_METHOD_OF[type(forecaster)],
    )
