"""The autoscaler's decisions (services/core/autoscale.py): demand per pool, and which
nodes to start, take back, drain and stop."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.autoscale import (
    ALIVE,
    DRAINING,
    STARTING,
    Pool,
    PoolNode,
    active_nodes,
    busy_nodes,
    decide,
    pool_demand,
    waiting_shapes,
)
from services.core.buckets import counts_from_sums
from services.core.limits import LimitLedger, QueueLimits
from services.core.task import TaskSpec

GIB = 1024


def vec(cpu: int, mem: int) -> np.ndarray:
    return np.array([cpu, mem, 0, 0], dtype=np.int64)


SMALL = Pool("small", vec(2000, 4 * GIB), mask=0, low=0, high=10)
GPU = Pool("gpu", vec(8000, 32 * GIB), mask=1 << 3, low=0, high=4)
BIG = Pool("big", vec(16000, 64 * GIB), mask=0, low=0, high=2)


def test_waiting_tasks_go_to_the_cheapest_pool_that_can_run_them():
    shapes = [vec(1000, 1024), vec(1000, 1024), vec(4000, 8 * GIB), vec(32000, 1024)]
    masks = [0, 1 << 3, 0, 0]
    counts = [5, 3, 2, 7]
    demand = pool_demand([BIG, GPU, SMALL], shapes, masks, counts)
    # 5 one-CPU tasks: 2 a small node -> 3 small nodes. 3 that need constraint 3: 8 a
    # gpu node -> 1. 2 four-CPU tasks: too big for small; gpu is cheaper than big, and a
    # node may have a constraint its task does not ask for -> 1 more gpu node.
    assert demand.nodes.tolist() == [0, 2, 3]
    assert demand.tasks.tolist() == [0, 5, 5]
    assert demand.unplaced == 7  # 32 CPUs: no pool holds it


def test_constraints_no_pool_has_leave_tasks_unplaced():
    demand = pool_demand([SMALL], [vec(1000, 1024)], [1 << 5], [4])
    assert demand.nodes.tolist() == [0] and demand.unplaced == 4


def test_a_task_that_asks_for_nothing_of_a_resource_is_counted_by_the_others():
    demand = pool_demand([SMALL], [vec(0, 1024)], [0], [9])
    assert demand.nodes.tolist() == [3]  # 4 a node by memory


def test_no_waiting_tasks_no_demand():
    empty = np.zeros((0, 4), dtype=np.int64)
    assert pool_demand([SMALL, GPU], empty, [], []).nodes.tolist() == [0, 0]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 20_000),
            st.integers(0, 70 * GIB),
            st.sampled_from([0, 1 << 3]),
            st.integers(1, 50),
        ),
        max_size=12,
    )
)
def test_demand_is_a_packing_that_exists_and_never_below_the_fluid_count(rows):
    rows = [r for r in rows if r[0] or r[1]]  # a task asks for something
    pools = [SMALL, GPU, BIG]
    shapes = [vec(c, m) for c, m, _, _ in rows]
    demand = pool_demand(
        pools, np.array(shapes).reshape(-1, 4), [r[2] for r in rows], [r[3] for r in rows]
    )
    caps = np.stack([p.shape for p in pools])
    sums = np.zeros_like(caps)
    given_tasks = np.zeros(len(pools), dtype=np.int64)
    unplaced = 0
    for (_, _, mask, count), shape in zip(rows, shapes, strict=True):
        fits = [
            i for i, p in enumerate(pools) if np.all(shape <= p.shape) and (mask & ~p.mask) == 0
        ]
        if not fits:
            unplaced += count
            continue
        # The cheapest pool: fewer cores first, then less memory.
        pool = min(fits, key=lambda i: tuple(pools[i].shape))
        sums[pool] += shape * count
        given_tasks[pool] += count
        per_node = min(p // s for p, s in zip(pools[pool].shape, shape, strict=True) if s)
        assert per_node >= 1
    assert demand.unplaced == unplaced
    assert demand.tasks.tolist() == given_tasks.tolist()
    fluid = counts_from_sums(sums, caps)
    assert np.all(demand.nodes >= fluid)
    assert np.all((demand.nodes > 0) == (given_tasks > 0))


def node(node_id, state=ALIVE, tasks=0, idle_since=None, slot=None, pool=0, here=True):
    slot = int(node_id.rsplit("-", 1)[-1]) if slot is None else slot
    return PoolNode(node_id, pool, slot, state, tasks, idle_since, here)


POOL = Pool("burst", vec(2000, 4 * GIB), low=1, high=4)


def test_scale_up_starts_the_lowest_free_slots_up_to_max():
    nodes = [node("n-1", tasks=2)]
    out = decide([POOL], nodes, [9], now=100.0, idle_s=30)
    assert out.start == [(0, 0), (0, 2), (0, 3)] and not out.drain and not out.stop


def test_a_node_it_drained_is_taken_back_before_one_is_started():
    nodes = [node("n-0", tasks=1), node("n-1", DRAINING, tasks=1), node("n-2", DRAINING)]
    out = decide([POOL], nodes, [2], now=0.0, idle_s=30)
    assert out.undrain == ["n-1"] and out.start == []
    assert out.stop == ["n-2"]  # still drained, and idle: stopped


def test_a_node_an_operator_drained_is_not_taken_back():
    nodes = [node("n-0", tasks=1), node("n-1", DRAINING, tasks=1, here=False)]
    out = decide([POOL], nodes, [2], now=0.0, idle_s=30)
    assert out.undrain == [] and out.start == [(0, 2)] and out.stop == []


def test_scale_down_drains_only_nodes_idle_long_enough_longest_first():
    nodes = [
        node("n-0", tasks=3),
        node("n-1", idle_since=50.0),
        node("n-2", idle_since=10.0),
        node("n-3", idle_since=90.0),  # idle 10 s only
    ]
    out = decide([POOL], nodes, [1], now=100.0, idle_s=30)
    assert out.drain == ["n-2", "n-1"] and out.start == [] and out.stop == []


def test_min_keeps_idle_nodes_and_starting_ones_are_never_drained():
    nodes = [node("n-0", idle_since=0.0), node("n-1", STARTING)]
    assert decide([POOL], nodes, [0], now=1e6, idle_s=0).drain == ["n-0"]
    assert decide([POOL], nodes[:1], [0], now=1e6, idle_s=0).drain == []  # min 1


@settings(max_examples=300, deadline=None)
@given(
    states=st.lists(
        st.tuples(
            st.sampled_from([STARTING, ALIVE, DRAINING]),
            st.integers(0, 2),
            st.one_of(st.none(), st.floats(0, 100)),
            st.booleans(),
        ),
        max_size=6,
    ),
    target=st.integers(0, 10),
    idle_s=st.floats(0, 100),
)
def test_decisions_respect_bounds_and_never_touch_busy_nodes(states, target, idle_s):
    nodes = [
        PoolNode(f"n-{i}", 0, i, state, tasks, idle if state == ALIVE else None, here)
        for i, (state, tasks, idle, here) in enumerate(states)
    ]
    pool = Pool("p", vec(1000, GIB), low=1, high=6)
    out = decide([pool], nodes, [target], now=100.0, idle_s=idle_s)
    by_id = {n.node_id: n for n in nodes}
    active = int(active_nodes([pool], nodes)[0])
    after = active + len(out.start) + len(out.undrain) - len(out.drain)
    want = min(max(target, pool.low), pool.high)
    if active <= want:  # up: as far as its own drained nodes and free slots allow
        takeable = sum(n.drained_here for n in nodes if n.state == DRAINING)
        assert after == min(want, active + takeable + pool.high - len(nodes))
        assert not out.drain
    else:  # down: only idle nodes, never below the target
        assert not out.start and not out.undrain and want <= after < active + 1
    for node_id in out.drain:
        n = by_id[node_id]
        assert n.state == ALIVE and n.tasks == 0 and 100.0 - n.idle_since >= idle_s
    for node_id in out.stop:
        assert by_id[node_id].state == DRAINING and by_id[node_id].tasks == 0
        assert node_id not in out.undrain
    for node_id in out.undrain:
        assert by_id[node_id].state == DRAINING and by_id[node_id].drained_here
    used = {n.slot for n in nodes}
    assert all(slot not in used and slot < pool.high for _, slot in out.start)
    assert len({slot for _, slot in out.start}) == len(out.start)
    assert busy_nodes([pool], nodes)[0] == sum(n.tasks > 0 for n in nodes)


def spec(task_id: str, cpu: int, mask: int = 0) -> TaskSpec:
    return TaskSpec(task_id=task_id, resources=vec(cpu, 512), constraint_mask=mask)


def test_waiting_shapes_group_a_gms_tasks_and_leave_out_what_a_limit_holds_back():
    research = [spec(f"r{i}", 1000) for i in range(5)] + [spec("g", 1000, 1 << 3)]
    prod = [spec(f"p{i}", 2000) for i in range(3)]
    queues = [("research", research), ("prod", prod)]
    assert waiting_shapes(queues) == [
        ("prod", (2000, 512, 0, 0), 0, 3),
        ("research", (1000, 512, 0, 0), 0, 5),
        ("research", (1000, 512, 0, 0), 8, 1),
    ]
    # research may hold 4 CPUs and holds 1.5: three more of its tasks could run.
    limits = QueueLimits.parse([("research", "cpu=4")])
    ledger = LimitLedger(limits, {"research": vec(1500, 0)})
    assert waiting_shapes(queues, ledger) == [
        ("prod", (2000, 512, 0, 0), 0, 3),
        ("research", (1000, 512, 0, 0), 0, 2),
    ]
