"""The LM's task lifecycle (``services.core.lm_lifecycle``) driven through scripted
scenarios, as the live LM drives it: each step is an event (a GM request, a worker's
report or inventory, a dead node, a cancel, a tick) and the test asserts the plan."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from services.core.cancels import CancelledJobs
from services.core.cluster_state import ClusterState
from services.core.gang import GangPiece
from services.core.lm_lifecycle import (
    Held,
    InventoryVerdict,
    Journal,
    Kill,
    Lifecycle,
    Lookup,
    Owe,
    Publish,
    ReportVerdict,
    Requeue,
    RoomFor,
    Start,
)
from services.core.reservations import Reservations, is_placeholder
from services.core.states import TaskState
from services.core.status import PlacementStatus
from tests.builders import NODE, task


@dataclass
class Stamps:
    started_unix_nanos: int = 0


@dataclass(eq=False)
class Wire:
    """A task as a driver holds it (the live LM: a ``megha.v1.Task``)."""

    task_id: str
    job_id: str = "j"
    attempt: int = 0
    failures: int = 0
    max_retries: int = 0
    lease: int = 0
    timestamps: Stamps = field(default_factory=Stamps)


@dataclass
class Report:
    task_id: str
    attempt: int
    state: int
    message: str = ""
    peak_memory_mb: int = 0


class Harness:
    """One LM (books, lifecycle) with ``nodes`` workers in gm-a's partition; carries out
    nothing, so every step's plan is there to assert."""

    def __init__(self, nodes: int = 3, timeout: float = 10.0, grace: float = 15.0):
        self.books = ClusterState("lm-1", ["gm-a"])
        for i in range(nodes):
            self.books.add_node(f"w{i}", NODE)
        self.life: Lifecycle[Wire] = Lifecycle(self.books, CancelledJobs(), timeout, grace)

    def launch(self, wire: Wire, node: int = 0) -> list:
        decision, actions = self.life.place("gm-a", spec_of(wire), node)
        assert decision.status is PlacementStatus.ACCEPTED, decision
        return [*actions, *self.life.hold(wire, decision.allocation)]

    def report(self, node: int, wire: Wire, state: TaskState, **kw):
        return self.life.report(node, Report(wire.task_id, wire.attempt, state, **kw))

    def held(self, wire: Wire, running: bool = True) -> Held[Wire]:
        return Held(wire, spec_of(wire), running)


def requeued(actions) -> list[tuple[str, int]]:
    """The (task, ended attempt) of every re-queue: the next attempt is attempt + 1."""
    return [(a.task.task_id, a.task.attempt) for a in actions if isinstance(a, Requeue)]


def published(actions) -> list[tuple[str, TaskState, str]]:
    return [
        (a.task.task_id, TaskState(a.state), a.reason) for a in actions if isinstance(a, Publish)
    ]


def spec_of(wire: Wire):
    spec = task(wire.task_id, attempt=wire.attempt, job_id=wire.job_id)
    return replace(spec, lease=wire.lease)


# ------------------------------------------------------------- placement
def test_an_accepted_task_is_held_started_and_placed():
    h = Harness()
    t = Wire("t1")
    actions = h.launch(t, node=1)
    assert actions == [Start(1, t), Publish(t, TaskState.PLACED, 1)]
    assert h.life.tasks == {"t1": t}


def test_a_newer_attempt_supersedes_the_older_which_is_killed_by_attempt_and_lost():
    h = Harness()
    old, new = Wire("t1", attempt=0), Wire("t1", attempt=1)
    h.launch(old, node=0)
    actions = h.launch(new, node=1)
    assert actions[:2] == [
        Kill(0, "t1", 0, "superseded"),
        Publish(old, TaskState.LOST, 0, "superseded"),
    ]
    assert h.life.tasks["t1"] is new and h.books.allocations["t1"].attempt == 1
    # The old attempt's late end, from its node, changes nothing: the new one runs on.
    assert h.report(0, old, TaskState.SUCCEEDED).verdict is ReportVerdict.IGNORED
    # Nor does a report naming the old attempt from the new one's node.
    stray = Report("t1", 0, TaskState.SUCCEEDED)
    assert h.life.report(1, stray).verdict is ReportVerdict.IGNORED
    assert h.books.allocations["t1"].attempt == 1 and h.life.tasks["t1"] is new


def test_a_cancelled_jobs_task_is_refused_and_nothing_is_booked():
    h = Harness()
    h.life.cancelled.add("j", "by alice")
    decision, actions = h.life.place("gm-a", task("t1", job_id="j"), 0)
    assert decision.status is PlacementStatus.REJECTED_CANCELLED
    assert decision.reason == "job j was cancelled: by alice"
    assert actions == () and not h.books.allocations


