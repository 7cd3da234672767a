"""Contention rules: which GM gets room that frees up while every GM wants it (issue 29).

Every GM hears of every ended task (lifecycle events) at about the same moment. Without a
rule, every GM with a backlog sends a task to the same freed node; one wins, the others
are rejected (an inconsistency each) and the winner is whoever's message came first, so
when the federation is full a GM's users wait as long as its luck in that race.

``OwnerFirst`` is the rule the design implies: a node's free resources are accounted to its
owner partition, so its owner has the first claim on them.

    task ended on node n of LM l ──GlobalView.release──▶ OwnerFirst.freed(l, n, now)
        n in this GM's partition: nothing (it is this GM's to take at once)
        n in another GM's partition: held for its owner until now + grace_s
    GlobalView._search, external partitions ──OwnerFirst.exclude──▶ held nodes skipped
    grace over (OwnerFirst.expire) ──▶ anyone's, as before; ``next_due`` tells the
        scheduler when to look again (``RoundPlan.recheck_in``)
"""

from __future__ import annotations

from collections import deque

from bitarray import bitarray
from bitarray.util import zeros

# Long enough for the owner to hear of the end and run a round (the simulator: 0.5 ms per
# message, a few ms per round; live: a GM's event loop and its round), short against the
# seconds a task runs, so a node whose owner has nothing to place there idles little.
OWNER_GRACE_S = 0.05


class OwnerFirst:
    """Freed room on a node of another GM's partition is left to that GM for a grace.

    Assumptions: every GM hears of an end at about the same time, and the owner, if it has
    work that fits, places it within ``grace_s``. Nothing is sent between GMs: each GM
    holds back by itself, so a GM that is down or idle delays others by ``grace_s`` at
    most. Internal matches are never held back, and nodes no one freed lately (idle room a
    heartbeat showed) are anyone's.

    Algorithm:
    1. ``freed(lm, node, now)``: this GM heard that a task on ``node`` of another GM's
       partition ended: the node is held until ``now + grace_s`` (a later end extends it).
    2. ``expire(now)``: holds that are due end; ``epoch`` counts the times some did, so a
       cache of failed matches knows it is stale.
    3. ``exclude(lm, within)``: the candidates ``within`` less the nodes held on ``lm``.
    4. ``next_due()``: when the next hold ends, to try parked work again then.
    """

    def __init__(self, grace_s: float = OWNER_GRACE_S):
        if grace_s <= 0:
            raise ValueError(f"grace_s must be positive, got {grace_s}")
        self.grace_s = grace_s
        self.epoch = 0
        self._held: dict[str, bitarray] = {}  # per LM, bit i: node i is held
        self._until: dict[tuple[str, int], float] = {}
        self._due: deque[tuple[float, str, int]] = deque()  # in time order

    def freed(self, lm_id: str, size: int, node: int, now: float) -> None:
        held = self._held.get(lm_id)
        if held is None or len(held) < size:
            grown = zeros(size)
            if held is not None:
                grown[: len(held)] = held
            held = self._held[lm_id] = grown
        held[node] = 1
        until = now + self.grace_s
        self._until[(lm_id, node)] = until
        self._due.append((until, lm_id, node))

    def expire(self, now: float) -> None:
        due = self._due
        ended = False
        while due and due[0][0] <= now:
            until, lm_id, node = due.popleft()
            if self._until.get((lm_id, node)) == until:  # not extended by a later end
                del self._until[(lm_id, node)]
                self._held[lm_id][node] = 0
                ended = True
        if ended:
            self.epoch += 1

    def exclude(self, lm_id: str, within: bitarray) -> bitarray:
        held = self._held.get(lm_id)
        if held is None or not held.any():
            return within
        if len(held) > len(within):  # the LM's table shrank (rebuilt)
            held = held[: len(within)]
        elif len(held) < len(within):  # it grew: the new nodes are not held
            held = held + zeros(len(within) - len(held))
        return within & ~held

    def next_due(self) -> float | None:
        return self._due[0][0] if self._due else None

    def forget(self, lm_id: str) -> None:
        """The LM restarted (its node rows may be other nodes now) or was dropped."""
        if self._held.pop(lm_id, None) is not None:
            self._until = {k: v for k, v in self._until.items() if k[0] != lm_id}
            self._due = deque(d for d in self._due if d[1] != lm_id)
            self.epoch += 1
