from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.cancels import CancelledJobs
from services.core.cluster_state import ClusterState
from services.core.gang import Gang, GangPiece, GangPlan, VdcLayout, plan_gang
from services.core.global_view import GlobalView
from services.core.reservations import (
    DEFAULT_TTL_S,
    TTL_MAX_S,
    TTL_MIN_S,
    Held,
    Reservations,
    held_for,
    is_placeholder,
    room_id,
)
from services.core.resources import NET, resources
from services.core.status import PlacementStatus as S
from services.core.task import TaskSpec
from services.core.vdc import Vdc
from tests.builders import NODE, task

GMS = ("gm-a", "gm-b")


def lm(nodes: int = 2) -> ClusterState:
    state = ClusterState("lm-1", GMS)
    for i in range(nodes):
        state.add_node(f"w{i}", NODE, partition=i % 2)
    return state


def piece(i: int, node: int, cpu: int = 1000, member: int | None = None) -> GangPiece:
    t = task(f"t{i}", cpu=cpu, job_id="j")
    return GangPiece(i if member is None else member, t, "lm-1", node, f"w{node}", node % 2 == 1)


def books(state: ClusterState) -> tuple:
    table = state.table
    return table.free.copy(), table.usage_mean.copy(), table.usage_var.copy()


def assert_books(state: ClusterState, before: tuple) -> None:
    for now, then in zip(books(state), before, strict=True):
        np.testing.assert_array_equal(now, then)


def test_reserve_holds_the_room_and_commit_turns_it_into_the_tasks():
    state = lm()
    res = Reservations(state)
    pieces = [piece(0, 0), piece(1, 0), piece(2, 1)]
    verdict = res.reserve("j/1", pieces, now=0.0, ttl_s=5.0, gm_id="gm-a")
    assert verdict.ok and len(verdict.allocations) == 3
    assert all(is_placeholder(t) for t in state.allocations)
    assert state.table.free[0].tolist() == [2000, 3000]  # held: no other task gets it
    assert not state.launch("gm-a", task("other", cpu=2500), 0).ok
    committed = res.commit("j/1", now=1.0)
    assert committed.ok and sorted(state.allocations) == ["t0", "t1", "t2"]
    assert state.allocations["t2"].logical  # on gm-b's node: a repartition
    assert state.table.free[0].tolist() == [2000, 3000]
    assert res.commit("j/1", now=2.0) is committed  # committed twice: the same answer
    assert res.state("j/1") is Held.COMMITTED


def test_a_retry_gets_the_same_verdict_other_pieces_are_refused():
    state = lm()
    res = Reservations(state)
    first = res.reserve("j/1", [piece(0, 0)], 0.0, 5.0, gm_id="gm-a")
    assert res.reserve("j/1", [piece(0, 0)], 1.0, 5.0, gm_id="gm-a") is first
    other = res.reserve("j/1", [piece(0, 0), piece(1, 0)], 1.0, 5.0, gm_id="gm-a")
    assert other.status is S.REJECTED_INVALID
    assert other.reason == "gang j/1 is already held here with other pieces"
    assert len(state.allocations) == 1


def test_a_refused_piece_leaves_nothing_held():
    state = lm()
    res = Reservations(state)
    before = books(state)
    verdict = res.reserve("j/1", [piece(0, 0), piece(1, 1, cpu=5000)], 0.0, 5.0, gm_id="gm-a")
    assert verdict.status is S.REJECTED_RESOURCES
    assert verdict.reason.startswith("t1 on w1: node w1 has cpu=4")
    assert not state.allocations and res.held() == []
    assert_books(state, before)


def test_a_reservation_is_held_as_long_as_asked_within_the_bounds():
    """What the LM's ReserveGang and the simulator hold a gang's room for."""
    assert held_for(0.0) == DEFAULT_TTL_S  # a GM that asks nothing
    assert held_for(2.5) == 2.5
    assert held_for(0.01) == TTL_MIN_S and held_for(600.0) == TTL_MAX_S


def test_a_cancelled_jobs_gang_holds_nothing_first_try_or_retry():
    """The LM's ReserveGang and the simulator share this check (the LM made it apart)."""
    state = lm()
    cancelled = CancelledJobs()
    res = Reservations(state, cancelled)
    held = res.reserve("j/1", [piece(0, 0)], 0.0, 5.0, gm_id="gm-a")
    assert held.ok
    cancelled.add("j", "user asked")
    retried = res.reserve("j/1", [piece(0, 0)], 1.0, 5.0, gm_id="gm-a")
    assert retried.status is S.REJECTED_CANCELLED
    assert retried.reason == "job j was cancelled: user asked"
    before = books(state)
    fresh = res.reserve("j/2", [piece(1, 1)], 1.0, 5.0, gm_id="gm-a")
    assert fresh.status is S.REJECTED_CANCELLED and res.state("j/2") is None
    assert_books(state, before)


