"""``megha bench predict``: how fast the lifetime model answers.

- in-process: one batch of queries (feature dicts + uptimes, as the GM would pass them)
  through ``PredictorService.predict`` (encoding, the mean and the three quantile models);
  reported per VM, median of several runs. Target: <= 50 us per VM. Also one VM per call
  (``inprocess_one_vm_us``, median of ``rpcs`` calls): the sidecar's own work for a
  one-VM request, what a round trip costs on top of gRPC.
- sidecar: a real gRPC server started in this process on a free loopback port, asked
  ``PredictLifetime`` for one VM at a time, sequentially; p50 / p99 of the round trip as
  the client sees it. Target: p99 <= 2 ms.
Without ``--model`` a model is trained first on a synthetic trace (not timed).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

INPROCESS_TARGET_US = 50.0
SIDECAR_P99_TARGET_MS = 2.0


@dataclass(frozen=True)
class PredictBench:
    inprocess_us_per_vm: float
    inprocess_batch: int
    inprocess_one_vm_us: float
    sidecar_p50_ms: float
    sidecar_p99_ms: float
    sidecar_rpcs: int
    model: str


def bench_predict(
    model_path: Path | None = None, batch: int = 10_000, rpcs: int = 2_000, seed: int = 7
) -> PredictBench:
    from loadgen.vm_trace import synthetic_vm_trace
    from services.predictor.lifetime_model import load_model, train_lifetime_model
    from services.predictor.service import PredictorService

    if model_path is not None:
        model, label = load_model(model_path), str(model_path)
    else:
        train = synthetic_vm_trace(vms=10_000, seed=seed, prehistory_days=0)
        model = train_lifetime_model(train.features, train.lifetime_s, seed=seed)
        label = "trained on 10,000 synthetic VMs"
    service = PredictorService(model=model)
    queries = synthetic_vm_trace(vms=max(batch, 1), seed=seed + 1, prehistory_days=0)
    features = queries.feature_dicts()
    uptime = np.random.default_rng(seed).uniform(0, 24 * 3600, len(features))
    service.predict(features[:100], uptime[:100])  # warm caches and the compiled trees
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        service.predict(features, uptime)
        runs.append(time.perf_counter() - started)
    inprocess_us = float(np.median(runs)) / len(features) * 1e6
    one_vm = []
    for i in range(rpcs):
        row = i % len(features)
        started = time.perf_counter()
        service.predict(features[row : row + 1], uptime[row : row + 1])
        one_vm.append(time.perf_counter() - started)
    latencies = asyncio.run(_sidecar_round_trips(service, features, uptime, rpcs))
    return PredictBench(
        inprocess_us_per_vm=round(inprocess_us, 2),
        inprocess_batch=len(features),
        inprocess_one_vm_us=round(float(np.median(one_vm)) * 1e6, 1),
        sidecar_p50_ms=round(float(np.percentile(latencies, 50)) * 1e3, 3),
        sidecar_p99_ms=round(float(np.percentile(latencies, 99)) * 1e3, 3),
        sidecar_rpcs=len(latencies),
        model=label,
    )


async def _sidecar_round_trips(service, features, uptime, rpcs: int) -> list[float]:
    from services._proto.megha.v1 import predictor_pb2, predictor_pb2_grpc
    from services.common.server import Service, channel

    server = Service(
        "127.0.0.1:0",
        [
            (
                predictor_pb2_grpc.add_PredictorServicer_to_server,
                service,
                predictor_pb2.DESCRIPTOR.services_by_name["Predictor"].full_name,
            )
        ],
    )
    requests = [
        predictor_pb2.PredictLifetimeRequest(
            queries=[
                predictor_pb2.LifetimeQuery(
                    task_id=f"t{i}",
                    features=features[i % len(features)],
                    uptime_s=float(uptime[i % len(uptime)]),
                )
            ]
        )
        for i in range(rpcs + 100)
    ]
    latencies = []
    async with server, channel(f"127.0.0.1:{server.port}") as ch:
        stub = predictor_pb2_grpc.PredictorStub(ch)
        for i, request in enumerate(requests):
            started = time.perf_counter()
            await stub.PredictLifetime(request, timeout=5)
            if i >= 100:  # the first calls set up the connection
                latencies.append(time.perf_counter() - started)
    return latencies


def render_predict(result: PredictBench, as_json: bool) -> str:
    if as_json:
        return json.dumps(asdict(result), indent=2)
    ok = "met" if result.inprocess_us_per_vm <= INPROCESS_TARGET_US else "MISSED"
    ok99 = "met" if result.sidecar_p99_ms <= SIDECAR_P99_TARGET_MS else "MISSED"
    return "\n".join(
        [
            f"model: {result.model}",
            f"in-process: {result.inprocess_us_per_vm:.2f} us per VM in a batch of "
            f"{result.inprocess_batch} (target <= {INPROCESS_TARGET_US:.0f} us: {ok}); "
            f"{result.inprocess_one_vm_us:.1f} us for one VM",
            f"sidecar: p50 {result.sidecar_p50_ms:.3f} ms, p99 {result.sidecar_p99_ms:.3f} ms "
            f"over {result.sidecar_rpcs} one-VM RPCs (target p99 <= "
            f"{SIDECAR_P99_TARGET_MS:.0f} ms: {ok99})",
        ]
    )
