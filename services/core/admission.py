"""Admission: how many submissions a GM takes on at once, so that it answers every client
within a second instead of answering ever later (issue 32).

A submission is *under way* from the moment the GM reads it until it answers (the broker
confirmed the job's message, or it was refused). An overloaded GM that takes every
submission it reads spends its loop on the ones it took, reads the rest ever later, and
the clients' deadlines run out while their requests wait in front of it. So the GM keeps
the number under way below a *limit* it adapts, as TCP adapts its window and Netflix's
concurrency-limits its ``AIMDLimit``: a client past the limit is refused at once with
``RESOURCE_EXHAUSTED`` and a retry hint, which costs the GM a read and a short answer.

    GM reads a submission ──Admission.admit(queue)──▶ None: taken (``began``)
                                                 └─▶ Refusal: answered at once, nothing queued
    its answer ──Admission.ended(queue, took_s, now)──▶ on time: the limit grows by one
                                                        (while the intake is used)
                                                    └─▶ late (> target_s): the limit shrinks
    the loop's lag ──Admission.lagged(lag_s, now)──▶ late (> max_lag_s): the limit shrinks

The limit shrinks by ``backoff`` at most once per ``target_s`` (the answers under way
when it shrank were already late: counting each would collapse it), never below
``min_limit``. A queue may hold at most ``queue_share`` of the limit while other queues'
submissions are under way too, so one queue's flood leaves room for the others' jobs.

Assumptions: an answer's time, measured from the GM's read, and the loop's lag are what
the GM can see of its own backlog; the wait in front of the read (the client's stream,
the transport) grows only while the loop is late, which ``lagged`` sees. That wait is
measured (``QueueingDelay``, for the reports) but not counted: counted, it made the
overloaded runs no better (docs/overload.md). No clock: the driver passes ``now`` and
the durations.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Answers later than this shrink the limit: well under the 1 s a client is promised, so
# that the wait in front of the read has room.
TARGET_S = 0.5
# A loop later than this shrinks it too (the stall that ``stalls.watch`` logs).
MAX_LAG_S = 0.25
BACKOFF = 0.7
MIN_LIMIT = 64
INITIAL_LIMIT = 256
MAX_LIMIT = 10_000  # the bound before admission adapted (``MAX_SUBMISSIONS``)
QUEUE_SHARE = 0.5


@dataclass(frozen=True)
class Refusal:
    """A submission not taken: why, for the client's message."""

    under_way: int  # in the GM, or in the queue when ``queue`` is set
    limit: int
    queue: str = ""

    def __str__(self) -> str:
        if self.queue:
            return (
                f"queue {self.queue!r} has {self.under_way} submissions under way at this "
                f"GM, its share of the GM's intake ({self.limit})"
            )
        return f"this GM has {self.under_way} submissions under way, its limit now"


@dataclass
class Admission:
    """The GM's intake: an adaptive bound on submissions under way (module doc)."""

    target_s: float = TARGET_S
    max_lag_s: float = MAX_LAG_S
    backoff: float = BACKOFF
    min_limit: int = MIN_LIMIT
    max_limit: int = MAX_LIMIT
    queue_share: float = QUEUE_SHARE
    limit: float = INITIAL_LIMIT
    under_way: int = 0
    by_queue: Counter[str] = field(default_factory=Counter)
    refused: int = 0  # since start, for metrics and reports
    _shrunk_at: float = float("-inf")

    def __post_init__(self) -> None:
        if not 0 < self.backoff < 1:
            raise ValueError(f"backoff {self.backoff} must be within (0, 1)")
        if self.min_limit < 1 or self.max_limit < 0:
            raise ValueError(f"limits {self.min_limit}..{self.max_limit} are not a range")
        if not 0 < self.queue_share <= 1:
            raise ValueError(f"queue_share {self.queue_share} must be within (0, 1]")
        self.limit = max(self.limit, self.min_limit)

    @property
    def current(self) -> int:
        """The bound now: the adapted limit, never above ``max_limit`` (which a driver
        may lower to 0 to refuse every submission)."""
        return min(int(self.limit), self.max_limit)

    def queue_limit(self) -> int:
        return max(self.min_limit, int(self.current * self.queue_share))

    def admit(self, queue: str) -> Refusal | None:
        """Take a submission to ``queue`` (then ``ended`` must follow), or say why not."""
        if self.under_way >= self.current:
            self.refused += 1
            return Refusal(self.under_way, self.current)
        in_queue = self.by_queue[queue]
        if in_queue >= self.queue_limit() and in_queue < self.under_way:  # others wait too
            self.refused += 1
            return Refusal(in_queue, self.queue_limit(), queue)
        self.under_way += 1
        self.by_queue[queue] += 1
        return None

    def ended(self, queue: str, took_s: float, now: float) -> None:
        """A taken submission was answered ``took_s`` after it was read."""
        self.under_way -= 1
        self.by_queue[queue] -= 1
        if not self.by_queue[queue]:
            del self.by_queue[queue]
        if took_s > self.target_s:
            self._shrink(now)
        elif 2 * (self.under_way + 1) >= self.limit:  # the intake is in use: grow
            self.limit = min(max(self.max_limit, self.min_limit), self.limit + 1)

    def lagged(self, lag_s: float, now: float) -> None:
        """The event loop ran a timer ``lag_s`` late."""
        if lag_s > self.max_lag_s:
            self._shrink(now)

    def _shrink(self, now: float) -> None:
        if now - self._shrunk_at < self.target_s:
            return
        self._shrunk_at = now
        self.limit = max(self.min_limit, self.limit * self.backoff)


@dataclass
class QueueingDelay:
    """How long a stream's messages waited in front of their reader, from the time each
    was sent by the sender's clock: the one-way delay (read on the reader's clock less
    sent on the sender's) above the least seen on the stream, which is the clocks'
    offset plus a transit with no queue (LEDBAT's base delay, RFC 6817). One per stream:
    each sender's clock has its own offset. Assumes the sender's clock does not jump
    forward during the stream (a jump reads as a wait until the stream ends)."""

    least_ns: int | None = None

    def wait_s(self, sent_ns: int, read_ns: int) -> float:
        """The wait of a message sent at ``sent_ns`` and read at ``read_ns``; 0 when the
        sender did not say (``sent_ns`` 0) or this is the least delay yet."""
        if sent_ns <= 0:
            return 0.0
        delay = read_ns - sent_ns
        if self.least_ns is None or delay < self.least_ns:
            self.least_ns = delay
        return (delay - self.least_ns) / 1e9
