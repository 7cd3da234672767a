"""The newest ``bound`` keys with an int each, the oldest forgotten first.

An LM remembers the last attempt of up to a million ended tasks (``lm_ended_kept``). One
``OrderedDict`` of that size held its process up to 0.13 s whenever it grew or rebuilt its
table, and, being always tracked by the garbage collector, added ~8 ms to every full
collection at 360,000 entries. ``RecentInts`` keeps the same entries in generations of
plain ``str -> int`` dicts of at most ``generation`` entries:

- no insert resizes a table bigger than one generation's (~6 ms);
- a dict of strings and ints is never tracked, so collections do not walk it;
- a lookup tries each generation, newest first (three or four for a million entries);
- forgetting takes the oldest generation's keys in the order they came, one at a time,
  so ``len`` never exceeds ``bound`` and the kept keys are exactly the newest ``bound``
  put, as with an ``OrderedDict`` and ``move_to_end``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

# CPython grows a dict when it is 2/3 full: below this, the last growth is at 174,762
# entries (~6 ms); the next, at 349,525, would take twice as long.
GENERATION = 349_000


class RecentInts:
    """The newest ``bound`` keys put, with the value each was put with last."""

    __slots__ = ("_gens", "_next", "_order", "_size", "bound", "generation")

    def __init__(self, bound: int, generation: int = GENERATION):
        if bound < 1:
            raise ValueError(f"bound must be at least 1, got {bound}")
        if generation < 1:
            raise ValueError(f"generation must be at least 1, got {generation}")
        self.bound = bound
        # At least two generations fit in the bound, so the oldest can be forgotten
        # entry by entry while the newest fills.
        self.generation = max(1, min(generation, bound // 2))
        self._gens: collections.deque[dict[str, int]] = collections.deque([{}])  # oldest first
        self._size = 0
        self._order: list[str] = []  # the oldest generation's keys as they came
        self._next = 0  # the first of them not yet forgotten

    def __len__(self) -> int:
        return self._size

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def __iter__(self) -> Iterator[str]:
        """Keys, oldest first."""
        for gen in self._gens:
            yield from gen

    def get(self, key: str, default: int | None = None) -> int | None:
        for gen in reversed(self._gens):
            value = gen.get(key)
            if value is not None:
                return value
        return default

    def put(self, key: str, value: int) -> None:
        """Remember ``key`` as the newest, with ``value``; forget the oldest past the bound."""
        self._put(key, value, self._holder(key))

    def put_max(self, key: str, value: int) -> None:
        """``put``, unless ``key`` is kept with a larger value (then nothing changes)."""
        holder = self._holder(key)
        if holder is None or holder[key] <= value:
            self._put(key, value, holder)

    def _holder(self, key: str) -> dict[str, int] | None:
        for gen in reversed(self._gens):
            if key in gen:
                return gen
        return None

    def _put(self, key: str, value: int, holder: dict[str, int] | None) -> None:
        gens = self._gens
        newest = gens[-1]
        if holder is None:
            self._size += 1
        else:
            del holder[key]  # so it goes to the end, as move_to_end would
        newest[key] = value
        if len(newest) >= self.generation:
            gens.append({})
        while self._size > self.bound:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        gens = self._gens
        oldest = gens[0]
        if not self._order:
            self._order = list(oldest)
            self._next = 0
        order = self._order
        while self._next < len(order):
            key = order[self._next]
            self._next += 1
            if oldest.pop(key, None) is not None:  # else put again since: no longer here
                self._size -= 1
                break
        if not oldest or self._next >= len(order):
            # Every key of the generation is gone (forgotten or put again later).
            gens.popleft()
            self._order = []
            if not gens:
                gens.append({})
