import numpy as np
import pytest

from services.core.cluster_state import ClusterState
from services.core.constraints import to_mask
from services.core.resources import ResourceError, resources
from services.core.status import PlacementStatus as S
from tests.builders import NODE, task


def lm(nodes: int = 4, gms=("gm-a", "gm-b"), masks=None) -> ClusterState:
    state = ClusterState("lm-1", gms)
    for i in range(nodes):
        state.add_node(f"w{i}", NODE, 0 if masks is None else masks[i], partition=i % len(gms))
    return state


def test_nodes_join_the_smallest_partition_by_default():
    state = ClusterState("lm-1", ["gm-a", "gm-b", "gm-c"])
    for i in range(7):
        state.add_node(f"w{i}", NODE)
    assert state.table.partition_sizes().tolist() == [3, 2, 2]


def test_bad_nodes_are_refused_with_reasons():
    state = lm(1)
    with pytest.raises(ValueError, match="already registered"):
        state.add_node("w0", NODE)
    with pytest.raises(ResourceError):
        state.add_node("w9", resources(0, 100))
    with pytest.raises(ValueError, match=r"unknown constraints \[30\]"):
        state.add_node("w9", NODE, to_mask([30]))
    with pytest.raises(ValueError, match="unique"):
        ClusterState("lm", ["a", "a"])


def test_launch_takes_and_release_gives_back_exactly():
    state = lm()
    before = state.table.free.copy()
    decision = state.launch("gm-a", task(cpu=1500, mem=3000), 0)
    assert decision.status is S.ACCEPTED and decision.ok
    assert state.table.free[:, 0].tolist() == [2500, 5192, 1000, 1000]
    released = state.release("t1")
    assert released is decision.allocation
    np.testing.assert_array_equal(state.table.free, before)
    assert state.release("t1") is None  # idempotent


@pytest.mark.parametrize(
    ("gm", "node", "t", "status", "reason"),
    [
        ("gm-z", 0, task(), S.REJECTED_UNKNOWN_GM, "unknown GM 'gm-z'"),
        ("gm-a", 9, task(), S.REJECTED_UNKNOWN_NODE, "no node with index 9"),
        ("gm-a", 1, task(), S.REJECTED_WRONG_PARTITION, "w1 is in gm-b's partition; use Repart"),
        ("gm-a", 0, task(constraints=(3,)), S.REJECTED_CONSTRAINTS, r"w0 lacks constraints \[3\]"),
        ("gm-a", 0, task(cpu=5000), S.REJECTED_RESOURCES, "w0 has cpu=4 mem=8192Mi"),
    ],
)
def test_invalid_launches_change_nothing(gm, node, t, status, reason):
    state = lm()
    version, free = state.version, state.table.free.copy()
    decision = state.launch(gm, t, node)
    assert decision.status is status
    assert not decision.ok
    assert __import__("re").search(reason, decision.reason)
    assert state.version == version
    np.testing.assert_array_equal(state.table.free, free)
    assert not state.allocations


def test_dead_node_rejects_and_returns_its_tasks_for_requeue():
    state = lm()
    state.launch("gm-a", task("t1"), 0)
    state.launch("gm-a", task("t2"), 0)
    lost = state.set_alive(0, False)
    assert sorted(a.task_id for a in lost) == ["t1", "t2"]
    assert state.table.free[:, 0].tolist() == NODE.tolist()
    assert state.launch("gm-a", task("t3"), 0).status is S.REJECTED_NODE_DEAD
    assert state.set_alive(0, False) == []
    state.set_alive(0, True)
    # the lost attempt is over; the re-queued one (attempt 1) runs
    assert state.launch("gm-a", task("t1"), 0).status is S.DUPLICATE
    assert state.launch("gm-a", task("t1", attempt=1), 0).status is S.ACCEPTED


