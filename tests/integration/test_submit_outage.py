"""A submission the GM cannot take for a moment (its broker away) is asked again under
its job id, as ``megha submit`` does, and its tasks run once (issue 32's "answer every
client": an uncertain answer is not the end of the job)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, broker_ctl, job_in_state, sim_tasks

pytestmark = pytest.mark.integration

SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED


@pytest.mark.slow  # stops the test broker for 2 s: run apart by .ci/run (MEGHA_SLOW_TESTS=1)
@pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl")
async def test_a_job_submitted_while_the_broker_is_away_is_queued_once_it_is_back(tmp_path):
    async with Federation(tmp_path, gms=1, lms=2, workers_per_lm=2) as fed:
        client = fed.gm("gm-1")
        unsure: list[tuple[str, str]] = []
        try:
            broker_ctl("stop_app")
            submitted = asyncio.create_task(
                client.submit(
                    sim_tasks(4, 0.2),
                    unsure_for_s=60,
                    on_unsure=lambda err, job, _pause: unsure.append((err.code().name, job)),
                )
            )
            await asyncio.sleep(2.0)
        finally:
            broker_ctl("start_app")
        reply = await asyncio.wait_for(submitted, timeout=90)
        assert unsure, "the GM took a job while its broker was away"
        assert {job for _, job in unsure} == {reply.job_id}  # every try under one id
        job = await job_in_state(client, reply.job_id, SUCCEEDED, timeout_s=60)
        assert len(job.tasks) == 4 and {t.attempt for t in job.tasks} <= {0, 1}
        runs = fed.events.runs()  # a recorder reconnecting may miss some: at most once
        assert all(runs[t.task_id] <= 1 for t in job.tasks), runs
