"""A GM's view never books a node's room twice: free never goes below zero.

One GM and one LM, on the core classes the services run, with the GM's three sources
(replies, lifecycle events, heartbeats) arriving in any order relative to each other.
With one GM nothing else takes the room the GM books, so a node the view shows below
zero counts some task twice: a preempting task on top of the victims it replaces, a
launch on top of a task whose end the view heard but that a late heartbeat still counts,
or a launch in the room of a retry the view dropped (a heartbeat named the end of the
retried attempt).
(With several GMs, a node can go below zero for a moment when two of them book the same
room; ``NodeTable.partition_free`` then shows it full.)
"""

from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.cluster_state import ClusterState
from services.core.fairness import FairShare, QueueShare
from services.core.global_view import ApplyResult, GlobalView, PreemptionPlan
from tests.builders import NODE, task

FAIR = FairShare([QueueShare("hog", 0.5), QueueShare("small", 0.5)])


def lm_and_view(nodes: int = 2) -> tuple[ClusterState, GlobalView]:
    lm = ClusterState("lm-0", ("gm-a",))
    for i in range(nodes):
        lm.add_node(f"w{i}", NODE)
    view = GlobalView("gm-a")
    assert view.apply(lm.snapshot(), now=0.0) is ApplyResult.APPLIED
    return lm, view


def free(view: GlobalView) -> np.ndarray:
    return view.lms["lm-0"].table.free


def test_a_preempting_task_is_booked_in_its_victims_room_not_on_top_of_them():
    lm, view = lm_and_view(1)
    for i in range(4):  # the hog fills the node: 4 one-core tasks
        assert lm.launch("gm-a", task(f"hog{i}", cpu=1000, queue="hog"), 0).ok
    view.apply(lm.snapshot(), now=0.0)
    big = task("s1", cpu=2000, queue="small")
    plan = view.preemption_plan(big, FAIR)
    assert isinstance(plan, PreemptionPlan) and len(plan.victims.task_ids) == 2
    view.reserve_preemption(plan, big, now=0.0)
    assert free(view)[0, 0] == 0  # 4 cores - 4 hogs + 2 victims - 2 for the task
    # The victims still count for their queue until the LM kills them.
    assert view.queue_usage()["hog"][0] == 4000

    # Another hog ends before the LM reads the request; the heartbeat that says so
    # predates the preemption, so the view books it again on the node, as it was.
    base = lm.version
    bystander = min({f"hog{i}" for i in range(4)} - set(plan.victims.task_ids))
    lm.release(bystander)
    view.apply(lm.snapshot(since_version=base), now=0.5)
    assert free(view)[0, 0] == 1000

    # The LM refuses (a fresh queue-share check says no): the victims hold the node again.
    view.release("lm-0", big.task_id)
    assert "s1" not in view.lms["lm-0"].allocations
    np.testing.assert_array_equal(free(view), lm.table.free)

    # Planned again, and this time the LM preempts; its next heartbeat agrees.
    plan = view.preemption_plan(big, FAIR)
    view.reserve_preemption(plan, big, now=1.0)
    assert free(view)[0, 0] == 0
    base = lm.version
    done = lm.preempt("gm-a", big, 0, list(plan.victims.task_ids), lambda _queue: True)
    assert done.ok
    for victim in done.preempted:  # their PREEMPTED events come before the heartbeat
        view.release("lm-0", victim.task_id, ended=True, attempt=victim.attempt, now=1.1)
        assert free(view)[0, 0] == 0
    view.apply(lm.snapshot(since_version=base), now=1.2)
    np.testing.assert_array_equal(free(view), lm.table.free)
    lmv = view.lms["lm-0"]
    assert not lmv.inflight and not lmv.evicting and not lmv.evicted


