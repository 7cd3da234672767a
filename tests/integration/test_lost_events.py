"""A task's end must reach its job even when its event does not: a broker restart drops
what is published meanwhile, and an LM that dies takes its unpublished events along.
GMs then learn the end from the LM (LookupTasks) instead of showing RUNNING for ever."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from services._proto.megha.v1 import common_pb2
from services.common.names import EVENT_EXCHANGE, EVERY_TASK_EVENT
from tests.integration.harness import (
    Federation,
    broker_ctl,
    embedded_federation,
    job_in_state,
    sim_tasks,
)

pytestmark = pytest.mark.integration

RUNNING = common_pb2.TASK_STATE_RUNNING
SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED


async def test_a_gm_that_missed_the_ends_learns_them_from_the_lm():
    async with embedded_federation("lost-events") as (_config, gm, gm_bus, client):
        await client.submit(sim_tasks(4, 0.5), job_id="unheard")
        await job_in_state(client, "unheard", RUNNING, timeout_s=10)
        # The GM's event queue goes away (as in a broker restart) while the tasks end.
        subs = gm._subscriptions
        (events,) = [s for s in subs if getattr(s, "binding_key", "") == EVERY_TASK_EVENT]
        await events.cancel()
        await asyncio.sleep(1.5)
        assert {t.state for t in (await client.job("unheard")).tasks} == {RUNNING}
        gm._subscriptions.append(
            await gm_bus.subscribe_topic(EVENT_EXCHANGE, EVERY_TASK_EVENT, gm._on_events)
        )
        job = await job_in_state(client, "unheard", SUCCEEDED, timeout_s=15)
        assert all(t.lm_id == "lm-1" and t.node_id for t in job.tasks)
        assert not gm.jobs.open


async def test_a_task_whose_every_event_was_lost_still_ends_in_its_job():
    """Its PLACED, RUNNING and SUCCEEDED events all lost (it ran within a broker
    restart): the GM's book, told only QUEUED, must still name the LM that accepted it,
    or no one ever asks how it ended and its job never ends."""
    async with embedded_federation("all-events-lost") as (_config, gm, _gm_bus, client):
        (events,) = [
            s for s in gm._subscriptions if getattr(s, "binding_key", "") == EVERY_TASK_EVENT
        ]
        await events.cancel()
        await client.submit(sim_tasks(4, 0.2), job_id="unheard")
        job = await job_in_state(client, "unheard", SUCCEEDED, timeout_s=20)
        assert all(t.lm_id == "lm-1" for t in job.tasks)
        assert not gm.jobs.open


@pytest.mark.slow  # ~19 s: run apart by .ci/run (MEGHA_SLOW_TESTS=1), the default's budget
@pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl")
async def test_a_broker_restart_mid_run_loses_no_task_end(tmp_path):
    async with Federation(tmp_path, gms=2, lms=2, workers_per_lm=4) as fed:
        jobs = []
        for gm in ("gm-1", "gm-2"):
            for _ in range(2):
                reply = await fed.gm(gm).submit(sim_tasks(12, 2.0))
                jobs.append((gm, reply.job_id))
        await asyncio.sleep(1.0)  # some run, some wait
        try:
            broker_ctl("stop_app")
            await asyncio.sleep(2.0)  # tasks end while nobody can hear of it
        finally:
            broker_ctl("start_app")
        deadline = time.monotonic() + 60
        for gm, job_id in jobs:
            while True:
                try:
                    job = await fed.gm(gm).job(job_id)
                except Exception:  # the GM may still be reconnecting
                    job = None
                if job is not None and {t.state for t in job.tasks} == {SUCCEEDED}:
                    break
                assert time.monotonic() < deadline, f"{job_id} never ended: {job}"
                await asyncio.sleep(0.5)
        await fed.assert_books_balanced()
