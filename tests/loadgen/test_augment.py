"""Augmentation: Sharma constraints, Gridiron bandwidth, resource scaling."""

import numpy as np
import pytest

from loadgen.augment import (
    MACHINE_PROBABILITIES,
    NUM_CONSTRAINTS,
    ConstraintReport,
    cores_per_task,
    gridiron_bandwidth,
    machine_constraints,
    sample_task_masks,
    satisfiable,
    scale_resources,
    sharma_constraints,
    task_constraint_frequencies,
    vdc_sizes,
    vlink_cap_mbps,
)
from loadgen.trace import TraceJob, TraceTask


def make_jobs(sizes, cpu_milli=1000, memory_mb=0):
    task = TraceTask(duration_s=1.0, cpu_milli=cpu_milli, memory_mb=memory_mb)
    return [
        TraceJob(job_id=f"j{i}", arrival_s=float(i), tasks=(task,) * n) for i, n in enumerate(sizes)
    ]


def bit_frequencies(masks):
    bits = (masks[:, None] >> np.arange(NUM_CONSTRAINTS, dtype=np.uint64)) & np.uint64(1)
    return bits.mean(axis=0)


# --- Sharma constraints -----------------------------------------------------------------


def test_task_constraint_frequencies_match_the_table():
    masks = sample_task_masks(40_000, np.random.default_rng(11))
    assert np.abs(bit_frequencies(masks) - task_constraint_frequencies()).max() < 0.015


@pytest.mark.parametrize("cluster", ["A", "B", "C"])
def test_machine_probabilities_match_the_table(cluster):
    masks = machine_constraints(20_000, cluster, np.random.default_rng(5))
    assert masks.dtype == np.uint64 and len(masks) == 20_000
    expected = MACHINE_PROBABILITIES[cluster]
    assert np.abs(bit_frequencies(masks) - expected).max() < 0.015


def test_cluster_b_is_more_constrained_than_c_and_c_than_a():
    a, b, c = (MACHINE_PROBABILITIES[k] for k in "ABC")
    assert (b <= c).all() and (c <= a).all() and a.shape == (NUM_CONSTRAINTS,)


def test_same_seed_same_constraints_other_seed_other_constraints():
    jobs = make_jobs([5, 40, 1])
    first = sharma_constraints(jobs, "C", np.random.default_rng(3))
    assert first == sharma_constraints(jobs, "C", np.random.default_rng(3))
    assert first != sharma_constraints(jobs, "C", np.random.default_rng(4))
    assert all(t.constraints == () for j in jobs for t in j.tasks)  # input untouched
    assert [len(j.tasks) for j in first] == [5, 40, 1]


def test_every_task_is_placeable_on_the_given_machines():
    rng = np.random.default_rng(8)
    machines = machine_constraints(40, "B", rng)  # a tiny, heterogeneous cluster
    report = ConstraintReport()
    jobs = sharma_constraints(make_jobs([500] * 4), "B", rng, machines=machines, report=report)
    masks = np.array(
        [sum(1 << c for c in t.constraints) for j in jobs for t in j.tasks], dtype=np.uint64
    )
    assert satisfiable(masks, machines).all()
    assert report.tasks == 2000 and report.machines == 40
    assert report.unsatisfiable > 0  # this cluster is small enough to need repairs
    assert report.redrawn + report.trimmed == report.unsatisfiable
    assert "2000 tasks against 40 machines" in report.render()


def test_frequencies_hold_after_repair_at_the_default_cluster_size():
    report = ConstraintReport()
    jobs = sharma_constraints(make_jobs([1000] * 20), "C", np.random.default_rng(2), report=report)
    masks = np.array(
        [sum(1 << c for c in t.constraints) for j in jobs for t in j.tasks], dtype=np.uint64
    )
    assert report.machines == 10_000 and report.trimmed == 0
    assert np.abs(bit_frequencies(masks) - task_constraint_frequencies()).max() < 0.015


def test_unknown_cluster_is_refused():
    with pytest.raises(ValueError, match="unknown Sharma cluster 'D'"):
        machine_constraints(10, "D", np.random.default_rng(1))


# --- Gridiron ------------------------------------------------------------------------------


def test_vlink_cap_for_30_member_vdcs_and_a_40_gbps_uplink_is_177():
    assert vlink_cap_mbps(30, 40_000) == 177
    assert vlink_cap_mbps() == 177


def test_rolling_overflow_never_exceeds_the_peak_vdc_size():
    assert vdc_sizes(65, 30) == [30, 30, 5]
    assert vdc_sizes(30, 30) == [30]
    for n in range(0, 200, 7):
        for peak in (2, 3, 10, 30):
            sizes = vdc_sizes(n, peak)
            assert sum(sizes) == n and all(0 < s <= peak for s in sizes)


def test_net_demand_sums_capped_vlinks_to_the_other_vdc_members():
    jobs = make_jobs([65])
    out = gridiron_bandwidth(jobs, bpc_mbps_per_core=100)
    demand = [t.net_mbps for t in out[0].tasks]
    assert demand == [29 * 100] * 60 + [4 * 100] * 5
    capped = gridiron_bandwidth(jobs, bpc_mbps_per_core=1000)  # 1000 per vlink > the cap
    assert {t.net_mbps for t in capped[0].tasks[:60]} == {29 * 177}


def test_vlink_follows_the_smaller_end():
    tasks = (TraceTask(1.0, cpu_milli=1000), TraceTask(1.0, cpu_milli=4000))
    tasks += (TraceTask(1.0, cpu_milli=500),)
    out = gridiron_bandwidth([TraceJob("d", 0.0, tasks)], bpc_mbps_per_core=10)
    # pairs: (1,4) -> 10, (1,0.5) -> 5, (4,0.5) -> 5
    assert [t.net_mbps for t in out[0].tasks] == [15, 15, 10]


def test_single_task_vdc_needs_no_network_and_caps_hold_for_any_bpc(rng):
    assert gridiron_bandwidth(make_jobs([1]), 50)[0].tasks[0].net_mbps == 0
    for _ in range(20):
        peak = int(rng.integers(2, 40))
        cap = vlink_cap_mbps(peak, 40_000)
        cores = rng.integers(1, 64, size=int(rng.integers(1, 120))) * 250
        job = TraceJob("d", 0.0, tuple(TraceTask(1.0, cpu_milli=int(c)) for c in cores))
        out = gridiron_bandwidth([job], float(rng.uniform(0, 500)), peak_vdc=peak)
        assert all(t.net_mbps <= (peak - 1) * cap for t in out[0].tasks)


# --- scaling --------------------------------------------------------------------------------


def test_scaling_rounds_up_and_never_zeroes_a_request():
    tasks = (
        TraceTask(1.0, cpu_milli=1000, memory_mb=120),
        TraceTask(1.0, cpu_milli=1, memory_mb=1),
        TraceTask(1.0, cpu_milli=800, memory_mb=0),
    )
    out = scale_resources([TraceJob("j", 0.0, tasks)])
    assert [(t.cpu_milli, t.memory_mb) for t in out[0].tasks] == [(3, 3), (1, 1), (2, 0)]
    assert tasks[0].cpu_milli == 1000  # input untouched


def test_cores_per_task_sets_every_request():
    out = cores_per_task(make_jobs([3, 2]), 2500)
    assert {t.cpu_milli for j in out for t in j.tasks} == {2500}
    with pytest.raises(ValueError):
        cores_per_task(make_jobs([1]), 0)
