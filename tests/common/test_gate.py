"""A client's gate: at most ``limit`` jobs in flight, the rest wait their turn in order,
each for a bounded time, on a future rather than a timer of its own."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.client import GlobalMasterClient
from services.common.gate import Gate


async def test_past_the_limit_jobs_wait_and_pass_in_the_order_they_came() -> None:
    gate = Gate(2)
    assert await gate.enter(1.0) and await gate.enter(1.0)
    passed: list[int] = []

    async def job(n: int) -> None:
        assert await gate.enter(5.0)
        passed.append(n)

    waiting = [asyncio.create_task(job(n)) for n in range(3)]
    await asyncio.sleep(0.01)
    assert passed == [] and gate.waiting == 3 and gate.held == 2
    gate.leave()
    await asyncio.sleep(0.01)
    assert passed == [0]
    gate.leave()
    gate.leave()
    await asyncio.gather(*waiting)
    assert passed == [0, 1, 2] and gate.held == 3 - 1  # two left, three came in


async def test_a_job_whose_turn_does_not_come_in_time_is_refused() -> None:
    gate = Gate(1)
    assert await gate.enter(1.0)
    assert not await gate.enter(0)  # no wait at all: refused at once
    loop = asyncio.get_running_loop()
    began = loop.time()
    first, second = (asyncio.create_task(gate.enter(s)) for s in (0.05, 0.1))
    assert not await first and not await second
    assert 0.09 <= loop.time() - began < 1.0
    assert gate.waiting == 0 and gate.held == 1
    gate.leave()  # nobody waits: the place is free
    assert gate.held == 0 and await gate.enter(0)


async def test_a_cancelled_waiter_is_passed_over_and_a_place_is_never_lost() -> None:
    gate = Gate(1)
    assert await gate.enter(1.0)
    cancelled = asyncio.create_task(gate.enter(5.0))
    later = asyncio.create_task(gate.enter(5.0))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    await asyncio.sleep(0.01)
    assert gate.waiting == 1
    gate.leave()
    assert await later and gate.held == 1
    # Handed a place just as it was cancelled: it hands the place on.
    handed = asyncio.create_task(gate.enter(5.0))
    after = asyncio.create_task(gate.enter(5.0))
    await asyncio.sleep(0.01)
    gate.leave()  # ``handed`` gets the place ...
    handed.cancel()  # ... and is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await handed
    assert await after and gate.held == 1


async def test_a_job_that_cannot_have_its_turn_in_time_is_refused_at_once() -> None:
    """At the pace places came free lately, a job behind too many waiters is refused
    without waiting out its bound (no future, no timer kept for it)."""
    gate = Gate(1)
    assert await gate.enter(1.0)
    for _ in range(20):  # a place comes free and is taken again: 20 in about 0.1 s
        gate.leave()
        assert await gate.enter(1.0)
        await asyncio.sleep(0.005)
    rate = gate.pace.per_s(asyncio.get_running_loop().time())
    assert 50 < rate < 400
    ahead = [asyncio.create_task(gate.enter(30.0)) for _ in range(int(rate * 0.5))]
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert gate.refuses(0.2) and not gate.refuses(30.0)  # told before entering
    assert not await gate.enter(0.2)  # ~0.5 s behind the others: refused at once
    assert loop.time() - began < 0.05 and gate.waiting == len(ahead)
    patient = asyncio.create_task(gate.enter(30.0))  # time enough: it waits its turn
    ahead.append(patient)
    await asyncio.sleep(0.01)
    assert not patient.done() and gate.waiting == len(ahead)
    for task in ahead:
        task.cancel()
    await asyncio.gather(*ahead, return_exceptions=True)
    assert gate.waiting == 0


async def test_a_client_tells_a_job_refused_at_once_before_any_call() -> None:
    """``refused_unsent``: what ``submit`` would refuse at once, unsent, is told (and
    counted) without a call or a coroutine; what would go or wait its turn is not."""
    client = GlobalMasterClient("127.0.0.1:1")
    client.gate = gate = Gate(1)
    try:
        assert client.refused_unsent(busy_tries=1) is None  # a place is free
        assert await gate.enter(1.0)
        assert client.refused_unsent(busy_tries=1) is None  # no pace yet: it would wait
        for _ in range(20):
            gate.leave()
            assert await gate.enter(1.0)
            await asyncio.sleep(0.005)
        rate = gate.pace.per_s(asyncio.get_running_loop().time())
        ahead = [asyncio.create_task(gate.enter(30.0)) for _ in range(int(rate * 3))]
        await asyncio.sleep(0)
        # One busy try may wait 1.1 s (a 0.1 s pause, a 1 s answer); 3 s of waiters ahead.
        refusal = client.refused_unsent(busy_tries=1)
        assert refusal is not None and refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "not sent" in refusal.details() and client.not_admitted == 1
        assert client.refused_unsent(busy_tries=8) is None  # 24 s: time for its turn
        assert client.not_admitted == 1 and gate.waiting == len(ahead)
        for task in ahead:
            task.cancel()
        await asyncio.gather(*ahead, return_exceptions=True)
    finally:
        await client.close()


def test_a_gate_lets_at_least_one_through() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Gate(0)


async def test_a_client_keeps_at_most_its_limit_of_jobs_in_flight(monkeypatch) -> None:
    """Behind the gate a job sends nothing: the GM sees at most ``limit`` jobs at once, and
    one whose turn does not come within its tries' bound is refused unsent, counted."""
    client = GlobalMasterClient("127.0.0.1:1")
    client.gate = Gate(2)
    in_flight, most = [0], [0]
    release = asyncio.Event()

    async def submit_once(request):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        try:
            await release.wait()
            return request.job_id
        finally:
            in_flight[0] -= 1

    monkeypatch.setattr(client, "_submit_once", submit_once)
    try:
        jobs = [asyncio.create_task(client.submit([], job_id=f"j{n}")) for n in range(5)]
        await asyncio.sleep(0.05)
        assert most[0] == 2 and client.gate.waiting == 3
        # One busy try's bound (0.1 s pause + 1 s answer) passes behind the other five.
        turns: list[tuple[float, bool]] = []
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.submit([], job_id="late", busy_tries=1, on_turn=lambda *t: turns.append(t))
        ((waited, admitted),) = turns
        assert 1.0 <= waited < 5.0 and not admitted
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "not sent" in refused.value.details() and client.not_admitted == 1
        release.set()
        assert await asyncio.gather(*jobs) == [f"j{n}" for n in range(5)]
        assert most[0] == 2 and client.gate.held == 0
    finally:
        await client.close()
