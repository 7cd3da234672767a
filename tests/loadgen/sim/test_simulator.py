"""The in-process simulator: deterministic, exactly-once, and as the paper describes it."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.sim.config import SimConfig, SimConfigError
from loadgen.sim.run import WALL_KEYS, simulate
from loadgen.trace import TraceJob, TraceTask

DELAY_S = 0.0005


def jobs(count: int = 40, tasks: int = 20, gap_s: float = 0.5, duration_s: float = 2.0):
    rng = np.random.default_rng(7)
    return [
        TraceJob(
            f"j{j}",
            j * gap_s,
            tuple(TraceTask(float(d)) for d in rng.uniform(0.5, duration_s, size=tasks)),
        )
        for j in range(count)
    ]


def comparable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in WALL_KEYS}


@pytest.mark.parametrize("scheduler", ["megha", "sparrow", "central"])
def test_same_seed_same_run(scheduler):
    config = SimConfig(scheduler=scheduler, workers=200, gms=4, lms=4, seed=3)
    first = simulate(config, jobs())
    second = simulate(config, jobs())
    assert comparable(first.summary) == comparable(second.summary)
    for name, values in first.log.stamps.items():
        assert np.array_equal(values, second.log.stamps[name]), name


@pytest.mark.parametrize("scheduler", ["megha", "sparrow", "central"])
def test_every_task_runs_once_and_no_sooner_than_the_messages_allow(scheduler):
    result = simulate(SimConfig(scheduler=scheduler, workers=100, gms=2, lms=2), jobs())
    s = result.summary
    assert s["completed"] == s["tasks"] == 800
    alloc = result.alloc_values_s()
    assert alloc.size == 800
    # Megha: GM -> LM -> worker; Sparrow: probe -> worker -> late-binding reply -> task.
    assert alloc.min() >= 2 * DELAY_S - 1e-12
    stamps = result.log.stamps
    assert np.all(stamps["finished"] >= stamps["started"])


def test_workers_never_hold_more_tasks_than_cores():
    # A overloaded cluster: 20 one-core workers, 800 tasks arriving fast.
    result = simulate(SimConfig(workers=20, gms=2, lms=2), jobs(gap_s=0.05))
    stamps = result.log.stamps
    node = result.log.lm.astype(np.int64) * 1_000_000 + result.log.node  # LM-local indices
    starts, ends = stamps["started"], stamps["finished"]
    for w in np.unique(node):
        mine = np.flatnonzero(node == w)
        order = mine[np.argsort(starts[mine])]
        # one core each: a task starts only after the node's previous task ended
        assert np.all(starts[order][1:] >= ends[order][:-1]), f"worker {w} over-committed"
    assert result.summary["completed"] == 800


def test_megha_tail_beats_sparrow_under_load():
    # Short, bursty jobs on a small cluster: Sparrow's random probes queue behind long
    # tasks, Megha's GMs know where the free nodes are.
    burst = jobs(count=30, tasks=40, gap_s=1.0, duration_s=4.0)
    megha = simulate(SimConfig(workers=400, gms=4, lms=4), burst).summary
    sparrow = simulate(SimConfig(scheduler="sparrow", workers=400), burst).summary
    assert megha["alloc_s"]["p99"] < sparrow["alloc_s"]["p99"]


def test_constrained_tasks_land_only_on_machines_that_satisfy_them():
    masks = np.zeros(40, dtype=np.uint64)
    masks[::4] = 0b10  # every fourth machine has constraint 1
    constrained = [
        TraceJob(f"j{j}", j * 0.2, tuple(TraceTask(1.0, constraints=(1,)) for _ in range(5)))
        for j in range(10)
    ]
    result = simulate(SimConfig(workers=40, gms=2, lms=2), constrained, machine_masks=masks)
    assert result.summary["completed"] == 50
    # LM-local node indices: 2 LMs of 20 nodes, so worker w is node w % 20 of LM w // 20
    workers = result.log.lm.astype(np.int64) * 20 + result.log.node
    assert set(np.unique(workers) % 4) == {0}


def test_a_task_no_machine_can_hold_is_reported_infeasible_not_waited_for():
    big = [TraceJob("j0", 0.0, (TraceTask(1.0, cpu_milli=8000), TraceTask(1.0)))]
    result = simulate(SimConfig(workers=10, gms=1, lms=1), big)
    assert result.summary["infeasible"] == 1
    assert result.summary["completed"] == 1


def test_heartbeat_staleness_shows_as_inconsistencies_not_as_double_booking():
    # A slow heartbeat and owner-only finish notices: GMs often think busy nodes are free.
    config = SimConfig(workers=50, gms=5, lms=2, heartbeat_interval_s=30, finish_notify="none")
    result = simulate(config, jobs(gap_s=0.1))
    assert result.summary["completed"] == 800
    assert result.summary["inconsistencies"] > 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("workers", 0), ("gms", 0), ("network_delay_s", -1.0), ("scheduler", "yarn")],
)
def test_bad_parameters_are_refused_with_the_reason(field, value):
    with pytest.raises(SimConfigError, match=field if field != "scheduler" else "scheduler"):
        simulate(SimConfig(**{field: value}), jobs(count=1))
