"""``megha-loadgen replay`` against a live federation: same report as the simulator's."""

from __future__ import annotations

import json

import pytest

from loadgen import report
from loadgen.replay import replay_jobs, write_report
from loadgen.sim.config import SimConfig
from loadgen.sim.run import simulate
from loadgen.sim.run import write_report as write_sim_report
from loadgen.trace import TraceJob, TraceTask
from tests.integration.harness import Federation

pytestmark = pytest.mark.integration


def small_trace() -> list[TraceJob]:
    return [
        TraceJob(f"j{j}", j * 2.0, tuple(TraceTask(1.0 + (t % 3)) for t in range(10)))
        for j in range(12)
    ]


async def test_replay_completes_every_task_and_writes_the_simulators_report(tmp_path):
    (tmp_path / "fed").mkdir()
    async with Federation(tmp_path / "fed", workers_per_lm=4) as fed:
        gms = [gm.target for gm in fed.config.gms]
        result = await replay_jobs(small_trace(), gms, speedup=20.0, timeout_s=60)
        live = result.summary
        assert live["completed"] == live["tasks"] == 120
        assert live["duplicates"] == 0
        assert live["target"] == "live" and live["gms"] == 2 and live["lms"] == 3
        assert live["workers"] == 12
        assert 0 < live["alloc_s"]["p50"] <= live["alloc_s"]["p99"] < 5
        # the trace's 22 s of arrivals, compressed 20x: about 1.1 s, not 22 s
        assert live["wall_s"] < 15
        files = write_report(tmp_path / "live", result)
    sim = simulate(SimConfig(workers=12, gms=2, lms=3), small_trace())
    write_sim_report(tmp_path / "sim", sim)
    live_keys = json.loads((tmp_path / "live" / report.SUMMARY_FILE).read_text()).keys()
    sim_keys = json.loads((tmp_path / "sim" / report.SUMMARY_FILE).read_text()).keys()
    assert list(report.SUMMARY_KEYS) == list(live_keys)[: len(report.SUMMARY_KEYS)]
    assert list(report.SUMMARY_KEYS) == list(sim_keys)[: len(report.SUMMARY_KEYS)]
    header = (tmp_path / "live" / report.TASKS_FILE).read_text().splitlines()[0]
    assert header == (tmp_path / "sim" / report.TASKS_FILE).read_text().splitlines()[0]
    assert {p.name for p in files} == {report.SUMMARY_FILE, report.TASKS_FILE, report.CDF_FILE}