# ---------------------------------------------------------------- reports
def test_the_first_running_report_is_news_a_repeated_one_is_known():
    h = Harness()
    t = Wire("t1")
    h.launch(t)
    first = h.report(0, t, TaskState.RUNNING)
    assert first.verdict is ReportVerdict.PROGRESS and first.task is t
    assert published(first.actions) == [("t1", TaskState.RUNNING, "")]
    t.timestamps.started_unix_nanos = 5  # the driver merged the worker's times
    again = h.report(0, t, TaskState.RUNNING)
    assert again.verdict is ReportVerdict.KNOWN and again.verdict.accepted
    assert again.task is None and again.actions == []
    assert "t1" in h.books.allocations


def test_a_success_releases_the_task_once():
    h = Harness()
    t = Wire("t1")
    h.launch(t)
    free = h.books.table.free[:, 0].copy()
    done = h.report(0, t, TaskState.SUCCEEDED, message="exit 0", peak_memory_mb=12)
    assert done.verdict is ReportVerdict.ENDED
    assert done.actions == [Publish(t, TaskState.SUCCEEDED, 0, "exit 0", 12)]
    assert "t1" not in h.books.allocations and "t1" not in h.life.tasks
    assert (h.books.table.free[:, 0] > free).any()
    assert requeued(done.actions) == []
    repeat = h.report(0, t, TaskState.SUCCEEDED)
    assert repeat.verdict is ReportVerdict.IGNORED and not repeat.verdict.accepted


def test_a_failure_with_retries_left_is_retried_as_the_next_attempt():
    h = Harness()
    t = Wire("t1", max_retries=2)
    h.launch(t)
    outcome = h.report(0, t, TaskState.FAILED, message="exit 3", peak_memory_mb=7)
    assert outcome.verdict is ReportVerdict.RETRYING and outcome.task is t
    assert outcome.actions == [Publish(t, TaskState.RETRYING, 0, "exit 3", 7), Requeue(t)]
    assert t.failures == 1  # the next attempt carries the count
    assert "t1" not in h.books.allocations and "t1" not in h.life.tasks
    assert h.books.known_attempt("t1") == (0, False)  # a retry of attempt 0: a duplicate


def test_a_failure_without_retries_left_ends_the_task():
    h = Harness()
    t = Wire("t1", failures=2, max_retries=2)
    h.launch(t)
    outcome = h.report(0, t, TaskState.FAILED, message="exit 3")
    assert outcome.verdict is ReportVerdict.ENDED
    assert outcome.actions == [Publish(t, TaskState.FAILED, 0, "exit 3")]
    assert t.failures == 2 and "t1" not in h.life.tasks and "t1" not in h.books.allocations


def test_a_worker_going_away_reports_lost_and_the_task_is_requeued_at_once():
    h = Harness()
    t = Wire("t1", attempt=3)
    h.launch(t)
    outcome = h.report(0, t, TaskState.LOST, message="worker stopping")
    assert outcome.verdict is ReportVerdict.LOST
    assert outcome.actions == [Publish(t, TaskState.LOST, 0, "worker stopping"), Requeue(t)]
    assert requeued(outcome.actions) == [("t1", 3)]  # attempt 4 goes to the queue
    # The node's death right after re-queues nothing more: exactly once.
    assert h.life.node_lost(0, "gone").actions == []


def test_a_report_from_another_node_than_the_books_say_is_ignored():
    h = Harness()
    t = Wire("t1")
    h.launch(t, node=0)
    assert h.report(1, t, TaskState.SUCCEEDED).verdict is ReportVerdict.IGNORED
    assert "t1" in h.books.allocations


# ----------------------------------------------------------- preemption
def preempted_two(h: Harness) -> tuple[list[Wire], list]:
    """Two victims on node 0, preempted for task p (held, as the driver does), which
    needs both their places."""
    victims = [Wire(f"v{i}", job_id="jv") for i in range(2)]
    for v in victims:
        spec = task(v.task_id, cpu=2000, queue="greedy", job_id="jv")
        decision, _ = h.life.place("gm-a", spec, 0)
        h.life.hold(v, decision.allocation)
    decision, actions = h.life.preempt(
        "gm-a", task("p", cpu=3000, job_id="jp"), 0, ["v0", "v1"], lambda queue: True
    )
    assert decision.status is PlacementStatus.ACCEPTED
    h.life.hold(Wire("p", job_id="jp"), decision.allocation)
    return victims, actions


