"""Starts for one worker that queue up together go as one message, and all run once."""

from __future__ import annotations

from collections import Counter, deque

import pytest

from services._proto.megha.v1 import common_pb2, local_master_pb2
from services.local_master.service import MAX_STARTS_PER_MESSAGE, _leading_starts
from tests.integration.harness import embedded_federation, job_in_state, sim_tasks

pytestmark = pytest.mark.integration


def start(task_id: str) -> local_master_pb2.WorkerCommand:
    return local_master_pb2.WorkerCommand(
        start=local_master_pb2.StartTask(task=common_pb2.Task(task_id=task_id))
    )


def test_leading_starts_stop_at_a_kill_and_at_a_message_s_worth():
    kill = local_master_pb2.WorkerCommand(kill=local_master_pb2.KillTask(task_id="x"))
    queue = deque([start("a"), start("b"), kill, start("c")])
    assert [c.start.task.task_id for c in _leading_starts(queue)] == ["a", "b"]
    assert _leading_starts(deque([kill, start("a")])) == []
    many = deque(start(str(i)) for i in range(MAX_STARTS_PER_MESSAGE + 5))
    assert len(_leading_starts(many)) == MAX_STARTS_PER_MESSAGE


async def test_a_job_packed_onto_nodes_starts_every_task_once():
    async with embedded_federation("start-batches") as (_config, _gm, _bus, client):
        # Two workers of 4 CPUs: first fit puts 4 one-CPU tasks on each at once.
        reply = await client.submit(sim_tasks(8, 0.2), job_id="packed")
        assert len(reply.task_ids) == 8
        job = await job_in_state(client, "packed", common_pb2.TASK_STATE_SUCCEEDED)
        assert sorted(Counter(t.node_id for t in job.tasks).values()) == [4, 4]
        assert all(t.attempt == 0 for t in job.tasks)
