"""CancelJob on a real federation: GMs, LMs and workers as processes, real RabbitMQ."""

from __future__ import annotations

import asyncio
import itertools
import re
import subprocess
import sys
import time

import grpc

from services._proto.megha.v1 import common_pb2, local_master_pb2, local_master_pb2_grpc
from services.app import operator
from services.common.server import channel
from tests.integration.harness import Federation, sim_tasks

CANCELLED = common_pb2.TASK_STATE_CANCELLED
RUNNING = common_pb2.TASK_STATE_RUNNING


async def _until(check, timeout_s: float, what: str) -> float:
    """Seconds until ``check()`` holds (fails past ``timeout_s``)."""
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < timeout_s, what
        await asyncio.sleep(0.02)
    return time.monotonic() - began


def _launch(fed: Federation, job_id: str) -> local_master_pb2.LaunchRequest:
    """gm-1's launch of task 0 of ``job_id`` on node 0 of lm-1, as if it had queued it."""
    (task,) = sim_tasks(1, 0.1)
    task.task_id, task.job_id = f"{job_id}.0", job_id
    task.queue = fed.config.effective_queues()[0].name
    placement = local_master_pb2.Placement(task=task, node_index=0)
    return local_master_pb2.LaunchRequest(gm_id="gm-1", placements=[placement])


async def test_a_cancelled_job_ends_at_once_queued_and_running_tasks_alike(tmp_path):
    # 16 cores: 8 of the 24 two-core tasks run, 16 wait in gm-1's queue. The cancel goes
    # through gm-2 (not the queue's GM) with the CLI.
    async with Federation(tmp_path, gms=2, lms=2, workers_per_lm=2, metrics=True) as fed:
        reply = await fed.gm("gm-1").submit(sim_tasks(24, 60.0, cpu_milli=2000))
        ids = set(reply.task_ids)
        await _until(lambda: len(fed.events.nodes_of(RUNNING)) == 8, 15, "8 never ran")
        cancelled_at = time.time_ns()
        gm_2 = fed.config.gm("gm-2").target
        cli = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "services.cli",
                "cancel",
                reply.job_id,
                "--gm",
                gm_2,
                "--config",
                str(fed.config_path),
                "--reason",
                "wrong input",
                "--wait",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert cli.returncode == 0, cli.stderr
        assert f"job {reply.job_id}: cancel" in cli.stdout
        # --wait followed the job through gm-1, which knows the queued tasks too (gm-2 knew
        # only those that ran, and could have ended its watch before the others).
        serving = await operator._serving_gm(fed.gm("gm-2"), reply.job_id, fed.config)
        assert serving == fed.config.gm("gm-1").target
        shown = set(re.findall(r"^(\S+)\s+cancelled\b", cli.stdout, flags=re.M))
        assert shown == ids, cli.stdout
        took = await _until(
            lambda: set(fed.events.states(CANCELLED)) == ids, 5, "not every task was cancelled"
        )
        assert took < 3
        assert not fed.events.succeeded()
        ran = set(fed.events.nodes_of(RUNNING))
        assert len(ran) == 8  # none started after the cancel
        late = [
            e
            for e in fed.events.events
            if e.state == RUNNING
            and e.task_id in ids
            and e.timestamps.started_unix_nanos > cancelled_at
        ]
        assert not late
        reasons = {e.reason for e in fed.events.events if e.state == CANCELLED}
        assert reasons == {"wrong input"}
        # gm-1 dropped the 16 queued ones; the LMs killed the 8 running ones.
        assert await fed.metric("gm-1", "megha_tasks_cancelled_total") == 16
        assert await fed.metric("gm-2", "megha_tasks_cancelled_total") == 0
        # Both GMs say so, and the job's room is free again for the next job at once.
        for gm_id in ("gm-1", "gm-2"):
            job = await fed.gm(gm_id).job(reply.job_id)
            states = {t.state for t in job.tasks}
            deadline = time.monotonic() + 5
            while states != {CANCELLED} and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                states = {t.state for t in (await fed.gm(gm_id).job(reply.job_id)).tasks}
            assert states == {CANCELLED}, (gm_id, states)
        # Submitted again under its id (a client's retry): nothing is queued again.
        again = await fed.gm("gm-2").submit(sim_tasks(24, 60.0, 2000), job_id=reply.job_id)
        assert set(again.task_ids) == ids
        after = await fed.gm("gm-1").submit(sim_tasks(8, 0.2, cpu_milli=2000))
        await fed.events.wait_succeeded(set(after.task_ids), timeout_s=10)
        await asyncio.sleep(1)
        starts = sum(e.state == RUNNING and e.task_id in ids for e in fed.events.events)
        assert starts == 8  # the retry ran nothing
        await fed.assert_books_balanced()


