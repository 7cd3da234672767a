"""A submission the broker did not take: the client is told, and nothing unlaunched runs.

Every service runs in this process on the in-memory bus (as ``megha up --embedded``);
the GM's bus is then closed, so its enqueue fails for real.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services._proto.megha.v1 import (
    common_pb2,
    global_master_pb2,
)
from services.common.convert import parse_task
from services.core.status import PlacementStatus
from services.global_master.service import SCHEDULE_BEFORE_CONFIRM, Batch, Pending, _message_key
from tests.integration.harness import (
    StoredAfterAll,
    embedded_federation,
    job_in_state,
    lm_knows,
    sim_tasks,
)

pytestmark = pytest.mark.integration


async def test_a_job_submitted_while_the_broker_is_unreachable_is_refused_whole():
    async with embedded_federation("submit-unreachable") as (config, _gm, gm_bus, client):
        ok = await client.submit(sim_tasks(1, 0.05), job_id="fine")
        assert ok.task_ids == ["fine.0"]

        await gm_bus.close()  # the broker is gone for this GM
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.submit(sim_tasks(1, 0.05), job_id="lost")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "broker is unreachable: this try queued nothing of job lost" in (
            refused.value.details()
        )

        # Refused before anything was scheduled: the GM does not know the job at all.
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await client.job("lost")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        await asyncio.sleep(0.3)
        assert await lm_knows(config, ["lost.0", "fine.0"]) == ["fine.0"]


class Aborted(Exception):
    pass


class Context:
    """What SubmitJob uses of grpc's servicer context: ``abort`` raises."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


async def test_a_publish_that_fails_drops_the_tasks_that_had_not_launched():
    async with embedded_federation("submit-failure") as (config, gm, gm_bus, client):
        # Both workers full for a second: the next task has to wait in the GM's queue.
        await client.submit(sim_tasks(2, 1.0, cpu_milli=4000), job_id="hog")
        await job_in_state(client, "hog", common_pb2.TASK_STATE_RUNNING, timeout_s=10)

        # The bus closes while SubmitJob is under way (its task runs at SubmitJob's first
        # yield, after the check that the broker is reachable): the publish then fails.
        closing = asyncio.create_task(gm_bus.close())
        request = global_master_pb2.SubmitJobRequest(job_id="lost", tasks=sim_tasks(1, 0.05))
        with pytest.raises(Aborted) as refused:
            await gm.SubmitJob(request, Context())
        await closing
        code, details = refused.value.args
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "did not confirm job lost" in details

        # It was waiting for room: it is taken out of the queue and shows as rejected at
        # once, and no LM ever books it (not even once the hogs are gone).
        job = await client.job("lost")
        assert job.tasks[0].state == common_pb2.TASK_STATE_REJECTED
        assert gm.queues.pending(job.queue) == 0
        await asyncio.sleep(1.5)
        assert await lm_knows(config, ["lost.0", "hog.0", "hog.1"]) == ["hog.0", "hog.1"]
        # Nothing of it was out at an LM: the GM keeps only its id, for a late delivery.
        assert not [key for key in gm._local if key[0] == "lost"]
        assert "lost" in gm._failed


async def test_a_failed_submission_delivered_after_all_waits_for_its_launches_in_flight():
    async with embedded_federation("submit-stored") as (config, gm, _bus, client):
        # Submitted and started as usual; then pretend its publish failed with a launch
        # still out, and its message arrives anyway.
        await client.submit(sim_tasks(1, 0.05, cpu_milli=100), job_id="twice")
        deadline = time.monotonic() + 10
        while (await lm_knows(config, ["twice.0"])) != ["twice.0"]:
            assert time.monotonic() < deadline, "the task never reached the LM"
            await asyncio.sleep(0.05)
        job = await client.job("twice")
        batch = common_pb2.TaskBatch(job_id="twice", queue=job.queue)
        batch.tasks.add(task_id="twice.0", job_id="twice", queue=batch.queue)
        local = Batch(None, remaining=1, cancelled=True)
        local.launching()  # the launch in flight
        gm._local[_message_key(batch)] = local
        delivery = StoredAfterAll(batch.SerializeToString())
        handling = asyncio.create_task(gm._on_delivery(delivery))
        await asyncio.sleep(0.3)
        assert not handling.done()  # asks no LM while the launch is out
        local.landed()
        await asyncio.wait_for(handling, 10)
        # The LM knew the task by then: the message is acked, the task not queued again.
        assert delivery.acked
        assert gm.queues.pending(batch.queue) == 0


