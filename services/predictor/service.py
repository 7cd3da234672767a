"""The predictor sidecar's gRPC servicer (``megha predictor``): a thin shell over the
lifetime model (``lifetime_model.py``) and the GPA math (``services/core/gpa.py``).

- ``PredictLifetime``: a batch of (features, uptime) queries, answered in request order
  with E[remaining], remaining-lifetime quantiles and the LAVA class of the expectation.
  The model comes from the constructor or the file named by ``MEGHA_PREDICTOR_MODEL``;
  with neither, the features-blind ``UptimePrior`` answers (logged once at start and
  counted in ``megha_predictor_predictions_total{source="fallback"}``: the reply has no
  field to say so).
- ``FitGpa``: which nodes take the task with P(CPU usage > capacity) <= rho.
- ``ForecastDemand``: the next interval's nodes per resource bucket from a history of
  bucket counts, and the scale-up plan: target = max(forecast, demand now), add =
  target - allocated, never negative (``demand.py`` over ``services/core/forecast.py``).
  The model is fitted on the request's own history, so a call costs a fit (tens to
  hundreds of ms for weeks of 15-minute samples); it runs off the event loop.

The same object works in-process (call ``predict`` / ``fit_gpa`` / ``forecast_demand``)
without a network hop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import numpy as np
from prometheus_client import Counter, Histogram

from services._proto.megha.v1 import predictor_pb2, predictor_pb2_grpc
from services.predictor.demand import forecast_demand
from services.predictor.lifetime_model import (
    LifetimeEstimates,
    LifetimeModel,
    UptimePrior,
    load_model,
)

log = logging.getLogger("megha.predictor")

MODEL_ENV = "MEGHA_PREDICTOR_MODEL"
# Batches past this many queries are predicted off the event loop, so one big batch
# does not stall the small ones behind it.
OFFLOAD_ROWS = 512

PREDICTIONS = Counter(
    "megha_predictor_predictions_total",
    "Lifetime predictions answered, by source (model or fallback prior).",
    ["source"],
)
RPC_SECONDS = Histogram(
    "megha_predictor_rpc_duration_seconds",
    "Time to answer a predictor RPC, by method.",
    ["method"],
    buckets=tuple(0.00005 * 2**i for i in range(16)),
)


class PredictorService(predictor_pb2_grpc.PredictorServicer):
    """Lifetime prediction, GPA fit and demand forecast; see the module doc for the
    lifetime fallback."""

    def __init__(self, model: LifetimeModel | None = None, model_path: str | Path | None = None):
        if model is None:
            path = model_path if model_path is not None else os.environ.get(MODEL_ENV) or None
            if path:
                model = load_model(path)  # a configured model that fails to load is fatal
                log.info("lifetime model loaded", extra={"path": str(path)})
        self.model = model
        self.prior = UptimePrior()
        self.source = "model" if model is not None else "fallback"
        # Metric children looked up once, not per call.
        self._predictions = PREDICTIONS.labels(self.source)
        self._predict_seconds = RPC_SECONDS.labels("PredictLifetime")
        if model is None:
            log.warning(
                f"no lifetime model configured (set {MODEL_ENV}); answering with the "
                "uptime-only Lomax prior, which ignores features"
            )

    # --- in-process API ------------------------------------------------------------------

    def predict(
        self, features: Sequence[Mapping[str, str]], uptime_s: Sequence[float] | np.ndarray
    ) -> LifetimeEstimates:
        predictor = self.model if self.model is not None else self.prior
        estimates = predictor.predict(features, np.asarray(uptime_s, dtype=np.float64))
        self._predictions.inc(len(features))
        return estimates

    @staticmethod
    def fit_gpa(request: predictor_pb2.FitGpaRequest) -> predictor_pb2.FitGpaResponse:
        """Raises ``ValueError`` with the reason for a request that makes no sense."""
        from services.core.gpa import fits_gpa, overflow_probability

        if not 0.0 < request.rho < 1.0:
            raise ValueError(f"rho must be in (0, 1), got {request.rho}")
        if request.task_mean_milli < 0 or request.task_std_milli < 0:
            raise ValueError("task_mean_milli and task_std_milli must be >= 0")
        nodes = request.nodes
        capacity = np.array([n.capacity_milli for n in nodes], dtype=np.float64)
        sum_mean = np.array([n.sum_mean_milli for n in nodes], dtype=np.float64)
        sum_var = np.array([n.sum_var_milli2 for n in nodes], dtype=np.float64)
        if np.any(capacity <= 0) or np.any(sum_var < 0):
            raise ValueError("every node needs capacity_milli > 0 and sum_var_milli2 >= 0")
        args = (capacity, sum_mean, sum_var, request.task_mean_milli, request.task_std_milli)
        overflow = np.asarray(overflow_probability(*args), dtype=np.float64)
        fits = np.asarray(fits_gpa(*args, request.rho), dtype=bool)
        return predictor_pb2.FitGpaResponse(
            fitting_node_indices=[n.node_index for n, ok in zip(nodes, fits, strict=True) if ok],
            overflow_probabilities=overflow.tolist(),
        )

    # --- gRPC ----------------------------------------------------------------------------

    async def PredictLifetime(self, request, context):
        started = time.perf_counter()
        queries = request.queries
        if not queries:
            return predictor_pb2.PredictLifetimeResponse()
        # The model reads the request's feature maps as they are (``.get`` only), no copy.
        features = [q.features for q in queries]
        uptimes = [q.uptime_s for q in queries]
        if not all(0.0 <= u < math.inf for u in uptimes):  # NaN fails too
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "uptime_s must be >= 0")
        uptime = np.array(uptimes, dtype=np.float64)
        if len(queries) > OFFLOAD_ROWS:
            est = await asyncio.to_thread(self.predict, features, uptime)
        else:
            est = self.predict(features, uptime)
        levels = list(est.quantile_levels)
        classes = est.lifetime_class.tolist()
        reply = predictor_pb2.PredictLifetimeResponse(
            predictions=[
                predictor_pb2.LifetimePrediction(
                    task_id=q.task_id,
                    expected_remaining_s=expected,
                    quantiles=quantiles,
                    quantile_levels=levels,
                    lifetime_class=cls,
                )
                for q, expected, quantiles, cls in zip(
                    queries,
                    est.expected_remaining_s.tolist(),
                    est.quantiles_s.tolist(),
                    classes,
                    strict=True,
                )
            ]
        )
        self._predict_seconds.observe(time.perf_counter() - started)
        return reply

    async def FitGpa(self, request, context):
        started = time.perf_counter()
        try:
            reply = self.fit_gpa(request)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        RPC_SECONDS.labels("FitGpa").observe(time.perf_counter() - started)
        return reply

    @staticmethod
    def forecast_demand(
        request: predictor_pb2.ForecastDemandRequest,
    ) -> predictor_pb2.ForecastDemandResponse:
        """Raises ``ValueError`` naming the field of a request that makes no sense."""
        return forecast_demand(request)

    async def ForecastDemand(self, request, context):
        """Forecast one interval ahead and plan the pool: ``forecast_bucket_counts``
        (to the nearest node), ``target_bucket_counts`` = max(forecast, the last sample's demand),
        ``scale_plan`` = target - ``allocated_bucket_counts``, never negative, and the
        ``method`` that answered (UNSPECIFIED asks for the best the history supports).
        INVALID_ARGUMENT, with the field and the reason, for an empty or ragged history,
        timestamps out of order, bad buckets or interval, or a named method that needs
        more history than was sent."""
        started = time.perf_counter()
        try:
            reply = await asyncio.to_thread(forecast_demand, request)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        RPC_SECONDS.labels("ForecastDemand").observe(time.perf_counter() - started)
        return reply
