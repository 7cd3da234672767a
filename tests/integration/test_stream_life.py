"""A worker agent replaces its heartbeat stream every ``worker_stream_life_s`` (gRPC holds
memory per message for a stream's whole life: ``python scripts/probes.py idle-worker``).
A replacement is not a reconnect: no new registration, and no task lost or run twice."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.client import GlobalMasterClient
from services.common.bus import InMemoryBroker, make_bus
from services.common.config import parse_config
from services.common.runner import running_gm, running_lm
from services.local_master.service import EVENT_EXCHANGE
from services.worker.host import WorkerHost
from tests.integration.harness import Events, free_ports, sim_tasks

pytestmark = pytest.mark.integration


async def test_streams_replaced_under_load_lose_no_task_and_run_none_twice():
    gm_port, lm_port = free_ports(2)
    config = parse_config(
        {
            "gms": [{"id": "gm-1", "port": gm_port}],
            "lms": [{"id": "lm-1", "port": lm_port}],
            "workers": [{"lm": "lm-1", "count": 2, "capacity": "cpu=4,mem=8Gi"}],
            "heartbeat_interval_s": 0.2,
            "worker_heartbeat_interval_s": 0.05,
            "worker_stream_life_s": 0.3,  # ~10 replacements per agent while the tasks run
            "event_batch_s": 0.01,
            "exchange_prefix": "stream-life",
        },
        env={},
    )
    broker, events = InMemoryBroker(), Events()
    async with (
        make_bus("memory://", broker=broker) as lm_bus,
        running_lm(config, "lm-1", lm_bus),
        WorkerHost(config, config.workers[0]) as host,
        make_bus("memory://", broker=broker) as gm_bus,
        running_gm(config, "gm-1", gm_bus),
        GlobalMasterClient(config.gm("gm-1").target) as client,
    ):
        await gm_bus.subscribe_topic(EVENT_EXCHANGE, "task.#", events.on_batch)
        await host.wait_connected()
        deadline = time.monotonic() + 20
        while sum(p.node_count for lm in (await client.cluster()).lms for p in lm.partitions) < 2:
            assert time.monotonic() < deadline, "the GM never saw the workers"
            await asyncio.sleep(0.05)
        opened = [agent.streams for agent in host.agents]
        began = time.monotonic()
        reply = await client.submit(sim_tasks(600, 0.02, cpu_milli=500))
        await events.wait_succeeded(set(reply.task_ids), timeout_s=60)
        took = time.monotonic() - began
        await asyncio.sleep(0.5)  # late duplicates, if any, would show by now
        assert took > 1.0, "over before any stream was replaced: the test proves nothing"
        for agent, first in zip(host.agents, opened, strict=True):
            assert agent.streams - first >= 3, "the stream was not replaced"
            assert agent.registrations == 1, "a replacement registered again"
        assert max(events.succeeded().values()) == 1
        assert max(events.runs().values()) == 1
