"""Every process of a federation killed at once (a power cut, a host that goes down with
all its containers): what was running or waiting to start runs again, and nothing is
lost. RabbitMQ stays up, as a broker on its own host (or its durable queues) would."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from services._proto.megha.v1 import common_pb2
from services.common.requeue import RESTART_GRACE_S
from tests.integration.harness import Federation, job_in_state, lm_lookup, sim_tasks

pytestmark = pytest.mark.integration

RUNNING = common_pb2.TASK_STATE_RUNNING


async def lm_ended(fed: Federation, task_ids: list[str]) -> set[str]:
    """The tasks whose latest attempt lm-1 has seen end."""
    known = await lm_lookup(fed.config, task_ids)
    return {t.task_id for t in known if t.HasField("last_ended") and not t.running}


async def test_tasks_running_when_the_whole_federation_dies_run_again(tmp_path):
    # Before the LM journalled the tasks it accepted, nothing held them once the GM (its
    # book and its memory of unstarted launches), the LM and the workers had died
    # together: the queue messages were acked on acceptance, the new LM's books were
    # empty and no worker named them. They stayed RUNNING in no book, their job never ended.
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2) as fed:
        reply = await fed.gm().submit(sim_tasks(8, 3.0))
        ids = set(reply.task_ids)
        for _ in range(100):
            if set(fed.events.nodes_of(RUNNING)) >= ids:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the tasks never all ran")
        fed.children.crash()
        await fed.events.wait_succeeded(ids, timeout_s=60)
        job = await job_in_state(fed.gm(), reply.job_id, common_pb2.TASK_STATE_SUCCEEDED, 20)
        assert {t.task_id for t in job.tasks} == ids
        lost = Counter(
            e.task_id for e in fed.events.events if e.state == common_pb2.TASK_STATE_LOST
        )
        assert set(lost) == ids and max(lost.values()) == 1
        assert max(fed.events.succeeded().values()) == 1
        await fed.assert_books_balanced()


@pytest.mark.slow  # ~17 s: run apart by .ci/run (MEGHA_SLOW_TESTS=1), the default's budget
async def test_a_gm_back_before_an_lm_waits_to_hear_what_that_lm_launched(tmp_path):
    # gm-1 and lm-1 die while a job's message is still unacked (more tasks than fit)
    # and some of its tasks already ran on lm-1. The GM, back first, gets the message
    # again and must not take lm-1's silence for "launched none of them": those tasks
    # ran again on lm-2 (4 of 4 started twice) before the GM waited for lm-1's answer.
    async with Federation(tmp_path, gms=1, lms=2, workers_per_lm=2) as fed:
        reply = await fed.gm().submit(sim_tasks(48, 0.5, cpu_milli=2000))
        ids = set(reply.task_ids)
        for _ in range(100):
            ended_on_lm1 = {
                e.task_id
                for e in fed.events.events
                if e.state == common_pb2.TASK_STATE_SUCCEEDED and e.lm_id == "lm-1"
            }
            if len(ended_on_lm1) >= 4:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("no task ended on lm-1")
        fed.children.kill("gm-gm-1")
        fed.children.kill("lm-lm-1")
        fed.children.restart("gm-gm-1")
        await asyncio.sleep(4)  # the GM has the message back; lm-1 does not answer
        fed.children.restart("lm-lm-1")
        await fed.events.wait_succeeded(ids, timeout_s=90)
        await asyncio.sleep(1)
        assert max(fed.events.runs().values()) == 1


async def test_tasks_that_just_ended_do_not_run_again_after_a_whole_crash(tmp_path):
    # Killed a moment after its tasks ended (their events out): a journal written every
    # 0.2 s had not always got those endings (1 of 3 runs), the LM took the tasks for
    # still accepted and, its workers dead too, ran all 8 again. Now an ending is
    # written on the loop's next turn.
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2) as fed:
        reply = await fed.gm().submit(sim_tasks(8, 0.3))
        ids = set(reply.task_ids)
        await fed.events.wait_succeeded(ids, timeout_s=20)
        fed.children.crash()
        # Past the LM's grace for workers to name its tasks (worker_timeout_s + 5 s).
        await asyncio.sleep(fed.config.worker_timeout_s + RESTART_GRACE_S + 1)
        await job_in_state(fed.gm(), reply.job_id, common_pb2.TASK_STATE_SUCCEEDED, 30)
        assert max(fed.events.runs().values()) == 1
        assert not fed.events.states(common_pb2.TASK_STATE_LOST)


async def test_endings_journalled_but_not_yet_published_are_published_after_a_crash(tmp_path):
    # Events wait event_batch_s before they go out. An LM that died in between, with its
    # workers, took them along: the GMs learnt the endings (LookupTasks), but the event
    # stream (what bench-live and other consumers read) never carried them.
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2, event_batch_s=1.0) as fed:
        reply = await fed.gm().submit(sim_tasks(4, 0.1))
        ids = list(reply.task_ids)
        for _ in range(100):
            if len(await lm_ended(fed, ids)) == len(ids):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the tasks never ended on the LM")
        assert not fed.events.succeeded(), "published already: the test proves nothing"
        fed.children.crash()
        await fed.events.wait_succeeded(set(ids), timeout_s=30)
        assert max(fed.events.runs().values()) == 1