def test_release_and_expire_give_back_exactly_and_refuse_the_id_for_a_while():
    state = lm()
    res = Reservations(state)
    before = books(state)
    res.reserve("j/1", [piece(0, 0)], 0.0, 5.0, gm_id="gm-a")
    res.reserve("j/2", [piece(1, 1)], 0.0, 2.0, gm_id="gm-a")
    assert res.release("j/1", now=1.0) and not res.release("j/1", now=1.0)
    assert res.expire(1.9) == []
    assert res.expire(2.0) == ["j/2"]
    assert_books(state, before)
    late = res.reserve("j/1", [piece(0, 0)], 3.0, 5.0, gm_id="gm-a")
    assert late.status is S.REJECTED_EXPIRED and late.reason == "gang j/1 was released"
    assert res.commit("j/2", 3.0).status is S.REJECTED_EXPIRED
    assert_books(state, before)
    res.expire(10.0)  # past their ttl: forgotten
    assert res.state("j/1") is None and res.next_deadline() is None


def test_commit_after_the_deadline_is_refused_and_releases():
    state = lm()
    res = Reservations(state)
    before = books(state)
    res.reserve("j/1", [piece(0, 0), piece(1, 1)], 0.0, 5.0, gm_id="gm-a")
    verdict = res.commit("j/1", now=5.0)
    assert verdict.status is S.REJECTED_EXPIRED
    assert verdict.reason == "gang j/1's reservation expired"
    assert_books(state, before)
    assert not state.allocations


def test_a_lost_node_fails_the_whole_commit():
    state = lm()
    res = Reservations(state)
    res.reserve("j/1", [piece(0, 0), piece(1, 1)], 0.0, 5.0, gm_id="gm-a")
    state.set_alive(1, False)
    verdict = res.commit("j/1", 1.0)
    assert verdict.status is S.REJECTED_NODE_DEAD
    assert not state.allocations  # t0 neither: never part of a gang
    assert state.table.free[:, 0].tolist() == NODE.tolist()


def test_a_vdc_layout_is_checked_on_this_lms_uplinks():
    state = lm()
    res = Reservations(state)
    vdc = Vdc(bandwidth_per_core=100, vlink_cap=177)
    # Three one-core members: two here on w0, one on another LM (slot 1).
    layout = VdcLayout(vdc, np.array([1000, 1000, 1000]), np.array([0, 0, 1]))
    shares = [piece(0, 0), piece(1, 0)]
    wrong = res.reserve("j/1", shares, 0.0, 5.0, gm_id="gm-a", layout=layout)
    assert wrong.status is S.REJECTED_INVALID and "disagrees" in wrong.reason
    booked = []
    for p in shares:
        vector = p.task.resources.copy()
        vector[NET] = 100  # each sends one vlink off the node
        booked.append(
            GangPiece(p.member, replace(p.task, resources=vector), "lm-1", 0, "w0", False)
        )
    state.launch("gm-a", TaskSpec("hog", resources(1, 1, 0, 950)), 0)  # 50 Mbit/s left
    full = res.reserve("j/2", booked, 0.0, 5.0, gm_id="gm-a", layout=layout)
    assert full.status is S.REJECTED_RESOURCES
    assert full.reason == (
        "node w0 would carry 200 Mbit/s of VDC traffic (2 of 3 members there) over an "
        "uplink with 50 Mbit/s free"
    )
    state.release("hog")
    assert res.reserve("j/3", booked, 0.0, 5.0, gm_id="gm-a", layout=layout).ok


# ------------------------------------------------------------------ property
ops = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "retry", "commit", "release", "expire", "kill"]),
        st.integers(0, 3),  # which gang
        st.floats(0, 3),  # time passing
    ),
    max_size=25,
)


