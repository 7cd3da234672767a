"""The predictor sidecar over real gRPC: a server on a loopback port answering
PredictLifetime, FitGpa and ForecastDemand, started as ``megha predictor`` starts it
(ForecastDemand's tests are in test_forecast_service.py)."""

import contextlib
import importlib.util
import socket

import grpc
import numpy as np
import pytest

from services._proto.megha.v1 import predictor_pb2, predictor_pb2_grpc
from services.app.runner import running_predictor
from services.common.config import parse_config
from services.common.server import Service, channel, wait_healthy
from services.predictor.lifetime_model import ModelError
from services.predictor.service import MODEL_ENV, PredictorService

FULL_NAME = predictor_pb2.DESCRIPTOR.services_by_name["Predictor"].full_name
HAS_GPA = importlib.util.find_spec("services.core.gpa") is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(servicer) -> Service:
    return Service(
        "127.0.0.1:0",
        [(predictor_pb2_grpc.add_PredictorServicer_to_server, servicer, FULL_NAME)],
    )


@contextlib.asynccontextmanager
async def stub_of(servicer):
    """A real server on a free loopback port, and a client stub for it."""
    async with serve(servicer) as server, channel(f"127.0.0.1:{server.port}") as ch:
        yield predictor_pb2_grpc.PredictorStub(ch)


def queries(trace, rows, uptimes):
    return [
        predictor_pb2.LifetimeQuery(task_id=f"vm{r}", features=f, uptime_s=u)
        for r, f, u in zip(rows, trace.feature_dicts(np.array(rows)), uptimes, strict=True)
    ]


async def test_megha_predictor_serves_the_model_named_by_the_environment(
    tiny_model_path, train_trace, monkeypatch
):
    monkeypatch.setenv(MODEL_ENV, str(tiny_model_path))
    port = free_port()
    config = parse_config(
        {
            "gms": [{"id": "gm-1", "port": free_port()}],
            "lms": [{"id": "lm-1", "port": free_port()}],
            "predictor": {"port": port},
        }
    )
    async with running_predictor(config):
        await wait_healthy(f"127.0.0.1:{port}", service=FULL_NAME)
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = predictor_pb2_grpc.PredictorStub(ch)
            rows = [0, 1, 2]
            request = predictor_pb2.PredictLifetimeRequest(
                queries=queries(train_trace, rows, [0.0, 3600.0, 36000.0])
            )
            reply = await stub.PredictLifetime(request, timeout=5)
    local = PredictorService(model_path=tiny_model_path).predict(
        train_trace.feature_dicts(np.array(rows)), [0.0, 3600.0, 36000.0]
    )
    assert [p.task_id for p in reply.predictions] == ["vm0", "vm1", "vm2"]
    for p, expected, quantiles, cls in zip(
        reply.predictions,
        local.expected_remaining_s,
        local.quantiles_s,
        local.lifetime_class,
        strict=True,
    ):
        assert p.expected_remaining_s == pytest.approx(expected)
        assert list(p.quantiles) == pytest.approx(quantiles.tolist())
        assert list(p.quantile_levels) == pytest.approx([0.1, 0.5, 0.9])
        assert p.lifetime_class == cls


async def test_big_batches_and_bad_uptime(tiny_model, train_trace):
    async with stub_of(PredictorService(model=tiny_model)) as stub:
        rows = list(range(1000))  # past OFFLOAD_ROWS: predicted off the event loop
        reply = await stub.PredictLifetime(
            predictor_pb2.PredictLifetimeRequest(queries=queries(train_trace, rows, [0.0] * 1000))
        )
        assert [p.task_id for p in reply.predictions] == [f"vm{r}" for r in rows]
        empty = await stub.PredictLifetime(predictor_pb2.PredictLifetimeRequest())
        assert len(empty.predictions) == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            bad = queries(train_trace, [0], [-1.0])
            await stub.PredictLifetime(predictor_pb2.PredictLifetimeRequest(queries=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "uptime_s must be >= 0" in err.value.details()


async def test_without_a_model_the_uptime_prior_answers(monkeypatch):
    monkeypatch.delenv(MODEL_ENV, raising=False)
    async with stub_of(PredictorService()) as stub:
        reply = await stub.PredictLifetime(
            predictor_pb2.PredictLifetimeRequest(
                queries=[
                    predictor_pb2.LifetimeQuery(task_id="a", uptime_s=0.0),
                    predictor_pb2.LifetimeQuery(task_id="b", uptime_s=7200.0),
                ]
            )
        )
    a, b = reply.predictions
    assert a.expected_remaining_s == pytest.approx(7200.0)  # 2 x (1 h + uptime)
    assert b.expected_remaining_s == pytest.approx(21600.0)
    assert a.lifetime_class == predictor_pb2.LIFETIME_CLASS_1H_TO_10H


def test_a_configured_model_that_cannot_load_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(MODEL_ENV, str(tmp_path / "nope.pkl"))
    with pytest.raises(ModelError, match="cannot read lifetime model"):
        PredictorService()


@pytest.mark.skipif(not HAS_GPA, reason="services/core/gpa.py (the GPA math) has not landed yet")
async def test_fit_gpa_over_grpc_matches_the_core_math():
    from services.core.gpa import fits_gpa, overflow_probability

    nodes = [
        predictor_pb2.GpaNode(node_index=i, capacity_milli=4000, sum_mean_milli=m, sum_var_milli2=v)
        for i, (m, v) in enumerate([(500, 1e4), (3000, 4e5), (3900, 1e4), (1000, 9e6)])
    ]
    request = predictor_pb2.FitGpaRequest(
        rho=0.01, task_mean_milli=400, task_std_milli=100, nodes=nodes
    )
    async with stub_of(PredictorService()) as stub:
        reply = await stub.FitGpa(request)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            bad = predictor_pb2.FitGpaRequest(rho=1.5, nodes=nodes)
            await stub.FitGpa(bad)
    args = (
        np.full(4, 4000.0),
        np.array([500.0, 3000, 3900, 1000]),
        np.array([1e4, 4e5, 1e4, 9e6]),
        400.0,
        100.0,
    )
    expected = overflow_probability(*args)
    assert list(reply.overflow_probabilities) == pytest.approx(np.asarray(expected).tolist())
    fits = np.flatnonzero(fits_gpa(*args, 0.01)).tolist()
    assert list(reply.fitting_node_indices) == fits
    assert 0 in fits and 2 not in fits  # room to spare vs. a mean past the capacity
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rho must be in (0, 1)" in err.value.details()
