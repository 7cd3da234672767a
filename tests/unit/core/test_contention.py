"""``OwnerFirst``: room freed on a GM's partition is that GM's first (issue 29)."""

from __future__ import annotations

import numpy as np
from bitarray.util import ones
from hypothesis import given
from hypothesis import strategies as st

from services.core.cluster_state import ClusterState
from services.core.contention import OwnerFirst
from services.core.fairness import FairShare, QueueShare
from services.core.global_view import ApplyResult, GlobalView
from services.core.limits import QueueLimits
from services.core.scheduler import Scheduler
from services.core.user_queues import UserQueues
from tests.builders import NODE
from tests.builders import task as one_core


def task(task_id: str, queue: str = "default"):
    """A task that fills a node."""
    return one_core(task_id, cpu=int(NODE[0]), queue=queue)


GMS = ("gm-a", "gm-b")


def one_lm() -> ClusterState:
    """Two nodes: node 0 is gm-a's, node 1 gm-b's."""
    state = ClusterState("lm-0", GMS)
    for i in range(2):
        state.add_node(f"w{i}", NODE, partition=i)
    return state


def full_view(state: ClusterState, gm: str, grace_s: float) -> GlobalView:
    view = GlobalView(gm, owner_grace_s=grace_s)
    assert view.apply(state.snapshot(), now=0.0) is ApplyResult.APPLIED
    return view


def freed_on_gm_bs_node(grace_s: float) -> tuple[ClusterState, int, GlobalView, GlobalView]:
    """Both nodes busy, then gm-b's frees and both GMs hear of it at t = 1."""
    state = one_lm()
    state.launch("gm-a", task("a1"), 0)
    state.launch("gm-b", task("b1"), 1)
    a, b = full_view(state, "gm-a", grace_s), full_view(state, "gm-b", grace_s)
    seen = state.version
    state.release("b1")
    for view in (a, b):
        view.release("lm-0", "b1", ended=True, now=1.0)
    return state, seen, a, b


def test_freed_room_is_left_to_its_owner_for_the_grace():
    _, _, a, b = freed_on_gm_bs_node(5.0)
    # The owner takes it at once; gm-a does not repartition onto it meanwhile.
    assert b.match(task("b2"), now=1.0).node == 1
    assert a.match(task("a2"), now=1.0) is None
    assert a.match(task("a2"), now=5.9) is None
    assert a.held_until() == 6.0
    # Without a clock (a driver that has none) or past the grace, it is anyone's.
    assert a.match(task("a2")).node == 1
    assert a.match(task("a2"), now=6.0).node == 1
    assert a.held_until() is None


def test_a_snapshot_showing_the_node_ends_the_hold():
    state, seen, a, _ = freed_on_gm_bs_node(5.0)
    assert a.match(task("a2"), now=2.0) is None
    # The heartbeat says whether the owner took the room: gm-a needs to guess no more.
    assert a.apply(state.snapshot(since_version=seen), now=2.5) is ApplyResult.APPLIED
    assert a.match(task("a2"), now=2.5).node == 1
    _, _, a, _ = freed_on_gm_bs_node(5.0)
    a.apply(state.snapshot(), now=2.5)  # a full one too
    assert a.match(task("a2"), now=2.5).node == 1


def test_a_hold_a_snapshot_ended_asks_for_no_recheck():
    # Its due time stays queued inside the rule; a recheck then would wake the GM for
    # nothing (most rounds of an overloaded simulation were such: issue 29).
    state, seen, a, _ = freed_on_gm_bs_node(5.0)
    assert a.held_until() == 6.0
    a.apply(state.snapshot(since_version=seen), now=2.5)
    assert a.held_until() is None


def test_no_rule_without_a_grace():
    _, _, a, _ = freed_on_gm_bs_node(0.0)
    assert a.owner_first is None
    assert a.match(task("a2"), now=1.0).node == 1


