"""What a bench-live run proves (the exit code) and the search for the saturation rate."""

from __future__ import annotations

import pytest

from loadgen.saturation import (
    BREACH,
    EXACTLY_ONCE,
    SATURATED,
    RateSearch,
    target_met,
    verdict,
)


def summary(**changes) -> dict:
    base = {
        "tasks": 100,
        "accepted": 100,
        "completed": 100,
        "failed": 0,
        "duplicates": 0,
        "submit_errors": {},
        "alloc_s": {"p99": 0.004},
        "offered_rate": 100.0,
        "achieved_offer_rate": 100.0,
    }
    return base | changes


def test_every_offered_task_run_once_exits_0() -> None:
    judged = verdict(summary())
    assert (judged.kind, judged.exit_code) == (EXACTLY_ONCE, 0)


def test_an_overloaded_run_that_refused_submissions_is_a_measurement_not_a_failure() -> None:
    # The run: 60,000 offered, 49,180 never acknowledged, the rest ran once.
    judged = verdict(
        summary(
            tasks=60_000,
            accepted=10_820,
            completed=10_820,
            submit_errors={"DEADLINE_EXCEEDED": 49_170, "RESOURCE_EXHAUSTED": 10},
        )
    )
    assert (judged.kind, judged.exit_code) == (SATURATED, 0)
    assert "49180 of 60000" in judged.reasons[0] and "DEADLINE_EXCEEDED 49170" in judged.reasons[0]


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"duplicates": 1}, "ran more than once"),
        ({"completed": 99}, "had not ended"),  # acknowledged, never ran: lost
        ({"completed": 99, "failed": 1}, "without succeeding"),
        # Saturation never hides a breach: refused jobs and a task that ran twice.
        (
            {"accepted": 50, "completed": 50, "duplicates": 2, "submit_errors": {"X": 50}},
            "ran more than once",
        ),
    ],
)
def test_a_lost_or_doubled_task_exits_1_whatever_the_load(changes, why) -> None:
    judged = verdict(summary(**changes))
    assert (judged.kind, judged.exit_code) == (BREACH, 1)
    assert why in " ".join(judged.reasons)


def test_a_rate_meets_the_target_only_if_every_offered_task_ran_in_time() -> None:
    assert target_met(summary(), 0.010)[0]
    assert target_met(summary(alloc_s={"p99": 0.011}), 0.010) == (
        False,
        "allocation p99 11.0 ms > 10 ms",
    )
    refused = summary(accepted=90, completed=90, submit_errors={"RESOURCE_EXHAUSTED": 10})
    assert not target_met(refused, 0.010)[0]
    assert not target_met(summary(achieved_offer_rate=80.0), 0.010)[0]
    assert not target_met(summary(alloc_s={"p99": None}), 0.010)[0]


def run_search(search: RateSearch, capacity: float) -> list[float]:
    """Drive ``search`` against a federation that keeps up to ``capacity`` tasks/s."""
    rates = []
    while (rate := search.next_rate()) is not None:
        rates.append(rate)
        search.record(rate, rate <= capacity)
    return rates


def test_the_search_doubles_then_bisects_within_its_runs() -> None:
    search = RateSearch(start=100, max_runs=8, resolution=0.1)
    rates = run_search(search, capacity=700)
    assert rates[:4] == [100, 200, 400, 800]  # doubling until the first miss
    assert rates[4:] == [600, 700, 750]  # then bisection between 400 and 800
    assert (search.best, search.lowest_missed) == (700, 750)  # within 10 %: done


def test_the_search_is_bounded_by_its_runs() -> None:
    search = RateSearch(start=100, max_runs=3)
    assert run_search(search, capacity=10_000) == [100, 200, 400]
    assert search.best == 400 and search.lowest_missed is None


def test_a_start_above_capacity_halves_down_until_a_rate_is_met() -> None:
    search = RateSearch(start=3000, max_runs=6)
    rates = run_search(search, capacity=500)
    assert rates[:3] == [3000, 1500, 750] and rates[3] == 375
    assert search.best is not None and 375 <= search.best <= 500
    assert search.lowest_missed is not None and search.lowest_missed > search.best


def test_no_rate_meets_the_target() -> None:
    search = RateSearch(start=4, max_runs=10, min_rate=1)
    assert run_search(search, capacity=0) == [4, 2, 1]
    assert search.best is None and search.lowest_missed == 1
