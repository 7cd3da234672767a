"""The live federation, as a user sees it: real processes, real gRPC, real RabbitMQ."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections import Counter

import grpc
import pytest

from services._proto.megha.v1 import (
    common_pb2,
    global_master_pb2,
    global_master_pb2_grpc,
    local_master_pb2,
    local_master_pb2_grpc,
)
from services.common.server import channel
from services.local_master.journal import FLUSH_S
from services.worker.agent import REDELIVERY_WINDOW_S
from tests.docker_engine import local_image, needs_docker
from tests.integration.harness import HEARTBEAT_S, RABBITMQ_URL, Federation, sim_tasks

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


async def test_a_gm_restart_neither_ends_a_watch_nor_forgets_a_job(tmp_path):
    succeeded = common_pb2.TASK_STATE_SUCCEEDED
    async with Federation(tmp_path, gms=1, lms=2, workers_per_lm=2) as fed:
        client = fed.gm()
        before = await client.submit(sim_tasks(4, 0.05), job_id="before")
        await fed.events.wait_succeeded(set(before.task_ids), timeout_s=20)
        reply = await client.submit(sim_tasks(6, 3.0))
        seen: list[common_pb2.TaskEvent] = []

        async def follow() -> None:
            async for event in client.follow(reply.job_id, reply.task_ids):
                seen.append(event)

        follower = asyncio.create_task(follow())
        await asyncio.sleep(1.0)
        assert not follower.done()
        fed.children.kill("gm-gm-1")  # kill -9: the watch breaks, the GM's memory goes
        fed.children.restart("gm-gm-1")
        await asyncio.wait_for(follower, timeout=40)
        ended = Counter(e.task_id for e in seen if e.state == succeeded)
        assert set(ended) == set(reply.task_ids) and max(ended.values()) == 1
        # The restarted GM knows the job that ended before it died: the LMs told it.
        job = await client.job("before")
        assert len(job.tasks) == 4 and {t.state for t in job.tasks} == {succeeded}
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a job never heard of: at once
            async for _ in client.follow("no-such-job"):
                pass
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


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


def two_small_lms(lm1_prefix: str) -> list[dict]:
    """Two 1-CPU workers on lm-1 (named ``lm1_prefix``-) and two on lm-2 (safe-)."""
    return [
        {"lm": "lm-1", "count": 2, "capacity": "cpu=1,mem=1Gi", "name_prefix": f"{lm1_prefix}-"},
        {"lm": "lm-2", "count": 2, "capacity": "cpu=1,mem=1Gi", "name_prefix": "safe-"},
    ]


async def fill_two_small_lms(fed: Federation, duration_s: float, lm1_prefix: str):
    """Four tasks, one per worker; returns the reply and the two running on lm-1."""
    reply = await fed.gm().submit(sim_tasks(4, duration_s))
    await asyncio.sleep(0.8)
    on_lm1 = {t for t, n in fed.events.nodes_of(RUNNING).items() if n.startswith(lm1_prefix)}
    assert len(on_lm1) == 2
    return reply, on_lm1


async def test_a_lost_worker_is_marked_dead_and_its_tasks_rerun(tmp_path):
    async with Federation(tmp_path, gms=1, lms=2, worker_groups=two_small_lms("doomed")) as fed:
        reply, doomed = await fill_two_small_lms(fed, 3.0, "doomed")
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


@pytest.mark.parametrize("journal", [True, False])
async def test_tasks_an_lm_lost_before_they_started_are_queued_again(tmp_path, journal):
    # The LM accepts launches for workers that died a moment ago (not yet taken for
    # dead), keeps the starts for when they reconnect, and dies too. With a journal the
    # restarted LM has them and queues them again; without one only the GM that placed
    # the tasks still has them, and it does.
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2, journal=journal) as fed:
        fed.children.kill("workers-lm-1")
        reply = await fed.gm().submit(sim_tasks(4, 0.2))
        ids = set(reply.task_ids)
        deadline = time.monotonic() + 5
        while set(fed.events.states(common_pb2.TASK_STATE_PLACED)) != ids:
            assert time.monotonic() < deadline, "the tasks were never placed"
            await asyncio.sleep(0.05)
        fed.children.kill("lm-lm-1")
        fed.children.restart("lm-lm-1")
        fed.children.restart("workers-lm-1")
        await fed.events.wait_succeeded(ids, timeout_s=40)
        assert max(fed.events.succeeded().values()) == 1
        job = await fed.gm().job(reply.job_id)
        assert {(t.state, t.attempt) for t in job.tasks} == {(common_pb2.TASK_STATE_SUCCEEDED, 1)}
        requeued_by_lm = "re-queueing tasks accepted before a restart" in fed.log("lm-lm-1")
        requeued_by_gm = "re-queued a task its LM lost" in fed.log("gm-gm-1")
        assert (requeued_by_lm, requeued_by_gm) == (journal, not journal)


@pytest.mark.chaos
async def test_after_a_long_lm_outage_its_workers_are_back_within_seconds(tmp_path):
    # gRPC's own reconnect backoff grows to 120 s: with it, after 40 s down a channel
    # polled every 0.1-3 s reached the server again 21-27 s after it was back (or at once,
    # by luck of the backoff's phase). The worker host's channel caps it at 2 s, so the
    # workers are back one step after the LM answers. Timed from that first answer, not
    # from the restart, which includes the LM's start-up on a loaded machine.
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2) as fed:
        fed.children.kill("lm-lm-1")
        await asyncio.sleep(40)
        fed.children.restart("lm-lm-1")
        restarted = time.monotonic()
        answered = None
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                nodes = len((await fed.lm_state("lm-1")).nodes)
                answered = answered or time.monotonic()
                if nodes == 2:
                    break
            assert time.monotonic() - restarted < 60, "the LM never came back"
            if answered is not None:
                waited = time.monotonic() - answered
                assert waited < 8, "the workers took over 8 s to reach the LM once it answered"
            await asyncio.sleep(0.1)
        reply = await fed.gm().submit(sim_tasks(2, 0.1))
        await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=10)


async def test_a_worker_host_killed_and_back_at_once_gets_its_tasks_rerun(tmp_path):
    # Back before the LM's watchdog could take its workers for dead: the LM learns what
    # they lost from their registrations, which name no task.
    async with Federation(tmp_path, gms=1, lms=2, workers_per_lm=4) as fed:
        reply = await fed.gm().submit(sim_tasks(16, 3.0))
        await asyncio.sleep(0.8)
        gone = {t for t, n in fed.events.nodes_of(RUNNING).items() if n.startswith("lm-1-")}
        assert gone
        fed.children.kill("workers-lm-1")
        fed.children.restart("workers-lm-1")
        await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=30)
        assert set(fed.events.states(common_pb2.TASK_STATE_LOST)) == gone
        assert max(fed.events.succeeded().values()) == 1
        await asyncio.sleep(3 * HEARTBEAT_S)
        await fed.assert_books_balanced()


async def test_a_worker_host_shut_down_gives_its_tasks_back_at_once(tmp_path):
    # A graceful stop (compose stop, a scale-down, a rolling upgrade) kills the host's
    # tasks and reports them LOST. The LM used to note the event and keep the tasks booked
    # until its watchdog took the host for dead, worker_timeout_s later (here 30 s).
    async with Federation(tmp_path, gms=1, lms=2, workers_per_lm=4, worker_timeout_s=30) as fed:
        reply = await fed.gm().submit(sim_tasks(8, 5.0, cpu_milli=4000))
        deadline = time.monotonic() + 10
        while len(fed.events.nodes_of(RUNNING)) < 8:
            assert time.monotonic() < deadline, "the tasks never all ran"
            await asyncio.sleep(0.05)
        gone = {t for t, n in fed.events.nodes_of(RUNNING).items() if n.startswith("lm-1-")}
        assert gone
        fed.children.kill("workers-lm-1", signal.SIGTERM)
        stopped = time.monotonic()
        while {e.task_id for e in fed.events.events if e.state == RUNNING and e.attempt} != gone:
            assert time.monotonic() - stopped < 10, "the lost tasks were not run again at once"
            await asyncio.sleep(0.05)
        await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=30)
        lost = Counter(
            e.task_id for e in fed.events.events if e.state == common_pb2.TASK_STATE_LOST
        )
        assert lost == dict.fromkeys(gone, 1)  # one LOST event each


def _pids_running(marker: str) -> set[int]:
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return {int(pid) for pid in found.split()}


def _process_tasks(script: str, count: int) -> list[common_pb2.Task]:
    tasks = []
    for _ in range(count):
        task = common_pb2.Task(process=common_pb2.ProcessExecutor(args=["sh", "-c", script]))
        task.resources.cpu_milli, task.resources.memory_mb = 1000, 256
        tasks.append(task)
    return tasks


async def _all_running(marker: str, count: int) -> set[int]:
    deadline = time.monotonic() + 10
    while len(running := _pids_running(marker)) < count:
        assert time.monotonic() < deadline, f"the tasks never started: {running}"
        await asyncio.sleep(0.1)
    return running


async def test_a_worker_host_killed_has_its_tasks_processes_killed_by_its_janitor(tmp_path):
    # A host killed -9 and not started again: its process tasks' children ran on, while
    # the LM queued their tasks again, until the host's next start (for ever if none).
    # Its janitor now kills them as soon as the host is gone.
    marker = f"{time.monotonic_ns() % 10**6}.7"  # a sleep only this test runs
    script = f"sleep 3{marker} & exec sleep 4{marker}"
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2) as fed:
        reply = await fed.gm().submit(_process_tasks(script, 2))
        first = await _all_running(f"sleep [34]{marker}", 4)
        fed.children.kill("workers-lm-1")
        killed = time.monotonic()
        while _pids_running(f"sleep [34]{marker}") & first:
            assert time.monotonic() - killed < 2, "a first attempt still runs"
            await asyncio.sleep(0.01)
        took = time.monotonic() - killed
        assert took < 1.0, f"the janitor took {took:.2f} s"
        ended = "the worker host died; its janitor ended what its tasks left running"
        deadline = time.monotonic() + 5
        while ended not in fed.log("workers-lm-1"):
            assert time.monotonic() < deadline, "the janitor did not say what it did"
            await asyncio.sleep(0.05)
        assert '"groups": 2' in fed.log("workers-lm-1")
        # The tasks were lost with the host and are queued again as their next attempt.
        deadline = time.monotonic() + 20
        while set(fed.events.states(common_pb2.TASK_STATE_LOST)) != set(reply.task_ids):
            assert time.monotonic() < deadline, "the tasks were never taken for lost"
            await asyncio.sleep(0.1)


async def test_a_worker_host_killed_takes_its_tasks_processes_along(tmp_path):
    # Each process task runs in a session of its own, so a worker host killed -9 left its
    # processes running while the LM re-queued their tasks: they ran twice at once. The
    # main process dies with the host (pdeathsig), and the host, started again, kills
    # what that process had started before its agents register: what is left when the
    # janitor died with the host (here: none was started).
    marker = f"{time.monotonic_ns() % 10**6}.5"  # a sleep only this test runs
    script = f"sleep 3{marker} & exec sleep 4{marker}"  # the exec'd sleep leads the group
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2, worker_janitor=False) as fed:
        reply = await fed.gm().submit(_process_tasks(script, 2))
        first = await _all_running(f"sleep [34]{marker}", 4)
        leaders = _pids_running(f"sleep 4{marker}")
        fed.children.kill("workers-lm-1")
        await asyncio.sleep(0.5)
        assert not _pids_running(f"sleep 4{marker}") & leaders  # died with the host
        fed.children.restart("workers-lm-1")
        # The host says so once what its tasks left is gone, before its agents register.
        swept = "killed what the tasks of this host's last life left running"
        deadline = time.monotonic() + 20
        while swept not in fed.log("workers-lm-1") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not _pids_running(f"sleep [34]{marker}") & first, "a first attempt still runs"
        assert swept in fed.log("workers-lm-1")
        # The tasks were lost with the host and are queued again as their next attempt.
        deadline = time.monotonic() + 20
        while set(fed.events.states(common_pb2.TASK_STATE_LOST)) != set(reply.task_ids):
            assert time.monotonic() < deadline, "the tasks were never taken for lost"
            await asyncio.sleep(0.1)


@needs_docker
async def test_a_worker_host_killed_has_its_containers_removed_when_it_starts_again(tmp_path):
    # A container is the Docker engine's child, not the host's: a host killed -9 left its
    # containers running while the LM queued their tasks again. The host's next start
    # removes them, before its agents register: what is left when its janitor died with
    # it (here: none was started).
    import docker

    engine = docker.from_env()
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2, worker_janitor=False) as fed:
        tasks = []
        for _ in range(2):
            image = common_pb2.DockerExecutor(image=local_image(), args=["sleep", "300"])
            task = common_pb2.Task(docker=image)
            task.resources.cpu_milli, task.resources.memory_mb = 1000, 256
            tasks.append(task)
        reply = await fed.gm().submit(tasks)
        theirs = {"label": "megha.host"}

        def running() -> set[str]:
            return {
                c.id
                for c in engine.containers.list(filters=theirs)
                if c.labels["megha.task_id"] in reply.task_ids
            }

        try:
            deadline = time.monotonic() + 60
            while len(first := running()) < 2:
                assert time.monotonic() < deadline, "the containers never started"
                await asyncio.sleep(0.2)
            fed.children.kill("workers-lm-1")
            await asyncio.sleep(1)
            assert running() == first  # the engine's children outlive the host
            fed.children.restart("workers-lm-1")
            swept = "killed what the tasks of this host's last life left running"
            deadline = time.monotonic() + 30
            while swept not in fed.log("workers-lm-1") and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert swept in fed.log("workers-lm-1")
            assert not running() & first, "a first attempt's container still runs"
            # The tasks were lost with the host and are queued again as their next attempt.
            deadline = time.monotonic() + 30
            while set(fed.events.states(common_pb2.TASK_STATE_LOST)) != set(reply.task_ids):
                assert time.monotonic() < deadline, "the tasks were never taken for lost"
                await asyncio.sleep(0.1)
        finally:
            for container in engine.containers.list(all=True, filters=theirs):
                if container.labels.get("megha.task_id") in reply.task_ids:
                    container.remove(force=True)
            engine.close()


async def test_an_lm_killed_and_restarted_takes_back_what_its_workers_run(tmp_path):
    async with Federation(tmp_path, gms=1, lms=2, workers_per_lm=4) as fed:
        warm = await fed.gm().submit(sim_tasks(150, 0.01))  # a first life of many versions
        await fed.events.wait_succeeded(set(warm.task_ids), timeout_s=30)
        # Past the window in which a worker sends a final report again on a new stream
        # (below): the warm-up's reports are settled.
        await asyncio.sleep(REDELIVERY_WINDOW_S + 0.5)
        reply = await fed.gm().submit(sim_tasks(16, 3.0))
        ids = set(reply.task_ids)
        deadline = time.monotonic() + 10
        while set(fed.events.nodes_of(RUNNING)) < ids | set(warm.task_ids):
            assert time.monotonic() < deadline, "the tasks never all ran"
            await asyncio.sleep(0.05)
        on_lm1 = {e.task_id for e in fed.events.events if e.task_id in ids and e.lm_id == "lm-1"}
        assert on_lm1, "nothing ran on lm-1"
        old_version = (await fed.lm_state("lm-1")).version
        fed.children.kill("lm-lm-1")  # kill -9: its books are gone
        fed.children.restart("lm-lm-1")
        await fed.events.wait_succeeded(ids, timeout_s=30)
        # Each ran once, where it started: nothing was lost, re-queued or run again.
        assert [e for e in fed.events.events if e.attempt > 0] == []
        running = Counter(e.task_id for e in fed.events.events if e.state == RUNNING)
        assert set(running) == ids | set(warm.task_ids) and max(running.values()) == 1
        # A final report the old LM took in its last seconds would be taken again by the
        # new one (the worker cannot know whether the old LM published it); none here.
        assert max(fed.events.succeeded().values()) == 1
        assert "took back tasks a worker holds" in fed.log("lm-lm-1")
        # The GM follows the new life although its versions started again from zero.
        deadline = time.monotonic() + 5
        while True:
            state = await fed.lm_state("lm-1")
            view = {lm.lm_id: lm for lm in (await fed.gm().cluster()).lms}
            if view["lm-1"].version == state.version:
                break
            assert time.monotonic() < deadline, (
                f"the GM still sees lm-1 at version {view['lm-1'].version} "
                f"(its first life ended at {old_version}), the LM is at {state.version}"
            )
            await asyncio.sleep(0.1)
        assert state.version < old_version
        await asyncio.sleep(3 * HEARTBEAT_S)
        await fed.assert_books_balanced()


async def test_a_restarted_lm_neither_reruns_nor_forgets_what_ended_on_it(tmp_path):
    # A GM that retries a launch the old LM ran to the end (its reply was lost) must get
    # DUPLICATE from the new LM, and a GM that missed the final event must still learn it.
    # From its journal the LM knows both; without one (journal=False), it knows neither.
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2) as fed:
        reply = await fed.gm().submit(sim_tasks(6, 0.05))
        ids = list(reply.task_ids)
        await fed.events.wait_succeeded(set(ids), timeout_s=20)
        # Past the window in which the workers would name them again when they register
        # (their final reports might not have arrived): from then on only the LM knows.
        await asyncio.sleep(max(FLUSH_S, REDELIVERY_WINDOW_S) + 0.5)
        fed.children.kill("lm-lm-1")
        fed.children.restart("lm-lm-1")
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                if len((await fed.lm_state("lm-1")).nodes) == 2:
                    break
            assert time.monotonic() < deadline, "lm-1 and its workers never came back"
            await asyncio.sleep(0.1)
        retry = sim_tasks(1, 0.05)[0]
        retry.task_id, retry.job_id, retry.queue = ids[0], reply.job_id, "default"
        async with channel(fed.config.lm("lm-1").target) as ch:
            stub = local_master_pb2_grpc.LocalMasterStub(ch)
            known = await stub.LookupTasks(
                local_master_pb2.LookupTasksRequest(task_ids=ids), timeout=5
            )
            launched = await stub.Launch(
                local_master_pb2.LaunchRequest(
                    gm_id="gm-1", placements=[local_master_pb2.Placement(task=retry)]
                ),
                timeout=5,
            )
        assert launched.results[0].status == local_master_pb2.PLACEMENT_STATUS_DUPLICATE
        ended = {t.task_id: (t.attempt, t.running, t.last_ended.state) for t in known.tasks}
        assert ended == {i: (0, False, common_pb2.TASK_STATE_SUCCEEDED) for i in ids}
        assert "recalled the tasks that ended here" in fed.log("lm-lm-1")


async def test_a_launch_an_lm_reads_after_the_gm_gave_up_on_it_runs_once(tmp_path):
    # A frozen LM (SIGSTOP) reads the GM's launches when it resumes, but the GM gave up
    # on them after lm_call_timeout_s. Before expiries, those tasks ran on both LMs (8 of
    # 16 succeeded twice). Now the GM fences them on the frozen LM before placing them
    # again: whichever the LM reads first, the launch or the fence, each runs once. The
    # workers' timeout is long so that the LM, resumed, still takes its nodes for alive.
    async with Federation(
        tmp_path, gms=1, lms=2, workers_per_lm=4, worker_timeout_s=30, lm_call_timeout_s=2
    ) as fed:
        lm = fed.children.procs["lm-lm-1"]
        lm.send_signal(signal.SIGSTOP)
        try:
            reply = await fed.gm().submit(sim_tasks(16, 0.5))
            await asyncio.sleep(4)
        finally:
            lm.send_signal(signal.SIGCONT)
        await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=30)
        await asyncio.sleep(2)  # a second run would have shown by now
        assert max(fed.events.succeeded().values()) == 1
        assert (
            max(Counter(e.task_id for e in fed.events.events if e.state == RUNNING).values()) == 1
        )
        assert "fencing it before placing its tasks again" in fed.log("gm-gm-1")


@pytest.mark.chaos
async def test_a_gm_stopped_for_a_while_goes_on_where_it_was(tmp_path):
    # Stopped (SIGSTOP) while its queue holds more than fits and the other GM schedules:
    # resumed, it neither loses nor repeats anything, and both GMs tell the same story.
    async with Federation(tmp_path, gms=2, lms=2, workers_per_lm=2) as fed:
        reply = await fed.gm("gm-1").submit(sim_tasks(40, 1.0, cpu_milli=2000))
        await asyncio.sleep(0.5)
        gm = fed.children.procs["gm-gm-1"]
        gm.send_signal(signal.SIGSTOP)
        try:
            other = await fed.gm("gm-2").submit(sim_tasks(8, 0.5))
            await asyncio.sleep(12)
        finally:
            gm.send_signal(signal.SIGCONT)
        await fed.events.wait_succeeded(set(reply.task_ids) | set(other.task_ids), timeout_s=60)
        await asyncio.sleep(1)
        assert max(fed.events.succeeded().values()) == 1
        assert (
            max(Counter(e.task_id for e in fed.events.events if e.state == RUNNING).values()) == 1
        )
        for gm_id in ("gm-1", "gm-2"):
            job = await fed.gm(gm_id).job(reply.job_id)
            assert {t.state for t in job.tasks} == {common_pb2.TASK_STATE_SUCCEEDED}, gm_id
        await fed.assert_books_balanced()


async def test_a_worker_taken_for_dead_stops_the_attempts_rerun_elsewhere(tmp_path):
    async with Federation(tmp_path, gms=1, lms=2, worker_groups=two_small_lms("frozen")) as fed:
        reply, frozen = await fill_two_small_lms(fed, 6.0, "frozen")
        workers = fed.children.procs["workers-lm-1"]
        workers.send_signal(signal.SIGSTOP)  # silent, not gone: its tasks are taken for lost
        try:
            deadline = time.monotonic() + 10
            while set(fed.events.states(common_pb2.TASK_STATE_LOST)) != frozen:
                assert time.monotonic() < deadline, "the frozen worker was never taken for dead"
                await asyncio.sleep(0.05)
        finally:
            workers.send_signal(signal.SIGCONT)
        # Back, it still runs attempt 0 of tasks re-queued as attempt 1: the LM has it
        # register again, learns what it runs and kills those attempts.
        deadline = time.monotonic() + 10
        while fed.log("workers-lm-1").count("task killed") < len(frozen):
            assert time.monotonic() < deadline, "the stale attempts were never killed"
            await asyncio.sleep(0.1)
        await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=30)
        assert max(fed.events.succeeded().values()) == 1
        state = await fed.lm_state("lm-1")
        assert all(n.health == common_pb2.NODE_HEALTH_ALIVE for n in state.nodes)
        await asyncio.sleep(3 * HEARTBEAT_S)
        await fed.assert_books_balanced()


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


def _megha(*argv: str) -> subprocess.CompletedProcess:
    """The real CLI, in a process of its own."""
    command = [sys.executable, "-m", "services.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def test_malformed_config_exits_with_a_readable_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gms: [{id: gm-1, port: 99999}]\nlms: []\n")
    proc = _megha("lm", "--id", "lm-1", "--config", str(bad))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "gms.0.port" in proc.stderr and "lms" in proc.stderr
    missing = _megha("gm", "--id", "gm-9", "--config", str(tmp_path / "x.yaml"))
    assert missing.returncode == 2 and "cannot read config" in missing.stderr


def test_an_lm_whose_journal_is_not_one_exits_with_a_readable_message(tmp_path):
    junk = tmp_path / "lm-1.journal"
    junk.write_bytes(b"not a journal " * 200)
    config = tmp_path / "federation.yaml"
    config.write_text(
        f"rabbitmq_url: {RABBITMQ_URL}\n"
        "gms: [{id: gm-1, port: 1}]\n"
        f"lms: [{{id: lm-1, port: 2, journal: '{junk}'}}]\n"
    )
    proc = _megha("lm", "--id", "lm-1", "--config", str(config))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"cannot open the LM journal {junk}: file is not a database" in proc.stderr
    assert "move it aside" in proc.stderr
