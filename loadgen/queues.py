"""User queues for fairness runs (``--queues FILE``) and the shares they really got.

    FILE (YAML list of name, share, gm[, limit]) ──load_queues──▶ QueueConfig per queue
    trace jobs ──assign_queues──▶ a queue per task: the job's user when the trace names
        users, else round-robin over the queues, task by task
    enqueues, starts, ends (sim task log or live events) ──measured_shares──▶ per queue the
        time-averaged dominant share while every queue had waiting tasks
    the same ──peak_held──▶ per queue the most CPU and memory its running tasks held at once

``megha-loadgen simulate`` and ``bench-live`` both write what ``summary_queues`` returns
under ``"queues"`` in summary.json, so a live run and a simulation compare key by key.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import ValidationError

from services.common.config import QueueConfig

_GM_ID = re.compile(r"^gm-?(\d+)$")


class QueueFileError(ValueError):
    """The queue file is malformed; the message names the file and the entry."""


def parse_queues(data: Any, where: str = "queues") -> tuple[QueueConfig, ...]:
    """Validate a list of ``{name, share, gm[, limit]}`` as ``QueueConfig``s; ``gm`` is
    ``gm-N`` or the number N (made ``gm-N``), ``limit`` as in a federation file."""
    if isinstance(data, dict) and "queues" in data:
        data = data["queues"]
    if not isinstance(data, list) or not data:
        raise QueueFileError(f"{where}: expected a non-empty list of queues (name, share, gm)")
    out = []
    for i, entry in enumerate(data, 1):
        out.append(_queue(entry, f"{where}: queue {i}"))
    names = [q.name for q in out]
    if len(set(names)) != len(names):
        raise QueueFileError(f"{where}: queue names must be unique, got {names}")
    total = sum(q.share for q in out)
    if total > 1 + 1e-9:
        raise QueueFileError(f"{where}: shares add up to {total:.2f}; they must not exceed 1")
    return tuple(out)


def _queue(entry: Any, at: str) -> QueueConfig:
    """One entry, checked by ``QueueConfig`` itself; its complaints are worded for the
    file (the first of name, share, limit, then gm, as the file reads)."""
    if not isinstance(entry, dict):
        raise QueueFileError(f"{at}: expected a mapping with name, share and gm")
    unknown = set(entry) - set(QueueConfig.model_fields)
    if unknown:
        raise QueueFileError(
            f"{at}: unknown keys {sorted(unknown)}; use {', '.join(QueueConfig.model_fields)}"
        )
    name = entry.get("name")
    gm = _gm_id(entry.get("gm"))
    # Strict: a share of true or "0.5" is a mistake in a file. The file must give a share
    # (None fails), where a federation file defaults it to 1.
    checked = {"share": None, **entry, "gm": gm or ""}
    try:
        queue = QueueConfig.model_validate(checked, strict=True)
    except ValidationError as err:
        problem = err.errors()[0]
        field = problem["loc"][0]
        if field == "name":
            raise QueueFileError(f"{at}: 'name' must be a non-empty string") from None
        if field == "share":
            raise QueueFileError(f"{at} ({name}): 'share' must be a number in (0, 1]") from None
        if field != "limit":
            raise QueueFileError(f"{at} ({name}): '{field}': {problem['msg']}") from None
        # The validator's error chains the reason (a ResourceError); a wrong type has none.
        raised = problem.get("ctx", {}).get("error")
        reason = getattr(raised, "__cause__", None) or "expected a string such as cpu=16,mem=64Gi"
        raise QueueFileError(f"{at} ({name}): 'limit' {entry.get('limit')!r}: {reason}") from None
    if gm is None:
        raise QueueFileError(
            f"{at} ({name}): 'gm' must be a GM id gm-N or its number N (from 1), "
            f"got {entry.get('gm')!r}"
        )
    return queue


def _gm_id(value: Any) -> str | None:
    """``gm-N`` for N or a GM id naming N (``gm-N``, ``gmN``), N from 1; else None."""
    if isinstance(value, str):
        found = _GM_ID.match(value.strip())
        value = int(found.group(1)) if found else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return f"gm-{value}"
    return None


def gm_index(gm_id: str) -> int:
    """Where GM ``gm-N`` stands among a federation's GMs: N - 1. Loadgen's federations and
    simulations name their GMs as ``default_config`` does (gm-1, gm-2, ...)."""
    found = _GM_ID.match(gm_id)
    if found is None or int(found.group(1)) < 1:
        raise QueueFileError(f"GM {gm_id!r} is not named gm-N (N from 1)")
    return int(found.group(1)) - 1


def load_queues(path: str | Path) -> tuple[QueueConfig, ...]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise QueueFileError(f"{path}: not YAML: {err}") from None
    return parse_queues(data, str(path))


def check_gms(queues: Sequence[QueueConfig], gms: int) -> None:
    for q in queues:
        if gm_index(q.gm) >= gms:
            raise QueueFileError(f"queue {q.name!r} is served by {q.gm}, but there are {gms} GMs")


def assign_queues(
    users: Sequence[str], first: np.ndarray, queues: Sequence[QueueConfig]
) -> np.ndarray:
    """Queue index of every task. A job whose user is a queue's name goes there; other
    named users go round-robin over the queues in order of first appearance (one user,
    one queue); tasks of jobs without a user go round-robin over the queues one by one."""
    counts = np.diff(first)
    out = np.empty(int(first[-1]), dtype=np.int32)
    by_name = {q.name: i for i, q in enumerate(queues)}
    users_seen: dict[str, int] = {}
    unnamed = 0
    for job, user in enumerate(users if len(users) else [""] * counts.size):
        lo, hi = int(first[job]), int(first[job + 1])
        if user:
            index = by_name.get(user)
            if index is None:
                index = users_seen.setdefault(user, len(users_seen) % len(queues))
            out[lo:hi] = index
        else:
            out[lo:hi] = (np.arange(hi - lo) + unnamed) % len(queues)
            unnamed += hi - lo
    return out


@dataclass(frozen=True)
class Attempts:
    """What a run did, one row per task attempt (any clock in ns, one clock per run)."""

    queue: np.ndarray  # int, index into the queue list
    enqueued: np.ndarray  # when the attempt joined its user queue
    started: np.ndarray  # 0: never started
    ended: np.ndarray  # 0: still running at the end of the run
    cpu_milli: np.ndarray
    memory_mb: np.ndarray


def _timeline(attempts: Attempts, queues: int) -> tuple[np.ndarray, np.ndarray]:
    """The moments anything changed, and from each to the next, per queue: the attempts
    waiting, and the CPU and memory its running attempts held, shape
    ``(3, moments, queues)``. An attempt holds from its start to its end (to the end of
    the run if it never ended); changes at one moment count together."""
    a = attempts
    started = a.started > 0
    horizon = max(int(a.ended.max(initial=0)), int(a.started.max(initial=0)))
    ended = np.where(a.ended > 0, a.ended, horizon)
    times = np.concatenate([a.enqueued, a.started[started], ended[started]])
    q = np.concatenate([a.queue, a.queue[started], a.queue[started]]).astype(np.int64)
    n_run = int(started.sum())
    waiting = np.concatenate([np.ones(a.queue.size), -np.ones(n_run), np.zeros(n_run)])
    sign = np.concatenate([np.zeros(a.queue.size), np.ones(n_run), -np.ones(n_run)])
    none = np.zeros(a.queue.size)
    cpu = sign * np.concatenate([none, a.cpu_milli[started], a.cpu_milli[started]])
    mem = sign * np.concatenate([none, a.memory_mb[started], a.memory_mb[started]])
    points, slot = np.unique(times, return_inverse=True)
    cube = np.zeros((3, points.size, queues))
    for k, delta in enumerate((waiting, cpu, mem)):
        np.add.at(cube[k], (slot, q), delta)
    return points, np.cumsum(cube, axis=1)


def measured_shares(
    attempts: Attempts, queues: int, total_cpu: float, total_memory: float
) -> tuple[list[float | None], float]:
    """Per queue, the dominant share it held averaged over the time every queue had a
    task waiting (enqueued, not yet started); and how long that was, in seconds.

    Shares are None when no queue was ever backlogged at the same time as all others.
    """
    points, cube = _timeline(attempts, queues)
    if points.size == 0:
        return [None] * queues, 0.0
    length = np.diff(points).astype(float)
    backlogged = (cube[0, :-1] > 0).all(axis=1)
    weight = length * backlogged
    window = float(weight.sum())
    if window <= 0:
        return [None] * queues, 0.0
    share = np.zeros((points.size - 1, queues))
    if total_cpu > 0:
        share = np.maximum(share, cube[1, :-1] / total_cpu)
    if total_memory > 0:
        share = np.maximum(share, cube[2, :-1] / total_memory)
    averaged = (share * weight[:, None]).sum(axis=0) / window
    return [round(float(s), 4) for s in averaged], round(window / 1e9, 3)


def peak_held(attempts: Attempts, queues: int) -> np.ndarray:
    """Per queue, the most CPU (millicores) and memory (MiB) its running attempts held at
    one moment, shape ``(queues, 2)`` (``_timeline``: an attempt that ends when another
    starts is not counted with it)."""
    points, cube = _timeline(attempts, queues)
    if points.size == 0:
        return np.zeros((queues, 2), dtype=np.int64)
    return np.maximum(cube[1:].max(axis=1), 0).T.round().astype(np.int64)


def summary_queues(
    queues: Sequence[QueueConfig],
    measured: Sequence[float | None],
    preempted: Sequence[int],
    tasks: Sequence[int],
    peaks: np.ndarray | None = None,
    preempted_work_s: Sequence[float] | None = None,
) -> dict[str, dict[str, Any]]:
    """The ``"queues"`` entry of summary.json. ``preemptions``: the queue's task attempts
    that were preempted (the victims it gave up); ``preempted_work_s``: how long those
    attempts had run when preempted (work thrown away); ``peak_cpu_milli`` and
    ``peak_memory_mb``: ``peak_held``, to set beside ``limit``."""
    out = {}
    for i, q in enumerate(queues):
        row: dict[str, Any] = {
            "share": q.share,
            "measured_share": measured[i],
            "preemptions": int(preempted[i]),
            "gm": q.gm,
            "tasks": int(tasks[i]),
            "limit": q.limit or None,
        }
        if preempted_work_s is not None:
            row["preempted_work_s"] = round(float(preempted_work_s[i]), 3)
        if peaks is not None:
            row["peak_cpu_milli"], row["peak_memory_mb"] = (int(v) for v in peaks[i])
        out[q.name] = row
    return out


def render(summary_entry: dict[str, dict[str, Any]], backlogged_s: float) -> str:
    """One line per queue: configured vs measured share, preemptions."""
    lines = [f"queues (shares averaged over {backlogged_s:,.1f} s with every queue backlogged)"]
    for name, q in summary_entry.items():
        measured = q["measured_share"]
        got = "-" if measured is None else f"{measured:.1%}"
        line = (
            f"  {name:<12} {q['gm']:<6} share {q['share']:.0%}  measured {got:>6}  "
            f"preempted {q['preemptions']}"
        )
        if q.get("preempted_work_s"):
            line += f" ({q['preempted_work_s']:,.0f} s of work lost)"
        if q.get("limit"):
            line += (
                f"  limit {q['limit']}: held at most cpu={q['peak_cpu_milli'] / 1000:g} "
                f"mem={q['peak_memory_mb']}Mi"
            )
        lines.append(line)
    return "\n".join(lines)


class LiveAttempts:
    """Task attempts as a live run's lifecycle events tell them (bench-live).

    A task is enqueued when the load generator's submission is acknowledged (attempt 0)
    or when an LM re-queues it (its ``queued`` stamp); an attempt starts at its
    ``started`` stamp and ends at ``finished`` (or, preempted or lost, when the event
    arrives: the LM stamps no end then).
    """

    def __init__(self, queues: Sequence[QueueConfig]) -> None:
        self.index = {q.name: i for i, q in enumerate(queues)}
        self.queues = len(queues)
        # (task_id, attempt) -> [queue, enqueued, started, ended]
        self.rows: dict[tuple[str, int], list[int]] = {}
        self.preempted = [0] * len(queues)

    def submitted(self, task_id: str, queue: str, at_ns: int) -> None:
        row = self.rows.setdefault((task_id, 0), [self.index.get(queue, -1), at_ns, 0, 0])
        row[1] = min(row[1], at_ns) if row[1] else at_ns

    def add_event(self, event: Any, now_ns: int) -> None:
        from services._proto.megha.v1 import common_pb2
        from services.core.states import RELEASED  # the end of an attempt an LM held

        queue = self.index.get(event.queue)
        if queue is None:
            return
        stamps = event.timestamps
        row = self.rows.setdefault((event.task_id, event.attempt), [queue, 0, 0, 0])
        if stamps.queued_unix_nanos and (not row[1] or stamps.queued_unix_nanos < row[1]):
            row[1] = stamps.queued_unix_nanos
        if event.state == common_pb2.TASK_STATE_RUNNING:
            row[2] = stamps.started_unix_nanos or now_ns
        elif event.state in RELEASED:
            row[2] = row[2] or stamps.started_unix_nanos
            row[3] = stamps.finished_unix_nanos or now_ns
            if event.state == common_pb2.TASK_STATE_PREEMPTED:
                self.preempted[queue] += 1

    def attempts(self, cpu_milli: int, memory_mb: int) -> Attempts:
        """Every attempt seen, each holding ``cpu_milli`` and ``memory_mb`` while it ran."""
        rows = np.array(
            [r for r in self.rows.values() if r[0] >= 0 and r[1]], dtype=np.int64
        ).reshape(-1, 4)
        # An end without a start (the start event was missed) holds nothing.
        rows[rows[:, 2] == 0, 3] = 0
        return Attempts(
            queue=rows[:, 0],
            enqueued=rows[:, 1],
            started=rows[:, 2],
            ended=rows[:, 3],
            cpu_milli=np.full(len(rows), cpu_milli),
            memory_mb=np.full(len(rows), memory_mb),
        )

    def tasks_per_queue(self) -> list[int]:
        counts = [0] * self.queues
        for (_, attempt), row in self.rows.items():
            if attempt == 0 and row[0] >= 0:
                counts[row[0]] += 1
        return counts
