"""Output piped into a reader that stops early (``megha job X | head``).

Python raises ``BrokenPipeError`` at the next write, and again when it flushes stdout at
exit, so the user got two tracebacks for something every Unix tool takes quietly. Our
CLIs end like those tools instead: no output, exit status 141 (128 + SIGPIPE).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

EXIT_BROKEN_PIPE = 128 + 13  # as a process killed by SIGPIPE


def quiet_on_broken_pipe(
    main: Callable[[Sequence[str] | None], int],
) -> Callable[[Sequence[str] | None], int]:
    """Wrap a CLI's ``main``: a reader that went away ends it quietly."""

    def wrapped(argv: Sequence[str] | None = None) -> int:
        try:
            return main(argv)
        except BrokenPipeError:
            # Python flushes stdout again at exit: point it at /dev/null first.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return EXIT_BROKEN_PIPE

    return wrapped
