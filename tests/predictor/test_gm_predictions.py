"""The GM's client of the sidecar (services/global_master/predictions.py) against a real
gRPC server on loopback: predictions land on the tasks, a dead sidecar costs one failed
call per back-off window, and a sidecar that comes back is used again."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from services._proto.megha.v1 import common_pb2, predictor_pb2, predictor_pb2_grpc
from services.common.server import Service
from services.global_master.predictions import LifetimePredictions
from services.predictor.service import PredictorService

FULL_NAME = predictor_pb2.DESCRIPTOR.services_by_name["Predictor"].full_name


def server(port: int = 0) -> Service:
    servicer = PredictorService()  # the features-blind prior: E[lifetime] = 2 h at uptime 0
    return Service(
        f"127.0.0.1:{port}",
        [(predictor_pb2_grpc.add_PredictorServicer_to_server, servicer, FULL_NAME)],
    )


def tasks(with_features: int, without: int = 0) -> list[common_pb2.Task]:
    out = []
    for i in range(with_features + without):
        task = common_pb2.Task(task_id=f"t{i}", predicted_lifetime_s=123.0)
        if i < with_features:
            task.lifetime_features["user"] = "u001"
        out.append(task)
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_one_batched_call_sets_the_prediction_on_tasks_with_features():
    async with server() as srv:
        client = LifetimePredictions("gm-t", f"127.0.0.1:{srv.port}")
        batch = tasks(3, without=2)
        assert await client.annotate(batch) == 3
        np.testing.assert_allclose([t.predicted_lifetime_s for t in batch[:3]], 7200.0)
        # No features: no prediction, and a client's own value does not survive.
        assert [t.predicted_lifetime_s for t in batch[3:]] == [0.0, 0.0]
        await client.close()


async def test_no_predictor_configured_never_calls():
    client = LifetimePredictions("gm-t", None)
    batch = tasks(2)
    assert await client.annotate(batch) == 0
    assert [t.predicted_lifetime_s for t in batch] == [0.0, 0.0]


async def test_a_dead_sidecar_is_logged_once_skipped_while_backing_off_then_used_again(caplog):
    probe = server()
    await probe.start()
    port = probe.port
    await probe.stop()  # nothing listens on the port now
    clock = Clock()
    client = LifetimePredictions("gm-t", f"127.0.0.1:{port}", retry_after_s=5.0, clock=clock)
    caplog.set_level(logging.INFO, logger="megha.gm")
    started = time.perf_counter()
    for _ in range(3):
        batch = tasks(2)
        assert await client.annotate(batch) == 0
        assert [t.predicted_lifetime_s for t in batch] == [0.0, 0.0]
    assert time.perf_counter() - started < 1.0  # one failed call (<= timeout), two skips
    down = [r for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(down) == 1

    async with server(port):
        clock.now = 5.1  # the back-off has passed: the next submission asks again
        batch = tasks(2)
        for _ in range(40):  # gRPC waits out its reconnect back-off (<= 5 s) first
            if await client.annotate(batch):
                break
            clock.now += 5.1
            await asyncio.sleep(0.25)
        assert [t.predicted_lifetime_s for t in batch] == [7200.0, 7200.0]
        assert any("answers again" in r.getMessage() for r in caplog.records)
    await client.close()
