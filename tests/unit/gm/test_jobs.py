"""JobBook: which tasks of a job a GM must not queue again, what it keeps of each, and
its bounds."""

from __future__ import annotations

import asyncio
import gc

from hypothesis import given
from hypothesis import strategies as st

from services._proto.megha.v1 import common_pb2, global_master_pb2
from services.global_master.jobs import JobBook, Watch

S = common_pb2


def task(task_id: str, attempt: int = 0) -> common_pb2.Task:
    return common_pb2.Task(task_id=task_id, job_id="j", queue="q", attempt=attempt)


def event(task_id: str, state: int, attempt: int = 0, node_id: str = "") -> common_pb2.TaskEvent:
    return common_pb2.TaskEvent(
        task_id=task_id,
        job_id="j",
        queue="q",
        state=state,
        attempt=attempt,
        lm_id="lm-1" if node_id else "",
        node_id=node_id,
    )


def test_nothing_is_taken_of_a_job_never_heard_of():
    assert JobBook().taken("j", [task("j.0")]) == set()


def test_queued_running_and_ended_tasks_are_taken_and_new_ones_are_not():
    book = JobBook()
    for t in ("j.0", "j.1", "j.2", "j.3"):
        book.queued(task(t))
    book.apply(event("j.1", S.TASK_STATE_RUNNING))
    book.apply(event("j.2", S.TASK_STATE_SUCCEEDED))
    book.apply(event("j.3", S.TASK_STATE_FAILED))
    asked = [task(t) for t in ("j.0", "j.1", "j.2", "j.3", "j.4")]
    assert book.taken("j", asked) == {"j.0", "j.1", "j.2", "j.3"}


def test_a_rejected_task_is_not_taken_and_queueing_it_again_takes_it():
    book = JobBook()
    book.queued(task("j.0"))
    book.apply(event("j.0", S.TASK_STATE_REJECTED))  # e.g. dropped: the broker refused it
    assert book.taken("j", [task("j.0")]) == set()
    book.queued(task("j.0"))  # queued again (a retry, or its message came after all)
    assert book.get("j").status("j.0").state == S.TASK_STATE_QUEUED
    assert book.taken("j", [task("j.0")]) == {"j.0"}


def test_a_later_attempt_is_not_taken_by_an_earlier_one():
    book = JobBook()
    book.queued(task("j.0"))
    book.apply(event("j.0", S.TASK_STATE_PREEMPTED))
    # The LM re-queues a preempted or lost task as the next attempt: that one must run.
    assert book.taken("j", [task("j.0", attempt=1)]) == set()
    assert book.taken("j", [task("j.0", attempt=0)]) == {"j.0"}
    book.apply(event("j.0", S.TASK_STATE_RUNNING, attempt=1))
    assert book.taken("j", [task("j.0", attempt=1)]) == {"j.0"}


def test_queueing_does_not_overwrite_what_events_said():
    book = JobBook()
    book.apply(event("j.0", S.TASK_STATE_RUNNING))
    book.queued(task("j.0"))
    assert book.get("j").status("j.0").state == S.TASK_STATE_RUNNING


def test_a_requeued_attempt_shows_as_queued_and_an_old_event_does_not_undo_it():
    book = JobBook()
    book.queued(task("j.0"))
    book.apply(event("j.0", S.TASK_STATE_RUNNING))
    book.queued(task("j.0", attempt=1))  # the LM re-queued it after a preemption
    status = book.get("j").status("j.0")
    assert (status.state, status.attempt) == (S.TASK_STATE_QUEUED, 1)
    book.apply(event("j.0", S.TASK_STATE_PREEMPTED))  # attempt 0's event, arriving late
    status = book.get("j").status("j.0")
    assert (status.state, status.attempt) == (S.TASK_STATE_QUEUED, 1)