def test_repeated_launch_is_a_no_op():
    state = lm()
    first = state.launch("gm-a", task(), 0)
    version, free = state.version, state.table.free.copy()
    again = state.launch("gm-a", task(), 2)  # retried elsewhere: still the same task
    assert again.status is S.DUPLICATE and again.ok
    assert again.allocation is first.allocation
    assert state.version == version
    np.testing.assert_array_equal(state.table.free, free)
    state.release("t1")
    assert state.launch("gm-a", task(), 0).status is S.DUPLICATE  # finished: never twice


def test_an_lm_remembers_only_the_newest_ended_attempts():
    state = ClusterState("lm-1", ("gm-a",), ended_kept=2)
    state.add_node("w0", NODE, 0, partition=0)
    for task_id in ("t1", "t2", "t3"):
        assert state.launch("gm-a", task(task_id), 0).ok
        state.release(task_id)
    assert state.known_attempt("t1") is None  # the oldest is forgotten
    assert state.known_attempt("t3") == (0, False)
    # An attempt that ends again counts as new: t2's second attempt outlives t3.
    assert state.launch("gm-a", task("t2", attempt=1), 0).ok
    state.release("t2")
    assert state.launch("gm-a", task("t4"), 0).ok
    state.release("t4")
    assert state.known_attempt("t3") is None
    assert state.launch("gm-a", task("t2", attempt=1), 0).status is S.DUPLICATE
    assert state.launch("gm-a", task("t4"), 0).status is S.DUPLICATE


def test_endings_recalled_from_a_journal_refuse_their_retries():
    state = lm()
    state.remember_ended("t1", 2)
    state.remember_ended("t1", 1)  # an older ending does not undo a newer one
    assert state.known_attempt("t1") == (2, False)
    assert state.launch("gm-a", task("t1", attempt=2), 0).status is S.DUPLICATE
    assert state.launch("gm-a", task("t1", attempt=3), 0).ok


def test_repartition_carves_a_logical_node_and_returns_it_to_the_owner():
    state = lm()
    assert state.repartition("gm-a", task(), 0).status is S.REJECTED_WRONG_PARTITION
    decision = state.repartition("gm-a", task(cpu=3000), 1)  # w1 belongs to gm-b
    assert decision.status is S.ACCEPTED
    assert decision.allocation.logical and decision.allocation.partition == 0
    assert state.borrowed()[1].tolist() == [3000, 1024, 0, 0]
    assert state.table.free[0, 1] == 1000
    # the owner sees the carved resources gone until release
    assert state.launch("gm-b", task("t2", cpu=2000), 1).status is S.REJECTED_RESOURCES
    state.release("t1")
    assert state.borrowed()[1].tolist() == [0, 0, 0, 0]
    assert state.launch("gm-b", task("t2", cpu=2000), 1).status is S.ACCEPTED


def test_preempt_verifies_victims_then_swaps():
    state = lm(2)
    state.launch("gm-a", task("old", cpu=2000, queue="big"), 0)
    state.launch("gm-a", task("young", cpu=2000, queue="big"), 0)
    over = {"big"}.__contains__

    new = task("new", cpu=2000, queue="small")
    rejected = state.preempt("gm-a", new, 0, ["gone"], over)
    assert rejected.status is S.REJECTED_VICTIMS
    assert "gone no longer runs on node w0" in rejected.reason

    rejected = state.preempt("gm-a", new, 0, ["young"], set().__contains__)
    assert rejected.status is S.REJECTED_VICTIMS and "no longer over its share" in rejected.reason

    rejected = state.preempt("gm-a", task("new", cpu=5000, queue="small"), 0, ["young"], over)
    assert rejected.status is S.REJECTED_RESOURCES
    assert set(state.allocations) == {"old", "young"}

    done = state.preempt("gm-a", task("new", cpu=2000, queue="small"), 0, ["young"], over)
    assert done.status is S.ACCEPTED
    assert [v.task_id for v in done.preempted] == ["young"]
    assert set(state.allocations) == {"old", "new"}
    assert state.table.free[0, 0] == 0
    # the victim comes back as its next attempt
    assert state.launch("gm-a", task("young", cpu=2000, queue="big"), 0).status is S.DUPLICATE
    young_again = task("young", cpu=2000, queue="big", attempt=1)
    assert state.repartition("gm-a", young_again, 1).status is S.ACCEPTED


