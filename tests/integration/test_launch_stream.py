"""The GM's launch stream against a real LM server: pairing, and an LM that goes away."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from services._proto.megha.v1 import common_pb2, local_master_pb2, local_master_pb2_grpc
from services.app.runner import running_lm
from services.common.bus import make_bus
from services.common.config import parse_config
from services.common.convert import resources_to_proto
from services.common.request_stream import Launcher
from services.common.server import channel
from services.core.resources import resources
from tests.integration.harness import free_ports

pytestmark = pytest.mark.integration

NODE = resources(cpu_milli=64_000, memory_mb=64_000)


def config():
    (port,) = free_ports(1)
    data = {
        "gms": [{"id": "gm-1", "port": 1}],
        "lms": [{"id": "lm-1", "port": port}],
        "workers": [],
        "exchange_prefix": "launch-stream-test",
    }
    return parse_config(data, env={})


def launch_of(task_id: str, cpu_milli: int = 1000) -> local_master_pb2.LaunchRequest:
    task = common_pb2.Task(
        task_id=task_id,
        job_id="j",
        queue="default",
        resources=resources_to_proto(resources(cpu_milli, 10)),
    )
    task.sim.duration_s = 1.0
    return local_master_pb2.LaunchRequest(
        gm_id="gm-1", placements=[local_master_pb2.Placement(task=task, node_index=0)]
    )


async def register(stub) -> None:
    await stub.RegisterWorker(
        local_master_pb2.RegisterWorkerRequest(node_id="w0", capacity=resources_to_proto(NODE)),
        timeout=10,
        wait_for_ready=True,  # after a restart the channel may still be backing off
    )


@contextlib.asynccontextmanager
async def launcher_to_lm():
    """A config, a stub and a Launcher for an LM at the config's address (not started)."""
    cfg = config()
    async with channel(cfg.lm("lm-1").target) as ch:
        stub = local_master_pb2_grpc.LocalMasterStub(ch)
        launcher = Launcher(stub)
        try:
            yield cfg, stub, launcher
        finally:
            await launcher.close()


async def test_concurrent_launches_each_get_their_own_answer_and_a_gone_lm_fails_them_fast():
    async with launcher_to_lm() as (cfg, stub, launcher):
        async with make_bus("memory://", prefix="t") as bus, running_lm(cfg, "lm-1", bus):
            await register(stub)
            # 64 fit on the node (1 CPU each), the rest are refused: every reply must
            # belong to its own request.
            ids = [f"t{i}" for i in range(80)]
            replies = await asyncio.gather(
                *(launcher.launch(launch_of(i), timeout=10) for i in ids)
            )
            assert [r.results[0].task_id for r in replies] == ids
            accepted = [r for r in replies if r.results[0].status == 1]
            assert len(accepted) == 64
            assert all(r.HasField("state") for r in replies if r.results[0].status != 1)
        # The LM is gone: a launch fails as a unary call would, without hanging.
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await launcher.launch(launch_of("late"), timeout=5)
        assert failed.value.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        # A new LM on the same address: the next launch opens a new stream.
        async with make_bus("memory://", prefix="t") as bus, running_lm(cfg, "lm-1", bus):
            await register(stub)
            for _ in range(50):
                try:
                    reply = await launcher.launch(launch_of("again"), timeout=5)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)  # the channel is still reconnecting
            else:
                raise AssertionError("the launcher never reached the restarted LM")
            assert reply.results[0].task_id == "again" and reply.results[0].status == 1


async def test_a_malformed_task_on_the_stream_is_refused_alone_and_the_stream_goes_on():
    async with (
        launcher_to_lm() as (cfg, stub, launcher),
        make_bus("memory://", prefix="t") as bus,
        running_lm(cfg, "lm-1", bus),
    ):
        await register(stub)
        request = launch_of("fine")
        bad = request.placements.add(task=launch_of("bad").placements[0].task)
        bad.task.constraints.append(cfg.num_constraints + 5)  # no such constraint
        reply = await launcher.launch(request, timeout=10)
        assert [(r.task_id, r.status) for r in reply.results] == [
            ("fine", local_master_pb2.PLACEMENT_STATUS_ACCEPTED),
            ("bad", local_master_pb2.PLACEMENT_STATUS_REJECTED_INVALID),
        ]
        assert "task bad:" in reply.results[1].reason
        again = await launcher.launch(launch_of("next"), timeout=10)
        assert again.results[0].status == local_master_pb2.PLACEMENT_STATUS_ACCEPTED
        # The unary call still fails whole and places nothing.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            bad_only = launch_of("bad2")
            bad_only.placements[0].task.constraints.append(cfg.num_constraints + 5)
            both = local_master_pb2.LaunchRequest(
                gm_id="gm-1",
                placements=[launch_of("ok2").placements[0], bad_only.placements[0]],
            )
            await stub.Launch(both, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        known = await stub.LookupTasks(
            local_master_pb2.LookupTasksRequest(task_ids=["ok2", "bad", "fine"]),
            timeout=5,
        )
        assert [t.task_id for t in known.tasks] == ["fine"]


async def test_launches_and_repartitions_go_as_one_request_each_placed_as_it_is_marked():
    cfg = parse_config(
        {
            "gms": [{"id": "gm-1", "port": 1}, {"id": "gm-2", "port": 2}],
            "lms": [{"id": "lm-1", "port": free_ports(1)[0]}],
            "workers": [],
            "exchange_prefix": "launch-stream-test",
        },
        env={},
    )
    async with (
        channel(cfg.lm("lm-1").target) as ch,
        make_bus("memory://", prefix="t") as bus,
        running_lm(cfg, "lm-1", bus),
    ):
        stub = local_master_pb2_grpc.LocalMasterStub(ch)
        launcher = Launcher(stub)
        try:
            for name in ("w0", "w1"):
                await stub.RegisterWorker(
                    local_master_pb2.RegisterWorkerRequest(
                        node_id=name, capacity=resources_to_proto(NODE)
                    ),
                    timeout=10,
                    wait_for_ready=True,
                )
            state = (await stub.GetState(local_master_pb2.GetStateRequest(), timeout=5)).state
            mine = list(state.gm_ids).index("gm-1")
            own = next(n.index for n in state.nodes if n.partition == mine)
            other = next(n.index for n in state.nodes if n.partition != mine)

            def placement(task_id: str, node: int, repartition: bool):
                p = launch_of(task_id).placements[0]
                return local_master_pb2.Placement(
                    task=p.task, node_index=node, repartition=repartition
                )

            request = local_master_pb2.LaunchRequest(
                gm_id="gm-1",
                placements=[
                    placement("launch", own, False),
                    placement("unmarked", other, False),  # another GM's node, as a launch
                    placement("marked", other, True),
                ],
            )
            reply = await launcher.launch(request, timeout=10)
            assert [(r.task_id, r.status) for r in reply.results] == [
                ("launch", local_master_pb2.PLACEMENT_STATUS_ACCEPTED),
                ("unmarked", local_master_pb2.PLACEMENT_STATUS_REJECTED_WRONG_PARTITION),
                ("marked", local_master_pb2.PLACEMENT_STATUS_ACCEPTED),
            ]
            after = (await stub.GetState(local_master_pb2.GetStateRequest(), timeout=5)).state
            held = {a.task_id: a for a in after.allocations}
            assert set(held) == {"launch", "marked"}
            assert held["marked"].logical and not held["launch"].logical  # carved out
        finally:
            await launcher.close()
