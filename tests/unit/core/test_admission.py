"""The GM's intake (``services/core/admission.py``): a bound on submissions under way
that grows while answers are on time and shrinks when they, or the loop, run late."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.admission import Admission, Refusal


def test_past_the_limit_a_submission_is_refused_and_nothing_is_counted_for_it():
    intake = Admission(limit=20, min_limit=4)
    for _ in range(20):
        assert intake.admit("a") is None
    refusal = intake.admit("a")
    assert refusal == Refusal(20, 20)
    assert str(refusal) == "this GM has 20 submissions under way, its limit now"
    assert intake.under_way == 20 and intake.refused == 1
    intake.ended("a", 0.01, now=1.0)
    assert intake.admit("a") is None


def test_on_time_answers_grow_the_limit_while_the_intake_is_in_use():
    intake = Admission(limit=20, min_limit=4)
    for _ in range(20):
        intake.admit("a")
    for k in range(10):  # one in, one out: the intake stays full
        intake.ended("a", 0.01, now=float(k))
        assert intake.admit("a") is None
    assert intake.current == 30
    # Little in use: an on-time answer says nothing of what more would cost.
    idle = Admission(limit=20, min_limit=4)
    idle.admit("a")
    idle.ended("a", 0.01, now=0.0)
    assert idle.current == 20


def test_late_answers_shrink_it_once_per_target_not_once_per_answer():
    intake = Admission(limit=100, min_limit=4, backoff=0.5, target_s=0.25)
    for _ in range(50):
        intake.admit("a")
    for _ in range(50):  # all late at once: the ones under way when it shrank
        intake.ended("a", 2.0, now=10.0)
    assert intake.current == 50
    intake.admit("a")
    intake.ended("a", 2.0, now=10.3)
    assert intake.current == 25


def test_a_late_loop_shrinks_it_and_it_never_goes_below_its_floor():
    intake = Admission(limit=64, min_limit=16, backoff=0.5, max_lag_s=0.1)
    intake.lagged(0.05, now=0.0)
    assert intake.current == 64
    for k in range(10):
        intake.lagged(0.5, now=float(k))
    assert intake.current == 16


def test_one_queue_holds_at_most_its_share_while_another_queue_waits_too():
    intake = Admission(limit=100, min_limit=4, queue_share=0.5)
    for _ in range(60):  # alone, a queue may use the whole intake
        assert intake.admit("flood") is None
    assert intake.admit("other") is None  # another queue is still taken
    refusal = intake.admit("flood")
    assert refusal == Refusal(60, 50, "flood")
    assert "queue 'flood' has 60 submissions under way" in str(refusal)


def test_a_driver_may_close_the_intake():
    intake = Admission()
    intake.max_limit = 0
    assert intake.admit("a") is not None
    intake.max_limit = 100
    assert intake.admit("a") is None


def test_bad_settings_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="backoff"):
        Admission(backoff=1.5)
    with pytest.raises(ValueError, match="queue_share"):
        Admission(queue_share=0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "end", "lag"]),
            st.sampled_from(["a", "b", "c"]),
            st.floats(0.0, 3.0),
        ),
        max_size=300,
    )
)
def test_under_way_never_passes_the_limit_and_the_limit_stays_in_its_bounds(steps):
    intake = Admission(limit=32, min_limit=8, max_limit=64)
    taken: list[str] = []
    now = 0.0
    for action, queue, value in steps:
        now += 0.01
        limit_before = intake.current
        if action == "admit":
            if intake.admit(queue) is None:
                taken.append(queue)
                assert intake.under_way <= limit_before
        elif action == "end" and taken:
            intake.ended(taken.pop(0), value, now)
        else:
            intake.lagged(value, now)
        assert 8 <= intake.current <= 64
        assert intake.under_way == len(taken) == sum(intake.by_queue.values())


def test_the_wait_before_a_read_is_the_delay_above_the_least_whatever_the_clocks() -> None:
    from services.core.admission import QueueingDelay

    for offset in (0, 7 * 10**9, -(3 * 10**9)):  # the sender's clock ahead, or behind
        stream = QueueingDelay()
        sent = [now + 100 for now in range(4)]  # ns, the true time a message was sent
        sent = [1_764_000_000 * 10**9 + at for at in sent]
        transit = [5, 3, 250_000_003, 3]  # ns; the third waited 0.25 s in a queue
        waits = [  # sent by the sender's clock (off by ``offset``), read by the reader's
            stream.wait_s(at + offset, at + took) for at, took in zip(sent, transit, strict=True)
        ]
        # The first is its own least (0); the second sets a lower least and reads 0 too.
        assert waits == [0.0, 0.0, 0.25, 0.0]
    assert QueueingDelay().wait_s(0, 123) == 0.0  # the sender did not say


def test_a_streamed_job_says_when_it_was_asked() -> None:
    from services._proto.megha.v1 import global_master_pb2
    from services.common.request_stream import _submit_many

    job = global_master_pb2.SubmitJobRequest(job_id="j")
    message = _submit_many([(1, job, 11), (2, job, 22), (3, job, 33)])
    assert message.asked_unix_nanos == 11
    assert [(m.request_id, m.asked_unix_nanos) for m in message.more_jobs] == [(2, 22), (3, 33)]
