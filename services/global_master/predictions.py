"""The GM's side of the predictor sidecar: lifetime predictions for submitted tasks.

    SubmitJob ──tasks with lifetime_features──▶ one PredictLifetime (batched, short deadline)
        answer   → Task.predicted_lifetime_s (travels in the durable queue message to the
                   LM, and shows in GetJob)
        no answer → logged once, counted, the job is queued without predictions; the
                   sidecar is not asked again for ``retry_after_s``, so a dead sidecar
                   costs a submission at most one deadline per ``retry_after_s``

Scheduling never waits on the sidecar: matching runs off the queue, and a submission
waits at most ``timeout_s`` for it. A federation without a ``predictor`` entry never
asks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import grpc
from prometheus_client import Counter

from services._proto.megha.v1 import common_pb2, predictor_pb2, predictor_pb2_grpc
from services.common.server import channel

log = logging.getLogger("megha.gm")

TIMEOUT_S = 0.25  # the sidecar answers in ~1 ms on loopback; this is for a sick one
RETRY_AFTER_S = 5.0
# Without a cap, gRPC backs off reconnecting for up to 2 minutes, so a sidecar that comes
# back would stay unused that long.
_CHANNEL_OPTIONS = [  # after the shared ones (server.channel)
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", int(RETRY_AFTER_S * 1000)),
]

REQUESTS = Counter(
    "megha_predictor_requests_total",
    "Calls a GM made (or skipped while the sidecar was down) to the predictor sidecar, "
    "by RPC and result (ok, error, skipped).",
    ["gm", "rpc", "result"],
)
ERRORS = Counter(
    "megha_predictor_errors_total",
    "Failed calls from a GM to the predictor sidecar, by RPC and gRPC status code.",
    ["gm", "rpc", "code"],
)


class LifetimePredictions:
    """Asks the sidecar for the expected lifetime of tasks; never raises, never blocks
    longer than ``timeout_s``. ``clock`` is injected so tests control the back-off."""

    def __init__(
        self,
        gm_id: str,
        target: str | None,
        timeout_s: float = TIMEOUT_S,
        retry_after_s: float = RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.gm_id = gm_id
        self.target = target
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.clock = clock
        self._channel = channel(target, _CHANNEL_OPTIONS) if target else None
        self._stub = predictor_pb2_grpc.PredictorStub(self._channel) if self._channel else None
        self._down_until: float | None = None  # set while the sidecar is considered down

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def annotate(self, tasks: Sequence[common_pb2.Task]) -> int:
        """Set ``predicted_lifetime_s`` on every task with lifetime features (0 on the
        rest); returns how many got a prediction."""
        for task in tasks:
            task.predicted_lifetime_s = 0.0
        asking = [t for t in tasks if t.lifetime_features]
        if self._stub is None or not asking:
            return 0
        now = self.clock()
        if self._down_until is not None and now < self._down_until:
            REQUESTS.labels(self.gm_id, "PredictLifetime", "skipped").inc()
            return 0
        request = predictor_pb2.PredictLifetimeRequest(
            queries=[
                predictor_pb2.LifetimeQuery(task_id=t.task_id, features=t.lifetime_features)
                for t in asking
            ]
        )
        try:
            reply = await self._stub.PredictLifetime(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            self._failed(err.code().name, err.details() or "")
            return 0
        if len(reply.predictions) != len(asking):
            self._failed("INTERNAL", f"{len(reply.predictions)} answers for {len(asking)}")
            return 0
        for task, prediction in zip(asking, reply.predictions, strict=True):
            # Asked at uptime 0, so the expected remaining lifetime is the lifetime.
            task.predicted_lifetime_s = prediction.expected_remaining_s
        REQUESTS.labels(self.gm_id, "PredictLifetime", "ok").inc()
        if self._down_until is not None:
            self._down_until = None
            log.info("predictor answers again", extra={"predictor": self.target})
        return len(asking)

    def _failed(self, code: str, details: str) -> None:
        REQUESTS.labels(self.gm_id, "PredictLifetime", "error").inc()
        ERRORS.labels(self.gm_id, "PredictLifetime", code).inc()
        if self._down_until is None:  # log the outage once, not every submission
            log.warning(
                f"predictor sidecar did not answer ({code}: {details}); queueing jobs "
                f"without lifetime predictions, asking again in {self.retry_after_s:g} s",
                extra={"predictor": self.target},
            )
        self._down_until = self.clock() + self.retry_after_s
