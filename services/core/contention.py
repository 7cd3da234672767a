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

import heapq
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from bitarray import bitarray
from bitarray.util import zeros

from services.core.recent import RecentInts

# The longest a hold lasts when no snapshot of the LM comes (lost heartbeats): a
# snapshot ends it first, one heartbeat interval at most after the end. A node whose owner
# had nothing to place there idles that long; tasks run minutes (Yahoo: 11 on average),
# and an owner with nothing to place is an owner whose partition has idle room anyway.
OWNER_GRACE_S = 30.0
# Who has the first claim on room an end freed (``GlobalView(claims=...)``).
CLAIMS = ("owner", "oldest")
# The oldest runs of waiting work a GM's backlog report names (``OldestFirst``): more
# than the ends a federation hears between two reports at full load on the sweep's sizes.
BACKLOG_RUNS = 32
# How often each GM reports its backlog (``OldestFirst``), live and simulated: a burst
# younger than a report is served only as LMs' snapshots show room (every LM heartbeat:
# 10 s in the paper's simulations), so the reports come more often than that.
# docs/results.md (Contention, "reports"): 0.5-2 s all cut the 7,500-worker p99 from
# 3.4 s to 2.4-2.7 s (central's 2.36 s), and every run of the sweep and of three
# synthetic traces moved towards central's figures (one FIFO queue's).
BACKLOG_INTERVAL_S = 1.0
Run = tuple[float, int, str]  # waiting work: (enqueued, tasks, queue)


@dataclass(frozen=True, slots=True)
class Backlog:
    """A GM's report of its waiting work (``Scheduler.backlog``, ``Scheduler.room``),
    read once: each queue's runs as (enqueued, tasks), oldest first; ``room`` None when
    no queue has a share. The simulator hands the one object to every GM, and hands it
    again while the GM's work has not changed: a GM that hears the same object with
    nothing claimed on it since skips it (every GM only reads it)."""

    gm_id: str
    lanes: dict[str, tuple[tuple[float, int], ...]]
    room: Mapping[str, int] | None = None

    @classmethod
    def of(cls, gm_id: str, runs: Iterable[Run], room: Mapping[str, int] | None = None) -> Backlog:
        lanes: dict[str, list[tuple[float, int]]] = {}
        for at, n, queue in runs:
            if n > 0:
                lanes.setdefault(queue, []).append((float(at), int(n)))
        return cls(gm_id, {queue: tuple(lane) for queue, lane in lanes.items()}, room or None)


# Ends remembered as counted (``OldestFirst.first_heard``): an end's event and the
# snapshot showing it come within a heartbeat or two of each other.
COUNTED_ENDS = 100_000


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

    def mine(self, lm_id: str, node: int) -> bool:
        """Room an end freed on ``node`` is this GM's to take (``OldestFirst``: it is the
        claimant): a hold it kept there since an earlier end, for another GM, ends, or
        the claimant would pass its own room by until a snapshot offered it to all.
        Whether a hold ended (room this GM could not use before, it can now)."""
        held = self._held.get(lm_id)
        if held is not None and node < len(held) and held[node]:
            held[node] = 0
            del self._until[(lm_id, node)]
            self.epoch += 1
            return True
        return False

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
        if nodes is not None and len(nodes) <= 64:  # a delta's few rows
            shown = set(nodes.tolist())
            ours = [node for node in ours if node in shown]
        elif nodes is not None:
            mask = np.zeros(len(held), dtype=bool)
            mask[nodes[nodes < len(held)]] = True
            ours = [node for node in ours if mask[node]]
        for node in ours:
            held[node] = 0
            del self._until[(lm_id, node)]
        if ours:
            self.epoch += 1

    def next_due(self) -> float | None:
        """When the next hold still in force ends (a hold a snapshot ended or a later
        end renewed leaves its due entry behind: dropped here, or a recheck would wake
        the GM for nothing: most of an overloaded run's rounds were such)."""
        due, until = self._due, self._until
        while due and until.get((due[0][1], due[0][2])) != due[0][0]:
            due.popleft()
        return due[0][0] if due else None

    def claimant(self, queue: str = "") -> str | None:
        """Who has the first claim on the room the next end (of a task of ``queue``)
        frees: None, its node's owner. Called once for every end this GM hears, in the
        order heard."""
        return None

    def next_claimant(self, queue: str = "") -> str | None:
        """Who ``claimant`` would name now, without counting the claim."""
        return None

    def counted(self, task_id: str, attempt: int) -> bool:
        """Whether ``first_heard`` was true for this end already (it changes nothing)."""
        return False

    def first_heard(self, task_id: str, attempt: int) -> bool:
        """Whether this is the first time this GM hears of the end of ``task_id``'s
        attempt ``attempt`` (an end comes as an event and in a snapshot, in either
        order): only then does it count a claim. Under ``OwnerFirst``, always."""
        return True

    def forget(self, lm_id: str) -> None:
        """The LM restarted (its node rows may be other nodes now) or was dropped."""
        if self._held.pop(lm_id, None) is not None:
            self._until = {k: v for k, v in self._until.items() if k[0] != lm_id}
            self._due = deque(d for d in self._due if d[1] != lm_id)
            self.epoch += 1


