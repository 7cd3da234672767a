"""Gangs in queues with a limit (issue 33): the members that start together fit what the
queue holds (``limit_gang``, ``Scheduler.plan_gang``); a gang whose starting members ask
more than the limit is refused (``gang_never_fits``); the dry run says either."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.cluster_state import ClusterState
from services.core.dry_run import Outcome, dry_run_gang
from services.core.gang import Gang, GangPlan, book, gang_never_fits, limit_gang
from services.core.global_view import GlobalView
from services.core.limits import LimitLedger, QueueLimits
from services.core.scheduler import Scheduler
from services.core.status import Schedulability, Verdict
from services.core.user_queues import UserQueues
from tests.builders import NODE, task


def gang(size: int, cpu: int = 1000, min_tasks: int = 0, queue: str = "q") -> Gang:
    members = tuple(task(f"t{i}", cpu=cpu, queue=queue, job_id="j") for i in range(size))
    return Gang("j/1", members, min_tasks)


def scheduler(limit: str, nodes: int = 4) -> tuple[Scheduler, ClusterState]:
    state = ClusterState("lm-0", ("gm-a",))
    for i in range(nodes):
        state.add_node(f"w{i}", NODE)  # 4 CPUs each
    limits = QueueLimits.parse([("q", limit)])
    sched = Scheduler(GlobalView("gm-a"), UserQueues(["q", "free"]), None, limits)
    sched.lm_ids = {"lm-0"}
    sched.apply(state.snapshot(), 0.0)
    return sched, state


def test_a_gang_within_the_limit_is_planned_whole():
    sched, _ = scheduler("cpu=4")
    plan = sched.plan_gang("q", gang(4), 0.0)
    assert isinstance(plan, GangPlan) and len(plan.pieces) == 4


def test_a_gang_past_what_its_queue_may_still_hold_waits_with_the_reason():
    sched, state = scheduler("cpu=4")
    state.launch("gm-a", task("held", cpu=1000, queue="q", job_id="other"), 0)
    sched.apply(state.snapshot(), 1.0)
    waits = sched.plan_gang("q", gang(4), 1.0)
    assert isinstance(waits, Verdict)
    assert waits.schedulability is Schedulability.UNSCHEDULABLE
    assert waits.reason == (
        "4 tasks together: queue 'q' is at its limit (cpu 1 of 4 held, needs 4); "
        "waiting for its tasks to end"
    )
    # Another queue's gang of the same size is not held back by q's limit.
    assert isinstance(sched.plan_gang("free", gang(4, queue="free"), 1.0), GangPlan)
    # Once q's task ended, the gang starts whole.
    state.release("held")
    sched.apply(state.snapshot(), 2.0)
    assert isinstance(sched.plan_gang("q", gang(4), 2.0), GangPlan)


def test_min_tasks_starts_as_many_as_the_limit_lets_and_no_fewer_than_min():
    sched, _ = scheduler("cpu=3")
    plan = sched.plan_gang("q", gang(5, min_tasks=2), 0.0)
    assert isinstance(plan, GangPlan)
    assert sorted(p.task.task_id for p in plan.pieces) == ["t0", "t1", "t2"]
    book(sched.view, plan, 0.0)  # booked: what the queue holds counts it
    again = sched.plan_gang("q", gang(2, min_tasks=1), 0.0)
    assert isinstance(again, Verdict) and "cpu 3 of 3 held" in again.reason


def test_a_gang_whose_starting_members_exceed_the_limit_is_refused_with_the_numbers():
    limits = QueueLimits.parse([("q", "cpu=3")])
    assert gang_never_fits(gang(4), "q", limits) == (
        "the 4 tasks that start together ask for more than queue 'q' may ever hold (cpu 4 > 3)"
    )
    assert gang_never_fits(gang(4, min_tasks=3), "q", limits) is None
    assert gang_never_fits(gang(4), "other", limits) is None
    sched, _ = scheduler("cpu=3")
    assert "may ever hold (cpu 4 > 3)" in (sched.gang_never_runs("q", gang(4), 0.0) or "")
    outlooks = dry_run_gang(sched, "q", gang(4), 0.0)
    assert {o.outcome for o in outlooks} == {Outcome.NEVER}
    assert "may ever hold (cpu 4 > 3)" in outlooks[0].reason


def test_the_dry_run_of_a_gang_past_the_limit_says_it_waits_for_the_limit():
    sched, state = scheduler("cpu=4")
    state.launch("gm-a", task("held", cpu=2000, queue="q", job_id="other"), 0)
    sched.apply(state.snapshot(), 1.0)
    outlooks = dry_run_gang(sched, "q", gang(3), 1.0)
    assert {o.outcome for o in outlooks} == {Outcome.WAITS}
    assert "is at its limit (cpu 2 of 4 held, needs 3)" in outlooks[0].reason


def test_an_unknown_holding_makes_the_gang_wait_with_that_reason():
    limits = QueueLimits.parse([("q", "cpu=4")])
    ledger = LimitLedger(limits, {}, unknown="this GM has not heard from lm-9 yet")
    waits = limit_gang(gang(2), "q", ledger)
    assert isinstance(waits, Verdict) and waits.reason == "this GM has not heard from lm-9 yet"
    free = gang(2)
    assert limit_gang(free, "q", None) is free  # no ledger: no limit served here


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    held=st.integers(0, 8),
    limit=st.integers(1, 12),
    need=st.integers(0, 8),
)
def test_a_limited_gang_never_takes_the_queue_past_its_limit(sizes, held, limit, need):
    members = tuple(task(f"t{i}", cpu=c * 1000, queue="q", job_id="j") for i, c in enumerate(sizes))
    g = Gang("j/1", members, min(need, len(members)))
    limits = QueueLimits.parse([("q", f"cpu={limit}")])
    usage = {"q": np.array([held * 1000, 0, 0, 0], dtype=np.int64)}
    out = limit_gang(g, "q", LimitLedger(limits, usage))
    if isinstance(out, Verdict):
        assert out.schedulability is Schedulability.UNSCHEDULABLE
        assert held * 1000 + sum(m.resources[0] for m in members[: g.needed]) > limit * 1000
        return
    taken = sum(int(m.resources[0]) for m in out.members)
    assert held * 1000 + taken <= limit * 1000
    assert len(out.members) >= g.needed and out.members == members[: len(out.members)]
