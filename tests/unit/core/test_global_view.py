from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.convert import snapshot_from_proto, snapshot_to_proto
from services.core.cluster_state import ClusterState
from services.core.fairness import FairShare, QueueShare, usage_by_queue
from services.core.global_view import ApplyResult, GlobalView, HeldAllocations, PreemptionPlan
from services.core.resources import resources
from services.core.snapshot import Allocation
from services.core.status import PlacementStatus, Schedulability
from tests.builders import NODE, task

GMS = ("gm-a", "gm-b")


def federation(lms: int = 3, nodes: int = 4) -> list[ClusterState]:
    states = []
    for j in range(lms):
        state = ClusterState(f"lm-{j}", GMS)
        for i in range(nodes):
            state.add_node(f"lm{j}-w{i}", NODE, partition=i % 2)
        states.append(state)
    return states


def view_of(states, gm="gm-a") -> GlobalView:
    view = GlobalView(gm)
    for s in states:
        assert view.apply(s.snapshot(), now=0.0) is ApplyResult.APPLIED
    return view


def test_full_snapshot_rebuilds_an_identical_table():
    states = federation(1, 5)
    states[0].launch("gm-a", task(), 2)
    view = view_of(states)
    mine = view.lms["lm-0"].table
    np.testing.assert_array_equal(mine.free, states[0].table.free)
    np.testing.assert_array_equal(mine.capacity, states[0].table.capacity)
    assert mine.node_ids == states[0].table.node_ids
    assert mine.members[0] == states[0].table.members[0]
    assert set(view.lms["lm-0"].allocations) == {"t1"}


def test_deltas_apply_in_order_and_stale_or_gapped_ones_are_refused():
    (state,) = federation(1)
    view = view_of([state])
    v0 = state.version
    state.launch("gm-a", task("t1"), 0)
    d1 = state.snapshot(since_version=v0)
    v1 = state.version
    state.launch("gm-a", task("t2"), 0)
    state.release("t1")
    d2 = state.snapshot(since_version=v1)
    assert view.apply(d2, 1.0) is ApplyResult.NEEDS_FULL  # a gap: v0 < base v1
    assert view.apply(d1, 1.0) is ApplyResult.APPLIED
    assert view.apply(d1, 1.0) is ApplyResult.STALE
    assert view.apply(d2, 2.0) is ApplyResult.APPLIED
    lmv = view.lms["lm-0"]
    np.testing.assert_array_equal(lmv.table.free, state.table.free)
    assert set(lmv.allocations) == {"t2"} and lmv.updated_at == 2.0
    # a delta from an older base than the view still converges (absolute values)
    v2 = state.version
    state.launch("gm-a", task("t3"), 2)
    assert view.apply(state.snapshot(since_version=v0), 3.0) is ApplyResult.APPLIED
    np.testing.assert_array_equal(lmv.table.free, state.table.free)
    assert set(lmv.allocations) == {"t2", "t3"} and v2 < lmv.version


def test_internal_partitions_round_robin_over_lms():
    view = view_of(federation(3))
    placed = [view.match(task(f"t{i}")) for i in range(6)]
    assert [p.lm_id for p in placed] == ["lm-0", "lm-1", "lm-2"] * 2
    assert all(not p.repartition and p.node % 2 == 0 for p in placed)


def test_full_internal_partitions_fall_back_to_external_then_none():
    states = federation(2, 2)  # per LM: node 0 -> gm-a, node 1 -> gm-b
    view = view_of(states)
    for n in range(2):
        placement = view.match(task(f"big{n}", cpu=4000))
        assert not placement.repartition
        view.reserve(placement, task(f"big{n}", cpu=4000))
    placement = view.match(task("x", cpu=4000))
    assert placement.repartition and placement.node == 1
    view.reserve(placement, task("x", cpu=4000))
    view.reserve(view.match(task("y", cpu=4000)), task("y", cpu=4000))
    assert view.match(task("z", cpu=4000)) is None
    verdict = view.assess(task("z", cpu=4000))
    assert verdict.schedulability is Schedulability.UNSCHEDULABLE
    assert view.assess(task("z", cpu=40_000)).schedulability is Schedulability.INFEASIBLE


