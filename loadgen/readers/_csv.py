"""CSV plumbing the table readers share: numbered rows, header detection, field parsing.

Every reader reports a malformed row as ``file:line: reason`` (a ``TraceError``), so the
messages look the same whichever table they come from.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

from loadgen.trace import ReadStats, TraceError, open_text


def numbered_rows(path: Path, stats: ReadStats) -> Iterator[tuple[str, list[str]]]:
    """Yield ``("file:line", fields)`` for every non-blank, non-comment row."""
    with open_text(path) as handle:
        reader = csv.reader(handle)
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as err:  # e.g. a NUL byte or an unterminated quote
                raise TraceError(f"{path.name}:{reader.line_num}: {err}") from None
            stats.lines += 1
            if not row or not any(f.strip() for f in row) or row[0].startswith("#"):
                continue
            yield f"{path.name}:{reader.line_num}", row


def header_index(row: Sequence[str], aliases: dict[str, tuple[str, ...]]) -> dict[str, int]:
    """Map each wanted column to its position in a header row.

    ``aliases`` maps our name to the spellings accepted (lower case); a name that no
    header cell matches is left out, and the caller decides whether it was required.
    """
    cells = [c.strip().lower() for c in row]
    found = {}
    for name, spellings in aliases.items():
        for spelling in spellings:
            if spelling in cells:
                found[name] = cells.index(spelling)
                break
    return found


def is_header(row: Sequence[str], columns: Sequence[str]) -> bool:
    """A row naming at least three of the published columns is a header."""
    return len({c.strip().lower() for c in row} & set(columns)) >= 3


def number(text: str, what: str, where: str) -> float:
    """A finite number; empty or not a number is malformed."""
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{where}: {what} is not a number: {text.strip()[:40]!r}") from None
    if not math.isfinite(value):
        raise TraceError(f"{where}: {what} is not finite: {text.strip()!r}")
    return value


def optional_number(text: str, what: str, where: str) -> float | None:
    """Like ``number`` but an empty field means "not given"."""
    return None if not text.strip() else number(text, what, where)


def integer(text: str, what: str, where: str) -> int:
    value = number(text, what, where)
    if value != int(value):
        raise TraceError(f"{where}: {what} must be a whole number, got {text.strip()!r}")
    return int(value)


def field_at(row: Sequence[str], index: int, what: str, where: str) -> str:
    if index >= len(row):
        raise TraceError(f"{where}: no {what} column (row has {len(row)} fields)")
    return row[index]
