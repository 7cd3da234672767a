"""A waiting gang preempts as one unit (issue 33): ``gang_evictions`` picks victims of the
queue most over its share, never a gang's, youngest first, no deeper than that queue's
share, only for a gang its queue is entitled to whole; with the victims gone, the gang
fits (``plan_gang``). ``Lifecycle.evict`` is the LM's side."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.cluster_state import ClusterState
from services.core.fairness import FairShare, QueueShare
from services.core.gang import Eviction, Gang, GangPlan, gang_evictions, plan_gang
from services.core.global_view import GlobalView
from tests.builders import NODE, task

GMS = ("gm-a", "gm-b")
FAIR = FairShare([QueueShare("a", 0.5), QueueShare("b", 0.5)])


def full_of_a(lms: int = 2, per_lm: int = 1, gang_every: int = 0) -> dict[str, ClusterState]:
    """Nodes of 4 CPUs, every CPU held by a one-CPU task of queue a (launched in order:
    a later one is younger); with ``gang_every`` every n-th is a gang's."""
    out, n = {}, 0
    for lm in range(lms):
        state = ClusterState(f"lm-{lm}", GMS)
        for i in range(per_lm):
            node = state.add_node(f"lm{lm}-w{i}", NODE, partition=0)
            for _ in range(4):
                spec = task(f"a{n}", cpu=1000, queue="a", job_id="ja")
                if gang_every and n % gang_every == 0:
                    spec = replace(spec, gang=True)
                assert state.launch("gm-a", spec, node).ok
                n += 1
        out[state.lm_id] = state
    return out


def view_of(lms: dict[str, ClusterState]) -> GlobalView:
    view = GlobalView("gm-a", silent_after_s=10.0)
    for state in lms.values():
        view.apply(state.snapshot(), 0.0)
    return view


def gang_of_b(size: int, cpu: int = 1000) -> Gang:
    return Gang("jb/1", tuple(task(f"b{i}", cpu=cpu, queue="b", job_id="jb") for i in range(size)))


def test_the_youngest_tasks_of_the_over_share_queue_make_room_for_the_whole_gang():
    lms = full_of_a()  # 8 CPUs, all queue a's
    out = gang_evictions(gang_of_b(3), "b", view_of(lms), FAIR)
    assert isinstance(out, Eviction) and out.queue == "a"
    assert [t for _, t, _ in out.victims] == ["a3", "a2", "a1"]  # one node, youngest first
    for lm_id, task_id, _ in out.victims:
        lms[lm_id].release(task_id)
    assert isinstance(plan_gang(gang_of_b(3), view_of(lms)), GangPlan)


def test_a_gang_its_queue_is_not_entitled_to_whole_preempts_nothing():
    out = gang_evictions(gang_of_b(5), "b", view_of(full_of_a()), FAIR)
    assert out == "its 5 tasks together would take queue b over its share"
    # ...unless min_tasks lets fewer start together.
    some = Gang("jb/1", gang_of_b(5).members, 4)
    assert isinstance(gang_evictions(some, "b", view_of(full_of_a()), FAIR), Eviction)


def test_no_member_of_a_gang_is_a_victim_and_the_victims_queue_keeps_its_share():
    # Every other task of a's is a gang's: only four are victims at all.
    out = gang_evictions(gang_of_b(4), "b", view_of(full_of_a(gang_every=2)), FAIR)
    assert isinstance(out, Eviction)
    assert sorted(t for _, t, _ in out.victims) == ["a1", "a3", "a5", "a7"]
    # One 4-CPU member needs a whole node: no node empties without a gang's task going.
    assert gang_evictions(gang_of_b(1, cpu=4000), "b", view_of(full_of_a(gang_every=2)), FAIR) == (
        "no room for its 1 tasks together even after preempting queue a down to its share"
    )


