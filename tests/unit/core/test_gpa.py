"""GPA: the fit test's numbers, the policy the GM and LM share, the LM's usage books, the
wire, and the offline packers gpa-eval uses."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services._proto.megha.v1 import common_pb2
from services.common.config import ConfigError, default_config, parse_config
from services.common.convert import snapshot_from_proto, snapshot_to_proto
from services.core import gpa
from services.core.cluster_state import ClusterState
from services.core.gpa import (
    FitRule,
    GpaPolicy,
    fits_gpa,
    overflow_probability,
    pack,
    rebalance_last_bin,
    task_usage,
)
from services.core.match import NO_NODE, assess, candidates, make_policy
from services.core.node_table import NodeTable
from services.core.resources import CPU, MEMORY, resources
from services.core.status import PlacementStatus as S
from services.core.status import Schedulability
from services.core.task import TaskSpec
from tests.builders import set_free_at

GMS = ("gm-a", "gm-b")
NODE = resources(4000, 8192, 1000, 1000)


def usage_task(
    task_id: str = "t",
    cpu: int = 1000,
    mem: int = 512,
    mean: float = 300.0,
    std: float = 100.0,
    queue: str = "q",
    mask: int = 0,
) -> TaskSpec:
    return TaskSpec(
        task_id, resources(cpu, mem), mask, queue=queue, cpu_usage_mean=mean, cpu_usage_std=std
    )


def gpa_lm(nodes: int = 1, rho: float = 0.01) -> ClusterState:
    state = ClusterState("lm", GMS, num_constraints=4, policy=GpaPolicy(rho))
    for i in range(nodes):
        state.add_node(f"w{i}", NODE, partition=0)
    return state


def scalar_overflow(c: float, mean: float, var: float) -> float:
    """P(N(mean, var) > c), written out by hand with math.erfc."""
    if var == 0:
        return float(mean > c)
    return 0.5 * math.erfc((c - mean) / math.sqrt(var) / math.sqrt(2))


# ------------------------------------------------------------------ the formula
def test_overflow_probability_matches_hand_computed_values():
    # usage ~ N(800, 100^2) on 1000m: z = 2, P(Z > 2) = 0.0227501319...
    p = overflow_probability(np.array([1000.0]), np.array([800.0]), np.array([1e4]), 0.0, 0.0)
    assert p[0] == pytest.approx(0.02275013194817921, rel=1e-12)
    # the task's own mean and variance join the node's: N(500 + 100, 30000 + 100^2), z = 2
    p = overflow_probability(np.array([1000.0]), np.array([500.0]), np.array([3e4]), 100, 100)
    assert p[0] == pytest.approx(0.02275013194817921, rel=1e-12)
    # z = 0: a coin flip; z = -1: 0.841...
    p = overflow_probability(np.array([1000.0, 1000.0]), np.array([1000.0, 1100.0]),
                             np.array([100.0, 1e4]), 0.0, 0.0)  # fmt: skip
    assert p.tolist() == pytest.approx([0.5, 0.8413447460685429])


def test_fit_is_phi_against_one_minus_rho():
    cap, mean, var = np.array([1000.0]), np.array([800.0]), np.array([1e4])
    assert fits_gpa(cap, mean, var, 0.0, 0.0, rho=0.05)[0]  # 0.0228 <= 0.05
    assert fits_gpa(cap, mean, var, 0.0, 0.0, rho=0.023)[0]
    assert not fits_gpa(cap, mean, var, 0.0, 0.0, rho=0.022)[0]
    assert not fits_gpa(cap, mean, var, 0.0, 0.0, rho=0.01)[0]


def test_zero_variance_is_deterministic():
    cap = np.array([1000.0, 1000.0, 1000.0])
    means = np.array([999.0, 1000.0, 1001.0])
    zero = np.zeros(3)
    assert overflow_probability(cap, means, zero, 0, 0).tolist() == [0.0, 0.0, 1.0]
    assert fits_gpa(cap, means, zero, 0, 0, rho=1e-9).tolist() == [True, True, False]


def test_bad_rho_is_refused():
    for rho in (0.0, 1.0, -0.1, 2.0):
        with pytest.raises(ValueError, match="rho"):
            GpaPolicy(rho)


def test_vectorised_equals_scalar(rng):
    n = 5000
    cap = rng.integers(500, 64_000, n).astype(float)
    mean = cap * rng.uniform(0, 1.3, n)
    var = (cap * rng.uniform(0, 0.3, n)) ** 2 * (rng.random(n) < 0.9)
    task_mean, task_std = 250.0, 80.0
    p = overflow_probability(cap, mean, var, task_mean, task_std)
    rows = zip(cap, mean, var, strict=True)
    want = [scalar_overflow(c, m + task_mean, v + task_std**2) for c, m, v in rows]
    np.testing.assert_allclose(p, want, rtol=1e-9, atol=1e-300)
    for rho in (0.1, 0.05, 0.01, 0.001):
        fit = fits_gpa(cap, mean, var, task_mean, task_std, rho)
        clear = np.abs(p - rho) > 1e-9 * rho  # away from the boundary, where rounding decides
        np.testing.assert_array_equal(fit[clear], (p <= rho)[clear])


def test_normal_tail_without_scipy_is_the_same(monkeypatch, rng):
    x = rng.normal(0, 3, 200)
    with_scipy = gpa.normal_sf(x)
    monkeypatch.setattr(gpa, "_ndtr", None)
    np.testing.assert_allclose(gpa.normal_sf(x), with_scipy, rtol=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    mean=st.floats(0, 2e4),
    var=st.floats(0, 1e8),
    task_mean=st.floats(0, 4000),
    task_std=st.floats(0, 2000),
    rhos=st.lists(st.floats(1e-6, 0.5), min_size=2, max_size=2, unique=True).map(sorted),
)
def test_a_larger_rho_never_rejects_what_a_smaller_one_accepts(
    mean, var, task_mean, task_std, rhos
):
    args = (np.array([8000.0]), np.array([mean]), np.array([var]), task_mean, task_std)
    strict, loose = (bool(fits_gpa(*args, rho)[0]) for rho in rhos)
    assert loose or not strict


def test_task_usage_defaults_to_the_request_and_stays_integral():
    assert task_usage(usage_task(cpu=1500, mean=0, std=0)) == (1500.0, 0.0)
    assert task_usage(usage_task(cpu=1500, mean=float("nan"), std=0)) == (1500.0, 0.0)
    assert task_usage(usage_task(mean=300.4, std=10.1)) == (300.0, 102.0)
    assert task_usage(usage_task(mean=0, std=5)) == (0.0, 25.0)  # an estimate: near-idle


# ------------------------------------------------------------------ the policy
def test_make_policy_and_config_know_gpa():
    policy = make_policy("gpa", rho=0.05)
    assert isinstance(policy, GpaPolicy) and policy.name == "gpa" and policy.rho == 0.05
    assert make_policy("gpa").rho == gpa.DEFAULT_RHO
    config = parse_config({**default_config(), "policy": "gpa", "gpa_rho": 0.05}, env={})
    assert (config.policy, config.gpa_rho) == ("gpa", 0.05)
    assert parse_config(default_config(), env={}).gpa_rho == 0.01
    with pytest.raises(ConfigError, match="gpa_rho"):
        parse_config({**default_config(), "gpa_rho": 0}, env={})


@st.composite
def gpa_tables(draw):
    n = draw(st.integers(1, 600))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    table = NodeTable(num_partitions=2, num_constraints=4)
    masks = rng.integers(0, 16, n)
    for i in range(n):
        table.add(f"n{i}", NODE, int(masks[i]), int(rng.integers(0, 2)))
    # usage sums around the boundary of the test; memory often short; cpu free anything
    table.usage_mean[:] = rng.integers(0, 9, n) * 500.0
    table.usage_var[:] = rng.integers(0, 5, n) * 250.0**2
    set_free_at(table, np.s_[CPU], rng.integers(-4, 5, n) * 1000)
    set_free_at(table, np.s_[MEMORY], rng.integers(0, 9, n) * 1024)
    for i in np.flatnonzero(rng.random(n) < 0.2):
        table.set_alive(int(i), False)
    return table


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    table=gpa_tables(),
    cpu=st.integers(1, 5),
    mem=st.integers(0, 8),
    mean=st.sampled_from([0.0, 250.0, 500.0, 1000.0]),
    std=st.sampled_from([0.0, 100.0, 400.0]),
    mask=st.integers(0, 15),
    partition=st.sampled_from([None, 0, 1]),
    rho=st.sampled_from([0.1, 0.01, 0.001]),
)
def test_select_is_the_first_node_brute_force_finds(
    table, cpu, mem, mean, std, mask, partition, rho
):
    policy = GpaPolicy(rho)
    t = TaskSpec("t", resources(cpu * 1000, mem * 1024), mask, cpu_usage_mean=mean,
                 cpu_usage_std=std)  # fmt: skip
    within = None if partition is None else table.members[partition]
    node = policy.select(table, candidates(table, mask, within), t)
    task_mean, task_var = task_usage(t)
    brute = [
        i
        for i in range(table.size)
        if table.is_alive(i)
        and (partition is None or table.owner[i] == partition)
        and table.satisfies(i, mask)
        and table.free[MEMORY, i] >= t.resources[MEMORY]
        and table.capacity[CPU, i] >= t.resources[CPU]
        and scalar_overflow(4000.0, table.usage_mean[i] + task_mean, table.usage_var[i] + task_var)
        <= rho * (1 + 1e-9)
    ]
    assert node == (brute[0] if brute else NO_NODE)
    if node != NO_NODE:
        assert policy.fits(table, node, t)


def test_lm_oversubscribes_cpu_within_rho_and_keeps_memory_strict():
    state = gpa_lm(rho=0.01)
    # 1000m requested, usage ~N(300, 100^2): 4000 - 300 n >= 2.326 * 100 * sqrt(n) -> n <= 10
    placed = [state.launch("gm-a", usage_task(f"t{i}"), 0).status for i in range(12)]
    assert placed == [S.ACCEPTED] * 10 + [S.REJECTED_RESOURCES] * 2
    assert state.table.free[CPU, 0] == 4000 - 10 * 1000  # requests oversubscribed 2.5x
    assert state.table.usage_mean[0] == 3000 and state.table.usage_var[0] == 10 * 100**2
    p = overflow_probability(np.array([4000.0]), state.table.usage_mean, state.table.usage_var,
                             0, 0)  # fmt: skip
    assert p[0] <= 0.01
    rejected = state.launch("gm-a", usage_task("t10"), 0)
    assert "P(cpu usage > 4000m)" in rejected.reason and "rho 0.01" in rejected.reason
    # a task without a usage estimate books its whole request: 3000 + 1000 > capacity - 2.3 std
    assert state.launch("gm-a", usage_task("plain", mean=0, std=0), 0).status is (
        S.REJECTED_RESOURCES
    )
    # memory is never oversubscribed, however idle the task's cpu is
    hog = usage_task("hog", mem=8192 - 10 * 512 + 1, mean=1, std=0)
    decision = state.launch("gm-a", hog, 0)
    assert decision.status is S.REJECTED_RESOURCES and "mem=" in decision.reason
    # more cpu than the node has, even if idle: never
    assert state.launch("gm-a", usage_task("big", cpu=4001, mean=1, std=0), 0).status is (
        S.REJECTED_RESOURCES
    )
    state.release("t0")
    assert state.launch("gm-a", usage_task("t10"), 0).status is S.ACCEPTED


def test_preempting_frees_the_victims_usage():
    state = gpa_lm(rho=0.01)
    for i in range(10):
        state.launch("gm-a", usage_task(f"big{i}", queue="big"), 0)
    newcomer = usage_task("new", mean=600, std=100, queue="small")
    assert state.launch("gm-a", newcomer, 0).status is S.REJECTED_RESOURCES
    over = {"big"}.__contains__
    # one victim frees 300 of mean: 3300 + 2.326 * sqrt(100k) = 4035 > 4000, still no
    one = state.preempt("gm-a", newcomer, 0, ["big9"], over)
    assert one.status is S.REJECTED_RESOURCES and "P(cpu usage" in one.reason
    assert state.table.usage_mean[0] == 3000  # a refused preemption changes nothing
    done = state.preempt("gm-a", newcomer, 0, ["big9", "big8"], over)
    assert done.status is S.ACCEPTED
    assert state.table.usage_mean[0] == 8 * 300 + 600
    assert state.table.usage_var[0] == 9 * 100**2


def test_assess_follows_the_policy_when_given():
    state = gpa_lm(rho=0.01)
    for i in range(9):
        state.launch("gm-a", usage_task(f"t{i}"), 0)
    small = usage_task("s", mean=100, std=10)
    assert state.table.free[CPU, 0] < 0  # strict fit would see no room at all
    assert assess([state.table], small).schedulability is Schedulability.UNSCHEDULABLE
    assert assess([state.table], small, GpaPolicy(0.01)).schedulability is (
        Schedulability.SCHEDULABLE
    )
    huge = usage_task("h", mean=3000, std=10)
    verdict = assess([state.table], huge, GpaPolicy(0.01))
    assert verdict.schedulability is Schedulability.UNSCHEDULABLE
    assert "GPA cpu test" in verdict.reason and "cpu=-" not in verdict.reason


# ------------------------------------------------------------- the usage books
class GpaBooks(RuleBasedStateMachine):
    """Random launches, repartitions, preemptions, releases and node deaths under GPA: the
    usage columns always equal the sums over running allocations, memory is never over
    committed, and every node passed the GPA test when its latest task arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.state = ClusterState("lm", GMS, num_constraints=2, policy=GpaPolicy(0.05))
        for i in range(4):
            self.state.add_node(f"w{i}", resources(4000, 4096), partition=i % 2)
        self.next = 0

    def _task(self, cpu, mem, mean, std, queue="q"):
        self.next += 1
        return TaskSpec(f"t{self.next}", resources(cpu, mem), queue=queue,
                        cpu_usage_mean=mean, cpu_usage_std=std)  # fmt: skip

    @rule(
        node=st.integers(0, 3),
        gm=st.sampled_from(GMS),
        cpu=st.integers(1, 4000),
        mem=st.integers(0, 2048),
        mean=st.sampled_from([0.0, 50.0, 333.3, 1200.0]),
        std=st.sampled_from([0.0, 20.0, 250.5]),
    )
    def place(self, node, gm, cpu, mem, mean, std):
        t = self._task(cpu, mem, mean, std)
        internal = int(self.state.table.owner[node]) == self.state.partition_of(gm)
        decision = (self.state.launch if internal else self.state.repartition)(gm, t, node)
        if decision.ok:
            table = self.state.table
            p = overflow_probability(table.capacity[CPU, node], table.usage_mean[node],
                                     table.usage_var[node], 0, 0)  # fmt: skip
            assert p <= 0.05 * (1 + 1e-9)

    @precondition(lambda self: self.state.allocations)
    @rule(data=st.data())
    def release(self, data):
        self.state.release(data.draw(st.sampled_from(sorted(self.state.allocations))))

    @precondition(lambda self: self.state.allocations)
    @rule(data=st.data(), mean=st.sampled_from([100.0, 900.0]))
    def preempt(self, data, mean):
        victim = self.state.allocations[data.draw(st.sampled_from(sorted(self.state.allocations)))]
        t = self._task(1000, 256, mean, 50.0, queue="small")
        self.state.preempt("gm-a", t, victim.node, [victim.task_id], lambda q: True)

    @rule(node=st.integers(0, 3), alive=st.booleans())
    def set_alive(self, node, alive):
        self.state.set_alive(node, alive)

    @invariant()
    def books_balance(self):
        table = self.state.table
        mean, var = np.zeros(table.size), np.zeros(table.size)
        held = np.zeros_like(table.capacity)
        for a in self.state.allocations.values():
            mean[a.node] += a.usage_mean
            var[a.node] += a.usage_var
            held[:, a.node] += a.resources
        np.testing.assert_array_equal(table.usage_mean, mean)  # exact: integral floats
        np.testing.assert_array_equal(table.usage_var, var)
        np.testing.assert_array_equal(table.free, table.capacity - held)
        assert (table.free[1:] >= 0).all()  # memory, disk, net: never over committed


