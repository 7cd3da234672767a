"""Client-side throttling (``AdaptiveThrottle``): a client holds back tries in proportion
to how many the GM refused, and never while it takes them all."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.throttle import MIN_REQUESTS, AdaptiveThrottle, Pace


def test_a_gm_taking_everything_is_never_throttled() -> None:
    throttle = AdaptiveThrottle()
    for i in range(1_000):
        now = i * 0.01
        assert throttle.allow(now, 0.0)
        throttle.record(now, accepted=True)
    assert throttle.reject_probability(10.0) == 0.0


def test_the_probability_is_the_sre_books_rule() -> None:
    throttle = AdaptiveThrottle(k=2)
    for i in range(100):
        throttle.record(0.5, accepted=i < 25)
    assert throttle.counts(0.5) == (100, 25)
    assert throttle.reject_probability(0.5) == pytest.approx((100 - 2 * 25) / 101)
    # Kept-back tries count as refused requests: holding back raises the probability.
    throttle.record(0.5, accepted=False)
    assert throttle.reject_probability(0.5) == pytest.approx((101 - 50) / 102)


def test_a_few_tries_are_never_held_back() -> None:
    throttle = AdaptiveThrottle()
    for _ in range(MIN_REQUESTS - 1):
        throttle.record(0.0, accepted=False)
    assert throttle.reject_probability(0.0) == 0.0
    throttle.record(0.0, accepted=False)
    assert throttle.reject_probability(0.0) > 0.9


def test_refusals_are_forgotten_after_the_window() -> None:
    throttle = AdaptiveThrottle(window_s=10)
    for _ in range(100):
        throttle.record(3.2, accepted=False)
    assert throttle.reject_probability(12.9) > 0.9  # second 3 is still in (12.9 - 10)
    assert throttle.reject_probability(14.0) == 0.0
    assert throttle.counts(14.0) == (0, 0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="k must be"):
        AdaptiveThrottle(k=0.5)
    with pytest.raises(ValueError, match="window_s"):
        AdaptiveThrottle(window_s=0)


# Derandomized: the bound below is statistical, and a run must not fail by the draw.
@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    offered=st.integers(50, 2_000),  # tries per second the client wants to make
    capacity=st.integers(5, 500),  # tries per second the GM takes
    seed=st.integers(0, 2**16),
)
def test_the_gm_sees_about_k_tries_per_one_it_takes(offered: int, capacity: int, seed) -> None:
    """A client offering more than the GM takes: once the window is full, the tries it
    sends stay near ``k`` per one taken (the refusals cost no message past that), and
    it never sends fewer than the GM would take."""
    rng = random.Random(seed)
    throttle = AdaptiveThrottle(k=2, window_s=10)
    sent = taken = 0
    for second in range(40):
        room = capacity
        for i in range(offered):
            now = second + i / offered
            if not throttle.allow(now, rng.random()):
                throttle.record(now, accepted=False)
                continue
            ok = room > 0
            room -= ok
            throttle.record(now, accepted=ok)
            if second >= 20:
                sent += 1
                taken += ok
    # The GM is kept busy: within 5 % of its room, or 15 tries (a GM taking 5 a second
    # sees about 10 tries a second, and a second with fewer than 5 sent happens: over
    # 100 seeds at 1,657 offered and 5 taken a second, the 20 s fell short by 0 (median),
    # 6 (99th) and 11 (most) tries).
    room_20s = min(offered, capacity) * 20
    assert taken >= room_20s - max(0.05 * room_20s, 15)
    if offered > 3 * capacity:
        assert sent <= 2.5 * taken + 20  # about k tries per one taken, not ``offered``


def test_the_pace_is_the_places_freed_over_the_window_or_since_the_first() -> None:
    pace = Pace(window_s=2.0)
    assert pace.per_s(0.0) == 0.0 and not pace.hopeless(10**6, 1.0, 0.0)  # not known
    for n in range(100):  # 100 freed within 0.5 s: 200 a second, not 50
        pace.freed(10.0 + n * 0.005)
    assert pace.per_s(10.5) == pytest.approx(200.0)
    # 1,000 ahead at 200 a second: 5 s.
    assert pace.hopeless(1_000, 4.9, 10.5) and not pace.hopeless(1_000, 5.1, 10.5)
    assert pace.per_s(11.5) == pytest.approx(100 / 1.5)  # since the first: 1.5 s
    assert pace.per_s(12.0) == pytest.approx(99 / 2.0)  # the window: the first left it
    assert pace.per_s(12.6) == 0.0 and not pace.hopeless(10**6, 1.0, 12.6)  # none lately


def test_a_pace_needs_a_window() -> None:
    with pytest.raises(ValueError, match="positive"):
        Pace(window_s=0)
