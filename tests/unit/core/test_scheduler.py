"""The scheduler core driven through scripted scenarios (Nomad's ``Harness``): GMs are
``Scheduler``s, LMs are the ``ClusterState`` books the live LM keeps, and the harness
carries plans to the LMs and replies back, as the live GM and the simulator do. Each
test asserts the actions a scenario produces, not a service's private state."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.cluster_state import ClusterState
from services.core.fairness import FairShare, QueueShare
from services.core.global_view import ApplyResult, GlobalView, Placement
from services.core.limits import QueueLimits
from services.core.scheduler import BLIND_RECHECK_S, Decided, Drop, Reply, RoundPlan, Scheduler
from services.core.status import PlacementStatus as S
from services.core.task import TaskSpec
from services.core.user_queues import UserQueues
from tests.builders import NODE, task


@dataclass(eq=False)
class One:
    """Work of one task, as the live GM queues it."""

    spec: TaskSpec
    rejections: int = 0
    lease: int = 0
    enqueued: float = 0.0

    def head(self) -> TaskSpec:
        return self.spec

    def take(self) -> One:
        return self

    def join(self, _other: One) -> bool:
        return False

    def __len__(self) -> int:
        return 1


@dataclass(eq=False)
class Run:
    """Consecutive tasks of one shape, as the simulator queues them."""

    specs: list[TaskSpec]
    pos: int = 0
    rejections: int = 0
    lease: int = 0
    enqueued: float = 0.0

    def head(self) -> TaskSpec:
        return self.specs[self.pos]

    def take(self) -> TaskSpec:
        self.pos += 1
        return self.specs[self.pos - 1]

    def join(self, other: Run) -> bool:
        if other.head().resources.tobytes() != self.head().resources.tobytes():
            return False
        self.specs += other.specs[other.pos :]
        return True

    def __len__(self) -> int:
        return len(self.specs) - self.pos


class Harness:
    """GMs and LMs on the core classes; messages are delivered when a test says so."""

    def __init__(self, gms=("gm-a",), lms=1, nodes=1, queues=None, limits=(), **kwargs):
        queues = queues or {"q": (1.0, gms[0])}
        self.fair = FairShare([QueueShare(n, s) for n, (s, _) in queues.items()])
        self.lms = {}
        for i in range(lms):
            state = ClusterState(f"lm-{i}", gms)
            for n in range(nodes):
                state.add_node(f"lm-{i}-w{n}", NODE)
            self.lms[state.lm_id] = state
        self.gms = {
            gm: Scheduler(
                GlobalView(gm),
                UserQueues([n for n, (_, g) in queues.items() if g == gm]),
                self.fair,
                QueueLimits.parse(limits),
                **kwargs,
            )
            for gm in gms
        }
        self.heartbeat()

    def heartbeat(self, now: float = 0.0) -> dict[str, bool]:
        """Every LM's state reaches every GM; which GMs should run a round."""
        woken = {}
        for gm, sched in self.gms.items():
            woken[gm] = False
            for state in self.lms.values():
                lmv = sched.view.lms.get(state.lm_id)
                result, wake = sched.apply(state.snapshot(lmv.version if lmv else None), now)
                assert result is not ApplyResult.NEEDS_FULL
                woken[gm] |= wake
        return woken

    def send(self, gm: str, plan: RoundPlan) -> list[tuple[object, Reply]]:
        """The LMs answer every launch of ``plan``; the GM takes the replies. Returns
        the refused work and what the scheduler made of each refusal."""
        sched, verdicts = self.gms[gm], []
        for (lm_id, repartition), decided in plan.launches.items():
            state = self.lms[lm_id]
            place = state.repartition if repartition else state.launch
            refused = []
            for d in decided:
                decision = place(gm, d.spec, d.placement.node)
                if decision.ok:
                    sched.accepted(lm_id, d.spec.task_id)
                else:
                    sched.refused(lm_id, d.spec.task_id)
                    refused.append((d.handle, decision.status))
            if refused:  # the reply carries the LM's state
                sched.apply(state.snapshot(sched.view.lms[lm_id].version), 0.0)
            for work, status in refused:
                verdicts.append((work, sched.rejected(work.head().queue, work, status)))
        return verdicts

    def end(self, task_id: str) -> None:
        """The task ends on its LM; every GM hears the event."""
        for lm_id, state in self.lms.items():
            allocation = state.allocations.get(task_id)
            if allocation is not None:
                state.release(task_id)
                for sched in self.gms.values():
                    sched.ended([(lm_id, task_id, allocation.attempt, "", allocation.queue)], 0.0)


