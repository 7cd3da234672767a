"""The coalescing writer of a shared stream (``services.common.coalesce``)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.coalesce import Coalescer


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