async def test_an_lm_refuses_to_launch_a_task_of_a_cancelled_job_even_after_a_restart(tmp_path):
    # A GM that has not heard of the cancel yet may still send a launch: the LM refuses
    # it without a fresh state (the GM's view was not wrong), and the task never runs.
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=1) as fed:
        answer = await fed.gm().cancel("never-submitted", "test")
        assert not answer.known and answer.unfinished == 0
        request = _launch(fed, "never-submitted")
        async with channel(fed.config.lm("lm-1").target) as ch:
            stub = local_master_pb2_grpc.LocalMasterStub(ch)
            deadline = time.monotonic() + 5
            for tries in itertools.count():  # the broadcast reaches the LM after the answer
                # A task the LM took before it heard is another's: each try is a new task
                # (the same one again would be a DUPLICATE, whatever the LM heard since).
                request.placements[0].task.task_id = f"never-submitted.try-{tries}"
                reply = await stub.Launch(request, timeout=5)
                status = reply.results[0].status
                if status != local_master_pb2.PLACEMENT_STATUS_ACCEPTED:
                    break
                assert time.monotonic() < deadline, "the LM never heard of the cancel"
                await asyncio.sleep(0.05)
        assert status == local_master_pb2.PLACEMENT_STATUS_REJECTED_CANCELLED
        assert "was cancelled: test" in reply.results[0].reason
        assert not reply.HasField("state")
        # Its journal keeps the cancel: killed and started again, it still refuses.
        fed.children.kill("lm-lm-1")
        fed.children.restart("lm-lm-1")
        async with channel(fed.config.lm("lm-1").target) as ch:
            stub = local_master_pb2_grpc.LocalMasterStub(ch)
            request.placements[0].task.task_id = "never-submitted.1"
            deadline = time.monotonic() + 30
            while True:
                try:
                    reply = await stub.Launch(request, timeout=5)
                    break
                except grpc.aio.AioRpcError:
                    assert time.monotonic() < deadline, "the LM never came back"
                    await asyncio.sleep(0.2)
        assert reply.results[0].status == local_master_pb2.PLACEMENT_STATUS_REJECTED_CANCELLED


async def test_a_cancelled_process_task_is_killed_on_its_worker(tmp_path):
    marker = f"{time.monotonic_ns() % 10**6}.3"  # a sleep only this test runs
    task = common_pb2.Task(
        process=common_pb2.ProcessExecutor(args=["sh", "-c", f"sleep 5{marker}"])
    )
    task.resources.cpu_milli, task.resources.memory_mb = 1000, 256

    def running() -> bool:
        found = subprocess.run(["pgrep", "-f", f"sleep 5{marker}"], capture_output=True)
        return found.returncode == 0

    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=1) as fed:
        reply = await fed.gm().submit([task])
        await _until(running, 15, "the task never started")
        await fed.gm().cancel(reply.job_id)
        took = await _until(lambda: not running(), 5, "the task's process still runs")
        assert took < 2
        deadline = time.monotonic() + 5  # the LM's event reaches the GM a moment later
        while (await fed.gm().job(reply.job_id)).tasks[0].state != CANCELLED:
            assert time.monotonic() < deadline, "the GM never heard the task was cancelled"
            await asyncio.sleep(0.05)


async def test_an_lm_down_when_a_job_is_cancelled_hears_of_it_once_back(tmp_path):
    # No journal: what it learns comes from its kept queue on the broker.
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=1, journal=False) as fed:
        fed.children.kill("lm-lm-1")
        await fed.gm().cancel("cancelled-while-away", "test")
        fed.children.restart("lm-lm-1")
        request = _launch(fed, "cancelled-while-away")
        async with channel(fed.config.lm("lm-1").target) as ch:
            stub = local_master_pb2_grpc.LocalMasterStub(ch)
            deadline = time.monotonic() + 30
            status = None
            while status != local_master_pb2.PLACEMENT_STATUS_REJECTED_CANCELLED:
                assert time.monotonic() < deadline, f"the LM never heard (last: {status})"
                try:
                    reply = await stub.Launch(request, timeout=5)
                    status = reply.results[0].status
                except grpc.aio.AioRpcError:
                    pass  # not back yet
                await asyncio.sleep(0.1)