class OldestFirst(OwnerFirst):
    """Freed room goes to the GM whose work has waited longest: a federation-wide FIFO
    without a coordinator (issue 29, item 2: the idea ``OwnerFirst`` left open).

    With ``OwnerFirst`` a full federation is ten clusters of a tenth each: a burst on one
    GM waits for its own partition while the others serve younger work. Here every GM
    reports its backlog (``backlog``: the oldest runs of its waiting work as (enqueued,
    tasks, queue), every ``BACKLOG_INTERVAL_S``, to every GM), and every GM hears every end in
    the same order, so each names the same claimant for each end without asking anyone:

        end heard ──▶ claimant = the GM whose oldest unclaimed run is oldest, of the
                      queues with room under their share (``room``, below); ties: the
                      lower GM id; that run is one task shorter
            claimant is this GM ──▶ its to take now (as its own partition's room; a
                                  hold it kept there for another GM since the node's
                                  last end ends, ``mine``: the end's event names the
                                  node even when this GM never saw the task)
            another GM ──▶ held for it: excluded from this GM's search, internal too,
                           until a snapshot shows the node or ``grace_s`` passes
            no GM reports waiting work ──▶ the owner's (``OwnerFirst``)
        a GM's report ──▶ replaces what it reported before (claims on it start over)

    An end is heard twice, as an event and in the LM's next snapshot, in either order
    (live, the snapshot often comes first): the first counts its claim, the second
    nothing (``first_heard``), so room a snapshot shows freed is held as an event's is.

    All waiting work is reported, every ``BACKLOG_INTERVAL_S``, however young: work
    placed before the report reaches anyone leaves its claims to a GM with nothing to
    place, a node idle until a snapshot shows it (at most a report interval's worth of
    ends); work left out waits for the LMs' snapshots to show it room while the ends
    go to owners with nothing waiting. Measured (``docs/results.md``, Contention,
    "reports"): reporting only work a report interval old, every 10 s heartbeat, the
    7,500-worker p99 was 3.4 s (1.46x central's) for a burst of one GM's; all work every
    second, 2.4 s (1.02x). While no GM reports work the owner rule serves as before.

    With user-queue shares (Alg. 2) each report also says, for each queue with waiting
    work, how many tasks it may still take before it is over its share (``room``, judged
    by the queue's own GM: ``Scheduler.room``); a queue claims no more than that, plus
    one task for each end of one of its own tasks heard since (the end names the task's
    queue). Every GM counts the same claims from the same reports and ends, so all agree
    which queue may claim, and room goes to the oldest work within its share (fairness
    preempts for a queue under it as before). When every queue is at its share, each end
    goes back to the queue whose task ended: shares hold through a wave of ends. And a
    queue over its share takes no room at all while some GM reports work of a queue
    under its share waiting (``Scheduler`` asks ``waiting_queues``): room it took then is
    room Alg. 2 would preempt back.

    Measured (``docs/results.md``, Fairness): before ``room``, each GM left out the
    queues *its own view* found over their share, so GMs named different claimants, and
    a queue under its share at its report took room for a whole report interval after
    passing it; a burst of 1,600 one-second tasks on 20 workers (0.25 s heartbeats) held
    q1 at 12.8 % of its 10 % and q4 at 41.7 % of 50 % (94 s for 80 s of work). With it:
    every share within 0.1 pp, 79 preemptions against Alg. 2's 717, 82 s.

    Assumptions: an end frees room for one task of the claimant's (true of one-slot
    traces; a bigger task waits for the next snapshot, as under
    ``OwnerFirst``); a GM reports its own backlog to itself as to the others, so all
    count the same claims; an end's room suits a task of any queue (one-slot traces), so
    an end of a queue's task is one more task that queue may take.
    Stale reports cost idle room, never a double booking: a claimant with nothing that
    fits leaves the node, which a snapshot then offers to all.
    """

    def __init__(self, gm_id: str, grace_s: float = OWNER_GRACE_S):
        super().__init__(grace_s)
        self.gm_id = gm_id
        # Per GM, per queue it reported waiting work of: [its runs of (enqueued, tasks),
        # the index of its oldest run with tasks unclaimed, the tasks of it claimed so
        # far] (changed in place: a claim allocates nothing, so it wakes no GC).
        self._lanes: dict[str, dict[str, list]] = {}
        # (enqueued of its oldest unclaimed run, GM, queue) of the lanes that may claim.
        self._heads: list[tuple[float, str, str]] = []
        # Per queue with a share: the tasks it may still claim (its GM's last report, plus
        # one per end of one of its tasks heard since, less its claims since); a lane of
        # a queue with none waits in ``_blocked`` until an end of that queue comes.
        self._credit: dict[str, int] = {}
        self._blocked: dict[str, list[tuple[float, str, str]]] = {}
        self._waiting: frozenset[str] = frozenset()  # queues with work reported waiting
        # Task id -> the newest attempt whose end was counted (``first_heard``).
        self._counted = RecentInts(COUNTED_ENDS)
        # Per GM, the report its lanes come from, and the GMs claimed from since theirs.
        self._heard: dict[str, Backlog] = {}
        self._claimed: set[str] = set()

    def counted(self, task_id: str, attempt: int) -> bool:
        counted = self._counted.get(task_id)
        return counted is not None and counted >= attempt

    def first_heard(self, task_id: str, attempt: int) -> bool:
        return self._counted.put_above(task_id, attempt)

    def backlog(
        self, gm_id: str, runs: Iterable[Run], room: Mapping[str, int] | None = None
    ) -> None:
        """``gm_id`` reported its waiting work: runs of (enqueued, tasks, queue), oldest
        first; ``room``: for its queues with a share, the tasks each may still take
        before it is over its share (``Scheduler.backlog``): they claim no more than
        that, plus one per end of one of their tasks heard until the next report."""
        self.backlogs((Backlog.of(gm_id, runs, room),))

    def backlogs(self, reports: Iterable[Backlog]) -> None:
        """Several GMs' reports, heard one after another with nothing between them: the
        same as ``backlog`` for each, the claims' order made once (the simulator hears
        every GM's report at once). A report heard again (the same object) with nothing
        claimed on it since, and no room in it, changes nothing and is skipped."""
        changed = False
        for report in reports:
            gm_id = report.gm_id
            if (
                report.room is None
                and self._heard.get(gm_id) is report
                and gm_id not in self._claimed
            ):
                continue
            if not report.lanes and not self._lanes.get(gm_id) and not report.room:
                continue
            self._lanes[gm_id] = {queue: [queued, 0, 0] for queue, queued in report.lanes.items()}
            self._heard[gm_id] = report
            self._claimed.discard(gm_id)
            if report.room:
                self._credit.update(report.room)
            changed = True
        if changed:
            self._waiting = frozenset(queue for mine in self._lanes.values() for queue in mine)
            self._heap()

    def waiting_queues(self) -> frozenset[str]:
        """The queues some GM last reported waiting work of."""
        return self._waiting

    def _heap(self) -> None:
        heads, blocked = [], {}
        for gm_id, mine in self._lanes.items():
            for queue, (queued, index, _used) in mine.items():
                head = (queued[index][0], gm_id, queue)
                if self._credit.get(queue, 1) > 0:
                    heads.append(head)
                else:
                    blocked.setdefault(queue, []).append(head)
        heapq.heapify(heads)
        self._heads, self._blocked = heads, blocked

    def _ended(self, queue: str) -> None:
        """An end of one of ``queue``'s tasks: it may claim one task more."""
        credit = self._credit.get(queue)
        if credit is None:
            return
        self._credit[queue] = credit + 1
        if credit == 0:  # it may claim again: its blocked lanes go back to the heap
            for head in self._blocked.pop(queue, ()):
                heapq.heappush(self._heads, head)

    def _may(self, lane: str, queue: str) -> bool:
        """Whether ``lane``'s queue may claim the room an end of ``queue``'s task frees."""
        credit = self._credit.get(lane)
        if credit is None:
            return True
        return credit + (lane == queue) > 0

    def next_claimant(self, queue: str = "") -> str | None:
        """Who ``claimant(queue)`` would name now, without counting the claim."""
        heads, blocked = self._heads, self._blocked
        if not blocked and not self._credit:  # no shares: the heap's top (every end)
            return heads[0][1] if heads else None
        if not heads and not blocked:
            return None
        may = [head for head in heads if self._may(head[2], queue)]
        may += (head for head in blocked.get(queue, ()) if self._may(queue, queue))
        if not may:  # no queue with room waits: the oldest work of any (``claimant``)
            may = heads + [head for lanes in blocked.values() for head in lanes]
        return min(may)[1]

    def claimant(self, queue: str = "") -> str | None:
        """Who the room an end of a task of ``queue`` frees is for: one task of the
        oldest run whose queue has room; if no queue with room waits, of the oldest run
        of any (room no waiting queue may take would idle until a snapshot offered it to
        all: a queue at its share has none, and Alg. 2 is there if this puts one over).
        None: no GM reported waiting work."""
        heads, credit, blocked = self._heads, self._credit, self._blocked
        if credit:  # shares: room counts (else every lane may claim: the heap's top)
            self._ended(queue)
            while heads and credit.get(heads[0][2], 1) <= 0:
                head = heapq.heappop(heads)
                blocked.setdefault(head[2], []).append(head)
        if heads:
            head = heads[0]
        elif blocked:
            head = min(head for lanes in blocked.values() for head in lanes)
        else:
            return None
        _, gm_id, lane = head
        if lane in credit:
            credit[lane] -= 1
        state = self._lanes[gm_id][lane]
        queued, index = state[0], state[1]
        state[2] += 1
        self._claimed.add(gm_id)
        if state[2] < queued[index][1]:
            return gm_id
        if index + 1 < len(queued):
            state[1], state[2] = index + 1, 0
            following = (queued[index + 1][0], gm_id, lane)
        else:
            del self._lanes[gm_id][lane]
            following = None
        if heads:
            if following is None:
                heapq.heappop(heads)
            else:
                heapq.heapreplace(heads, following)
        else:
            lanes = blocked[lane]
            lanes.remove(head)
            if following is not None:
                lanes.append(following)
            elif not lanes:
                del blocked[lane]
        return gm_id


def contention_rule(claims: str, gm_id: str, grace_s: float) -> OwnerFirst | None:
    """The rule ``claims`` (``CLAIMS``) names, for ``gm_id``; None when ``grace_s`` is 0."""
    if claims not in CLAIMS:
        raise ValueError(f"claims must be one of {CLAIMS}, got {claims!r}")
    if grace_s <= 0:
        return None
    return OldestFirst(gm_id, grace_s) if claims == "oldest" else OwnerFirst(grace_s)