def test_preemption_kills_every_victim_and_queues_none_before_its_kill_took_effect():
    # Chaos-sim bug 2: the next attempt was queued as the kill was sent; a kill that
    # reached its worker late let the old attempt run beside the next one.
    h = Harness(nodes=1)
    victims, actions = preempted_two(h)
    kinds = [type(a).__name__ for a in actions]
    # Stopping (journalled) before the kills: a kill that takes back a start at once
    # re-queues it, and a stopping row written after that would queue it again after a
    # restart (chaos-sim --small --seed 485).
    assert kinds == ["Publish", "Owe", "Publish", "Owe", "Kill", "Kill"]
    assert actions[-2:] == [Kill(0, "v0", 0, "preempted"), Kill(0, "v1", 0, "preempted")]
    assert published(actions) == [
        ("v0", TaskState.PREEMPTED, "preempted"),
        ("v1", TaskState.PREEMPTED, "preempted"),
    ]
    assert [a.task for a in actions if isinstance(a, Owe)] == victims
    assert requeued(actions) == []  # the task that preempts them runs at once, though
    assert "p" in h.books.allocations and set(h.life.stopping) == {("v0", 0), ("v1", 0)}
    # Still running, as the worker says before the kill reaches it: nothing yet.
    assert h.report(0, victims[0], TaskState.RUNNING).verdict is ReportVerdict.IGNORED
    # The worker says it is killed: now the next attempt is queued, once.
    outcome = h.report(0, victims[0], TaskState.PREEMPTED)
    assert outcome.verdict is ReportVerdict.STOPPED
    assert outcome.actions == [Requeue(victims[0], owed=True)]
    assert h.report(0, victims[0], TaskState.PREEMPTED).verdict is ReportVerdict.IGNORED
    # It ended on its own before the kill came: its next attempt is queued all the same
    # (the federation was told PREEMPTED).
    outcome = h.report(0, victims[1], TaskState.SUCCEEDED)
    assert requeued(outcome.actions) == [("v1", 0)] and not h.life.stopping


def test_a_killed_attempts_end_from_another_node_or_attempt_queues_nothing():
    h = Harness(nodes=2)
    victims, _ = preempted_two(h)
    assert h.report(1, victims[0], TaskState.PREEMPTED).verdict is ReportVerdict.IGNORED
    other = Wire("v0", job_id="jv", attempt=1)
    assert h.report(0, other, TaskState.PREEMPTED).verdict is ReportVerdict.IGNORED
    assert ("v0", 0) in h.life.stopping


def test_a_kill_whose_start_never_left_the_lm_queues_the_next_attempt_at_once():
    h = Harness(nodes=1)
    victims, _ = preempted_two(h)
    # The driver found v0's start still waiting for the worker's stream and took it
    # back with its kill: v0 never ran, and never will.
    assert h.life.withdrawn("v0", 0) == [Requeue(victims[0], owed=True)]
    assert h.life.withdrawn("v0", 0) == []
    assert h.life.withdrawn("other", 0) == []  # a cancel's or a supersede's kill
    assert set(h.life.stopping) == {("v1", 0)}


def test_a_killed_attempts_next_is_queued_when_its_node_is_taken_for_dead():
    # With worker_fence_s on, a worker the LM has not heard from for worker_timeout_s
    # has killed what it ran, and starts nothing, by then.
    h = Harness(nodes=1)
    preempted_two(h)
    loss = h.life.node_lost(0, "no heartbeat for 10 s")
    assert ("p", 0) in requeued(loss.actions)
    assert sorted(a.task.task_id for a in loss.actions if isinstance(a, Requeue) and a.owed) == [
        "v0",
        "v1",
    ]
    assert not h.life.stopping


def test_a_registering_worker_says_which_killed_attempts_still_run():
    h = Harness(nodes=1)
    victims, _ = preempted_two(h)
    p = h.life.tasks["p"]
    # v0 still runs there (its kill was lost with the stream: killed again, STALE); v1
    # is gone (the worker never got it, or it ended): its next attempt is queued.
    plan = h.life.take_back(0, [h.held(victims[0]), h.held(p)])
    assert (victims[0].task_id, InventoryVerdict.STALE) in plan.verdicts
    assert Kill(0, "v0", 0, "this attempt ended on the LM's books") in plan.actions
    assert requeued(plan.actions) == [("v1", 0)]
    assert set(h.life.stopping) == {("v0", 0)}
    # A start of v0 still waiting to be sent (its kill waits behind it): not ended yet.
    assert requeued(h.life.take_back(0, [h.held(p)], pending=["v0"]).actions) == []
    # Named as ended, its final report owed: ended.
    plan = h.life.take_back(0, [h.held(p), h.held(victims[0], running=False)])
    assert requeued(plan.actions) == [("v0", 0)] and not h.life.stopping


