"""What tasks wrote: each attempt's stdout and stderr, kept in files on its worker host.

A process task writes its stdout straight into ``<dir>/<task>.<attempt>.out`` (no copy
through the host) and its stderr through the host, which keeps the tail for the failure
message, into ``.err``; a container's logs are copied there as they come. ``megha logs``
reads them back through the GM, the LM and the worker that ran the attempt
(``TaskOutputs.read``).

The newest ``keep`` attempts are kept (by the time their files were last written; the
files of a host's earlier lives count too), older ones are deleted as new ones start.
A single attempt's output is not capped: a task that writes without end can fill the
disk, as with any batch system that keeps output in files.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

STREAMS = ("out", "err")
READ_LIMIT = 1 << 20  # the most one read returns (a gRPC message stays small)


@dataclass(frozen=True)
class Chunk:
    """Bytes ``offset`` to ``offset + len(data)`` of a stream whose file holds ``size``."""

    data: bytes
    offset: int
    size: int


class TaskOutputs:
    """The output files of one worker host, under ``directory``."""

    def __init__(self, directory: Path, keep: int = 10_000) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self._lock = threading.Lock()  # reads run in threads, starts on the loop
        self._kept: OrderedDict[str, None] = OrderedDict()  # file stems, oldest first
        self.directory.mkdir(parents=True, exist_ok=True)
        stems = {path.name.rsplit(".", 1)[0]: path for path in self.directory.iterdir()}
        for stem in sorted(stems, key=lambda s: _mtime(stems[s])):
            self._kept[stem] = None
        self._trim()

    def path(self, task_id: str, attempt: int, stream: str) -> Path:
        if stream not in STREAMS:
            raise ValueError(f"stream must be one of {', '.join(STREAMS)}, got {stream!r}")
        return self.directory / f"{_stem(task_id, attempt)}.{stream}"

    def open(self, task_id: str, attempt: int, stream: str) -> int:
        """A new file for the attempt's ``stream``, as a file descriptor to write to
        (the caller closes it); the oldest attempts beyond ``keep`` are deleted."""
        path = self.path(task_id, attempt, stream)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with self._lock:
            stem = _stem(task_id, attempt)
            self._kept[stem] = None
            self._kept.move_to_end(stem)
            self._trim()
        return fd

    def read(
        self, task_id: str, attempt: int, stream: str, offset: int = 0, limit: int = READ_LIMIT
    ) -> Chunk | None:
        """Up to ``limit`` bytes from ``offset`` (negative: that many from the end);
        None when this host holds no such file."""
        try:
            with self.path(task_id, attempt, stream).open("rb") as file:
                size = os.fstat(file.fileno()).st_size
                start = max(0, size + offset) if offset < 0 else min(offset, size)
                file.seek(start)
                return Chunk(file.read(max(0, min(limit, READ_LIMIT))), start, size)
        except FileNotFoundError:
            return None

    def _trim(self) -> None:
        while len(self._kept) > self.keep:
            stem, _ = self._kept.popitem(last=False)
            for stream in STREAMS:
                with contextlib.suppress(FileNotFoundError):
                    (self.directory / f"{stem}.{stream}").unlink()


def _stem(task_id: str, attempt: int) -> str:
    # Task ids are the user's: quoted, so that no id reaches outside the directory
    # ("/" and "%" are quoted, and the attempt suffix keeps ".." from being a name).
    return f"{quote(task_id, safe='')}.{attempt}"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