def test_a_wrong_view_is_corrected_by_the_lm_reply():
    (state,) = federation(1, 2)
    view_a = view_of([state], "gm-a")
    # gm-b takes node 0 by repartition; gm-a's view still shows node 0 free
    assert state.launch("gm-b", task("b1", cpu=4000, mem=1), 1).ok
    assert state.repartition("gm-b", task("b2", cpu=4000, mem=1), 0).ok
    placement_a = view_a.match(task("a1", cpu=4000))
    assert placement_a.node == 0
    decision = state.launch("gm-a", task("a1", cpu=4000), placement_a.node)
    assert not decision.ok
    assert view_a.apply(state.snapshot(), 1.0) is ApplyResult.APPLIED
    assert view_a.match(task("a1", cpu=4000)) is None


def test_a_restarted_gm_rebuilds_the_same_view_from_heartbeats():
    states = federation(2)
    states[0].launch("gm-a", task("t1"), 0)
    states[1].repartition("gm-a", task("t2"), 1)
    old, new = view_of(states), view_of(states)
    for lm_id in old.lms:
        np.testing.assert_array_equal(old.lms[lm_id].table.free, new.lms[lm_id].table.free)
    assert new.queue_usage()["default"].tolist() == [2000, 2048, 0, 0]
    assert new.total_capacity().tolist() == (NODE * 8).tolist()


def test_preemption_plan_follows_alg2():
    states = federation(1, 2)
    (state,) = states
    for i, node in enumerate([0, 0, 1, 1]):
        gm = "gm-a" if node == 0 else "gm-b"
        state.launch(gm, task(f"hog{i}", cpu=2000, mem=1000, queue="hog"), node)
    view = view_of(states)
    fair = FairShare([QueueShare("hog", 0.5), QueueShare("small", 0.5)])
    plan = view.preemption_plan(task("s1", cpu=2000, queue="small"), fair)
    assert isinstance(plan, PreemptionPlan)
    assert plan.victims.queue == "hog" and plan.victims.task_ids == ("hog1",)  # youngest on node 0
    # a queue over share never preempts
    assert "over share (100% of 50%)" in view.preemption_plan(task("h", queue="hog"), fair)
    # nothing is over share -> wait
    lone = FairShare([QueueShare("small", 0.5), QueueShare("other", 0.5)])
    assert "over share" not in lone.describe("small", view.queue_usage(), view.total_capacity())


def test_a_finished_task_is_credited_back_once():
    (state,) = federation(1, 2)
    view = view_of([state])
    placement = view.match(task("t1", cpu=4000))
    view.reserve(placement, task("t1", cpu=4000))
    assert view.match(task("t2", cpu=4000)).repartition  # own node is now full
    assert view.release("lm-0", "t1") is True
    assert view.release("lm-0", "t1") is False
    assert view.release("lm-9", "t1") is False
    assert not view.match(task("t2", cpu=4000)).repartition
    assert view.lms["lm-0"].table.free[0, placement.node] == 4000


def test_a_heartbeat_older_than_a_finish_event_does_not_resurrect_the_task():
    (state,) = federation(1, 2)
    view = view_of([state])
    base = state.version
    state.launch("gm-a", task("t1", cpu=4000), 0)
    during = state.snapshot(since_version=base)  # taken while t1 runs...
    state.release("t1")
    # ...but the finish event came first (the view never saw t1 run: nothing to credit)
    assert view.release("lm-0", "t1", ended=True) is False
    assert view.apply(during, 1.0) is ApplyResult.APPLIED
    assert "t1" not in view.lms["lm-0"].allocations
    assert view.lms["lm-0"].table.free[0, 0] == 4000  # the node is free, as it truly is
    assert view.apply(state.snapshot(since_version=during.version), 2.0) is ApplyResult.APPLIED
    assert not view.lms["lm-0"].ended  # confirmed by the LM: nothing left to remember
    np.testing.assert_array_equal(view.lms["lm-0"].table.free, state.table.free)


def test_a_heartbeat_older_than_a_launch_keeps_the_launch_booked():
    (state,) = federation(1, 2)
    view = view_of([state])
    base = state.version
    state.launch("gm-b", task("other", cpu=100), 1)
    before = state.snapshot(since_version=base)  # predates gm-a's launch below
    placement = view.match(task("t1", cpu=4000))
    view.reserve(placement, task("t1", cpu=4000))
    assert view.apply(before, 1.0) is ApplyResult.APPLIED
    assert view.lms["lm-0"].table.free[0, placement.node] == 0  # still booked
    assert view.match(task("t2", cpu=3000)).node != placement.node
    state.launch("gm-a", task("t1", cpu=4000), placement.node)
    assert view.apply(state.snapshot(since_version=before.version), 2.0) is ApplyResult.APPLIED
    assert not view.lms["lm-0"].inflight  # the LM showed it: no longer ours to remember
    np.testing.assert_array_equal(view.lms["lm-0"].table.free, state.table.free)


