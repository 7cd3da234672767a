"""``megha status`` shows each queue's waiting tasks as the GM that serves it counts
them, whichever GM it asks (only the serving GM holds them), and ``?`` when that GM does
not answer (soon); an LM the GM no longer hears from is shown silent, its room not
counted, and the GM places nothing there."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time

import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, sim_tasks

pytestmark = pytest.mark.integration

QUEUES = [
    {"name": "first", "share": 0.5, "gm": "gm-1"},
    {"name": "second", "share": 0.5, "gm": "gm-2"},
]


async def test_status_counts_each_queues_waiting_tasks_at_its_own_gm(tmp_path):
    async with Federation(
        tmp_path, gms=2, lms=1, workers_per_lm=1, capacity="cpu=1,mem=2Gi", queues=QUEUES
    ) as fed:
        job = await fed.gm("gm-2").submit(sim_tasks(4, 30.0), queue="second")
        deadline = time.monotonic() + 20
        while not set(job.task_ids) & set(fed.events.nodes_of(common_pb2.TASK_STATE_RUNNING)):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

        async def status() -> dict[str, list[str]]:
            argv = [sys.executable, "-m", "services.cli", "status", "--config"]
            shown = await asyncio.to_thread(
                subprocess.run, [*argv, str(fed.config_path)], capture_output=True, text=True,
                timeout=60,
            )  # fmt: skip
            assert shown.returncode == 0, shown.stderr
            return {line.split()[0]: line.split() for line in shown.stdout.splitlines() if line}

        rows = await status()  # asks gm-1, which holds none of them
        assert rows["second"][:6] == ["second", "gm-2", "50%", "100%", "3", "1"], rows

        fed.children.kill("gm-gm-2")
        rows = await status()
        assert rows["second"][4] == "?" and rows["first"][4] == "0", rows


async def megha_status(fed: Federation) -> tuple[dict[str, str], float]:
    """``megha status`` (asking gm-1) as lines by their first word, and how long it took."""
    argv = [sys.executable, "-m", "services.cli", "status", "--config", str(fed.config_path)]
    began = time.monotonic()
    shown = await asyncio.to_thread(
        subprocess.run, argv, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    lines = {line.split()[0]: line for line in shown.stdout.splitlines() if line.strip()}
    return lines, time.monotonic() - began


@contextlib.contextmanager
def frozen(fed: Federation, name: str):
    """A child stopped (SIGSTOP) as a hung process or an unreachable host is: its port
    still takes connections, but nothing answers. Killed on the way out."""
    proc = fed.children.procs[name]
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.kill()


async def test_status_waits_for_a_frozen_gm_about_a_second_not_a_call_deadline(tmp_path):
    async with Federation(
        tmp_path, gms=2, lms=1, workers_per_lm=1, capacity="cpu=1,mem=2Gi", queues=QUEUES
    ) as fed:
        with frozen(fed, "gm-gm-2"):
            lines, took = await megha_status(fed)  # asks gm-1, which asks gm-2
        assert lines["second"].split()[4] == "?", lines
        # A process start (about 1 s) and the short wait for gm-2; each GM that did not
        # answer cost a 10 s deadline before.
        assert took < 6, f"megha status took {took:.1f} s with gm-2 frozen"


async def test_a_silent_lm_takes_no_tasks_and_its_room_is_not_counted_free(tmp_path):
    async with Federation(
        tmp_path, gms=1, lms=2, workers_per_lm=2, capacity="cpu=4,mem=8Gi"
    ) as fed:
        with frozen(fed, "lm-lm-2"):
            deadline = time.monotonic() + 15
            while True:  # silent after 5 heartbeats, and at least 2 s
                lines, _ = await megha_status(fed)
                if "SILENT" in lines["lm-2"] or time.monotonic() > deadline:
                    break
            assert "SILENT: not heard from, not counted" in lines["lm-2"], lines
            assert lines["total"].split()[1:] == ["gm-1:", "2,", "cpu=8", "mem=16384Mi"], lines

            # Placed on lm-1 at once: none waits for a launch lm-2 never answers (the
            # GM's call deadline is 10 s).
            began = time.monotonic()
            job = await fed.gm("gm-1").submit(sim_tasks(4, 0.5))
            await fed.events.wait_succeeded(set(job.task_ids), timeout_s=8)
            assert time.monotonic() - began < 8
            ran = {e.lm_id for e in fed.events.events if e.task_id in set(job.task_ids)}
            assert ran == {"lm-1"}, ran


@pytest.mark.slow  # run apart by .ci/run (MEGHA_SLOW_TESTS=1): the default suite's budget
async def test_with_queue_failover_status_names_the_gm_the_broker_chose(tmp_path):
    """``queue_failover``: each GM first serves its own queue; killed, its queue is
    served by the other, and ``megha status`` says so (``gm-1 (prefers gm-2)``)."""
    async with Federation(
        tmp_path, gms=2, lms=1, workers_per_lm=2, queues=QUEUES, queue_failover=True
    ) as fed:

        async def status() -> dict[str, list[str]]:
            deadline = time.monotonic() + 15
            while True:
                lines, _ = await megha_status(fed)
                rows = {name: line.split() for name, line in lines.items()}
                if "?" not in rows["first"][1] + rows["second"][1] or time.monotonic() > deadline:
                    return rows
                await asyncio.sleep(0.5)

        rows = await status()
        assert rows["first"][1] == "gm-1" and rows["second"][1] == "gm-2", rows
        # Both GMs take both queues' jobs; each message runs where the broker sends it.
        jobs = [
            await fed.gm(gm).submit(sim_tasks(3, 0.1), queue=q)
            for gm in ("gm-1", "gm-2")
            for q in ("first", "second")
        ]
        await fed.events.wait_succeeded({t for j in jobs for t in j.task_ids}, timeout_s=30)
        assert max(fed.events.succeeded().values()) == 1
        fed.children.kill("gm-gm-2")
        deadline = time.monotonic() + 20
        while (rows := await status())["second"][1:4] != ["gm-1", "(prefers", "gm-2)"]:
            assert time.monotonic() < deadline, rows
            await asyncio.sleep(0.5)
        job = await fed.gm("gm-1").submit(sim_tasks(3, 0.1), queue="second")
        await fed.events.wait_succeeded(set(job.task_ids), timeout_s=30)
