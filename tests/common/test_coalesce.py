"""The coalescing writer of a shared stream (``services.common.coalesce``)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.coalesce import Coalescer, Gatherer


class Stream:
    """A stream whose writes take as long as the test says."""

    def __init__(self) -> None:
        self.messages: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.broken: BaseException | None = None

    async def write(self, items: list[int]) -> None:
        await self.gate.wait()
        if self.broken is not None:
            raise self.broken
        self.messages.append(items)


async def test_what_queues_while_a_write_is_under_way_goes_in_the_next_message() -> None:
    stream = Stream()
    out: Coalescer[int] = Coalescer(stream.write, lambda waiting: 3, "test")
    first = asyncio.create_task(out.send(0))
    await asyncio.sleep(0)  # the writer takes 0 alone
    stream.gate.clear()
    await asyncio.sleep(0)
    later = [asyncio.create_task(out.send(i)) for i in range(1, 6)]
    await asyncio.sleep(0.01)
    stream.gate.set()
    await asyncio.gather(first, *later)
    assert stream.messages == [[0], [1, 2, 3], [4, 5]]  # at most ``take`` per message
    out.stop()


async def test_a_send_cancelled_before_its_write_began_is_never_written() -> None:
    stream = Stream()
    out: Coalescer[int] = Coalescer(stream.write, lambda waiting: 1, "test")
    stream.gate.clear()
    under_way = asyncio.create_task(out.send(1))
    await asyncio.sleep(0.01)  # 1 is being written
    dropped = asyncio.create_task(out.send(2))
    await asyncio.sleep(0)
    dropped.cancel()
    stream.gate.set()
    await under_way
    await out.flush()
    assert stream.messages == [[1]]
    out.stop()


async def test_a_broken_write_fails_what_waits_and_every_later_send() -> None:
    stream = Stream()
    out: Coalescer[int] = Coalescer(stream.write, lambda waiting: 1, "test")
    stream.gate.clear()
    sends = [asyncio.create_task(out.send(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    stream.broken = ConnectionResetError("gone")
    stream.gate.set()
    for send in sends:
        with pytest.raises(ConnectionResetError):
            await send
    with pytest.raises(ConnectionResetError):
        await out.send(9)
    out.send_nowait(10)  # dropped, not raised
    assert stream.messages == []
    await out.flush()  # returns at once


async def test_flush_waits_for_what_was_queued_without_waiting() -> None:
    stream = Stream()
    out: Coalescer[int] = Coalescer(stream.write, lambda waiting: 10, "test")
    stream.gate.clear()
    out.send_nowait(1)
    out.send_nowait(2)
    flushed = asyncio.create_task(out.flush())
    await asyncio.sleep(0.01)
    assert not flushed.done()
    stream.gate.set()
    await flushed
    assert stream.messages == [[1, 2]]
    out.stop()


async def _turns() -> None:
    """Long enough for every task woken to run (a send's call starts a turn after it)."""
    for _ in range(5):
        await asyncio.sleep(0)


class Confirmed:
    """Calls answered one by one, in the order the test releases them."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.answers: list[asyncio.Future[None]] = []

    async def send_many(self, items: list[int]) -> None:
        self.calls.append(items)
        answer = asyncio.get_running_loop().create_future()
        self.answers.append(answer)
        await answer


async def test_a_gatherer_sends_alone_while_a_call_is_free_then_together() -> None:
    broker = Confirmed()
    out: Gatherer[int] = Gatherer(broker.send_many, lambda waiting: 10, "test", in_flight=2)
    sends = [asyncio.create_task(out.send(0))]
    await _turns()
    sends.append(asyncio.create_task(out.send(1)))
    await _turns()
    assert broker.calls == [[0], [1]]  # two calls free: each went at once
    sends += [asyncio.create_task(out.send(i)) for i in range(2, 6)]
    await _turns()
    assert broker.calls == [[0], [1]]  # both under way: the rest wait
    broker.answers[1].set_result(None)
    await _turns()
    assert sends[1].done() and not sends[0].done()
    assert broker.calls == [[0], [1], [2, 3, 4, 5]]  # together in the freed call
    broker.answers[0].set_result(None)
    broker.answers[2].set_result(None)
    await asyncio.gather(*sends)
    assert (out.calls, out.items) == (3, 6)


async def test_a_failed_call_fails_only_what_it_carried() -> None:
    broker = Confirmed()
    out: Gatherer[int] = Gatherer(broker.send_many, lambda waiting: 2, "test")
    first = asyncio.create_task(out.send(0))
    await _turns()
    rest = [asyncio.create_task(out.send(i)) for i in range(1, 4)]
    await _turns()
    broker.answers[0].set_exception(ConnectionError("nacked"))
    await _turns()
    with pytest.raises(ConnectionError):
        await first
    assert broker.calls == [[0], [1, 2]]  # ``take`` said two
    broker.answers[1].set_result(None)
    await _turns()
    broker.answers[2].set_result(None)
    await asyncio.gather(*rest)
    assert broker.calls == [[0], [1, 2], [3]]


async def test_a_send_cancelled_before_its_call_is_not_sent() -> None:
    broker = Confirmed()
    out: Gatherer[int] = Gatherer(broker.send_many, lambda waiting: 10, "test")
    first = asyncio.create_task(out.send(0))
    await _turns()
    gone = asyncio.create_task(out.send(1))
    kept = asyncio.create_task(out.send(2))
    await _turns()
    gone.cancel()
    await _turns()
    broker.answers[0].set_result(None)
    await _turns()
    broker.answers[1].set_result(None)
    await asyncio.gather(first, kept)
    assert broker.calls == [[0], [2]]


async def test_stop_fails_what_waits_and_what_is_under_way() -> None:
    broker = Confirmed()
    out: Gatherer[int] = Gatherer(broker.send_many, lambda waiting: 10, "test")
    sends = [asyncio.create_task(out.send(i)) for i in range(3)]
    await _turns()
    sends.append(asyncio.create_task(out.send(3)))
    await _turns()
    out.stop()
    results = await asyncio.gather(*sends, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    with pytest.raises(ValueError):
        Gatherer(broker.send_many, lambda waiting: 1, "test", in_flight=0)
