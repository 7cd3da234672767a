"""The promises a run must keep, checked from the task events alone.

    events (as any subscriber of the events exchange sees them) ──▶ check() ──▶ violations

A recorder that only listens can tell whether the federation kept its word, whatever
crashed meanwhile; nothing here asks a GM or an LM. The promises (issue 27):

- ``stuck``: every task a client was told is queued reaches an end state.
- ``started twice``: no (task, attempt) starts twice (on two nodes, or twice on one).
- ``attempts overlap``: no two attempts of one task run at the same time.
- ``succeeded twice``: a task succeeds at most once.
- ``over-committed``: no node holds more CPU at any moment than it has.

Times are the workers' own stamps (``started_unix_nanos`` / ``finished_unix_nanos``).
An attempt whose end no worker stamped (its worker died, and the LM ended it LOST) has
no known end; it is left out of the overlap and capacity sweeps and counted apart
(``unknown_ends``), never guessed.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services._proto.megha.v1 import common_pb2
from services.core.states import ATTEMPT_ENDED, TERMINAL


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    task_id: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.task_id}: {self.detail}"


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    tasks: int = 0
    attempts_started: int = 0
    unknown_ends: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    def count(self, kind: str) -> int:
        return sum(v.kind == kind for v in self.violations)

    def summary(self) -> str:
        kinds = sorted({v.kind for v in self.violations})
        counts = ", ".join(f"{self.count(k)} {k}" for k in kinds) or "no violations"
        return (
            f"{self.tasks} tasks, {self.attempts_started} attempts started, "
            f"{self.unknown_ends} ends no worker stamped: {counts}"
        )


def check(
    events: Iterable[common_pb2.TaskEvent],
    acknowledged: Iterable[str],
    cpu_milli: Mapping[str, int] | None = None,
    capacity_milli: Mapping[str, int] | None = None,
) -> Report:
    """Every promise above over ``events``; ``acknowledged`` are the task ids clients
    were told are queued. The capacity sweep runs when the tasks' CPU (``cpu_milli``,
    by task id) and the nodes' (``capacity_milli``, by node id) are given."""
    acknowledged = set(acknowledged)
    report = Report(tasks=len(acknowledged))
    # (task, attempt) -> the distinct (node, start stamp) it was seen RUNNING with.
    starts: dict[tuple[str, int], set[tuple[str, int]]] = defaultdict(set)
    finished: dict[tuple[str, int], int] = {}
    ended: set[str] = set()
    successes: dict[str, set[tuple[int, str, int]]] = defaultdict(set)
    for event in events:
        key = (event.task_id, event.attempt)
        stamps = event.timestamps
        if event.state == common_pb2.TASK_STATE_RUNNING and stamps.started_unix_nanos:
            starts[key].add((event.node_id, stamps.started_unix_nanos))
        if event.state in ATTEMPT_ENDED and stamps.finished_unix_nanos:
            if stamps.started_unix_nanos:  # the end of a run, not of a queued attempt
                starts[key].add((event.node_id, stamps.started_unix_nanos))
            finished[key] = max(finished.get(key, 0), stamps.finished_unix_nanos)
        if event.state in TERMINAL:
            ended.add(event.task_id)
        if event.state == common_pb2.TASK_STATE_SUCCEEDED and stamps.started_unix_nanos:
            # (an end learnt without its run's stamps, e.g. from a GM's book, proves no run)
            successes[event.task_id].add((event.attempt, event.node_id, stamps.started_unix_nanos))

    for task_id in sorted(acknowledged - ended):
        report.violations.append(Violation("stuck", task_id, "never reached an end state"))
    for task_id, runs_ok in sorted(successes.items()):
        if len(runs_ok) > 1:
            where = ", ".join(f"attempt {a} on {n or '?'}" for a, n, _ in sorted(runs_ok))
            report.violations.append(Violation("succeeded twice", task_id, where))

    runs: dict[str, list[tuple[int, int | None, int, str]]] = defaultdict(list)
    for (task_id, attempt), seen in sorted(starts.items()):
        report.attempts_started += 1
        if len(seen) > 1:
            where = ", ".join(f"{node or '?'}@{stamp}" for node, stamp in sorted(seen))
            report.violations.append(
                Violation("started twice", task_id, f"attempt {attempt} on {where}")
            )
        node, started = min(seen, key=lambda s: s[1])
        end = finished.get((task_id, attempt))
        if end is None:
            report.unknown_ends += 1
        runs[task_id].append((started, end, attempt, node))

    for task_id, spans in sorted(runs.items()):
        known = sorted((s, e, a) for s, e, a, _ in spans if e is not None)
        for (_s1, e1, a1), (s2, _e2, a2) in itertools.pairwise(known):
            if a1 != a2 and s2 < e1:
                report.violations.append(
                    Violation(
                        "attempts overlap",
                        task_id,
                        f"attempt {a2} started {(e1 - s2) / 1e9:.3f} s before attempt {a1} ended",
                    )
                )

    if cpu_milli is not None and capacity_milli is not None:
        report.violations.extend(_over_committed(runs, cpu_milli, capacity_milli))
    return report


def _over_committed(
    runs: Mapping[str, list[tuple[int, int | None, int, str]]],
    cpu_milli: Mapping[str, int],
    capacity_milli: Mapping[str, int],
) -> list[Violation]:
    """Per node, a sweep over the starts and ends of the runs with known ends: the CPU
    held at each moment against the node's capacity (an end before a start at the same
    instant: a task that ends as the next starts does not count twice)."""
    moves: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for task_id, spans in runs.items():
        cpu = cpu_milli.get(task_id, 0)
        for started, end, _attempt, node in spans:
            if end is not None and node:
                moves[node] += [(started, cpu, task_id), (end, -cpu, task_id)]
    out = []
    for node, events in sorted(moves.items()):
        capacity = capacity_milli.get(node)
        if capacity is None:
            continue
        held = 0
        for _at, delta, task_id in sorted(events, key=lambda m: (m[0], m[1])):
            held += delta
            if held > capacity:
                out.append(
                    Violation("over-committed", task_id, f"node {node} held {held}m of {capacity}m")
                )
                break
    return out
