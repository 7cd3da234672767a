"""Process tasks held to the memory they asked for.

A container's memory is limited by the engine (``mem_limit``); a process task's is not,
so one that asks for 512 MiB and takes 20 GiB could starve its host's other tasks, the
worker host and the LM of memory, and bring the kernel's OOM killer down on any of them.
As YARN's NodeManager does for its containers, the host looks, every ``interval_s``, at
how much memory each process task's processes hold resident (the ``rss`` of every
process of its group in ``/proc/<pid>/stat``, summed: pages two of them share count
twice), in one pass over ``/proc`` for all of them, and a task over its request is
killed and fails, saying so (``ProcessExecutor``).

Between two looks a task can take more than it asked for; processes that left the
task's group (``setsid``) are not counted, as they are not killed with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Collection
from dataclasses import dataclass

from services.worker.leftovers import proc_stats

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_RSS = 21  # field 24 of stat(5), counted from field 3 (state) as proc_stat returns them


def resident(pgids: Collection[int]) -> dict[int, int]:
    """Bytes resident in memory, for each process group of ``pgids``: the sum over its
    processes (a zombie holds none), in one pass over ``/proc``."""
    totals = dict.fromkeys(pgids, 0)
    for fields in proc_stats():
        if int(fields[2]) in totals:
            totals[int(fields[2])] += int(fields[_RSS]) * PAGE_BYTES
    return totals


@dataclass
class _Watched:
    limit: int  # 0: none
    over: asyncio.Future[int]
    peak: int = 0


class MemoryWatch:
    """Watches process groups' resident memory against their limits, every
    ``interval_s``, while there is a group to watch."""

    def __init__(self, interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be more than 0, got {interval_s}")
        self.interval_s = interval_s
        self._watched: dict[int, _Watched] = {}
        self._looking: asyncio.Task[None] | None = None

    def watch(self, pgid: int, limit: int = 0) -> asyncio.Future[int]:
        """A future that gets the group's resident bytes once they are over ``limit``
        (0: never, the group is only measured); the caller ``unwatch``es the group when
        its task has ended."""
        over: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._watched[pgid] = _Watched(limit, over)
        if self._looking is None or self._looking.done():
            self._looking = asyncio.create_task(self._look())
        return over

    def peak(self, pgid: int) -> int:
        """The most bytes the group held resident at one look so far (0: no look yet)."""
        watched = self._watched.get(pgid)
        return 0 if watched is None else watched.peak

    def unwatch(self, pgid: int) -> None:
        watched = self._watched.pop(pgid, None)
        if watched is not None:
            watched.over.cancel()
        if not self._watched and self._looking is not None:
            self._looking.cancel()  # started again with the next watch
            self._looking = None

    async def _look(self) -> None:
        while self._watched:
            await asyncio.sleep(self.interval_s)
            groups = list(self._watched)
            with contextlib.suppress(OSError):  # no /proc: nothing to go by
                for pgid, used in (await asyncio.to_thread(resident, groups)).items():
                    watched = self._watched.get(pgid)
                    if watched is None:
                        continue
                    watched.peak = max(watched.peak, used)
                    if watched.limit and used > watched.limit and not watched.over.done():
                        watched.over.set_result(used)