TestGpaBooks = GpaBooks.TestCase
TestGpaBooks.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


# ------------------------------------------------------------------- the wire
def _wire(snap):
    data = snapshot_to_proto(snap).SerializeToString()
    return snapshot_from_proto(common_pb2.LocalMasterState.FromString(data), 4)


def test_usage_columns_and_allocations_survive_the_wire():
    state = gpa_lm(nodes=3)
    state.launch("gm-a", usage_task("a", mean=333.0, std=12.5), 0)
    state.launch("gm-a", usage_task("b", mean=0, std=0), 2)
    snap = state.snapshot()
    got = _wire(snap)
    np.testing.assert_array_equal(got.usage_mean, [333.0, 0.0, 1000.0])
    np.testing.assert_array_equal(got.usage_var, [156.0, 0.0, 0.0])
    assert {a.task_id: (a.usage_mean, a.usage_var) for a in got.allocations} == {
        "a": (333.0, 156.0),
        "b": (1000.0, 0.0),
    }
    # a GM's table built from the snapshot has the LM's books
    view = NodeTable(2, 4)
    view.set_columns(got.nodes)
    view.set_free(got.free_indices, got.free, got.usage_mean, got.usage_var)
    np.testing.assert_array_equal(view.usage_mean, state.table.usage_mean)
    np.testing.assert_array_equal(view.usage_var, state.table.usage_var)

    version = state.version
    state.release("a")
    delta = _wire(state.snapshot(since_version=version))
    assert delta.free_indices.tolist() == [0]
    assert delta.usage_mean.tolist() == [0.0] and delta.usage_var.tolist() == [0.0]
    nothing = _wire(state.snapshot(since_version=state.version))
    assert nothing.usage_mean is not None and len(nothing.usage_mean) == 0


