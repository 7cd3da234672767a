"""A client that retries a job under the same id (after a timeout, say) does not get it
queued twice: the GM queues only the tasks it does not hold already.

Every service runs in this process on the in-memory bus (as ``megha up --embedded``).
Two 4-CPU workers, kept busy by a "hog" job, so a job's tasks stay in the GM's queue
where they can be counted.
"""

from __future__ import annotations

import asyncio

import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import (
    StoredAfterAll,
    embedded_federation,
    hog,
    job_in_state,
    lm_knows,
    sim_tasks,
)

pytestmark = pytest.mark.integration


async def test_a_retried_job_id_queues_only_what_the_gm_does_not_hold():
    async with embedded_federation("submit-retry") as (config, gm, _bus, client):
        await hog(client, 1.5)
        first = await client.submit(sim_tasks(2, 0.05, cpu_milli=100), job_id="again")
        queue = (await client.job("again")).queue
        assert gm.queues.pending(queue) == 2

        # The same request again, and again at once: the same answer, nothing queued.
        retries = await asyncio.gather(
            *(client.submit(sim_tasks(2, 0.05, cpu_milli=100), job_id="again") for _ in range(3))
        )
        assert [list(r.task_ids) for r in retries] == [list(first.task_ids)] * 3
        assert gm.queues.pending(queue) == 2

        # A retry that carries one task more queues that one only.
        grown = await client.submit(sim_tasks(3, 0.05, cpu_milli=100), job_id="again")
        assert list(grown.task_ids) == ["again.0", "again.1", "again.2"]
        assert gm.queues.pending(queue) == 3

        job = await job_in_state(client, "again", common_pb2.TASK_STATE_SUCCEEDED, timeout_s=20)
        assert len(job.tasks) == 3
        # Ended: a retry now still queues nothing and answers the same ids.
        late = await client.submit(sim_tasks(3, 0.05, cpu_milli=100), job_id="again")
        assert list(late.task_ids) == list(grown.task_ids)
        assert gm.queues.pending(queue) == 0
        assert sorted(await lm_knows(config, list(grown.task_ids))) == list(grown.task_ids)


async def test_a_second_message_of_a_queued_job_is_dropped_on_delivery():
    """What a retry through another GM (or a message stored after a lost confirm) looks
    like to the GM serving the queue: the job's tasks arrive a second time."""
    async with embedded_federation("submit-dup-msg") as (_config, gm, _bus, client):
        await hog(client, 1.0)
        tasks = sim_tasks(2, 0.05, cpu_milli=100)
        await client.submit(tasks, job_id="dup")
        queue = (await client.job("dup")).queue
        assert gm.queues.pending(queue) == 2

        batch = common_pb2.TaskBatch(job_id="dup", queue=queue, tasks=tasks)
        for i, task in enumerate(batch.tasks):
            task.task_id, task.job_id, task.queue = f"dup.{i}", "dup", queue
        copy = StoredAfterAll(batch.SerializeToString())
        async with asyncio.timeout(10):
            await gm._on_delivery(copy)
        # Not queued twice; it joins the tasks waiting here, acked once they launch
        # (acked now, it would be lost with them should the GM die first).
        assert gm.queues.pending(queue) == 2
        assert not copy.acked

        # A re-queued task (the LM's next attempt after a preemption or a lost node) is
        # a new attempt, not a duplicate: it is queued.
        batch.tasks[0].attempt = 1
        del batch.tasks[1]
        retry = StoredAfterAll(batch.SerializeToString())
        async with asyncio.timeout(10):
            await gm._on_delivery(retry)
        assert not retry.acked
        assert gm.queues.pending(queue) == 3
        await job_in_state(client, "dup", common_pb2.TASK_STATE_SUCCEEDED, timeout_s=20)
        assert copy.acked and retry.acked