def test_launched_is_an_lms_word_on_the_attempt_or_a_later_one():
    """What a GM whose fence went unanswered must not place again (``_settle``)."""
    book = JobBook()
    for t in ("j.0", "j.1", "j.2", "j.3"):
        book.queued(task(t))
    book.apply(event("j.1", S.TASK_STATE_PLACED, node_id="n1"))
    book.apply(event("j.2", S.TASK_STATE_SUCCEEDED, node_id="n1"))
    book.apply(event("j.3", S.TASK_STATE_QUEUED, attempt=1))  # re-queued by its LM
    assert not book.launched(task("j.0"))  # only queued here: the GM's own word
    assert book.launched(task("j.1")) and book.launched(task("j.2"))
    assert book.launched(task("j.3"))  # a later attempt exists
    assert not book.launched(task("j.3", attempt=1))  # the later one is only queued
    assert not book.launched(task("j.1", attempt=1))  # an attempt not heard of
    assert not book.launched(task("x.0"))  # a job never heard of


def test_open_holds_the_placed_and_running_tasks_whose_end_is_awaited():
    book = JobBook(max_jobs=2)
    for t in ("j.0", "j.1", "j.2"):
        book.queued(task(t))
    assert book.open == {}
    book.apply(event("j.0", S.TASK_STATE_PLACED))
    book.apply(event("j.1", S.TASK_STATE_RUNNING))
    book.apply(event("j.2", S.TASK_STATE_RUNNING))
    assert set(book.open) == {("j", "j.0"), ("j", "j.1"), ("j", "j.2")}
    assert book.open["j", "j.1"] == book.get("j").status("j.1")
    book.apply(event("j.0", S.TASK_STATE_SUCCEEDED))
    book.apply(event("j.1", S.TASK_STATE_LOST))
    book.apply(event("j.1", S.TASK_STATE_RUNNING))  # a late event of the ended attempt
    assert set(book.open) == {("j", "j.2")}
    book.queued(task("j.1", attempt=1))  # re-queued: waiting, not open
    book.apply(event("j.1", S.TASK_STATE_RUNNING, attempt=1))
    assert set(book.open) == {("j", "j.1"), ("j", "j.2")}
    book.record("k", "q")
    book.record("m", "q")  # j is forgotten, and with it its open tasks
    assert book.get("j") is None and book.open == {}


def test_past_its_task_bound_the_book_forgets_the_jobs_least_recently_heard_of():
    book = JobBook(max_tasks=4)

    def job_task(job_id: str, n: int) -> common_pb2.Task:
        return common_pb2.Task(task_id=f"{job_id}.{n}", job_id=job_id, queue="q")

    for job_id in ("a", "b"):
        book.queued(job_task(job_id, 0))
        book.queued(job_task(job_id, 1))
    assert book.task_count == 4
    book.apply(
        common_pb2.TaskEvent(task_id="a.0", job_id="a", queue="q", state=S.TASK_STATE_RUNNING)
    )
    book.queued(job_task("c", 0))  # a was heard of after b: b goes
    assert [*book.jobs] == ["a", "c"] and book.task_count == 3
    assert set(book.open) == {("a", "a.0")}
    for n in range(3):  # a job's own tasks never push it out
        book.queued(job_task("c", n))
    assert [*book.jobs] == ["c"] and book.task_count == 3 and book.open == {}


def test_a_job_is_done_when_every_task_has_ended_at_its_latest_attempt():
    book = JobBook()
    book.queued(task("j.0"))
    book.queued(task("j.1"))
    job = book.get("j")
    assert not job.done
    book.apply(event("j.0", S.TASK_STATE_SUCCEEDED))
    book.apply(event("j.1", S.TASK_STATE_PREEMPTED))
    assert not job.done  # preempted: its next attempt is to come
    book.apply(event("j.1", S.TASK_STATE_FAILED))
    assert job.done
    book.queued(task("j.1", attempt=1))  # re-queued after all
    assert not job.done
    book.apply(event("j.1", S.TASK_STATE_SUCCEEDED, attempt=1))
    book.set_reason("j", "j.1", "a reason keeps the state")
    assert job.done and job.status("j.1").pending_reason == "a reason keeps the state"
    assert not book.record("empty", "q").done


