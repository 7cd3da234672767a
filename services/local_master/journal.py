"""The LM's journal of ended tasks: what a restarted LM must not forget.

An LM's books live in memory, and its workers give back what they run when it restarts
(``LocalMaster._take_back``). What no worker holds any more is which tasks *ended* here.
Without it a restarted LM would launch an ended attempt again when a GM retries it (the
exactly-once check is ``ClusterState``'s memory of ended attempts), and could not tell a
GM that missed the final event how the task ended (``LookupTasks``, ``ListTasks``).

So the LM appends each ending (the final ``TaskEvent`` of an attempt) to this journal, a
SQLite file, and a starting LM reads the newest ones back. Appends are batched and written
off the event loop every ``FLUSH_S``, well inside the workers' redelivery window (a final
report written less than ``REDELIVERY_WINDOW_S`` before the LM died is sent again to the
new LM), so an LM killed at any moment still knows every ending its workers consider
delivered. The file keeps the newest ``keep`` ended attempts, one row per task, and the
whole events only of the newest ``keep_events`` endings: a restarted LM serves nothing
until it has read the file, and parsing a million whole events takes several times
longer than reading a million (task, attempt) pairs (``scripts/journal_bench.py``).
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from services._proto.megha.v1 import common_pb2

FLUSH_S = 0.2  # between writes of the endings gathered meanwhile
TRIM_EVERY = 10_000  # appended rows between two trims to ``keep``

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ended (
    task_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    attempt INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ended_seq ON ended (seq);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,
    event BLOB NOT NULL
);
"""


class JournalError(RuntimeError):
    """The journal file cannot be opened or read (named in the message)."""


class EndingsJournal:
    """The newest ``keep`` ended attempts on disk, one row per task, with the whole event
    for the newest ``keep_events`` of them.

    One writer at a time (the LM's flush loop); safe to call from a worker thread.
    """

    def __init__(self, path: str | Path, keep: int, keep_events: int):
        self.path = Path(path)
        self.keep = keep
        self.keep_events = min(keep_events, keep)
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False)
            # WAL: a commit is one append to the log, and a killed process loses nothing
            # it committed (synchronous=NORMAL gives up only on a power cut).
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM ended").fetchone()
        except (OSError, sqlite3.Error) as err:
            raise JournalError(
                f"cannot open the LM journal {self.path}: {err} (move it aside, and the LM "
                "starts with no memory of the tasks that ended on it)"
            ) from err
        self._seq = int(row[0])
        self._since_trim = 0

    def load(self) -> tuple[list[tuple[str, int]], list[common_pb2.TaskEvent]]:
        """The ended attempts kept, as (task id, attempt), and the events kept; both
        oldest first."""
        with self._lock:
            try:
                attempts = self._db.execute(
                    "SELECT task_id, attempt FROM ended ORDER BY seq DESC LIMIT ?", (self.keep,)
                ).fetchall()
                blobs = self._db.execute(
                    "SELECT event FROM events ORDER BY seq DESC LIMIT ?", (self.keep_events,)
                ).fetchall()
            except sqlite3.Error as err:
                raise JournalError(f"cannot read the LM journal {self.path}: {err}") from err
        attempts.reverse()
        # A task that ended twice has two events; only its newer one is its ending.
        latest: dict[str, common_pb2.TaskEvent] = {}
        for (blob,) in blobs:
            event = common_pb2.TaskEvent.FromString(blob)
            latest.setdefault(event.task_id, event)
        return attempts, list(reversed(latest.values()))

    def append(self, events: list[common_pb2.TaskEvent]) -> None:
        """Write ``events`` in one transaction; a task's newer ending replaces its older."""
        if not events:
            return
        with self._lock:
            first = self._seq + 1
            self._seq += len(events)
            numbered = list(enumerate(events, start=first))
            with self._db:  # one transaction, committed on leaving
                self._db.executemany(
                    "INSERT OR REPLACE INTO ended (task_id, seq, attempt) VALUES (?, ?, ?)",
                    [(e.task_id, seq, e.attempt) for seq, e in numbered],
                )
                self._db.executemany(
                    "INSERT INTO events (seq, event) VALUES (?, ?)",
                    [(seq, e.SerializeToString()) for seq, e in numbered],
                )
            self._since_trim += len(events)
            if self._since_trim >= TRIM_EVERY:
                self._since_trim = 0
                with self._db:  # freed pages are reused: the file stops growing
                    self._db.execute("DELETE FROM ended WHERE seq <= ?", (self._seq - self.keep,))
                    self._db.execute(
                        "DELETE FROM events WHERE seq <= ?", (self._seq - self.keep_events,)
                    )

    def close(self) -> None:
        with self._lock:
            self._db.close()