def test_a_restarted_lm_still_queues_the_next_attempt_it_owed():
    h = Harness(nodes=2, grace=15.0)
    a, b, c = Wire("a"), Wire("b"), Wire("c")
    h.life.recall([], owed=[a, b, c])
    assert h.life.unclaimed
    # a's worker names it running: it stops there, as its kill (STALE) takes effect.
    plan = h.life.take_back(0, [h.held(a)])
    assert requeued(plan.actions) == [] and h.life.stopping[("a", 0)].node == 0
    assert requeued(h.report(0, a, TaskState.FAILED).actions) == [("a", 0)]
    # b's worker names it ended.
    plan = h.life.take_back(1, [h.held(b, running=False)])
    assert requeued(plan.actions) == [("b", 0)]
    # No worker names c within the grace: its worker died or fenced itself.
    due = h.life.arm_orphans(100.0)
    assert h.life.expire_orphan(due - 1) is None
    assert h.life.expire_orphan(due) == [Requeue(c, owed=True)]
    assert h.life.expire_orphan(due) is None and not h.life.unclaimed


def test_a_recalled_killed_attempt_whose_end_comes_as_a_report_is_queued_at_once():
    """Its worker's final report was written to the old LM's stream, so it is not in the
    registration (owed reports only) but sent again on the new stream: before, a report
    of an attempt recalled with no node was ignored, and its next attempt waited for the
    orphans' grace (the live chaos suite's lm-kill once ran out of time)."""
    h = Harness(nodes=1, grace=15.0)
    v = Wire("v")
    h.life.recall([], owed=[v])
    assert requeued(h.life.take_back(0, []).actions) == []
    assert requeued(h.report(0, v, TaskState.PREEMPTED).actions) == [("v", 0)]
    assert not h.life.stopping


def test_a_killed_attempt_whose_ending_was_not_written_is_no_orphan_and_is_not_adopted():
    """The LM died after writing a kill's row (``Owe``) and before the ending (written a
    loop turn later): the journal holds the attempt both as accepted and as killed.
    Before, it was an orphan too (its next attempt queued twice: by the orphan's expiry
    and by its own), and a worker still running it had it adopted, running on beside
    the next attempt queued at its end."""
    h = Harness(nodes=2, grace=15.0)
    v, w = Wire("v"), Wire("w")
    h.life.recall([v, w], owed=[v, w])
    assert not h.life.orphans
    plan = h.life.take_back(0, [h.held(v)])  # v's kill was lost with the LM: it runs
    assert ("v", InventoryVerdict.STALE) in plan.verdicts and "v" not in h.life.tasks
    assert requeued(h.report(0, v, TaskState.FAILED).actions) == [("v", 0)]
    due = h.life.arm_orphans(100.0)  # no worker names w: queued once, after the grace
    assert h.life.expire_orphan(due) == [Requeue(w, owed=True)]
    assert h.life.expire_orphan(due) is None and not h.life.unclaimed


def test_a_preemption_for_a_newer_attempt_supersedes_the_older_too():
    h = Harness(nodes=2)
    old, victim = Wire("t1", attempt=0), Wire("v")
    h.launch(old, 0)
    decision, _ = h.life.place("gm-a", task("v", cpu=3500), 1)
    h.life.hold(victim, decision.allocation)
    newer = spec_of(Wire("t1", attempt=1))
    decision, actions = h.life.preempt("gm-a", newer, 1, ["v"], lambda queue: True)
    assert decision.status is PlacementStatus.ACCEPTED
    assert actions[-2:] == [
        Kill(0, "t1", 0, "superseded"),
        Publish(old, TaskState.LOST, 0, "superseded"),
    ]
    assert h.books.allocations["t1"].node == 1 and "t1" not in h.life.tasks


def test_a_refused_preemption_changes_nothing():
    h = Harness(nodes=1)
    v = Wire("v0")
    h.launch(v)
    decision, actions = h.life.preempt("gm-a", task("p", cpu=3500), 0, ["v0"], lambda queue: False)
    assert decision.status is PlacementStatus.REJECTED_VICTIMS and actions == []
    assert h.life.tasks == {"v0": v}


def test_a_preempted_end_reported_for_the_held_attempt_releases_it_for_good():
    h = Harness()
    t = Wire("t1")
    h.launch(t)
    outcome = h.report(0, t, TaskState.PREEMPTED, message="evicted by the host")
    assert outcome.verdict is ReportVerdict.ENDED
    assert requeued(outcome.actions) == []
    assert "t1" not in h.life.tasks and "t1" not in h.books.allocations