@settings(max_examples=120, deadline=None)
@given(ops=ops, sizes=st.lists(st.integers(1, 6), min_size=4, max_size=4))
def test_no_partial_gang_and_free_room_returns_exactly(ops, sizes):
    """Whatever the order of reserves, retries, commits, releases, timeouts and lost
    nodes: a gang's tasks are all on the books or none are, placeholders exist only for
    held reservations, and the books equal the start less what committed gangs hold."""
    lms = {"lm-1": lm(3)}
    state = lms["lm-1"]
    start = books(state)
    view = GlobalView("gm-a")
    view.apply(state.snapshot(), 0.0)
    plans: dict[int, GangPlan] = {}
    for g, size in enumerate(sizes):
        members = tuple(task(f"g{g}t{i}", cpu=1000, job_id=f"g{g}") for i in range(size))
        plan = plan_gang(Gang(f"g{g}", members), view)  # planned on the empty LM
        if isinstance(plan, GangPlan):
            plans[g] = plan
    res = Reservations(state)
    lost: set[str] = set()  # committed gangs that lost a member to a dead node
    now = 0.0
    for op, g, dt in ops:
        now += dt
        plan = plans.get(g)
        if op in ("reserve", "retry") and plan is not None:
            verdict = res.reserve(plan.gang_id, plan.pieces, now, 2.0, gm_id="gm-a")
            # A refusal (the id expired or was released) holds nothing: ``check``.
            assert verdict.ok == (res.state(plan.gang_id) in (Held.HELD, Held.COMMITTED))
        elif op == "commit" and plan is not None:
            res.commit(plan.gang_id, now)
        elif op == "release" and plan is not None:
            res.release(plan.gang_id, now)
        elif op == "expire":
            res.expire(now)
        elif op == "kill":  # a node dies and comes back
            for plan in plans.values():
                held = [state.allocations.get(p.task.task_id) for p in plan.pieces]
                if any(a is not None and a.node == g % 3 for a in held):
                    lost.add(plan.gang_id)  # the rest is the lifecycle's to restart
            state.set_alive(g % 3, False)
            state.set_alive(g % 3, True)
        check(state, res, plans, start, lost)
    for gang_id in res.held():
        res.release(gang_id, now)
    check(state, res, plans, start, lost)


def check(state, res, plans, start, lost):
    expected = start[0].copy()
    for plan in plans.values():
        ids = [p.task.task_id for p in plan.pieces]
        on_books = [i in state.allocations for i in ids]
        whole = all(on_books) or not any(on_books)
        assert whole or plan.gang_id in lost, f"part of {plan.gang_id} runs"
        holders = [a for a in state.allocations if a.startswith(tuple(i + "#" for i in ids))]
        if res.state(plan.gang_id) is not Held.HELD:
            assert not holders, f"{plan.gang_id} holds room while not reserved"
        for allocation in state.allocations.values():
            if allocation.task_id in ids or allocation.task_id in holders:
                expected[:, allocation.node] -= allocation.resources
    np.testing.assert_array_equal(state.table.free, expected)
    if not state.allocations:
        assert_books(state, start)


def test_a_gang_refused_by_one_lm_leaves_nothing_held_on_the_other():
    lms = {}
    for name in ("lm-0", "lm-1"):
        state = ClusterState(name, GMS)
        state.add_node(f"{name}-w0", NODE, partition=0)
        lms[name] = state
    view = GlobalView("gm-a")
    for state in lms.values():
        view.apply(state.snapshot(), 0.0)
    members = tuple(task(f"t{i}", cpu=1000, job_id="j") for i in range(8))
    plan = plan_gang(Gang("j/1", members), view)
    assert isinstance(plan, GangPlan) and set(plan.by_lm()) == {"lm-0", "lm-1"}
    before = {name: books(state) for name, state in lms.items()}
    lms["lm-1"].launch("gm-a", task("late", cpu=500), 0)  # the view is stale now
    reservations = {name: Reservations(state) for name, state in lms.items()}
    verdicts = {
        name: reservations[name].reserve("j/1", pieces, 0.0, 5.0, gm_id="gm-a")
        for name, pieces in plan.by_lm().items()
    }
    assert verdicts["lm-0"].ok and verdicts["lm-1"].status is S.REJECTED_RESOURCES
    # The GM releases the gang everywhere (any refusal releases every piece).
    assert reservations["lm-0"].release("j/1", now=0.0)
    assert_books(lms["lm-0"], before["lm-0"])
    assert not lms["lm-0"].allocations
    assert sorted(lms["lm-1"].allocations) == ["late"]


def preempted_for(state: ClusterState, res: Reservations, job: str, *victims: str, now=0.0):
    """The LM's StopTasks with ``for_job_id``: each victim off the books, its room held."""
    for victim in victims:
        allocation = state.release(victim)
        assert allocation is not None
        res.hold_room(job, allocation, now, ttl_s=5.0)


def hog(state: ClusterState, *nodes: int) -> list[str]:
    """Fill ``nodes`` with queue b's 1-core tasks; their ids."""
    ids = []
    for node in nodes:
        for k in range(4):
            t = replace(task(f"b{node}.{k}", cpu=1000, job_id="hog"), queue="b")
            assert state._place("gm-a" if node % 2 == 0 else "gm-b", t, node, False).ok
            ids.append(t.task_id)
    return ids


