import numpy as np
import pytest

from services.core.constraints import to_mask
from services.core.match import (
    NO_NODE,
    BestFit,
    FirstFit,
    assess,
    candidates,
    make_policy,
    match,
)
from services.core.node_table import NodeTable, bits_from_bools, bools_from_bits
from services.core.resources import resources
from services.core.status import Schedulability
from tests.builders import NODE, set_free_at, task


def table_of(n: int, masks=None, partitions=None, num_partitions=1) -> NodeTable:
    table = NodeTable(num_partitions=num_partitions, num_constraints=21)
    for i in range(n):
        mask = 0 if masks is None else masks[i]
        part = 0 if partitions is None else partitions[i]
        table.add(f"n{i}", NODE, mask, part)
    return table


def test_bit_helpers_round_trip(rng):
    values = rng.random(1003) < 0.3
    bits = bits_from_bools(values)
    assert len(bits) == 1003
    np.testing.assert_array_equal(bools_from_bits(bits), values)
    np.testing.assert_array_equal(bools_from_bits(bits, 8, 500), values[8:500])


def test_first_fit_takes_lowest_row_that_fits():
    table = table_of(5)
    set_free_at(table, np.s_[0, :3], 0)  # rows 0-2 have no cpu left
    assert match(table, task(cpu=500), FirstFit()) == 3


def test_an_exact_fit_is_a_fit():
    table = table_of(2)
    set_free_at(table, np.s_[:, 0], resources(1000, 1024, 0, 0))
    for policy in (FirstFit(), BestFit()):
        assert match(table, task(cpu=1000, mem=1024), policy) == 0


def test_constraints_are_anded():
    masks = [to_mask([1]), to_mask([2]), to_mask([1, 2]), to_mask([1, 2, 3])]
    table = table_of(4, masks)
    assert match(table, task(constraints=(1, 2)), FirstFit()) == 2
    assert match(table, task(constraints=(3,)), FirstFit()) == 3
    assert match(table, task(constraints=(4,)), FirstFit()) == NO_NODE


def test_dead_nodes_and_other_partitions_are_skipped():
    table = table_of(4, partitions=[0, 1, 0, 1], num_partitions=2)
    table.set_alive(0, False)
    assert match(table, task(), FirstFit(), table.members[0]) == 2
    assert match(table, task(), FirstFit(), table.members[1]) == 1


def test_constraint_beyond_table_matches_nothing():
    table = table_of(3)
    assert not candidates(table, 1 << 40).any()


def test_first_fit_finds_a_needle_far_past_the_first_window():
    table = table_of(20_000)
    set_free_at(table, np.s_[0, :], 0)
    set_free_at(table, np.s_[0, 19_999], 4000)
    assert match(table, task(), FirstFit()) == 19_999


def test_best_fit_prefers_the_tightest_node():
    table = table_of(3)
    set_free_at(table, np.s_[:, 0], resources(4000, 8192, 1000, 1000))
    set_free_at(table, np.s_[:, 1], resources(1200, 1500, 1000, 1000))
    set_free_at(table, np.s_[:, 2], resources(3000, 4000, 1000, 1000))
    assert match(table, task(cpu=1000, mem=1024), BestFit()) == 1
    assert match(table, task(cpu=3500, mem=1024), BestFit()) == 0


@pytest.mark.parametrize("policy", [FirstFit(), BestFit()])
def test_policies_agree_with_brute_force(policy, rng):
    n = 3000
    masks = [int(m) for m in rng.integers(0, 1 << 6, n)]
    table = table_of(n, masks)
    set_free_at(table, np.s_[0], rng.integers(0, 4001, n))
    set_free_at(table, np.s_[1], rng.integers(0, 8193, n))
    alive = rng.random(n) < 0.9
    for i in np.flatnonzero(~alive):
        table.set_alive(int(i), False)
    for k in range(200):
        cons = tuple(int(c) for c in rng.choice(6, size=int(rng.integers(0, 3)), replace=False))
        t = task(f"t{k}", int(rng.integers(1, 4001)), int(rng.integers(1, 8193)), cons)
        node = match(table, t, policy)
        fits = [
            i
            for i in range(n)
            if alive[i]
            and masks[i] & t.constraint_mask == t.constraint_mask
            and (table.free[:, i] >= t.resources).all()
        ]
        if not fits:
            assert node == NO_NODE
        else:
            assert node in fits
            if isinstance(policy, FirstFit):
                assert node == fits[0]


def test_make_policy_names_known_policies():
    assert make_policy("best-fit").name == "best-fit"
    with pytest.raises(ValueError, match="unknown placement policy 'magic'"):
        make_policy("magic")


def test_assess_tells_never_from_not_now():
    table = table_of(2, masks=[to_mask([1]), to_mask([2])])
    verdict = assess([table], task(constraints=(5,)))
    assert verdict.schedulability is Schedulability.INFEASIBLE
    assert verdict.reason == "no node has constraint 5"

    verdict = assess([table], task(constraints=(1, 2)))
    assert verdict.schedulability is Schedulability.INFEASIBLE
    assert "constraints 1, 2 together" in verdict.reason
    # with the federation's names for them
    labels = {5: "gpu", 1: "ssd"}
    assert assess([table], task(constraints=(5,)), labels=labels).reason == (
        "no node has constraint 5 (gpu)"
    )
    together = assess([table], task(constraints=(1, 2)), labels=labels).reason
    assert "constraints 1 (ssd), 2 together" in together

    verdict = assess([table], task(cpu=64_000))
    assert verdict.schedulability is Schedulability.INFEASIBLE
    assert "no node is large enough" in verdict.reason and "short of cpu_milli" in verdict.reason

    set_free_at(table, np.s_[1, :], 512)
    verdict = assess([table], task(mem=1024))
    assert verdict.schedulability is Schedulability.UNSCHEDULABLE
    assert "largest free on a matching node: cpu=4 mem=512Mi" in verdict.reason

    table.set_alive(0, False)
    table.set_alive(1, False)
    verdict = assess([table], task(mem=1024))
    assert verdict.schedulability is Schedulability.UNSCHEDULABLE
    assert verdict.reason == "every node that could hold it is dead"

    assert assess([table_of(1)], task()).schedulability is Schedulability.SCHEDULABLE
    verdict = assess([table_of(0)], task())
    assert verdict.schedulability is Schedulability.INFEASIBLE
    assert verdict.reason == "no worker node has registered"
