"""What tasks wrote: each attempt's stdout and stderr, kept in files on its worker host.

A process task writes its stdout straight into ``<dir>/<task>.<attempt>.out`` (no copy
through the host) and its stderr through the host, which keeps the tail for the failure
message, into ``.err``; a container's logs are copied there as they come. ``megha logs``
reads them back through the GM, the LM and the worker that ran the attempt
(``TaskOutputs.read``).

The newest ``keep`` attempts are kept (by the time their files were last written; the
files of a host's earlier lives count too), older ones are deleted as new ones start,
and as ended ones take the bytes on disk past ``max_total`` (the files of attempts still
written are neither counted nor deleted).

With ``max_bytes``, each stream keeps only about its last ``max_bytes``: a thread looks at
every open file each ``check_s`` and punches a hole at its start (``fallocate``'s
``FALLOC_FL_PUNCH_HOLE``), which frees those blocks and keeps every offset where it was,
so a process may go on writing straight into the file and ``megha logs --follow`` reads
on from where it was; a read of dropped bytes starts at the first kept one
(``Chunk.dropped``, found with ``SEEK_DATA``, so files of earlier lives too). Between two
looks a file can grow by whatever its task writes in ``check_s``. On a filesystem without
holes (most have them: ext4, xfs, btrfs, tmpfs, overlayfs) output is kept whole, and the
host logs that once.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

log = logging.getLogger(__name__)

STREAMS = ("out", "err")
READ_LIMIT = 1 << 20  # the most one read returns (a gRPC message stays small)
CHECK_S = 0.5  # how often open files are held to max_bytes
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


@dataclass(frozen=True)
class Chunk:
    """Bytes ``offset`` to ``offset + len(data)`` of a stream of ``size`` bytes so far,
    whose first ``dropped`` bytes are no longer kept (``max_bytes``)."""

    data: bytes
    offset: int
    size: int
    dropped: int = 0


class TaskOutputs:
    """The output files of one worker host, under ``directory``."""

    def __init__(
        self,
        directory: Path,
        keep: int = 10_000,
        max_bytes: int = 0,
        max_total: int = 0,
        check_s: float = CHECK_S,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if max_bytes < 0 or max_total < 0:
            raise ValueError(
                f"max_bytes and max_total must be 0 (no cap) or more, got {max_bytes}, {max_total}"
            )
        self.directory = Path(directory)
        self.keep = keep
        self.max_bytes = max_bytes
        self.max_total = max_total
        self.check_s = check_s
        # Reads run in threads, opens and closes on the loop, the checker in its own.
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, None] = OrderedDict()  # file stems, oldest first
        self._open: dict[int, _Open] = {}  # by file descriptor
        self._disk: dict[str, int] = {}  # bytes on disk of each closed file, by name
        self._total = 0  # their sum
        self._checker: threading.Thread | None = None
        self._stopping = threading.Event()
        self.directory.mkdir(parents=True, exist_ok=True)
        newest: dict[str, float] = {}
        with os.scandir(self.directory) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):
                    stat = entry.stat()
                    stem = entry.name.rsplit(".", 1)[0]
                    newest[stem] = max(newest.get(stem, 0.0), stat.st_mtime)
                    self._disk[entry.name] = stat.st_blocks * 512
        self._total = sum(self._disk.values())
        for stem in sorted(newest, key=newest.__getitem__):
            self._kept[stem] = None
        self._trim()

    @property
    def total(self) -> int:
        """Bytes on disk of the files of attempts whose output has ended."""
        return self._total

    def path(self, task_id: str, attempt: int, stream: str) -> Path:
        if stream not in STREAMS:
            raise ValueError(f"stream must be one of {', '.join(STREAMS)}, got {stream!r}")
        return self.directory / f"{_stem(task_id, attempt)}.{stream}"

    def open(self, task_id: str, attempt: int, stream: str) -> int:
        """A new file for the attempt's ``stream``, as a file descriptor to write to,
        which the caller gives back to ``close`` once the stream has ended (it is held
        to ``max_bytes`` until then); the oldest attempts beyond ``keep`` are deleted."""
        path = self.path(task_id, attempt, stream)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with self._lock:
            stem = _stem(task_id, attempt)
            self._total -= self._disk.pop(path.name, 0)  # emptied by O_TRUNC
            self._open[fd] = _Open(stem, path.name)
            self._kept[stem] = None
            self._kept.move_to_end(stem)
            self._trim()
            if self.max_bytes and self._checker is None and not self._stopping.is_set():
                self._checker = threading.Thread(target=self._check, name="output-cap", daemon=True)
                self._checker.start()
        return fd

    def close(self, fd: int) -> None:
        """The stream of ``fd`` has ended: held to ``max_bytes`` a last time, counted
        in ``max_total`` (older attempts deleted past it), closed."""
        with self._lock:  # the checker must not look at a number reused after this
            done = self._open.pop(fd, None)
            if done is not None:
                self._cap(fd, done.dropped)
                with contextlib.suppress(OSError):  # _trim leaves files being written
                    used = os.fstat(fd).st_blocks * 512
                    self._disk[done.name] = used
                    self._total += used
            with contextlib.suppress(OSError):
                os.close(fd)
            if done is not None:
                self._trim()

    def stop(self) -> None:
        """End the checker (files still open stay as they are)."""
        self._stopping.set()
        if self._checker is not None:
            self._checker.join()

    def read(
        self, task_id: str, attempt: int, stream: str, offset: int = 0, limit: int = READ_LIMIT
    ) -> Chunk | None:
        """Up to ``limit`` bytes from ``offset`` (negative: that many from the end), or
        from the first byte still kept if that is later; None when this host holds no
        such file."""
        try:
            with self.path(task_id, attempt, stream).open("rb") as file:
                size = os.fstat(file.fileno()).st_size
                dropped = _data_start(file.fileno(), size)
                start = max(size + offset, dropped) if offset < 0 else max(offset, dropped)
                start = min(start, size)
                file.seek(start)
                data = file.read(max(0, min(limit, READ_LIMIT)))
                # The checker may have punched past ``start`` meanwhile: what it read
                # there may be the hole's zeros, so it starts at the first byte kept.
                later = _data_start(file.fileno(), size)
                if later > start:
                    data, start, dropped = data[later - start :], min(later, size), later
                return Chunk(data, start, size, dropped)
        except FileNotFoundError:
            return None

    def hold(self) -> None:
        """Hold every open file to ``max_bytes`` now (the checker does, each ``check_s``)."""
        with self._lock:
            for fd, written in self._open.items():
                written.dropped = self._cap(fd, written.dropped)

    def _check(self) -> None:
        while not self._stopping.wait(self.check_s):
            self.hold()

    def _cap(self, fd: int, dropped: int) -> int:
        """Free the blocks of ``fd``'s file before its last ``max_bytes`` (those before
        ``dropped`` are freed already); how many bytes are dropped now."""
        if not self.max_bytes:
            return dropped
        try:
            stat = os.fstat(fd)
            block = stat.st_blksize or 4096
            # Whole blocks only: a partial one would be zeroed, not freed.
            cut = (stat.st_size - self.max_bytes) // block * block
            if cut <= dropped:
                return dropped
            _punch_hole(fd, dropped, cut - dropped)
            return cut
        except OSError as err:
            if err.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                self.max_bytes = 0
                log.warning(
                    "this filesystem cannot drop the start of a file: tasks' output is kept whole",
                    extra={"dir": str(self.directory), "why": err.strerror},
                )
            return dropped

    def _trim(self) -> None:
        """Delete the oldest attempts' files while more than ``keep`` attempts or
        ``max_total`` bytes are kept; not those still written."""
        writing = {written.stem for written in self._open.values()}
        while len(self._kept) > self.keep or (self.max_total and self._total > self.max_total):
            stem = next((stem for stem in self._kept if stem not in writing), None)
            if stem is None:
                return
            del self._kept[stem]
            for stream in STREAMS:
                name = f"{stem}.{stream}"
                self._total -= self._disk.pop(name, 0)
                with contextlib.suppress(FileNotFoundError):
                    (self.directory / name).unlink()


@dataclass
class _Open:
    """A file being written: its attempt's stem, its name, and how much of its start
    has been dropped so far."""

    stem: str
    name: str
    dropped: int = 0


def _stem(task_id: str, attempt: int) -> str:
    # Task ids are the user's: quoted, so that no id reaches outside the directory
    # ("/" and "%" are quoted, and the attempt suffix keeps ".." from being a name).
    return f"{quote(task_id, safe='')}.{attempt}"


def _data_start(fd: int, size: int) -> int:
    """The offset of the first byte a file holds (after the hole punched at its start)."""
    try:
        return os.lseek(fd, 0, os.SEEK_DATA)
    except OSError as err:
        # ENXIO: nothing but a hole up to the end; else no SEEK_DATA here: no holes.
        return size if err.errno == errno.ENXIO else 0


@functools.cache
def _fallocate() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fallocate = libc.fallocate
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int
    return fallocate


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``length`` bytes of the file from ``offset``; its size stays (they read as
    zeros, and ``SEEK_DATA`` skips them)."""
    flags = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if _fallocate()(fd, flags, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
