"""Where a service process loses time it cannot spend on requests: event-loop stalls and
the garbage collector's pauses.

``watch()`` runs for the life of a ``megha`` process. It wakes every ``interval_s`` and
measures how late it woke (the event loop's lag: a callback that ran too long, or the
process not getting a core), and it times every collection of CPython's cyclic garbage
collector through ``gc.callbacks``. Both go to Prometheus histograms; a lag of
``warn_s`` or more is also logged, with the collections that ran while the loop was late,
so a stall in an allocation-time report can be matched to its cause from the service's log.

A lag has two causes that call for different mends: the loop's own work (a callback, or a
run of them, that held it: computing, or blocked in a call) or no free core (the thread was
ready to run and the host's other processes had the cores). The watcher tells them apart
by the time the kernel kept its thread waiting for a core (``/proc/thread-self/schedstat``,
Linux): a lag less than half of which was such a wait is the loop's own
(``megha_event_loop_busy_lag_seconds``); the rest only less work on the host mends. Where
the kernel does not say, every lag counts as the loop's own.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Histogram

log = logging.getLogger("megha.stalls")

# 1 ms .. ~16 s, x2 per bucket.
_BUCKETS = tuple(0.001 * 2**i for i in range(15))
# A loop later than this has stalled, for the reports that count stalls (a bucket edge).
STALL_S = _BUCKETS[7]  # 0.128 s

LOOP_LAG_SECONDS = Histogram(
    "megha_event_loop_lag_seconds",
    "How late the event loop ran a timer that was due (blocked loop or no free core).",
    buckets=_BUCKETS,
)
BUSY_LAG_SECONDS = Histogram(
    "megha_event_loop_busy_lag_seconds",
    "The loop's lags its own work caused, a callback or a run of them that held it (its"
    " thread waited for a free core less than half the lag).",
    buckets=_BUCKETS,
)
# Called with each lag ``watch`` measures in this process (a GM's ``Admission`` reads
# its loop's lag so).
LAG_LISTENERS: list[Callable[[float], None]] = []

GC_PAUSE_SECONDS = Histogram(
    "megha_gc_pause_seconds",
    "Duration of each collection of the cyclic garbage collector, by generation.",
    ["generation"],
    buckets=_BUCKETS,
)


@dataclass
class GcTimer:
    """Times each collection through ``gc.callbacks``; ``recent`` keeps the ones since it
    was last drained as (generation, seconds)."""

    recent: list[tuple[int, float]] = field(default_factory=list)
    _began: float = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        generation = int(info.get("generation", 0))
        GC_PAUSE_SECONDS.labels(str(generation)).observe(took)
        if len(self.recent) < 1000:  # drained by the watcher; bounded if it is not running
            self.recent.append((generation, took))

    def drain(self) -> list[tuple[int, float]]:
        out, self.recent = self.recent, []
        return out


@dataclass
class StallTally:
    """What one ``watch`` saw, for a report of a bounded run (the histograms cover the
    whole process): the same figures bench-live reads from a service's histograms."""

    loop_lags: int = 0
    stalls: int = 0
    worst_lag_s: float = 0.0
    gc: dict[str, list[float]] = field(default_factory=dict)  # generation -> [count, s]
    busy_stalls: int = 0  # of ``stalls``, those the loop's own work caused (``busy``)

    def add(self, lag: float, collections: list[tuple[int, float]], busy: bool = False) -> None:
        self.loop_lags += 1
        self.stalls += lag > STALL_S
        self.busy_stalls += lag > STALL_S and busy
        self.worst_lag_s = max(self.worst_lag_s, lag)
        for generation, took in collections:
            entry = self.gc.setdefault(str(generation), [0, 0.0])
            entry[0] += 1
            entry[1] += took

    def as_dict(self) -> dict:
        worst = next((edge for edge in _BUCKETS if self.worst_lag_s <= edge), float("inf"))
        return {
            "loop_lags": self.loop_lags,
            "stalls": self.stalls,
            "busy_stalls": self.busy_stalls,
            "worst_lag_le_s": worst,
            "gc": {gen: [int(c), round(sec, 3)] for gen, (c, sec) in sorted(self.gc.items())},
        }


_SCHEDSTAT = "/proc/thread-self/schedstat"