def test_a_state_without_usage_columns_derives_them_from_free():
    state = gpa_lm(nodes=2)
    state.launch("gm-a", usage_task("a", cpu=1500, mean=0, std=0), 1)
    msg = snapshot_to_proto(state.snapshot())
    msg.ClearField("usage")  # what an LM that predates GPA sends
    got = snapshot_from_proto(msg, 4)
    assert got.usage_mean is None and got.usage_var is None
    view = NodeTable(2, 4)
    view.set_columns(got.nodes)
    view.set_free(got.free_indices, got.free)
    assert view.usage_mean.tolist() == [0.0, 1500.0] and view.usage_var.tolist() == [0.0, 0.0]


def test_a_gm_view_keeps_the_usage_books_in_step():
    from services.core.global_view import GlobalView, Placement

    state = gpa_lm(nodes=2)
    view = GlobalView("gm-a", GpaPolicy(0.01), num_constraints=4)
    state.launch("gm-a", usage_task("a", mean=333.0, std=12.5), 0)
    view.apply(_wire(state.snapshot()), now=0.0)
    np.testing.assert_array_equal(view.lms["lm"].table.usage_mean, state.table.usage_mean)
    # optimistic deduction and an early end move the usage sums like the LM's books
    t = usage_task("b", mean=200.0, std=30.0)
    placement = view.match(t)
    assert placement == Placement("lm", 0, "w0", False)
    view.reserve(placement, t, now=0.0)
    assert state.launch("gm-a", t, 0).ok
    np.testing.assert_array_equal(view.lms["lm"].table.usage_mean, state.table.usage_mean)
    np.testing.assert_array_equal(view.lms["lm"].table.usage_var, state.table.usage_var)
    view.release("lm", "a", ended=True, attempt=0, now=1.0)
    state.release("a")
    np.testing.assert_array_equal(view.lms["lm"].table.usage_mean, state.table.usage_mean)
    view.apply(_wire(state.snapshot(since_version=0)), now=2.0)
    np.testing.assert_array_equal(view.lms["lm"].table.usage_mean, state.table.usage_mean)
    np.testing.assert_array_equal(view.lms["lm"].table.usage_var, state.table.usage_var)


