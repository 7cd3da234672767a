"""The agent on its own: what it does while no LM answers. Its conversation with a real
LM is covered by the agent ↔ LM integration tests."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time

import grpc
import numpy as np
import pytest

from services.core.resources import ResourceError, resources
from services.worker.agent import BACKOFF_MAX_S, Backoff, WorkerAgent

CAPACITY = resources(cpu_milli=4000, memory_mb=8192)


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_backoff_doubles_to_the_cap_with_jitter() -> None:
    backoff = Backoff(rng=random.Random(7))
    delays = [backoff.next() for _ in range(8)]
    nominal = [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
    for delay, cap in zip(delays, nominal, strict=True):
        assert cap / 2 <= delay <= cap
    assert len(set(delays)) == len(delays)  # jittered, so agents do not retry in lockstep
    backoff.reset()
    assert backoff.next() <= 0.1


def test_agent_refuses_an_unknown_default_executor() -> None:
    with pytest.raises(ValueError, match="unknown default executor 'k8s'"):
        WorkerAgent("w0", CAPACITY, [], channel=None, default_executor="k8s")  # type: ignore[arg-type]


def test_agent_refuses_a_capacity_without_cpu() -> None:
    with pytest.raises(ResourceError):
        WorkerAgent("w0", np.zeros(4, dtype=np.int64), [], channel=None)  # type: ignore[arg-type]


async def test_agent_keeps_retrying_an_unreachable_lm_and_shuts_down_promptly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="megha.worker")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{closed_port()}") as channel:
        agent = WorkerAgent("w0", CAPACITY, [1], channel)
        runner = asyncio.create_task(agent.run())

        def tries() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.getMessage() == "cannot reach the LM"]

        # Retried with a short backoff, not once and given up (polled, not a fixed
        # sleep: on a busy machine three tries once took longer than 1 s).
        deadline = time.monotonic() + 5
        while len(tries()) < 3:
            assert time.monotonic() < deadline, f"{len(tries())} tries in 5 s"
            await asyncio.sleep(0.05)
        assert not runner.done()  # an absent LM is not fatal: the agent waits for it
        assert not agent.connected
        attempts = tries()
        # One warning per outage; the retries after it log at debug level.
        assert [r.levelno for r in attempts].count(logging.WARNING) == 1

        began = time.monotonic()
        await asyncio.wait_for(agent.shutdown(), 5)
        await asyncio.wait_for(agent.shutdown(), 5)  # idempotent
        await asyncio.wait_for(runner, 1)
        assert time.monotonic() - began < BACKOFF_MAX_S


async def test_agent_context_manager_runs_in_the_background() -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{closed_port()}")
    async with channel, WorkerAgent("w0", CAPACITY, [], channel) as agent:
        await asyncio.sleep(0.2)
        assert agent.running_task_ids == []
        with pytest.raises(RuntimeError, match="already running"):
            await agent.run()


async def test_an_ack_moves_the_contact_to_the_heartbeat_it_names_whatever_the_wall_clock_did():
    agent = WorkerAgent("w0", CAPACITY, [], grpc.aio.insecure_channel("127.0.0.1:1"), fence_s=2.0)
    agent._unacked.extend([(100, 1.0), (50, 2.0), (60, 3.0)])  # the clock stepped back
    agent._acked(50)
    assert agent._contact == 2.0 and list(agent._unacked) == [(60, 3.0)]
    agent._acked(999)  # written on an earlier stream: names none of these
    assert agent._contact == 2.0 and list(agent._unacked) == [(60, 3.0)]
    agent._acked(60)
    assert agent._contact == 3.0 and not agent._unacked


def _sim_task(task_id: str, attempt: int, seconds: float):
    from services._proto.megha.v1 import common_pb2

    task = common_pb2.Task(task_id=task_id, attempt=attempt)
    task.resources.cpu_milli, task.resources.memory_mb = 1000, 256
    task.sim.duration_s = seconds
    return task


async def test_a_start_of_the_next_attempt_waits_for_the_older_one_and_its_kill_spares_it():
    # The LM preempted attempt 0 and granted attempt 1 on this node; the start of 1 came
    # before the kill of 0. Two attempts never run at once, and the kill (which names
    # attempt 0) does not take attempt 1 with it. Before, the start was ignored as a
    # duplicate and the kill removed the task: attempt 1 never ran.

    async with grpc.aio.insecure_channel(f"127.0.0.1:{closed_port()}") as channel:
        await _supersede(WorkerAgent("w0", CAPACITY, [], channel))


async def _supersede(agent: WorkerAgent) -> None:
    from services._proto.megha.v1 import common_pb2

    agent._start(_sim_task("t", 0, 30))
    agent._start(_sim_task("t", 1, 0.2))
    assert [e.task.attempt for e in agent._running.values()] == [0]  # 1 waits
    agent._on_kill("t", 0, "preempted")
    deadline = time.monotonic() + 5
    while not any(
        r.attempt == 1 and r.state == common_pb2.TASK_STATE_SUCCEEDED for r in agent._outbox
    ):
        assert time.monotonic() < deadline, [(r.attempt, r.state) for r in agent._outbox]
        await asyncio.sleep(0.02)
    states = [(r.attempt, common_pb2.TaskState.Name(r.state)) for r in agent._outbox]
    assert states == [
        (0, "TASK_STATE_RUNNING"),
        (0, "TASK_STATE_LOST"),  # ended by the start of its successor, before its kill
        (1, "TASK_STATE_RUNNING"),
        (1, "TASK_STATE_SUCCEEDED"),
    ]
    agent._on_kill("t", 0, "preempted")  # a kill of an attempt that is gone: nothing
    assert not agent._running