def test_a_heartbeat_that_predates_an_end_does_not_count_the_ended_task_again():
    lm, view = lm_and_view(1)
    assert lm.launch("gm-a", task("old", cpu=3000), 0).ok
    view.apply(lm.snapshot(), now=0.0)
    base = lm.version
    assert lm.launch("gm-a", task("other", cpu=1000), 0).ok
    before_end = lm.snapshot(since_version=base)  # shows the node, does not list "old"
    lm.release("old")
    view.release("lm-0", "old", ended=True, attempt=0, now=0.1)  # its event comes first
    new = task("new", cpu=3000)
    placement = view.match(new)
    assert placement is not None  # the view knows the node has room again
    view.reserve(placement, new, now=0.1)
    # The late heartbeat still counts "old" on the node: the view must take it off
    # again before booking "new" once more, or the node shows -3 cores.
    assert view.apply(before_end, now=0.2) is ApplyResult.APPLIED
    assert free(view)[0, 0] == 0
    assert lm.launch("gm-a", new, placement.node).ok  # the LM agrees there was room
    view.apply(lm.snapshot(since_version=before_end.version), now=0.3)
    np.testing.assert_array_equal(free(view), lm.table.free)


def test_an_earlier_attempts_end_leaves_the_next_attempt_booked():
    lm, view = lm_and_view(1)
    assert lm.launch("gm-a", task("v", cpu=2000), 0).ok
    view.apply(lm.snapshot(), now=0.0)
    base = lm.version
    lm.release("v")  # preempted: its next attempt goes back to its queue at once
    retry = task("v", cpu=2000, attempt=1)
    view.reserve(view.match(retry), retry, now=0.1)
    # A heartbeat names the end of "v" (of attempt 0: a snapshot does not say which)...
    assert view.apply(lm.snapshot(since_version=base), now=0.2) is ApplyResult.APPLIED
    assert free(view)[0, 0] == 2000, "attempt 1 is still on its way: its room stays booked"
    # ...and so does the PREEMPTED event of attempt 0, heard late.
    assert view.release("lm-0", "v", ended=True, attempt=0, now=0.3) is False
    assert free(view)[0, 0] == 2000 and view.lms["lm-0"].allocations["v"].attempt == 1
    base = lm.version
    assert lm.launch("gm-a", retry, 0).ok
    view.apply(lm.snapshot(since_version=base), now=0.4)
    np.testing.assert_array_equal(free(view), lm.table.free)
    assert not view.lms["lm-0"].inflight


def test_room_two_gms_booked_at_once_shows_full_not_below_zero():
    lm = ClusterState("lm-0", ("gm-a", "gm-b"))
    for i in range(2):
        lm.add_node(f"w{i}", NODE, partition=0)  # gm-a's
    view = GlobalView("gm-a")
    view.apply(lm.snapshot(), now=0.0)
    mine = task("mine", cpu=4000)
    placement = view.match(mine)
    view.reserve(placement, mine, now=0.0)
    base = lm.version
    # gm-b borrows the same node first; a heartbeat shows it before gm-a's launch arrives.
    assert lm.repartition("gm-b", task("theirs", cpu=4000), placement.node).ok
    view.apply(lm.snapshot(since_version=base), now=0.1)
    assert free(view)[0, placement.node] == -4000  # both booked: the LM will refuse one
    # Shown as full; the other node's room is not taken to cover the deficit.
    assert view.lms["lm-0"].table.partition_free()[0, 0] == 4000
    view.release("lm-0", "mine")  # refused
    np.testing.assert_array_equal(free(view), lm.table.free)


