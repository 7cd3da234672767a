"""Contention rules: which GM gets room that frees up while every GM wants it (issue 29).

Every GM hears of every ended task (lifecycle events) at about the same moment. Without a
rule, every GM with a backlog sends a task to the same freed node; one wins, the others
are rejected (an inconsistency each) and the winner is whoever's message came first, so
when the federation is full a GM's users wait as long as its luck in that race.

``OwnerFirst`` is the rule the design implies: a node's free resources are accounted to its
owner partition, so its owner has the first claim on them.

    task ended on node n of LM l ──GlobalView.release──▶ OwnerFirst.freed(l, n, now)
        n in this GM's partition: nothing (it is this GM's to take at once)
        n in another GM's partition: held for its owner; this GM is not woken for it
    GlobalView._search, external partitions ──OwnerFirst.exclude──▶ held nodes skipped
    a snapshot of l shows n (heartbeat, reply) ──OwnerFirst.seen──▶ anyone's: the view
        now says whether the owner took the room, so no GM races the owner for it
    no snapshot within grace_s (OwnerFirst.expire) ──▶ anyone's; ``next_due`` tells the
        scheduler when to look again (``RoundPlan.recheck_in``)

Measured (issue 29, ``docs/results.md``, the Yahoo sample, 10 GMs x 10 LMs, against the
same runs without it): inconsistencies per task 6.77 -> 0.42 (3,000 workers), 0.70 ->
0.09 (5,000), 0.025 -> 0.009 (7,500); mean allocation time -25 %, -6 %, +9 %; p99 +25 %,
-2 %, -90 %; light load (10,000) unchanged. Its cost: a GM with little work gets its own
partition's room at once, so the per-GM spread of mean allocation times grows (the
fastest GM gets faster). Tried and dropped: a short grace alone (50 ms, then anyone's):
non-owners then raced the owner for the node it had just taken, as their views did not
know it yet (at 5,000 workers 0.60 inconsistencies per task instead of 0.70).
"""

from __future__ import annotations

from collections import deque

import numpy as np
from bitarray import bitarray
from bitarray.util import zeros

# The longest a hold lasts when no snapshot of the LM comes (lost heartbeats): a
# snapshot ends it first, one heartbeat interval at most after the end. A node whose owner
# had nothing to place there idles that long; tasks run minutes (Yahoo: 11 on average),
# and an owner with nothing to place is an owner whose partition has idle room anyway.
OWNER_GRACE_S = 30.0


class OwnerFirst:
    """Freed room on a node of another GM's partition is left to that GM for a grace.

    Assumptions: every GM hears of an end at about the same time, and the owner, if it has
    work that fits, places it before the LM's next snapshot reaches the others. Nothing is
    sent between GMs: each GM holds back by itself, so a GM that is down or idle delays
    the others by a heartbeat interval at most (``grace_s`` if heartbeats are lost).
    Internal matches are never held back, and nodes no one freed lately (idle room a
    snapshot showed) are anyone's: borrowing idle room stays as fast as before.

    Algorithm:
    1. ``freed(lm, node, now)``: this GM heard that a task on ``node`` of another GM's
       partition ended: the node is held until ``now + grace_s`` (a later end extends it).
    2. ``seen(lm, nodes)``: a snapshot showed ``nodes`` as they are: their holds end.
    3. ``expire(now)``: holds that are due end. ``epoch`` counts the times holds ended by
       2 or 3, so a cache of failed matches knows it is stale.
    4. ``exclude(lm, within)``: the candidates ``within`` less the nodes held on ``lm``.
    5. ``next_due()``: when the next hold ends, to try parked work again then.

    Off where user queues have shares (Alg. 2, ``Scheduler``): a partition is room to
    schedule from, not an entitlement beyond a queue's share.
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
            if self._until.get((lm_id, node)) == until:  # not extended, nor seen since
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

    def seen(self, lm_id: str, nodes: np.ndarray | None) -> None:
        """A snapshot of ``lm_id`` showed ``nodes`` as they are now (None: every node): a
        hold on them ends, as this GM now knows whether the owner took the room."""
        held = self._held.get(lm_id)
        if held is None or not held.any():
            return
        ours = list(held.search(1))  # a few nodes; ``nodes`` may be every node
        if nodes is not None:
            shown = np.zeros(len(held), dtype=bool)
            shown[nodes[nodes < len(held)]] = True
            ours = [node for node in ours if shown[node]]
        for node in ours:
            held[node] = 0
            del self._until[(lm_id, node)]
        if ours:
            self.epoch += 1

    def next_due(self) -> float | None:
        return self._due[0][0] if self._due else None

    def forget(self, lm_id: str) -> None:
        """The LM restarted (its node rows may be other nodes now) or was dropped."""
        if self._held.pop(lm_id, None) is not None:
            self._until = {k: v for k, v in self._until.items() if k[0] != lm_id}
            self._due = deque(d for d in self._due if d[1] != lm_id)
            self.epoch += 1