def test_room_freed_on_ones_own_partition_is_not_held():
    state = one_lm()
    state.repartition("gm-b", task("b1"), 0)  # gm-b borrowed gm-a's node
    a = full_view(state, "gm-a", 5.0)
    state.release("b1")
    a.release("lm-0", "b1", ended=True, now=1.0)
    assert a.match(task("a1"), now=1.0).node == 0
    assert a.held_until() is None


class One:
    """One task's work in a user queue (the live GM's kind)."""

    rejections = 0
    lease = 0
    enqueued = 0.0

    def __init__(self, spec):
        self.spec = spec
        self.left = 1

    def head(self):
        return self.spec

    def take(self):
        self.left -= 1
        return self.spec.task_id

    def __len__(self):
        return self.left

    def join(self, other):
        return False


def test_a_waiting_round_asks_to_look_again_when_a_hold_ends():
    state = one_lm()
    state.launch("gm-a", task("a1"), 0)
    state.launch("gm-b", task("b1"), 1)
    view = full_view(state, "gm-a", 2.0)
    state.release("b1")
    view.release("lm-0", "b1", ended=True, now=1.0)
    scheduler = Scheduler(view, UserQueues(["q"]), None, QueueLimits.parse([]))

    scheduler.submit("q", One(task("a2", queue="q")))
    plan = scheduler.round(1.5)
    assert plan.placed == 0 and len(plan.waiting) == 1
    assert abs(plan.recheck_in - 1.5) < 1e-3  # the hold ends at 3.0
    assert scheduler.unpark()
    assert scheduler.round(3.0 + plan.recheck_in - 1.5).placed == 1


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["freed", "seen", "seen-all", "expire", "mine"]),
            st.integers(0, 15),
            st.floats(0.0, 1.0),
        ),
        max_size=40,
    )
)
def test_held_nodes_are_those_freed_and_neither_seen_nor_due(ops):
    rule = OwnerFirst(grace_s=0.3)
    now, held = 0.0, {}  # node -> until
    for op, node, step in ops:
        now += step
        if op == "freed":
            rule.freed("lm", 16, node, now)
            held[node] = now + 0.3
        elif op == "seen":
            rule.seen("lm", np.array([node]))
            held.pop(node, None)
        elif op == "seen-all":
            rule.seen("lm", None)
            held.clear()
        elif op == "mine":  # this GM is the claimant of an end there: its hold ends
            rule.mine("lm", node)
            held.pop(node, None)
        else:
            rule.expire(now)
            held = {n: until for n, until in held.items() if until > now}
        free = rule.exclude("lm", ones(16))
        # Held nodes are never offered; every other node always is.
        assert {i for i in range(16) if not free[i]} <= set(held)
        if op == "expire":
            assert {i for i in range(16) if not free[i]} == set(held)
        # The next recheck is when the first hold in force ends, none if none is.
        assert rule.next_due() == (min(held.values()) if held else None)
    # Growing tables keep their new nodes offered.
    assert rule.exclude("lm", ones(20))[16:].all()


def test_with_shares_alg2_decides_and_no_room_is_held():
    # A partition is not a share: holding freed room for its owner handed a 10 % queue
    # 32 % of the federation in the fairness simulation, so with shares the rule is off.
    _, _, view, _ = freed_on_gm_bs_node(5.0)
    fair = FairShare([QueueShare("qa", 0.5), QueueShare("qb", 0.5)])
    Scheduler(view, UserQueues(["qa"]), fair, QueueLimits.parse([]))
    assert view.owner_first is None
    assert view.match(task("a2", queue="qa"), now=1.0).node == 1


# --------------------------------------------------------------------- OldestFirst
def oldest_views(state: ClusterState, grace_s: float = 5.0) -> tuple[GlobalView, GlobalView]:
    views = []
    for gm in GMS:
        view = GlobalView(gm, owner_grace_s=grace_s, claims="oldest")
        assert view.apply(state.snapshot(), now=0.0) is ApplyResult.APPLIED
        views.append(view)
    return views[0], views[1]


