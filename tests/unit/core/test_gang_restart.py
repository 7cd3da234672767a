"""A started gang that lost a member restarts whole: ``services.core.gang_restart``."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.core.gang_restart import Regather, Standing, Stop, kill_reason, regather
from services.core.states import TaskState

MEMBERS = ["g.0", "g.1", "g.2", "g.3"]
LOST, SUCCEEDED = TaskState.LOST, TaskState.SUCCEEDED


def running(attempt: int = 0, lm: str = "lm-2") -> Standing:
    return Standing(attempt, lm, True)


def ended(state: TaskState, attempt: int = 0, lm: str = "lm-1") -> Standing:
    return Standing(attempt, lm, False, state)


def test_the_first_member_back_stops_every_member_still_running():
    standing = {
        "g.0": ended(LOST),
        "g.1": running(lm="lm-1"),
        "g.2": running(),
        "g.3": running(),
    }
    step = regather(MEMBERS, {"g.0": 1}, standing)
    assert step.stop == (Stop("g.1", 0, "lm-1"), Stop("g.2", 0, "lm-2"), Stop("g.3", 0, "lm-2"))
    assert step.ready == ("g.0",) and not step.start
    assert "g.0 was lost" in step.reason


def test_it_waits_for_the_stopped_members_next_attempts_then_starts_them_all():
    killed = {t: ended(LOST) for t in MEMBERS}
    # Stopped (their LMs told LOST), their next attempts not back yet: wait, stop nothing.
    step = regather(MEMBERS, {"g.0": 1, "g.2": 1}, killed)
    assert step.stop == () and step.waiting == ("g.1", "g.3") and not step.start
    assert "waiting for 2 member(s)" in step.reason
    # Every member's next attempt is here: one gang, all of them.
    step = regather(MEMBERS, dict.fromkeys(MEMBERS, 1), killed)
    assert step.start and step.ready == tuple(MEMBERS)


def test_a_member_that_ended_for_good_is_not_run_again():
    standing = {t: ended(LOST) for t in MEMBERS}
    standing["g.3"] = ended(SUCCEEDED)
    step = regather(MEMBERS, {"g.0": 1, "g.1": 1, "g.2": 1}, standing)
    assert step.start and step.ready == ("g.0", "g.1", "g.2")


def test_retried_and_preempted_members_come_back_too():
    standing = {t: ended(LOST) for t in MEMBERS}
    standing["g.1"] = ended(TaskState.RETRYING)
    standing["g.2"] = ended(TaskState.PREEMPTED)
    step = regather(MEMBERS, {"g.0": 1, "g.3": 1}, standing)
    assert step.waiting == ("g.1", "g.2") and not step.start


def test_nothing_is_stopped_or_started_while_an_lm_has_not_answered():
    standing = {"g.0": ended(LOST), "g.1": running()}
    step = regather(["g.0", "g.1"], {"g.0": 1}, standing, complete=False)
    assert step.stop == () and not step.start and "g.1" in step.waiting
    step = regather(["g.0", "g.1"], {"g.0": 1, "g.1": 1}, {}, complete=False)
    assert not step.start and "every LM to answer" in step.reason


def test_a_member_no_lm_knows_is_waited_for():
    step = regather(["g.0", "g.1"], {"g.0": 1}, {"g.0": ended(LOST)})
    assert step.waiting == ("g.1",) and not step.start


def test_an_arrived_attempt_an_lm_already_holds_is_launched_and_stopped_with_the_rest():
    """A GM committed part of the restart on one LM and died: the next GM gets every
    message again; the attempt that runs is stopped (its next comes back), not placed
    again beside itself."""
    standing = {"g.0": running(1, "lm-1"), "g.1": ended(LOST)}
    step = regather(["g.0", "g.1"], {"g.0": 1, "g.1": 1}, standing)
    assert step.launched == ("g.0",) and step.ready == ("g.1",)
    assert step.stop == (Stop("g.0", 1, "lm-1"),) and not step.start


def test_a_next_attempt_never_starts_while_an_older_one_still_runs():
    step = regather(["g.0", "g.1"], {"g.0": 1, "g.1": 1}, {"g.1": running(0)})
    assert step.stop == (Stop("g.1", 0, "lm-2"),) and step.ready == ("g.0",)
    assert not step.start and step.launched == ()


def test_the_kills_reason_names_the_lost_member():
    assert kill_reason("g.0") == "gang member g.0 lost: its gang restarts whole"


_standing = st.one_of(
    st.none(),
    st.builds(
        Standing,
        st.integers(0, 3),
        st.sampled_from(["lm-1", "lm-2"]),
        st.booleans(),
        st.sampled_from([None, LOST, TaskState.RETRYING, SUCCEEDED, TaskState.FAILED]),
    ),
)


@given(
    st.dictionaries(st.sampled_from(MEMBERS), _standing),
    st.dictionaries(st.sampled_from(MEMBERS), st.integers(0, 4), min_size=1),
    st.booleans(),
)
def test_a_restart_never_starts_beside_a_running_or_awaited_member(standing, arrived, complete):
    """Exactly once: a gang starts again only when no member runs (nothing to stop),
    none is on its way, every LM answered, and only attempts no LM launched start."""
    standing = {t: s for t, s in standing.items() if s is not None}
    step: Regather = regather(MEMBERS, arrived, standing, complete)
    if step.start:
        assert complete
        for task_id in MEMBERS:
            known = standing.get(task_id)
            assert known is None or not known.running or task_id in step.launched
            if task_id in step.ready:
                assert known is None or known.attempt < arrived[task_id]
            else:
                assert known is not None and not known.running
                assert known.ended is not None and known.ended not in (
                    LOST,
                    TaskState.RETRYING,
                    TaskState.PREEMPTED,
                )
    for stop in step.stop:
        assert standing[stop.task_id].running and complete
    assert set(step.ready).isdisjoint(step.launched)
    for task_id in step.ready:  # no attempt is ready beside an older one still running
        assert task_id not in standing or not standing[task_id].running


def test_only_a_member_failed_for_good_ends_its_gang():
    from services.core.gang_restart import ends_gang, gang_failed
    from services.core.states import TaskState

    assert [s for s in TaskState if ends_gang(s)] == [TaskState.FAILED]
    assert gang_failed("j.2", "exit code 3") == (
        "gang member j.2 failed (exit code 3): its gang is cancelled"
    )
    assert "(no reason given)" in gang_failed("j.2", "")