def test_what_the_book_keeps_of_its_tasks_is_not_scanned_by_the_garbage_collector():
    # A GM remembers up to 500,000 tasks: as tracked objects they would lengthen every
    # full collection of its heap.
    book = JobBook()
    gc.collect()
    before = len(gc.get_objects())
    for j in range(40):
        for n in range(50):
            t = common_pb2.Task(task_id=f"{j}.{n}", job_id=str(j), queue="q")
            book.queued(t)
            for state in (S.TASK_STATE_RUNNING, S.TASK_STATE_SUCCEEDED):
                book.apply(common_pb2.TaskEvent(task_id=t.task_id, job_id=str(j), state=state))
    gc.collect()
    assert book.task_count == 2000
    assert len(gc.get_objects()) - before < 200  # per job, not per task


def _counts(book: JobBook, job_id: str = "j") -> dict[int, int]:
    job = book.get(job_id)
    assert job is not None
    return job.counts()


def test_a_job_counts_its_tasks_by_state_through_every_change():
    book = JobBook()
    for t in ("j.0", "j.1", "j.2"):
        book.queued(task(t))
    assert _counts(book) == {S.TASK_STATE_QUEUED: 3}
    book.apply(event("j.0", S.TASK_STATE_RUNNING))
    book.apply(event("j.1", S.TASK_STATE_RUNNING))
    book.set_reason("j", "j.2", "waiting for resources")  # no change of state
    assert _counts(book) == {S.TASK_STATE_QUEUED: 1, S.TASK_STATE_RUNNING: 2}
    book.apply(event("j.0", S.TASK_STATE_SUCCEEDED))
    book.apply(event("j.0", S.TASK_STATE_RUNNING))  # late and older: ignored
    book.apply(event("j.1", S.TASK_STATE_LOST))
    book.queued(task("j.1", attempt=1))  # its next attempt
    book.apply(event("j.2", S.TASK_STATE_CANCELLED))
    assert _counts(book) == {
        S.TASK_STATE_SUCCEEDED: 1,
        S.TASK_STATE_QUEUED: 1,
        S.TASK_STATE_CANCELLED: 1,
    }
    summary = book.get("j").summary()
    assert (summary.job_id, summary.queue, summary.tasks) == ("j", "q", 3)
    assert sum(c.tasks for c in summary.states) == 3
    assert book.get("j").unfinished == 1


def test_the_newest_jobs_come_first_filtered_and_bounded():
    book = JobBook()
    for job_id, queue in (("a", "q1"), ("b", "q2"), ("c", "q1"), ("d", "q1")):
        book.queued(common_pb2.Task(task_id=f"{job_id}.0", job_id=job_id, queue=queue))
    done = common_pb2.TaskEvent(task_id="c.0", job_id="c", queue="q1", state=S.TASK_STATE_SUCCEEDED)
    book.apply(done)  # c is heard of last now
    assert [j.job_id for j in book.newest(10)] == ["c", "d", "b", "a"]
    assert [j.job_id for j in book.newest(2)] == ["c", "d"]
    assert [j.job_id for j in book.newest(10, queue="q1")] == ["c", "d", "a"]
    assert [j.job_id for j in book.newest(10, unfinished_only=True)] == ["d", "b", "a"]


def _previous_end(book: JobBook, task_id: str = "t") -> tuple | None:
    status = book.get("j").status(task_id)
    if not status.HasField("previous_end"):
        return None
    end = status.previous_end
    return end.state, end.attempt, end.reason


