"""Task ids are global: a second job that names a task id another job holds is refused
(by the GM that knows the other job at submission, by the LM that books it otherwise),
never acknowledged and left QUEUED for ever."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services._proto.megha.v1 import common_pb2
from services.common.names import user_queue
from tests.integration.harness import Federation, job_in_state, sim_tasks

pytestmark = pytest.mark.integration

RUNNING = common_pb2.TASK_STATE_RUNNING
SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED
REJECTED = common_pb2.TASK_STATE_REJECTED


def named(task_id: str, duration_s: float) -> common_pb2.Task:
    (task,) = sim_tasks(1, duration_s, cpu_milli=100)
    task.task_id = task_id
    return task


async def known_to(client, job_id: str, timeout_s: float = 10) -> None:
    """Until ``client``'s GM knows the job (from the LMs' events, for another GM's job)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.job(job_id)
            return
        except grpc.aio.AioRpcError:
            assert time.monotonic() < deadline, f"{job_id} never known"
            await asyncio.sleep(0.05)


async def test_a_gm_refuses_a_task_id_another_job_holds_and_takes_a_retry_of_the_same(tmp_path):
    async with Federation(tmp_path, gms=2, lms=1, workers_per_lm=2) as fed:
        first = await fed.gm("gm-1").submit([named("shared", 30.0)], job_id="A")
        await job_in_state(fed.gm("gm-1"), "A", RUNNING)
        await known_to(fed.gm("gm-2"), "A")
        for gm_id in ("gm-1", "gm-2"):  # the GM it was submitted to, and one that heard
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await fed.gm(gm_id).submit([named("shared", 0.05)], job_id="B")
            assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "task id shared is taken by job A" in refused.value.details()
        # Refused whole: nothing of B is known, and A still runs, once.
        with pytest.raises(grpc.aio.AioRpcError):
            await fed.gm("gm-1").job("B")
        # The same job again (a client's retry) is no clash: the same answer.
        again = await fed.gm("gm-1").submit([named("shared", 30.0)], job_id="A")
        assert list(again.task_ids) == list(first.task_ids) == ["shared"]
        (task,) = (await fed.gm("gm-1").job("A")).tasks
        assert task.state == RUNNING and fed.events.runs()["shared"] == 1


async def test_an_lm_refuses_a_task_id_another_job_ran_there(tmp_path):
    """Two GMs can take the two jobs at once, each before hearing of the other: job B's
    message then reaches the queue as if another GM had queued it, here put there
    directly. The LM, which books job A's tasks, refuses B's, and B's tasks end REJECTED
    saying why; job A is untouched."""
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2) as fed:
        client = fed.gm()
        await client.submit([named("ran", 0.05), named("runs", 30.0)], job_id="A")
        deadline = time.monotonic() + 20
        while not (fed.events.succeeded()["ran"] and fed.events.states(RUNNING)["runs"]):
            assert time.monotonic() < deadline, "job A never got going"
            await asyncio.sleep(0.05)

        queue = fed.config.effective_queues()[0].name
        batch = common_pb2.TaskBatch(job_id="B", queue=queue)
        for index, task_id in enumerate(("ran", "runs")):
            task = batch.tasks.add()
            task.CopyFrom(named(task_id, 0.05))
            task.job_id, task.queue, task.index = "B", queue, index
        await fed.bus.enqueue(user_queue(queue), batch.SerializeToString())

        job = await job_in_state(client, "B", REJECTED)
        reasons = {t.task_id: t.pending_reason for t in job.tasks}
        assert "task id ran is job A's (it ended on lm-1), not job B's" in reasons["ran"]
        assert "task id runs is job A's (it runs on lm-1), not job B's" in reasons["runs"]
        assert "lm-1:" in reasons["ran"]
        # Job A: one run of each task, the long one still running.
        tasks = {t.task_id: t.state for t in (await client.job("A")).tasks}
        assert tasks == {"ran": SUCCEEDED, "runs": RUNNING}
        assert fed.events.runs() == {"ran": 1, "runs": 1}
        assert "an LM holds a task's id as another job's" in fed.log("gm-gm-1")
