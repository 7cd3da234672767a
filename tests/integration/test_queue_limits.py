"""Queue limits: a queue never holds more than its ``limit`` across the federation, its
tasks wait with the reason while it is reached, other queues are not held back, and a
task bigger than the limit is refused at submission (through any GM)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, embedded_federation, sim_tasks

pytestmark = pytest.mark.integration

QUEUES = [
    {"name": "capped", "share": 0.5, "gm": "gm-1", "limit": "cpu=3"},
    {"name": "open", "share": 0.5, "gm": "gm-2"},
]


def most_at_once(events: list[common_pb2.TaskEvent], task_ids: set[str]) -> int:
    """The most of ``task_ids`` that ran at the same moment, from the start and finish
    stamps their workers put in the SUCCEEDED events."""
    edges = []
    for e in events:
        if e.state == common_pb2.TASK_STATE_SUCCEEDED and e.task_id in task_ids:
            edges += [(e.timestamps.started_unix_nanos, 1), (e.timestamps.finished_unix_nanos, -1)]
    running = most = 0
    for _, step in sorted(edges):  # at equal stamps an end (-1) sorts before a start
        running += step
        most = max(most, running)
    return most


async def test_a_queue_never_holds_more_than_its_limit_and_others_are_not_held_back(tmp_path):
    # 2 LMs x 2 nodes x 4 CPUs = 16 CPUs: without the limit all 12 tasks run at once.
    async with Federation(
        tmp_path,
        gms=2,
        lms=2,
        workers_per_lm=2,
        capacity="cpu=4,mem=8Gi",
        queues=QUEUES,
        metrics=True,
    ) as fed:
        # Submitted through gm-2, which does not serve the queue: gm-1 places them.
        capped = await fed.gm("gm-2").submit(sim_tasks(12, 0.6), queue="capped")
        open_ = await fed.gm("gm-2").submit(sim_tasks(12, 0.6), queue="open")

        # While the limit holds tasks back, they say why (gm-1 serves the queue).
        deadline = time.monotonic() + 10
        while True:
            job = await fed.gm("gm-1").job(capped.job_id)
            reasons = {t.pending_reason for t in job.tasks if t.pending_reason}
            if any("is at its limit" in r for r in reasons):
                break
            assert time.monotonic() < deadline, job
            await asyncio.sleep(0.05)
        assert (
            "queue 'capped' is at its limit (cpu 3 of 3 held, needs 1); "
            "waiting for its tasks to end" in reasons
        )
        status = await fed.gm("gm-1").cluster()
        (row,) = (q for q in status.queues if q.queue == "capped")
        assert row.limit.cpu_milli == 3000 and row.limit.memory_mb == 0
        assert 0 < row.held.cpu_milli <= 3000
        # The autoscaler's demand leaves out what the limit holds back: 6 or more tasks
        # wait now, but at most the 3 CPUs' worth a node could let run (none, once held).
        waiting = (await fed.gm("gm-1").cluster(pending_shapes=True)).pending_shapes
        assert sum(s.count for s in waiting if s.queue == "capped") <= 3

        # Prometheus: the limit, and what the queue holds of it (a gauge set every second).
        limit = 'megha_queue_limit{queue="capped",resource="cpu_milli"}'
        held = 'megha_queue_held{queue="capped",resource="cpu_milli"}'
        deadline = time.monotonic() + 5
        while await fed.metric("gm-1", limit) != 3000:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        assert 0 <= await fed.metric("gm-1", held) <= 3000
        assert (
            await fed.metric("gm-1", 'megha_queue_limit{queue="capped",resource="memory_mb"}') == 0
        )

        await fed.events.wait_succeeded({*capped.task_ids, *open_.task_ids}, timeout_s=60)
        assert most_at_once(fed.events.events, set(capped.task_ids)) == 3
        assert most_at_once(fed.events.events, set(open_.task_ids)) >= 6

        # Bigger than the limit: refused whichever GM is asked, and nothing is queued.
        for gm in ("gm-1", "gm-2"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await fed.gm(gm).submit(sim_tasks(1, 0.1, cpu_milli=4000), queue="capped")
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert refused.value.details().endswith(
                "can never run here: it asks for more than queue 'capped' may ever hold (cpu 4 > 3)"
            )

        megha = [sys.executable, "-m", "services.cli", "status", "--config", str(fed.config_path)]
        shown = await asyncio.to_thread(
            subprocess.run, megha, capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0, shown.stderr
        lines = {line.split()[0]: line for line in shown.stdout.splitlines() if line.strip()}
        assert lines["capped"].endswith("cpu 0/3"), shown.stdout
        assert lines["open"].endswith(" -"), shown.stdout


async def test_a_gm_that_has_not_heard_from_every_lm_holds_a_limited_queue_a_while():
    """Right after a GM starts, an LM it has not heard from may hold tasks of the queue:
    counting without them could overshoot the limit. So the queue waits, saying why,
    until the LM is heard from or ``limit_settle_s`` has passed (lm-2 never runs here)."""
    queues = [{"name": "capped", "share": 1.0, "gm": "gm-1", "limit": "cpu=2"}]
    async with embedded_federation(
        "limits-settle", silent_lms=1, queues=queues, full_state_every=10
    ) as (_config, gm, _bus, client):
        settled_at = gm._started_at + gm.limit_settle_s  # 3 full states: 6 s
        assert time.monotonic() < settled_at - 1, "the federation took too long to start"
        job = await client.submit(sim_tasks(4, 0.2), queue="capped")
        reasons: set[str] = set()
        deadline = time.monotonic() + 5
        while not reasons:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
            reasons = {t.pending_reason for t in (await client.job(job.job_id)).tasks} - {""}
        (reason,) = reasons
        assert reason.startswith(
            "this GM has not heard from lm-2 yet, so it does not know what the queue holds "
            "against its limit; waiting at most"
        )
        queued = common_pb2.TASK_STATE_QUEUED
        while all(t.state == queued for t in (await client.job(job.job_id)).tasks):
            await asyncio.sleep(0.02)
        assert time.monotonic() >= settled_at - 0.05
        deadline = time.monotonic() + 20
        while True:
            tasks = (await client.job(job.job_id)).tasks
            if all(t.state == common_pb2.TASK_STATE_SUCCEEDED for t in tasks):
                break
            assert time.monotonic() < deadline, tasks
            await asyncio.sleep(0.1)


async def test_a_queued_task_over_a_lowered_limit_is_rejected_when_its_gm_comes_back(tmp_path):
    """A task queued while its queue's limit allowed it, then the limit lowered below it
    (edit the file, restart the GM serving the queue): it could never run, so the GM
    rejects it, with the reason, instead of holding it for ever."""
    queues = [
        {"name": "capped", "share": 0.5, "gm": "gm-1", "limit": "cpu=4"},
        {"name": "open", "share": 0.5, "gm": "gm-2"},
    ]
    async with Federation(tmp_path, gms=2, lms=1, workers_per_lm=2, queues=queues) as fed:
        fed.children.kill("gm-gm-1")  # the message waits on the broker meanwhile
        job = await fed.gm("gm-2").submit(sim_tasks(2, 0.2, cpu_milli=3000), queue="capped")
        lowered = fed.config_path.read_text().replace("limit: cpu=4", "limit: cpu=2")
        assert lowered != fed.config_path.read_text()
        fed.config_path.write_text(lowered)
        fed.children.restart("gm-gm-1")
        ended = {f"{job.job_id}.0", f"{job.job_id}.1"}
        deadline = time.monotonic() + 30
        while not ended <= set(fed.events.states(common_pb2.TASK_STATE_REJECTED)):
            assert time.monotonic() < deadline, "the tasks were not rejected"
            await asyncio.sleep(0.1)
        (reason,) = {
            e.reason for e in fed.events.events if e.state == common_pb2.TASK_STATE_REJECTED
        }
        assert reason == (
            "can never run here: it asks for more than queue 'capped' may ever hold (cpu 3 > 2)"
        )
        states = {t.state for t in (await fed.gm("gm-1").job(job.job_id)).tasks}
        assert states == {common_pb2.TASK_STATE_REJECTED}
