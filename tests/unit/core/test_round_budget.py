"""A live GM's round budget (``RoundBudget``): rounds last about ``target_s``, whatever
one item of work costs, between the least and the most items per queue."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.core.round_budget import RoundBudget


def test_it_starts_at_the_most_and_a_round_that_took_nothing_changes_nothing() -> None:
    budget = RoundBudget(target_s=0.025, least=16, most=512)
    assert budget.budget == 512
    assert budget.observe(0, 3.0) == 512


def test_a_slow_round_shrinks_the_next_to_what_fits_the_target() -> None:
    budget = RoundBudget(target_s=0.025, least=16, most=512)
    assert budget.observe(500, 0.25) == 50  # 0.5 ms an item: 50 in 25 ms
    assert budget.observe(10, 1.0) == 16  # never below the least


def test_a_budget_grows_at_most_twofold_and_only_after_a_round_that_used_it_all() -> None:
    budget = RoundBudget(target_s=0.025, least=16, most=512)
    budget.observe(500, 0.25)
    assert budget.budget == 50
    assert budget.observe(20, 0.0001) == 50  # ran out of work: says nothing of more
    assert budget.observe(50, 0.0025) == 100  # used it all, 10x faster: twice, not 10x
    assert budget.observe(100, 0.005) == 200
    assert budget.observe(200, 0.0) == 400
    assert budget.observe(400, 0.0) == 512  # never above the most


@pytest.mark.parametrize(
    "kwargs", [{"target_s": 0}, {"least": 0}, {"least": 600, "most": 512}, {"growth": 0.5}]
)
def test_bad_settings_are_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        RoundBudget(**kwargs)


@given(
    st.lists(
        st.tuples(st.integers(0, 5_000), st.floats(0, 5.0, allow_nan=False)),
        min_size=1,
        max_size=50,
    )
)
def test_the_budget_stays_within_bounds_and_fits_the_last_rounds_cost(rounds) -> None:
    budget = RoundBudget(target_s=0.025, least=16, most=512)
    for taken, seconds in rounds:
        before = budget.budget
        got = budget.observe(taken, seconds)
        assert 16 <= got <= 512
        assert got <= max(before * 2, 16)
        if taken > 0 and seconds > 0 and got > 16:
            # the last round's cost per item: the next one fits in the target, or kept
            assert got * seconds / taken <= 0.025 * (1 + 1e-9) or got == before