# ------------------------------------------------------------ dead nodes
def test_a_lost_worker_requeues_what_it_ran_as_the_next_attempt():
    h = Harness()
    a, b, other = Wire("a", attempt=2), Wire("b"), Wire("c")
    h.launch(a, 0)
    h.launch(b, 0)
    h.launch(other, 1)
    loss = h.life.node_lost(0, "no heartbeat for 10 s")
    assert {x.task_id for x in loss.lost} == {"a", "b"}
    assert sorted(requeued(loss.actions)) == [("a", 2), ("b", 0)]
    assert {r for _, _, r in published(loss.actions)} == {"worker lost: no heartbeat for 10 s"}
    assert set(h.life.tasks) == {"c"} and not h.books.table.is_alive(0)
    # Its late reports, and a second verdict of death, do nothing.
    assert h.report(0, a, TaskState.SUCCEEDED).verdict is ReportVerdict.IGNORED
    assert h.life.node_lost(0, "again").actions == []


def test_the_watchdog_takes_silent_alive_nodes_for_dead():
    h = Harness(timeout=10.0)
    for node in range(3):
        h.life.heard(node, now=100.0)
    h.life.heard(1, now=105.0)
    assert list(h.life.silent(now=110.0)) == []  # silent 10 s: not longer than the timeout
    assert list(h.life.silent(now=110.5)) == [0, 2]
    h.life.node_lost(0, "silent")
    assert list(h.life.silent(now=111.0)) == [2]  # dead already: judged once


def test_the_watchdog_judges_each_node_as_it_is_when_its_turn_comes():
    h = Harness(timeout=1.0)
    h.life.heard(0, 0.0)
    h.life.heard(1, 0.0)
    silent = h.life.silent(5.0)
    assert next(silent) == 0
    h.life.heard(1, 5.0)  # heard while the driver acted on node 0
    assert list(silent) == []


# ------------------------------------------------------------- cancels
def test_a_cancel_ends_the_jobs_tasks_and_kills_them_by_attempt():
    h = Harness()
    a, b, keep = Wire("a", job_id="j", attempt=1), Wire("b", job_id="j"), Wire("k", job_id="k")
    h.launch(a, 0)
    h.launch(b, 1)
    h.launch(keep, 1)
    h.life.cancelled.add("j", "by alice")
    actions = h.life.cancel({"j"})
    assert actions == [
        Publish(a, TaskState.CANCELLED, 0, "by alice"),
        Kill(0, "a", 1, "cancelled: by alice"),
        Publish(b, TaskState.CANCELLED, 1, "by alice"),
        Kill(1, "b", 0, "cancelled: by alice"),
    ]
    assert set(h.life.tasks) == {"k"} and set(h.books.allocations) == {"k"}
    # The worker's report of the kill finds nothing held.
    assert h.report(0, a, TaskState.CANCELLED).verdict is ReportVerdict.IGNORED


# ------------------------------------------------------------ inventory
def test_a_restarted_lm_adopts_what_a_worker_runs_and_journals_it():
    h = Harness()  # empty books: a new incarnation
    running, finished = Wire("r", attempt=2), Wire("f")
    plan = h.life.take_back(0, [h.held(running), h.held(finished, running=False)])
    assert plan.verdicts == [("r", InventoryVerdict.ADOPTED), ("f", InventoryVerdict.ADOPTED)]
    assert plan.actions == [Journal(running), Journal(finished)]
    assert h.books.allocations["r"].attempt == 2 and h.life.tasks["r"] is running
    # Its reports then go the usual way.
    assert h.report(0, finished, TaskState.SUCCEEDED).verdict is ReportVerdict.ENDED


def test_a_reconnecting_worker_names_what_the_books_know():
    h = Harness()
    t = Wire("t1")
    h.launch(t, 0)
    plan = h.life.take_back(0, [h.held(t)])
    assert plan.verdicts == [("t1", InventoryVerdict.KNOWN)] and plan.actions == []
    assert h.life.tasks["t1"] is t


def test_a_worker_running_an_attempt_the_books_saw_end_is_told_to_kill_it():
    h = Harness()
    t = Wire("t1")
    h.launch(t, 0)
    h.life.node_lost(0, "silent")  # re-queued: attempt 1 goes on elsewhere
    h.books.set_alive(0, True)  # it registers again, still running attempt 0
    owed = Wire("t2")
    h.books.remember_ended("t2", 0)
    plan = h.life.take_back(0, [h.held(t), h.held(owed, running=False)])
    assert plan.verdicts == [("t1", InventoryVerdict.STALE), ("t2", InventoryVerdict.REFUSED)]
    assert plan.actions == [Kill(0, "t1", 0, "this attempt ended on the LM's books")]
    assert not h.books.allocations and not h.life.tasks


