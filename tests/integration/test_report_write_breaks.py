"""A worker's final report whose write breaks under it (the LM killed, the connection
reset mid-write: gRPC raises from ``write``) goes out on the next stream.

Found by the chaos suite (lm-kill, seed 1, about one run in two): a task ended on its
worker the instant its LM was killed; the agent had taken the report out of its outbox,
the write raised, and the report was lost with it while the task stayed owed. The next
registration named the task as finished, the restarted LM booked it, and no report ever
came: the task stayed RUNNING on the LM's and the GM's books for good.

Here the LM is a real process; the break is injected in the agent's own stream call, on
the first write that carries a final report (no timing can aim a kill -9 that precisely)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services._proto.megha.v1 import common_pb2
from services.common.server import channel
from services.core.resources import resources
from services.worker.agent import WorkerAgent
from tests.integration.harness import Federation, sim_tasks

pytestmark = pytest.mark.integration

RUNNING = common_pb2.TASK_STATE_RUNNING


class BreakOnFinalReport:
    """The agent's WorkerHeartbeats call, whose first write carrying a final report
    breaks the stream (the call is cancelled, the write raises) instead of being sent."""

    def __init__(self, call: grpc.aio.StreamStreamCall, armed: list[bool]) -> None:
        self._call = call
        self._armed = armed

    async def write(self, beat) -> None:
        if self._armed[0] and any(r.state != RUNNING for r in beat.reports):
            self._armed[0] = False
            self._call.cancel()
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INTERNAL,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details="Internal error from Core (injected: the stream broke mid-write)",
            )
        await self._call.write(beat)

    def __getattr__(self, name: str):
        return getattr(self._call, name)


async def test_a_final_report_whose_write_breaks_is_sent_on_the_next_stream(tmp_path):
    async with (
        Federation(tmp_path, gms=1, lms=1, worker_groups=[]) as fed,
        channel(f"127.0.0.1:{fed.config.lm('lm-1').port}") as lm_channel,
    ):
        agent = WorkerAgent(
            "brk-w0",
            resources(cpu_milli=1000, memory_mb=1024),
            [],
            lm_channel,
            heartbeat_interval_s=0.25,
        )
        armed = [True]
        open_stream = agent._stub.WorkerHeartbeats
        agent._stub.WorkerHeartbeats = lambda: BreakOnFinalReport(open_stream(), armed)
        async with agent:
            await asyncio.wait_for(agent.wait_connected(), 10)
            await asyncio.sleep(1.0)  # the GM sees the node
            reply = await fed.gm().submit(sim_tasks(1, 0.5))
            (task_id,) = reply.task_ids
            began = time.monotonic()
            await fed.events.wait_succeeded({task_id}, timeout_s=15)
            assert not armed[0], "the injected break never happened"
            assert agent.registrations == 2  # it did reconnect: the report went then
            assert fed.events.runs()[task_id] == 1
            assert time.monotonic() - began < 10
