"""An LM's event batch leaves out a PLACED its attempt's later event in the batch
supersedes (issue #32: fewer events per task for every subscriber)."""

from services._proto.megha.v1 import common_pb2
from services.local_master.service import drop_superseded

PLACED = common_pb2.TASK_STATE_PLACED
RUNNING = common_pb2.TASK_STATE_RUNNING
SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED
PREEMPTED = common_pb2.TASK_STATE_PREEMPTED


def event(task: str, state: int, attempt: int = 0) -> common_pb2.TaskEvent:
    return common_pb2.TaskEvent(task_id=task, state=state, attempt=attempt, node_id="w1")


def states(events: list[common_pb2.TaskEvent]) -> list[tuple[str, int, int]]:
    return [(e.task_id, e.state, e.attempt) for e in events]


def test_a_placed_followed_in_the_batch_by_its_attempts_start_or_end_is_left_out():
    batch = [
        event("a", PLACED),
        event("b", PLACED),
        event("a", RUNNING),
        event("c", PLACED),
        event("c", RUNNING),
        event("c", SUCCEEDED),
        event("d", PLACED, attempt=1),  # its attempt 0 ended here: attempt 1 not started
        event("d", PREEMPTED, attempt=0),
    ]
    assert states(drop_superseded(batch)) == [
        ("b", PLACED, 0),  # not started within the batch: still shown placed
        ("a", RUNNING, 0),
        ("c", RUNNING, 0),
        ("c", SUCCEEDED, 0),
        ("d", PLACED, 1),
        ("d", PREEMPTED, 0),
    ]


def test_a_batch_with_nothing_to_leave_out_is_kept_as_it_is():
    batch = [event("a", RUNNING), event("b", SUCCEEDED), event("c", PLACED)]
    assert states(drop_superseded(batch)) == states(batch)
    only_ends = [event("a", SUCCEEDED), event("b", SUCCEEDED)]
    assert drop_superseded(only_ends) is only_ends
    assert drop_superseded([]) == []
