"""The stall watcher: a blocked event loop is measured and logged, collections are timed."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import subprocess
import sys
import time

import pytest

from services.common import stalls


def _count(histogram, **labels) -> float:
    metric = histogram.labels(**labels) if labels else histogram
    (family,) = metric.collect()
    return next(s.value for s in family.samples if s.name.endswith("_count"))


async def test_a_blocked_loop_is_logged_with_the_collections_that_ran_meanwhile(caplog):
    caplog.set_level(logging.WARNING, logger="megha.stalls")
    lags_before = _count(stalls.LOOP_LAG_SECONDS)
    gen2_before = _count(stalls.GC_PAUSE_SECONDS, generation="2")
    tally = stalls.StallTally()
    watcher = asyncio.create_task(stalls.watch(interval_s=0.01, warn_s=0.2, tally=tally))
    await asyncio.sleep(0.05)
    time.sleep(0.3)  # the loop is blocked
    gc.collect()
    await asyncio.sleep(0.05)
    watcher.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watcher

    (record,) = [r for r in caplog.records if r.name == "megha.stalls"]
    assert record.lag_s >= 0.29
    assert "1 collections" in record.getMessage() and "gen 2" in record.getMessage()
    assert _count(stalls.LOOP_LAG_SECONDS) >= lags_before + 3
    assert _count(stalls.GC_PAUSE_SECONDS, generation="2") == gen2_before + 1
    assert not any(isinstance(c, stalls.GcTimer) for c in gc.callbacks)  # removed on cancel
    counted = tally.as_dict()
    # The worst lag's bucket (powers of two from 1 ms): 0.512 s for the 0.3 s block,
    # the next one up when a loaded machine stretched the block and the collection.
    assert counted["stalls"] == 1
    # Blocked in a call, not waiting for a core: the loop's own (where the kernel tells).
    if stalls.core_wait_s() is not None:
        assert counted["busy_stalls"] == 1 and record.busy
        assert "the loop's own work" in record.getMessage()
    assert counted["worst_lag_le_s"] / 2 < record.lag_s <= counted["worst_lag_le_s"]
    assert counted["loop_lags"] >= 3 and counted["gc"]["2"][0] == 1


async def test_a_loop_that_keeps_up_logs_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="megha.stalls")
    watcher = asyncio.create_task(stalls.watch(interval_s=0.01, warn_s=0.2))
    await asyncio.sleep(0.1)
    watcher.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watcher
    assert not [r for r in caplog.records if r.name == "megha.stalls"]


def test_describe_names_the_slowest_collection():
    assert stalls.describe([]) == "no gc"
    text = stalls.describe([(0, 0.001), (2, 0.050)])
    assert text == "gc: 2 collections, 0.051 s (slowest gen 2: 0.050 s)"


def test_settling_takes_what_exists_out_of_full_collections():
    kept = [[n] for n in range(10_000)]  # lives on, like a started service's objects
    try:
        stalls.settle()
        assert gc.get_freeze_count() >= len(kept)
        scanned = {id(o) for o in gc.get_objects()}  # what a full collection looks at
        assert not any(id(x) in scanned for x in kept)
    finally:
        gc.unfreeze()


def test_settling_raises_the_collectors_thresholds_for_a_long_lived_process(monkeypatch):
    monkeypatch.delenv(stalls.GC_THRESHOLDS_ENV, raising=False)
    before = gc.get_threshold()
    try:
        assert stalls.settle() == stalls.GC_THRESHOLDS == gc.get_threshold()
        assert gc.get_threshold()[0] >= 10_000  # not CPython's 700
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def test_the_thresholds_can_be_set_from_the_environment(monkeypatch, caplog):
    assert stalls.gc_thresholds({"MEGHA_GC_THRESHOLDS": "700,10,10"}) == (700, 10, 10)
    assert stalls.gc_thresholds({}) == stalls.GC_THRESHOLDS
    with pytest.raises(ValueError, match="three positive integers"):
        stalls.gc_thresholds({"MEGHA_GC_THRESHOLDS": "700,10"})
    monkeypatch.setenv(stalls.GC_THRESHOLDS_ENV, "lots")
    before = gc.get_threshold()
    try:
        assert stalls.settle() == stalls.GC_THRESHOLDS  # a typo never stops a service
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
    assert "three positive integers" in caplog.text


def test_a_lag_is_the_loops_own_unless_mostly_a_wait_for_a_core(tmp_path):
    assert stalls.busy(0.3, 0.0) and stalls.busy(0.3, 0.149)
    assert not stalls.busy(0.3, 0.15) and not stalls.busy(0.3, 0.29)
    assert stalls.busy(0.3, None)  # not told: not excused
    assert not stalls.busy(0.0, 0.0)  # on time
    told = tmp_path / "schedstat"
    told.write_text("341749585 456000000 27\n")
    assert stalls.core_wait_s(str(told)) == 0.456
    assert stalls.core_wait_s(str(tmp_path / "absent")) is None
    told.write_text("")
    assert stalls.core_wait_s(str(told)) is None


@pytest.mark.skipif(stalls.core_wait_s() is None, reason="the kernel does not tell")
def test_the_kernel_counts_the_wait_for_a_core_a_busy_neighbour_causes():
    """What ``busy`` relies on: a thread that shares its one core with a process that
    spins waits for the core about as long as it runs."""
    cpu = min(os.sched_getaffinity(0))
    allowed = os.sched_getaffinity(0)
    rival = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(rival.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.1)  # the rival is spinning
        before = stalls.core_wait_s()
        spun = time.monotonic() + 0.4
        while time.monotonic() < spun:
            pass
        waited = stalls.core_wait_s() - before
    finally:
        os.sched_setaffinity(0, allowed)
        rival.kill()
        rival.wait()
    assert waited >= 0.1  # about 0.2 s when the two share the core evenly
