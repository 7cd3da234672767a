"""A worker agent replaces its heartbeat stream every ``worker_stream_life_s`` (gRPC holds
memory per message for a stream's whole life: ``python scripts/probes.py idle-worker``).
A replacement is not a reconnect: no new registration, and no task lost or run twice."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.names import EVENT_EXCHANGE, EVERY_TASK_EVENT
from tests.integration.harness import Events, embedded_federation, sim_tasks

pytestmark = pytest.mark.integration


async def test_streams_replaced_under_load_lose_no_task_and_run_none_twice():
    hosts: list = []
    events = Events()
    async with embedded_federation(
        "stream-life",
        hosts,
        worker_heartbeat_interval_s=0.05,
        worker_stream_life_s=0.3,  # ~10 replacements per agent while the tasks run
        event_batch_s=0.01,
    ) as (_config, _gm, gm_bus, client):
        await gm_bus.subscribe_topic(EVENT_EXCHANGE, EVERY_TASK_EVENT, events.on_batch)
        (host,) = hosts
        opened = [agent.streams for agent in host.agents]
        began = time.monotonic()
        reply = await client.submit(sim_tasks(600, 0.02, cpu_milli=500))
        await events.wait_succeeded(set(reply.task_ids), timeout_s=60)
        took = time.monotonic() - began
        await asyncio.sleep(0.5)  # late duplicates, if any, would show by now
        assert took > 1.0, "over before any stream was replaced: the test proves nothing"
        for agent, first in zip(host.agents, opened, strict=True):
            # At least twice: ~1 s of 0.3 s lives gave one agent only 2 on a busy machine.
            assert agent.streams - first >= 2, "the stream was not replaced"
            assert agent.registrations == 1, "a replacement registered again"
        # The host's one heartbeat call is replaced as often (its node streams move on).
        assert host.link.calls_opened >= 2, "the host's call was not replaced"
        assert max(events.succeeded().values()) == 1
        assert max(events.runs().values()) == 1