# --------------------------------------------------------------------- property
_OPS = st.lists(
    st.sampled_from(["submit", "submit", "lm", "lm", "end", "beat", "reply", "event", "heard"]),
    min_size=5,
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(_OPS, st.integers(0, 2**32 - 1))
def test_with_one_gm_no_node_of_the_view_ever_shows_less_than_nothing_free(ops, seed):
    rng = np.random.default_rng(seed)
    lm, view = lm_and_view(2)
    lmv = view.lms["lm-0"]
    requests: deque = deque()  # GM -> LM: (kind, task, node, victims, the view's version)
    replies: deque = deque()  # LM -> GM: (task id, accepted, victims, state if refused)
    events: deque = deque()  # LM -> GM, ends: (task id, attempt)
    beats: deque = deque()  # LM -> GM, heartbeats
    requeued: deque = deque()  # preempted tasks' next attempts, back in their queue
    published = lm.version
    pledged: set[str] = set()
    now, count = 0.0, 0

    def check() -> None:
        table = free(view)
        assert (table >= 0).all(), f"a node of the view shows {table.min(axis=1)} free"

    def lm_reads() -> None:
        kind, spec, node, victims, known = requests.popleft()
        if kind == "launch":
            decision = lm.launch("gm-a", spec, node)
        else:
            decision = lm.preempt("gm-a", spec, node, list(victims), lambda _queue: True)
            events.extend((v.task_id, v.attempt) for v in decision.preempted)
            requeued.extend(
                task(v.task_id, cpu=int(v.resources[0]), queue=v.queue, attempt=v.attempt + 1)
                for v in decision.preempted
            )
        # A refusal carries the LM's state (the inconsistency path).
        state = None if decision.ok else lm.snapshot(since_version=known)
        replies.append((spec.task_id, decision.ok, victims, state))

    def gm_reads_reply() -> None:
        task_id, ok, victims, state = replies.popleft()
        pledged.difference_update(victims)
        if ok:
            view.accepted("lm-0", task_id)
            return
        view.release("lm-0", task_id)
        if view.apply(state, now) is ApplyResult.NEEDS_FULL:
            view.apply(lm.snapshot(), now)

    def gm_reads_beat() -> None:
        if view.apply(beats.popleft(), now) is ApplyResult.NEEDS_FULL:
            view.apply(lm.snapshot(), now)

    def gm_reads_event() -> None:
        task_id, attempt = events.popleft()
        view.release("lm-0", task_id, ended=True, attempt=attempt, now=now)

    for op in ops:
        now += 0.01
        if op == "submit":
            if requeued and rng.random() < 0.5:
                # Often before the GM heard that the earlier attempt ended.
                spec = requeued.popleft()
            else:
                count += 1
                queue = "small" if rng.random() < 0.5 else "hog"
                spec = task(f"t{count}", cpu=int(rng.choice([1000, 2000, 3000])), queue=queue)
            placement = view.match(spec)
            if placement is not None:
                view.reserve(placement, spec, now)
                requests.append(("launch", spec, placement.node, (), lmv.version))
            else:
                plan = view.preemption_plan(spec, FAIR, pledged)
                if isinstance(plan, PreemptionPlan):
                    pledged.update(plan.victims.task_ids)
                    view.reserve_preemption(plan, spec, now)
                    victims = plan.victims
                    requests.append(("preempt", spec, victims.node, victims.task_ids, lmv.version))
        elif op == "lm" and requests:
            lm_reads()
        elif op == "end":
            # A task ends on its own (not a victim of a preemption under way: that the LM
            # refuses is another test's story).
            running = sorted(set(lm.allocations) - pledged)
            if running:
                ended = lm.release(running[int(rng.integers(len(running)))])
                events.append((ended.task_id, ended.attempt))
        elif op == "beat":
            full = rng.random() < 0.2
            beats.append(lm.snapshot(None if full else published))
            published = lm.version
        elif op == "reply" and replies:
            gm_reads_reply()
        elif op == "event" and events:
            gm_reads_event()
        elif op == "heard" and beats:
            gm_reads_beat()
        check()

    # Everything arrives; the view then agrees with the LM's books.
    while requests:
        lm_reads()
    for pending, read in (
        (replies, gm_reads_reply),
        (events, gm_reads_event),
        (beats, gm_reads_beat),
    ):
        while pending:
            read()
            check()
    view.apply(lm.snapshot(published), now)
    np.testing.assert_array_equal(free(view), lm.table.free)
