"""Issue 33 item 3: ``megha-loadgen experiment gridiron`` on a tiny trace."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen import experiment_gridiron as gridiron
from loadgen.augment import gridiron_bandwidth
from loadgen.experiment import EXPERIMENTS
from loadgen.sim.config import SimConfig
from loadgen.sim.run import simulate
from loadgen.synth_azure import synth_vmtable
from loadgen.trace import TraceJob, TraceTask

# 1-core tasks, bpc 100: a job of 12 asks 11 x 100 = 1,100 Mbit/s per task (more than a
# 1,000 Mbit/s uplink) but fits one 16-core node whole, where its vlinks never leave
# the node; a job of 30 fits no node whole, and alone on a node a member still needs
# 2,900 Mbit/s. On 16 nodes it still fits at 10,000 Mbit/s, 3 members a node (on 8 it would
# not: a gang needs all 30 at once, 4 on a node carry 10,400 Mbit/s).
SIZES = (5, 12, 30, 3)
SMALL = (
    gridiron.TraceSetup("yahoo", workers=16, cores_per_worker=16, memory_per_worker_mb=4096),
    gridiron.TraceSetup(
        "azure", workers=8, cores_per_worker=32, memory_per_worker_mb=256 * 1024, fmt="azure"
    ),
)


def tiny_tr(path):
    # arrival, tasks, mean duration, then every task's duration
    lines = [f"{j * 5.0} {n} 10.0 " + " ".join(["10.0"] * n) for j, n in enumerate(SIZES)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_vdc_of_splits_jobs_in_task_order():
    vdc, job = gridiron.vdc_of(np.array([0, 5, 65, 66]), peak_vdc=30)
    assert vdc.tolist() == [0] * 5 + [1] * 30 + [2] * 30 + [3]
    assert job.tolist() == [0, 1, 1, 2]


@pytest.mark.slow  # run apart by .ci/run (MEGHA_SLOW_TESTS=1): the default suite's budget
def test_gridiron_experiment_on_a_tiny_trace(tmp_path):
    assert EXPERIMENTS["gridiron"].plot == "gridiron"
    azure = synth_vmtable(tmp_path / "vmtable.csv", deployments=6, seed=1)
    assert azure.read_text() == synth_vmtable(tmp_path / "again.csv", 6, seed=1).read_text()
    runs, labels = gridiron.run(
        tmp_path / "out",
        tiny_tr(tmp_path / "tiny.tr"),
        azure,
        progress=False,
        uplinks=(1_000, 10_000),
        traces=SMALL,
    )
    assert labels == [
        gridiron.label(t, m, u)
        for t in ("yahoo", "azure")
        for u in (1_000, 10_000)
        for m in gridiron.MODES
    ]
    by = {r.label: r.summary for r in runs}
    g = {name: s["gridiron"] for name, s in by.items()}
    # Per-task: the jobs of 12 and 30 never run at 1,000 Mbit/s; VDC-aware: only the 30.
    assert g["yahoo-pertask-1g"]["vdcs_infeasible"] == 2
    assert g["yahoo-vdc-1g"]["vdcs_infeasible"] == 1
    assert g["yahoo-vdc-1g"]["vdcs_admitted"] == 3 > g["yahoo-pertask-1g"]["vdcs_admitted"]
    # Colocated whole, the admitted VDCs book no uplink; per-task books the worst case.
    assert by["yahoo-vdc-1g"]["uplink"]["utilisation"] == 0
    assert by["yahoo-pertask-1g"]["uplink"]["utilisation"] > 0
    for mode in gridiron.MODES:
        s = g[f"yahoo-{mode}-10g"]
        assert s["vdcs_infeasible"] == 0 and s["vdcs_admitted"] == s["vdcs"] == 4
        assert s["jobs_completed"] == 4
        assert s["vdc_alloc_s"]["p99"] >= s["vdc_alloc_s"]["p50"] > 0
    for name, s in by.items():
        u = s["uplink"]
        assert 0 <= u["utilisation"] <= u["peak_utilisation"] <= 1, name
    table = gridiron.markdown_table(runs)
    assert table.count("\n") == 2 + len(labels) - 1
    verdicts = gridiron.verdicts(runs)
    assert len(verdicts) == 4
    assert verdicts[0].startswith("yahoo at 1,000 Mbit/s: VDC-aware admitted 3 VDCs, per-task 2")
    plot = gridiron.plot(runs, tmp_path / "g.png", "tiny")
    assert plot is not None and plot.stat().st_size > 0


def test_uplink_use_is_booked_net_mbps_over_capacity_time_weighted():
    # Two 1-core tasks of one VDC, 10 s each, 100 Mbit/s vlink: each books 100 per-task;
    # on 2 workers of 1,000 Mbit/s that is 200 of 2,000 for (nearly) the whole run.
    jobs = [TraceJob("j", 0.0, (TraceTask(10.0), TraceTask(10.0)))]
    jobs = gridiron_bandwidth(jobs, 100.0, 30, 40_000.0)
    result = simulate(SimConfig(workers=2, gms=1, lms=1, uplink_mbps=1_000), jobs)
    u = result.summary["uplink"]
    assert u["capacity_mbps"] == 2_000 and u["peak_utilisation"] == 0.1
    assert u["booked_mbps_s"] == 2_000.0
    assert 0.0999 < u["utilisation"] < 0.1
    # Without an uplink nothing is measured (runs without --gridiron are unchanged).
    plain = simulate(SimConfig(workers=2, gms=1, lms=1), [TraceJob("j", 0.0, (TraceTask(1.0),))])
    assert "uplink" not in plain.summary
