"""Registration sanity (issue #31, item 6), against a real LM server: a worker may not
advertise more than a node may have, a worker host does not advertise more than its
machine, and a node that stays lost is forgotten, so GMs stop listing it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import grpc
import pytest

from services._proto.megha.v1 import common_pb2, local_master_pb2, local_master_pb2_grpc
from services.app.runner import running_gm, running_lm, running_workers
from services.common.bus import InMemoryBroker, make_bus
from services.common.client import GlobalMasterClient
from services.common.config import parse_config
from services.common.convert import resources_to_proto
from services.common.server import channel
from services.core.resources import resources
from tests.integration.harness import free_ports

pytestmark = pytest.mark.integration


def config(**overrides):
    gm_port, lm_port = free_ports(2)
    data = {
        "gms": [{"id": "gm-1", "port": gm_port}],
        "lms": [{"id": "lm-1", "port": lm_port}],
        "workers": [],
        "heartbeat_interval_s": 0.2,
        "exchange_prefix": "registration-test",
        **overrides,
    }
    return parse_config(data, env={})


@contextlib.asynccontextmanager
async def lm_stub(cfg):
    """A real LM server of ``cfg`` (in-memory bus) and a stub to it."""
    async with (
        make_bus("memory://", prefix="t") as bus,
        running_lm(cfg, "lm-1", bus) as lm,
        channel(cfg.lm("lm-1").target) as ch,
    ):
        yield lm, local_master_pb2_grpc.LocalMasterStub(ch)


async def register(stub, node_id: str, **capacity: int):
    request = local_master_pb2.RegisterWorkerRequest(
        node_id=node_id, capacity=resources_to_proto(resources(**capacity))
    )
    return await stub.RegisterWorker(request, timeout=10, wait_for_ready=True)


async def listed(stub) -> dict[str, common_pb2.NodeState]:
    """The nodes of the LM's full state, by id."""
    reply = await stub.GetState(local_master_pb2.GetStateRequest(), timeout=10)
    return {n.node_id: n for n in reply.state.nodes}


async def test_a_worker_claiming_2_to_the_40_cpus_is_refused_naming_the_field_and_bound():
    async with lm_stub(config()) as (_lm, stub):
        for cpu_milli in (1 << 40, (1 << 40) * 1000):  # 2**40 millicores, 2**40 cores
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await register(stub, "forged", cpu_milli=cpu_milli, memory_mb=1024)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = refused.value.details()
            assert f"cpu_milli={cpu_milli}" in details
            assert "above the bound 1024000 (cpu=1024)" in details
            assert "max_node_capacity" in details
        # Each field is bounded, and nothing of the refused worker is booked.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await register(stub, "forged", cpu_milli=4000, memory_mb=17 << 20)  # 17 TiB
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "memory_mb=17825792 is above the bound 16777216" in refused.value.details()
        assert await listed(stub) == {}
        # A node within the bound registers as before.
        assert (await register(stub, "w0", cpu_milli=4000, memory_mb=8192)).node_index == 0
        assert list(await listed(stub)) == ["w0"]


