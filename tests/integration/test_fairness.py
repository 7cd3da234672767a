"""Global fairness (paper Alg. 2) on a live federation, as in the paper's Sec. VI-E."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import grpc
import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, sim_tasks

pytestmark = pytest.mark.integration

# Queue 1 -> GM 1, queues 2 and 3 -> GM 2, queue 4 -> GM 3 (paper Sec. VI-E).
SHARES = {"q1": 0.10, "q2": 0.25, "q3": 0.15, "q4": 0.50}
QUEUES = [
    {"name": "q1", "share": 0.10, "gm": "gm-1"},
    {"name": "q2", "share": 0.25, "gm": "gm-2"},
    {"name": "q3", "share": 0.15, "gm": "gm-2"},
    {"name": "q4", "share": 0.50, "gm": "gm-3"},
]

# Two queues of half the pool each, both served by gm-1.
BIG_SMALL = [
    {"name": "big", "share": 0.5, "gm": "gm-1"},
    {"name": "small", "share": 0.5, "gm": "gm-1"},
]


async def measure_shares(fed: Federation, seconds: float, warmup: float) -> dict[str, float]:
    """Time-averaged share of the federation's CPU each queue holds, from the LMs' books."""
    total_cpu = sum(g.count for g in fed.config.workers) * 1000
    held: dict[str, float] = defaultdict(float)
    samples = 0
    start = time.monotonic()
    while time.monotonic() - start < warmup + seconds:
        books = await fed.books()
        if time.monotonic() - start >= warmup:
            samples += 1
            for state in books.values():
                for allocation in state.allocations:
                    held[allocation.queue] += allocation.resources.cpu_milli / total_cpu
        await asyncio.sleep(0.1)
    return {q: held[q] / samples for q in SHARES}


@pytest.mark.slow  # ~28 s: run apart by .ci/run (MEGHA_SLOW_TESTS=1), the default's budget
async def test_backlogged_queues_converge_to_their_shares(tmp_path):
    groups = [{"lm": f"lm-{i}", "count": 10, "capacity": "cpu=1,mem=1Gi"} for i in (1, 2)]
    async with Federation(
        tmp_path, gms=3, lms=2, worker_groups=groups, queues=QUEUES, metrics=True
    ) as fed:
        for q in QUEUES:
            await fed.gm(q["gm"]).submit(sim_tasks(400, 1.0), queue=q["name"])
        shares = await measure_shares(fed, seconds=12, warmup=4)
        print({q: round(s, 3) for q, s in shares.items()})
        for queue, share in SHARES.items():
            assert abs(shares[queue] - share) <= 0.05, f"{queue}: {shares[queue]:.3f} vs {share}"
        # The serving GM's gauges say the same: its view of the share, and a backlog left.
        # A gauge is one 1 Hz sample of the GM's view (ends not yet heard of; the LMs'
        # own books swing by +-0.15 between samples on a loaded machine): the median of
        # five readings a refresh apart must track the share.
        readings: dict[str, list[float]] = defaultdict(list)
        for _ in range(5):
            for q in QUEUES:
                name, gm = q["name"], q["gm"]
                gauge = await fed.metric(gm, f'megha_queue_usage_share{{queue="{name}"}}')
                readings[name].append(gauge)
            await asyncio.sleep(1.1)
        for q in QUEUES:
            name, gm = q["name"], q["gm"]
            gauge = sorted(readings[name])[2]
            assert abs(gauge - SHARES[name]) <= 0.15, f"{name}: gauges {readings[name]}"
            assert await fed.metric(gm, f'megha_queue_pending_tasks{{queue="{name}"}}') > 0


async def test_no_contention_means_no_preemption(tmp_path):
    groups = [{"lm": f"lm-{i}", "count": 10, "capacity": "cpu=1,mem=1Gi"} for i in (1, 2)]
    async with Federation(
        tmp_path, gms=3, lms=2, worker_groups=groups, queues=QUEUES, metrics=True
    ) as fed:
        ids: set[str] = set()
        for q in QUEUES:  # 16 one-core tasks on 20 cores: room for everyone
            reply = await fed.gm(q["gm"]).submit(sim_tasks(4, 0.5), queue=q["name"])
            ids.update(reply.task_ids)
        await fed.events.wait_succeeded(ids, timeout_s=30)
        for gm in ("gm-1", "gm-2", "gm-3"):
            assert await fed.metric(gm, "megha_preemption_attempts_total") == 0
        assert not fed.events.states(common_pb2.TASK_STATE_PREEMPTED)


async def test_pending_tasks_say_why(tmp_path):
    groups = [{"lm": "lm-1", "count": 2, "capacity": "cpu=1,mem=1Gi"}]
    async with Federation(tmp_path, gms=1, lms=1, worker_groups=groups, queues=BIG_SMALL) as fed:
        hog = await fed.gm().submit(sim_tasks(4, 5.0), queue="big")
        await asyncio.sleep(1.0)
        job = await fed.gm().job(hog.job_id)
        waiting = [t for t in job.tasks if t.state == common_pb2.TASK_STATE_QUEUED]
        assert len(waiting) == 2
        for t in waiting:
            reason = t.pending_reason
            assert reason.startswith("queue big is over share (100% of 50%); "), reason
            assert "largest free on a matching node: cpu=0" in reason, reason
        # a task that needs more than any node has is refused at submit, never queued
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fed.gm().submit(sim_tasks(1, 1.0, cpu_milli=2000), queue="small")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no node is large enough" in err.value.details()


async def test_preempted_tasks_run_again_and_complete_exactly_once(tmp_path):
    groups = [{"lm": "lm-1", "count": 4, "capacity": "cpu=1,mem=1Gi"}]
    async with Federation(tmp_path, gms=1, lms=1, worker_groups=groups, queues=BIG_SMALL) as fed:
        hog = await fed.gm().submit(sim_tasks(8, 2.0), queue="big")
        await asyncio.sleep(1.0)  # the hog holds all 4 cores: 100 % of a 50 % share
        small = await fed.gm().submit(sim_tasks(2, 1.0), queue="small")
        ids = set(hog.task_ids) | set(small.task_ids)
        await fed.events.wait_succeeded(ids, timeout_s=40)
        preempted = fed.events.states(common_pb2.TASK_STATE_PREEMPTED)
        assert preempted, "the under-share queue never preempted"
        # Only the over-share queue loses tasks, and only while the other is under share:
        # its two one-core tasks bring it to 2 of 4 cores, its share, so at most two.
        assert set(preempted) <= set(hog.task_ids) and sum(preempted.values()) <= 2
        assert all(n == 1 for n in fed.events.succeeded().values())
        for task_id in preempted:
            trail = [
                (e.state, e.attempt)
                for e in fed.events.events
                if e.task_id == task_id and e.state != common_pb2.TASK_STATE_QUEUED
            ]
            at = trail.index((common_pb2.TASK_STATE_PREEMPTED, 0))
            assert (common_pb2.TASK_STATE_RUNNING, 1) in trail[at:], trail
            assert trail[-1] == (common_pb2.TASK_STATE_SUCCEEDED, 1), trail
        await asyncio.sleep(0.5)
        await fed.assert_books_balanced()


async def shares_and_preemptions(tmp_path, **overrides) -> tuple[dict[str, float], int]:
    groups = [{"lm": f"lm-{i}", "count": 10, "capacity": "cpu=1,mem=1Gi"} for i in (1, 2)]
    async with Federation(
        tmp_path, gms=3, lms=2, worker_groups=groups, queues=QUEUES, **overrides
    ) as fed:
        for q in QUEUES:
            await fed.gm(q["gm"]).submit(sim_tasks(400, 1.0), queue=q["name"])
        shares = await measure_shares(fed, seconds=12, warmup=4)
        return shares, len(fed.events.states(common_pb2.TASK_STATE_PREEMPTED))


@pytest.mark.slow  # ~45 s: two federations, one after the other
async def test_claims_oldest_with_a_slack_keeps_shares_with_fewer_preemptions(tmp_path):
    # Issue 29, item 3: freed room goes to queues within their share first, a queue over
    # its share yields while one under it waits, and Alg. 2 preempts only 2 pp below.
    # Each GM's backlog report says how many tasks each of its queues may still take
    # (its room under its share): every GM caps the claims alike. Before that (each GM
    # judging shares on its own view) this missed: q4 at 42 % of its 50 %, preemptions
    # not fewer (142 against 141). Measured after, 6 runs: shares within 3.3 pp, 52-70
    # preemptions against 145-156; on 2026-11-29, 9 runs: 49-71 against 134-153, so
    # the bound is 0.6x (one run of 71 against 136 missed "half"), not the 1x of no rule.
    (tmp_path / "rule").mkdir()
    (tmp_path / "alg2").mkdir()
    shares, preempted = await shares_and_preemptions(
        tmp_path / "rule", claims="oldest", preemption_slack=0.02
    )
    # Alg. 2 alone: with shares, ``claims: owner`` turns every contention rule off.
    _, before = await shares_and_preemptions(tmp_path / "alg2", claims="owner")
    measured = {q: round(s, 3) for q, s in shares.items()}
    print(f"\n{measured}: {preempted} preempted, {before} with Alg. 2 alone")
    for queue, share in SHARES.items():
        assert abs(shares[queue] - share) <= 0.05, f"{queue}: {shares[queue]:.3f} vs {share}"
    assert preempted < 0.6 * before, (preempted, before)