def test_delta_snapshot_carries_only_changes_and_applies_to_same_result():
    state = lm(6)
    full = state.snapshot()
    assert full.full and len(full.nodes) == 6 and full.free.shape == (4, 6)
    v = state.version
    state.launch("gm-a", task("t1"), 2)
    state.launch("gm-b", task("t2"), 3)
    state.release("t1")
    state.set_alive(5, False)
    delta = state.snapshot(since_version=v)
    assert not delta.full and delta.base_version == v and delta.version == state.version
    assert sorted(delta.free_indices.tolist()) == [2, 3]
    assert delta.nodes.indices.tolist() == [5] and not delta.nodes.alive[0]
    assert [a.task_id for a in delta.allocations] == ["t2"]
    assert delta.ended_task_ids == ["t1"]
    nothing = state.snapshot(since_version=state.version)
    assert len(nothing.free_indices) == 0 and not nothing.allocations


def test_old_delta_base_falls_back_to_full():
    state = ClusterState("lm-1", ["gm-a"], delta_history=2)
    state.add_node("w0", NODE)
    for i in range(4):
        state.launch("gm-a", task(f"t{i}", cpu=100), 0)
        state.release(f"t{i}")
    assert state.snapshot(since_version=1).full
    assert not state.snapshot(since_version=state.version - 1).full


def test_queue_usage_sums_per_queue():
    state = lm()
    state.launch("gm-a", task("a", cpu=1000, queue="q1"), 0)
    state.launch("gm-a", task("b", cpu=500, queue="q1"), 2)
    state.launch("gm-b", task("c", cpu=200, queue="q2"), 1)
    usage = state.queue_usage()
    assert usage["q1"].tolist() == [1500, 2048, 0, 0]
    assert usage["q2"].tolist() == [200, 1024, 0, 0]


def test_a_restarted_lm_adopts_what_its_workers_run_in_the_owner_partition():
    state = lm()
    adopted = state.adopt(task("t1", cpu=3000, attempt=2), 1)
    assert adopted is not None
    assert (adopted.node, adopted.partition, adopted.logical, adopted.attempt) == (1, 1, False, 2)
    assert state.table.free[0, 1] == 1000
    # already booked (this attempt or a later one), or ended: not again
    assert state.adopt(task("t1", attempt=2), 1) is None
    assert state.adopt(task("t1", attempt=1), 3) is None
    state.release("t1")
    assert state.adopt(task("t1", attempt=2), 1) is None
    assert state.table.free[:, 1].tolist() == NODE.tolist()
    # a later attempt replaces an earlier one still on the books
    state.launch("gm-a", task("t2"), 0)
    assert state.adopt(task("t2", attempt=1), 2) is not None
    assert state.allocations["t2"].node == 2 and state.table.free[:, 0].tolist() == NODE.tolist()
    # it already runs: booked even past what the node has free
    assert state.adopt(task("big", cpu=4000), 2) is not None
    assert state.table.free[0, 2] == -1000
    with pytest.raises(ValueError, match="no node with index 9"):
        state.adopt(task("t3"), 9)


def test_snapshots_name_the_incarnation():
    state = ClusterState("lm-1", ("gm-a",), incarnation=1234)
    assert state.snapshot().incarnation == 1234
    assert state.snapshot(since_version=0).incarnation == 1234


