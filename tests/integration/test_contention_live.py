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


# A third queue holds the federation while the two second jobs queue: its long tasks'
# ends leave a and b, both under their share, room to claim (a: 8 tasks, b: 6).
THREE = [
    {"name": "a", "share": 0.5, "gm": "gm-1"},
    {"name": "b", "share": 0.4, "gm": "gm-2"},
    {"name": "c", "share": 0.1, "gm": "gm-2"},
]


async def older_starts_on_freed_workers(tmp_path, claims: str) -> str:
    """Queue c's ``WIDE`` long tasks fill the federation; then queue a's job, and a second
    later queue b's, wait for room. The long tasks end: who got the first ``WIDE`` freed
    workers, in order of start ('A' the older job, 'b' the younger). No preemption (the
    slack is wider than any deficit here): only the claims decide."""
    async with Federation(
        tmp_path, gms=2, lms=2, workers_per_lm=WIDE // 2, capacity="cpu=1,mem=2Gi",
        queues=THREE, claims=claims, preemption_slack=0.9,
    ) as fed:  # fmt: skip
        long = await fed.gm("gm-2").submit(sim_tasks(WIDE, LONG_S), queue="c")
        await fed.events.wait_running(set(long.task_ids), timeout_s=10)
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
async def test_with_claims_oldest_freed_workers_fill_each_queues_room_older_first(tmp_path):
    (tmp_path / "oldest").mkdir()
    (tmp_path / "owner").mkdir()
    oldest = await older_starts_on_freed_workers(tmp_path / "oldest", "oldest")
    owner = await older_starts_on_freed_workers(tmp_path / "owner", "owner")
    print(f"\nthe first {WIDE} freed workers (A older, b younger): oldest {oldest}, owner {owner}")
    # Every slot frees within some 20 ms. Under the owner rule (off with shares: the GMs
    # race) the split is luck: A 4 to 12 of 16 in 9 runs. Under oldest each queue gets
    # its room under its share (a: 8, b: 6) and the older job the rest: A 10 and b 6 in
    # each of 9 runs. Which start comes first is not asserted: GMs hear the ends
    # of two LMs in different orders (each counts claims in the order it heard them), so
    # at times they name claimants for different nodes and some launches wait a snapshot
    # (AAAAbbbbAAAAbbAA, bbbbAAAAbAAAAbAA); and with one LM all claims land at once.
    # (Before each queue's claims were capped by its room, both queues started at their
    # share and the older job took every freed worker until a report found it over.)
    assert oldest.count("A") >= 8 and oldest.count("b") >= 6, (oldest, owner)
