"""The live federation, as a user sees it: real processes, real gRPC, real RabbitMQ."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import pytest

from services._proto.megha.v1 import common_pb2, global_master_pb2, global_master_pb2_grpc
from tests.integration.harness import HEARTBEAT_S, Federation, sim_tasks

pytestmark = pytest.mark.integration

RUNNING = common_pb2.TASK_STATE_RUNNING


async def test_500_tasks_all_finish_exactly_once(tmp_path):
    queues = [
        {"name": "q1", "share": 0.5, "gm": "gm-1"},
        {"name": "q2", "share": 0.5, "gm": "gm-2"},
    ]
    async with Federation(tmp_path, queues=queues) as fed:
        ids: set[str] = set()
        for job in range(10):
            queue = "q1" if job % 2 == 0 else "q2"
            client = fed.gm("gm-1" if job < 5 else "gm-2")  # any GM takes any queue
            reply = await client.submit(sim_tasks(50, 0.05), queue=queue)
            ids.update(reply.task_ids)
        assert len(ids) == 500
        await fed.events.wait_succeeded(ids, timeout_s=60)
        succeeded = fed.events.succeeded()
        assert {t: n for t, n in succeeded.items() if n != 1} == {}
        assert set(succeeded) == ids
        await asyncio.sleep(3 * HEARTBEAT_S)
        await fed.assert_books_balanced()
        job = await fed.gm("gm-2").job(reply.job_id)
        assert all(t.state == common_pb2.TASK_STATE_SUCCEEDED for t in job.tasks)
        # Every queue message was acked once its tasks had launched, also those a GM
        # scheduled from memory before their delivery came back: with both GMs stopped,
        # no message returns to its queue.
        for gm in ("gm-gm-1", "gm-gm-2"):
            fed.children.kill(gm, signal.SIGTERM)
        for queue in ("q1", "q2"):
            assert await fed.bus.queue_depth(f"user.{queue}") == 0, queue


async def test_a_job_retried_through_both_gms_runs_each_task_once(tmp_path):
    """A client that resubmits a job under its id (through the same GM or another one,
    while it runs or after it ended) gets the same task ids, and the GM serving the queue
    places every task once. (A second copy that reached the LM which ran the first would
    be refused as a duplicate; one placed on another LM would run again.)"""
    async with Federation(tmp_path, metrics=True) as fed:
        first = await fed.gm("gm-1").submit(sim_tasks(12, 0.5), job_id="retried")
        ids = set(first.task_ids)
        while_queued = await asyncio.gather(
            fed.gm("gm-2").submit(sim_tasks(12, 0.5), job_id="retried"),
            fed.gm("gm-1").submit(sim_tasks(12, 0.5), job_id="retried"),
        )
        assert all(set(r.task_ids) == ids for r in while_queued)
        await fed.events.wait_succeeded(ids, timeout_s=30)
        for gm in ("gm-1", "gm-2"):
            after = await fed.gm(gm).submit(sim_tasks(12, 0.5), job_id="retried")
            assert set(after.task_ids) == ids
        await asyncio.sleep(1.5)  # time for a second copy to start, were one queued
        for state in (RUNNING, common_pb2.TASK_STATE_SUCCEEDED):
            counts = fed.events.states(state)
            assert {t: n for t, n in counts.items() if n != 1} == {}, state
            assert set(counts) == ids
        queue = fed.config.effective_queues()[0]
        placed = f'megha_schedule_attempts_total{{gm="{queue.gm}",result="placed"}}'
        assert await fed.metric(queue.gm, placed) == len(ids)
        assert await fed.bus.queue_depth(f"user.{queue.name}") == 0


async def test_full_partitions_place_through_repartition(tmp_path):
    # One LM, 4 one-core nodes: 2 in gm-1's partition, 2 in gm-2's. Only gm-1 has work.
    groups = [{"lm": "lm-1", "count": 4, "capacity": "cpu=1,mem=1Gi"}]
    async with Federation(tmp_path, lms=1, worker_groups=groups) as fed:
        reply = await fed.gm("gm-1").submit(sim_tasks(4, 2.0))
        await asyncio.sleep(0.8)
        state = await fed.lm_state("lm-1")
        running = {a.task_id: a for a in state.allocations}
        assert set(running) == set(reply.task_ids)
        assert sum(a.logical for a in running.values()) == 2  # carved from gm-2's nodes
        assert len({a.node_index for a in running.values()}) == 4
        gm2_partition = next(p for p in state.partitions if p.gm_id == "gm-2")
        assert gm2_partition.borrowed.cpu_milli == 2000
        await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=20)
        await asyncio.sleep(3 * HEARTBEAT_S)
        await fed.assert_books_balanced()


async def test_racing_gms_one_wins_the_other_gets_state_and_waits(tmp_path):
    groups = [{"lm": "lm-1", "count": 4, "capacity": "cpu=1,mem=1Gi"}]
    queues = [
        {"name": "q1", "share": 0.5, "gm": "gm-1"},
        {"name": "q2", "share": 0.5, "gm": "gm-2"},
    ]
    async with Federation(
        tmp_path, lms=1, worker_groups=groups, queues=queues, metrics=True
    ) as fed:
        # Both GMs see 4 free nodes and get 4 tasks each at the same instant: each takes
        # its own 2 nodes and races the other for the other 2 by repartition.
        replies = await asyncio.gather(
            fed.gm("gm-1").submit(sim_tasks(4, 1.0), queue="q1"),
            fed.gm("gm-2").submit(sim_tasks(4, 1.0), queue="q2"),
        )
        ids = {t for r in replies for t in r.task_ids}
        peak = 0
        deadline = time.monotonic() + 30
        while set(fed.events.succeeded()) != ids and time.monotonic() < deadline:
            state = await fed.lm_state("lm-1")
            assert min(state.free.cpu_milli) >= 0, "a node was over-committed"
            peak = max(peak, len(state.allocations))
            await asyncio.sleep(0.05)
        assert peak == 4  # never more than the 4 cores
        assert set(fed.events.succeeded()) == ids
        assert max(fed.events.succeeded().values()) == 1
        rejected = await fed.metric("gm-1", "megha_inconsistencies_total") + await fed.metric(
            "gm-2", "megha_inconsistencies_total"
        )
        assert rejected >= 1, "the race should have produced at least one LM rejection"
        await asyncio.sleep(3 * HEARTBEAT_S)
        await fed.assert_books_balanced()


async def test_gm_killed_mid_run_rebuilds_view_and_loses_nothing(tmp_path):
    async with Federation(tmp_path) as fed:
        ids: set[str] = set()
        for _ in range(4):
            reply = await fed.gm("gm-1").submit(sim_tasks(60, 0.3))
            ids.update(reply.task_ids)
        await asyncio.sleep(0.4)  # some tasks run, some wait in gm-1
        assert any(e.state == RUNNING for e in fed.events.events)
        fed.children.kill("gm-gm-1")  # kill -9
        fed.children.restart("gm-gm-1")
        target = fed.config.gm("gm-1").target
        client = fed.gm("gm-1")
        started = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                view = await client.cluster()
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.02)
                continue
            started = started or time.monotonic()
            if {lm.lm_id for lm in view.lms} == {lm.id for lm in fed.config.lms}:
                break
            await asyncio.sleep(0.02)
        rebuilt_in = time.monotonic() - started
        assert rebuilt_in <= 2 * HEARTBEAT_S + 0.1, f"view rebuilt in {rebuilt_in:.2f} s ({target})"
        await fed.events.wait_succeeded(ids, timeout_s=60)
        assert max(fed.events.succeeded().values()) == 1, "a task ran twice"
        await asyncio.sleep(3 * HEARTBEAT_S)
        await fed.assert_books_balanced()


async def test_constraints_are_honoured(tmp_path):
    groups = [
        {"lm": "lm-1", "count": 3, "constraints": [1, 2], "name_prefix": "both-"},
        {"lm": "lm-2", "count": 3, "constraints": [2], "name_prefix": "two-"},
        {"lm": "lm-3", "count": 3, "constraints": [], "name_prefix": "none-"},
    ]
    async with Federation(tmp_path, worker_groups=groups) as fed:
        one = await fed.gm().submit(sim_tasks(20, 0.05, constraints=[1]))
        two = await fed.gm().submit(sim_tasks(20, 0.05, constraints=[2]))
        await fed.events.wait_succeeded(set(one.task_ids) | set(two.task_ids), timeout_s=30)
        nodes = fed.events.nodes_of(RUNNING)
        assert {nodes[t].split("-")[0] for t in one.task_ids} == {"both"}
        assert {nodes[t].split("-")[0] for t in two.task_ids} <= {"both", "two"}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fed.gm().submit(sim_tasks(1, 0.05, constraints=[5]))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no node has constraint 5" in err.value.details()


async def test_a_lost_worker_is_marked_dead_and_its_tasks_rerun(tmp_path):
    groups = [
        {"lm": "lm-1", "count": 2, "capacity": "cpu=1,mem=1Gi", "name_prefix": "doomed-"},
        {"lm": "lm-2", "count": 2, "capacity": "cpu=1,mem=1Gi", "name_prefix": "safe-"},
    ]
    async with Federation(tmp_path, gms=1, lms=2, worker_groups=groups) as fed:
        reply = await fed.gm().submit(sim_tasks(4, 3.0))
        await asyncio.sleep(0.8)
        doomed = {t for t, n in fed.events.nodes_of(RUNNING).items() if n.startswith("doomed")}
        assert len(doomed) == 2
        fed.children.kill("workers-lm-1")
        await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=30)
        lost = fed.events.states(common_pb2.TASK_STATE_LOST)
        assert set(lost) == doomed
        reran = {
            e.task_id: e.node_id for e in fed.events.events if e.state == RUNNING and e.attempt == 1
        }
        assert set(reran) == doomed and all(n.startswith("safe") for n in reran.values())
        assert max(fed.events.succeeded().values()) == 1
        state = await fed.lm_state("lm-1")
        assert all(n.health == common_pb2.NODE_HEALTH_DEAD for n in state.nodes)


async def test_bad_input_gets_clear_errors_and_changes_nothing(tmp_path):
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2) as fed:
        gm = fed.gm()

        async def code_of(tasks, queue=""):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gm.submit(tasks, queue=queue)
            return err.value.code(), err.value.details()

        zero = sim_tasks(1, 0.1, cpu_milli=0)
        zero[0].resources.memory_mb = 0
        negative = sim_tasks(1, 0.1, cpu_milli=-5)
        huge = sim_tasks(1, 0.1, cpu_milli=10_000_000)
        cases = [
            (zero, "", grpc.StatusCode.INVALID_ARGUMENT, "asks for nothing"),
            (negative, "", grpc.StatusCode.INVALID_ARGUMENT, "negative quantity"),
            (
                sim_tasks(1, 0.1, constraints=[40]),
                "",
                grpc.StatusCode.INVALID_ARGUMENT,
                "unknown constraint 40",
            ),
            ([], "", grpc.StatusCode.INVALID_ARGUMENT, "at least one task"),
            (sim_tasks(1, 0.1), "nope", grpc.StatusCode.INVALID_ARGUMENT, "unknown queue 'nope'"),
            (huge, "", grpc.StatusCode.FAILED_PRECONDITION, "no node is large enough"),
        ]
        for tasks, queue, code, words in cases:
            got, details = await code_of(tasks, queue)
            assert got == code and words in details, (got, details)

        # An oversized message is refused by the server, not half-read.
        async with grpc.aio.insecure_channel(fed.config.gm("gm-1").target) as raw:
            stub = global_master_pb2_grpc.GlobalMasterStub(raw)
            task = sim_tasks(1, 0.1)[0]
            task.lifetime_features["blob"] = "x" * (65 * 1024 * 1024)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SubmitJob(global_master_pb2.SubmitJobRequest(tasks=[task]), timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        view = await gm.cluster()
        assert all(q.pending_tasks == 0 and q.running_tasks == 0 for q in view.queues)
        assert not fed.events.events


def test_malformed_config_exits_with_a_readable_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gms: [{id: gm-1, port: 99999}]\nlms: []\n")
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "lm", "--id", "lm-1", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "gms.0.port" in proc.stderr and "lms" in proc.stderr
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "gm",
            "--id",
            "gm-9",
            "--config",
            str(tmp_path / "x.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert missing.returncode == 2 and "cannot read config" in missing.stderr