def test_a_launch_never_answered_expires():
    (state,) = federation(1, 2)
    view = view_of([state])
    placement = view.match(task("t1", cpu=4000))
    view.reserve(placement, task("t1", cpu=4000), now=0.0)
    assert state.repartition("gm-b", task("other", cpu=100), placement.node).ok  # touch it
    assert view.apply(state.snapshot(), now=60.0) is ApplyResult.APPLIED
    assert "t1" not in view.lms["lm-0"].allocations and not view.lms["lm-0"].inflight
    np.testing.assert_array_equal(view.lms["lm-0"].table.free, state.table.free)


def lost_at_once(view: GlobalView, state: ClusterState, attempt: int):
    """Attempt ``attempt`` of t1 (a whole node) reserved by the view, accepted, launched
    and lost at once on the LM; returns its placement and the delta since before it."""
    retry = task("t1", cpu=4000, attempt=attempt)
    placement = view.match(retry)
    view.reserve(placement, retry, now=0.0)
    view.accepted("lm-0", "t1")
    base = state.version
    assert state.launch("gm-a", retry, placement.node).ok
    state.release("t1")
    return placement, state.snapshot(since_version=base)


def test_a_retry_whose_end_event_was_lost_expires_though_the_lm_went_quiet():
    # chaos-sim --seed 6005: a retry accepted and lost at once; its LOST event, on the
    # slow path, was lost with a broker restart. The delta naming the end by task id
    # does not settle a retry (it may be an earlier attempt's end), and the LM's books
    # never changed again, so every later heartbeat was STALE and the launch stayed
    # booked past its expiry for good.
    (state,) = federation(1, 2)
    view = view_of([state])
    _, delta = lost_at_once(view, state, attempt=2)
    assert "t1" in delta.ended_task_ids
    assert view.apply(delta, 1.0) is ApplyResult.APPLIED
    lmv = view.lms["lm-0"]
    assert "t1" in lmv.allocations  # only the retry's own end event settles it
    assert view.apply(state.snapshot(), 20.0) is ApplyResult.STALE  # not expired yet
    assert "t1" in lmv.allocations
    assert view.apply(state.snapshot(since_version=state.version), 40.0) is ApplyResult.STALE
    # The LM's next full state, at the view's own version, drops what expired.
    assert view.apply(state.snapshot(), 40.0) is ApplyResult.APPLIED
    lmv = view.lms["lm-0"]
    assert "t1" not in lmv.allocations and not lmv.inflight
    np.testing.assert_array_equal(lmv.table.free, state.table.free)
    assert view.apply(state.snapshot(), 50.0) is ApplyResult.STALE  # nothing left to drop


def test_a_retry_booked_where_an_earlier_attempt_still_is_gives_that_room_back():
    # chaos-sim --seed 101241: attempt 2 placed and lost at once; the delta naming the
    # end by task id does not settle a retry, so the view booked it again; its LOST
    # event came late (a broker restart), after attempt 3, placed on another node of the
    # same LM, had overwritten its booking. The room of attempt 2 stayed taken in the
    # view for good: no later delta named that node.
    (state,) = federation(1, 4)
    view = view_of([state])
    lmv = view.lms["lm-0"]
    p2, delta = lost_at_once(view, state, attempt=2)
    assert view.apply(delta, 1.0) is ApplyResult.APPLIED
    assert lmv.table.free[0][p2.node] == 0  # booked again: only its own end settles it
    retry = task("t1", cpu=4000, attempt=3)
    p3 = view.match(retry)
    assert p3.node != p2.node
    view.reserve(p3, retry, now=2.0)
    assert lmv.table.free[0][p2.node] == 4000  # the earlier attempt's room, given back
    base = state.version
    assert state.launch("gm-a", retry, p3.node).ok
    assert not view.release("lm-0", "t1", ended=True, attempt=2, now=3.0)  # late
    state.release("t1")
    view.release("lm-0", "t1", ended=True, attempt=3, now=4.0)
    assert view.apply(state.snapshot(since_version=base), 5.0) is ApplyResult.APPLIED
    np.testing.assert_array_equal(lmv.table.free, state.table.free)
    assert not lmv.allocations and not lmv.inflight