def placed(plan: RoundPlan) -> list[str]:
    return [d.spec.task_id for ds in plan.launches.values() for d in ds]


def test_a_round_places_what_fits_and_parks_the_rest_with_a_reason():
    h = Harness(nodes=1)
    sched = h.gms["gm-a"]
    for i in range(6):
        sched.submit("q", One(task(f"t{i}", cpu=1000, queue="q", job_id="j")))
    plan = sched.round(0.0)
    assert placed(plan) == ["t0", "t1", "t2", "t3"]  # the node has 4 cores
    assert [w.spec.task_id for w, _ in plan.waiting] == ["t4", "t5"]
    assert all("needs" in why or "waiting" in why for _, why in plan.waiting)
    assert plan.matches == 5  # t5's shape found no node this round: not matched again
    assert not plan.more and sched.round(0.0).taken == []  # parked until the view changes
    assert h.send("gm-a", plan) == []
    h.end("t0")  # the event frees a core: parked work is ready again
    again = sched.round(0.0)
    assert placed(again) == ["t4"] and [w.spec.task_id for w, _ in again.waiting] == ["t5"]


def test_racing_gms_the_loser_is_refused_with_fresh_state_and_the_task_waits():
    h = Harness(
        gms=("gm-a", "gm-b"), lms=2, nodes=2, queues={"a": (0.5, "gm-a"), "b": (0.5, "gm-b")}
    )
    a, b = h.gms["gm-a"], h.gms["gm-b"]
    # Each GM owns 8 cores (one node per LM). a fills its own; b fills its own and,
    # not having heard of a's launches, repartitions a ninth task onto a's nodes.
    for i in range(8):
        a.submit("a", One(task(f"a{i}", cpu=1000, queue="a", job_id="ja")))
    for i in range(9):
        b.submit("b", One(task(f"b{i}", cpu=1000, queue="b", job_id="jb")))
    plan_a, plan_b = a.round(0.0), b.round(0.0)
    assert any(repartition for _, repartition in plan_b.launches)
    assert h.send("gm-a", plan_a) == []
    verdicts = h.send("gm-b", plan_b)
    assert [(w.spec.task_id, v) for w, v in verdicts] == [("b8", Reply.RETRY)]
    # Each refusal carries its LM's state: once b knows both, it says there is no room.
    for _ in range(2):
        retry = b.round(0.0)
        if not placed(retry):
            break
        assert [(w.spec.task_id, v) for w, v in h.send("gm-b", retry)] == [("b8", Reply.RETRY)]
    assert placed(retry) == [] and [w.spec.task_id for w, _ in retry.waiting] == ["b8"]
    for state in h.lms.values():
        assert state.table.free[0].min() >= 0  # no node over-committed


def test_a_stale_view_rejected_too_often_parks_the_task_until_the_view_changes():
    h = Harness(nodes=1, max_rejections=2)
    sched = h.gms["gm-a"]
    work = One(task("t", cpu=1000, queue="q", job_id="j"))
    assert sched.rejected("q", work, S.REJECTED_RESOURCES) is Reply.RETRY
    assert sched.round(0.0).taken == [work]  # tried again first (the harness drops it)
    assert sched.rejected("q", work, S.REJECTED_RESOURCES) is Reply.PARKED
    assert sched.round(0.0).taken == []
    h.lms["lm-0"].add_node("lm-0-w9", NODE)  # a view change: a heartbeat shows it
    assert h.heartbeat()["gm-a"]
    assert placed(sched.round(0.0)) == ["t"]


