"""Invariants that must hold for any sequence of operations (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.core.cluster_state import ClusterState
from services.core.global_view import ApplyResult, GlobalView
from services.core.match import NO_NODE, BestFit, FirstFit, match
from services.core.node_table import NodeTable
from services.core.resources import resources
from services.core.task import TaskSpec
from tests.builders import set_free_at

GMS = ("gm-a", "gm-b")
NUM_CONSTRAINTS = 6

masks = st.integers(0, (1 << NUM_CONSTRAINTS) - 1)
small_masks = st.sampled_from([0, 1, 2, 3, 4, 5, 8, 12])
cpus = st.integers(1, 4000)
mems = st.integers(0, 8192)
capacities = st.tuples(st.integers(500, 4000), st.integers(256, 8192))


def make_task(task_id: str, cpu: int, mem: int, mask: int, attempt: int = 0, queue="q") -> TaskSpec:
    return TaskSpec(task_id, resources(cpu, mem), mask, queue=queue, attempt=attempt)


class LocalMasterMachine(RuleBasedStateMachine):
    """Random launches, repartitions, preemptions, releases and node deaths on one LM,
    with a GM view that hears a random subset of the LM's deltas."""

    def __init__(self) -> None:
        super().__init__()
        self.state = ClusterState("lm", GMS, num_constraints=NUM_CONSTRAINTS)
        self.view = GlobalView("gm-a", num_constraints=NUM_CONSTRAINTS)
        self.heard = -1
        self.next_task = 0
        self.attempts: dict[str, int] = {}

    @rule(cap=capacities, mask=masks, partition=st.integers(0, 1))
    def add_node(self, cap, mask, partition):
        if self.state.table.size < 12:
            self.state.add_node(f"w{self.state.table.size}", resources(*cap), mask, partition)

    @precondition(lambda self: self.state.table.size > 0)
    @rule(
        data=st.data(),
        cpu=cpus,
        mem=mems,
        mask=small_masks,
        gm=st.sampled_from(GMS),
        kind=st.sampled_from(["launch", "repartition"]),
    )
    def place(self, data, cpu, mem, mask, gm, kind):
        node = data.draw(st.integers(0, self.state.table.size - 1))
        task_id = f"t{self.next_task}"
        self.next_task += 1
        t = make_task(task_id, cpu, mem, mask)
        free_before = self.state.table.free.copy()
        decision = getattr(self.state, kind)(gm, t, node)
        if decision.ok:
            expected = free_before[:, node] - t.resources
            assert (self.state.table.free[:, node] == expected).all()
            assert self.state.table.satisfies(node, mask)
            # the same request again changes nothing
            version, free = self.state.version, self.state.table.free.copy()
            again = getattr(self.state, kind)(gm, t, node)
            assert again.ok and again.allocation is decision.allocation
            assert self.state.version == version and (self.state.table.free == free).all()
        else:
            assert (self.state.table.free == free_before).all()

    @precondition(lambda self: self.state.allocations)
    @rule(data=st.data())
    def release(self, data):
        task_id = data.draw(st.sampled_from(sorted(self.state.allocations)))
        allocation = self.state.allocations[task_id]
        before = self.state.table.free[:, allocation.node].copy()
        self.state.release(task_id)
        assert (self.state.table.free[:, allocation.node] == before + allocation.resources).all()
        assert self.state.release(task_id) is None

    @precondition(lambda self: self.state.allocations)
    @rule(data=st.data(), cpu=cpus, mem=mems)
    def preempt(self, data, cpu, mem):
        victim_id = data.draw(st.sampled_from(sorted(self.state.allocations)))
        node = self.state.allocations[victim_id].node
        t = make_task(f"p{self.next_task}", cpu, mem, 0, queue="small")
        self.next_task += 1
        decision = self.state.preempt("gm-a", t, node, [victim_id], lambda q: True)
        if decision.ok:
            assert victim_id not in self.state.allocations
            assert self.state.allocations[t.task_id].node == node

    @precondition(lambda self: self.state.table.size > 0)
    @rule(data=st.data(), alive=st.booleans())
    def set_alive(self, data, alive):
        node = data.draw(st.integers(0, self.state.table.size - 1))
        lost = self.state.set_alive(node, alive)
        assert all(a.node == node for a in lost)
        assert not any(a.node == node for a in self.state.allocations.values()) or alive

    @rule(full=st.booleans())
    def heartbeat(self, full):
        since = None if full or self.heard < 0 else self.heard
        result = self.view.apply(self.state.snapshot(since_version=since), now=0.0)
        assert result in (ApplyResult.APPLIED, ApplyResult.STALE)
        self.heard = self.state.version
        lmv = self.view.lms["lm"]
        assert (lmv.table.free == self.state.table.free).all()
        assert set(lmv.allocations) == set(self.state.allocations)
        assert lmv.table.alive == self.state.table.alive

    @invariant()
    def never_over_committed(self):
        table = self.state.table
        assert (table.free >= 0).all()
        held = np.zeros_like(table.capacity)
        for a in self.state.allocations.values():
            held[:, a.node] += a.resources
            assert table.is_alive(a.node)
        assert (table.free == table.capacity - held).all()