async def test_a_failed_submission_delivered_long_after_still_checks_what_launched():
    async with embedded_federation("submit-late") as (config, gm, _bus, client):
        tasks = sim_tasks(1, 0.05, cpu_milli=100)
        await client.submit(tasks, job_id="late")
        deadline = time.monotonic() + 10
        while (await lm_knows(config, ["late.0"])) != ["late.0"]:
            assert time.monotonic() < deadline, "the task never reached the LM"
            await asyncio.sleep(0.05)
        # As if its publish had failed and its entry had since been forgotten (no launch
        # out): only the job id is left when the broker's delivery comes.
        job = await client.job("late")
        batch = common_pb2.TaskBatch(job_id="late", queue=job.queue, tasks=tasks)
        batch.tasks[0].MergeFrom(common_pb2.Task(task_id="late.0", job_id="late", queue=job.queue))
        gm._failed["late"] = Batch(None, remaining=1, cancelled=True)  # landed
        # And as if the GM had forgotten the job too (100,000 newer ones): only the LMs
        # can tell what launched.
        del gm.jobs.jobs["late"]
        delivery = StoredAfterAll(batch.SerializeToString())
        async with asyncio.timeout(10):
            await gm._on_delivery(delivery)
        # Decided by the delivery itself (no turn of the loop in between): the LM knew
        # the task, so the message is acked and the task not queued again.
        assert delivery.acked
        assert gm.queues.pending(batch.queue) == 0
        assert "late" not in gm._failed


async def test_a_refused_jobs_launch_that_comes_back_rejected_ends_at_once():
    """A task of a job the broker did not confirm, whose launch was out: when the LM
    turns it down it is rejected there and then, not put back in the queue, so that by
    the time its launches have landed a retry knows it has to queue it again."""
    async with embedded_federation("submit-refused-back") as (_config, gm, _bus, client):
        await client.submit(sim_tasks(1, 0.05, cpu_milli=100), job_id="known")
        queue = (await client.job("known")).queue
        task = common_pb2.Task(task_id="gone.0", job_id="gone", queue=queue)
        task.resources.cpu_milli = 100
        gm.jobs.queued(task)
        item = Pending(task, parse_task(task, 21), Batch(None, remaining=1, cancelled=True))
        gm._rejected("lm-1", item, PlacementStatus.REJECTED_RESOURCES, "node 0 is full")
        assert gm.queues.pending(queue) == 0
        assert (await client.job("gone")).tasks[0].state == common_pb2.TASK_STATE_REJECTED
        assert gm.jobs.taken("gone", [task]) == set()  # a retry queues it again


async def test_a_submission_whose_confirm_is_lost_after_its_delivery_came_still_runs():
    """The message was stored and delivered back to this GM (joining the tasks it was
    scheduling from memory), then the confirm was lost. The delivery used to wait for
    that batch forever, unacked, its task dropped (``chaos-sim --small --seed 4767``):
    now it is taken as a delivery anew, checked against what launched, and runs."""
    async with embedded_federation("submit-confirm-lost") as (_config, gm, gm_bus, client):
        await client.submit(sim_tasks(2, 1.0, cpu_milli=4000), job_id="hog")
        await job_in_state(client, "hog", common_pb2.TASK_STATE_RUNNING, timeout_s=10)
        real = gm_bus.enqueue

        async def confirm_lost(queue: str, body: bytes) -> None:
            await real(queue, body)  # stored for real
            key = _message_key(common_pb2.TaskBatch.FromString(body))
            async with asyncio.timeout(5):
                while key in gm._local:  # until its delivery came back and joined
                    await asyncio.sleep(0.01)
            raise ConnectionError("the confirm was lost")

        gm_bus.enqueue = confirm_lost
        request = global_master_pb2.SubmitJobRequest(job_id="stored", tasks=sim_tasks(1, 0.05))
        with pytest.raises(Aborted) as refused:
            await gm.SubmitJob(request, Context())
        gm_bus.enqueue = real
        assert refused.value.args[0] == grpc.StatusCode.UNAVAILABLE
        # No retry by the client: the stored message alone runs the task, once.
        job = await job_in_state(client, "stored", common_pb2.TASK_STATE_SUCCEEDED, 15)
        assert job.tasks[0].attempt == 0
        assert gm.queues.pending(job.queue) == 0


