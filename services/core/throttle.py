"""Client-side throttling: a client that a GM keeps refusing stops asking so often
(issue 32, item 1).

A GM whose intake is full refuses a submission at once (``admission.py``), and the client
tries it again after a pause. Each refused try still costs the GM a read, a refusal and an
answer, and the client a request and an answer. Under a sustained overload the jobs
waiting for another try pile up in the clients, and with them the tries: at 1,000 one-task
jobs per second offered to a federation placing about 500, the GMs refused about 10,000
tries a second (``megha-loadgen bench-live --rate 1000``), and that work starved the
placements and the answers it was meant to protect.

So each client keeps the rule of the Google SRE book's chapter "Handling Overload"
("Client-side throttling"): over the last ``window_s`` it counts its *requests* (every
try it meant to make, those it then kept to itself too) and the *accepts* (tries the GM
did not refuse for being too busy), and it keeps a new try to itself, answered at once as
a refusal, with probability

    max(0, (requests - k * accepts) / (requests + 1))

While the GM takes everything, no try is kept back, nor while the client made fewer than
``min_requests`` in the window (a few tries load no GM, and one refused try would
otherwise hold back every other one). Past that, the GM still sees about
``k`` tries per one it takes, enough to learn at once when it takes more again, and the
rest of the refusals cost no message.

Assumptions: only a refusal for being busy (``RESOURCE_EXHAUSTED``) counts against the
GM; an unreachable GM or a bad request is the caller's to handle and is not counted. The
counts live in one-second buckets, so a record or a check costs O(1) amortised. No clock
and no randomness here: the driver passes ``now`` and a uniform draw in [0, 1).
"""

from __future__ import annotations

from collections import deque

K = 2.0  # the SRE book's multiplier: the GM sees about twice the tries it takes
WINDOW_S = 10.0  # long enough to count many tries, short enough to follow a change
MIN_REQUESTS = 20


class AdaptiveThrottle:
    """The counts of one client's tries to one GM, and the rule above."""

    __slots__ = ("_accepts", "_buckets", "_requests", "k", "min_requests", "window_s")

    def __init__(self, k: float = K, window_s: float = WINDOW_S, min_requests: int = MIN_REQUESTS):
        if k < 1:
            raise ValueError(f"k must be at least 1 (a GM taking all is never throttled), got {k}")
        if window_s < 1:
            raise ValueError(f"window_s must be at least 1 s, got {window_s}")
        self.k = k
        self.window_s = window_s
        self.min_requests = min_requests
        # [second, requests, accepts], oldest first; the totals of the kept ones.
        self._buckets: deque[list[int]] = deque()
        self._requests = 0
        self._accepts = 0

    def reject_probability(self, now: float) -> float:
        """The chance that a try made at ``now`` is kept back."""
        self._expire(now)
        requests = self._requests
        if requests < self.min_requests:
            return 0.0
        return max(0.0, (requests - self.k * self._accepts) / (requests + 1))

    def allow(self, now: float, draw: float) -> bool:
        """Whether a try is to be sent at ``now`` (``draw``: uniform in [0, 1)). A try kept
        back is to be ``record``ed as refused."""
        return draw >= self.reject_probability(now)

    def record(self, now: float, accepted: bool) -> None:
        """A request: a try the GM answered (``accepted`` unless refused for being busy),
        or one kept back (not accepted). Other failures are not recorded."""
        bucket = self._bucket(now)
        bucket[1] += 1
        self._requests += 1
        if accepted:
            bucket[2] += 1
            self._accepts += 1

    def counts(self, now: float) -> tuple[int, int]:
        """(requests, accepts) within the window."""
        self._expire(now)
        return self._requests, self._accepts

    def _bucket(self, now: float) -> list[int]:
        self._expire(now)
        second = int(now)
        buckets = self._buckets
        if not buckets or buckets[-1][0] < second:
            buckets.append([second, 0, 0])
        return buckets[-1]

    def _expire(self, now: float) -> None:
        oldest = int(now - self.window_s)
        buckets = self._buckets
        while buckets and buckets[0][0] <= oldest:
            _, requests, accepts = buckets.popleft()
            self._requests -= requests
            self._accepts -= accepts


# The window over which a client's gate measures how fast its jobs go through
# (``services/common/gate.py``).
PACE_S = 2.0


class Pace:
    """How fast places come free at a client's gate (``Gate``: each job in flight that
    ends frees one), and whether a job that would wait behind others can have its turn
    within its bound. A job that cannot is refused at once rather than after waiting out
    the bound: its caller hears sooner, and the client keeps no future and no timer for it.

    The pace is the places freed over the last ``window_s`` (or since the first, when that
    is more recent). While none came free in the window nothing is judged hopeless: the
    waiters then wait out their own bounds."""

    __slots__ = ("_freed", "_since", "window_s")

    def __init__(self, window_s: float = PACE_S):
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._freed: deque[float] = deque()  # when each place came free, oldest first
        self._since: float | None = None

    def freed(self, now: float) -> None:
        """A place came free at ``now``."""
        if self._since is None:
            self._since = now
        self._freed.append(now)
        self._expire(now)

    def per_s(self, now: float) -> float:
        """Places freed per second lately (0.0: none within the window)."""
        self._expire(now)
        if not self._freed or self._since is None:
            return 0.0
        return len(self._freed) / max(min(self.window_s, now - self._since), 0.1)

    def hopeless(self, places: int, within_s: float, now: float) -> bool:
        """Whether a job whose turn comes once ``places`` more came free would not have
        it within ``within_s``, at the pace lately."""
        rate = self.per_s(now)
        return rate > 0 and places / rate > within_s

    def _expire(self, now: float) -> None:
        oldest = now - self.window_s
        freed = self._freed
        while freed and freed[0] <= oldest:
            freed.popleft()