def test_reported_usage_leaves_out_the_launches_no_lm_answered():
    (state,) = federation(1, 2)
    view = view_of([state])
    t1, t2 = task("t1", cpu=4000), task("t2", cpu=4000)
    p1 = view.match(t1)
    view.reserve(p1, t1, now=0.0)
    p2 = view.match(t2)
    view.reserve(p2, t2, now=0.0)
    # Placement and fairness count both launches (so as not to oversubscribe a node)...
    assert view.queue_usage()["default"][0] == 8000
    assert {a.task_id for a in view.allocations()} == {"t1", "t2"}
    # ...a report of what the queue holds only those an LM accepted.
    assert view.queue_usage(accepted=True)["default"][0] == 0
    assert list(view.allocations(accepted=True)) == []
    view.accepted("lm-0", "t1")
    assert view.release("lm-0", "t2") is True  # rejected
    assert view.queue_usage(accepted=True)["default"][0] == 4000
    assert [a.task_id for a in view.allocations(accepted=True)] == ["t1"]
    # A snapshot that shows t1 ends the bookkeeping; the cached sums were not touched.
    base = state.version
    state.launch("gm-a", t1, p1.node)
    assert view.apply(state.snapshot(since_version=base), 1.0) is ApplyResult.APPLIED
    lmv = view.lms["lm-0"]
    assert not lmv.inflight and not lmv.unanswered
    assert view.queue_usage(accepted=True)["default"][0] == 4000
    assert view.queue_usage()["default"][0] == 4000


def test_a_snapshot_showing_an_unanswered_launch_counts_it():
    (state,) = federation(1, 2)
    view = view_of([state])
    t1 = task("t1", cpu=4000)
    placement = view.match(t1)
    view.reserve(placement, t1, now=0.0)
    base = state.version
    state.launch("gm-a", t1, placement.node)  # the heartbeat overtakes the reply
    assert view.apply(state.snapshot(since_version=base), 1.0) is ApplyResult.APPLIED
    assert view.queue_usage(accepted=True)["default"][0] == 4000


# ------------------------------------------------------------------ the miss cache
from hypothesis import settings  # noqa: E402

from services.core.match import candidates  # noqa: E402

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["match", "match", "match", "launch", "end", "heartbeat"]),
        st.integers(0, 1),  # LM
        st.sampled_from([2000, 3000, 4000, 5000]),  # cpu of the task
        st.sampled_from([(), (0,), (1,)]),  # constraints
    ),
    min_size=10,
    max_size=60,
)


def _any_fit(view: GlobalView, spec) -> bool:
    """Brute force over the view: some node of any partition has room and constraints."""
    for lmv in view.lms.values():
        cand = candidates(lmv.table, spec.constraint_mask)
        for node in cand.search(1):
            if (lmv.table.free[:, node] >= spec.resources).all():
                return True
    return False


@settings(max_examples=150, deadline=None)
@given(_OPS)
def test_the_view_caches_never_hide_a_node_or_misstate_usage(ops):
    states = federation(2, 2)  # 4 nodes of 4 CPUs: small enough to fill up often
    for state in states:  # some nodes carry constraints 0 and 1
        for i in range(state.table.size):
            state.table._masks[i] = i % 3
        state.table._rebuild_bits(np.ones(state.table.size, dtype=bool))
    view = view_of(states)
    running: list[tuple[int, str]] = []
    for n, (op, lm, cpu, constraints) in enumerate(ops):
        spec = task(f"t{n}", cpu=cpu, constraints=constraints, queue=f"q{n % 3}")
        if op == "match":
            found = view.match(spec)
            assert (found is not None) == _any_fit(view, spec)
            if found is not None:
                view.reserve(found, spec)
                states[int(found.lm_id[-1])].launch("gm-a", spec, found.node)
                running.append((int(found.lm_id[-1]), spec.task_id))
                if cpu == 3000:  # some launches are answered before a heartbeat shows them
                    view.accepted(found.lm_id, spec.task_id)
        elif op == "launch":  # another GM takes room behind this view's back
            node = states[lm].table.free[0].argmax()
            if states[lm].launch("gm-b", spec, int(node)).ok:
                running.append((lm, spec.task_id))
        elif op == "end" and running:
            where, task_id = running.pop(0)
            states[where].release(task_id)
            view.release(f"lm-{where}", task_id, ended=True)
        elif op == "heartbeat":
            view.apply(states[lm].snapshot(), now=float(n))
        # the per-LM usage cache agrees with summing every allocation afresh
        fresh = usage_by_queue(view.allocations())
        cached = view.queue_usage()
        assert set(cached) == set(fresh)
        for queue, held in fresh.items():
            np.testing.assert_array_equal(cached[queue], held)
        # what a report counts: the allocations less the launches no LM answered yet
        for lmv in view.lms.values():
            assert lmv.unanswered <= set(lmv.inflight)
        fresh = usage_by_queue(view.allocations(accepted=True))
        reported = view.queue_usage(accepted=True)
        for queue in set(reported) | set(fresh):
            expected = fresh.get(queue, np.zeros_like(next(iter(reported.values()))))
            np.testing.assert_array_equal(reported.get(queue, expected), expected)


