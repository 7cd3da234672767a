"""The recorder's checks: each promise broken on purpose is named, a clean run is not."""

from __future__ import annotations

from loadgen.invariants import check
from services._proto.megha.v1 import common_pb2

S = common_pb2
SEC = 1_000_000_000


def ev(task_id, state, attempt=0, node="n1", started=0, finished=0):
    stamps = common_pb2.TaskTimestamps(
        started_unix_nanos=int(started * SEC), finished_unix_nanos=int(finished * SEC)
    )
    return common_pb2.TaskEvent(
        task_id=task_id, state=state, attempt=attempt, node_id=node, timestamps=stamps
    )


def run(task_id, attempt=0, node="n1", start=1, end=2, state=S.TASK_STATE_SUCCEEDED):
    return [
        ev(task_id, S.TASK_STATE_RUNNING, attempt, node, start),
        ev(task_id, state, attempt, node, start, end),
    ]


def test_a_clean_run_with_a_preemption_keeps_every_promise():
    events = [
        *run("a", 0, "n1", 1, 2, S.TASK_STATE_PREEMPTED),
        *run("a", 1, "n1", 2, 3),  # the next attempt starts as the last one ends
        *run("b", 0, "n2", 1, 4),
        ev("b", S.TASK_STATE_SUCCEEDED, 0, "n2", 1, 4),  # an ending published twice
    ]
    report = check(events, {"a", "b"}, {"a": 1000, "b": 1000}, {"n1": 1000, "n2": 1000})
    assert report.ok, report.summary()
    assert (report.tasks, report.attempts_started, report.unknown_ends) == (2, 3, 0)


def test_each_broken_promise_is_named():
    events = [
        *run("twice", 0, "n1", 1, 2),
        *run("twice", 0, "n2", 1.5, 2.5),  # attempt 0 on two nodes
        *run("overlap", 0, "n3", 1, 5, S.TASK_STATE_PREEMPTED),
        *run("overlap", 1, "n4", 3, 6),  # starts before attempt 0 ended
        *run("packed", 0, "n5", 1, 3),
        *run("packed2", 0, "n5", 2, 4),  # n5 holds 2 CPUs of 1.5
        ev("lost", S.TASK_STATE_RUNNING, 0, "n6", 1),
        ev("lost", S.TASK_STATE_LOST, 0, "n6", 1),  # no worker stamped its end
    ]
    cpu = dict.fromkeys(["twice", "overlap", "packed", "packed2", "stuck", "lost"], 1000)
    capacity = {"n1": 1000, "n2": 1000, "n3": 1000, "n4": 1000, "n5": 1500, "n6": 1000}
    report = check(events, {*cpu}, cpu, capacity)
    kinds = {(v.kind, v.task_id) for v in report.violations}
    assert kinds == {
        ("stuck", "stuck"),
        ("stuck", "lost"),
        ("started twice", "twice"),
        ("succeeded twice", "twice"),
        ("attempts overlap", "overlap"),
        ("over-committed", "packed2"),
    }, report.summary()
    assert report.unknown_ends == 1
    assert "1 over-committed" in report.summary()
