"""Task priority within a queue: ``megha submit --priority N`` goes ahead of the queue's
waiting tasks of a lower priority (not of those already running)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, sim_tasks

pytestmark = pytest.mark.integration
TASK_STATE_SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED


async def test_a_higher_priority_job_overtakes_the_waiting_tasks_of_its_queue(tmp_path):
    # One node of 1 CPU: tasks of 1 CPU run one at a time, in the order the GM picks.
    groups = [{"lm": "lm-1", "count": 1, "capacity": "cpu=1,mem=8Gi"}]
    async with Federation(tmp_path, gms=1, lms=1, worker_groups=groups) as fed:
        # The first low task runs 4 s: time enough for the CLI to submit the high job.
        low = await fed.gm().submit(sim_tasks(1, 4.0) + sim_tasks(4, 0.3))
        deadline = time.monotonic() + 10
        while not fed.events.states(common_pb2.TASK_STATE_RUNNING):
            assert time.monotonic() < deadline, "the first task never started"
            await asyncio.sleep(0.02)

        megha = [sys.executable, "-m", "services.cli", "submit", "--config", str(fed.config_path)]
        args = ["--priority", "5", "--count", "3", "--duration", "0.3", "--resources", "cpu=1"]
        done = await asyncio.to_thread(
            subprocess.run, [*megha, *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        high_job = done.stdout.split()[1].rstrip(":")
        high = {f"{high_job}.{i}" for i in range(3)}
        await fed.events.wait_succeeded({*low.task_ids, *high}, timeout_s=60)

        ended = {e.task_id: e for e in fed.events.events if e.state == TASK_STATE_SUCCEEDED}
        first = ended[low.task_ids[0]].timestamps.finished_unix_nanos
        queued = max(ended[t].timestamps.queued_unix_nanos for t in high)
        assert queued < first, "the high job came after the long task: the CLI was too slow"
        order = sorted(ended, key=lambda t: ended[t].timestamps.started_unix_nanos)
        # The low task that was running goes on; then the three high ones; then the rest.
        assert order[0] in low.task_ids
        assert set(order[1:4]) == high, order
        assert set(order[4:]) == set(low.task_ids) - {order[0]}
