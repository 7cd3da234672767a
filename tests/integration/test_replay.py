"""``megha-loadgen replay`` against a live federation: same report as the simulator's."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from loadgen import report
from loadgen.replay import replay_jobs, write_report
from loadgen.sim.config import SimConfig
from loadgen.sim.run import simulate
from loadgen.sim.run import write_report as write_sim_report
from loadgen.trace import TraceJob, TraceTask
from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, sim_tasks

pytestmark = pytest.mark.integration

SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED


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


async def test_a_job_submitted_to_a_gm_that_does_not_serve_its_queue_is_followed_there(tmp_path):
    # q1 is scheduled by gm-1; the user talks to gm-2 only, and must still see the job end.
    queues = [
        {"name": "q1", "share": 0.5, "gm": "gm-1"},
        {"name": "q2", "share": 0.5, "gm": "gm-2"},
    ]
    (tmp_path / "fed").mkdir()
    async with Federation(tmp_path / "fed", workers_per_lm=2, queues=queues) as fed:
        client = fed.gm("gm-2")
        reply = await client.submit(sim_tasks(6, 0.2), queue="q1")
        states = {}

        async def follow():
            async for event in client.watch(reply.job_id):
                states[event.task_id] = event.state
                if len(states) == 6 and all(s == SUCCEEDED for s in states.values()):
                    return

        await asyncio.wait_for(follow(), timeout=30)
        job = await client.job(reply.job_id)
        assert all(t.state == SUCCEEDED for t in job.tasks)


async def test_a_replay_routes_around_a_gm_that_is_down(tmp_path):
    """gm-2 is killed before the replay starts and named first: the cluster view comes
    from gm-1, and every job gm-2 cannot take goes to gm-1 under the same job id."""
    async with Federation(tmp_path, workers_per_lm=4) as fed:
        fed.children.kill("gm-gm-2", signal.SIGKILL)
        gms = [fed.config.gm("gm-2").target, fed.config.gm("gm-1").target]
        result = await replay_jobs(small_trace(), gms, speedup=20.0, timeout_s=60)
        live = result.summary
        assert live["submit_errors"] == {}
        assert live["rerouted_submissions"] == 12  # every job tried gm-2 first
        assert live["completed"] == live["tasks"] == 120
        assert live["duplicates"] == 0
        assert {row["gm"] for row in result.rows} == {fed.config.gm("gm-1").target}
        assert "rerouted               12 submissions to another GM" in result.render()


async def test_a_replay_waits_out_a_gm_that_restarts_instead_of_dropping_its_jobs(tmp_path):
    """The only GM dies just after the replay began and comes back 2 s later: the jobs due
    meanwhile are tried again after pauses, under their ids, and all of them run once
    (before, each was given up after one round of the GMs: counted as refused)."""
    async with Federation(tmp_path, gms=1, workers_per_lm=4) as fed:

        async def outage() -> None:
            await asyncio.sleep(0.3)
            fed.children.kill("gm-gm-1", signal.SIGKILL)
            await asyncio.sleep(2.0)
            fed.children.restart("gm-gm-1")

        down = asyncio.create_task(outage())
        gms = [fed.config.gm("gm-1").target]
        result = await replay_jobs(small_trace(), gms, speedup=20.0, timeout_s=90)
        await down
        live = result.summary
        assert live["submit_errors"] == {}
        assert live["outage_retries"] > 0
        assert live["accepted"] == live["completed"] == live["tasks"] == 120
        assert live["duplicates"] == 0
        assert "waited out" in result.render()


async def test_a_replay_follows_its_jobs_through_another_gm_when_one_dies(tmp_path):
    """gm-1 dies for good mid-replay, after it took jobs: their events come through gm-2,
    and what gm-2 replays of them on a new watch is not counted twice."""
    async with Federation(tmp_path, workers_per_lm=4) as fed:
        gms = [gm.target for gm in fed.config.gms]
        # 40 tasks of 2 s (at speedup 20) arriving over 0.2 s, 48 CPUs: all run at once.
        # (A task still queued would wait for gm-1: each queue has one GM.)
        jobs = [
            TraceJob(f"j{j}", j * 0.5, tuple(TraceTask(40.0) for _ in range(5))) for j in range(8)
        ]
        replay = asyncio.create_task(replay_jobs(jobs, gms, speedup=20.0, timeout_s=60))
        await asyncio.sleep(1.0)  # every job submitted and running
        fed.children.kill("gm-gm-1", signal.SIGKILL)
        result = await replay
        assert result.summary["completed"] == result.summary["tasks"] == 40
        assert result.summary["duplicates"] == 0 and result.summary["submit_errors"] == {}
        assert sum(1 for row in result.rows if row["gm"] == gms[0]) == 20
