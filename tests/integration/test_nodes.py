"""``megha nodes``: every node as its LM holds it, draining ones and constraint names
included, and an LM that does not answer named without hiding the others."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, sim_tasks

pytestmark = pytest.mark.integration

GROUPS = [
    {"lm": "lm-1", "count": 1, "capacity": "cpu=4,mem=8Gi", "constraints": ["gpu", 5]},
    {"lm": "lm-1", "count": 1, "capacity": "cpu=2,mem=4Gi", "name_prefix": "small-"},
    {"lm": "lm-2", "count": 1, "capacity": "cpu=2,mem=4Gi"},
]


async def test_megha_nodes_shows_what_each_lm_holds(tmp_path):
    async with Federation(
        tmp_path, gms=1, lms=2, worker_groups=GROUPS, constraint_names={"gpu": 3}
    ) as fed:
        config = ["--config", str(fed.config_path)]

        async def megha(*args: str) -> subprocess.CompletedProcess:
            return await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "services.cli", *args],
                capture_output=True,
                text=True,
                timeout=60,
            )

        # A task of 1 CPU on the gpu node, then drain the small one.
        gpu_task = sim_tasks(1, 30.0, cpu_milli=1500, constraints=[3])
        job = await fed.gm().submit(gpu_task)
        deadline = time.monotonic() + 20
        while job.task_ids[0] not in fed.events.nodes_of(common_pb2.TASK_STATE_RUNNING):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        drained = await megha("drain", *config, "small-0")
        assert drained.returncode == 0, drained.stderr

        shown = await megha("nodes", *config)
        assert shown.returncode == 0, shown.stderr
        print(shown.stdout)
        lines = shown.stdout.splitlines()
        assert lines[0].split() == [
            "NODE", "LM", "GM", "STATE", "CPU", "free/total", "MEM", "free/total", "TASKS",
            "CONSTRAINTS",
        ]  # fmt: skip
        rows = {line.split()[0]: line.split() for line in lines[1:]}
        assert rows["lm-1-w0"] == [
            "lm-1-w0", "lm-1", "gm-1", "alive", "2500m/4", "7936/8192Mi", "1", "gpu,", "5",
        ]  # fmt: skip
        assert rows["small-0"][3] == "draining" and rows["small-0"][-1] == "-"
        assert rows["lm-2-w0"][:4] == ["lm-2-w0", "lm-2", "gm-1", "alive"]

        only_gpu = await megha("nodes", *config, "--constraint", "gpu", "--json")
        (row,) = json.loads(only_gpu.stdout)
        assert (row["node_id"], row["constraints"], row["tasks"]) == ("lm-1-w0", [3, 5], 1)
        bad = await megha("nodes", *config, "--constraint", "tpu")
        assert bad.returncode == 2 and "unknown constraint 'tpu'" in bad.stderr

        fed.children.kill("lm-lm-2")
        partial = await megha("nodes", *config)
        assert partial.returncode == 1
        assert partial.stderr.startswith("megha: lm-2: UNAVAILABLE")
        assert {line.split()[0] for line in partial.stdout.splitlines()[1:]} == {
            "lm-1-w0",
            "small-0",
        }
