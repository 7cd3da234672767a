import asyncio
import logging
import os
import signal

import pytest

from services.common import tasks
from services.common.tasks import TASK_RESTARTS, describe_tasks, install_dump, long_lived


async def test_a_long_lived_task_that_fails_is_said_and_started_again(monkeypatch, caplog):
    monkeypatch.setattr(tasks, "RESTART_S", 0.01)
    runs = []

    async def flaky():
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError(f"boom {len(runs)}")
        await asyncio.Event().wait()

    before = TASK_RESTARTS.labels("flaky-test")._value.get()
    with caplog.at_level(logging.CRITICAL, logger="megha.tasks"):
        task = long_lived(flaky, "flaky-test")
        await asyncio.sleep(0.2)
    assert len(runs) == 3 and not task.done()
    failed = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(failed) == 2 and "boom 1" in str(failed[0].exc_info[1])
    assert failed[0].task == "flaky-test"
    assert TASK_RESTARTS.labels("flaky-test")._value.get() - before == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_long_lived_task_that_returns_has_ended():
    async def once():
        return None

    task = long_lived(once, "once-test")
    await asyncio.sleep(0.01)
    assert task.done() and task.exception() is None


async def test_sigusr1_logs_every_task_and_the_frames_it_waits_in(caplog):
    async def inner():
        await asyncio.sleep(100)

    async def outer():
        await inner()

    waiting = asyncio.create_task(outer(), name="waiting-here")
    await asyncio.sleep(0)
    text = describe_tasks()
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("task waiting-here ("))
    assert lines[at].endswith(".outer):")
    assert "in outer" in lines[at + 1] and "in inner" in lines[at + 2]
    install_dump()
    with caplog.at_level(logging.WARNING, logger="megha.tasks"):
        os.kill(os.getpid(), signal.SIGUSR1)
        await asyncio.sleep(0.05)
    assert any("task waiting-here (" in r.getMessage() for r in caplog.records)
    asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)
    waiting.cancel()