async def test_a_delivery_of_tasks_held_by_a_submission_under_way_waits_for_its_confirm():
    """A client's retry through another GM stored some of the job's tasks while this
    GM's own submission of them waited for its confirm. Their delivery skipped them as
    queued here; the confirm then failed and dropped them: acknowledged, never run
    (``chaos-sim --small --seed 6719``). Now the delivery waits for the submission."""
    async with embedded_federation("submit-under-way") as (_config, gm, gm_bus, client):
        await client.submit(sim_tasks(2, 1.0, cpu_milli=4000), job_id="hog")
        await job_in_state(client, "hog", common_pb2.TASK_STATE_RUNNING, timeout_s=10)
        real, release = gm_bus.enqueue, asyncio.Event()

        async def unconfirmed(queue: str, body: bytes) -> None:
            await release.wait()
            raise ConnectionError("the broker went away before storing it")

        gm_bus.enqueue = unconfirmed
        tasks = sim_tasks(2, 0.05)
        request = global_master_pb2.SubmitJobRequest(job_id="split", tasks=tasks)
        submitting = asyncio.create_task(gm.SubmitJob(request, Context()))
        async with asyncio.timeout(5):
            while "split" not in gm._submitting:
                await asyncio.sleep(0.01)
        queue = (await client.job("split")).queue
        retry = common_pb2.TaskBatch(job_id="split", queue=queue)
        retry.tasks.add().CopyFrom(tasks[1])
        retry.tasks[0].task_id, retry.tasks[0].job_id, retry.tasks[0].queue = (
            "split.1",
            "split",
            queue,
        )
        delivery = StoredAfterAll(retry.SerializeToString())
        handling = asyncio.create_task(gm._on_delivery(delivery))
        await asyncio.sleep(0.2)
        release.set()
        with pytest.raises(Aborted):
            await submitting
        gm_bus.enqueue = real
        await asyncio.wait_for(handling, 10)
        # split.0 was only in the failed submission (the client was told); split.1's
        # message was stored: it runs.
        deadline = time.monotonic() + 15
        while True:
            states = {t.task_id: t.state for t in (await client.job("split")).tasks}
            if states.get("split.1") == common_pb2.TASK_STATE_SUCCEEDED:
                break
            assert time.monotonic() < deadline, f"split.1 never ran: {states}"
            await asyncio.sleep(0.05)
        assert states["split.0"] == common_pb2.TASK_STATE_REJECTED
        assert delivery.acked


async def test_a_big_job_whose_confirm_failed_is_not_taken_for_queued_by_a_retrys_message():
    """A job too big to schedule before its confirm (over SCHEDULE_BEFORE_CONFIRM tasks)
    whose publish failed left its tasks booked QUEUED here; the client's retry through
    another GM stored the job, and its delivery here skipped them all as taken and was
    acked: 33 tasks acknowledged, never run (the two-queue preemption replay)."""
    async with embedded_federation("submit-big-failed") as (_config, gm, gm_bus, client):
        real = gm_bus.enqueue

        async def refused(queue: str, body: bytes) -> None:
            raise TimeoutError()  # not stored

        gm_bus.enqueue = refused
        tasks = sim_tasks(SCHEDULE_BEFORE_CONFIRM + 1, 0.05, cpu_milli=100)
        request = global_master_pb2.SubmitJobRequest(job_id="big", tasks=tasks)
        with pytest.raises(Aborted):
            await gm.SubmitJob(request, Context())
        gm_bus.enqueue = real
        job = await client.job("big")
        assert {t.state for t in job.tasks} == {common_pb2.TASK_STATE_REJECTED}
        # The retry's message, as another GM published it.
        retry = common_pb2.TaskBatch(job_id="big", queue=job.queue)
        for i, task in enumerate(tasks):
            task.task_id, task.job_id, task.queue, task.index = f"big.{i}", "big", job.queue, i
            retry.tasks.add().CopyFrom(task)
        delivery = StoredAfterAll(retry.SerializeToString())
        await asyncio.wait_for(gm._on_delivery(delivery), 10)
        await job_in_state(client, "big", common_pb2.TASK_STATE_SUCCEEDED, timeout_s=20)
        assert delivery.acked