def test_work_parked_for_refusals_is_tried_again_in_a_quiet_federation():
    """Parked after refusals or an unanswered preemption, a task waited for a view change
    that a quiet federation never makes (``chaos-sim --small --seed 4463``: two tasks
    stuck with no fault at all). Now a round asks the driver to recheck."""
    h = Harness(nodes=1, max_rejections=1)
    sched = h.gms["gm-a"]
    work = One(task("t", cpu=1000, queue="q", job_id="j"))
    assert sched.rejected("q", work, S.REJECTED_RESOURCES) is Reply.PARKED
    plan = sched.round(0.0)
    assert plan.taken == [] and plan.recheck_in == BLIND_RECHECK_S
    assert sched.unpark()  # the driver's timer
    assert placed(sched.round(0.0)) == ["t"]
    assert sched.round(0.0).recheck_in is None  # nothing parked blind now
    other = One(task("u", cpu=1000, queue="q", job_id="j"))
    assert sched.preempt_unanswered("q", other) is None
    assert sched.round(0.0).recheck_in == BLIND_RECHECK_S


def test_preemption_refused_because_the_victim_ended_releases_the_pledges_and_retries():
    h = Harness(nodes=1, queues={"hog": (0.5, "gm-a"), "small": (0.5, "gm-a")})
    sched = h.gms["gm-a"]
    for i in range(4):
        sched.submit("hog", One(task(f"hog{i}", cpu=1000, queue="hog", job_id="jh")))
    h.send("gm-a", sched.round(0.0))
    h.heartbeat()
    sched.submit("small", One(task("s", cpu=1000, queue="small", job_id="js")))
    plan = sched.round(0.0)
    (preemption,) = plan.preemptions
    assert preemption.plan.victims.queue == "hog" and sched.pledged
    (victim,) = preemption.plan.victims.task_ids
    state = h.lms["lm-0"]
    state.release(victim)  # it ends before the Preempt reaches the LM
    decision = state.preempt(
        "gm-a", preemption.spec, preemption.plan.victims.node, [victim], lambda q: True
    )
    assert decision.status is S.REJECTED_VICTIMS
    sched.preempt_replied(preemption.plan, "s", decision.ok)
    assert not sched.pledged
    sched.apply(state.snapshot(sched.view.lms["lm-0"].version), 0.0)
    assert sched.rejected("small", preemption.handle, decision.status) is Reply.RETRY
    assert placed(sched.round(0.0)) == ["s"]  # the freed core: no preemption needed


def test_a_queue_at_its_limit_waits_and_is_served_when_its_tasks_end():
    h = Harness(nodes=2, limits=[("q", "cpu=2")])
    sched = h.gms["gm-a"]
    for i in range(3):
        sched.submit("q", One(task(f"t{i}", cpu=1000, queue="q", job_id="j")))
    plan = sched.round(0.0)
    assert placed(plan) == ["t0", "t1"]
    ((work, why),) = plan.waiting
    assert work.spec.task_id == "t2" and "limit" in why
    h.send("gm-a", plan)
    h.heartbeat()
    h.end("t0")
    assert placed(sched.round(0.0)) == ["t2"]


def test_a_limited_queue_waits_for_every_lm_after_a_start_then_for_the_settle_time():
    sched = Scheduler(
        GlobalView("gm-a"),
        UserQueues(["q"]),
        None,
        QueueLimits.parse([("q", "cpu=8")]),
        lm_ids=["lm-0", "lm-1"],
        started_at=100.0,
        limit_settle_s=6.0,
    )
    state = ClusterState("lm-0", ("gm-a",))
    state.add_node("w", NODE)
    sched.apply(state.snapshot(), 100.0)
    sched.submit("q", One(task("t", queue="q", job_id="j")))
    plan = sched.round(101.0)
    ((_, why),) = plan.waiting
    assert "has not heard from lm-1" in why and plan.recheck_in is not None
    assert abs(plan.recheck_in - 5.05) < 1e-9
    sched.unpark()
    assert placed(sched.round(107.0)) == ["t"]  # lm-1 may be down for long


def test_a_cancelled_job_leaves_the_queues_and_its_late_work_is_dropped():
    h = Harness(nodes=0)
    sched = h.gms["gm-a"]
    for i in range(2):
        sched.submit("q", One(task(f"t{i}", queue="q", job_id="j")))
    sched.round(0.0)  # no node: both parked
    dropped = sched.cancel("j", "by the user")
    assert [w.spec.task_id for w in dropped] == ["t0", "t1"]
    sched.submit("q", One(task("t2", queue="q", job_id="j")))  # a late delivery
    plan = sched.round(0.0)
    assert [(w.spec.task_id, d) for w, d in plan.dropped] == [("t2", Drop.CANCELLED)]
    work = One(task("t3", queue="q", job_id="j"))  # refused by an LM meanwhile
    assert sched.rejected("q", work, S.REJECTED_RESOURCES) is Reply.CANCELLED


