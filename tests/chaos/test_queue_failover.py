"""The GM serving a queue is killed, and another GM serves it (#30's queue failover).

``queue_failover: true``: every GM consumes every user queue with RabbitMQ's single
active consumer, each GM first its own queues (``queues[].gm``, the preference). A steady
stream of submissions goes to both queues, in bursts of jobs sent at once on a stream
(a GM publishes the jobs it takes together as one message, ``TaskBatch.more_jobs``,
whose every job is checked when redelivered); gm-1, which serves queue ``a``, is killed
(-9) mid-stream and stays down. Checked with an independent event recorder
(``loadgen.invariants``): every acknowledged task ends, no (task, attempt) starts twice
(the redelivered messages are checked against what the LMs launched, fenced), and a task
of ``a`` submitted after the kill starts within 5 s. Then gm-1 comes back as a standby:
gm-2 keeps the queue (the broker does not hand it back), and the GMs say who serves what
(``QueueStatus.served_here``, shown by ``megha status``)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from loadgen.invariants import check
from services._proto.megha.v1 import common_pb2
from services.common.client import GlobalMasterClient
from services.core.states import TERMINAL
from services.global_master.service import PROBE_EVERY_S, STANDBY_AFTER_S
from tests.integration.harness import Federation, sim_tasks

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

QUEUES = [{"name": "a", "share": 0.5, "gm": "gm-1"}, {"name": "b", "share": 0.5, "gm": "gm-2"}]
CPU = 500
LOAD_S = 12.0
KILL_AT_S = 4.3  # at the next tick (5 s): a second after a burst of queue a through gm-1
EVERY_S = 1.0  # a burst of BURST jobs
BURST = 5
TARGET_S = 5.0
DEADLINE_S = 90


async def _serving(fed: Federation, gm_ids: list[str]) -> dict[str, set[str]]:
    """Queue -> the GMs (of those asked that answer) that say they serve it."""
    found: dict[str, set[str]] = {q["name"]: set() for q in QUEUES}
    for gm_id in gm_ids:
        with contextlib.suppress(grpc.aio.AioRpcError):
            view = await asyncio.wait_for(fed.gm(gm_id).cluster(), 5)
            for q in view.queues:
                if q.served_here:
                    found[q.queue].add(gm_id)
    return found


async def _until_served(fed: Federation, gm_ids: list[str], wanted: dict[str, set[str]]):
    deadline = time.monotonic() + STANDBY_AFTER_S + 4 * PROBE_EVERY_S + 5
    while (serving := await _serving(fed, gm_ids)) != wanted:
        assert time.monotonic() < deadline, f"serving {serving}, wanted {wanted}"
        await asyncio.sleep(0.2)


async def test_the_gm_serving_a_queue_killed_another_serves_it_nothing_lost_or_twice(tmp_path):
    fed = Federation(
        tmp_path,
        gms=2,
        lms=2,
        workers_per_lm=4,
        capacity="cpu=1,mem=8Gi",  # 16 slots of CPU: the load below slightly more
        queues=QUEUES,
        queue_failover=True,
        metrics=True,
    )
    async with fed:
        for gm_id in ("gm-1", "gm-2"):  # SubmitStream: a burst's jobs reach a GM together
            fed.clients[gm_id] = GlobalMasterClient(fed.config.gm(gm_id).target, streaming=True)
        # Each GM serves its own queue: it subscribed first (the other a little later).
        await _until_served(fed, ["gm-1", "gm-2"], {"a": {"gm-1"}, "b": {"gm-2"}})

        acknowledged: set[str] = set()
        jobs: list[str] = []
        refused: list[str] = []
        sent_at: dict[str, float] = {}  # job -> when sent, from the load's start
        began = time.monotonic()
        killed_at = 0.0

        async def submit(n: int) -> None:
            queue = "a" if n // BURST % 2 == 0 else "b"
            # Through gm-1 while it lives (it serves a: the message goes through the broker
            # to it), then through gm-2.
            gm_id = "gm-1" if not killed_at and n // BURST % 4 < 2 else "gm-2"
            job_id = f"{queue}-{n}"
            sent_at[job_id] = time.monotonic() - began
            try:
                reply = await asyncio.wait_for(
                    fed.gm(gm_id).submit(
                        sim_tasks(2, 3.0 if queue == "a" else 0.5, cpu_milli=CPU), queue, job_id
                    ),
                    20,
                )
            except (grpc.aio.AioRpcError, TimeoutError) as err:
                refused.append(f"{job_id} via {gm_id}: {err!r}"[:200])
                return
            jobs.append(job_id)
            acknowledged.update(reply.task_ids)

        submissions, n = [], 0
        while (now := time.monotonic() - began) < LOAD_S:
            if not killed_at and now >= KILL_AT_S:
                fed.children.kill("gm-gm-1")  # kill -9, and it stays down
                killed_at = time.monotonic() - began
            submissions += [asyncio.create_task(submit(n + k)) for k in range(BURST)]
            n += BURST
            await asyncio.sleep(EVERY_S)
        await asyncio.gather(*submissions)

        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            ended = {e.task_id for e in fed.events.events if e.state in TERMINAL}
            if acknowledged <= ended:
                break
            await asyncio.sleep(1.0)
        await asyncio.sleep(1.0)  # a second run would show by now
        events = list(fed.events.events)
        nodes = {e.node_id for e in events if e.node_id}
        report = check(
            events, acknowledged, dict.fromkeys(acknowledged, CPU), dict.fromkeys(nodes, 1000)
        )
        redelivered = fed.log("gm-gm-2").count("a message redelivered")
        published = await fed.metric("gm-2", "megha_queue_message_jobs_total")
        messages = await fed.metric("gm-2", "megha_queue_messages_total")
        # Served again: the first start of a task of queue a sent after the kill.
        first_start = min(
            (
                e.timestamps.started_unix_nanos
                for e in events
                if e.state == common_pb2.TASK_STATE_RUNNING
                and e.queue == "a"
                and sent_at.get(e.job_id, -1.0) >= killed_at
            ),
            default=None,
        )
        assert first_start is not None, f"queue a never served after the kill; {refused[:3]}"
        kill_unix = time.time() - (time.monotonic() - began - killed_at)
        served_after_s = first_start / 1e9 - kill_unix
        print(
            f"\nkill -9 gm-1 at {killed_at:.1f} s; {len(jobs)} jobs accepted, {len(refused)} "
            f"refused ({refused[:2]}); queue a's first task sent after the kill started "
            f"{served_after_s:.2f} s after it; {report.summary()}; {redelivered} messages "
            f"redelivered to gm-2; gm-2 published {published:.0f} jobs in {messages:.0f} "
            "messages"
        )
        assert report.ok, "\n".join(str(v) for v in report.violations[:20])
        assert not refused, refused[:5]
        assert served_after_s <= TARGET_S
        assert await _serving(fed, ["gm-2"]) == {"a": {"gm-2"}, "b": {"gm-2"}}

        # gm-1 back: a standby now; the broker keeps delivering both queues to gm-2.
        fed.children.restart("gm-gm-1")
        await asyncio.sleep(STANDBY_AFTER_S + 2 * PROBE_EVERY_S)
        await _until_served(fed, ["gm-1", "gm-2"], {"a": {"gm-2"}, "b": {"gm-2"}})
        later = await fed.gm("gm-1").submit(sim_tasks(4, 0.1, cpu_milli=CPU), "a", "later")
        await fed.events.wait_succeeded(set(later.task_ids), timeout_s=30)
        assert max(fed.events.succeeded().values()) == 1
