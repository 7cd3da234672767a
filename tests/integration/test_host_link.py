"""A worker host's nodes share one heartbeat call (``HostHeartbeats``): each node stream on
it is served by the LM as a ``WorkerHeartbeats`` call, and the host's idle heartbeats go
out together. The LM is real (in this process, on the in-memory bus); the first test
plays the host on a raw call, the second runs a real ``WorkerHost``."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services._proto.megha.v1 import common_pb2, local_master_pb2
from services.app.runner import running_lm
from services.common.bus import InMemoryBroker, make_bus
from services.common.config import parse_config
from services.worker.host import WorkerHost
from tests.integration.harness import free_ports, lm_alone, register_worker

pytestmark = pytest.mark.integration


def _config(workers: int = 2, interval_s: float = 0.2):
    return parse_config(
        {
            "gms": [{"id": "gm-1", "port": free_ports(1)[0]}],
            "lms": [{"id": "lm-1", "port": free_ports(1)[0]}],
            "workers": [{"lm": "lm-1", "count": workers, "capacity": "cpu=2,mem=4Gi"}],
            "queues": [{"name": "q", "gm": "gm-1"}],
            "heartbeat_interval_s": 0.2,
            "worker_heartbeat_interval_s": interval_s,
            "event_batch_s": 0.01,
        },
        env={},
    )


def _task(task_id: str) -> common_pb2.Task:
    task = common_pb2.Task(task_id=task_id, job_id=f"job-{task_id}", queue="q", lease=1)
    task.resources.cpu_milli, task.resources.memory_mb = 1000, 256
    task.sim.duration_s = 30
    return task


async def _commands(call, want: int) -> list[local_master_pb2.NodeCommand]:
    got: list[local_master_pb2.NodeCommand] = []
    async with asyncio.timeout(5):
        while len(got) < want:
            got.extend((await call.read()).commands)
    return got


async def test_node_streams_on_one_call_are_served_as_worker_streams_each():
    """Two registered nodes and one stranger on one call: the stranger's stream alone is
    ended with the status WorkerHeartbeats gives it, the nodes get their starts on their
    own streams, and a node that ends its stream gets the clean end of a call."""
    config = _config()
    async with lm_alone(config) as lm:
        nodes = {name: await register_worker(lm, name) for name in ("w-0", "w-1")}

        def beat(stream: int, name: str, index: int) -> local_master_pb2.NodeHeartbeat:
            heartbeat = local_master_pb2.WorkerHeartbeat(
                node_id=name, node_index=index, sent_unix_nanos=time.time_ns()
            )
            return local_master_pb2.NodeHeartbeat(stream=stream, heartbeat=heartbeat)

        call = lm.HostHeartbeats()
        first = [beat(1, "w-0", nodes["w-0"]), beat(2, "w-1", nodes["w-1"]), beat(3, "x", 99)]
        await call.write(local_master_pb2.HostHeartbeatsRequest(heartbeats=first))
        (refused,) = await _commands(call, 1)
        assert (refused.stream, refused.end) == (3, True)
        assert refused.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert refused.details == "register first"

        placements = [
            local_master_pb2.Placement(task=_task(f"t{i}"), node_index=nodes[f"w-{i}"])
            for i in (0, 1)
        ]
        reply = await lm.Launch(
            local_master_pb2.LaunchRequest(gm_id="gm-1", placements=placements), timeout=5
        )
        assert {r.status for r in reply.results} == {local_master_pb2.PLACEMENT_STATUS_ACCEPTED}
        started = {}
        for command in await _commands(call, 2):
            tasks = command.command.starts.tasks or [command.command.start.task]
            started[command.stream] = [t.task_id for t in tasks]
        assert started == {1: ["t0"], 2: ["t1"]}

        end = local_master_pb2.NodeHeartbeat(stream=1, end=True)
        await call.write(local_master_pb2.HostHeartbeatsRequest(heartbeats=[end]))
        (ended,) = await _commands(call, 1)
        assert (ended.stream, ended.end, ended.code) == (1, True, 0)
        call.cancel()


async def test_a_hosts_idle_nodes_heartbeat_together_on_one_call():
    """40 idle nodes heartbeating every 0.1 s: on their own streams each heartbeat was a
    message (400 a second); on the host's call they go out together, on its one clock."""
    config = _config(workers=40, interval_s=0.1)
    async with (
        make_bus("memory://", broker=InMemoryBroker()) as bus,
        running_lm(config, "lm-1", bus),
    ):
        host = WorkerHost(config, config.workers[0])
        async with host:
            await asyncio.wait_for(host.wait_connected(), 20)
            link = host.link
            assert link is not None
            await asyncio.sleep(0.5)  # every agent past its first, resync heartbeat
            messages, beats = link.messages_written, link.heartbeats_written
            await asyncio.sleep(1.0)
            messages, beats = link.messages_written - messages, link.heartbeats_written - beats
            assert beats >= 40 * 5, "the nodes did not heartbeat"
            # Ten ticks a second; a report or a late wake-up may take a message of its own.
            assert messages <= beats / 10, (messages, beats)
            assert link.calls_opened == 1
            assert all(agent.registrations == 1 for agent in host.agents)