def test_a_worker_running_a_fenced_attempt_is_told_to_kill_it():
    h = Harness()
    h.life.lookup(["t1"], fence_lease=5)  # a GM fenced it: older requests do nothing
    plan = h.life.take_back(0, [h.held(Wire("t1", lease=3))])
    assert plan.verdicts == [("t1", InventoryVerdict.STALE)]
    assert plan.actions == [Kill(0, "t1", 0, "this attempt ended on the LM's books")]


def test_what_the_books_hold_on_a_node_and_its_worker_lost_is_requeued():
    h = Harness()
    kept, lost, pending = Wire("kept"), Wire("lost", attempt=1), Wire("pending")
    for t in (kept, lost, pending):
        h.launch(t, 0)
    # The worker came back (restarted) holding "kept"; "pending" still waits to be sent.
    plan = h.life.take_back(0, [h.held(kept)], pending=["pending"])
    assert ("lost", InventoryVerdict.MISSING) in plan.verdicts
    assert plan.actions == [
        Publish(lost, TaskState.LOST, 0, "worker w0 came back without it (restarted?)"),
        Requeue(lost),
    ]
    assert set(h.books.allocations) == {"kept", "pending"}
    assert set(h.life.tasks) == {"kept", "pending"}


def test_a_worker_naming_an_earlier_attempt_has_lost_the_one_the_books_put_on_it():
    """The worker still owes attempt 0's final report; the books put attempt 1 on it
    since, and its start was lost with the stream the worker left. Named by id only,
    attempt 1 was taken for held: never run, never re-queued (``chaos-sim --small
    --calm-streams --seed 193``)."""
    h = Harness()
    again = Wire("t1", attempt=1)
    h.launch(again, 0)
    plan = h.life.take_back(0, [h.held(Wire("t1"), running=False)])
    assert ("t1", InventoryVerdict.MISSING) in plan.verdicts
    assert plan.actions[-2:] == [
        Publish(again, TaskState.LOST, 0, "worker w0 came back without it (restarted?)"),
        Requeue(again),
    ]
    assert "t1" not in h.books.allocations


def test_an_unreadable_task_is_named_but_left_alone():
    h = Harness()
    t = Wire("t1")
    h.launch(t, 0)
    plan = h.life.take_back(0, [Held(Wire("t1"), None, True)])
    assert plan.verdicts == [("t1", InventoryVerdict.MALFORMED)] and plan.actions == []
    assert "t1" in h.books.allocations  # named: not taken for lost


def test_a_worker_returning_with_a_cancelled_jobs_task_has_it_cancelled():
    h = Harness()
    h.life.cancelled.add("j", "by bob")
    doomed, other = Wire("d", job_id="j"), Wire("o", job_id="k")
    plan = h.life.take_back(0, [h.held(doomed), h.held(other)])
    assert plan.cancelled == 1 and plan.cancelled_jobs == {"j"}
    assert plan.actions == [
        Journal(doomed),
        Journal(other),
        Publish(doomed, TaskState.CANCELLED, 0, "by bob"),
        Kill(0, "d", 0, "cancelled: by bob"),
    ]
    assert set(h.life.tasks) == {"o"}


# -------------------------------------------------------------- orphans
def test_an_orphan_no_worker_names_is_ended_then_requeued_after_the_grace():
    h = Harness(grace=15.0)
    a, b = Wire("a", attempt=1), Wire("b")
    h.life.recall([a, b])
    assert h.life.expire_orphan(now=0.0) is None  # not armed: the LM has not started
    assert h.life.arm_orphans(now=100.0) == 115.0
    assert h.life.expire_orphan(now=114.9) is None
    assert h.life.lookup(["a"]) == [Lookup("a", 1, True)]  # held: a worker may name it
    first = h.life.expire_orphan(now=115.0)
    assert first == [Requeue(a), Publish(a, TaskState.LOST, -1, "lm-1 restarted")]
    assert h.books.known_attempt("a") == (1, False)  # ended on the books
    # Its worker, late, is told to kill its copy rather than have it booked.
    plan = h.life.take_back(0, [h.held(a)])
    assert plan.verdicts == [("a", InventoryVerdict.STALE)]
    assert requeued(h.life.expire_orphan(now=116.0)) == [("b", 0)]
    assert h.life.expire_orphan(now=117.0) is None


def test_an_orphan_a_worker_names_is_held_again_not_requeued():
    h = Harness()
    a = Wire("a", attempt=2)
    h.life.recall([a])
    h.life.arm_orphans(now=0.0)
    h.life.take_back(0, [h.held(Wire("a", attempt=1))])  # an older attempt: still an orphan
    assert "a" in h.life.orphans
    named = Wire("a", attempt=2)
    plan = h.life.take_back(1, [h.held(named)])
    assert plan.verdicts == [("a", InventoryVerdict.ADOPTED)] and not h.life.orphans
    assert h.life.expire_orphan(now=1e9) is None


