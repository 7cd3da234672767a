"""What a bench-live run proves, and the search for the highest rate a federation serves.

    summary.json ──▶ verdict(): exactly once (0) | saturated, measured (0) | breach (1)
    RateSearch: start ──x2──▶ ... first miss ──bisect──▶ highest rate that met the target

An overloaded run is a measurement, not a failure: a GM that refuses what it cannot take
(``RESOURCE_EXHAUSTED``), or a submission the load generator gave up waiting for
(``DEADLINE_EXCEEDED``), is reported with the rate that was placed. What must never pass
is a breach of exactly once: a task the federation acknowledged that did not run, or one
that ran twice, whatever the load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

EXACTLY_ONCE = "exactly_once"
SATURATED = "saturated"
BREACH = "breach"


@dataclass(frozen=True)
class Verdict:
    """``kind`` is one of ``EXACTLY_ONCE`` (every offered task ran once), ``SATURATED``
    (some submissions were refused or unanswered; every task a GM acknowledged ran once)
    or ``BREACH``; ``reasons`` say why, for a person."""

    kind: str
    reasons: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        """The CLI's: 1 for a breach of exactly once, else 0."""
        return 1 if self.kind == BREACH else 0


def verdict(summary: Mapping[str, Any]) -> Verdict:
    """Classify a bench-live ``summary``: its ``tasks`` (offered), ``accepted`` (tasks a GM
    acknowledged), ``completed`` (accepted tasks that succeeded), ``failed`` (accepted
    tasks that ended otherwise), ``duplicates`` (tasks that succeeded more than once,
    acknowledged or not) and ``submit_errors`` (gRPC code -> jobs not acknowledged)."""
    breaches = []
    if summary["duplicates"]:
        breaches.append(f"{summary['duplicates']} tasks ran more than once")
    if summary["failed"]:
        breaches.append(f"{summary['failed']} acknowledged tasks ended without succeeding")
    unfinished = summary["accepted"] - summary["completed"] - summary["failed"]
    if unfinished > 0:
        breaches.append(
            f"{unfinished} acknowledged tasks had not ended when the wait for them ran out "
            "(lost, or still queued)"
        )
    if breaches:
        return Verdict(BREACH, tuple(breaches))
    refused = summary["tasks"] - summary["accepted"]
    if refused > 0:
        codes = ", ".join(f"{code} {n}" for code, n in sorted(summary["submit_errors"].items()))
        why = f"{refused} of {summary['tasks']} offered tasks were not acknowledged"
        return Verdict(SATURATED, (f"{why} (jobs by code: {codes})",))
    return Verdict(EXACTLY_ONCE)


def target_met(summary: Mapping[str, Any], target_p99_s: float) -> tuple[bool, str]:
    """Whether a run served its offered rate: every offered task placed and completed
    exactly once, the allocation-time p99 within ``target_p99_s``, and the load
    generator itself keeping up (it offered at least 95 % of the rate); and why not."""
    judged = verdict(summary)
    if judged.kind != EXACTLY_ONCE:
        return False, "; ".join(judged.reasons)
    p99 = summary["alloc_s"]["p99"]
    if p99 is None or p99 > target_p99_s:
        shown = "none" if p99 is None else f"{1e3 * p99:.1f} ms"
        return False, f"allocation p99 {shown} > {1e3 * target_p99_s:g} ms"
    offered = summary.get("achieved_offer_rate")
    if offered is not None and offered < 0.95 * summary["offered_rate"]:
        return False, f"the load generator offered only {offered:.0f} tasks/s"
    return True, f"allocation p99 {1e3 * p99:.1f} ms"


@dataclass
class RateSearch:
    """The highest offered rate that meets a target, in at most ``max_runs`` runs.

    Assumes that meeting the target is monotone in the rate (a federation that keeps up
    at R keeps up below R). Algorithm:

    1. Try ``start``; while runs meet the target, double the rate.
    2. If the first run misses, halve instead until one meets it (or the rate would
       drop below ``min_rate``: then no rate met it).
    3. Once a met rate ``lo`` and a missed rate ``hi`` bracket the answer, try their
       midpoint (whole tasks/s) until ``hi / lo - 1 <= resolution``.
    4. Stop after ``max_runs`` runs; ``best`` is the highest rate that met it.
    """

    start: float
    max_runs: int = 6
    resolution: float = 0.1
    min_rate: float = 1.0
    tried: list[tuple[float, bool]] = field(default_factory=list)

    @property
    def best(self) -> float | None:
        """The highest rate that met the target, or None."""
        return max((rate for rate, met in self.tried if met), default=None)

    @property
    def lowest_missed(self) -> float | None:
        """The lowest rate above ``best`` that missed the target, or None."""
        best = self.best
        return min(
            (rate for rate, met in self.tried if not met and (best is None or rate > best)),
            default=None,
        )

    def record(self, rate: float, met: bool) -> None:
        self.tried.append((rate, met))

    def next_rate(self) -> float | None:
        """The rate to try next, or None when the search is done."""
        if len(self.tried) >= self.max_runs:
            return None
        if not self.tried:
            return self.start
        lo, hi = self.best, self.lowest_missed
        if hi is None:  # every run met it
            return 2 * lo  # type: ignore[operator]
        if lo is None:  # every run missed it
            lower = math.floor(hi / 2)
            return float(lower) if lower >= self.min_rate else None
        if hi / lo - 1 <= self.resolution:
            return None
        mid = float(round((lo + hi) / 2))
        return mid if lo < mid < hi else None
