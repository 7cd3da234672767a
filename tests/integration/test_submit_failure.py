"""A submission the broker did not take: the client is told, and nothing unlaunched runs.

Every service runs in this process on the in-memory bus (as ``megha up --embedded``);
the GM's bus is then closed, so its enqueue fails for real.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from services._proto.megha.v1 import (
    common_pb2,
    global_master_pb2,
    local_master_pb2,
    local_master_pb2_grpc,
)
from services.client import GlobalMasterClient
from services.common.bus import InMemoryBroker, make_bus
from services.common.config import parse_config
from services.common.runner import running_gm, running_lm, running_workers
from services.common.server import channel
from tests.integration.harness import free_ports, sim_tasks

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def federation(prefix: str):
    """One GM, one LM with two workers of 4 CPUs; yields (config, GM, its bus, client)."""
    gm_port, lm_port = free_ports(2)
    config = parse_config(
        {
            "gms": [{"id": "gm-1", "port": gm_port}],
            "lms": [{"id": "lm-1", "port": lm_port}],
            "workers": [{"lm": "lm-1", "count": 2, "capacity": "cpu=4,mem=8Gi"}],
            "heartbeat_interval_s": 0.2,
            "exchange_prefix": prefix,
        },
        env={},
    )
    broker = InMemoryBroker()
    async with (
        make_bus("memory://", broker=broker) as lm_bus,
        running_lm(config, "lm-1", lm_bus),
        running_workers(config, None, None),
        make_bus("memory://", broker=broker) as gm_bus,
        running_gm(config, "gm-1", gm_bus) as gm,
        GlobalMasterClient(config.gm("gm-1").target) as client,
    ):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the GM knows the LM and both workers
            view = await client.cluster()
            if sum(p.node_count for lm in view.lms for p in lm.partitions) == 2:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the GM never saw the workers")
        yield config, gm, gm_bus, client


async def lm_knows(config, task_ids: list[str]) -> list[str]:
    async with channel(config.lm("lm-1").target) as ch:
        stub = local_master_pb2_grpc.LocalMasterStub(ch)
        known = await stub.LookupTasks(
            local_master_pb2.LookupTasksRequest(task_ids=task_ids), timeout=5
        )
    return [t.task_id for t in known.tasks]


async def test_a_job_submitted_while_the_broker_is_unreachable_is_refused_whole():
    async with federation("submit-unreachable") as (config, _gm, gm_bus, client):
        ok = await client.submit(sim_tasks(1, 0.05), job_id="fine")
        assert ok.task_ids == ["fine.0"]

        await gm_bus.close()  # the broker is gone for this GM
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.submit(sim_tasks(1, 0.05), job_id="lost")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "broker is unreachable: job lost was not queued" in refused.value.details()

        # Refused before anything was scheduled: the GM does not know the job at all.
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await client.job("lost")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        await asyncio.sleep(0.3)
        assert await lm_knows(config, ["lost.0", "fine.0"]) == ["fine.0"]


class Aborted(Exception):
    pass


class Context:
    """What SubmitJob uses of grpc's servicer context: ``abort`` raises."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


async def test_a_publish_that_fails_drops_the_tasks_that_had_not_launched():
    async with federation("submit-failure") as (config, gm, gm_bus, client):
        # Both workers full for a second: the next task has to wait in the GM's queue.
        await client.submit(sim_tasks(2, 1.0, cpu_milli=4000), job_id="hog")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            hog = await client.job("hog")
            if all(t.state == common_pb2.TASK_STATE_RUNNING for t in hog.tasks):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the hog tasks never ran")

        # The bus closes while SubmitJob is under way (its task runs at SubmitJob's first
        # yield, after the check that the broker is reachable): the publish then fails.
        closing = asyncio.create_task(gm_bus.close())
        request = global_master_pb2.SubmitJobRequest(job_id="lost", tasks=sim_tasks(1, 0.05))
        with pytest.raises(Aborted) as refused:
            await gm.SubmitJob(request, Context())
        await closing
        code, details = refused.value.args
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "did not confirm job lost" in details

        # It was waiting for room: it is taken out of the queue and shows as rejected at
        # once, and no LM ever books it (not even once the hogs are gone).
        job = await client.job("lost")
        assert job.tasks[0].state == common_pb2.TASK_STATE_REJECTED
        assert gm.queues.pending(job.queue) == 0
        await asyncio.sleep(1.5)
        assert await lm_knows(config, ["lost.0", "hog.0", "hog.1"]) == ["hog.0", "hog.1"]
