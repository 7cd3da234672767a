"""Resource buckets (Gao 2020, Alg. 1-2): cost-ordered lexicographic comparison, first fit
over the shapes cheapest first, counts rounded up under ideal placement."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from services.core.buckets import (
    UNFIT,
    BucketError,
    assign_buckets,
    compare,
    counts_from_sums,
    describe_unfit,
    embed,
    increasing_order,
)

GI = 1024
# Node shapes given out of cost order on purpose: 16 cores, 4 cores, 64 cores.
SHAPES = np.array(
    [[16000, 64 * GI, 0, 0], [4000, 16 * GI, 0, 0], [64000, 256 * GI, 0, 0]], dtype=np.int64
)


def test_alg1_the_costliest_dimension_decides_first():
    # 2 cores + 64 GiB is cheaper than 4 cores + 1 GiB: cores are compared first.
    assert compare([2000, 64 * GI, 0, 0], [4000, GI, 0, 0]) == -1
    assert compare([4000, GI, 0, 0], [2000, 64 * GI, 0, 0]) == 1
    # equal cores: memory decides; all equal: a tie
    assert compare([4000, GI, 0, 0], [4000, 2 * GI, 0, 0]) == -1
    assert compare([4000, GI, 5, 0], [4000, GI, 5, 0]) == 0
    # with memory declared the costlier dimension, the order flips
    assert compare([2000, 64 * GI, 0, 0], [4000, GI, 0, 0], cost_order=(1, 0, 2, 3)) == 1


def test_alg1_sorts_shapes_cheapest_first():
    assert increasing_order(SHAPES).tolist() == [1, 0, 2]
    with pytest.raises(BucketError, match="permutation"):
        increasing_order(SHAPES, cost_order=(0, 0, 1, 2))


def test_alg2_each_task_goes_to_the_cheapest_shape_that_holds_it():
    tasks = [
        [500, GI, 0, 0],  # fits all three: the 4-core shape
        [4000, 16 * GI, 0, 0],  # exactly the 4-core shape
        [2000, 32 * GI, 0, 0],  # few cores but more memory than 4/16: the 16-core shape
        [20000, GI, 0, 0],  # more cores than 16: the 64-core shape
    ]
    bucket, units = assign_buckets(tasks, SHAPES)
    assert bucket.tolist() == [1, 1, 0, 2]  # indices into SHAPES as given
    assert units.tolist() == [1, 1, 1, 1]


def test_alg2_a_task_larger_than_every_shape_spans_whole_nodes_rounded_up():
    bucket, units = assign_buckets([[130000, 100 * GI, 0, 0]], SHAPES)
    assert bucket.tolist() == [2] and units.tolist() == [3]  # ceil(130 / 64) = 3 nodes


def test_a_task_asking_for_a_dimension_no_shape_offers_fits_nowhere_and_says_why():
    task = [1000, GI, 0, 100]
    result = embed([[1000, GI, 0, 0], task], SHAPES)
    assert result.bucket.tolist() == [1, UNFIT] and result.unfit.tolist() == [1]
    assert result.counts.tolist() == [0, 1, 0]  # the unfit task is not counted anywhere
    assert describe_unfit(task, SHAPES) == "task asks for net_mbps=100 but no bucket offers it"


def test_counts_round_up_the_summed_demand_per_dimension():
    # five 1-core/8-GiB tasks in the 4-core/16-GiB shape: 5 cores -> 2 nodes, but
    # 40 GiB -> 3 nodes; memory binds, so 3.
    result = embed([[1000, 8 * GI, 0, 0]] * 5, SHAPES)
    assert result.counts.tolist() == [0, 3, 0]
    # exact multiples do not round up
    assert embed([[1000, 4 * GI, 0, 0]] * 8, SHAPES).counts.tolist() == [0, 2, 0]
    assert embed(np.zeros((0, 4), dtype=np.int64), SHAPES).counts.tolist() == [0, 0, 0]


def test_counts_for_a_whole_series_at_once():
    sums = np.zeros((2, 3, 4), dtype=np.int64)
    sums[0, 1] = [8000, 16 * GI, 0, 0]
    sums[1, 2] = [64001, GI, 0, 0]
    assert counts_from_sums(sums, SHAPES).tolist() == [[0, 2, 0], [0, 0, 2]]


def test_bad_shapes_and_tasks_are_refused_with_a_reason():
    with pytest.raises(BucketError, match="need at least one bucket"):
        assign_buckets([[1, 1, 0, 0]], np.zeros((0, 4)))
    with pytest.raises(BucketError, match="every quantity zero"):
        assign_buckets([[1, 1, 0, 0]], [[0, 0, 0, 0]])
    with pytest.raises(BucketError, match="negative"):
        assign_buckets([[-1, 1, 0, 0]], SHAPES)


vectors = hnp.arrays(
    np.int64, st.tuples(st.integers(0, 40), st.just(4)), elements=st.integers(0, 70_000)
)
shapes = hnp.arrays(
    np.int64, st.tuples(st.integers(1, 5), st.just(4)), elements=st.integers(0, 70_000)
).filter(lambda s: bool(np.all(s.sum(axis=1) > 0)))


@settings(max_examples=150, deadline=None)
@given(tasks=vectors, buckets=shapes)
def test_every_embedded_task_fits_its_bucket_and_counts_cover_the_demand(tasks, buckets):
    result = embed(tasks, buckets)
    assert np.all(result.counts >= 0)
    order = increasing_order(buckets).tolist()
    for task, b, units in zip(tasks, result.bucket, result.units, strict=True):
        if b == UNFIT:
            # nothing holds it: no shape offers every dimension it needs (not even spread
            # over several nodes of one shape)
            needs = task > 0
            assert not np.any(np.all(~needs | (buckets > 0), axis=1))
            continue
        assert units >= 1 and np.all(task <= units * buckets[b])
        if units == 1:  # no cheaper shape would have held it
            for cheaper in order[: order.index(b)]:
                assert not np.all(task <= buckets[cheaper])
        else:
            assert not np.any(np.all(task <= buckets, axis=1))
    for b in range(len(buckets)):
        demand = tasks[result.bucket == b].sum(axis=0)
        assert np.all(demand <= result.counts[b] * buckets[b])  # enough nodes
        if result.counts[b] > 0:  # and not one too many
            assert np.any(demand > (result.counts[b] - 1) * buckets[b])


small_vectors = st.lists(st.integers(0, 9), min_size=4, max_size=4)


@given(a=small_vectors, b=small_vectors, perm=st.permutations(range(4)))
def test_alg1_is_tuple_order_on_the_cost_ordered_dimensions(a, b, perm):
    key_a, key_b = [a[d] for d in perm], [b[d] for d in perm]
    expected = (key_a > key_b) - (key_a < key_b)
    assert compare(a, b, perm) == expected
    assert compare(b, a, perm) == -expected
