"""Clients that do not read, and big jobs: a GM keeps a bounded amount for each client,
and reads a big job in turns with its other work.

A WatchJob client that reads slower than its job's tasks change state is cut once it is
``WATCH_BACKLOG`` events behind (RESOURCE_EXHAUSTED, and ``follow`` watches again without
missing an end); a SubmitStream client that sends without reading its answers is no
longer read once it owes ``STREAM_ANSWERS_OWED`` of them, and is read on as it reads.
Real gRPC calls against a GM in this process, whose bounds are lowered for the test.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import REGISTRY

from services._proto.megha.v1 import common_pb2, global_master_pb2, global_master_pb2_grpc
from services.common.server import channel
from services.core.states import TERMINAL
from services.global_master import jobs as gm_jobs
from services.global_master import service as gm_service
from tests.integration.harness import embedded_federation, job_in_state, sim_tasks

pytestmark = pytest.mark.integration


def _sample(name: str) -> float:
    """A counter of gm-1's (the federation runs in this process)."""
    return REGISTRY.get_sample_value(name, {"gm": "gm-1"}) or 0.0


BIG = [{"lm": "lm-1", "count": 2, "capacity": "cpu=64,mem=64Gi"}]


async def test_a_watch_that_falls_behind_is_cut_and_follow_still_sees_every_end(monkeypatch):
    monkeypatch.setattr(gm_jobs, "WATCH_BACKLOG", 50)
    cut_before = _sample("megha_watches_cut_total")
    async with embedded_federation("slow-watch", workers=BIG) as (config, gm, _bus, client):
        await client.submit(sim_tasks(2000, 0.01, cpu_milli=100), job_id="big")
        async with channel(config.gm("gm-1").target) as ch:
            stub = global_master_pb2_grpc.GlobalMasterStub(ch)
            call = stub.WatchJob(global_master_pb2.WatchJobRequest(job_id="big"))
            await call.read()  # the watch is on; nothing more is read for a while
            for _ in range(200):
                job = gm.jobs.get("big")
                if job.done:
                    break
                await asyncio.sleep(0.05)
            assert job.done
            # Never more than the bound waited for it; past it the watch is cut and keeps
            # nothing (its stream waits for the client to read, or to go).
            assert all(w.cut and w.empty() for w in job.watchers)
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                while True:
                    if await call.read() is grpc.aio.EOF:
                        break
            assert cut.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "fell 50 events behind: watch again" in cut.value.details()
            assert _sample("megha_watches_cut_total") == cut_before + 1

        # A client that follows the job reads each task's end, however the watch goes.
        ended = {e.task_id async for e in client.follow("big") if e.state in TERMINAL}
        assert len(ended) == 2000


async def test_a_stream_that_sends_without_reading_is_held_back_then_answered(monkeypatch):
    monkeypatch.setattr(gm_service, "STREAM_ANSWERS_OWED", 20)
    paused = _sample("megha_submit_streams_paused_total")
    # Without BDP probing the client's window stays at gRPC's default (64 KB); with it,
    # it grows to megabytes and this test would need that many answers unread.
    no_probing = [("grpc.http2.bdp_probe", 0)]
    async with (
        embedded_federation("slow-stream", workers=BIG) as (config, gm, _bus, _client),
        channel(config.gm("gm-1").target, no_probing) as ch,
    ):
        stub = global_master_pb2_grpc.GlobalMasterStub(ch)
        call = stub.SubmitStream()
        # 100 tasks a job: an answer names them (~1 KB), so the answers soon fill
        # what gRPC's flow control lets the GM send ahead of the client's reads.
        for i in range(200):
            job = global_master_pb2.SubmitJobRequest(job_id=f"s{i}")
            job.tasks.extend(sim_tasks(100, 0.01, cpu_milli=100))
            await call.write(global_master_pb2.SubmitStreamRequest(request_id=i, submit=job))
        await asyncio.sleep(3.0)
        # Its answers unread, the stream was read only so far: the bound, and what
        # the client's gRPC took in before its window filled. Not all 200.
        taken = sum(gm.jobs.get(f"s{i}") is not None for i in range(200))
        assert 20 <= taken < 200, taken
        assert _sample("megha_submit_streams_paused_total") > paused
        await call.done_writing()
        answered = set()
        async for reply in call:
            for answer in (reply, *reply.more_answers):
                assert not answer.error_code, answer.error_message
                answered.add(answer.request_id)
        assert answered == set(range(200))
        for i in range(200):
            assert gm.jobs.get(f"s{i}") is not None


async def test_a_big_job_is_checked_in_turns_with_the_gm_s_other_work(monkeypatch):
    monkeypatch.setattr(gm_service, "TASKS_BETWEEN_TURNS", 10)
    async with embedded_federation("big-turns") as (_config, gm, _bus, _client):
        turns = 0

        async def other_work():
            nonlocal turns
            while True:
                await asyncio.sleep(0)
                turns += 1

        job = global_master_pb2.SubmitJobRequest(job_id="big")
        job.tasks.extend(sim_tasks(100, 0.01, cpu_milli=100))
        job.tasks[-1].attempt = 1  # the federation's to set: found once the other 99 are checked
        ticker = asyncio.ensure_future(other_work())
        await asyncio.sleep(0)
        turns = 0
        with pytest.raises(gm_service.Refused) as refused:
            await gm._queue_job(job, "big")
        ticker.cancel()
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # A turn for the rest after each 10 tasks checked (none without the turns: the
        # job is checked before anything is awaited); and the refused job left nothing.
        assert turns >= 9
        assert gm.jobs.get("big") is None


async def test_a_big_job_cut_short_while_booked_is_queued_whole_by_its_retry(monkeypatch):
    # Its client gone while the GM booked it in turns: what was booked is undone, so the
    # client's retry (the same job id) queues every task, and each runs once.
    monkeypatch.setattr(gm_service, "TASKS_BETWEEN_TURNS", 100)
    async with embedded_federation("big-cut", workers=BIG) as (_config, gm, _bus, client):
        tasks = sim_tasks(2000, 0.01, cpu_milli=100)
        job = global_master_pb2.SubmitJobRequest(job_id="big")
        job.tasks.extend(tasks)
        submitting = asyncio.ensure_future(gm._submit_job(job))
        while not submitting.done():
            record = gm.jobs.get("big")
            if record is not None and 0 < record.size < 2000:
                submitting.cancel()  # in the middle of the booking
                break
            await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await submitting
        # Undone: each task ended REJECTED (not taken), the booked and the others alike.
        assert gm.jobs.get("big").counts() == {common_pb2.TASK_STATE_REJECTED: 2000}
        reply = await client.submit(tasks, job_id="big")
        assert len(reply.task_ids) == 2000
        await job_in_state(client, "big", common_pb2.TASK_STATE_SUCCEEDED, timeout_s=60)
