"""A client's gate for its submissions: at most ``limit`` jobs in flight, the rest waiting
their turn, first come first served (issue 32, item 1).

A client that offers more than its GM takes used to send every job at once and retry each
on its own after its pauses: at 10,000 one-task jobs a second offered to a federation
placing about 3,000, the load generator held some 200,000 jobs, each waking on its own
timer to be refused again or kept back by its throttle (2.7 million such wakes in a 20 s
run). That took the load generator 78 % of a core, on the cores the federation runs on,
and the federation placed 136 tasks a second (``megha-loadgen bench-live --rate 10000``).

Behind the gate a job waits on a future, not a timer: it costs nothing until a job in
flight ends and hands it its place. The jobs in flight are the only ones that try, pause
and retry, so the work a refused try costs is bounded by ``limit``, however much the
caller offers. Each waiter has a deadline (the time its tries would have taken in all):
one timer, for the earliest deadline, refuses those whose turn did not come in time. A job
that would wait behind more than can pass before its deadline, at the pace places came
free lately (``services/core/throttle.py``'s ``Pace``), is refused at once instead.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque

from services.core.throttle import Pace

# Per client: one of a GM's largest stream messages (``MAX_COALESCED``). What is in flight
# waits, so this bounds a try's wait: at 10,000 one-task jobs a second offered (bench-live,
# 2 GMs, docs/overload.md), 256 placed 2,637 / 2,073 tasks/s with every try answered
# within 1 s (p99 0.34 / 0.48 s), 1,024 placed 2,489 / 2,637 with 512 tries answered after
# more than 1 s (p99 0.83 / 0.79 s); at 3,000 offered, 256 placed 2,954 / 2,770 and 1,024
# 2,983 / 2,930 (p99 0.31-0.34 s against 0.53-0.64 s).
IN_FLIGHT = 256


class Gate:
    """At most ``limit`` holders at once; ``enter`` waits its turn, ``leave`` hands it on."""

    def __init__(self, limit: int = IN_FLIGHT) -> None:
        if limit < 1:
            raise ValueError(f"a gate lets at least one job through, not {limit}")
        self.limit = limit
        self.held = 0
        self._waiting: deque[asyncio.Future[bool]] = deque()  # in the order they came
        # The same waiters by deadline (and arrival, for ties), for the one timer.
        self._deadlines: list[tuple[float, int, asyncio.Future[bool]]] = []
        self._arrivals = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._queued = 0  # of ``_waiting``, those still waiting
        self.pace = Pace()

    @property
    def waiting(self) -> int:
        """How many wait their turn."""
        return self._queued

    async def enter(self, within_s: float) -> bool:
        """Take a place: True once one is free, False if none was within ``within_s``
        seconds. One who gets True must ``leave``."""
        if self.held < self.limit and not self._queued:
            self.held += 1
            return True
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._hopeless(within_s, now):
            return False
        turn: asyncio.Future[bool] = loop.create_future()
        self._waiting.append(turn)
        self._queued += 1
        deadline = now + within_s
        heapq.heappush(self._deadlines, (deadline, next(self._arrivals), turn))
        if self._timer is None or deadline < self._timer.when():
            self._arm(loop)
        try:
            return await turn
        except asyncio.CancelledError:
            if turn.cancelled():
                self._queued -= 1  # left waiting
            elif turn.result():
                self.leave()  # handed a place as it was cancelled: hand it on
            raise

    def refuses(self, within_s: float) -> bool:
        """Whether ``enter(within_s)`` now would refuse at once, without waiting."""
        if self.held < self.limit and not self._queued:
            return False
        return self._hopeless(within_s, asyncio.get_running_loop().time())

    def _hopeless(self, within_s: float, now: float) -> bool:
        # Its turn comes once a place came free for each waiter before it, and one for it.
        return within_s <= 0 or self.pace.hopeless(self._queued + 1, within_s, now)

    def leave(self) -> None:
        """A holder is done: its place goes to the first waiter still waiting."""
        self.held -= 1
        self.pace.freed(asyncio.get_running_loop().time())
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                self.held += 1
                self._queued -= 1
                turn.set_result(True)
                return

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer, for the earliest deadline of a waiter still waiting (None: none)."""
        if self._timer is not None:
            self._timer.cancel()
        while self._deadlines and self._deadlines[0][2].done():
            heapq.heappop(self._deadlines)  # passed through or cancelled meanwhile
        self._timer = loop.call_at(self._deadlines[0][0], self._expire) if self._deadlines else None

    def _expire(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, turn = heapq.heappop(self._deadlines)
            if not turn.done():
                self._queued -= 1
                turn.set_result(False)
        self._timer = None
        self._arm(loop)
