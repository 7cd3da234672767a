"""How a task an LM lost goes back to its user queue, shared by the LM (a lost or
preempted task) and the GM (a task an LM lost before it started, found after its
restart): the next attempt, as a message on the queue's durable work queue.

    task (attempt n) ──next_attempt──▶ task (attempt n + 1) ──enqueue──▶ user_queue(queue)
"""

from __future__ import annotations

import time

from services._proto.megha.v1 import common_pb2
from services.common.bus import Bus
from services.common.convert import next_attempt
from services.common.names import user_queue

# After an LM restarts, past ``worker_timeout_s`` plus this, a worker that has not
# registered again is taken for gone with what it ran (the GM's rule for tasks the LM
# lost, the LM's for the tasks its journal holds and no worker named: ``orphans``).
RESTART_GRACE_S = 5.0


async def enqueue_next_attempt(bus: Bus, task: common_pb2.Task) -> None:
    """Put ``task``'s next attempt in its user queue (the LM's re-queue of a lost or
    preempted task, and the GM's of one an LM lost before it started)."""
    await enqueue_attempt(bus, next_attempt(task, time.time_ns()))


async def enqueue_attempt(bus: Bus, again: common_pb2.Task) -> None:
    """Put ``again`` (a next attempt, made by ``next_attempt``) in its user queue."""
    batch = common_pb2.TaskBatch(job_id=again.job_id, queue=again.queue, tasks=[again])
    await bus.enqueue(user_queue(again.queue), batch.SerializeToString())
