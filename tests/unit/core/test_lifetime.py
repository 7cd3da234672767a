"""Lifetime-aware placement (services/core/lifetime.py): classes, LAS cost, the LAVA host
state machine, the policies and the LARS order."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.core.lifetime import (
    HOUR_S,
    LAS_COST_BUCKETS_S,
    NO_HOST,
    BestFitBaseline,
    HostPool,
    HostState,
    LaBinary,
    Las,
    Lava,
    LifetimeClass,
    LifetimeEstimate,
    VmRequest,
    class_upper_s,
    extension_curve,
    lars_order,
    lifetime_class,
    make_lifetime_policy,
    quantise_cost,
    temporal_cost_s,
)

CAP = (64_000, 262_144)  # 64 cores, 256 GiB
H = HOUR_S


def pool(n=4, adaptive=False) -> HostPool:
    return HostPool(np.tile(CAP, (n, 1)), adaptive=adaptive)


def shape(cores, gib=None) -> np.ndarray:
    return np.array([cores * 1000.0, (gib if gib is not None else 4 * cores) * 1024.0])


def est(hours: float) -> LifetimeEstimate:
    return LifetimeEstimate(hours * H)


# --- classes and costs -------------------------------------------------------------------


def test_lifetime_class_boundaries():
    seconds = [0, 3599, 3600, 10 * H - 1, 10 * H, 100 * H, 999 * H, 1000 * H, 1e9]
    assert lifetime_class(seconds).tolist() == [1, 1, 2, 2, 3, 4, 4, 4, 4]
    assert int(lifetime_class(1800.0)) == LifetimeClass.UNDER_1H
    assert [class_upper_s(c) / H for c in (1, 2, 3, 4)] == [1, 10, 100, 1000]


def test_temporal_cost_is_the_host_extension():
    host_exit = np.array([10 * H, 2 * H, 5 * H])
    assert temporal_cost_s(5 * H, host_exit).tolist() == [0.0, 3 * H, 0.0]


def test_quantise_cost_rounds_up_to_the_bucket_edges():
    assert LAS_COST_BUCKETS_S.tolist() == [h * H for h in (0, 0.5, 1, 1.5, 2, 3, 4, 6, 12, 24, 168)]
    costs = [0, 1, 30 * 60, 30 * 60 + 1, 2.5 * H, 24 * H, 100 * H, 168 * H, 169 * H]
    assert quantise_cost(costs).tolist() == [0, 1, 1, 2, 5, 9, 10, 10, 11]


@given(st.lists(st.floats(0, 1e7), min_size=2, max_size=20))
def test_quantised_cost_is_monotone_and_zero_only_for_no_extension(costs):
    costs = np.sort(np.array(costs))
    buckets = quantise_cost(costs)
    assert np.all(np.diff(buckets) >= 0)
    assert np.array_equal(buckets == 0, costs == 0)


def test_lars_migrates_longest_predicted_first_keeping_ties_in_order():
    assert lars_order([1.0, 50.0, 3.0, 50.0]).tolist() == [1, 3, 2, 0]


# --- the host state machine ----------------------------------------------------------------


def test_first_vm_opens_a_host_and_90_percent_makes_it_recycling():
    p = pool(adaptive=True)
    p.place(0, 0, shape(16), tag=3, exit_s=50 * H, now_s=0)
    assert p.state[0] == HostState.OPEN and p.host_class[0] == 3
    assert p.deadline_s[0] == 100 * H
    p.place(1, 0, shape(32), tag=3, exit_s=40 * H, now_s=H)
    assert p.state[0] == HostState.OPEN  # 75 % CPU
    p.place(2, 0, shape(10), tag=1, exit_s=1.5 * H, now_s=H)
    assert p.state[0] == HostState.RECYCLING  # 90.6 % CPU
    assert p.exit_s[0] == 50 * H


def test_memory_alone_can_make_a_host_recycling():
    p = pool(adaptive=True)
    p.place(0, 0, shape(2, gib=240), tag=2, exit_s=H, now_s=0)
    assert p.state[0] == HostState.RECYCLING


def test_last_vm_gone_empties_the_host():
    p = pool(adaptive=True)
    p.place(0, 1, shape(4), tag=2, exit_s=5 * H, now_s=0)
    p.release(0, now_s=H)
    assert p.state[1] == HostState.EMPTY and p.host_class[1] == 0
    assert p.vm_count[1] == 0 and np.all(p.used[1] == 0) and p.exit_s[1] == -np.inf
    assert p.deadline_s[1] == np.inf


def test_residual_vms_gone_moves_the_class_down():
    p = pool(adaptive=True)
    p.place(0, 0, shape(40), tag=3, exit_s=50 * H, now_s=0)  # residual
    p.place(1, 0, shape(20), tag=1, exit_s=0.5 * H, now_s=0)  # recycling fill
    p.place(2, 0, shape(2), tag=2, exit_s=5 * H, now_s=0.2 * H)
    assert p.state[0] == HostState.RECYCLING
    p.release(0, now_s=0.3 * H)
    assert p.host_class[0] == 2  # the longest class left
    assert p.state[0] == HostState.OPEN  # 34 % used now
    assert p.deadline_s[0] == pytest.approx(0.2 * H + 10 * H)
    assert p.exit_s[0] == 5 * H


def test_a_recycling_host_still_full_stays_recycling_after_class_down():
    p = pool(adaptive=True)
    p.place(0, 0, shape(4), tag=3, exit_s=50 * H, now_s=0)
    p.place(1, 0, shape(58), tag=2, exit_s=5 * H, now_s=0)
    p.release(0, now_s=H)
    assert p.host_class[0] == 2 and p.state[0] == HostState.RECYCLING


def test_deadline_passed_moves_the_class_up_and_retags_the_residual_vms():
    p = pool(adaptive=True)
    p.place(0, 0, shape(4), tag=1, exit_s=0.5 * H, now_s=0)
    assert p.advance(0.9 * H) == []
    assert p.advance(1.1 * H) == [0]
    assert p.host_class[0] == 2 and p.vm_tag[0] == 2
    assert p.deadline_s[0] == pytest.approx(1.1 * H + 10 * H)
    # The VM is residual of the new class: its exit does not class the host down.
    p.place(1, 0, shape(4), tag=1, exit_s=2 * H, now_s=1.2 * H)
    p.release(1, now_s=1.3 * H)
    assert p.host_class[0] == 2


def test_deadline_bump_follows_a_longer_reprediction_and_stops_at_class_4():
    p = pool(adaptive=True)
    p.place(0, 0, shape(4), tag=1, exit_s=0.5 * H, now_s=0)
    p.advance(2 * H, remaining_s={0: 300 * H})
    assert p.host_class[0] == 4
    p.advance(2 * H + 1001 * H)
    assert p.host_class[0] == 4


def test_a_longer_vm_on_a_shorter_host_lifts_its_class():
    p = pool(adaptive=True)
    p.place(0, 0, shape(4), tag=1, exit_s=0.5 * H, now_s=0)
    p.place(1, 0, shape(4), tag=3, exit_s=50 * H, now_s=0)
    assert p.host_class[0] == 3 and p.deadline_s[0] == 100 * H


def test_non_adaptive_pool_keeps_the_first_label():
    p = pool(adaptive=False)
    p.place(0, 0, shape(4), tag=1, exit_s=0.5 * H, now_s=0)
    p.place(1, 0, shape(4), tag=2, exit_s=5 * H, now_s=0)
    p.release(0, now_s=0.5 * H)
    assert p.advance(10 * H) == [] and p.host_class[0] == 1


def test_placing_a_vm_twice_is_an_error():
    p = pool()
    p.place(0, 0, shape(1), 0, H, 0)
    with pytest.raises(ValueError, match="already on host 0"):
        p.place(0, 1, shape(1), 0, H, 0)


def test_update_exits_recomputes_host_exits():
    p = pool()
    p.place(0, 0, shape(1), 0, 10 * H, 0)
    p.place(1, 0, shape(1), 0, 2 * H, 0)
    p.update_exits({0: 3 * H, 1: 4 * H})
    assert p.exit_s[0] == 4 * H
    p.release(1, H)
    assert p.exit_s[0] == 3 * H


# --- policies ------------------------------------------------------------------------------


def test_best_fit_takes_the_fullest_fitting_host_and_skips_draining_ones():
    p = pool()
    p.place(0, 1, shape(32), 0, H, 0)
    p.place(1, 2, shape(60), 0, H, 0)
    vm = VmRequest(shape(8), 0.0)
    assert BestFitBaseline().choose_host(p, vm, est(1)) == 1  # host 2 has only 4 cores left
    p.available[1] = False
    assert BestFitBaseline().choose_host(p, vm, est(1)) == 0
    assert BestFitBaseline().choose_host(p, VmRequest(shape(65), 0.0), est(1)) == NO_HOST


def test_la_binary_segregates_long_from_short_at_2_hours():
    policy = LaBinary()
    assert policy.tag(est(1.99)) == 1 and policy.tag(est(2)) == 2
    p = pool()
    p.place(0, 0, shape(32), policy.tag(est(0.2)), 0.2 * H, 0)  # a short host, fuller
    p.place(1, 1, shape(8), policy.tag(est(50)), 50 * H, 0)  # a long host
    assert policy.choose_host(p, VmRequest(shape(4), 0), est(30)) == 1
    assert policy.choose_host(p, VmRequest(shape(4), 0), est(0.5)) == 0
    p.place(2, 1, shape(56), 2, 50 * H, 0)  # the long host is full now
    # A long VM opens an empty host rather than pin a short one...
    assert policy.choose_host(p, VmRequest(shape(4), 0), est(30)) == 2
    # ...while a short VM may take a long host before opening one.
    p2 = pool()
    p2.place(0, 3, shape(8), 2, 50 * H, 0)
    assert policy.choose_host(p2, VmRequest(shape(4), 0), est(0.5)) == 3


def test_las_prefers_the_host_whose_exit_covers_the_vm_over_a_fuller_one():
    p = pool()
    p.place(0, 0, shape(8), 0, 100 * H, 0)  # lives long, mostly free
    p.place(1, 1, shape(56), 0, 1 * H, 0)  # fuller, but leaves soon
    vm = VmRequest(shape(4), 0.0)
    assert Las().choose_host(p, vm, est(20)) == 0  # no extension
    assert Las().choose_host(p, vm, est(0.5)) == 1  # both cost 0: best-fit
    # Extensions in the same bucket tie, and best-fit decides.
    p.update_exits({0: 10 * H, 1: 10.5 * H})
    assert Las().choose_host(p, vm, est(20)) == 1
    # An empty host's exit is now: a fitting occupied host is never worse.
    q = pool(2)
    q.place(0, 1, shape(4), 0, 0.1 * H, 0)
    assert Las().choose_host(q, VmRequest(shape(4), 0.0), est(20)) == 1


def test_lava_order_recycling_then_open_same_then_open_longer_then_las_then_empty():
    lava = Lava()
    p = pool(6, adaptive=True)
    p.place(0, 0, shape(60), 3, 50 * H, 0)  # recycling, class 3
    p.place(1, 1, shape(8), 1, 0.5 * H, 0)  # open, class 1
    p.place(2, 2, shape(8), 3, 90 * H, 0)  # open, class 3
    p.place(3, 3, shape(8), 2, 5 * H, 0)  # open, class 2
    assert p.state[0] == HostState.RECYCLING
    # choose() also names the step (Lava.STEPS) that picked the host.
    assert lava.choose(p, VmRequest(shape(2), 0), est(0.5)) == (0, 0)
    assert lava.choose(p, VmRequest(shape(8), 0), est(0.5)) == (1, 1)  # recycling too full
    assert lava.choose(p, VmRequest(shape(8), 0), est(5)) == (3, 1)
    p.release(3, 0)
    assert lava.choose(p, VmRequest(shape(8), 0), est(5)) == (2, 2)  # open, longer class
    # A class-4 VM: no class-4 host, so LAS among occupied hosts (host 2 lives longest).
    assert lava.choose(p, VmRequest(shape(8), 0), est(100)) == (2, 3)
    full = pool(2, adaptive=True)
    full.place(0, 0, shape(62), 1, 0.5 * H, 0)
    assert lava.choose(full, VmRequest(shape(8), 0), est(5)) == (1, 4)  # empty, last
    assert lava.choose(full, VmRequest(shape(80), 0), est(5)) == (NO_HOST, -1)
    assert lava.choose_host(full, VmRequest(shape(8), 0), est(5)) == 1
    assert Lava.STEPS[3] == "las_occupied"
    assert lava.tag(est(5)) == 2


def test_make_lifetime_policy_names_and_errors():
    for name in ("best_fit", "la_binary", "las", "lava"):
        assert make_lifetime_policy(name).name == name
    assert make_lifetime_policy("lava").adaptive and not make_lifetime_policy("las").adaptive
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_lifetime_policy("nope")


# --- the expected extension over a predicted distribution -------------------------------


def test_extension_curve_of_a_point_mass_is_the_plain_extension():
    # An oracle: R = 10 h exactly, so m(u) = 10 h - u and E[max(R - h, 0)] = max(10 h - h, 0).
    horizons = np.linspace(0, 20 * H, 2001)
    curve = extension_curve(horizons, np.maximum(10 * H - horizons, 0.0))
    for h in (0, 1, 5, 9, 10, 15):
        expected = max(10 - h, 0) * H
        assert curve[int(h * 100)] == pytest.approx(expected, abs=0.01 * H)


def test_extension_curve_of_an_exponential_lifetime():
    # Memoryless: m(u) = 3 h everywhere, and E[max(R - h, 0)] = P(R > h) * 3 h = 3 h e^(-h/3h).
    horizons = np.array([0, 0.5, 1, 3, 6, 12]) * H
    curve = extension_curve(horizons, np.full(len(horizons), 3 * H))
    assert curve == pytest.approx(3 * H * np.exp(-horizons / (3 * H)))


def test_extension_curve_recovers_a_bimodal_distribution_from_its_mean_residual_life():
    # 90 % of such VMs live 6 min, 10 % live 24 h: E[R] = 2.49 h.
    horizons = np.linspace(0, 30 * H, 30_001)
    short, long = 0.1 * H, 24 * H
    true = 0.9 * np.maximum(short - horizons, 0) + 0.1 * np.maximum(long - horizons, 0)
    alive = 0.9 * (horizons < short) + 0.1 * (horizons < long)
    mean_residual = np.where(alive > 0, true / np.maximum(alive, 1e-12), 0.0)
    curve = extension_curve(horizons, mean_residual)
    for h in (0, 0.05, 1, 3, 12, 23):
        k = int(h * 1000)
        assert curve[k] == pytest.approx(true[k], rel=0.02, abs=0.01 * H)


def test_las_on_the_distribution_sends_an_uncertain_vm_to_the_long_lived_host():
    # Host 0 (fuller) ends in 3 h, host 1 in 40 h. The VM's mean, 2.49 h, extends neither:
    # on the mean, best-fit picks host 0. Over the distribution, host 0 is extended by
    # 0.1 * (24 h - 3 h) = 2.1 h in expectation, host 1 by nothing: host 1.
    p = pool(n=2)
    p.place(0, 0, shape(40), tag=0, exit_s=3 * H, now_s=0)
    p.place(1, 1, shape(8), tag=0, exit_s=40 * H, now_s=0)
    horizons = np.linspace(0, 50 * H, 5001)
    curve = 0.9 * np.maximum(0.1 * H - horizons, 0) + 0.1 * np.maximum(24 * H - horizons, 0)
    mean_only = LifetimeEstimate(curve[0])
    with_curve = LifetimeEstimate(curve[0], extension_horizons_s=horizons, extension_s=curve)
    vm = VmRequest(shape(4), now_s=0.0)
    assert Las().choose_host(p, vm, mean_only) == 0
    assert Las().choose_host(p, vm, with_curve) == 1
    assert with_curve.expected_extension_s(np.array([3 * H]))[0] == pytest.approx(2.1 * H)
    assert mean_only.expected_extension_s(np.array([1 * H, 3 * H])).tolist() == [
        pytest.approx(1.49 * H),
        0.0,
    ]
