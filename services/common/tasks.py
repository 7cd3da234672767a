"""A service's long-lived asyncio tasks: none may end on an error unsaid, and an operator
can ask a live process what every task is waiting for.

- ``long_lived(make, name)`` starts ``make()`` as a task that should run for the life of
  the process (a GM's scheduling loop, an LM's heartbeats, a subscription's pump). An
  error that ends it is logged at once, CRITICAL with its traceback (asyncio alone says
  nothing until the task is collected, which for a task a service keeps is never), is
  counted (``megha_task_restarts_total``), and the task is started again after a pause
  that doubles up to ``RESTART_MAX_S`` while it keeps failing: these loops keep no
  state of their own, their objects do. A task that returns or is cancelled has ended.
- ``dump_tasks()`` logs every task of the running loop with the frames it is suspended
  in; ``install_dump()`` makes SIGUSR1 do it (``kill -USR1 <pid>``), as Go's SIGQUIT
  does for goroutines: a service that stopped doing something, without an error, says
  what it waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import Counter

log = logging.getLogger("megha.tasks")

RESTART_S = 0.5  # the first pause before a failed long-lived task starts again
RESTART_MAX_S = 30.0
_HEALTHY_S = 60.0  # a task that ran this long before failing starts over from RESTART_S

TASK_RESTARTS = Counter(
    "megha_task_restarts_total",
    "Long-lived tasks of this process that ended on an error and were started again.",
    ["task"],
)


def long_lived(make: Callable[[], Coroutine[Any, Any, Any]], name: str) -> asyncio.Task:
    """Run ``make()`` for the life of the process, started again (logged, counted) each
    time it ends on an error; cancelling the returned task stops it for good."""
    return asyncio.get_running_loop().create_task(_keep_running(make, name), name=name)


async def _keep_running(make: Callable[[], Coroutine[Any, Any, Any]], name: str) -> None:
    pause = RESTART_S
    while True:
        began = time.monotonic()
        try:
            await make()
            return
        except Exception:
            if time.monotonic() - began >= _HEALTHY_S:
                pause = RESTART_S
            log.critical(
                "a long-lived task ended on an error; starting it again in %.1f s",
                pause,
                exc_info=True,
                extra={"task": name},
            )
            TASK_RESTARTS.labels(name).inc()
        await asyncio.sleep(pause)
        pause = min(2 * pause, RESTART_MAX_S)


def describe_tasks(limit: int = 12) -> str:
    """Every task of the running loop, with the frames it is suspended in (innermost
    last, at most ``limit`` each)."""
    current = asyncio.current_task()
    lines = []
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    for task in tasks:
        if task is current:
            continue
        coro = task.get_coro()
        what = getattr(coro, "__qualname__", repr(coro))
        lines.append(f"task {task.get_name()} ({what}):")
        chain, awaited = _awaits(coro)
        frames = traceback.StackSummary.extract(chain[-limit:], lookup_lines=False)
        lines.extend(f"    {f.filename}:{f.lineno} in {f.name}" for f in frames)
        if awaited is not None:
            lines.append(f"    awaiting {awaited!r}"[:300])
    return f"{len(tasks)} tasks\n" + "\n".join(lines)


def _awaits(coro: Any) -> tuple[list[tuple[Any, int]], Any]:
    """The frames of ``coro`` and of what it awaits, outermost first, and the object at
    the bottom of that chain (a future, usually). ``Task.get_stack`` gives only the
    outermost frame of a suspended coroutine."""
    frames = []
    while coro is not None:
        frame = _first(coro, ("cr_frame", "gi_frame", "ag_frame"))
        if frame is None:
            return frames, coro
        frames.append((frame, frame.f_lineno))
        coro = _first(coro, ("cr_await", "gi_yieldfrom", "ag_await"))
    return frames, None


def _first(obj: Any, names: tuple[str, ...]) -> Any:
    return next((v for v in (getattr(obj, n, None) for n in names) if v is not None), None)


def dump_tasks() -> None:
    log.warning("asyncio tasks (SIGUSR1):\n%s", describe_tasks())


def install_dump() -> None:
    """SIGUSR1 logs every task and where it waits (``dump_tasks``)."""
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
