"""A plan's re-queues all go out even when its caller is cancelled while the first waits
for the broker. ``_carry_out`` used to send them one after the other: a worker's
registration cancelled past its deadline (the LM just restarted, the broker slow to
confirm) left the later re-queues of its plan unsent, and those tasks, ended on the books
and no longer stopping, waited for the LM's next restart (the chaos suite's LM kill: a
preempted task stuck)."""

from __future__ import annotations

import asyncio

from services._proto.megha.v1 import common_pb2
from services.common.names import user_queue
from services.core.lm_lifecycle import Requeue
from services.local_master import service
from tests.unit.lm.one_lm import lm_without_broker


def _task(task_id: str) -> common_pb2.Task:
    task = common_pb2.Task(task_id=task_id, job_id="j", queue="q", attempt=0)
    task.resources.cpu_milli, task.resources.memory_mb = 1000, 256
    return task


async def test_every_requeue_of_a_plan_goes_out_though_its_caller_is_cancelled(monkeypatch):
    monkeypatch.setattr(service, "EVENT_RETRY_S", 0.01)
    master, bus = lm_without_broker()  # not connected: the broker is away
    caller = asyncio.create_task(master._carry_out([Requeue(_task(f"t{i}")) for i in range(3)]))
    await asyncio.sleep(0.05)  # the first re-queue is trying the broker again and again
    caller.cancel()  # the registration that carried the plan out gave up
    await asyncio.gather(caller, return_exceptions=True)
    await bus.connect()
    for _ in range(100):
        if await bus.queue_depth(user_queue("q")) == 3:
            break
        await asyncio.sleep(0.01)
    assert await bus.queue_depth(user_queue("q")) == 3
