"""A worker cut off from its LM, both alive (a network partition): with ``worker_fence_s``
it kills its task before the LM, after ``worker_timeout_s``, gives the task to another
worker; without it, it still runs the task then (the task runs twice until it is back).

The cut is a TCP proxy between the agent and a real LM process that stops passing bytes
both ways while keeping the connections open, as a partition does."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from services._proto.megha.v1 import common_pb2
from services.common.server import channel
from services.core.resources import resources
from services.worker.agent import WorkerAgent
from tests.integration.harness import Federation, sim_tasks

pytestmark = pytest.mark.integration

TIMEOUT_S = 3.0  # worker_timeout_s of this federation
FENCE_S = 1.5
TASK_S = 8.0


class CuttableLink:
    """A TCP proxy on 127.0.0.1 to ``target_port`` whose link can be cut and healed."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.open = asyncio.Event()
        self.open.set()
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> CuttableLink:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    @property
    def target(self) -> str:
        assert self._server is not None
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.open.wait()
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        for pair in ((reader, up_writer), (up_reader, writer)):
            pump = asyncio.create_task(self._pump(*pair))
            self._pumps.add(pump)
            pump.add_done_callback(self._pumps.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                await self.open.wait()  # cut: held here, the connection stays open
                writer.write(data)
                await writer.drain()
        writer.close()


@pytest.mark.parametrize(
    "fence_s",
    [
        pytest.param(FENCE_S, id="fenced"),
        # The control (what happens without the fence): with the slow suite, for the
        # default suite's budget (~18 s).
        pytest.param(0.0, id="not-fenced", marks=pytest.mark.slow),
    ],
)
async def test_a_worker_cut_off_from_its_lm_kills_its_task_before_it_runs_elsewhere(
    tmp_path, fence_s
):
    groups = [{"lm": "lm-1", "count": 1, "capacity": "cpu=1,mem=1Gi", "name_prefix": "safe-"}]
    async with (
        Federation(tmp_path, gms=1, lms=1, worker_groups=groups, worker_timeout_s=TIMEOUT_S) as fed,
        CuttableLink(fed.config.lm("lm-1").port) as link,
        channel(link.target) as lm_channel,
    ):
        agent = WorkerAgent(
            "cut-w0",
            resources(cpu_milli=1000, memory_mb=1024),
            [],
            lm_channel,
            heartbeat_interval_s=0.25,
            fence_s=fence_s,
        )
        async with agent:
            await asyncio.wait_for(agent.wait_connected(), 10)
            await asyncio.sleep(1.0)  # the GM sees the new node
            reply = await fed.gm().submit(sim_tasks(2, TASK_S))  # one task per node
            deadline = time.monotonic() + 10
            while not agent.running_task_ids:
                assert time.monotonic() < deadline, "no task started on the agent"
                await asyncio.sleep(0.05)
            (task_id,) = agent.running_task_ids

            link.open.clear()
            cut = time.monotonic()
            killed_at = lost_at = None
            running_when_lost = False
            while lost_at is None:
                assert time.monotonic() - cut < TIMEOUT_S + 5, "the LM never took it for lost"
                now = time.monotonic() - cut
                if killed_at is None and task_id not in agent.running_task_ids:
                    killed_at = now
                if fed.events.states(common_pb2.TASK_STATE_LOST)[task_id]:
                    lost_at = now
                    running_when_lost = task_id in agent.running_task_ids
                await asyncio.sleep(0.02)
            link.open.set()

            if fence_s:
                # Counted from its last heartbeat the LM acked (acks come every 0.5 s at
                # most, heartbeats every 0.25 s), so up to ~0.75 s before the cut.
                assert killed_at is not None and fence_s - 1.0 <= killed_at < lost_at
                assert not running_when_lost and agent.fenced == 1
            else:  # what fencing prevents: the LM gives it away while it runs here
                assert killed_at is None and running_when_lost and agent.fenced == 0
            # Back in touch, it registers again; the task ends once, as attempt 1.
            await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=3 * TASK_S)
            assert max(fed.events.succeeded().values()) == 1
            assert agent.registrations == 2
