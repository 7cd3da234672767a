import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.cluster_state import ClusterState
from services.core.gang import Gang, GangError, GangPlan, book, plan_gang, unbook
from services.core.global_view import GlobalView
from services.core.reservations import Reservations
from services.core.resources import NET, resources
from services.core.status import Schedulability
from services.core.vdc import Vdc, fits_uplinks, uplink_demand
from tests.builders import NODE, task

GMS = ("gm-a", "gm-b")


def federation(lms: int = 2, per_lm: int = 2, masks=None) -> dict[str, ClusterState]:
    """LMs of ``per_lm`` nodes, alternately in gm-a's and gm-b's partitions."""
    out = {}
    for lm in range(lms):
        state = ClusterState(f"lm-{lm}", GMS)
        for i in range(per_lm):
            mask = 0 if masks is None else masks[lm * per_lm + i]
            state.add_node(f"lm{lm}-w{i}", NODE, mask, partition=i % 2)
        out[state.lm_id] = state
    return out


def view_of(lms: dict[str, ClusterState], now: float = 0.0, gm: str = "gm-a") -> GlobalView:
    view = GlobalView(gm, silent_after_s=10.0)
    for state in lms.values():
        view.apply(state.snapshot(), now)
    return view


def gang(size: int, cpu: int = 1000, **kwargs) -> Gang:
    members = tuple(task(f"t{i}", cpu=cpu, job_id="j") for i in range(size))
    return Gang("j/1", members, **kwargs)


def test_a_gang_spans_lms_and_partitions_own_partition_first():
    lms = federation()
    plan = plan_gang(gang(16), view_of(lms))  # 4 nodes of 4 cores: every one of them
    assert isinstance(plan, GangPlan) and len(plan.pieces) == 16
    where = {(p.lm_id, p.node_id, p.repartition) for p in plan.pieces}
    assert where == {
        ("lm-0", "lm0-w0", False),
        ("lm-1", "lm1-w0", False),
        ("lm-0", "lm0-w1", True),
        ("lm-1", "lm1-w1", True),
    }
    small = plan_gang(gang(8), view_of(lms))
    assert {p.repartition for p in small.pieces} == {False}  # Launch room first
    assert list(small.by_lm()) == ["lm-0", "lm-1"]


def test_no_partial_plan_only_a_reason():
    lms = federation()
    lms["lm-1"].launch("gm-a", task("busy", cpu=4000, mem=1), 0)
    verdict = plan_gang(gang(16), view_of(lms))
    assert verdict.schedulability is Schedulability.UNSCHEDULABLE
    assert "all the room together is short of cpu_milli" in verdict.reason
    never = plan_gang(gang(17), view_of(lms))
    assert never.schedulability is Schedulability.INFEASIBLE
    assert never.reason.startswith("the gang cannot start even on empty nodes (17 of its 17")


def test_a_caller_that_judged_never_at_submission_may_skip_it():
    verdict = plan_gang(gang(17), view_of(federation()), judge_never=False)
    assert verdict.schedulability is Schedulability.UNSCHEDULABLE


def test_min_tasks_starts_with_enough_of_them():
    plan = plan_gang(gang(20, min_tasks=16), view_of(federation()))
    assert isinstance(plan, GangPlan) and len(plan.pieces) == 16


def test_every_member_needs_a_node_with_all_the_gangs_constraints():
    lms = federation(masks=[0b1, 0b11, 0b1, 0b1])
    members = (task("a", constraints=(0,)), task("b", constraints=(1,)))
    plan = plan_gang(Gang("g", members), view_of(lms))
    assert {p.node_id for p in plan.pieces} == {"lm0-w1"}
    never = plan_gang(Gang("g", (task("a", constraints=(2,)),)), view_of(lms))
    assert never.schedulability is Schedulability.INFEASIBLE
    assert never.reason == "no node has every constraint the gang's members need"


def test_a_silent_lm_takes_no_member():
    lms = federation()
    view = view_of(lms)
    view.apply(lms["lm-1"].snapshot(), 20.0)  # only lm-1 was heard lately
    plan = plan_gang(gang(8), view, now=20.0)
    assert {p.lm_id for p in plan.pieces} == {"lm-1"}
    assert plan_gang(gang(9), view, now=20.0).schedulability is Schedulability.UNSCHEDULABLE


