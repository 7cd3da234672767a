"""The user queues one GM serves, drained round-robin (paper: a GM serves its queues
round-robin). Within a queue, items of a higher priority go first, and items of one
priority in the order they came. Items that found no node are *parked* until the view
changes, so the GM never spins on a full federation; a state change puts them back,
oldest first, ahead of newer items of their priority.

    push ──▶ queue q ──▶ lane of priority p (a deque) ─┐
                                                       ├─ pop_round: from each queue in
    park ──▶ parked (one deque a queue) ──unpark──▶    │  turn, the highest lanes first
             back to the front of their lanes ─────────┘

Priority orders work within one queue only; it does not preempt, and it does not change
what a queue gets against the others (fairness does that).
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Generic, TypeVar

T = TypeVar("T")


def _no_priority(_item: object) -> int:
    return 0


class _Lanes(Generic[T]):
    """One queue's ready items: a deque per priority, the priorities highest first."""

    __slots__ = ("count", "lanes", "order")

    def __init__(self) -> None:
        self.lanes: dict[int, deque[T]] = {}
        self.order: list[int] = []  # the priorities that have a lane, as -priority, sorted
        self.count = 0

    def lane(self, priority: int) -> deque[T]:
        lane = self.lanes.get(priority)
        if lane is None:
            lane = self.lanes[priority] = deque()
            insort(self.order, -priority)
        return lane

    def take(self, most: int) -> list[T]:
        """Up to ``most`` items, highest priority first; empty lanes are dropped."""
        out: list[T] = []
        while len(out) < most and self.order:
            priority = -self.order[0]
            lane = self.lanes[priority]
            for _ in range(min(most - len(out), len(lane))):
                out.append(lane.popleft())
            if not lane:
                del self.lanes[priority]
                self.order.pop(0)
        self.count -= len(out)
        return out


class UserQueues(Generic[T]):
    def __init__(
        self,
        names: Iterable[str],
        priority: Callable[[T], int] | None = None,
        age: Callable[[T], float] | None = None,
    ):
        """``priority``: an item's priority (higher goes first); all 0 by default.
        ``age``: when an item was queued (smaller is older), for ``unpark``."""
        self.names = list(names)
        self._priority = priority or _no_priority
        self.age = age
        self._ready: dict[str, _Lanes[T]] = {n: _Lanes() for n in self.names}
        self._parked: dict[str, deque[T]] = {n: deque() for n in self.names}
        self._next = 0

    def _known(self, queue: str) -> None:
        if queue not in self._ready:
            self.names.append(queue)
            self._ready[queue] = _Lanes()
            self._parked[queue] = deque()

    def push(self, queue: str, item: T) -> None:
        self._known(queue)
        ready = self._ready[queue]
        ready.lane(self._priority(item)).append(item)
        ready.count += 1

    def push_front(self, queue: str, item: T) -> None:
        """Retry soon (the LM rejected it and the view was corrected)."""
        self._known(queue)
        ready = self._ready[queue]
        ready.lane(self._priority(item)).appendleft(item)
        ready.count += 1

    def park(self, queue: str, item: T) -> None:
        self._known(queue)
        self._parked[queue].append(item)

    def unpark(self) -> int:
        """The view changed: parked items go back ahead of newer ones of their priority,
        in the order they were parked (by ``age``, when there is one: then ready items
        older than a parked one, pushed to the front meanwhile, stay ahead of it).
        Returns how many. Cost: O(parked) (a sort of nearly sorted items)."""
        moved = 0
        for name in self.names:
            parked = self._parked[name]
            if parked:
                moved += len(parked)
                ready = self._ready[name]
                ready.count += len(parked)
                if self.age is not None:
                    self._merge(ready, parked)
                    continue
                while parked:
                    item = parked.pop()  # the newest first, each to the front of its lane
                    ready.lane(self._priority(item)).appendleft(item)
        return moved

    def _merge(self, ready: _Lanes[T], parked: deque[T]) -> None:
        """``parked`` back into ``ready``'s lanes in ``age`` order, with the items at a
        lane's front older than the newest of them (stable: a tie keeps the parked
        item first)."""
        age = self.age
        assert age is not None
        by_lane: dict[int, list[T]] = {}
        for item in parked:
            by_lane.setdefault(self._priority(item), []).append(item)
        parked.clear()
        for priority, items in by_lane.items():
            lane = ready.lane(priority)
            newest = max(map(age, items))
            while lane and age(lane[0]) < newest:
                items.append(lane.popleft())
            items.sort(key=age)
            lane.extendleft(reversed(items))

    def remove(self, queue: str, drop: Callable[[T], bool]) -> list[T]:
        """Take out every item of ``queue``, ready or parked, for which ``drop`` is true
        (a job withdrawn); the rest keep their order. O(items in the queue)."""
        dropped: list[T] = []
        ready = self._ready.get(queue)
        if ready is not None:
            for priority, lane in list(ready.lanes.items()):
                kept: deque[T] = deque()
                for item in lane:
                    (dropped if drop(item) else kept).append(item)
                if kept:
                    ready.lanes[priority] = kept
                else:
                    del ready.lanes[priority]
                    ready.order.remove(-priority)
            ready.count -= len(dropped)
        parked = self._parked.get(queue)
        if parked:
            kept = deque()
            for item in parked:
                (dropped if drop(item) else kept).append(item)
            self._parked[queue] = kept
        return dropped

    def pop_round(self, per_queue: int) -> list[tuple[str, T]]:
        """Up to ``per_queue`` items from each non-empty queue (its highest priorities
        first), in ``rotation`` order."""
        out: list[tuple[str, T]] = []
        for name in self.rotation():
            ready = self._ready[name]
            if ready.count:
                out.extend((name, item) for item in ready.take(per_queue))
        return out

    def rotation(self) -> list[str]:
        """The queues in the order a round serves them: starting after the queue the
        previous round started with, so no queue is always served first."""
        count = len(self.names)
        if not count:
            return []
        start = self._next
        self._next = (self._next + 1) % count
        return [self.names[(start + step) % count] for step in range(count)]

    def take(self, queue: str) -> T | None:
        """The next ready item of ``queue`` (highest priority first), or None."""
        ready = self._ready.get(queue)
        if ready is None or not ready.count:
            return None
        return ready.take(1)[0]

    def items(self, queue: str) -> Iterator[T]:
        """Every item of ``queue``, ready (highest priority first) then parked."""
        ready = self._ready.get(queue)
        if ready is not None:
            for negated in ready.order:
                yield from ready.lanes[-negated]
        yield from self._parked.get(queue, ())

    def oldest(self, queue: str, most: int) -> Iterator[T]:
        """The first ``most`` items of each lane of ``queue`` and of its parked ones: its
        oldest items are among them (each lane, and the parked, are in arrival order)."""
        ready = self._ready.get(queue)
        if ready is not None:
            for lane in ready.lanes.values():
                yield from islice(lane, most)
        yield from islice(self._parked.get(queue, ()), most)

    def ready(self, queue: str) -> int:
        ready = self._ready.get(queue)
        return ready.count if ready is not None else 0

    def parked(self, queue: str) -> int:
        return len(self._parked.get(queue, ()))

    def pending(self, queue: str) -> int:
        return self.ready(queue) + self.parked(queue)

    def __len__(self) -> int:
        return sum(r.count for r in self._ready.values()) + sum(
            len(q) for q in self._parked.values()
        )
