"""Pick a reader by format name or file name."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from loadgen.readers.alibaba2018 import read_alibaba2018
from loadgen.readers.azure import read_azure
from loadgen.readers.google2019 import read_google2019
from loadgen.trace import ReadStats, TraceError, TraceJob, read_tr

Reader = Callable[..., Iterator[TraceJob]]
READERS: dict[str, Reader] = {
    "tr": read_tr,
    "google2019": read_google2019,
    "alibaba2018": read_alibaba2018,
    "azure": read_azure,
}
FORMATS = tuple(READERS)
# Substrings of the published file names -> format (after dropping ".gz").
_NAME_HINTS = (("instance_events", "google2019"), ("batch_task", "alibaba2018"))
_NAME_HINTS += (("vmtable", "azure"),)


def guess_format(path: str | Path) -> str:
    """The format a file name implies: ``*.tr``, ``instance_events*``, ``batch_task*``,
    ``vmtable*`` (each optionally ``.gz``)."""
    name = Path(path).name.lower().removesuffix(".gz")
    if name.endswith(".tr"):
        return "tr"
    for hint, fmt in _NAME_HINTS:
        if hint in name:
            return fmt
    raise TraceError(
        f"cannot tell the trace format of {Path(path).name!r} from its name; "
        f"pass --format ({', '.join(FORMATS)})"
    )


def read_trace(
    path: str | Path,
    fmt: str | None = None,
    strict: bool = False,
    max_jobs: int | None = None,
    stats: ReadStats | None = None,
) -> Iterator[TraceJob]:
    """Read any supported trace into canonical jobs; ``fmt`` None guesses from the name.

    ``.tr`` jobs come in file order, the table formats sorted by arrival. ``max_jobs``
    keeps the first N. Raises ``TraceError`` for an unknown format or (``strict``) a
    malformed line, ``OSError`` when the file cannot be read.
    """
    fmt = fmt or guess_format(path)
    if fmt not in READERS:
        raise TraceError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    return READERS[fmt](path, strict=strict, max_jobs=max_jobs, stats=stats)