def test_room_preempted_for_a_gang_is_held_for_its_job_alone():
    """A victim's room stays booked (a placeholder in the victim's queue, never a victim
    itself) for the gang job it was preempted for: another GM's launch and the victims'
    next attempts are refused it; the job's reserve takes it."""
    state = lm(1)
    res = Reservations(state)
    hog(state, 0)
    preempted_for(state, res, "j", "b0.0", "b0.1")
    holders = res.rooms_held("j")
    assert holders == [room_id("b0.0", "j"), room_id("b0.1", "j")]
    assert all(is_placeholder(h) for h in holders)
    held = state.allocations[holders[0]]
    assert held.queue == "b" and held.gang and held.node == 0
    assert state.table.free[0, 0] == 0  # nothing to take
    assert state.launch("gm-a", task("other", cpu=1000, job_id="x"), 0).status is (
        S.REJECTED_RESOURCES
    )
    retry = replace(task("b0.0", cpu=1000, job_id="hog", attempt=1), queue="b")
    assert state.launch("gm-a", retry, 0).status is S.REJECTED_RESOURCES
    # Another job's gang is refused the room too.
    other = [GangPiece(0, task("o0", cpu=1000, job_id="o"), "lm-1", 0, "w0", False)]
    assert res.reserve("o/1", other, 0.5, 5.0, gm_id="gm-a").status is S.REJECTED_RESOURCES
    assert res.rooms_held("j") == holders  # still held
    verdict = res.reserve("j/1", [piece(0, 0), piece(1, 0)], 1.0, 5.0, gm_id="gm-a")
    assert verdict.ok and res.rooms_held("j") == []
    assert not any(h in state.allocations for h in holders)
    assert res.commit("j/1", 1.5).ok
    assert {"t0", "t1"} <= set(state.allocations)


def test_a_refused_reserve_keeps_the_held_room_and_expiry_frees_it_exactly():
    state = lm(1)
    res = Reservations(state)
    victims = hog(state, 0)
    for v in victims[2:]:
        state.release(v)  # two of b's tasks ended on their own
    empty = books(state)
    first = state.allocations["b0.0"]
    preempted_for(state, res, "j", *victims[:2], now=0.0)
    res.hold_room("j", first, 0.0, 5.0)  # the same victim again: nothing more held
    assert len(res.rooms_held("j")) == 2
    assert res.next_deadline() == 5.0
    held_books = books(state)
    # Five cores on a four-core node: refused, and the room is held again as it was.
    pieces = [piece(i, 0) for i in range(5)]
    assert res.reserve("j/1", pieces, 1.0, 5.0, gm_id="gm-a").status is S.REJECTED_RESOURCES
    assert len(res.rooms_held("j")) == 2
    assert_books(state, held_books)
    assert res.expire(4.9) == [] and len(res.rooms_held("j")) == 2
    res.expire(5.0)  # no reserve took it: free for anyone
    assert res.rooms_held("j") == [] and res.next_deadline() is None
    for v in victims[2:]:
        assert v not in state.allocations
    np.testing.assert_array_equal(state.table.free, empty[0] + 2 * resources(1000, 1024)[:, None])


def test_a_gang_plan_counts_the_room_held_for_it_free():
    state = lm(1)
    res = Reservations(state)
    hog(state, 0)
    preempted_for(state, res, "j", "b0.0", "b0.1")
    view = GlobalView("gm-a")
    view.apply(state.snapshot(), 0.0)
    gang = Gang("j/1", tuple(task(f"t{i}", cpu=1000, job_id="j") for i in range(2)))
    assert not isinstance(plan_gang(gang, view, judge_never=False), GangPlan)  # no room
    held = [("lm-1", h) for h in res.rooms_held("j")]
    plan = plan_gang(gang, view, judge_never=False, held=held)
    assert isinstance(plan, GangPlan) and {p.node for p in plan.pieces} == {0}
    assert res.reserve("j/1", list(plan.pieces), 0.5, 5.0, gm_id="gm-a").ok
    # Room held for another job, or gone, counts for nothing.
    other = plan_gang(gang, view, judge_never=False, held=[("lm-1", room_id("b0.2", "j"))])
    assert not isinstance(other, GangPlan)


def test_room_a_dead_node_dropped_is_not_booked_again_on_a_refusal():
    state = lm(2)
    res = Reservations(state)
    hog(state, 0)
    preempted_for(state, res, "j", "b0.0")
    state.set_alive(0, False)  # the placeholder goes with the node
    state.set_alive(0, True)
    assert state.launch("gm-a", task("late", cpu=1000, job_id="x"), 0).ok  # in its room
    before = books(state)
    pieces = [piece(i, 0) for i in range(5)]  # never fits: refused
    assert res.reserve("j/1", pieces, 1.0, 5.0, gm_id="gm-a").status is S.REJECTED_RESOURCES
    assert room_id("b0.0", "j") not in state.allocations and res.rooms_held("j") == []
    assert_books(state, before)