def test_a_queue_at_its_share_does_not_preempt():
    lms = full_of_a()
    for task_id in ("a0", "a1", "a2", "a3"):
        lms["lm-0"].release(task_id)
    for i in range(4):
        assert lms["lm-0"].launch("gm-a", task(f"b{i}", queue="b", job_id="old"), 0).ok
    out = gang_evictions(gang_of_b(1), "b", view_of(lms), FAIR)
    assert isinstance(out, str) and out.startswith("queue b is")


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(1, 6),
    cpu=st.sampled_from([500, 1000, 2000, 4000]),
    gang_every=st.sampled_from([0, 2, 3]),
    lms=st.integers(1, 3),
)
def test_evictions_only_take_what_fairness_allows_and_then_the_gang_fits(
    size, cpu, gang_every, lms
):
    books = full_of_a(lms=lms, per_lm=2, gang_every=gang_every)
    view = view_of(books)
    gang = gang_of_b(size, cpu)
    out = gang_evictions(gang, "b", view, FAIR)
    if not isinstance(out, Eviction):
        return
    total = 4000 * 2 * lms
    freed = 0
    for lm_id, task_id, _ in out.victims:
        allocation = books[lm_id].allocations[task_id]
        assert allocation.queue == "a" and not allocation.gang
        freed += int(allocation.resources[0])
        books[lm_id].release(task_id)
    held_a = total - freed
    assert held_a / total >= 0.5  # a keeps its share
    assert size * cpu / total <= 0.5  # b is entitled to the whole gang
    assert isinstance(plan_gang(gang, view_of(books)), GangPlan)


def test_the_scheduler_pledges_the_victims_and_a_limited_queue_waits_for_its_own():
    from services.core.limits import QueueLimits
    from services.core.scheduler import Scheduler
    from services.core.user_queues import UserQueues

    lms = full_of_a()
    view = view_of(lms)
    sched = Scheduler(view, UserQueues(["a", "b"]), FAIR, QueueLimits.parse([]))
    out = sched.gang_evictions("b", gang_of_b(2), 0.0)
    first = {t for _, t, _ in out.victims}
    assert isinstance(out, Eviction) and sched.pledged == first
    again = sched.gang_evictions("b", gang_of_b(2), 0.0)  # the pledged are not picked twice
    assert isinstance(again, Eviction) and not first & {t for _, t, _ in again.victims}
    sched.evictions_replied(out)
    sched.evictions_replied(again)
    assert not sched.pledged
    capped = Scheduler(view, UserQueues(["a", "b"]), FAIR, QueueLimits.parse([("b", "cpu=1")]))
    capped.lm_ids = set(lms)
    why = capped.gang_evictions("b", gang_of_b(2), 0.0)
    assert (
        why == "2 tasks together: queue 'b' is at its limit (cpu 0 of 1 held, needs 2); "
        "waiting for its tasks to end"
    )


def test_the_dry_run_of_a_gang_that_would_preempt_says_so_and_changes_nothing():
    from services.core.dry_run import Outcome, dry_run_gang
    from services.core.limits import QueueLimits
    from services.core.scheduler import Scheduler
    from services.core.user_queues import UserQueues

    view = view_of(full_of_a())
    sched = Scheduler(view, UserQueues(["a", "b"]), FAIR, QueueLimits.parse([]))
    free = {lm_id: v.table.free.copy() for lm_id, v in view.lms.items()}
    outlooks = dry_run_gang(sched, "b", gang_of_b(2), 0.0)
    assert {o.outcome for o in outlooks} == {Outcome.PREEMPTS}
    assert outlooks[0].reason == (
        "the gang would preempt 2 task(s) of queue a (over its share) and start whole in their room"
    )
    assert not sched.pledged
    assert all((view.lms[lm_id].table.free == f).all() for lm_id, f in free.items())
    too_big = dry_run_gang(sched, "b", gang_of_b(5), 0.0)  # b not entitled to 5 of 8
    assert {o.outcome for o in too_big} == {Outcome.WAITS}
