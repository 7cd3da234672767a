"""The task states every process, the simulator and the load generator agree on, and
their sets: one vocabulary.

    QUEUED ─▶ PLACED ─▶ RUNNING ─▶ SUCCEEDED | FAILED | CANCELLED        (TERMINAL)
       │                   └─────▶ PREEMPTED | LOST | RETRYING ─▶ QUEUED  (REQUEUED:
       └─▶ REJECTED | CANCELLED                                  the next attempt)

``TaskState`` is an ``IntEnum`` whose values are the wire enum's (``megha.v1.TaskState``;
``tests/unit/lm/test_lifecycle_wire.py`` checks it), so a protobuf value compares equal
to its member and is found in these sets: the core imports no protobuf, and every other
layer uses these sets with the wire values as they come.
"""

from __future__ import annotations

import enum


class TaskState(enum.IntEnum):
    """Where a task is in its life."""

    UNSPECIFIED = 0
    QUEUED = 1
    PLACED = 2
    RUNNING = 3
    SUCCEEDED = 4
    FAILED = 5
    PREEMPTED = 6
    LOST = 7
    REJECTED = 8
    CANCELLED = 9
    RETRYING = 10


QUEUED = TaskState.QUEUED
PLACED = TaskState.PLACED
RUNNING = TaskState.RUNNING
SUCCEEDED = TaskState.SUCCEEDED
FAILED = TaskState.FAILED
PREEMPTED = TaskState.PREEMPTED
LOST = TaskState.LOST
REJECTED = TaskState.REJECTED
CANCELLED = TaskState.CANCELLED
RETRYING = TaskState.RETRYING

TERMINAL = frozenset({SUCCEEDED, FAILED, REJECTED, CANCELLED})
"""The states a task never leaves: its job book's last word, what a client waits for."""

REQUEUED = frozenset({RETRYING, LOST, PREEMPTED})
"""Ends of an attempt after which the task is queued again as its next attempt."""

ATTEMPT_ENDED = TERMINAL | REQUEUED
"""Every end of one attempt: the task ends, or goes on as its next attempt."""

RELEASED = ATTEMPT_ENDED - {REJECTED}
"""Ends of an attempt an LM held: its resources are free again (the LM's view, and every
GM's as it hears the event). A REJECTED task was refused before any LM held it."""

RUN_ENDED = frozenset({SUCCEEDED, FAILED, PREEMPTED, CANCELLED})
"""How a worker reports a run that is over for this LM, which then forgets the task (a
worker's LOST, from a graceful stop, and a FAILED with retries left are queued again
instead)."""
