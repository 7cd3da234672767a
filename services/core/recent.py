"""Maps of millions of string keys that never stop their process to grow.

A dict grows by building a table twice the size and moving every entry: 30 ms at 699,050
entries, ~100 ms for an ``OrderedDict`` at 1,398,101, and the process does nothing else
meanwhile. Both maps here keep their entries in generations of plain dicts of at most
``generation`` entries, so no insert grows a table bigger than one generation's (~6 ms);
a dict of strings, bytes and ints is never tracked by the garbage collector, so no
collection walks them either. A lookup tries each generation, newest first.

- ``GrowingMap``: a map that only grows (the load generator's per-task records, which at
  1,080,000 tasks held it ~0.12 s when its four maps grew together).
- ``Recent``: the newest ``bound`` keys with a value each, the oldest forgotten first
  (the job of an LM's ended attempts); ``RecentInts``, with an int each, also keeps the
  larger of two values (an LM's ended attempts, where one ``OrderedDict`` held the LM up
  to 0.13 s and added ~8 ms to every full collection at 360,000 entries).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Generic, TypeVar

# CPython grows a dict when it is 2/3 full: below this, the last growth is at 174,762
# entries (~6 ms); the next, at 349,525, would take twice as long.
GENERATION = 349_000

V = TypeVar("V")
_MISSING = object()


class GrowingMap(Generic[V]):
    """A ``str -> V`` map in generations of at most ``generation`` entries. Setting a key
    that is already there changes its value where it is; a new key goes to the newest."""

    __slots__ = ("_gens", "_size", "generation")

    def __init__(self, generation: int = GENERATION):
        if generation < 1:
            raise ValueError(f"generation must be at least 1, got {generation}")
        self.generation = generation
        self._gens: collections.deque[dict[str, V]] = collections.deque([{}])  # oldest first
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, key: str) -> bool:
        return self._holder(key) is not None

    def __iter__(self) -> Iterator[str]:
        """Keys, oldest generation first."""
        for gen in self._gens:
            yield from gen

    def __getitem__(self, key: str) -> V:
        holder = self._holder(key)
        if holder is None:
            raise KeyError(key)
        return holder[key]

    def get(self, key: str, default: V | None = None) -> V | None:
        gens = self._gens
        if len(gens) == 1:  # most maps never fill a generation
            return gens[0].get(key, default)
        for gen in reversed(gens):
            value = gen.get(key, _MISSING)
            if value is not _MISSING:
                return value  # type: ignore[return-value]
        return default

    def __setitem__(self, key: str, value: V) -> None:
        holder = self._holder(key)
        if holder is None:
            self._insert(key, value)
        else:
            holder[key] = value

    def values(self) -> Iterator[V]:
        for gen in self._gens:
            yield from gen.values()

    def items(self) -> Iterator[tuple[str, V]]:
        for gen in self._gens:
            yield from gen.items()

    def _holder(self, key: str) -> dict[str, V] | None:
        # The newest first (most keys looked up are recent), then the others in any
        # order: a key is in one generation at most.
        gens = self._gens
        newest = gens[-1]
        if key in newest:
            return newest
        if len(gens) > 1:
            for gen in gens:
                if key in gen:
                    return gen
        return None

    def _insert(self, key: str, value: V) -> None:
        newest = self._gens[-1]
        newest[key] = value
        self._size += 1
        if len(newest) >= self.generation:
            self._gens.append({})


class Recent(GrowingMap[V]):
    """The newest ``bound`` keys put, with the value each was put with last. Forgets one
    entry at a time, oldest first, so ``len`` never exceeds ``bound`` and the kept keys
    are exactly those an ``OrderedDict`` with ``move_to_end`` and ``popitem(last=False)``
    would keep."""

    __slots__ = ("_next", "_order", "bound")

    def __init__(self, bound: int, generation: int = GENERATION):
        if bound < 1:
            raise ValueError(f"bound must be at least 1, got {bound}")
        # At least two generations fit in the bound, so the oldest can be forgotten
        # entry by entry while the newest fills.
        super().__init__(max(1, min(generation, bound // 2)) if generation >= 1 else generation)
        self.bound = bound
        self._order: list[str] = []  # the oldest generation's keys as they came
        self._next = 0  # the first of them not yet forgotten

    def put(self, key: str, value: V) -> None:
        """Remember ``key`` as the newest, with ``value``; forget the oldest past the bound."""
        self._put(key, value, self._holder(key))

    def __setitem__(self, key: str, value: V) -> None:
        self.put(key, value)

    def _put(self, key: str, value: V, holder: dict[str, V] | None) -> None:
        if holder is not None:
            del holder[key]  # so it goes to the end, as move_to_end would
            self._size -= 1
        self._insert(key, value)
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


class RecentInts(Recent[int]):
    """``Recent`` with an int each, which ``put_max`` never lowers."""

    __slots__ = ()

    def put_max(self, key: str, value: int) -> None:
        """``put``, unless ``key`` is kept with a larger value (then nothing changes)."""
        holder = self._holder(key)
        if holder is None or holder[key] <= value:
            self._put(key, value, holder)

    def put_above(self, key: str, value: int) -> bool:
        """``put`` if ``key`` is not kept with ``value`` or more: True if it was put (one
        lookup where ``get`` then ``put_max`` take two)."""
        holder = self._holder(key)
        if holder is not None and holder[key] >= value:
            return False
        self._put(key, value, holder)
        return True
