"""``megha autoscale`` against a real federation (started with it, as ``megha up`` does):
it starts pool nodes (worker processes)
for the tasks that wait, the tasks run on them, idle nodes are drained and stopped, and a
crashed autoscaler's nodes are adopted by the next one instead of started twice."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time

import pytest

from services._proto.megha.v1 import common_pb2
from services.autoscaler.service import Autoscaler
from services.common.config import AutoscaleConfig
from services.common.nodes import lm_rows
from services.worker.leftovers import proc_stat
from tests.integration.harness import Federation, sim_tasks

pytestmark = pytest.mark.integration

STATIC = [{"lm": "lm-1", "count": 1, "capacity": "cpu=1,mem=2Gi"}]


def autoscale(tmp_path, **pool) -> dict:
    return {
        "interval_s": 0.5,
        "idle_s": 1.0,
        "method": "reactive",
        "state_dir": str(tmp_path / "autoscale"),
        "pools": [{"name": "burst", "lm": "lm-1", "capacity": "cpu=2,mem=4Gi", "max": 3, **pool}],
    }


async def pool_nodes(fed: Federation) -> dict[str, str]:
    """The burst pool's nodes the LM holds: id -> alive, dead or draining."""
    rows = await lm_rows(fed.config.lm("lm-1").target, "lm-1")
    return {r.node_id: r.state for r in rows if r.node_id.startswith("lm-1-burst-")}


async def until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.1)


def recorded(fed: Federation) -> dict:
    path = fed.dir / "autoscale" / "nodes.json"
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.mark.slow  # ~20-45 s: run apart by .ci/run (MEGHA_SLOW_TESTS=1)
async def test_pool_grows_for_waiting_tasks_and_shrinks_when_idle(tmp_path):
    async with Federation(
        tmp_path, gms=1, lms=1, worker_groups=STATIC, autoscale=autoscale(tmp_path)
    ) as fed:
        await asyncio.sleep(2.0)  # four intervals of nothing to do: no node started
        assert await pool_nodes(fed) == {}

        # 7 one-CPU tasks: the static node runs one, six wait, and two fit a pool node.
        tasks = sim_tasks(7, 6.0)
        await fed.gm().submit(tasks)
        seen: dict[str, set[str]] = {}

        async def all_done():
            for node_id, state in (await pool_nodes(fed)).items():
                seen.setdefault(node_id, set()).add(state)
            return len(fed.events.succeeded()) == 7

        await until(all_done, 60, "the 7 tasks succeed")
        assert sorted(seen) == ["lm-1-burst-0", "lm-1-burst-1", "lm-1-burst-2"]
        ran_on = fed.events.nodes_of(common_pb2.TASK_STATE_RUNNING)
        assert sum(node.startswith("lm-1-burst-") for node in ran_on.values()) >= 5, ran_on

        # Idle for idle_s: drained, then stopped (the LM takes a stopped node for dead).
        async def all_dead():
            states = await pool_nodes(fed)
            return states and all(s == "dead" for s in states.values()) and not recorded(fed)

        await until(all_dead, 30, "the idle pool nodes are stopped")
        log = (tmp_path / "autoscale.log").read_text()
        assert "draining idle node lm-1-burst-" in log and "stopping node lm-1-burst-" in log
        assert "burst: 0 nodes, demand 3 (6 waiting tasks), target 3 [naive]" in log
        assert "did not answer" not in log  # it waited for the federation to come up

        # A second burst: the slots' next nodes take tasks (the LM kept no drain of the
        # stopped ones, which would stop each new node as soon as it registered).
        again = await fed.gm().submit(sim_tasks(5, 3.0))
        await fed.events.wait_succeeded(set(again.task_ids), timeout_s=60)
        ran_on = fed.events.nodes_of(common_pb2.TASK_STATE_RUNNING)
        assert sum(ran_on[t].startswith("lm-1-burst-") for t in again.task_ids) >= 3, ran_on


async def test_a_restarted_autoscaler_adopts_its_nodes(tmp_path):
    async with Federation(
        tmp_path, gms=1, lms=1, worker_groups=STATIC, autoscale=autoscale(tmp_path, min=1)
    ) as fed:

        async def one_alive():
            return await pool_nodes(fed) == {"lm-1-burst-0": "alive"} and recorded(fed)

        first = await until(one_alive, 30, "the pool's min node is up")
        pid = first["lm-1-burst-0"]["pid"]

        fed.children.kill("autoscale")  # -9: its node keeps running
        os.kill(pid, 0)
        fed.children.restart("autoscale")
        await until(
            lambda: _contains(tmp_path / "autoscale.log", "adopted the nodes"), 30, "adoption"
        )
        await asyncio.sleep(1.5)  # three intervals: nothing started twice
        assert recorded(fed) == first
        assert await pool_nodes(fed) == {"lm-1-burst-0": "alive"}

        # A stopped (not crashed) autoscaler stops its nodes.
        fed.children.kill("autoscale", signal.SIGTERM)
        await until(
            lambda: _coro(not _alive(pid)), 20, "the node's process ends with the autoscaler"
        )
        await until(lambda: _state_is(fed, "dead"), 20, "the LM sees it go")


async def _contains(path, text: str) -> bool:
    return path.exists() and text in path.read_text()


async def _coro(value):
    return value


async def _state_is(fed: Federation, state: str) -> bool:
    return await pool_nodes(fed) == {"lm-1-burst-0": state}


def _alive(pid: int) -> bool:
    fields = proc_stat(pid)  # reaped by init, or a zombie still: gone
    return fields is not None and fields[0] not in (b"Z", b"X")


async def test_a_pool_whose_nodes_cannot_start_is_held_back_and_says_why(tmp_path, caplog):
    async with Federation(tmp_path, gms=1, lms=1, worker_groups=STATIC) as fed:
        config = fed.config.model_copy(
            update={"autoscale": AutoscaleConfig(**autoscale(tmp_path, min=1))}
        )
        # Its nodes read a file that is not there: each exits at once.
        scaler = Autoscaler(config, str(tmp_path / "missing.yaml"), tmp_path / "nodes")
        started = []
        start = scaler.procs.start
        scaler.procs.start = lambda pool, slot: started.append(slot) or start(pool, slot)
        caplog.set_level(logging.INFO, logger="megha.autoscaler")
        try:
            deadline = time.monotonic() + 40
            while "starting none for" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                await scaler.step()
                await asyncio.sleep(0.3)
            assert len(started) == 3
            for _ in range(6):  # still wanted (min 1), but held back
                await scaler.step()
                await asyncio.sleep(0.3)
            assert len(started) == 3
        finally:
            await scaler.procs.stop_all()
            await scaler.close()
        assert "pool burst: 3 nodes exited within 30 s of their start" in caplog.text
        assert "cannot read config" in caplog.text  # the node's own log, quoted
