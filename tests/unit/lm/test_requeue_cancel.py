"""A plan's re-queues all go out even when its caller is cancelled while the first waits
for the broker. ``_carry_out`` used to send them one after the other: a worker's
registration cancelled past its deadline (the LM just restarted, the broker slow to
confirm) left the later re-queues of its plan unsent, and those tasks, ended on the books
and no longer stopping, waited for the LM's next restart (the chaos suite's LM kill: a
preempted task stuck)."""

from __future__ import annotations

import asyncio

from services._proto.megha.v1 import common_pb2
from services.common.bus import InMemoryBroker, make_bus
from services.common.config import parse_config
from services.common.names import user_queue
from services.core.lm_lifecycle import Requeue
from services.local_master import service
from services.local_master.service import LocalMaster


def _task(task_id: str) -> common_pb2.Task:
    task = common_pb2.Task(task_id=task_id, job_id="j", queue="q", attempt=0)
    task.resources.cpu_milli, task.resources.memory_mb = 1000, 256
    return task


async def test_every_requeue_of_a_plan_goes_out_though_its_caller_is_cancelled(monkeypatch):
    monkeypatch.setattr(service, "EVENT_RETRY_S", 0.01)
    config = parse_config(
        {
            "gms": [{"id": "gm-1", "port": 1}],
            "lms": [{"id": "lm-1", "port": 2}],
            "workers": [{"lm": "lm-1", "count": 1, "capacity": "cpu=4,mem=8Gi"}],
        },
        env={},
    )
    broker = InMemoryBroker()
    bus = make_bus("memory://", broker=broker)  # not connected yet: the broker is away
    master = LocalMaster(config, "lm-1", bus)
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