def test_usage_columns_of_the_wrong_length_are_refused():
    msg = snapshot_to_proto(gpa_lm(nodes=2).snapshot())
    del msg.usage.cpu_usage_variances[-1]
    with pytest.raises(ValueError, match="UsageColumns"):
        snapshot_from_proto(msg, 4)


# ------------------------------------------------------------ offline packing
def test_first_fit_and_best_fit_on_a_hand_example():
    rule = FitRule.average(np.array([0.5, 0.7, 0.5, 0.2, 0.3]), 1.0)
    # first fit: 0.5 -> b0, 0.7 -> b1, 0.5 -> b0 (full), 0.2 -> b1, 0.3 -> b2
    assert pack(rule, 1.0, "first-fit", rebalance=False).tolist() == [0, 1, 0, 1, 2]
    rule = FitRule.average(np.array([0.5, 0.7, 0.2, 0.1]), 1.0)
    # best fit puts 0.2 on the fuller bin (0.7), first fit on the first (0.5)
    assert pack(rule, 1.0, "best-fit", rebalance=False).tolist() == [0, 1, 1, 1]
    assert pack(rule, 1.0, "first-fit", rebalance=False).tolist() == [0, 1, 0, 0]


def test_an_item_larger_than_a_bin_gets_its_own():
    rule = FitRule.percentile(np.array([0.4, 1.5, 0.4]))
    assert pack(rule, 1.0, rebalance=False).tolist() == [0, 1, 0]