def both_waiting() -> tuple[ClusterState, GlobalView, GlobalView]:
    """Both nodes busy; gm-b's one task waits since t = 2, gm-a's since t = 1, and both
    GMs heard both reports."""
    state = one_lm()
    state.launch("gm-a", task("a1"), 0)
    state.launch("gm-b", task("b1"), 1)
    a, b = oldest_views(state)
    for view in (a, b):
        view.backlog("gm-a", [(1.0, 1, "qa")])
        view.backlog("gm-b", [(2.0, 1, "qb")])
    return state, a, b


def test_freed_room_goes_to_the_gm_whose_work_waited_longest():
    state, a, b = both_waiting()
    state.release("b1")
    for view in (a, b):
        view.release("lm-0", "b1", ended=True, now=3.0)
    # gm-b's own node goes to gm-a: its owner does not take it, gm-a does.
    assert b.match(task("b2"), now=3.0) is None
    assert a.match(task("a2"), now=3.0).node == 1
    # The next end is gm-b's (gm-a's run is claimed), on gm-a's own node.
    state.release("a1")
    for view in (a, b):
        view.release("lm-0", "a1", ended=True, now=4.0)
    assert b.match(task("b2"), now=4.0).node == 0


def test_counting_an_ends_claim_alone_keeps_the_gms_claimants_the_same():
    # A driver that knows an end changes nothing else in a GM (the simulator) counts only
    # its claim there (``count_end``); what ``claims_end`` foretells is what the GMs that
    # ran the end named, and the next end's claimant is the same everywhere.
    state, a, b = both_waiting()
    assert a.claims_end("b1", 0) == b.claims_end("b1", 0) == "gm-a"
    state.release("b1")
    a.release("lm-0", "b1", ended=True, now=3.0)
    b.count_end("b1", 0)
    assert b.claims_end("b1", 0) is None  # counted: a snapshot showing it claims nothing
    assert b.lms["lm-0"].allocations.get("b1") is not None  # nothing else changed in b
    assert a.match(task("a2"), now=3.0).node == 1
    # The next end is gm-b's in both.
    assert a.claims_end("a1", 0) == b.claims_end("a1", 0) == "gm-b"


def test_the_claimant_of_an_end_it_never_saw_takes_the_room_it_held_for_another():
    # Issue 29 (claims: oldest): gm-b held node 1 for gm-a (the claimant of b1's end);
    # gm-a ran a2 there and a2 ended before any snapshot showed it to gm-b. gm-b is the
    # claimant of that end: with the node the event names, its hold ends and the room is
    # its own; without, it passed the room by until a snapshot offered the node to every
    # GM at once, and they raced for it (most of the refused launches at 3,000 workers).
    for told in (True, False):
        state, a, b = both_waiting()
        state.release("b1")
        for view in (a, b):
            view.release("lm-0", "b1", ended=True, now=3.0, node="w1")
        placement = a.match(task("a2"), now=3.0)
        assert placement.node == 1
        a.reserve(placement, task("a2"), now=3.0)
        state.launch("gm-a", task("a2"), 1)
        state.release("a2")
        freed = {
            view.gm_id: view.release("lm-0", "a2", ended=True, now=3.5, node="w1" if told else "")
            for view in (a, b)
        }
        placed = b.match(task("b2"), now=3.5)
        assert (placed.node if placed else None) == (1 if told else None)
        assert a.match(task("a3"), now=3.5) is None  # gm-a holds it for gm-b
        # gm-b never saw a2, but its room is back: the release says so, and its parked
        # work is tried now (without, it waited for the next heartbeat while its younger
        # work took the room: 722 s out of order in test_a_gm_serves_its_own_work_...).
        assert freed == {"gm-a": False, "gm-b": told}


