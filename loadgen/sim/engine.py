"""The discrete-event engine: a heap of ``(time_ns, seq, handler, args)`` and a virtual clock.

Handlers run in time order; ``seq`` breaks ties in scheduling order, so a run is a pure
function of its inputs and seed. (The progress line a run draws is
``services/common/progress.py``.)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

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
