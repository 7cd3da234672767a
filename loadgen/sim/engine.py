"""The discrete-event engine: a heap of ``(time_ns, seq, handler, args)`` and a virtual clock.

Handlers run in time order; ``seq`` breaks ties in scheduling order, so a run is a pure
function of its inputs and seed. Wall time is read only to redraw the progress line.
"""

from __future__ import annotations

import heapq
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

Handler = Callable[..., None]


class Engine:
    def __init__(self) -> None:
        self.now = 0  # virtual nanoseconds
        self.events = 0
        self.stopped = False
        self._heap: list[tuple[int, int, Handler, tuple[Any, ...]]] = []
        self._seq = 0

    def at(self, when_ns: int, handler: Handler, *args: Any) -> None:
        """Run ``handler(*args)`` at virtual time ``when_ns`` (never in the past)."""
        if when_ns < self.now:
            raise ValueError(f"event at {when_ns} ns is before the clock ({self.now} ns)")
        heapq.heappush(self._heap, (when_ns, self._seq, handler, args))
        self._seq += 1

    def stop(self) -> None:
        """Leave the loop after the current handler (e.g. every task finished)."""
        self.stopped = True

    def run(self, tick: Callable[[], None] | None = None, tick_every: int = 16_384) -> None:
        heap, pop = self._heap, heapq.heappop
        base, count = self.events, 0
        while heap and not self.stopped:
            when, _, handler, args = pop(heap)
            self.now = when
            handler(*args)
            count += 1
            if tick is not None and count % tick_every == 0:
                self.events = base + count
                tick()
        self.events = base + count

    def __len__(self) -> int:
        return len(self._heap)


class Progress:
    """One status line, redrawn at most twice a second (a plain line per 5 s off a tty)."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._period = 0.5 if self.tty else 5.0
        self._last = 0.0
        self._dirty = False

    def show(self, line: Callable[[], str], force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self._period:
            return
        self._last = now
        if self.tty:
            self.stream.write(f"\r{line()}\x1b[K")
            self._dirty = True
        else:
            self.stream.write(line() + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self._dirty:
            self.stream.write("\n")
            self.stream.flush()
            self._dirty = False


def bar(fraction: float, width: int = 24) -> str:
    filled = max(0, min(width, int(fraction * width)))
    return "[" + "#" * filled + "." * (width - filled) + "]"
