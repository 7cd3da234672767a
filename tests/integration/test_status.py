"""``megha status`` shows each queue's waiting tasks as the GM that serves it counts
them, whichever GM it asks (only the serving GM holds them), and ``?`` when that GM does
not answer."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, sim_tasks

pytestmark = pytest.mark.integration

QUEUES = [
    {"name": "first", "share": 0.5, "gm": "gm-1"},
    {"name": "second", "share": 0.5, "gm": "gm-2"},
]


async def test_status_counts_each_queues_waiting_tasks_at_its_own_gm(tmp_path):
    async with Federation(
        tmp_path, gms=2, lms=1, workers_per_lm=1, capacity="cpu=1,mem=2Gi", queues=QUEUES
    ) as fed:
        job = await fed.gm("gm-2").submit(sim_tasks(4, 30.0), queue="second")
        deadline = time.monotonic() + 20
        while not set(job.task_ids) & set(fed.events.nodes_of(common_pb2.TASK_STATE_RUNNING)):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

        async def status() -> dict[str, list[str]]:
            argv = [sys.executable, "-m", "services.cli", "status", "--config"]
            shown = await asyncio.to_thread(
                subprocess.run, [*argv, str(fed.config_path)], capture_output=True, text=True,
                timeout=60,
            )  # fmt: skip
            assert shown.returncode == 0, shown.stderr
            return {line.split()[0]: line.split() for line in shown.stdout.splitlines() if line}

        rows = await status()  # asks gm-1, which holds none of them
        assert rows["second"][:6] == ["second", "gm-2", "50%", "100%", "3", "1"], rows

        fed.children.kill("gm-gm-2")
        rows = await status()
        assert rows["second"][4] == "?" and rows["first"][4] == "0", rows
