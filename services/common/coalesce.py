"""Many writers, one stream: what they queue while a write is under way goes out together.

gRPC allows one write in flight per call, and each costs about as much whatever it
carries (services/bench_hops.py), so the writers of a shared call (the node streams of
a worker host's heartbeat call, both ways) queue their items here and one task writes
them: alone at light load, many to a message when they come faster than a write takes.

``Gatherer`` is the same for calls that are each answered on their own (a confirmed
broker publish): a few under way at once, and a failed one fails only what it carried.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class _Queued(Generic[T]):
    __slots__ = ("done", "item")

    def __init__(self, item: T, done: asyncio.Future[None] | None) -> None:
        self.item = item
        self.done = done


async def _until_done(queue: list[_Queued[T]], queued: _Queued[T]) -> None:
    """Wait for ``queued``'s write; cancelled before it began, it leaves ``queue``."""
    try:
        await queued.done  # type: ignore[misc]
    except asyncio.CancelledError:
        with contextlib.suppress(ValueError):
            queue.remove(queued)
        raise


class Coalescer(Generic[T]):
    """Writes queued items with ``write(items)``, one call at a time, as many per call as
    ``take(items)`` says of those waiting (at least one). If a write fails, every item
    queued fails with its error, and so does every later ``send``."""

    def __init__(
        self,
        write: Callable[[list[T]], Awaitable[None]],
        take: Callable[[Sequence[T]], int],
        name: str,
    ) -> None:
        self._write = write
        self._take = take
        self._queue: list[_Queued[T]] = []
        self._writing: list[_Queued[T]] = []  # taken by the write under way
        self._wake = asyncio.Event()
        self.error: BaseException | None = None
        self.task = asyncio.create_task(self._loop(), name=name)

    async def send(self, item: T) -> None:
        """Return once ``item`` is written; cancelled before its write began, it is not
        written at all (as a cancelled gRPC write)."""
        if self.error is not None:
            raise self.error
        queued = _Queued(item, asyncio.get_running_loop().create_future())
        self._queue.append(queued)
        self._wake.set()
        await _until_done(self._queue, queued)

    def send_nowait(self, item: T) -> None:
        """Queue ``item`` and wait for nothing (dropped once the writes failed)."""
        if self.error is None:
            self._queue.append(_Queued(item, None))
            self._wake.set()

    async def flush(self) -> None:
        """Return once everything queued so far is written, or the writes failed."""
        waiting = self._queue or self._writing
        if waiting and self.error is None:
            last = waiting[-1]
            if last.done is None:
                last.done = asyncio.get_running_loop().create_future()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(last.done)

    def fail(self, error: BaseException) -> None:
        """No more writes: what waits fails with ``error``, as will every later send."""
        if self.error is None:
            self.error = error
        for queued in self._queue:
            if queued.done is not None and not queued.done.done():
                queued.done.set_exception(self.error)
        self._queue.clear()
        self._wake.set()

    def stop(self) -> None:
        """Cancel the writing task (what waits fails CancelledError)."""
        self.task.cancel()

    async def _loop(self) -> None:
        try:
            while self.error is None:
                await self._wake.wait()
                self._wake.clear()
                while self._queue and self.error is None:
                    items = [q.item for q in self._queue]
                    count = max(1, self._take(items))
                    taken = self._writing = self._queue[:count]
                    del self._queue[:count]
                    try:
                        await self._write(items[:count])
                    except BaseException:
                        self._queue[:0] = taken  # they fail with the rest
                        raise
                    finally:
                        self._writing = []
                    for queued in taken:
                        if queued.done is not None and not queued.done.done():
                            queued.done.set_result(None)
        except asyncio.CancelledError:
            self.fail(asyncio.CancelledError())
            raise
        except BaseException as err:  # the stream broke under the write
            self.fail(err)


class Gatherer(Generic[T]):
    """Sends queued items with ``send_many(items)``, at most ``in_flight`` calls under way
    at once, each with as many of the waiting items as ``take(items)`` says (at least
    one): alone while calls are free, together once they come faster than calls end.
    Each sender gets its own call's outcome: a call that fails fails only its items."""

    def __init__(
        self,
        send_many: Callable[[list[T]], Awaitable[None]],
        take: Callable[[Sequence[T]], int],
        name: str,
        in_flight: int = 1,
    ) -> None:
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, got {in_flight}")
        self._send_many = send_many
        self._take = take
        self._name = name
        self._limit = in_flight
        self._queue: list[_Queued[T]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = 0  # tasks in ``_run`` (a finished one is off at once, unlike _tasks)
        self.calls = 0  # calls made (each counted when it starts)
        self.items = 0  # items they carried

    async def send(self, item: T) -> None:
        """Return once the call carrying ``item`` succeeded, or raise its error; cancelled
        before a call took it, it is not sent at all."""
        queued = _Queued(item, asyncio.get_running_loop().create_future())
        self._queue.append(queued)
        if self._running < self._limit:
            self._running += 1
            task = asyncio.create_task(self._run(), name=self._name)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await _until_done(self._queue, queued)

    def stop(self) -> None:
        """Cancel the calls under way (their senders fail CancelledError) and drop what
        waits (its senders too)."""
        for queued in self._queue:
            if queued.done is not None:
                queued.done.cancel()
        self._queue.clear()
        for task in self._tasks:
            task.cancel()

    async def _run(self) -> None:
        try:
            while self._queue:
                await self._call()
        finally:
            self._running -= 1

    async def _call(self) -> None:
        items = [q.item for q in self._queue]
        count = max(1, self._take(items))
        taken = self._queue[:count]
        del self._queue[:count]
        self.calls += 1
        self.items += len(taken)
        try:
            await self._send_many(items[:count])
        except Exception as err:
            for queued in taken:
                if queued.done is not None and not queued.done.done():
                    queued.done.set_exception(err)
            return
        except BaseException:
            for queued in taken:
                if queued.done is not None:
                    queued.done.cancel()
            raise
        for queued in taken:
            if queued.done is not None and not queued.done.done():
                queued.done.set_result(None)