def test_an_orphan_a_newer_attempt_replaces_is_no_orphan():
    h = Harness()
    h.life.recall([Wire("a", attempt=0)])
    h.launch(Wire("a", attempt=1))
    assert not h.life.orphans


# --------------------------------------------------------------- lookups
def test_a_lookup_fences_what_is_not_held_in_the_same_step():
    h = Harness()
    running, ended = Wire("run"), Wire("end")
    h.launch(running, 0)
    h.launch(ended, 1)
    h.report(1, ended, TaskState.SUCCEEDED)
    h.life.recall([Wire("orphan", attempt=3)])
    found = h.life.lookup(["run", "end", "orphan", "never"], fence_lease=7)
    assert found == [Lookup("run", 0, True), Lookup("end", 0, False), Lookup("orphan", 3, True)]
    late = spec_of(Wire("never", lease=6))
    assert h.life.place("gm-a", late, 2)[0].status is PlacementStatus.REJECTED_FENCED
    # What it holds is left alone: a request of it with any lease is judged as before.
    again = task("run")
    assert h.life.place("gm-a", again, 0)[0].status is PlacementStatus.DUPLICATE


def test_a_lookup_names_an_orphans_attempt_over_an_earlier_one_that_ended_here():
    # Found by the chaos simulation (``megha-loadgen chaos-sim``): attempt 0 of a task
    # ended here, attempt 2 was accepted here before the LM restarted (an orphan); a GM
    # settling a launch asks before the worker registers again. Told "attempt 0, ended",
    # it fenced the task and placed attempt 2 elsewhere, and the worker's copy, fenced,
    # was refused: attempt 2 ran twice.
    h = Harness()
    h.books.remember_ended("a", 0, "j")  # from the journal
    h.life.recall([Wire("a", attempt=2)])
    assert h.life.lookup(["a"], fence_lease=9) == [Lookup("a", 2, True)]
    plan = h.life.take_back(0, [h.held(Wire("a", attempt=2), running=False)])
    assert plan.verdicts == [("a", InventoryVerdict.ADOPTED)]  # not fenced: its end counts


def test_the_listing_shows_what_runs_what_waits_to_start_and_the_orphans():
    h = Harness()
    placed, running, orphan = Wire("p"), Wire("r"), Wire("o")
    h.launch(placed, 0)
    h.launch(running, 1)
    running.timestamps.started_unix_nanos = 1
    h.life.recall([orphan])
    assert list(h.life.listing()) == [
        (placed, TaskState.PLACED, 0),
        (running, TaskState.RUNNING, 1),
        (orphan, TaskState.PLACED, -1),
    ]


@pytest.mark.parametrize("state", [TaskState.SUCCEEDED, TaskState.CANCELLED])
def test_no_report_of_an_ended_task_ever_requeues_it(state):
    h = Harness()
    t = Wire("t1", max_retries=5)
    h.launch(t)
    assert requeued(h.report(0, t, state).actions) == []
    for later in TaskState:
        assert h.report(0, t, later).verdict is ReportVerdict.IGNORED


def test_a_gangs_held_room_survives_its_workers_registration_and_its_death():
    """A gang's placeholders (``Reservations``) are the LM's, not a worker's: a worker
    registering without them does not drop them (or the gang would lose its room); a
    node that dies drops them with it but re-queues nothing (no task of them ran)."""
    h = Harness(nodes=1)
    gangs = Reservations(h.books)
    piece = GangPiece(0, spec_of(Wire("g.0", job_id="g")), "lm-1", 0, "w0", False)
    assert gangs.reserve("g/1", [piece], 0.0, 5.0, gm_id="gm-a").ok
    plan = h.life.take_back(0, [])
    assert plan.actions == [] and [a for a in h.books.allocations if is_placeholder(a)]
    loss = h.life.node_lost(0, "silent", 1.0)
    assert loss.actions == [] and not h.books.allocations
    assert not gangs.commit("g/1", 1.0).ok


