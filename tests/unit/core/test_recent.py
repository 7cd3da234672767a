import collections
import gc
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.recent import GrowingMap, RecentInts


class Model:
    """What RecentInts must behave as: an OrderedDict cut to its newest ``bound`` keys."""

    def __init__(self, bound: int):
        self.bound = bound
        self.data: collections.OrderedDict[str, int] = collections.OrderedDict()

    def put(self, key: str, value: int) -> None:
        self.data[key] = value
        self.data.move_to_end(key)
        while len(self.data) > self.bound:
            self.data.popitem(last=False)

    def put_max(self, key: str, value: int) -> None:
        if self.data.get(key, -1) <= value:
            self.put(key, value)

    def put_above(self, key: str, value: int) -> bool:
        if self.data.get(key, -1) >= value:
            return False
        self.put(key, value)
        return True


@settings(max_examples=300, deadline=None)
@given(
    bound=st.integers(1, 12),
    generation=st.integers(1, 8),
    puts=st.lists(
        st.tuples(
            st.sampled_from(["put", "put_max", "put_above"]), st.integers(0, 20), st.integers(0, 5)
        ),
        max_size=120,
    ),
)
def test_it_keeps_exactly_what_an_ordered_dict_cut_to_the_bound_keeps(bound, generation, puts):
    recent, model = RecentInts(bound, generation), Model(bound)
    for op, key, value in puts:
        assert getattr(recent, op)(f"t{key}", value) == getattr(model, op)(f"t{key}", value)
        assert len(recent) == len(model.data)
    assert list(recent) == list(model.data)  # same keys, oldest first
    for key in range(21):
        assert recent.get(f"t{key}") == model.data.get(f"t{key}")
        assert (f"t{key}" in recent) == (f"t{key}" in model.data)
    assert recent.get("never", -1) == -1


@settings(max_examples=200, deadline=None)
@given(
    generation=st.integers(1, 6),
    sets=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5)), max_size=100),
)
def test_a_growing_map_holds_what_a_dict_holds(generation, sets):
    grown: GrowingMap[int] = GrowingMap(generation)
    model: dict[str, int] = {}
    for key, value in sets:
        grown[f"t{key}"] = value
        model[f"t{key}"] = value
    assert len(grown) == len(model) and sorted(grown) == sorted(model)
    assert sorted(grown.items()) == sorted(model.items())
    assert sorted(grown.values()) == sorted(model.values())
    for key in range(31):
        assert grown.get(f"t{key}") == model.get(f"t{key}")
        assert (f"t{key}" in grown) == (f"t{key}" in model)
    assert all(len(gen) <= generation for gen in grown._gens)
    with pytest.raises(KeyError):
        grown["never"]


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="bound"):
        RecentInts(0)
    with pytest.raises(ValueError, match="generation"):
        RecentInts(10, generation=0)
    with pytest.raises(ValueError, match="generation"):
        GrowingMap(0)


def test_the_garbage_collector_never_walks_it():
    recent = RecentInts(10_000, generation=1_000)
    for i in range(25_000):
        recent.put(f"task-{i}", i % 3)
    assert len(recent) == 10_000
    assert not any(gc.is_tracked(gen) for gen in recent._gens)


def test_no_put_grows_a_table_bigger_than_a_generation():
    """An OrderedDict of 700,000 entries stalled its LM ~80 ms when it grew; with
    generations of 20,000 no put takes longer than a small table's growth. Timed against
    a plain dict growing to 200,000 in the same process, so a slow machine fails neither."""
    keys = [f"job-{i:08d}/task-{i % 50}" for i in range(200_000)]

    def worst(put) -> float:
        slowest = 0.0
        for key in keys:
            start = time.perf_counter()
            put(key, 1)
            slowest = max(slowest, time.perf_counter() - start)
        return slowest

    plain: dict[str, int] = {}
    one_table = worst(plain.__setitem__)
    generations = one_table
    for _ in range(3):  # a time slice lost to another process is not a table growing
        recent = RecentInts(100_000, generation=20_000)
        generations = min(generations, worst(recent.put))
        assert len(recent) == 100_000
    assert generations < one_table / 2, (generations, one_table)
