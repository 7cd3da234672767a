"""The jobs a process has heard were cancelled (``CancelJob``), bounded.

Every GM and LM keeps one: a GM drops a cancelled job's tasks wherever they turn up in
its queues (a queued task, a broker delivery, a launch an LM refused), an LM refuses to
launch them and kills those it runs. Newest ``max_jobs`` kept; a cancel older than that
is forgotten (a task of such a job that is still queued somewhere then runs).
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_KEPT = 100_000  # jobs; about 0.2 KB each with their reasons


class CancelledJobs:
    def __init__(self, max_jobs: int = DEFAULT_KEPT) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be at least 1, got {max_jobs}")
        self.max_jobs = max_jobs
        self._reasons: OrderedDict[str, str] = OrderedDict()

    def add(self, job_id: str, reason: str) -> bool:
        """Note ``job_id`` as cancelled; False if it already was (the first reason stays)."""
        if job_id in self._reasons:
            return False
        self._reasons[job_id] = reason
        if len(self._reasons) > self.max_jobs:
            self._reasons.popitem(last=False)
        return True

    def reason(self, job_id: str) -> str | None:
        """Why ``job_id`` was cancelled, or None if it was not (or is forgotten)."""
        return self._reasons.get(job_id)

    def refusal(self, job_id: str) -> str | None:
        """What an LM answers a GM that asks to run (or hold room for) a task of
        ``job_id``, cancelled; None if it was not."""
        reason = self._reasons.get(job_id)
        return None if reason is None else f"job {job_id} was cancelled: {reason}"

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._reasons

    def __len__(self) -> int:
        return len(self._reasons)