def test_with_no_backlog_reported_the_owner_has_the_claim():
    state = one_lm()
    state.launch("gm-a", task("a1"), 0)
    state.launch("gm-b", task("b1"), 1)
    a, b = oldest_views(state)
    state.release("b1")
    for view in (a, b):
        view.release("lm-0", "b1", ended=True, now=1.0)
    assert a.match(task("a2"), now=1.0) is None
    assert b.match(task("b2"), now=1.0).node == 1


@given(
    reports=st.lists(
        st.lists(st.tuples(st.integers(0, 20), st.integers(0, 4)), max_size=5),
        min_size=3,
        max_size=3,
    ),
    ends=st.integers(0, 40),
    order=st.permutations(["gm-0", "gm-1", "gm-2"]),
)
def test_every_gm_names_the_same_claimants_and_in_age_order(reports, ends, order):
    """Heard in any order of reports, every GM names the same claimant for each end: the
    oldest unclaimed task's GM (ties: the lower id), each reported task claimed once."""
    from services.core.contention import OldestFirst

    gms = ["gm-0", "gm-1", "gm-2"]
    runs = {g: sorted((at, n, "q") for at, n in r) for g, r in zip(gms, reports, strict=True)}
    rules = [OldestFirst(g) for g in gms]
    for rule in rules:
        for g in order:
            rule.backlog(g, runs[g])
    named = [[rule.claimant() for _ in range(ends)] for rule in rules]
    assert named[0] == named[1] == named[2]
    tasks = sorted((at, g) for g in gms for at, n, _ in runs[g] for _ in range(n))
    expected = [g for _, g in tasks[:ends]] + [None] * max(0, ends - len(tasks))
    assert named[0] == expected


def test_a_new_report_replaces_the_claims_on_the_old():
    from services.core.contention import OldestFirst

    rule = OldestFirst("gm-0")
    rule.backlog("gm-1", [(1.0, 1, "q")])
    assert rule.claimant() == "gm-1"
    assert rule.claimant() is None
    rule.backlog("gm-1", [(1.0, 1, "q"), (3.0, 1, "q")])  # the claimed one waits still
    rule.backlog("gm-0", [(2.0, 1, "q")])
    assert [rule.claimant() for _ in range(4)] == ["gm-1", "gm-0", "gm-1", None]
    rule.backlog("gm-1", [])
    assert rule.claimant() is None


@given(
    runs=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 3)), max_size=4),
    steps=st.lists(st.sampled_from(["again", "claim", "new"]), max_size=12),
)
def test_a_report_heard_again_is_skipped_only_while_nothing_was_claimed_on_it(runs, steps):
    """The simulator hands a GM's unchanged ``Backlog`` again: hearing the same object
    names the same claimants as hearing a fresh copy of it (skipped only while no claim
    touched it; after a claim it starts the claims over, as a new report does)."""
    from services.core.contention import Backlog, OldestFirst

    report = Backlog.of("gm-1", sorted((float(at), n, "q") for at, n in runs))
    reused, fresh = OldestFirst("gm-0"), OldestFirst("gm-0")
    for step in steps:
        if step == "claim":
            assert reused.claimant() == fresh.claimant()
            continue
        if step == "new":
            report = Backlog.of("gm-1", [(0.5, 1, "q"), *report_runs(report)])
        reused.backlogs((report,))
        fresh.backlogs((Backlog.of("gm-1", report_runs(report)),))
    assert [reused.claimant() for _ in range(8)] == [fresh.claimant() for _ in range(8)]


def report_runs(report):
    return [(at, n, queue) for queue, lane in report.lanes.items() for at, n in lane]


def test_the_backlog_is_the_oldest_waiting_work_by_enqueued_time():
    state = one_lm()
    view = full_view(state, "gm-a", 5.0)
    scheduler = Scheduler(view, UserQueues(["q1", "q2"]), None, QueueLimits.parse([]))
    for queue, at, n in (("q1", 5.0, 2), ("q2", 1.0, 3), ("q1", 9.0, 1), ("q2", 5.0, 1)):
        work = One(task(f"{queue}-{at}", queue=queue))
        work.left, work.enqueued = n, at
        scheduler.submit(queue, work)
    assert scheduler.backlog() == [(1.0, 3, "q2"), (5.0, 2, "q1"), (5.0, 1, "q2"), (9.0, 1, "q1")]
    assert scheduler.backlog(most=2) == [(1.0, 3, "q2"), (5.0, 2, "q1")]


