"""How many tasks a live GM's scheduling round may take from each queue (issue 32,
item 3: no event-loop stall over 100 ms under overload).

A round runs on the GM's event loop without yielding: it matches every task it takes,
books it in the view and hands the launches to the loop, and meanwhile no submission is
read, no reply or heartbeat applied. With a fixed budget (``ROUND_PER_QUEUE`` tasks per
queue) a round's length is the budget times what one task costs, and that cost varies by
an order of magnitude: a full federation's misses cost more than an idle one's hits, a
busy host makes everything slower. With 50-task jobs offered past saturation the GMs'
loops ran late by more than 128 ms 116-142 times in a 20 s run; ``PYTHONASYNCIODEBUG=1``
named the GM's schedule task for 49 of its 54 slow steps, and one round re-parked 3,000
items in 0.38 s. (Bounding the rounds halved their p99 but not the stall count: on a host
the federation saturates, most stalls are a process waiting for a core; docs/overload.md.)

So the budget follows the rounds' length: after each round the driver tells how much work
it took (placed, or parked again: the live GM's scheduler charges both, ``charge_taken``)
and how long the round took (with handing its launches over). What the last round took
per item says how many fit in ``target_s``; the next budget is that, between ``least``
and ``most``, and grows at most twofold a round, only after a round that used its whole
budget (a round that ran out of work says nothing about a bigger one). A round that took
nothing changes nothing. A placement costs several times a parking, so a round mixing
them may run past the target by that ratio, one round at a time. Between rounds the GM's
loop serves everything else; a smaller budget costs a round's fixed overhead more often
and no throughput otherwise.

Pure: the driver measures the time. The simulator keeps the fixed budget (its rounds
cost virtual time by what they match, not by wall time).
"""

from __future__ import annotations

from services.core.scheduler import ROUND_PER_QUEUE

TARGET_S = 0.025  # a quarter of the 100 ms a loop may stall at most
LEAST = 16  # a round always moves some work
GROWTH = 2.0  # the most a budget grows from one round to the next


class RoundBudget:
    def __init__(
        self,
        target_s: float = TARGET_S,
        least: int = LEAST,
        most: int = ROUND_PER_QUEUE,
        growth: float = GROWTH,
    ):
        if target_s <= 0 or not 0 < least <= most or growth < 1:
            raise ValueError("a round budget needs target_s > 0, 0 < least <= most, growth >= 1")
        self.target_s = target_s
        self.least, self.most = least, most
        self.growth = growth
        self.budget = most

    def observe(self, taken: int, seconds: float) -> int:
        """A round took ``taken`` items of work in ``seconds``: the next round's budget."""
        if taken <= 0 or seconds < 0:
            return self.budget
        if taken * self.target_s >= self.most * seconds:  # the most fits (seconds may be 0)
            fits = self.most
        else:
            fits = int(taken * self.target_s / seconds)
        if fits > self.budget:
            if taken < self.budget:
                return self.budget  # it ran out of work: no sign a bigger round fits
            fits = min(fits, int(self.budget * self.growth))
        self.budget = max(self.least, min(self.most, fits))
        return self.budget