def test_withdrawn_work_is_dropped_wherever_it_turns_up():
    gone = set()
    h = Harness(nodes=1, withdrawn=lambda w: w.spec.task_id in gone)
    sched = h.gms["gm-a"]
    sched.submit("q", One(task("t", queue="q", job_id="j")))
    gone.add("t")
    assert [d for _, d in sched.round(0.0).dropped] == [Drop.WITHDRAWN]
    assert sched.retry("q", One(task("t", queue="q", job_id="j"))) is Drop.WITHDRAWN


def test_a_fenced_refusal_is_resent_when_this_gm_fenced_it_else_rechecked():
    h = Harness(nodes=1)
    sched = h.gms["gm-a"]
    sched.lease = 10
    mine = One(task("t", queue="q", job_id="j"), lease=9)  # sent before this GM's fence
    assert sched.rejected("q", mine, S.REJECTED_FENCED) is Reply.RESEND
    newer = One(task("u", queue="q", job_id="j"), lease=10)  # another GM fenced above it
    assert sched.rejected("q", newer, S.REJECTED_FENCED) is Reply.RECHECK
    assert [w.spec.task_id for w, _ in [(w, 0) for w in sched.round(0.0).taken]] == ["t"]
    # The driver fenced it above every lease and asked the LMs: held -> it runs there;
    # not held -> only this GM's launch can land now: sent again.
    assert sched.rechecked("q", newer, held=True) is Reply.LET_GO
    assert sched.round(0.0).taken == []
    assert sched.rechecked("q", newer, held=False) is Reply.RESEND
    assert [w.spec.task_id for w in sched.round(0.0).taken] == ["u"]
    for status, verdict in (
        (S.REJECTED_INVALID, Reply.INVALID),
        (S.REJECTED_TASK_ID_TAKEN, Reply.ID_TAKEN),
    ):
        assert sched.rejected("q", One(task("v", queue="q")), status) is verdict


def test_each_queue_gets_its_budget_per_round_and_the_first_queue_rotates():
    h = Harness(nodes=20, queues={"a": (0.5, "gm-a"), "b": (0.5, "gm-a")}, round_per_queue=3)
    sched = h.gms["gm-a"]
    for q in "ab":
        for i in range(5):
            sched.submit(q, One(task(f"{q}{i}", cpu=100, queue=q, job_id=q)))
    first = placed(sched.round(0.0))
    second = placed(sched.round(0.0))
    assert first == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert second == ["b3", "b4", "a3", "a4"]


def test_charged_by_what_it_takes_a_round_parks_a_backlog_a_budget_at_a_time():
    """The live GM's rounds (``charge_taken``): work parked again costs the budget too, so
    a full federation's backlog, ready again after every end, is parked over several
    rounds, each of bounded length, in the order it was queued; without the charge one
    round takes it all."""
    for charged, sizes in ((True, [4, 4, 4, 1]), (False, [13])):
        h = Harness(nodes=1, round_per_queue=4, charge_taken=charged)
        sched = h.gms["gm-a"]
        for i in range(15):
            spec = task(f"t{i}", cpu=2000, queue="q", job_id="j")
            sched.submit("q", One(spec, enqueued=float(i)))
        h.send("gm-a", sched.round(0.0))  # two fill the node's 4 cores
        h.end("t0")  # room for one: the rest is ready again
        taken, got = [], []
        while (plan := sched.round(0.0)).taken:
            taken.append(len(plan.taken))
            got += placed(plan)
            h.send("gm-a", plan)
        assert taken == sizes, charged
        assert got == ["t2"]  # the oldest waiting
        assert sched.queues.parked("q") == 12


def test_a_run_of_one_shape_is_placed_task_by_task_and_parks_as_one_item():
    h = Harness(nodes=1, round_per_queue=100)
    sched = h.gms["gm-a"]
    run = Run([task(f"t{i}", cpu=1000, queue="q", job_id="j") for i in range(6)])
    sched.submit("q", run)
    late = Run([task(f"u{i}", cpu=1000, queue="q", job_id="k") for i in range(3)])
    plan = sched.round(0.0)
    assert placed(plan) == ["t0", "t1", "t2", "t3"] and len(run) == 2
    sched.submit("q", late)
    assert sched.round(0.0).waiting and sched.queues.parked("q") == 1  # joined the run
    assert len(run) == 5


