"""A submission the broker did not take: the client is told, and nothing of it runs.

Every service runs in this process on the in-memory bus (as ``megha up --embedded``);
the GM's bus is then closed, so its enqueue fails for real.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services._proto.megha.v1 import common_pb2, local_master_pb2, local_master_pb2_grpc
from services.client import GlobalMasterClient
from services.common.bus import InMemoryBroker, make_bus
from services.common.config import parse_config
from services.common.runner import running_gm, running_lm, running_workers
from services.common.server import channel
from tests.integration.harness import free_ports, sim_tasks

pytestmark = pytest.mark.integration


async def test_a_job_the_broker_did_not_confirm_is_refused_and_never_runs():
    gm_port, lm_port = free_ports(2)
    config = parse_config(
        {
            "gms": [{"id": "gm-1", "port": gm_port}],
            "lms": [{"id": "lm-1", "port": lm_port}],
            "workers": [{"lm": "lm-1", "count": 2, "capacity": "cpu=4,mem=8Gi"}],
            "heartbeat_interval_s": 0.2,
            "exchange_prefix": "submit-failure",
        },
        env={},
    )
    broker = InMemoryBroker()
    async with (
        make_bus("memory://", broker=broker) as lm_bus,
        running_lm(config, "lm-1", lm_bus),
        running_workers(config, None, None),
        make_bus("memory://", broker=broker) as gm_bus,
        running_gm(config, "gm-1", gm_bus),
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
        ok = await client.submit(sim_tasks(1, 0.05), job_id="fine")
        assert ok.task_ids == ["fine.0"]

        await gm_bus.close()  # the broker is gone for this GM
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.submit(sim_tasks(1, 0.05), job_id="lost")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "did not confirm job lost" in refused.value.details()

        # The task was queued in memory before the enqueue failed: it is dropped, shown
        # as rejected, and no LM ever books it.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            job = await client.job("lost")
            if job.tasks[0].state == common_pb2.TASK_STATE_REJECTED:
                break
            await asyncio.sleep(0.05)
        assert job.tasks[0].state == common_pb2.TASK_STATE_REJECTED
        async with channel(config.lm("lm-1").target) as ch:
            stub = local_master_pb2_grpc.LocalMasterStub(ch)
            known = await stub.LookupTasks(
                local_master_pb2.LookupTasksRequest(task_ids=["lost.0", "fine.0"]), timeout=5
            )
        assert [t.task_id for t in known.tasks] == ["fine.0"]
