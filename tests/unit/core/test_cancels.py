import pytest

from services.core.cancels import CancelledJobs


def test_a_cancel_is_noted_once_with_its_first_reason():
    cancels = CancelledJobs()
    assert cancels.add("j1", "wrong input")
    assert not cancels.add("j1", "again")
    assert "j1" in cancels and "j2" not in cancels
    assert cancels.reason("j1") == "wrong input" and cancels.reason("j2") is None


def test_only_the_newest_cancels_are_kept():
    cancels = CancelledJobs(max_jobs=3)
    for i in range(5):
        cancels.add(f"j{i}", "r")
    assert len(cancels) == 3
    assert [f"j{i}" in cancels for i in range(5)] == [False, False, True, True, True]


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        CancelledJobs(0)
