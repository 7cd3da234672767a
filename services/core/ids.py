"""Names that travel: job, task, queue and node ids.

Ids go into every event, heartbeat, log line and error message, so they are bounded
(``MAX_ID_BYTES`` of UTF-8), and an error about one shows it cut short (``shown``): a
client that sends a megabyte id gets a one-line answer, not its megabyte back.
"""

from __future__ import annotations

MAX_ID_BYTES = 256
SHOWN_CHARS = 40  # of an id quoted in an error message


def id_size(value: str) -> int:
    """The UTF-8 size of ``value``; an ASCII string (almost every id) is not encoded."""
    return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))


def id_problem(name: str, value: str) -> str | None:
    """Why ``value`` cannot be the ``name`` field (an id), or None when it can."""
    size = id_size(value)
    if size <= MAX_ID_BYTES:
        return None
    return f"{name} {shown(value)!r} is {size} bytes long; at most {MAX_ID_BYTES}"


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """``value`` for a message: itself when short, else its first ``limit`` characters."""
    return value if len(value) <= limit else f"{value[:limit]}..."