def test_a_vdc_plan_books_each_members_uplink_share():
    vdc = Vdc(bandwidth_per_core=100, vlink_cap=177)
    plan = plan_gang(gang(6, vdc=vdc), view_of(federation()))
    assert plan.layout is not None and plan.layout.vdc == vdc
    nets = sorted(int(p.task.resources[NET]) for p in plan.pieces)
    assert nets == [200, 200, 200, 200, 400, 400]  # 4 + 2 members: 4x2x100, 2x4x100


def test_bad_gangs_are_refused_with_reasons():
    with pytest.raises(GangError, match="has no members"):
        Gang("g", ())
    with pytest.raises(GangError, match="names a task twice"):
        Gang("g", (task("a"), task("a")))
    with pytest.raises(GangError, match=r"min_tasks 3 is not in 0..2"):
        Gang("g", (task("a"), task("b")), min_tasks=3)
    with pytest.raises(GangError, match="needs a gang_id"):
        Gang("", (task("a"),))


def test_book_and_unbook_leave_the_view_as_it_was():
    view = view_of(federation())
    before = {lm: v.table.free.copy() for lm, v in view.lms.items()}
    plan = plan_gang(gang(10), view)
    book(view, plan, now=0.0)
    assert plan_gang(gang(7), view).schedulability is Schedulability.UNSCHEDULABLE
    unbook(view, plan)
    for lm, v in view.lms.items():
        np.testing.assert_array_equal(v.table.free, before[lm])


member = st.tuples(st.integers(100, 4000), st.integers(1, 8192))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(member, min_size=1, max_size=12),
    busy=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4000)), max_size=6),
    uplinks=st.lists(st.integers(0, 2000), min_size=6, max_size=6),
    vdc=st.none() | st.builds(Vdc, st.floats(0, 300), st.floats(0, 400)),
    need=st.integers(0, 12),
)
def test_a_plan_is_whole_fits_every_node_and_every_lm_accepts_it(sizes, busy, uplinks, vdc, need):
    lms = {}
    for lm in range(2):
        state = ClusterState(f"lm-{lm}", GMS)
        for i in range(3):
            up = uplinks[lm * 3 + i]
            state.add_node(f"lm{lm}-w{i}", resources(4000, 8192, 1000, up), 0, i % 2)
        lms[state.lm_id] = state
    for n, (node, cpu) in enumerate(busy):
        lms[f"lm-{node // 3}"].launch(GMS[node % 3 % 2], task(f"b{n}", cpu=cpu, mem=1), node % 3)
    members = tuple(task(f"t{i}", cpu=c, mem=m, job_id="j") for i, (c, m) in enumerate(sizes))
    g = Gang("j/1", members, min_tasks=min(need, len(members)), vdc=vdc)
    view = view_of(lms)
    outcome = plan_gang(g, view)
    if not isinstance(outcome, GangPlan):
        assert outcome.schedulability is not Schedulability.SCHEDULABLE
        return
    assert g.needed <= len(outcome.pieces) <= len(members)
    # No node is over-committed, uplink included.
    for lm_id, pieces in outcome.by_lm().items():
        table = lms[lm_id].table
        used = np.zeros_like(table.free)
        for piece in pieces:
            used[:, piece.node] += piece.task.resources
        assert (used <= table.free).all()
    if vdc is not None:
        layout = outcome.layout
        free = np.zeros(int(layout.slots.max()) + 1, dtype=np.int64)
        for piece in outcome.pieces:
            free[layout.slots[piece.member]] = lms[piece.lm_id].table.free[NET, piece.node]
        assert fits_uplinks(vdc, layout.cpu_milli, layout.slots, free)
        demand = uplink_demand(vdc, layout.cpu_milli, layout.slots, len(free))
        assert demand.sum() == sum(int(p.task.resources[NET]) for p in outcome.pieces)
    # The LMs, judging the same state with the same code, accept every piece.
    for lm_id, pieces in outcome.by_lm().items():
        reservations = Reservations(lms[lm_id])
        verdict = reservations.reserve("j/1", pieces, 0.0, 5.0, gm_id="gm-a", layout=outcome.layout)
        assert verdict.ok, verdict.reason
        assert reservations.commit("j/1", 1.0).ok
