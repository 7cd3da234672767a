"""Process tasks held to their memory request (``memwatch.py``, ``ProcessExecutor``)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from services._proto.megha.v1 import common_pb2
from services.worker.executors import ProcessExecutor
from services.worker.leftovers import proc_stat
from services.worker.memwatch import MemoryWatch, resident
from tests.task_user import task_python

MIB = 1 << 20
# Takes 200 MiB (touched, so resident), says so on stdout's file, then waits.
HOG = "x = bytearray(200 << 20); print('ready', flush=True); import time; time.sleep({})"


def _task(memory_mb: int, script: str) -> common_pb2.Task:
    task = common_pb2.Task(
        task_id="hog", process=common_pb2.ProcessExecutor(args=[task_python(), "-c", script])
    )
    task.resources.memory_mb = memory_mb
    return task


def test_resident_sums_a_groups_processes_in_one_pass() -> None:
    own = os.getpgid(0)
    with open(f"/proc/{os.getpid()}/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    totals = resident({own, 2**22 + 7})  # a group no process leads
    assert totals[2**22 + 7] == 0
    assert totals[own] >= rss * 0.9  # this process, and whatever else is in its group


async def test_a_process_task_over_its_memory_request_is_killed_and_fails() -> None:
    executor = ProcessExecutor(memory=MemoryWatch(0.1))
    began = time.monotonic()
    result = await asyncio.wait_for(executor.run(_task(64, HOG.format(30))), 20)
    assert time.monotonic() - began < 10  # not the 30 s it would have slept
    assert result.exit_code == 137  # SIGKILL
    assert "more than the 64 MiB it asked for" in result.message, result.message
    held = int(result.message.split("held ")[1].split(" MiB")[0])
    assert 64 < held < 400  # caught on the way to 200, or after
    assert result.peak_memory_mb == held
    assert not executor.memory._watched  # type: ignore[union-attr]


async def test_a_task_within_its_request_or_without_one_or_unwatched_runs_to_its_end() -> None:
    watch = MemoryWatch(0.1)
    within = await ProcessExecutor(memory=watch).run(_task(512, HOG.format(0.5)))
    assert within.exit_code == 0, within.message
    assert 200 <= within.peak_memory_mb < 400  # measured all the same: what it took
    no_request = await ProcessExecutor(memory=watch).run(_task(0, HOG.format(0.5)))
    assert no_request.exit_code == 0, no_request.message
    assert 200 <= no_request.peak_memory_mb < 400
    unwatched = await ProcessExecutor().run(_task(64, HOG.format(0.5)))
    assert unwatched.exit_code == 0, unwatched.message
    assert unwatched.peak_memory_mb == 0  # not measured
    quick = await ProcessExecutor(memory=MemoryWatch(30)).run(_task(512, "pass"))
    assert quick.peak_memory_mb == 0  # ended before the first look
    assert watch._looking is None  # nothing watched: no loop left behind


async def test_the_whole_group_counts_and_is_killed(task_tmp) -> None:
    # The shell holds little; its two children 120 MiB each: only the sum is over 200.
    child = "x = bytearray(120 << 20); import time; time.sleep(30)"
    pids = task_tmp / "pids"
    python = task_python()
    one = f"{python} -c '{child}' & echo $! >> {pids}"
    script = f"{one}; {one}; wait"
    task = common_pb2.Task(
        task_id="pair", process=common_pb2.ProcessExecutor(args=["sh", "-c", script])
    )
    task.resources.memory_mb = 200
    result = await asyncio.wait_for(ProcessExecutor(memory=MemoryWatch(0.1)).run(task), 20)
    assert "more than the 200 MiB it asked for" in result.message, result.message
    children = [int(pid) for pid in pids.read_text().split()]
    assert len(children) == 2
    for pid in children:  # gone, or a zombie not reaped yet
        fields = proc_stat(pid)
        assert fields is None or fields[0] in (b"Z", b"X")


def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s must be more than 0"):
        MemoryWatch(0)
