"""Two GMs with backlogs on a full federation share the freed workers (issue 29, item 6).

Every slot is taken and both GMs hold a backlog of short tasks, so each end frees a worker
both GMs want. With the OwnerFirst rule (``owner_grace_s``, services/core/contention.py)
room freed on a GM's partition is its own first, so over the run each GM starts about as
many tasks as its partitions free; without it, whoever hears of an end first races the
other for the node. Asserted: while both GMs have tasks waiting, the numbers of tasks
they start on freed workers are within 1.5x of each other.

Measured here (one sitting, alternating): ratios 1.00-1.13 with the rule, 1.09 and 1.10
with ``owner_grace_s: 0``. Live, the race is not won by a fixed GM as it was in the
simulator's fixed order (which gave the last GM 150x the waits): each end reaches both
GMs over the broker in no set order. So this test guards the live property, and would
fail on a driver that favoured one GM, not on the rule's absence alone."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, sim_tasks

QUEUES = [{"name": "a", "share": 0.5, "gm": "gm-1"}, {"name": "b", "share": 0.5, "gm": "gm-2"}]
TASKS, TASK_S = 120, 0.25  # per GM; 8 one-CPU slots: about 7.5 s of backlog
SLOTS = 8
RATIO = 1.5


async def share_of_freed_workers(tmp_path, **overrides) -> tuple[Counter, int]:
    """Tasks each queue (each GM) started while both still had some waiting."""
    async with Federation(
        tmp_path, gms=2, lms=2, workers_per_lm=4, capacity="cpu=1,mem=2Gi", queues=QUEUES,
        **overrides,
    ) as fed:  # fmt: skip
        jobs = await asyncio.gather(
            fed.gm("gm-1").submit(sim_tasks(TASKS, TASK_S), queue="a"),
            fed.gm("gm-2").submit(sim_tasks(TASKS, TASK_S), queue="b"),
        )
        await fed.events.wait_succeeded({t for j in jobs for t in j.task_ids}, timeout_s=60)
        starts = sorted(
            (e.timestamps.started_unix_nanos, e.queue)
            for e in fed.events.events
            if e.state == common_pb2.TASK_STATE_RUNNING and e.timestamps.started_unix_nanos
        )
        # Freed workers: after the first SLOTS starts (the empty federation filled), up to
        # the moment one queue started its last task (both had work waiting till then).
        seen: Counter = Counter()
        total: Counter = Counter()
        for i, (_, queue) in enumerate(starts):
            total[queue] += 1
            if i >= SLOTS:
                seen[queue] += 1
            if total[queue] == TASKS:
                break
        return seen, len(starts)


@pytest.mark.slow  # ~20 s: run apart by .ci/run (MEGHA_SLOW_TESTS=1)
async def test_two_gms_with_backlogs_share_freed_workers_within_1_5x(tmp_path):
    seen, _ = await share_of_freed_workers(tmp_path)
    ratio = max(seen.values()) / max(1, min(seen["a"], seen["b"]))
    print(f"\nstarts while both waited: {dict(seen)} (ratio {ratio:.2f})")
    assert ratio <= RATIO, seen


async def older_starts_on_freed_workers(tmp_path, claims: str) -> str:
    """Both queues at their share on a full federation (``WIDE // 2`` long tasks each);
    then queue a's second job, and a second later queue b's, wait for room. The long
    tasks end: who got the first ``WIDE`` freed workers, in order of start ('A' the older
    job, 'b' the younger)."""
    async with Federation(
        tmp_path, gms=2, lms=2, workers_per_lm=WIDE // 2, capacity="cpu=1,mem=2Gi",
        queues=QUEUES, claims=claims,
    ) as fed:  # fmt: skip
        long = await asyncio.gather(
            fed.gm("gm-1").submit(sim_tasks(WIDE // 2, LONG_S), queue="a"),
            fed.gm("gm-2").submit(sim_tasks(WIDE // 2, LONG_S), queue="b"),
        )
        await fed.events.wait_running({t for j in long for t in j.task_ids}, timeout_s=10)
        older = await fed.gm("gm-1").submit(sim_tasks(WAITING, TASK_S), queue="a")
        await asyncio.sleep(1.0)
        younger = await fed.gm("gm-2").submit(sim_tasks(WAITING, TASK_S), queue="b")
        second = {*older.task_ids, *younger.task_ids}
        await fed.events.wait_succeeded(second, timeout_s=60)
        starts = sorted(
            (e.timestamps.started_unix_nanos, e.task_id)
            for e in fed.events.events
            if e.state == common_pb2.TASK_STATE_RUNNING and e.task_id in second
        )
        mine = set(older.task_ids)
        return "".join("A" if task_id in mine else "b" for _, task_id in starts[:WIDE])


WIDE = 16  # slots: twice the other test's, so that one late report moves the share less
LONG_S = 3.0  # the tasks that hold every slot while the second jobs queue
WAITING = 32  # tasks of each second job


@pytest.mark.slow  # ~35 s: both rules, one after the other
async def test_with_claims_oldest_freed_workers_serve_the_older_work_first(tmp_path):
    (tmp_path / "oldest").mkdir()
    (tmp_path / "owner").mkdir()
    oldest = await older_starts_on_freed_workers(tmp_path / "oldest", "oldest")
    owner = await older_starts_on_freed_workers(tmp_path / "owner", "owner")
    print(f"\nthe first {WIDE} freed workers (A older, b younger): oldest {oldest}, owner {owner}")
    # Both queues are at their share (no preemption), and every slot frees within some
    # 20 ms. Under the owner rule (off with shares: the GMs race) the older job gets about
    # half of them. Under oldest it gets all until its queue is over its share; past
    # that, a GM's report that finds it so (every heartbeat) rightly hands the rest to the
    # younger job of the queue under its share (issue 29, item 3). So only the first
    # WIDE // 2 are the older job's by rule: all but one, allowing one node a snapshot
    # offered to both GMs before the claimant's launch landed. Measured (one sitting, also
    # with three CPU hogs): oldest AAAAAAAAAAAAAAAA x6; owner bbbbAAAAbbbbAAAA,
    # bbbbbbbbbbbbAAAA, AAAAbbbbAAAAbbbb, AAAAbAbbbAAAAAAA; a CI run's oldest: 9 of 16.
    assert oldest[: WIDE // 2].count("A") >= WIDE // 2 - 1, (oldest, owner)