# ------------------------------------------------------ a gang's restart
def test_a_stopped_gang_member_ends_lost_and_its_next_waits_for_the_kill():
    """StopTasks (a GM restarting a gang whole): the held attempt ends LOST with the
    reason, journalled as stopping before its kill, and its next attempt is queued only
    once the worker says it ended, once."""
    h = Harness(nodes=1)
    member = Wire("g.1", job_id="g")
    h.launch(member)
    reason = "gang member g.0 lost: its gang restarts whole"
    actions = h.life.stop("g.1", 0, reason)
    assert [type(a).__name__ for a in actions] == ["Publish", "Owe", "Kill"]
    assert published(actions) == [("g.1", TaskState.LOST, reason)]
    assert actions[-1] == Kill(0, "g.1", 0, reason)
    assert requeued(actions) == [] and "g.1" not in h.books.allocations
    assert set(h.life.stopping) == {("g.1", 0)}
    # Stopped again (a GM's retry), or another attempt named: nothing more.
    assert h.life.stop("g.1", 0, reason) == []
    assert h.report(0, member, TaskState.RUNNING).verdict is ReportVerdict.IGNORED
    outcome = h.report(0, member, TaskState.LOST)
    assert outcome.verdict is ReportVerdict.STOPPED
    assert outcome.actions == [Requeue(member, owed=True)]
    assert h.report(0, member, TaskState.LOST).verdict is ReportVerdict.IGNORED


def test_stopping_an_attempt_not_held_does_nothing():
    h = Harness(nodes=1)
    member = Wire("g.1", job_id="g", attempt=2)
    h.launch(member)
    assert h.life.stop("g.1", 1, "x") == []  # an older attempt: the held one runs on
    assert h.life.stop("g.9", 0, "x") == []  # never here
    assert h.books.allocations["g.1"].attempt == 2 and not h.life.stopping
    h.report(0, member, TaskState.SUCCEEDED)
    assert h.life.stop("g.1", 2, "x") == []  # ended already: not run again


def test_a_stopped_member_whose_node_dies_is_queued_then():
    h = Harness(nodes=1)
    member = Wire("g.1", job_id="g")
    h.launch(member)
    h.life.stop("g.1", 0, "x")
    loss = h.life.node_lost(0, "no heartbeat")
    assert requeued(loss.actions) == [("g.1", 0)] and not h.life.stopping


def test_a_task_evicted_for_a_gang_ends_preempted_only_if_its_queue_is_over_share():
    """StopTasks with ``preempt`` (a waiting gang's victims): the held attempt of a queue
    over its share ends PREEMPTED, killed, its next attempt queued once the kill took
    effect; one of a queue within its share, or a gang's, is left running."""
    h = Harness(nodes=1)
    victim, keeper = Wire("v.1", job_id="v"), Wire("k.1", job_id="k")
    h.launch(victim)
    h.launch(keeper)
    reason = "preempted for gang jb/1 (queue b under its share)"
    over = {"default"}  # the queue spec_of gives every task
    assert h.life.evict("v.1", 0, lambda q: q not in over, reason) == []  # within share
    actions = h.life.evict("v.1", 0, lambda q: q in over, reason)
    assert published(actions) == [("v.1", TaskState.PREEMPTED, reason)]
    assert actions[-1] == Kill(0, "v.1", 0, reason)
    assert "v.1" not in h.books.allocations and set(h.life.stopping) == {("v.1", 0)}
    assert h.life.evict("v.1", 0, lambda q: True, reason) == []  # once
    outcome = h.report(0, victim, TaskState.CANCELLED)
    assert outcome.verdict is ReportVerdict.STOPPED
    assert outcome.actions == [Requeue(victim, owed=True)]
    h.books.allocations["k.1"] = replace(h.books.allocations["k.1"], gang=True)
    assert h.life.evict("k.1", 0, lambda q: True, reason) == []  # a gang's: never


def test_a_victims_room_is_held_for_the_gang_it_was_evicted_for_and_only_then():
    """``room_for``: what the LM's StopTasks with ``for_job_id`` and the simulator's
    ``_lm_evict`` both do through ``evict_books``: the victim leaves the books and its
    room is booked for the gang's job until it reserves; a refused eviction holds none."""
    h = Harness(nodes=1)
    gangs = Reservations(h.books)
    h.launch(Wire("v.1", job_id="v"))
    h.launch(Wire("w.1", job_id="w"))
    room_for = RoomFor(gangs, "jb", now=0.0, ttl_s=5.0)
    assert h.life.evict("v.1", 0, lambda q: False, "x", room_for) == []
    assert gangs.rooms_held("jb") == []
    free = h.books.table.free[0].copy()
    assert h.life.evict("v.1", 0, lambda q: True, "x", room_for)
    (holder,) = gangs.rooms_held("jb")
    assert is_placeholder(holder) and "v.1" not in h.books.allocations
    assert (h.books.table.free[0] == free).all()  # the room went to the gang, not free
    books_only = h.life.evict_books("w.1", 0, lambda q: True, room_for)  # as the simulator
    assert books_only is not None and books_only.task_id == "w.1"
    assert len(gangs.rooms_held("jb")) == 2 and "w.1" in h.life.tasks  # no task changed
