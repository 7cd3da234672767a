"""Requests from a GM to an LM expire, but only as a fallback: a late request is made
harmless by fencing (tests/integration/test_fencing.py), not by trusting clocks. An LM
whose clock is ahead within the margin gets its launches; far ahead, every request is
refused, the GM says why, and it never stops sending expiries (before, one early refusal,
as a merely late delivery also gives, turned expiries off for that LM for good)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from services._proto.megha.v1 import common_pb2
from services.global_master.service import LM_ACCEPT_S
from services.local_master import service as lm_service
from tests.integration.harness import embedded_federation, job_in_state, sim_tasks

pytestmark = pytest.mark.integration


class _ClockAhead:
    """The ``time`` module as a host whose wall clock is ``by_s`` ahead sees it."""

    def __init__(self, by_s: float):
        self._by = int(by_s * 1e9)

    def time_ns(self) -> int:
        return time.time_ns() + self._by

    def __getattr__(self, name: str):
        return getattr(time, name)


async def test_an_lm_whose_clock_is_ahead_within_the_margin_gets_its_launches(monkeypatch):
    monkeypatch.setattr(lm_service, "time", _ClockAhead(LM_ACCEPT_S / 3))
    async with embedded_federation("clock-ahead") as (_config, _gm, _bus, client):
        reply = await client.submit(sim_tasks(4, 0.1))
        await job_in_state(client, reply.job_id, common_pb2.TASK_STATE_SUCCEEDED, timeout_s=15)


async def test_an_lm_whose_clock_is_far_ahead_refuses_and_the_gm_says_why(monkeypatch, caplog):
    monkeypatch.setattr(lm_service, "time", _ClockAhead(LM_ACCEPT_S + 30))
    caplog.set_level(logging.ERROR, logger="megha.gm")
    async with embedded_federation("clock-far-ahead") as (_config, gm, _bus, client):
        reply = await client.submit(sim_tasks(2, 0.1))
        for _ in range(100):
            job = await client.job(reply.job_id)
            if any("expired" in t.pending_reason for t in job.tasks):
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the parked tasks do not say why they wait")
        assert all(t.state == common_pb2.TASK_STATE_QUEUED for t in job.tasks)
        gm.queues.unpark()  # what a new heartbeat does: still refused, still expiring
        await asyncio.sleep(0.5)
    assert any("sync the clocks" in r.getMessage() for r in caplog.records)
