"""Queue limits: a hard cap on what one user queue may hold across the federation.

A share (fairness.py) says what a queue is entitled to under contention; a limit says
what it may never exceed, contended or not (YARN's maximum-capacity, a Kubernetes
ResourceQuota). A limit names some of ``cpu, mem, disk, net``; the ones it leaves out
are unlimited. The GM serving the queue enforces it when it places a task::

    round of tasks ──▶ LimitLedger(limits, usage of every queue in the GM's view)
        queue limited?  no ──▶ match as usual
                        yes ─▶ held + request <= limit ? ──▶ match ──placed──▶ take(request)
                                        │ no
                                        ▼
                               wait (parked, with the reason) until a task of it ends

The ledger starts from the view's usage (what the LMs hold plus this GM's launches no LM
has answered yet) and adds each placement of the round, so a round never overshoots.
A task whose request alone exceeds its queue's limit can never run: it is refused at
submission (``never_fits``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from services.core.resources import (
    MAX_VALUE,
    NUM_RESOURCES,
    ResourceError,
    parse_quantities,
)
from services.core.resources import format_quantity as quantity

# A dimension the limit leaves out. Far above any sum of requests (at most MAX_VALUE =
# 2**40 each), so ``held + request <= UNLIMITED`` always holds and never overflows.
UNLIMITED = np.int64(1 << 62)

_SHORT = ("cpu", "mem", "disk", "net")


def parse_limit(text: str) -> np.ndarray:
    """``"cpu=16,mem=64Gi"`` -> a vector with the named quantities and ``UNLIMITED``
    elsewhere. Raises ``ResourceError`` for anything ``parse_resources`` refuses, and for a
    quantity of 0 (a queue that may hold nothing should not exist)."""
    vector, named = parse_quantities(text)
    zero = [_SHORT[i] for i in named if vector[i] <= 0]
    if zero:
        raise ResourceError(f"a limit must be above 0: {', '.join(zero)} is 0")
    too_big = [_SHORT[i] for i in named if vector[i] > MAX_VALUE]
    if too_big:
        raise ResourceError(f"limit quantity out of range: {', '.join(too_big)}")
    limit = np.full(NUM_RESOURCES, UNLIMITED, dtype=np.int64)
    for i in named:
        limit[i] = vector[i]
    return limit


def format_limit(limit: np.ndarray) -> str:
    """The limited dimensions as ``parse_limit`` reads them: ``cpu=4,mem=8192Mi``."""
    parts = [
        f"{_SHORT[i]}={quantity(i, int(limit[i]))}"
        for i in range(NUM_RESOURCES)
        if limit[i] < UNLIMITED
    ]
    return ",".join(parts) or "none"


def limit_to_wire(limit: np.ndarray) -> np.ndarray:
    """On the wire (``QueueStatus.limit``) a resource that is not limited is 0."""
    return np.where(limit < UNLIMITED, limit, 0)


def limit_from_wire(vector: np.ndarray) -> np.ndarray:
    return np.where(vector > 0, vector, UNLIMITED)


def describe_held(held: np.ndarray, limit: np.ndarray) -> str:
    """What a queue holds of each limited resource: ``cpu 3/4, mem 512Mi/8192Mi``."""
    return ", ".join(
        f"{_SHORT[i]} {quantity(i, int(held[i]))}/{quantity(i, int(limit[i]))}"
        for i in range(NUM_RESOURCES)
        if limit[i] < UNLIMITED
    )


class QueueLimits:
    """The limits of the queues that have one, by queue name."""

    def __init__(self, limits: Mapping[str, np.ndarray] | None = None):
        self._limits = {q: np.asarray(v, dtype=np.int64) for q, v in (limits or {}).items()}

    @classmethod
    def parse(cls, limits: Iterable[tuple[str, str]]) -> QueueLimits:
        """From ``(queue, "cpu=16,mem=64Gi")`` pairs; an empty text means no limit."""
        return cls({queue: parse_limit(text) for queue, text in limits if text.strip()})

    def __bool__(self) -> bool:
        return bool(self._limits)

    def __contains__(self, queue: str) -> bool:
        return queue in self._limits

    def get(self, queue: str) -> np.ndarray | None:
        return self._limits.get(queue)

    def queues(self) -> list[str]:
        return list(self._limits)

    def never_fits(self, queue: str, request: np.ndarray) -> str | None:
        """Why a task of this request can never run in ``queue`` (its request alone
        exceeds the limit), or None."""
        limit = self._limits.get(queue)
        if limit is None:
            return None
        over = np.flatnonzero(request > limit)
        if not len(over):
            return None
        what = ", ".join(
            f"{_SHORT[i]} {quantity(i, int(request[i]))} > {quantity(i, int(limit[i]))}"
            for i in over
        )
        return f"it asks for more than queue {queue!r} may ever hold ({what})"


class LimitLedger:
    """What each limited queue holds during one scheduling round.

    ``usage`` is what the queues held when the round began (fresh arrays or not: the
    ledger copies what it changes). ``check`` before matching a task, ``take`` once the
    task is placed. ``unknown``: why what the queues hold is not known yet (a GM that has
    not heard from every LM); every limited queue then waits, with that reason.
    """

    def __init__(
        self, limits: QueueLimits, usage: Mapping[str, np.ndarray], unknown: str | None = None
    ):
        self.limits = limits
        self.unknown = unknown
        self._held: dict[str, np.ndarray] = {}
        for queue in limits.queues():
            held = usage.get(queue)
            self._held[queue] = (
                np.zeros(NUM_RESOURCES, dtype=np.int64) if held is None else held.astype(np.int64)
            )

    def held(self, queue: str) -> np.ndarray | None:
        return self._held.get(queue)

    def check(self, queue: str, request: np.ndarray) -> str | None:
        """None if the queue may take ``request`` now, else why it waits."""
        limit = self.limits.get(queue)
        if limit is None:
            return None
        if self.unknown is not None:
            return self.unknown
        held = self._held[queue]
        over = np.flatnonzero(held + request > limit)
        if not len(over):
            return None
        what = ", ".join(
            f"{_SHORT[i]} {quantity(i, int(held[i]))} of {quantity(i, int(limit[i]))} held, "
            f"needs {quantity(i, int(request[i]))}"
            for i in over
        )
        return f"queue {queue!r} is at its limit ({what}); waiting for its tasks to end"

    def take(self, queue: str, request: np.ndarray) -> None:
        held = self._held.get(queue)
        if held is not None:
            held += request