def test_a_later_attempt_keeps_how_the_one_before_ended_in_either_order():
    retrying = event("t", common_pb2.TASK_STATE_RETRYING, 0)
    retrying.reason = "exit code 3: broken"
    running = event("t", common_pb2.TASK_STATE_RUNNING, 1)
    expected = (common_pb2.TASK_STATE_RETRYING, 0, "exit code 3: broken")

    # The end first, then the next attempt queued, then running.
    book = JobBook()
    book.queued(task("t"))
    book.apply(retrying)
    book.queued(task("t", attempt=1))
    assert _previous_end(book) == expected
    book.apply(running)
    assert _previous_end(book) == expected

    # The next attempt heard of first (its message, or its events), the end late.
    for first in (lambda b: b.queued(task("t", attempt=1)), lambda b: b.apply(running)):
        book = JobBook()
        book.queued(task("t"))
        book.apply(event("t", common_pb2.TASK_STATE_RUNNING, 0))
        first(book)
        assert _previous_end(book) is None
        book.apply(retrying)
        assert _previous_end(book) == expected
        assert book.get("j").status("t").attempt == 1  # the late end changed nothing else


def test_the_previous_end_is_that_of_the_attempt_just_before_and_no_older():
    book = JobBook()
    book.queued(task("t"))
    book.apply(event("t", common_pb2.TASK_STATE_LOST, 0))
    book.apply(event("t", common_pb2.TASK_STATE_RUNNING, 1))
    assert _previous_end(book) == (common_pb2.TASK_STATE_LOST, 0, "")
    book.apply(event("t", common_pb2.TASK_STATE_RUNNING, 2))  # attempt 1's end never heard
    assert _previous_end(book) is None
    book.apply(event("t", common_pb2.TASK_STATE_LOST, 0))  # too old to be the one before
    assert _previous_end(book) is None
    book.apply(event("t", common_pb2.TASK_STATE_SUCCEEDED, 1))  # not how a retry begins
    assert _previous_end(book) is None
    # A task on its first attempt, or one that ended for good, has none.
    book.queued(task("u"))
    book.apply(event("u", common_pb2.TASK_STATE_FAILED, 0))
    assert _previous_end(book, "u") is None


_ENDS = [
    common_pb2.TASK_STATE_RETRYING,
    common_pb2.TASK_STATE_LOST,
    common_pb2.TASK_STATE_PREEMPTED,
]


@given(st.data())
def test_whatever_the_order_a_task_ends_with_its_last_attempt_and_the_one_before(data):
    """Events of a task's attempts 0..k reach a GM in any order (the events exchange and
    the queue are separate paths): the status ends at attempt k's end, keeps how
    attempt k-1 ended, and where each earlier attempt ran."""
    attempts = data.draw(st.integers(1, 4), label="attempts")
    ends = [data.draw(st.sampled_from(_ENDS)) for _ in range(attempts - 1)]
    last = data.draw(
        st.sampled_from([common_pb2.TASK_STATE_SUCCEEDED, common_pb2.TASK_STATE_FAILED])
    )
    steps = []
    for attempt in range(attempts):
        steps.append(("queued", attempt, common_pb2.TASK_STATE_QUEUED))
        for state in (common_pb2.TASK_STATE_PLACED, common_pb2.TASK_STATE_RUNNING):
            steps.append(("event", attempt, state))
        steps.append(("event", attempt, ends[attempt] if attempt < attempts - 1 else last))
    order = data.draw(st.permutations(steps), label="order")
    book = JobBook()
    for kind, attempt, state in order:
        if kind == "queued":
            book.queued(task("t", attempt=attempt))
        else:
            book.apply(event("t", state, attempt, node_id=f"n{attempt}"))
    status = book.get("j").status("t")
    assert (status.state, status.attempt) == (last, attempts - 1)
    assert {e.attempt: (e.lm_id, e.node_id) for e in status.earlier_attempts} == {
        a: ("lm-1", f"n{a}") for a in range(attempts - 1)
    }
    if attempts > 1:
        assert _previous_end(book)[:2] == (ends[-1], attempts - 2)
    else:
        assert _previous_end(book) is None


def test_a_status_keeps_where_its_newest_earlier_attempts_ran_and_no_more():
    book = JobBook()
    for attempt in range(40):  # e.g. lost again and again
        book.queued(task("t", attempt=attempt))
        book.apply(event("t", S.TASK_STATE_RUNNING, attempt, node_id=f"n{attempt}"))
        book.apply(event("t", S.TASK_STATE_LOST, attempt, node_id=f"n{attempt}"))
    earlier = book.get("j").status("t").earlier_attempts
    assert sorted(e.attempt for e in earlier) == list(range(7, 39))  # the newest 32
    assert all(e.node_id == f"n{e.attempt}" for e in earlier)


