"""Requests from a GM to an LM expire (a frozen LM must not start what the GM gave up
on); an LM whose clock disagrees with the GM's must not take every request for expired."""

from __future__ import annotations

import logging
import time

import pytest

from services._proto.megha.v1 import common_pb2
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


async def test_an_lm_whose_clock_is_ahead_still_gets_its_launches(monkeypatch, caplog):
    # 10 s ahead, the LM reads every request as expired. Its refusal reaches the GM before
    # the GM gave up, so the GM knows the clocks disagree and stops sending it expiries;
    # before, every task was refused 20 times and then parked.
    monkeypatch.setattr(lm_service, "time", _ClockAhead(10))
    caplog.set_level(logging.ERROR, logger="megha.gm")
    async with embedded_federation("clock-ahead") as (_config, gm, _bus, client):
        reply = await client.submit(sim_tasks(4, 0.1))
        await job_in_state(client, reply.job_id, common_pb2.TASK_STATE_SUCCEEDED, timeout_s=15)
        assert gm._unexpiring == {"lm-1"}
    assert any("clocks disagree" in r.getMessage() for r in caplog.records)
