"""The worker host: many agents, one process, one channel."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import grpc
import pytest

from services.common.config import parse_config
from services.core.resources import resources
from services.worker.host import WorkerHost, advertised, advertised_address, node_ids
from services.worker.link import MAX_PER_MESSAGE, HostLink
from services.worker.machine import Machine


def config(port: int, **group: object):
    return parse_config(
        {
            "gms": [{"id": "gm-1", "port": 1}],
            "lms": [{"id": "lm-1", "port": port}],
            "workers": [{"lm": "lm-1", **group}],
        },
        env={},
    )


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_node_ids_follow_the_prefix_and_offset() -> None:
    cfg = config(2, count=3)
    assert node_ids(cfg.workers[0]) == ["lm-1-w0", "lm-1-w1", "lm-1-w2"]
    assert node_ids(cfg.workers[0], 10) == ["lm-1-w10", "lm-1-w11", "lm-1-w12"]
    named = config(2, count=2, name_prefix="rack7-")
    assert node_ids(named.workers[0], 5) == ["rack7-5", "rack7-6"]


def test_nodes_advertise_their_hosts_address_from_the_file_or_the_environment() -> None:
    """What an LM (and ``megha nodes``) shows for the node: the group's ``host``, unless
    the worker process's MEGHA_ADVERTISE_HOST names this machine; with the metrics port."""
    assert advertised_address(config(2).workers[0], env={}) == ""
    named = config(2, host="10.0.3.7").workers[0]
    assert advertised_address(named, env={}) == "10.0.3.7"
    assert advertised_address(named, env={"MEGHA_ADVERTISE_HOST": "w7.example"}) == "w7.example"
    scraped = config(2, metrics_port=9100).workers[0]
    assert advertised_address(scraped, env={"MEGHA_ADVERTISE_HOST": "fd00::7"}) == "[fd00::7]:9100"
    assert advertised_address(scraped, env={"MEGHA_ADVERTISE_HOST": " "}) == ""


async def test_every_agent_registers_with_the_advertised_address(monkeypatch) -> None:
    monkeypatch.delenv("MEGHA_ADVERTISE_HOST", raising=False)
    cfg = config(closed_port(), count=2, host="10.0.3.7", metrics_port=9100)
    host = WorkerHost(cfg, cfg.workers[0])
    async with host:
        assert [a.address for a in host.agents] == ["10.0.3.7:9100"] * 2


async def test_host_runs_its_agents_over_one_channel_and_stops_cleanly() -> None:
    port = closed_port()
    cfg = config(
        port,
        count=4,
        capacity="cpu=2,mem=4Gi",
        constraints=[3],
        executor="process",
        capacity_beyond_host=True,  # as configured, on a machine of any size
    )
    host = WorkerHost(cfg, cfg.workers[0], index_offset=4)
    assert host.target == f"127.0.0.1:{port}"
    async with host:
        await asyncio.sleep(0.3)
        assert [a.node_id for a in host.agents] == ["lm-1-w4", "lm-1-w5", "lm-1-w6", "lm-1-w7"]
        assert len({id(a.channel) for a in host.agents}) == 1
        for agent in host.agents:
            assert (agent.capacity == resources(cpu_milli=2000, memory_mb=4096)).all()
            assert agent.constraints == [3]
            assert agent.default_executor == "process"
        began = time.monotonic()
    assert time.monotonic() - began < 2
    await asyncio.wait_for(host.shutdown(), 2)  # idempotent


async def test_a_host_that_cannot_keep_output_runs_its_agents_anyway(tmp_path, caplog) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the output directory should go")
    cfg = parse_config(
        {
            "gms": [{"id": "gm-1", "port": 1}],
            "lms": [{"id": "lm-1", "port": closed_port()}],
            "workers": [{"lm": "lm-1", "count": 2}],
            "worker_output_dir": str(blocker),
        },
        env={},
    )
    async with WorkerHost(cfg, cfg.workers[0]) as host:
        await asyncio.sleep(0.1)
        assert len(host.agents) == 2
    assert "tasks' output will not be kept" in caplog.text


def test_a_host_of_real_tasks_advertises_no_more_than_its_machine(caplog) -> None:
    small = Machine(cpu_milli=2000, memory_mb=4096)
    cfg = config(2, capacity="cpu=64,mem=1Ti,disk=1Ti", executor="process")
    assert advertised(cfg.workers[0], small).tolist() == [2000, 4096, 1 << 20, 0]
    (said,) = [r for r in caplog.records if r.message == "capacity cut down to this machine's"]
    assert said.cut == "cpu_milli 64000 -> 2000; memory_mb 1048576 -> 4096"
    within = config(2, capacity="cpu=1,mem=1Gi", executor="docker")
    assert advertised(within.workers[0], small).tolist() == [1000, 1024, 0, 0]
    beyond = config(2, capacity="cpu=64,mem=8Gi", executor="process", capacity_beyond_host=True)
    assert advertised(beyond.workers[0], small).tolist() == [64000, 8192, 0, 0]
    sim = config(2, capacity="cpu=64,mem=8Gi")
    assert advertised(sim.workers[0], small).tolist() == [64000, 8192, 0, 0]


async def test_a_hosts_nodes_heartbeat_on_one_clock() -> None:
    """Nodes that heartbeat at different moments next heartbeat at the same tick of the
    host's clock, at least a tenth of an interval ahead (a timer woken a little early must
    not heartbeat twice) and never more than 1.1 intervals ahead."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{closed_port()}") as channel:
        link = HostLink(channel, life_s=120.0, rng=random.Random(7))
        loop = asyncio.get_running_loop()
        interval = 0.2
        first = link.next_beat(interval, "w0")
        assert loop.time() + 0.1 * interval <= first <= loop.time() + 1.1 * interval
        await asyncio.sleep(0.01)
        # Other nodes, a little later: the same tick, a message's worth of them.
        others = {link.next_beat(interval, f"w{i}") for i in range(1, MAX_PER_MESSAGE)}
        assert others == {first}
        beyond = link.next_beat(interval, "w-next")  # the next message's worth: its own tick
        assert beyond != first
        assert loop.time() + 0.1 * interval <= beyond <= loop.time() + 1.1 * interval
        await asyncio.sleep(max(0.0, first - loop.time() - 0.01))  # just before the tick
        following = link.next_beat(interval, "w0")
        assert following == pytest.approx(first + interval)