def test_the_book_knows_which_job_holds_each_task_id_while_it_remembers_the_job():
    book = JobBook(max_jobs=3)
    book.queued(common_pb2.Task(task_id="x", job_id="A", queue="q"))  # submitted here
    other = event("y", S.TASK_STATE_RUNNING, node_id="w1")
    other.job_id = "C"  # heard of from an LM: another GM's job
    book.apply(other)
    assert book.holder("x", "B") == "A" and book.holder("y", "B") == "C"
    assert book.holder("x", "A") is None  # the job's own retry
    assert book.holder("z", "B") is None
    # A second job heard of with the same id (an LM refused it) does not take it over.
    clash = event("x", S.TASK_STATE_REJECTED)
    clash.job_id = "B"
    book.apply(clash)
    assert book.holder("x", "B") == "A"
    book.queued(common_pb2.Task(task_id="w", job_id="D", queue="q"))  # A is forgotten
    assert book.get("A") is None and book.holder("x", "B") is None


def test_a_task_only_relayed_here_is_not_taken_when_its_message_comes_here():
    """Queue failover: a GM that sent a job to a queue another GM served, then took that
    queue over, must schedule the job's message when it is redelivered to it, yet still
    answer a client's retry of the job as a duplicate."""
    book = JobBook()
    task = common_pb2.Task(task_id="j.0", job_id="j", queue="q", attempt=0)
    book.queued(task, relayed=True)
    assert book.taken("j", [task]) == {"j.0"}  # a retry through this GM: the same job
    assert book.taken("j", [task], relayed=False) == set()  # its delivery: schedule it
    book.queued(task)  # delivered here: held here now
    assert book.taken("j", [task], relayed=False) == {"j.0"}
    other = common_pb2.Task(task_id="k.0", job_id="k", queue="q", attempt=0)
    book.queued(other, relayed=True)
    book.apply(
        common_pb2.TaskEvent(
            task_id="k.0", job_id="k", queue="q", state=common_pb2.TASK_STATE_RUNNING
        )
    )
    assert book.taken("k", [other], relayed=False) == {"k.0"}  # it runs: never again


def test_relayed_tasks_never_heard_of_are_due_oldest_first_then_again_later():
    import time

    book = JobBook()
    start = time.monotonic()
    for i in range(3):
        book.queued(task(f"t{i}"), relayed=True)
    book.queued(task("mine"))  # queued here (its message delivered here): not relayed
    assert book.relayed_unheard(10.0, 100, start + 5) == []  # too young
    book.apply(event("t1", S.TASK_STATE_RUNNING, node_id="w1"))  # heard of: never due
    assert book.relayed_unheard(10.0, 1, start + 11) == [("j", "t0")]  # the limit
    assert book.relayed_unheard(10.0, 100, start + 11) == [("j", "t2")]
    assert book.relayed_unheard(10.0, 100, start + 15) == []  # asked: due again later
    assert book.relayed_unheard(10.0, 100, start + 22) == [("j", "t0"), ("j", "t2")]
    book.apply(event("t0", S.TASK_STATE_SUCCEEDED, node_id="w1"))  # its end recovered
    assert book.relayed_unheard(10.0, 100, start + 40) == [("j", "t2")]


def test_a_relayed_task_preempted_stays_due_until_its_next_attempt_is_heard_of():
    """A preempted attempt is not the task's last word: were the next attempt's events
    lost, the task would show PREEMPTED here for ever. It is asked about until an event
    of a later attempt comes (running: then a lost end is found from the LMs' books)."""
    import time

    book = JobBook()
    start = time.monotonic()
    book.queued(task("t0"), relayed=True)
    book.apply(event("t0", S.TASK_STATE_RUNNING, node_id="w1"))
    book.apply(event("t0", S.TASK_STATE_PREEMPTED, node_id="w1"))
    assert book.relayed_unheard(10.0, 100, start + 11) == [("j", "t0")]
    book.apply(event("t0", S.TASK_STATE_RUNNING, attempt=1, node_id="w2"))
    assert book.relayed_unheard(10.0, 100, start + 30) == []
    assert ("j", "t0") in book.open  # a lost end of it is found from the LM's books