TestLocalMaster = LocalMasterMachine.TestCase
TestLocalMaster.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


@st.composite
def tables(draw):
    n = draw(st.integers(1, 300))
    table = NodeTable(num_partitions=2, num_constraints=NUM_CONSTRAINTS)
    for i in range(n):
        table.add(f"n{i}", resources(4000, 8192), draw(masks), draw(st.integers(0, 1)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # Coarse steps make "free exactly equals the request" common: the boundary case.
    set_free_at(table, np.s_[0], rng.integers(0, 9, n) * 500)
    set_free_at(table, np.s_[1], rng.integers(0, 9, n) * 1024)
    for i in np.flatnonzero(rng.random(n) < 0.2):
        table.set_alive(int(i), False)
    return table


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    table=tables(),
    cpu=st.integers(1, 8),
    mem=st.integers(0, 8),
    mask=masks,
    partition=st.sampled_from([None, 0, 1]),
    policy=st.sampled_from([FirstFit(), BestFit()]),
)
def test_match_finds_a_node_iff_brute_force_does(table, cpu, mem, mask, partition, policy):
    t = make_task("t", cpu * 500, mem * 1024, mask)
    within = None if partition is None else table.members[partition]
    node = match(table, t, policy, within)
    brute = [
        i
        for i in range(table.size)
        if table.is_alive(i)
        and (partition is None or table.owner[i] == partition)
        and table.satisfies(i, mask)
        and (table.free[:, i] >= t.resources).all()
    ]
    assert (node != NO_NODE) == bool(brute)
    if brute:
        assert node in brute
        assert table.satisfies(node, mask)
        if isinstance(policy, FirstFit):
            assert node == brute[0]


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "take", "give_back", "set_free", "delta", "vacate", "columns"]),
            st.integers(0, 7),
            st.integers(0, 4000),
        ),
        max_size=40,
    )
)
def test_has_cpu_is_always_the_nodes_with_cpu_free(ops):
    """``NodeTable.has_cpu`` (what matching ANDs in first) is ``free[CPU] > 0`` after any
    sequence of the table's mutators, a GM view's (snapshot columns) and an LM's alike."""
    table = NodeTable(num_partitions=2, num_constraints=2)
    for n in range(12 if ops and ops[0][1] % 2 else 0):  # big enough for deltas of one row
        table.add(f"pre{n}", resources(1000 * (n % 3), 1024), 0, n % 2)
    for step, (op, k, amount) in enumerate(ops):
        node = k % table.size if table.size else None
        if op == "add" or node is None:
            table.add(f"n{step}", resources(amount, 1024), 0, k % 2)
        elif op == "take":
            table.take(node, resources(amount, 0), 0.0, 0.0)
        elif op == "give_back":
            table.give_back(node, resources(amount, 0), 0.0, 0.0)
        elif op == "set_free":
            set_free_at(table, np.s_[0, node], amount - 2000)
        elif op == "delta":  # a heartbeat's delta: one row (the table's only, or a few)
            column = table.free[:, [node]].copy()
            column[0, 0] = amount - 2000
            table.set_free(np.array([node]), column, np.zeros(1), np.zeros(1))
        elif op == "vacate":
            table.vacate(node)
        else:  # a snapshot's columns of a node, as a GM's view applies them
            table.set_columns(table.columns([node]))
        np.testing.assert_array_equal(
            np.array(table.has_cpu.tolist(), dtype=bool), table.free[0] > 0
        )