def test_gpa_rule_is_the_gpa_test():
    mean, std = np.full(40, 0.03), np.full(40, 0.02)
    bins = pack(FitRule.gpa(mean, std, 0.05), 1.0, rebalance=False)
    per_bin = np.bincount(bins)
    n = per_bin[0]  # the first bin holds the most tasks the test allows
    assert fits_gpa(np.array([1.0]), np.array([0.03 * (n - 1)]),
                    np.array([0.0004 * (n - 1)]), 0.03, 0.02, 0.05)[0]  # fmt: skip
    assert not fits_gpa(np.array([1.0]), np.array([0.03 * n]), np.array([0.0004 * n]),
                        0.03, 0.02, 0.05)[0]  # fmt: skip


def test_rebalancing_moves_tasks_to_the_last_bin_round_robin():
    rule = FitRule.average(np.full(9, 0.25), 1.0)
    bins = pack(rule, 1.0, rebalance=False)
    assert np.bincount(bins).tolist() == [4, 4, 1]
    moved = rebalance_last_bin(rule, 1.0, bins)
    assert np.bincount(moved).tolist() == [3, 3, 3]  # one from b0, one from b1, one from b0
    assert moved.tolist() == [0, 0, 0, 2, 1, 1, 1, 2, 2]
    assert pack(rule, 1.0).tolist() == moved.tolist()


def test_rebalancing_stops_after_max_failures_and_keeps_every_bin():
    rule = FitRule.average(np.array([0.9, 0.9, 0.9, 0.2]), 1.0)
    bins = pack(rule, 1.0, rebalance=False)
    assert rebalance_last_bin(rule, 1.0, bins).tolist() == bins.tolist()