def test_a_relayed_task_preempted_then_finished_elsewhere_is_asked_no_more():
    import time

    book = JobBook()
    start = time.monotonic()
    book.queued(task("t0"), relayed=True)
    book.apply(event("t0", S.TASK_STATE_PREEMPTED, node_id="w1"))
    assert book.relayed_unheard(10.0, 100, start + 11) == [("j", "t0")]
    book.apply(event("t0", S.TASK_STATE_SUCCEEDED, attempt=1, node_id="w2"))  # recovered
    assert book.relayed_unheard(10.0, 100, start + 30) == []
    assert book.get("j").status("t0").state == S.TASK_STATE_SUCCEEDED


async def test_a_watch_hands_events_in_order_until_it_falls_its_bound_behind():
    book, watch = JobBook(), Watch(bound=3)
    book.queued(task("a"))
    book.get("j").watchers.append(watch)
    waiting = asyncio.ensure_future(watch.get())
    await asyncio.sleep(0)
    assert not waiting.done()  # nothing yet: the watch waits
    book.apply(event("a", S.TASK_STATE_PLACED, node_id="n1"))
    assert (await waiting).state == S.TASK_STATE_PLACED
    for state in (S.TASK_STATE_RUNNING, S.TASK_STATE_SUCCEEDED):
        book.apply(event("a", state, node_id="n1"))
    assert [(await watch.get()).state for _ in range(2)] == [
        S.TASK_STATE_RUNNING,
        S.TASK_STATE_SUCCEEDED,
    ]
    assert watch.empty() and not watch.cut
    # Three events waiting is the bound; the fourth cuts it: nothing kept, none handed.
    book.queued(task("b"))
    for state in (S.TASK_STATE_PLACED, S.TASK_STATE_RUNNING, S.TASK_STATE_SUCCEEDED):
        book.apply(event("b", state, node_id="n2"))
    assert not watch.cut
    book.queued(task("c"))
    book.apply(event("c", S.TASK_STATE_PLACED, node_id="n2"))
    assert watch.cut and watch.empty()
    assert await watch.get() is None
    book.apply(event("c", S.TASK_STATE_RUNNING, node_id="n2"))
    assert watch.empty()  # a cut watch takes nothing more


def test_kept_is_the_record_s_own_bytes_not_copies():
    book = JobBook()
    for name in ("a", "b"):
        book.queued(task(name))
    job = book.get("j")
    kept = job.kept()
    assert [s.task_id for s in job.statuses()] == ["a", "b"]
    assert all(any(k is v for v in job._statuses.values()) for k in kept)


@given(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=300), st.integers(0, 3), st.integers(0, 2)),
        max_size=20,
        unique_by=lambda t: t[0],
    )
)
def test_a_job_written_from_its_kept_bytes_is_the_job_built_field_by_field(tasks):
    # Ids up to 300 characters: statuses over 127 bytes take a two-byte length.
    book = JobBook()
    for task_id, ends, attempt in tasks:
        book.queued(task(task_id, attempt))
        states = (S.TASK_STATE_PLACED, S.TASK_STATE_RUNNING, S.TASK_STATE_SUCCEEDED)
        for state in states[:ends]:
            book.apply(event(task_id, state, attempt=attempt, node_id="n1"))
    job = book.record("j", "q")
    built = global_master_pb2.Job(job_id="j", queue="q", tasks=job.statuses())
    assert job.to_proto() == built
    assert job.response() == global_master_pb2.GetJobResponse(job=built)
    assert job.serialized() == built.SerializeToString()
