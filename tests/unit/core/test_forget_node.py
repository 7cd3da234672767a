"""Forgetting a node that stayed lost (issue #31, item 6): its row is vacated, full states
leave it out, a delta shows it vacant so a GM's view drops it, and the next new node takes
the row; the per-node capacity bound."""

from __future__ import annotations

import numpy as np
import pytest

from services.core.cancels import CancelledJobs
from services.core.cluster_state import ClusterState
from services.core.global_view import GlobalView
from services.core.lm_lifecycle import Lifecycle
from services.core.resources import (
    DEFAULT_MAX_NODE_CAPACITY,
    ResourceError,
    above_bound,
    parse_bound,
    parse_resources,
    resources,
)
from services.core.status import PlacementStatus
from tests.builders import NODE, task


def books(nodes: int = 3) -> ClusterState:
    state = ClusterState("lm-1", ["gm-a", "gm-b"])
    for i in range(nodes):
        state.add_node(f"w{i}", NODE, partition=i % 2)
    return state


def test_only_a_dead_node_holding_nothing_is_forgotten():
    state = books()
    assert not state.forget_node(1)  # alive
    assert state.launch("gm-b", task("t1"), 1).ok
    state.set_alive(1, False)  # its task is released with it
    assert state.forget_node(1)
    assert not state.forget_node(1)  # once
    assert state.table.index_of("w1") is None and state.table.vacant == {1}
    assert state.table.partition_sizes().tolist() == [2, 0]
    # A GM naming the row (a view from before) is told there is no such node.
    refused = state.launch("gm-b", task("t2"), 1)
    assert refused.status is PlacementStatus.REJECTED_UNKNOWN_NODE


def test_views_drop_a_forgotten_node_by_delta_and_by_full_state():
    state = books()
    view = GlobalView("gm-a")
    view.apply(state.snapshot(), now=0.0)
    known = state.version
    state.set_alive(1, False)
    state.forget_node(1)
    full = state.snapshot()
    assert full.nodes.node_ids == ["w0", "w2"] and full.free_indices.tolist() == [0, 2]
    delta = state.snapshot(known)
    assert delta.nodes.node_ids == [""]  # the row, vacant
    view.apply(delta, now=1.0)
    table = view.lms["lm-1"].table
    assert table.index_of("w1") is None and "w1" not in table.node_ids
    assert table.partition_sizes().tolist() == [2, 0]
    fresh = GlobalView("gm-a")
    fresh.apply(full, now=1.0)
    assert fresh.lms["lm-1"].table.node_ids == ["w0", "", "w2"]
    assert fresh.lms["lm-1"].table.partition_sizes().tolist() == [2, 0]


def test_the_next_new_node_takes_the_vacant_row_and_views_see_it():
    state = books()
    view = GlobalView("gm-a")
    view.apply(state.snapshot(), now=0.0)
    state.set_alive(0, False)
    state.forget_node(0)
    view.apply(state.snapshot(view.lms["lm-1"].version), now=1.0)
    known = state.version
    assert state.add_node("w0", resources(cpu_milli=2000, memory_mb=1024)) == 0  # back
    assert state.add_node("w9", NODE) == 3  # no vacant row left: a new one
    assert state.table.vacant == set()
    assert view.apply(state.snapshot(known), now=2.0).name == "APPLIED"
    table = view.lms["lm-1"].table
    assert table.node_ids == ["w0", "w1", "w2", "w9"] and table.vacant == set()
    assert table.capacity[:, 0].tolist() == [2000, 1024, 0, 0]
    assert table.is_alive(0) and table.index_of("w0") == 0


def test_a_lost_node_is_forgettable_after_the_time_unless_it_came_back():
    state = books()
    life = Lifecycle(state, CancelledJobs(), worker_timeout_s=1.0)
    for node in range(3):
        life.heard(node, now=0.0)
    life.node_lost(0, "silent", now=2.0)
    life.node_lost(1, "silent", now=2.0)
    life.node_lost(2, "left")  # no time: never forgettable
    assert life.forgettable(now=5.0, after_s=10.0) == []
    assert life.forgettable(now=13.0, after_s=0) == []  # 0: never
    state.set_alive(1, True)  # it registered again ...
    life.heard(1, now=3.0)  # ... and was heard from
    assert life.forgettable(now=13.0, after_s=10.0) == [0]
    assert life.forget(0)
    assert 0 not in life.last_heard and life.forgettable(now=99.0, after_s=10.0) == []
    assert list(life.silent(now=99.0)) == [1]  # the others are judged as before


def test_the_default_bound_and_overrides():
    bound = parse_bound(DEFAULT_MAX_NODE_CAPACITY)
    assert bound.tolist() == [1_024_000, 16 << 20, 1 << 30, 1_000_000]
    lm = parse_bound("cpu=8", bound)
    assert lm.tolist() == [8000, *bound.tolist()[1:]]
    assert above_bound(parse_resources("cpu=8,mem=16Ti"), lm) == ""
    why = above_bound(resources(cpu_milli=1 << 40, memory_mb=1), lm)
    assert why == "cpu_milli=1099511627776 is above the bound 8000 (cpu=8)"
    with pytest.raises(ResourceError, match="above 0"):
        parse_bound("mem=0")
    assert np.array_equal(parse_bound(""), bound)
