"""Trace readers into one canonical job model.

Sparrow / Megha simulator traces (``*.tr``): one job per line,
``arrival_s num_tasks mean_duration_s dur_1 ... dur_n``. The readers of the published
Google 2019, Alibaba 2018 and Azure tables live in ``loadgen/readers`` and produce the same
``TraceJob``; ``loadgen.readers.read_trace`` picks one by format or file name.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO


class TraceError(ValueError):
    """A malformed trace line; says file and line number."""


@dataclass(frozen=True, slots=True)
class TraceTask:
    """One task of the canonical model. ``.tr`` traces carry only durations: a task then
    takes one CPU (the public Megha and Sparrow simulators' convention)."""

    duration_s: float
    cpu_milli: int = 1000
    memory_mb: int = 0
    disk_mb: int = 0
    net_mbps: int = 0
    constraints: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job of the canonical model every reader produces."""

    job_id: str
    arrival_s: float
    tasks: tuple[TraceTask, ...]
    user: str = ""  # the user/queue when the trace names one

    @property
    def durations_s(self) -> tuple[float, ...]:
        return tuple(t.duration_s for t in self.tasks)


MAX_PROBLEMS = 10  # malformed lines quoted in full; the rest are only counted


@dataclass
class ReadStats:
    lines: int = 0
    jobs: int = 0
    skipped: int = 0  # malformed lines, skipped (``strict`` raises instead)
    problems: list[str] = field(default_factory=list)  # the first few, for the report
    # Well-formed records that describe no finished task (never scheduled, still running
    # at the end of the trace): not errors, but the user should know they were left out.
    incomplete: int = 0
    # What augmentation did to the jobs (Gridiron settings, constraint repairs), one line each.
    notes: list[str] = field(default_factory=list)

    def require_jobs(self, jobs: Sequence[TraceJob], path: str | Path) -> None:
        """Raise ``TraceError`` when a trace gave no job at all, saying how many of its
        lines were skipped as malformed (and the first reason), so that a run does not
        go ahead with nothing to do."""
        if jobs:
            return
        why = ""
        if self.skipped:
            why = f" ({self.skipped} malformed lines skipped, e.g. {self.problems[0]})"
        raise TraceError(f"no jobs in {path}{why}")

    def malformed(self, err: TraceError, strict: bool) -> None:
        """Raise ``err`` when ``strict``; else count the line and keep its message."""
        if strict:
            raise err
        self.skipped += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(str(err))


def read_tr(
    path: str | Path,
    strict: bool = False,
    max_jobs: int | None = None,
    stats: ReadStats | None = None,
) -> Iterator[TraceJob]:
    """Yield jobs in file order. Malformed lines raise (``strict``) or are skipped and
    counted in ``stats`` with their file and line number."""
    path = Path(path)
    stats = stats if stats is not None else ReadStats()
    with open_text(path) as lines:
        for number, line in enumerate(lines, start=1):
            if max_jobs is not None and stats.jobs >= max_jobs:
                return
            stats.lines += 1
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            try:
                job = _parse_tr_line(text, f"{path.name}:{number}")
            except TraceError as err:
                stats.malformed(err, strict)
                continue
            stats.jobs += 1
            yield job


def open_text(path: Path) -> TextIO:
    """Open a trace for reading; ``*.gz`` files (how the public traces ship) are unpacked
    on the fly."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", newline="")
    return path.open(newline="")


def _parse_tr_line(text: str, where: str) -> TraceJob:
    fields = text.split()
    if len(fields) < 3:
        raise TraceError(f"{where}: expected 'arrival num_tasks mean dur...', got {text[:60]!r}")
    try:
        arrival = float(fields[0])
        count = int(fields[1])
        durations = tuple(float(f) for f in fields[3:])
    except ValueError as err:
        raise TraceError(f"{where}: {err}") from None
    if arrival < 0 or count < 1:
        raise TraceError(f"{where}: arrival must be >= 0 and num_tasks >= 1")
    if len(durations) != count:
        raise TraceError(f"{where}: num_tasks is {count} but {len(durations)} durations follow")
    if min(durations) < 0:
        raise TraceError(f"{where}: negative task duration")
    return TraceJob(
        job_id=f"job{where.rsplit(':', 1)[1]}",
        arrival_s=arrival,
        tasks=tuple(TraceTask(duration_s=d) for d in durations),
    )
