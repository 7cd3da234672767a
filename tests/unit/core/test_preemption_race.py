"""The GM -> LM preemption protocol on the core classes the services run: a victim that
finished between the GM's decision and the LM's check is refused by the LM, the GM
corrects its view from the reply and decides again, and nothing runs twice."""

from services.core.cluster_state import ClusterState
from services.core.fairness import FairShare, QueueShare
from services.core.global_view import ApplyResult, GlobalView, PreemptionPlan
from services.core.status import PlacementStatus as S
from tests.builders import NODE, task

FAIR = FairShare([QueueShare("hog", 0.5), QueueShare("small", 0.5)])


def over_share(state: ClusterState):
    usage, total = state.queue_usage(), state.table.capacity.sum(axis=1)
    return lambda queue: FAIR.is_over_share(queue, usage, total)


def test_a_victim_that_finished_first_is_refused_and_the_gm_retries_with_fresh_state():
    lm = ClusterState("lm-0", ("gm-a",))
    for i in range(2):
        lm.add_node(f"w{i}", NODE)
    for i in range(8):  # the hog fills both nodes: 2 x 4 one-core tasks
        assert lm.launch("gm-a", task(f"hog{i}", cpu=1000, queue="hog"), i // 4).ok
    view = GlobalView("gm-a")
    assert view.apply(lm.snapshot(), now=0.0) is ApplyResult.APPLIED

    small = task("s1", cpu=1000, queue="small")
    assert view.match(small) is None
    plan = view.preemption_plan(small, FAIR)
    assert isinstance(plan, PreemptionPlan) and plan.victims.queue == "hog"
    (victim,) = plan.victims.task_ids
    view.reserve_preemption(plan, small)

    # The victim ends on its own before the Preempt request reaches the LM.
    lm.release(victim)
    decision = lm.preempt("gm-a", small, plan.victims.node, [victim], over_share(lm))
    assert decision.status is S.REJECTED_VICTIMS
    assert f"victim {victim} no longer runs" in decision.reason
    assert set(lm.allocations) == {f"hog{i}" for i in range(8)} - {victim}

    # The GM undoes its booking and applies the state the LM sent with the refusal.
    view.release(plan.lm_id, small.task_id)
    view.apply(lm.snapshot(view.lms[plan.lm_id].version), now=1.0)
    retry = view.match(small)
    assert retry is not None, "the freed core is visible at once: no preemption needed"
    assert lm.launch("gm-a", small, retry.node).status is S.ACCEPTED
    # Launching it again (a retried message) is a no-op: it runs once.
    assert lm.launch("gm-a", small, retry.node).status is S.DUPLICATE
    assert list(lm.allocations).count("s1") == 1
    assert lm.table.free[0].min() >= 0


def test_a_refused_plan_picks_other_victims_when_still_under_share():
    lm = ClusterState("lm-0", ("gm-a",))
    lm.add_node("w0", NODE)
    for i in range(4):
        assert lm.launch("gm-a", task(f"hog{i}", cpu=1000, queue="hog"), 0).ok
    view = GlobalView("gm-a")
    view.apply(lm.snapshot(), now=0.0)
    small = task("s1", cpu=1000, queue="small")
    plan = view.preemption_plan(small, FAIR)
    (victim,) = plan.victims.task_ids
    # The victim ends and another hog task takes its core before the Preempt arrives.
    lm.release(victim)
    assert lm.launch("gm-a", task("hog9", cpu=1000, queue="hog"), 0).ok
    assert lm.preempt("gm-a", small, 0, [victim], over_share(lm)).status is S.REJECTED_VICTIMS
    view.apply(lm.snapshot(view.lms["lm-0"].version), now=1.0)
    assert view.match(small) is None
    again = view.preemption_plan(small, FAIR)
    assert isinstance(again, PreemptionPlan) and victim not in again.victims.task_ids
    done = lm.preempt("gm-a", small, 0, list(again.victims.task_ids), over_share(lm))
    assert done.status is S.ACCEPTED
    assert [v.task_id for v in done.preempted] == list(again.victims.task_ids)
    assert "s1" in lm.allocations and again.victims.task_ids[0] not in lm.allocations


def test_a_queue_at_or_over_its_share_never_preempts():
    lm = ClusterState("lm-0", ("gm-a",))
    lm.add_node("w0", NODE)
    for i, queue in enumerate(["hog", "hog", "small", "small"]):
        assert lm.launch("gm-a", task(f"t{i}", cpu=1000, queue=queue), 0).ok
    view = GlobalView("gm-a")
    view.apply(lm.snapshot(), now=0.0)
    # Both at exactly 50 %: nobody is under share, so nobody preempts.
    for queue in ("hog", "small"):
        reason = view.preemption_plan(task("x", cpu=1000, queue=queue), FAIR)
        assert isinstance(reason, str)
        assert "share" in reason
