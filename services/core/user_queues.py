"""The user queues one GM serves, drained round-robin (paper: a GM serves its queues
round-robin). Items that found no node are *parked* until the view changes, so the GM
never spins on a full federation; a state change puts them back, oldest first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class UserQueues(Generic[T]):
    def __init__(self, names: Iterable[str]):
        self.names = list(names)
        self._ready: dict[str, deque[T]] = {n: deque() for n in self.names}
        self._parked: dict[str, deque[T]] = {n: deque() for n in self.names}
        self._next = 0

    def _known(self, queue: str) -> None:
        if queue not in self._ready:
            self.names.append(queue)
            self._ready[queue] = deque()
            self._parked[queue] = deque()

    def push(self, queue: str, item: T) -> None:
        self._known(queue)
        self._ready[queue].append(item)

    def push_front(self, queue: str, item: T) -> None:
        """Retry soon (the LM rejected it and the view was corrected)."""
        self._known(queue)
        self._ready[queue].appendleft(item)

    def park(self, queue: str, item: T) -> None:
        self._known(queue)
        self._parked[queue].append(item)

    def unpark(self) -> int:
        """The view changed: parked items go back ahead of newer ones. Returns how many."""
        moved = 0
        for name in self.names:
            parked = self._parked[name]
            if parked:
                moved += len(parked)
                parked.extend(self._ready[name])
                self._ready[name], self._parked[name] = parked, deque()
        return moved

    def remove(self, queue: str, drop: Callable[[T], bool]) -> list[T]:
        """Take out every item of ``queue``, ready or parked, for which ``drop`` is true
        (a job withdrawn); the rest keep their order. O(items in the queue)."""
        dropped: list[T] = []
        for held in (self._ready, self._parked):
            items = held.get(queue)
            if items:
                kept: deque[T] = deque()
                for item in items:
                    (dropped if drop(item) else kept).append(item)
                held[queue] = kept
        return dropped

    def pop_round(self, per_queue: int) -> list[tuple[str, T]]:
        """Up to ``per_queue`` items from each non-empty queue, starting after the queue
        the previous round started with, so no queue is always served first."""
        out: list[tuple[str, T]] = []
        count = len(self.names)
        for step in range(count):
            name = self.names[(self._next + step) % count]
            ready = self._ready[name]
            for _ in range(min(per_queue, len(ready))):
                out.append((name, ready.popleft()))
        if count:
            self._next = (self._next + 1) % count
        return out

    def ready(self, queue: str) -> int:
        return len(self._ready.get(queue, ()))

    def parked(self, queue: str) -> int:
        return len(self._parked.get(queue, ()))

    def pending(self, queue: str) -> int:
        return self.ready(queue) + self.parked(queue)

    def __len__(self) -> int:
        return sum(len(q) for q in self._ready.values()) + sum(
            len(q) for q in self._parked.values()
        )