async def test_the_bound_is_per_lm_and_nonsense_is_refused_too():
    cfg = config(max_node_capacity="cpu=64")
    lms = [{**cfg.lms[0].model_dump(), "max_node_capacity": "cpu=8,mem=32Gi"}]
    cfg = cfg.model_copy(update={"lms": [cfg.lms[0].model_validate(lms[0])]})
    async with lm_stub(cfg) as (_lm, stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await register(stub, "big", cpu_milli=16_000, memory_mb=1024)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cpu_milli=16000 is above the bound 8000 (cpu=8)" in refused.value.details()
        for bad in ({"cpu_milli": -1, "memory_mb": 1024}, {"cpu_milli": 0, "memory_mb": 1024}):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await register(stub, "bad", **bad)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await register(stub, "ok", cpu_milli=8000, memory_mb=32 << 10)
        assert list(await listed(stub)) == ["ok"]


def real_cpu_milli() -> int:
    return len(os.sched_getaffinity(0)) * 1000


def physical_memory_mb() -> int:
    with open("/proc/meminfo") as meminfo:
        kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    return kib >> 10


async def test_a_process_worker_host_advertises_no_more_than_its_machine(caplog):
    cores = real_cpu_milli() // 1000 + 100  # far more than this machine has
    group = {"lm": "lm-1", "count": 1, "capacity": f"cpu={cores},mem=8Ti"}
    cfg = config(
        workers=[
            {**group, "executor": "process", "name_prefix": "real-"},
            {**group, "executor": "process", "name_prefix": "asked-", "capacity_beyond_host": True},
            {**group, "executor": "sim", "name_prefix": "sim-"},
        ]
    )
    caplog.set_level(logging.WARNING, "megha.worker")
    async with lm_stub(cfg) as (_lm, stub), running_workers(cfg, "lm-1", None) as hosts:
        for host in hosts:
            await asyncio.wait_for(host.wait_connected(), 10)
        nodes = await listed(stub)
    real = nodes["real-0"].capacity
    assert real.cpu_milli == real_cpu_milli()
    assert 0 < real.memory_mb <= physical_memory_mb()
    assert nodes["asked-0"].capacity.cpu_milli == cores * 1000  # the explicit override
    assert nodes["asked-0"].capacity.memory_mb == 8 << 20
    assert nodes["sim-0"].capacity.cpu_milli == cores * 1000  # sim nodes run nothing real
    assert "capacity cut down to this machine's" in caplog.text


async def test_a_node_lost_for_forget_lost_after_s_is_forgotten_and_may_register_again():
    cfg = config(
        workers=[{"lm": "lm-1", "count": 1, "capacity": "cpu=4,mem=8Gi"}],
        worker_timeout_s=0.5,
        forget_lost_after_s=1.5,
        full_state_every=1000,  # GMs follow by deltas: the forgetting must travel in one
    )
    broker = InMemoryBroker()
    async with (
        make_bus("memory://", broker=broker) as lm_bus,
        running_lm(cfg, "lm-1", lm_bus),
        make_bus("memory://", broker=broker) as gm_bus,
        running_gm(cfg, "gm-1", gm_bus),
        GlobalMasterClient(cfg.gm("gm-1").target) as gm,
        running_workers(cfg, "lm-1", None) as hosts,
        channel(cfg.lm("lm-1").target) as ch,
    ):
        stub = local_master_pb2_grpc.LocalMasterStub(ch)
        await asyncio.wait_for(hosts[0].wait_connected(), 10)
        # A worker that registers and is never heard from again (no heartbeat stream).
        ghost = (await register(stub, "ghost", cpu_milli=2000, memory_mb=1024)).node_index

        async def gm_nodes() -> int:
            view = await gm.cluster()
            return sum(p.node_count for lm in view.lms for p in lm.partitions)

        async def until(check, timeout_s: float) -> float:
            began = time.monotonic()
            while not await check():
                assert time.monotonic() - began < timeout_s, "timed out"
                await asyncio.sleep(0.05)
            return time.monotonic() - began

        await until(lambda: _eq(gm_nodes(), 2), 5)
        # Lost after worker_timeout_s, and listed dead for a while ...
        await until(lambda: _health(stub, "ghost", common_pb2.NODE_HEALTH_DEAD), 5)
        lost_at = time.monotonic()
        assert (await gm_nodes()) == 2
        # ... then forgotten: gone from the LM's state and, by a delta, from the GM's view.
        await until(lambda: _gone(stub, "ghost"), 5)
        assert time.monotonic() - lost_at >= 1.0  # not before forget_lost_after_s (less a tick)
        await until(lambda: _eq(gm_nodes(), 1), 5)
        assert "lm-1-w0" in await listed(stub)  # the live worker stays
        # It comes back: it registers as a node again (into the vacant row).
        back = await register(stub, "ghost", cpu_milli=2000, memory_mb=1024)
        assert back.node_index == ghost
        assert (await listed(stub))["ghost"].health == common_pb2.NODE_HEALTH_ALIVE
        await until(lambda: _eq(gm_nodes(), 2), 5)


async def _eq(value, expected) -> bool:
    return (await value) == expected


async def _health(stub, node_id: str, health: int) -> bool:
    node = (await listed(stub)).get(node_id)
    return node is not None and node.health == health


async def _gone(stub, node_id: str) -> bool:
    return node_id not in await listed(stub)