def test_a_shape_that_missed_matches_again_once_a_task_ends():
    states = federation(2, 2)
    view = view_of(states)
    placed = []
    for n in range(4):
        spec = task(f"t{n}", cpu=4000)
        found = view.match(spec)
        assert found is not None
        view.reserve(found, spec)
        placed.append((found.lm_id, spec.task_id))
    assert view.match(task("late", cpu=4000)) is None  # full: remembered as a miss
    lm_id, task_id = placed[0]
    view.release(lm_id, task_id, ended=True)
    assert view.match(task("late", cpu=4000)) is not None


# ------------------------------------------------------------ the feasibility cache
from services.core.constraints import to_mask  # noqa: E402

_GROWTH = st.lists(
    st.tuples(
        st.sampled_from(["ask", "ask", "add", "fill", "heartbeat", "full"]),
        st.integers(0, 1),  # LM
        st.sampled_from([2000, 4000, 8000, 16000]),  # cpu: of a new node, or asked for
        st.sampled_from([(), (0,), (1,), (0, 1)]),  # constraints
    ),
    min_size=5,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_GROWTH)
def test_the_feasibility_cache_follows_nodes_joining(ops):
    states = federation(2, 1)
    view = view_of(states)
    for n, (op, lm, cpu, constraints) in enumerate(ops):
        state = states[lm]
        if op == "add":  # a node joins: only a heartbeat tells the view
            capacity = resources(cpu_milli=cpu, memory_mb=8192, disk_mb=1000, net_mbps=1000)
            state.add_node(f"new{n}", capacity, to_mask(constraints))
        elif op == "fill":  # busy nodes change nothing about what could ever run
            state.launch("gm-a", task(f"busy{n}", cpu=1000), 0)
        elif op == "heartbeat":
            view.apply(state.snapshot(view.lms[f"lm-{lm}"].version), now=float(n))
        elif op == "full":
            view.apply(state.snapshot(), now=float(n))
        else:
            spec = task(f"t{n}", cpu=cpu, constraints=constraints)
            never = view.assess(spec).schedulability is Schedulability.INFEASIBLE
            assert (view.infeasible(spec) is not None) == never


def restarted(state: ClusterState, incarnation: int, nodes: list[str]) -> ClusterState:
    """The same LM after a restart: empty books, its workers back in another order."""
    again = ClusterState(state.lm_id, state.gm_ids, incarnation=incarnation)
    for i, node_id in enumerate(nodes):
        again.add_node(node_id, NODE, partition=i % 2)
    return again