def test_a_queue_claims_no_more_than_its_room_and_one_more_per_end_of_its_own():
    from services.core.contention import OldestFirst

    rule = OldestFirst("gm-0")
    rule.backlog("gm-0", [(1.0, 2, "big"), (2.0, 1, "small")], {"big": 0, "small": 4})
    rule.backlog("gm-1", [(3.0, 1, "small2")], {"small2": 1})
    assert rule.next_claimant() == "gm-0"
    assert rule.claimant() == "gm-0"  # small's run, not big's older one: big has no room
    rule.backlog("gm-2", [(0.5, 1, "old")], {"old": 0})
    assert rule.claimant() == "gm-1"  # small2 has room; old, older, has none
    # No queue with room waits: the oldest work of any, rather than room left idle.
    assert rule.next_claimant() == "gm-2"
    assert rule.claimant() == "gm-2"
    assert rule.claimant() == "gm-0"  # big's, the oldest left
    # Big went one over its room: an end of one of its tasks puts it back at none, so
    # small2, with room, is named.
    rule.backlog("gm-1", [(3.0, 1, "small2")], {"small2": 1})
    assert rule.claimant("big") == "gm-1"
    # A new report: big's room is what it says now.
    rule.backlog("gm-0", [(1.0, 2, "big")], {"big": 2})
    assert [rule.claimant() for _ in range(3)] == ["gm-0", "gm-0", None]


@given(
    reports=st.lists(
        st.lists(
            st.tuples(st.integers(0, 20), st.integers(0, 4), st.sampled_from(["q0", "q1", "q2"])),
            max_size=5,
        ),
        min_size=3,
        max_size=3,
    ),
    rooms=st.lists(st.integers(0, 5), min_size=3, max_size=3),
    ends=st.lists(st.sampled_from(["", "q0", "q1", "q2", "other"]), max_size=40),
    order=st.permutations([0, 1, 2]),
)
def test_with_room_every_gm_names_the_same_claimants_and_no_queue_claims_past_it(
    reports, rooms, ends, order
):
    """GM i serves queue qi. Every GM, hearing the reports in any order, names the same
    claimant for each end, and ``next_claimant`` foretells it; a queue is named no more
    often than its room plus the ends of its own tasks heard so far while another with
    room waits; and a claim goes to the oldest reported task of a queue with room left
    (ties: the lower GM id), or if none has room, to the oldest of any."""
    from services.core.contention import OldestFirst

    gms = ["gm-0", "gm-1", "gm-2"]
    runs = {
        g: sorted((float(at), n, f"q{i}") for at, n, _ in r)
        for i, (g, r) in enumerate(zip(gms, reports, strict=True))
    }
    rules = [OldestFirst(g) for g in gms]
    for rule in rules:
        for i in order:
            rule.backlog(gms[i], runs[gms[i]], {f"q{i}": rooms[i]})
    named = []
    for rule in rules:
        names = []
        for queue in ends:
            foretold = rule.next_claimant(queue)
            names.append(rule.claimant(queue))
            assert foretold == names[-1]
        named.append(names)
    assert named[0] == named[1] == named[2]
    # A model: per queue its unclaimed tasks oldest first, and its room.
    left = {f"q{i}": [at for at, n, _ in runs[g] for _ in range(n)] for i, g in enumerate(gms)}
    room = {f"q{i}": rooms[i] for i in range(3)}
    expected = []
    for queue in ends:
        if queue in room:
            room[queue] += 1
        ready = [(left[q][0], q) for q in sorted(left) if left[q] and room[q] > 0]
        if not ready:  # no queue with room waits: the oldest work of any
            ready = [(left[q][0], q) for q in sorted(left) if left[q]]
        if not ready:
            expected.append(None)
            continue
        _, q = min(ready)
        left[q].pop(0)
        room[q] -= 1
        expected.append(gms[int(q[1])])
    assert named[0] == expected