def core_wait_s(path: str = _SCHEDSTAT) -> float | None:
    """How long the calling thread has waited, ready, for a core since it began (the
    second of the kernel's three schedstat figures, in ns), or None where it is not told."""
    try:
        with open(path, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def busy(lag: float, waited_s: float | None) -> bool:
    """Whether a lag of ``lag`` s was the loop's own work: its thread waited for a core
    ``waited_s`` of the time, less than half the lag (None: not known, so its own)."""
    return lag > 0 and (waited_s is None or waited_s < lag / 2)


def describe(collections: list[tuple[int, float]]) -> str:
    """``"gc: 2 collections, 0.061 s (gen 2: 0.058 s)"`` or ``"no gc"``."""
    if not collections:
        return "no gc"
    total = sum(took for _, took in collections)
    slowest = max(collections, key=lambda c: c[1])
    return (
        f"gc: {len(collections)} collections, {total:.3f} s"
        f" (slowest gen {slowest[0]}: {slowest[1]:.3f} s)"
    )


# The collector's thresholds for a long-lived service, (gen 0, gen 1, gen 2), where
# CPython's are (700, 10, 10): a young collection after 50,000 net allocations instead
# of 700, and an older generation once the younger one was collected 50 (100) times.
# A service allocates a few objects per message and keeps most of what lives long
# (books, views) as untracked bytes, so young collections found little garbage and the
# full ones (each a stop of the whole process, 1.6 s at worst under overload) ran often.
# Measured with bench-live in docs/overload.md; ``MEGHA_GC_THRESHOLDS=700,10,10`` puts
# CPython's back.
GC_THRESHOLDS = (50_000, 50, 100)
GC_THRESHOLDS_ENV = "MEGHA_GC_THRESHOLDS"


def gc_thresholds(env: dict[str, str] | None = None) -> tuple[int, int, int]:
    """``GC_THRESHOLDS``, or the three integers ``MEGHA_GC_THRESHOLDS`` gives."""
    text = (os.environ if env is None else env).get(GC_THRESHOLDS_ENV, "").strip()
    if not text:
        return GC_THRESHOLDS
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise ValueError(
            f"{GC_THRESHOLDS_ENV}={text!r}: give three positive integers, e.g. 50000,50,100"
        )
    return values  # type: ignore[return-value]


def settle(thresholds: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """Tune the garbage collector for a long-lived process, once it has started (every
    role calls this through ``runner.until_signalled``; bench-live for itself).

    What the process made so far (modules, stubs, config, servers) lives as long as it
    does, so it is moved out of the collector's way: each full collection then scans
    only what the work made since (``gc.freeze``). Then the thresholds are raised
    (``GC_THRESHOLDS``, or ``MEGHA_GC_THRESHOLDS``), so collections run less often.
    Returns the thresholds set."""
    if thresholds is None:
        try:
            thresholds = gc_thresholds()
        except ValueError as err:
            log.warning("%s; using %s", err, GC_THRESHOLDS)
            thresholds = GC_THRESHOLDS
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    log.debug("gc: %d objects frozen, thresholds %s", gc.get_freeze_count(), thresholds)
    return thresholds


def _cause(own: bool, waited: float | None) -> str:
    if waited is None:
        return "the loop's own work, or a wait for a core: not told"
    said = f"waited {waited:.3f} s for a core"
    return f"the loop's own work ({said})" if own else f"mostly a wait for a core ({said})"


async def watch(
    interval_s: float = 0.05, warn_s: float = 0.1, tally: StallTally | None = None
) -> None:
    """Measure the loop's lag and the collector's pauses until cancelled; ``tally`` also
    counts them."""
    timer = GcTimer()
    gc.callbacks.append(timer)
    try:
        loop = asyncio.get_running_loop()
        waited_before = core_wait_s()
        while True:
            due = loop.time() + interval_s
            await asyncio.sleep(interval_s)
            lag = max(0.0, loop.time() - due)
            waited_after = core_wait_s()  # read once a turn: the next turn's start too
            waited = (
                None
                if waited_before is None or waited_after is None
                else waited_after - waited_before
            )
            waited_before = waited_after
            own = busy(lag, waited)
            LOOP_LAG_SECONDS.observe(lag)
            if own:
                BUSY_LAG_SECONDS.observe(lag)
            for listener in LAG_LISTENERS:
                listener(lag)
            collections = timer.drain()
            if tally is not None:
                tally.add(lag, collections, own)
            if lag >= warn_s:
                log.warning(
                    "event loop ran %.3f s late (%s; %s)",
                    lag,
                    describe(collections),
                    _cause(own, waited),
                    extra={"lag_s": round(lag, 3), "busy": own},
                )
    finally:
        gc.callbacks.remove(timer)