def test_a_restarted_lm_replaces_the_view_though_its_versions_start_again():
    old = ClusterState("lm-0", GMS, incarnation=100)
    for i in range(4):
        old.add_node(f"w{i}", NODE, partition=i % 2)
    view = view_of([old])
    for n in range(30):  # a long first life: its versions are far ahead
        old.launch("gm-a", task(f"t{n}", cpu=100, mem=100), n % 2 * 2)
    assert view.apply(old.snapshot(), 1.0) is ApplyResult.APPLIED
    new = restarted(old, 200, ["w3", "w2", "w1", "w0"])
    new.launch("gm-a", task("fresh"), 0)
    assert new.version < old.version
    assert view.apply(new.snapshot(new.version - 1), 2.0) is ApplyResult.NEEDS_FULL
    assert view.restarted(1.5, within_s=30) == []
    assert view.apply(new.snapshot(), 2.0) is ApplyResult.APPLIED
    lmv = view.lms["lm-0"]
    assert lmv.incarnation == 200 and lmv.version == new.version
    # its workers may still be coming back: for a while the view knows it restarted
    assert view.restarted(31.9, within_s=30) == ["lm-0"]
    assert view.restarted(32.0, within_s=30) == []
    assert lmv.table.node_ids == ["w3", "w2", "w1", "w0"]
    assert set(lmv.allocations) == {"fresh"}
    np.testing.assert_array_equal(lmv.table.free, new.table.free)
    # a late heartbeat of the earlier life, full or not, changes nothing
    assert view.apply(old.snapshot(), 3.0) is ApplyResult.STALE
    assert view.lms["lm-0"].incarnation == 200 and set(view.lms["lm-0"].allocations) == {"fresh"}
    # and deltas of the new life apply as usual
    base = new.version
    new.release("fresh")
    assert view.apply(new.snapshot(base), 4.0) is ApplyResult.APPLIED
    assert not view.lms["lm-0"].allocations
    assert view.lms["lm-0"].restarted_at == 2.0  # the same life


