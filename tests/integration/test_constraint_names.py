"""Constraint names (``constraint_names`` in the federation file): worker groups, ``megha
submit --constraints`` and the GM's reasons speak of ``gpu`` where the wire carries 3."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation

pytestmark = pytest.mark.integration

GROUPS = [
    {"lm": "lm-1", "count": 1, "capacity": "cpu=4,mem=8Gi", "constraints": ["gpu"]},
    {"lm": "lm-1", "count": 1, "capacity": "cpu=4,mem=8Gi", "name_prefix": "plain-"},
]


async def test_tasks_ask_for_constraints_by_name(tmp_path):
    names = {"gpu": 3, "ssd": 4}
    async with Federation(
        tmp_path, gms=1, lms=1, worker_groups=GROUPS, constraint_names=names
    ) as fed:
        megha = [sys.executable, "-m", "services.cli", "submit", "--config", str(fed.config_path)]

        async def submit(*args: str) -> subprocess.CompletedProcess:
            return await asyncio.to_thread(
                subprocess.run, [*megha, *args], capture_output=True, text=True, timeout=60
            )

        done = await submit("--constraints", "gpu", "--count", "4", "--duration", "0.2", "--wait")
        assert done.returncode == 0, done.stderr
        job_id = done.stdout.split()[1].rstrip(":")
        job = await fed.gm().job(job_id)
        assert {t.state for t in job.tasks} == {common_pb2.TASK_STATE_SUCCEEDED}
        assert {t.node_id for t in job.tasks} == {"lm-1-w0"}  # the gpu group's one node

        unknown = await submit("--constraints", "tpu")
        assert unknown.returncode == 2
        assert unknown.stderr == "megha: unknown constraint 'tpu'; this federation names gpu, ssd\n"

        nobody = await submit("--constraints", "ssd,gpu")
        assert nobody.returncode != 0
        assert "can never run here: no node has constraint 4 (ssd)" in nobody.stderr