def test_a_draining_node_keeps_its_tasks_takes_none_and_offers_nothing():
    state = lm()
    assert state.launch("gm-a", task("running", cpu=1000), 0).ok
    full = state.snapshot()
    assert state.drain(0) and not state.drain(0)  # a second drain changes nothing
    assert state.task_ids_on(0) == ["running"]
    refused = state.launch("gm-a", task("new"), 0)
    assert (refused.status, refused.reason) == (S.REJECTED_NODE_DRAINING, "node w0 is draining")
    assert state.repartition("gm-b", task("new"), 0).status is S.REJECTED_NODE_DRAINING
    # Heartbeats show it with nothing free, the full state and the next delta alike.
    delta = state.snapshot(full.version)
    assert delta.free_indices.tolist() == [0] and not delta.free.any()
    assert not state.snapshot().free[:, 0].any() and state.snapshot().free[:, 2].all()
    assert state.table.free[:, 0].tolist() == [3000, 7168, 1000, 1000]  # its books stay
    state.release("running")  # its task ends: still nothing to offer
    assert not state.snapshot().free[:, 0].any()
    before_undo = state.snapshot()
    assert state.drain(0, on=False) and not state.drain(0, on=False)
    assert state.snapshot(before_undo.version).free[:, 0].tolist() == [4000, 8192, 1000, 1000]
    assert state.launch("gm-a", task("new"), 0).ok
    with pytest.raises(IndexError):
        state.drain(9)


def test_a_task_id_another_job_runs_or_ran_here_is_refused_for_good():
    state = lm()
    assert state.launch("gm-a", task("x", job_id="A"), 0).ok
    # Another job's task with the same id: never here (not a DUPLICATE, which a GM takes
    # for launched), whatever its attempt, through every kind of request.
    for attempt in (0, 1):
        refused = state.launch("gm-a", task("x", job_id="B", attempt=attempt), 0)
        assert refused.status is S.REJECTED_TASK_ID_TAKEN and not refused.ok
        assert refused.reason == (
            "task id x is job A's (it runs on lm-1), not job B's: task ids are unique "
            "across the federation"
        )
    assert state.repartition("gm-b", task("x", job_id="B"), 0).status is S.REJECTED_TASK_ID_TAKEN
    preempt = state.preempt("gm-a", task("x", job_id="B"), 0, ["x"], lambda queue: True)
    assert preempt.status is S.REJECTED_TASK_ID_TAKEN
    assert state.allocations["x"].job_id == "A"  # nothing changed
    # The job's own retry is still a duplicate.
    assert state.launch("gm-a", task("x", job_id="A"), 0).status is S.DUPLICATE

    state.release("x")
    ended = state.launch("gm-a", task("x", job_id="B", attempt=5), 0)
    assert ended.status is S.REJECTED_TASK_ID_TAKEN and "it ended on lm-1" in ended.reason
    assert state.adopt(task("x", job_id="B"), 0) is None  # a worker's copy is not booked
    assert state.launch("gm-a", task("x", job_id="A"), 0).status is S.DUPLICATE
    assert state.launch("gm-a", task("x", job_id="A", attempt=1), 0).ok


def test_a_task_id_is_compared_by_job_only_when_both_jobs_are_known():
    state = lm()
    # Recalled from a journal without its event: which job it was is not known, so a
    # placement is judged by its attempt alone, as before task ids were checked.
    state.remember_ended("old", 0)
    assert state.launch("gm-a", task("old", job_id="B"), 0).status is S.DUPLICATE
    state.remember_ended("known", 0, job_id="A")
    assert state.launch("gm-a", task("known", job_id="B"), 0).status is S.REJECTED_TASK_ID_TAKEN
    # A request that names no job (the simulator's) is not compared either.
    assert state.launch("gm-a", task("known"), 0).status is S.DUPLICATE


def test_the_jobs_of_ended_tasks_are_remembered_as_long_as_their_attempts():
    state = ClusterState("lm-1", ("gm-a",), ended_kept=2)
    state.add_node("w0", NODE, 0, partition=0)
    for task_id in ("t1", "t2", "t3"):
        assert state.launch("gm-a", task(task_id, job_id="A"), 0).ok
        state.release(task_id)
    assert state.launch("gm-a", task("t1", job_id="B"), 0).ok  # forgotten, job and all
    assert state.launch("gm-a", task("t3", job_id="B"), 0).status is S.REJECTED_TASK_ID_TAKEN
