"""Many writers, one stream: what they queue while a write is under way goes out together.

gRPC allows one write in flight per call, and each costs about as much whatever it
carries (services/bench_hops.py), so the writers of a shared call (the node streams of
a worker host's heartbeat call, both ways) queue their items here and one task writes
them: alone at light load, many to a message when they come faster than a write takes.
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
        try:
            await queued.done  # type: ignore[misc]
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):
                self._queue.remove(queued)
            raise

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
                    count = max(1, self._take([q.item for q in self._queue]))
                    taken = self._writing = self._queue[:count]
                    del self._queue[:count]
                    try:
                        await self._write([q.item for q in taken])
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
