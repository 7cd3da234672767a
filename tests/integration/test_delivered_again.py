"""Deliveries a GM must not take at their word (found by ``megha-loadgen chaos-sim``,
docs/chaos.md bugs 3 and 5).

- The same message delivered again (its first delivery's channel closed: a broker
  restart) while its tasks still wait in the GM: acked at once, it was lost with them
  should the GM die before placing them. It joins them, acked when they launch.
- A message queued before the GM started, delivered for the first time (not marked
  redelivered): an earlier life of the GM may have scheduled it from memory and died
  before the broker confirmed it, so that its tasks run. It is fenced like a
  redelivered one, and what an LM holds is not placed again.
- A message of several jobs (``TaskBatch.more_jobs``) delivered again: each job is checked on
  its own, and the message is acked once every job of it is done, not before.

Every service runs in this process on the in-memory bus (``embedded_federation``); two
4-CPU workers kept busy by a "hog" job hold the tasks in the GM's queue.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from services._proto.megha.v1 import common_pb2, local_master_pb2, local_master_pb2_grpc
from services.common import queue_messages
from services.common.server import channel
from tests.integration.harness import (
    StoredAfterAll,
    embedded_federation,
    hog,
    job_in_state,
    sim_tasks,
)

pytestmark = pytest.mark.integration


def _message(job_id: str, queue: str, count: int) -> common_pb2.TaskBatch:
    """The message SubmitJob queues for ``job_id``'s ``count`` tasks (the same key)."""
    batch = common_pb2.TaskBatch(job_id=job_id, queue=queue, tasks=sim_tasks(count, 0.05, 100))
    for i, task in enumerate(batch.tasks):
        task.task_id, task.job_id, task.queue = f"{job_id}.{i}", job_id, queue
    return batch


async def test_a_message_delivered_again_while_its_tasks_wait_is_acked_when_they_launch():
    async with embedded_federation("delivered-again") as (_config, gm, _bus, client):
        await hog(client, 1.5)
        await client.submit(sim_tasks(2, 0.05, cpu_milli=100), job_id="wait")
        queue = (await client.job("wait")).queue
        assert gm.queues.pending(queue) == 2

        again = StoredAfterAll(_message("wait", queue, 2).SerializeToString(), redelivered=True)
        async with asyncio.timeout(10):
            await gm._on_delivery(again)
        assert not again.acked, "acked while its tasks wait here: lost should the GM die"
        assert gm.queues.pending(queue) == 2  # not queued twice

        await job_in_state(client, "wait", common_pb2.TASK_STATE_SUCCEEDED, timeout_s=20)
        assert again.acked


async def test_a_first_delivery_queued_before_the_gm_started_is_fenced():
    async with embedded_federation("queued-before") as (config, gm, _bus, client):
        queue = config.queues_of("gm-1")[0].name
        # An earlier life of the GM launched the job from memory and died before the
        # broker confirmed it: lm-1 holds its tasks, this GM has never heard of them.
        message = _message("early", queue, 2)
        await _launched_by_an_earlier_life(config, message)
        for task in message.tasks:
            task.timestamps.queued_unix_nanos = time.time_ns() - 3_600 * 10**9  # before

        first = StoredAfterAll(message.SerializeToString())  # not marked redelivered
        async with asyncio.timeout(10):
            await gm._on_delivery(first)
        assert first.acked  # every task of it is held by lm-1
        assert gm.queues.pending(queue) == 0, "placed again: they would run twice"
        job = await client.job("early")
        assert {(t.task_id, t.lm_id) for t in job.tasks} == {
            ("early.0", "lm-1"),
            ("early.1", "lm-1"),
        }


async def _launched_by_an_earlier_life(config, message: common_pb2.TaskBatch) -> None:
    """lm-1 holds ``message``'s tasks, launched by a life of gm-1 before this one."""
    async with channel(config.lm("lm-1").target) as ch:
        lm = local_master_pb2_grpc.LocalMasterStub(ch)
        placements = []
        for task in message.tasks:
            task.lease = 1
            placements.append(local_master_pb2.Placement(task=task, node_index=0))
        reply = await lm.Launch(
            local_master_pb2.LaunchRequest(gm_id="gm-1", placements=placements), timeout=5
        )
    assert {r.status for r in reply.results} == {local_master_pb2.PLACEMENT_STATUS_ACCEPTED}
    for task in message.tasks:
        task.lease = 0


async def test_a_message_of_several_jobs_delivered_again_is_checked_job_by_job():
    async with embedded_federation("several-again") as (config, gm, _bus, client):
        queue = config.queues_of("gm-1")[0].name
        ran, waits = _message("ran", queue, 2), _message("waits", queue, 2)
        await _launched_by_an_earlier_life(config, ran)
        await hog(client, 1.5)  # "waits" then waits in the GM's queue

        body = queue_messages.join([ran.SerializeToString(), waits.SerializeToString()])
        again = StoredAfterAll(body, redelivered=True)
        async with asyncio.timeout(10):
            await gm._on_message(again)
        assert gm.queues.pending(queue) == 2, "only the job that did not run is queued"
        assert not again.acked, "acked while a job of it waits: lost should the GM die"

        await job_in_state(client, "waits", common_pb2.TASK_STATE_SUCCEEDED, timeout_s=20)
        assert again.acked
        job = await client.job("ran")
        assert {(t.task_id, t.lm_id, t.attempt) for t in job.tasks} == {
            ("ran.0", "lm-1", 0),
            ("ran.1", "lm-1", 0),
        }