def test_what_a_gm_learnt_about_an_lms_earlier_life_is_dropped_with_it():
    old = ClusterState("lm-0", GMS, incarnation=1)
    for i in range(2):
        old.add_node(f"w{i}", NODE, partition=0)
    view = view_of([old])
    placement = view.match(task("sent", cpu=4000))
    view.reserve(placement, task("sent", cpu=4000), now=0.0)  # never answered
    view.release("lm-0", "gone", ended=True, attempt=0, now=0.0)
    new = restarted(old, 2, ["w1", "w0"])
    assert view.apply(new.snapshot(), 1.0) is ApplyResult.APPLIED
    lmv = view.lms["lm-0"]
    assert not lmv.inflight and not lmv.ended and not lmv.unanswered
    # the launch no snapshot of the new life shows is not booked on whatever row it named
    np.testing.assert_array_equal(lmv.table.free, new.table.free)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["set", "del", "pop", "pop_missing", "clear"]),
            st.integers(0, 7),  # task id
            st.sampled_from(["a", "b", "c"]),  # queue
            st.integers(0, 5000),  # cpu
        ),
        max_size=60,
    )
)
def test_held_allocations_keep_each_queue_sum_whatever_comes_and_goes(ops):
    """The sums kept as allocations come and go equal a sum over what is there now."""
    held = HeldAllocations()
    model: dict[str, Allocation] = {}
    for op, key, queue, cpu in ops:
        task_id = f"t{key}"
        if op == "set":
            allocation = Allocation(task_id, queue, 0, resources(cpu, cpu // 2), 0, False, 0)
            held[task_id] = model[task_id] = allocation
        elif op == "del" and task_id in model:
            del held[task_id], model[task_id]
        elif op == "pop":
            assert held.pop(task_id, None) is model.pop(task_id, None)
        elif op == "pop_missing" and task_id not in model:
            with pytest.raises(KeyError):
                held.pop(task_id)
        elif op == "clear":
            held.clear()
            model.clear()
        assert dict(held) == model
        if cpu % 3 == 0:  # read now and then: the changes between pile up, then fold
            _same_sums(held, model)
    _same_sums(held, model)
    with pytest.raises(TypeError):
        held.update({})


def _same_sums(held: HeldAllocations, model: dict[str, Allocation]) -> None:
    expected = usage_by_queue(model.values())
    assert held.held.keys() == expected.keys()
    for q, vector in expected.items():
        assert (held.held[q] == vector).all()


def test_held_sums_are_kept_only_once_asked_for():
    """A view whose queues' usage nobody reads (no limits, no shares) sums nothing; the
    first read sums what is there, and the sums are kept from then on."""
    held = HeldAllocations(
        [Allocation(f"t{i}", "ab"[i % 2], 0, resources(100 * i, 1), 0, False, 0) for i in range(6)]
    )
    del held["t0"]
    held["t6"] = Allocation("t6", "a", 0, resources(7, 1), 0, False, 0)
    assert not held._pending and not held._count
    assert {q: v.tolist() for q, v in held.held.items()} == {
        "a": [200 + 400 + 7, 3, 0, 0],
        "b": [100 + 300 + 500, 3, 0, 0],
    }
    held.pop("t1")
    assert held.held["b"].tolist() == [800, 2, 0, 0]


def test_held_sums_fold_on_their_own_past_the_pending_bound():
    """Changes never read still fold once a queue keeps thousands pending (no growth
    without bound), and the sums stay exact."""
    held = HeldAllocations()
    model: dict[str, Allocation] = {}
    assert held.held == {}  # read once: from now on the sums are kept
    for i in range(10_000):
        allocation = Allocation(f"t{i}", "q", 0, resources(1 + i % 7, 3), 0, False, 0)
        held[allocation.task_id] = model[allocation.task_id] = allocation
        if i % 3 == 0:
            del held[f"t{i}"], model[f"t{i}"]
    assert all(len(side) <= 4097 for pending in held._pending.values() for side in pending)
    _same_sums(held, model)


# ---------------------------------------------------------------- silent LMs
from services.core.global_view import silent_after  # noqa: E402


def test_a_silent_lm_takes_no_task_until_it_is_heard_again():
    states = federation(2, 2)
    view = GlobalView("gm-a", silent_after_s=2.0)
    for state in states:
        view.apply(state.snapshot(), now=0.0)
    # lm-1 goes on sending heartbeats (nothing changed: the same version); lm-0 stops.
    view.apply(states[1].snapshot(since_version=states[1].version), now=2.5)
    assert view.silent("lm-0", 2.5) and not view.silent("lm-1", 2.5)
    placed = {view.match(task(f"t{i}", cpu=4000), now=2.5).lm_id for i in range(4)}
    assert placed == {"lm-1"}
    # Without a clock (the simulator's LMs never fall silent) every LM is matched.
    assert view.match(task("t9", cpu=4000)).lm_id == "lm-0"
    view.apply(states[0].snapshot(since_version=states[0].version), now=3.0)
    assert not view.silent("lm-0", 3.0)
    assert {view.match(task(f"t{i}", cpu=4000), now=3.0).lm_id for i in range(2)} == {
        "lm-0",
        "lm-1",
    }


def test_no_victim_is_chosen_on_a_silent_lm():
    (state,) = federation(1, 1)
    assert state.launch("gm-a", task("hog", cpu=4000, queue="hog"), 0).ok
    view = GlobalView("gm-a", silent_after_s=2.0)
    view.apply(state.snapshot(), now=0.0)
    fair = FairShare([QueueShare("hog", 0.5), QueueShare("small", 0.5)])
    small = task("s", cpu=1000, queue="small")
    assert isinstance(view.preemption_plan(small, fair, now=1.0), PreemptionPlan)
    assert view.preemption_plan(small, fair, now=3.0) == (
        "no node could hold it even after preempting queue hog"
    )


def test_an_lm_is_silent_after_a_few_heartbeats_and_never_within_two_seconds():
    assert silent_after(1.0) == 5.0
    assert silent_after(0.25) == 2.0


def test_a_gangs_tasks_are_never_preemption_victims():
    """Preempting one task of a gang would leave the rest running without it (issue 33):
    the GM never picks one, and the LM refuses a preemption that names one, also once
    the view came through the wire (``Allocation.gang``)."""
    (state,) = federation(1, 2)
    for i, node in enumerate([0, 0, 1, 1]):
        gm = "gm-a" if node == 0 else "gm-b"
        spec = replace(task(f"hog{i}", cpu=2000, mem=1000, queue="hog"), gang=i != 1)
        state.launch(gm, spec, node)
    wire = snapshot_from_proto(snapshot_to_proto(state.snapshot()), state.table.num_constraints)
    assert {a.task_id for a in wire.allocations if a.gang} == {"hog0", "hog2", "hog3"}
    view = GlobalView("gm-a")
    view.apply(wire, 0.0)
    fair = FairShare([QueueShare("hog", 0.5), QueueShare("small", 0.5)])
    plan = view.preemption_plan(task("s1", cpu=2000, queue="small"), fair)
    assert isinstance(plan, PreemptionPlan) and plan.victims.task_ids == ("hog1",)
    plan = view.preemption_plan(task("s2", cpu=4000, queue="small"), fair)
    assert not isinstance(plan, PreemptionPlan)  # only gang tasks would make room
    refused = state.preempt("gm-a", task("s2", cpu=2000, queue="small"), 0, ["hog0"], bool)
    assert refused.status is PlacementStatus.REJECTED_VICTIMS and "gang" in refused.reason
