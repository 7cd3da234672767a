"""A GM restarted while a launch of its earlier life waits at a frozen LM, and a client's
retry of that job relayed by the other GM: each task runs once.

The fault-injection simulation found this order running a task twice (``megha-loadgen
chaos-sim --seed 1178``, one of 3,000 seeds; ``tests/loadgen/test_chaos_sim.py``): the
restarted GM took the relayed message (queued after it started, not redelivered) as new,
its book did not know the task its earlier life had launched at the frozen LM, and it
placed the task again; the LM, resumed, read the old launch (younger than its expiry)
before any fence. Now, until every LM has said what it holds (``_catch_up``), a GM
fences the tasks of every message it takes. Live, this test has passed with and without
that change in our runs (the relayed copy did not overtake the redelivered original's
fence here): it checks the scenario end to end, not the ordering the simulation found.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter

import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, sim_tasks

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUNNING = common_pb2.TASK_STATE_RUNNING


async def test_a_retry_relayed_to_a_restarted_gm_does_not_run_a_frozen_lms_task_again(
    tmp_path,
):
    async with Federation(
        tmp_path, gms=2, lms=2, workers_per_lm=2, worker_timeout_s=30, lm_call_timeout_s=1
    ) as fed:
        frozen = fed.children.procs["lm-lm-2"]
        tasks = sim_tasks(8, 3.0)  # room for all 8 on either LM
        frozen.send_signal(signal.SIGSTOP)
        try:
            reply = await fed.gm("gm-1").submit(tasks, job_id="j-retry")
            await asyncio.sleep(0.3)  # launched: some of them to the frozen LM
            fed.children.kill("gm-gm-1")
            fed.children.restart("gm-gm-1")
            await asyncio.sleep(3.0)  # it takes its queue (and the message) again
            # The client did not hear back (say) and retries through the other GM,
            # which relays what it does not know as placed into gm-1's queue.
            again = await fed.gm("gm-2").submit(tasks, job_id="j-retry")
            assert set(again.task_ids) == set(reply.task_ids)
            await asyncio.sleep(3.0)  # the relayed message reaches gm-1
        finally:
            frozen.send_signal(signal.SIGCONT)
        await fed.events.wait_succeeded(set(reply.task_ids), timeout_s=60)
        await asyncio.sleep(2)  # a second run would have shown by now
        runs = Counter(e.task_id for e in fed.events.events if e.state == RUNNING)
        assert max(fed.events.succeeded().values()) == 1, fed.events.succeeded()
        assert max(runs.values()) == 1, runs
