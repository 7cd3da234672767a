"""``megha drain``: a node keeps its tasks, takes no new ones, and stays drained across an
LM restart (journal) until ``--undo``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, shell_task

RUNNING = common_pb2.TASK_STATE_RUNNING


def _cpu(task: common_pb2.Task, milli: int) -> common_pb2.Task:
    task.resources.cpu_milli = milli
    return task


@pytest.mark.slow  # ~20-45 s: run apart by .ci/run (MEGHA_SLOW_TESTS=1)
async def test_a_drained_node_keeps_its_task_takes_no_new_one_even_after_an_lm_restart(tmp_path):
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2) as fed:
        megha = [sys.executable, "-m", "services.cli", "drain", "--config", str(fed.config_path)]

        async def drain(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
            return await asyncio.to_thread(
                subprocess.run, [*megha, *args], capture_output=True, text=True, timeout=timeout
            )

        async def placed(job_id: str, tasks: int) -> dict[str, str]:
            """Where each task of the job ran, once all have succeeded."""
            deadline = time.monotonic() + 30
            while True:
                job = await fed.gm().job(job_id)
                if all(t.state == common_pb2.TASK_STATE_SUCCEEDED for t in job.tasks):
                    return {t.task_id: t.node_id for t in job.tasks}
                assert time.monotonic() < deadline, job
                await asyncio.sleep(0.1)

        # A task of 1 of a node's 4 CPUs holds a node: the drained one, below.
        long = await fed.gm().submit([_cpu(shell_task("sleep 6"), 1000)])
        deadline = time.monotonic() + 20
        while long.task_ids[0] not in fed.events.nodes_of(RUNNING):
            assert time.monotonic() < deadline, "the long task never started"
            await asyncio.sleep(0.05)
        node = fed.events.nodes_of(RUNNING)[long.task_ids[0]]
        other = ({"lm-1-w0", "lm-1-w1"} - {node}).pop()

        first = await drain(node)
        assert first.returncode == 0, first.stderr
        assert first.stdout == f"node {node} (lm-1) draining: 1 tasks still run\n"
        assert (await drain("--list")).stdout == f"lm-1: {node}\n"
        # Eight short tasks of 1 CPU: the other node takes four at a time, and the
        # drained one, with 3 CPUs free, none.
        short = await fed.gm().submit([_cpu(shell_task("sleep 0.3"), 1000) for _ in range(8)])
        assert set((await placed(short.job_id, 8)).values()) == {other}

        # --wait ends once its task has (it was not killed: it succeeded).
        began = time.monotonic()
        waited = await drain(node, "--wait")
        assert waited.returncode == 0, waited.stderr
        assert waited.stdout.splitlines()[-1] == f"node {node} (lm-1) drained: no task runs on it"
        (task,) = (await fed.gm().job(long.job_id)).tasks
        assert task.state == common_pb2.TASK_STATE_SUCCEEDED
        assert time.monotonic() - began < 15

        # The LM's journal keeps the drain across a restart.
        fed.children.kill("lm-lm-1")
        fed.children.restart("lm-lm-1")
        deadline = time.monotonic() + 30
        while (listed := await drain("--list", timeout=30)).returncode != 0:
            assert time.monotonic() < deadline, listed.stderr
            await asyncio.sleep(0.5)
        assert listed.stdout == f"lm-1: {node}\n"
        again = await fed.gm().submit([_cpu(shell_task("sleep 0.3"), 1000) for _ in range(8)])
        assert set((await placed(again.job_id, 8)).values()) == {other}

        undone = await drain(node, "--undo")
        assert undone.stdout == f"node {node} (lm-1) takes tasks again\n", undone.stderr
        assert (await drain("--list")).stdout == "lm-1: no node draining\n"
        both = await fed.gm().submit([_cpu(shell_task("sleep 0.5"), 1000) for _ in range(8)])
        assert set((await placed(both.job_id, 8)).values()) == {node, other}

        unknown = await drain("no-such-node")
        assert unknown.returncode == 1
        assert "megha: no LM has a node 'no-such-node'" in unknown.stderr
        assert (await drain()).returncode == 2  # neither a node nor --list
