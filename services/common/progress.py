"""The one status line a long command redraws on stderr: a simulation, a replay, a
benchmark, ``megha job --follow``.

    show(line) ──at most twice a second on a tty (\\r, redrawn in place)──▶ stderr
               ──every 5 s otherwise (one plain line each)──▶ stderr

Here, below both, because the load generator and ``megha``'s commands draw it alike.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    """One status line, redrawn at most twice a second (a plain line per 5 s off a tty)."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._period = 0.5 if self.tty else 5.0
        self._last = 0.0
        self._dirty = False

    def show(self, line: Callable[[], str], force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self._period:
            return
        self._last = now
        if self.tty:
            self.stream.write(f"\r{line()}\x1b[K")
            self._dirty = True
        else:
            self.stream.write(line() + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self._dirty:
            self.stream.write("\n")
            self.stream.flush()
            self._dirty = False


def bar(fraction: float, width: int = 24) -> str:
    filled = max(0, min(width, int(fraction * width)))
    return "[" + "#" * filled + "." * (width - filled) + "]"