def test_with_shares_the_oldest_rule_stays_on():
    state = one_lm()
    view = GlobalView("gm-a", owner_grace_s=5.0, claims="oldest")
    fair = FairShare([QueueShare("qa", 0.5), QueueShare("qb", 0.5)])
    scheduler = Scheduler(view, UserQueues(["qa"]), fair, QueueLimits.parse([]))
    assert view.owner_first is not None
    state.launch("gm-b", task("b1", queue="qb"), 1)
    state.repartition("gm-b", task("b2", queue="qb"), 0)
    view.apply(state.snapshot(), now=0.0)
    # qb holds every node (over its half: gm-b says it has no room): its older work
    # claims nothing.
    scheduler.heard_backlog("gm-b", [(1.0, 1, "qb")], {"qb": 0})
    scheduler.heard_backlog("gm-a", [(2.0, 1, "qa")], {"qa": 1})
    assert view.owner_first.claimant() == "gm-a"


def test_with_shares_the_room_reported_is_what_fits_under_each_queues_share():
    state = ClusterState("lm-0", GMS)
    for i in range(4):
        state.add_node(f"w{i}", NODE, partition=i % 2)
    state.launch("gm-a", task("a1", queue="qa"), 0)
    view = GlobalView("gm-a", owner_grace_s=5.0, claims="oldest")
    view.apply(state.snapshot(), now=0.0)
    fair = FairShare([QueueShare("qa", 0.75), QueueShare("qc", 0.25)])
    scheduler = Scheduler(view, UserQueues(["qa", "qc"]), fair, QueueLimits.parse([]))
    for i in range(5):
        scheduler.submit("qa", One(task(f"a{i + 2}", queue="qa")))
    # qa holds one node of four and may hold three: two more; qc waits for nothing.
    assert scheduler.room(["qa", "qc"]) == {"qa": 2}
    # A launch no LM answered yet counts: else the next report offers its room again.
    placed = view.match(task("a2", queue="qa"))
    view.reserve(placed, task("a2", queue="qa"))
    assert scheduler.room(["qa"]) == {"qa": 1}
    # No shares, no room: nothing is limited.
    alone = Scheduler(view, UserQueues(["qa"]), None, QueueLimits.parse([]))
    alone.submit("qa", One(task("a9", queue="qa")))
    assert alone.room(["qa"]) == {}


def test_a_queue_over_its_share_yields_while_a_queue_under_its_share_waits():
    state = one_lm()
    state.launch("gm-a", task("a1", queue="qa"), 0)
    state.repartition("gm-a", task("a2", queue="qa"), 1)
    state.release("a2")  # qa holds one node of two: at its half
    view = GlobalView("gm-a", owner_grace_s=5.0, claims="oldest")
    view.apply(state.snapshot(), now=0.0)
    fair = FairShare([QueueShare("qa", 0.25), QueueShare("qb", 0.75)])
    scheduler = Scheduler(view, UserQueues(["qa"]), fair, QueueLimits.parse([]))
    scheduler.submit("qa", One(task("a3", queue="qa")))
    # qa is over its quarter while gm-b reports qb's work waiting: qa waits, though a
    # node is free (it would be preempted back), and the round asks to look again.
    scheduler.heard_backlog("gm-b", [(1.0, 1, "qb")])
    plan = scheduler.round(2.0)
    assert plan.placed == 0 and not plan.more and plan.recheck_in is not None
    assert scheduler.recheck()  # its work is ready still: the driver runs a round
    # qb's work is no longer reported waiting: qa takes the room.
    scheduler.heard_backlog("gm-b", [])
    assert scheduler.round(3.0).placed == 1
