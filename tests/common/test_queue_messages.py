"""Several jobs in one user-queue message (``services.common.queue_messages``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services._proto.megha.v1 import common_pb2
from services.common import queue_messages


def _job(job_id: str, tasks: int, gang: bool = False) -> common_pb2.TaskBatch:
    batch = common_pb2.TaskBatch(job_id=job_id, queue="q", gang=gang, min_tasks=tasks // 2)
    for i in range(tasks):
        batch.tasks.add(task_id=f"{job_id}.{i}", job_id=job_id, attempt=i % 3, owner="u" * i)
    return batch


@given(st.lists(st.tuples(st.integers(0, 40), st.booleans()), min_size=1, max_size=20))
def test_join_then_split_gives_the_jobs_back(shapes) -> None:
    jobs = [_job(f"j{n}", tasks, gang) for n, (tasks, gang) in enumerate(shapes)]
    body = queue_messages.join([job.SerializeToString() for job in jobs])
    parts = queue_messages.split(common_pb2.TaskBatch.FromString(body))
    assert parts == jobs
    assert all(not part.more_jobs for part in parts)


def test_one_job_is_its_own_body_and_its_own_part() -> None:
    body = _job("a", 3).SerializeToString()
    assert queue_messages.join([body]) is body
    batch = common_pb2.TaskBatch.FromString(body)
    assert queue_messages.split(batch) == [batch]
    with pytest.raises(ValueError):
        queue_messages.join([])


def test_a_long_job_gets_a_long_length() -> None:
    """Lengths past one varint byte (128) and two (16,384) are encoded right."""
    jobs = [_job("a", 1), _job("b", 200), _job("c", 1)]
    body = queue_messages.join([job.SerializeToString() for job in jobs])
    assert len(jobs[1].SerializeToString()) > 16_384
    assert queue_messages.split(common_pb2.TaskBatch.FromString(body)) == jobs