def test_a_task_no_node_could_hold_or_over_its_queue_limit_is_refused_at_submission():
    h = Harness(nodes=1, limits=[("q", "cpu=2")])
    sched = h.gms["gm-a"]
    assert sched.never_runs("q", task("ok", cpu=1000, queue="q"), 0.0) is None
    assert "may ever hold" in sched.never_runs("q", task("big", cpu=3000, queue="q"), 0.0)
    huge = task("huge", cpu=64_000, queue="q")
    assert sched.never_runs("other", huge, 0.0) is not None


def test_a_placed_task_its_lm_does_not_hold_is_a_suspect_for_lost_ends():
    h = Harness(nodes=1)
    sched = h.gms["gm-a"]
    sched.submit("q", One(task("t", queue="q", job_id="j")))
    h.send("gm-a", sched.round(0.0))
    # Accepted, but no snapshot has shown it: it may have run and ended unseen.
    assert sched.unheld({"t": ("lm-0", "t", 0)}) == {"t"}
    h.heartbeat()
    placed = {"held": ("lm-0", "t", 0), "later": ("lm-0", "t", 1), "gone": ("lm-0", "x", 0)}
    assert sched.unheld(placed) == {"later", "gone"}


def test_lost_starts_wait_for_the_restarted_lm_to_settle_and_skip_later_launches():
    h = Harness(nodes=1)
    sched = h.gms["gm-a"]
    h.lms["lm-0"] = ClusterState("lm-0", ("gm-a",), incarnation=2)  # restarted
    h.lms["lm-0"].add_node("lm-0-w0", NODE)
    sched.apply(h.lms["lm-0"].snapshot(), 100.0)
    restarted_at = sched.view.lms["lm-0"].restarted_at
    assert restarted_at is not None
    accepted = {"old": ("lm-0", restarted_at - 1), "new": ("lm-0", restarted_at + 1)}
    assert sched.lost_starts("lm-0", {"old", "new"}, accepted, restarted_at + 1, 15.0) == []
    assert sched.lost_starts("lm-0", {"old", "new"}, accepted, restarted_at + 16, 15.0) == ["old"]


def _other_gm_takes(state: ClusterState, spec: TaskSpec, node: int) -> bool:
    """Another GM ("gm-b") places ``spec`` on ``node`` of ``state`` (its partition or not)."""
    decision = state.launch("gm-b", spec, node)
    if decision.status is S.REJECTED_WRONG_PARTITION:
        decision = state.repartition("gm-b", spec, node)
    return decision.ok


def test_a_snapshot_that_frees_no_cpu_wakes_no_round_for_work_that_needs_cpu():
    """Issue 29: most rounds of an overloaded federation were woken by a heartbeat that
    showed room already taken again, and placed nothing. Such a snapshot wakes none; one
    that shows a core free does, and the parked work takes it."""
    h = Harness(gms=("gm-a", "gm-b"), lms=2, nodes=1, queues={"q": (1.0, "gm-a")})
    sched = h.gms["gm-a"]
    for i in range(9):
        sched.submit("q", One(task(f"t{i}", cpu=1000, queue="q", job_id="j")))
    plan = sched.round(0.0)
    assert len(placed(plan)) == 8 and [w.spec.task_id for w, _ in plan.waiting] == ["t8"]
    h.send("gm-a", plan)
    h.heartbeat()
    lm0, lm1 = h.lms["lm-0"], h.lms["lm-1"]
    node0 = lm0.allocations["t0"].node
    lm0.release("t0")  # ends, and another GM's task takes its core before the next beat
    assert _other_gm_takes(lm0, task("b0", cpu=1000, queue="q", job_id="b"), node0)
    assert not h.heartbeat()["gm-a"]
    assert sched.round(0.0).taken == []  # still parked: nothing to try it on
    lm1.release(next(iter(lm1.allocations)))
    assert h.heartbeat()["gm-a"]
    assert placed(sched.round(0.0)) == ["t8"]


def test_work_that_asks_no_cpu_or_waits_for_a_limit_is_woken_by_every_change():
    h = Harness(gms=("gm-a", "gm-b"), nodes=1, queues={"q": (1.0, "gm-a")})
    sched = h.gms["gm-a"]
    for i in range(4):
        sched.submit("q", One(task(f"t{i}", cpu=1000, mem=1024, queue="q", job_id="j")))
    sched.submit("q", One(task("big", cpu=1000, mem=8192, queue="q", job_id="j")))
    sched.submit("q", One(task("nocpu", cpu=0, mem=8192, queue="q", job_id="j")))
    plan = sched.round(0.0)
    assert len(placed(plan)) == 4 and len(plan.waiting) == 2
    h.send("gm-a", plan)
    lm = h.lms["lm-0"]
    lm.release("t0")
    assert _other_gm_takes(lm, task("b0", cpu=1000, mem=1024, queue="q", job_id="b"), 0)
    assert h.heartbeat()["gm-a"]  # "nocpu" might fit where no CPU is free
    limited = Harness(
        gms=("gm-a", "gm-b"), nodes=2, queues={"q": (1.0, "gm-a")}, limits=[("q", "cpu=1")]
    )
    capped = limited.gms["gm-a"]
    for i in range(2):
        capped.submit("q", One(task(f"c{i}", cpu=1000, queue="q", job_id="j")))
    limited.send("gm-a", capped.round(0.0))
    full = limited.lms["lm-0"]
    for n in range(2):
        while _other_gm_takes(full, task(f"x{n}{full.version}", cpu=1000, job_id="x"), n):
            pass
    assert limited.heartbeat()["gm-a"]  # it waits for its limit, not for room


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["submit", "end", "fill", "beat"]), st.integers(0, 7)),
        min_size=1,
        max_size=40,
    )
)
def test_a_snapshot_that_wakes_no_round_leaves_nothing_a_round_would_place(ops):
    """Property: whenever a snapshot wakes no round, unparking and running one anyway
    (what every snapshot did before) places nothing. Random submissions (some asking no
    CPU), ends, other GMs' launches and heartbeats on 2 LMs of 2 nodes."""
    h = Harness(gms=("gm-a", "gm-b"), lms=2, nodes=2, queues={"q": (1.0, "gm-a")})
    sched = h.gms["gm-a"]
    lms = list(h.lms.values())

    def settle() -> None:  # rounds until nothing is ready (refused launches come back)
        for _ in range(20):
            if not sched.ready():
                return
            h.send("gm-a", sched.round(0.0))

    for count, (op, k) in enumerate(ops):
        if op == "submit":
            spec = task(f"t{count}", cpu=1000 * (k % 3), mem=512 * (1 + k), queue="q", job_id="j")
            sched.submit("q", One(spec))
            settle()
        elif op == "end":
            state = lms[k % 2]
            if state.allocations:
                ended = sorted(state.allocations)[k % len(state.allocations)]
                state.release(ended)
        elif op == "fill":
            state = lms[k % 2]
            _other_gm_takes(state, task(f"b{count}", cpu=1000, mem=512, job_id="b"), k % 2)
        else:
            for state in lms:
                lmv = sched.view.lms[state.lm_id]
                result, wake = sched.apply(state.snapshot(lmv.version), 0.0)
                if result is ApplyResult.APPLIED and not wake:
                    assert not sched.ready()
                    sched.unpark()
                    assert placed(sched.round(0.0)) == []
                elif wake:
                    settle()


@given(st.lists(st.tuples(st.sampled_from(["lm-1", "lm-2"]), st.booleans()), max_size=30))
def test_a_round_goes_as_one_request_per_lm_in_the_order_it_was_decided(choices):
    plan: RoundPlan = RoundPlan()
    for match, (lm_id, repartition) in enumerate(choices, start=1):
        placement = Placement(lm_id, match, f"n{match}", repartition)
        decided = Decided(match, task(f"t{match}"), placement, match)
        plan.launches.setdefault((lm_id, repartition), []).append(decided)
    requests = plan.per_lm()
    assert set(requests) == {lm_id for lm_id, _ in choices}
    for lm_id, decided in requests.items():
        expected = [m for m, (lm, _) in enumerate(choices, start=1) if lm == lm_id]
        assert [d.match for d in decided] == expected  # each once, in decision order
        assert all(d.placement.repartition == choices[d.match - 1][1] for d in decided)
