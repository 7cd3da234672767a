"""The LM's journal: what a restarted LM must not forget.

An LM's books live in memory, and its workers give back what they run when it restarts
(``LocalMaster._take_back``). Two things no worker can give back:

- which tasks *ended* here. Without them a restarted LM would launch an ended attempt
  again when a GM retries it (the exactly-once check is ``ClusterState``'s memory of ended
  attempts), and could not tell a GM that missed the final event how the task ended
  (``LookupTasks``, ``ListTasks``);
- which killed attempts it owes the next attempt of: a preempted task's next attempt is
  queued once its worker says the kill took effect (``Lifecycle.stopping``), and an LM
  that restarts meanwhile still queues it (``stop``, ``stopped``); and which next
  attempts it sent the broker that the broker has not confirmed (``owe``, ``paid``);
- which tasks it *accepted* and that have not ended. When the workers died with it (a
  host or a whole federation going down at once) or never received them, nothing else
  holds them: the GM acked their queue message when the LM accepted them, and a GM that
  died too forgot them. A restarted LM gives such a task, once no worker has named it
  within the grace period, back to its queue as the next attempt (``LocalMaster._orphans_loop``).

So the LM writes each accepted task before it answers ACCEPTED (``accept``; a killed LM
then knows every task a GM believes it holds), and each ending (the final ``TaskEvent`` of
an attempt, which also strikes the accepted row) on the event loop's next turn, with the
other endings of that turn. That is well inside the workers' redelivery window (a final
report written less than ``REDELIVERY_WINDOW_S`` before the LM died is sent again to the
new LM), so an LM killed at any moment still knows every ending its workers consider
delivered, and one killed with its workers runs again only what ended in the last turn
(not what ended in a flush interval, as when endings were batched). It also notes how far
the LM has published its events (``mark_published``): a restarted LM publishes the
endings after that mark again, which died with it in its outgoing batch. The file keeps the
newest ``keep`` ended attempts, one row per task, and the whole events only of the newest
``keep_events`` endings: a restarted LM serves nothing until it has read the file, and
parsing a million whole events takes several times longer than reading a million (task,
attempt) pairs (``scripts/journal_bench.py``).
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path

from services._proto.megha.v1 import common_pb2
from services.core.cancels import DEFAULT_KEPT

FLUSH_S = 0.2  # between checkpoints, and tries again of writes that failed
TRIM_EVERY = 10_000  # appended rows between two trims to ``keep``
CANCELS_KEPT = DEFAULT_KEPT  # cancelled jobs, as in memory (``CancelledJobs``)

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
CREATE TABLE IF NOT EXISTS published (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS accepted (
    task_id TEXT PRIMARY KEY,
    attempt INTEGER NOT NULL,
    task BLOB NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS owed (
    task_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    task BLOB NOT NULL,
    PRIMARY KEY (task_id, attempt)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS cancelled (
    seq INTEGER PRIMARY KEY,
    job_id TEXT NOT NULL UNIQUE,
    reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS draining (
    node_id TEXT PRIMARY KEY
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS stopping (
    task_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    task BLOB NOT NULL,
    PRIMARY KEY (task_id, attempt)
) WITHOUT ROWID;
"""


@dataclass
class Recalled:
    """What a journal holds, oldest first: ended attempts as (task id, attempt), the
    events kept of them, the accepted tasks whose attempt has not ended, and the events
    written after the last ``mark_published`` (the LM died before the broker had them)."""

    attempts: list[tuple[str, int]]
    events: list[common_pb2.TaskEvent]
    accepted: list[common_pb2.Task]
    unpublished: list[common_pb2.TaskEvent]
    cancelled: list[tuple[str, str]]  # (job id, reason), the newest ``CANCELS_KEPT``
    draining: list[str] = field(default_factory=list)  # nodes an operator drains
    # Next attempts (re-queues) the broker had not confirmed when the LM died: the only
    # way on of a task whose attempt ended here, sent again by the restarted LM.
    owed: list[common_pb2.Task] = field(default_factory=list)
    # Killed attempts whose next attempt was not queued yet (``stop``).
    stopping: list[common_pb2.Task] = field(default_factory=list)


class JournalError(RuntimeError):
    """The journal file cannot be opened or read (named in the message)."""


class TaskJournal:
    """The tasks accepted and not ended, and the newest ``keep`` ended attempts, one row
    per task, with the whole event for the newest ``keep_events`` of them.

    Safe to call from any thread, one write at a time (a lock). ``accept`` is cheap
    enough for the event loop: a one-task write costs ~30 us of CPU there, and ~4 times
    that when handed to a thread and awaited (``scripts/journal_bench.py``). No commit
    moves the log into the main file (that fsyncs): ``checkpoint`` does, on its own
    connection, from a thread, without the lock.
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
            self._db.execute("PRAGMA wal_autocheckpoint=0")  # see ``checkpoint``
            self._db.executescript(_SCHEMA)
            with self._db:  # a journal older than the mark: what it holds went out
                self._db.execute(
                    "INSERT OR IGNORE INTO published (id, seq)"
                    " SELECT 0, COALESCE(MAX(seq), 0) FROM events"
                )
            row = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM ended").fetchone()
        except (OSError, sqlite3.Error) as err:
            raise JournalError(
                f"cannot open the LM journal {self.path}: {err} (move it aside, and the LM "
                "starts with no memory of the tasks it accepted or that ended on it)"
            ) from err
        self._seq = int(row[0])
        self._since_trim = 0
        self._checkpointer: sqlite3.Connection | None = None
        self.written = False  # since the last checkpoint

    def load(self) -> Recalled:
        """Everything kept, oldest first (see ``Recalled``)."""
        with self._lock:
            try:
                attempts = self._db.execute(
                    "SELECT task_id, attempt FROM ended ORDER BY seq DESC LIMIT ?", (self.keep,)
                ).fetchall()
                blobs = self._db.execute(
                    "SELECT event FROM events ORDER BY seq DESC LIMIT ?", (self.keep_events,)
                ).fetchall()
                # An accepted row outlived by its ending (written in another order than
                # made, or a retry's) is not an open task.
                accepted = self._db.execute(
                    "SELECT a.task FROM accepted a LEFT JOIN ended e ON a.task_id = e.task_id"
                    " WHERE e.attempt IS NULL OR e.attempt < a.attempt"
                ).fetchall()
                unpublished = self._db.execute(
                    "SELECT event FROM events WHERE seq > "
                    "(SELECT COALESCE(MAX(seq), 0) FROM published) ORDER BY seq"
                ).fetchall()
                cancelled = self._db.execute(
                    "SELECT job_id, reason FROM cancelled ORDER BY seq DESC LIMIT ?",
                    (CANCELS_KEPT,),
                ).fetchall()
                draining = self._db.execute("SELECT node_id FROM draining").fetchall()
                owed = self._db.execute("SELECT task FROM owed").fetchall()
                stopping = self._db.execute("SELECT task FROM stopping").fetchall()
            except sqlite3.Error as err:
                raise JournalError(f"cannot read the LM journal {self.path}: {err}") from err
        attempts.reverse()
        # A task that ended twice has two events; only its newer one is its ending.
        latest: dict[str, common_pb2.TaskEvent] = {}
        for (blob,) in blobs:
            event = common_pb2.TaskEvent.FromString(blob)
            latest.setdefault(event.task_id, event)
        tasks = [common_pb2.Task.FromString(blob) for (blob,) in accepted]
        tasks.sort(key=lambda t: t.timestamps.lm_decided_unix_nanos)
        late = [common_pb2.TaskEvent.FromString(blob) for (blob,) in unpublished]
        cancelled.reverse()
        return Recalled(
            attempts,
            list(reversed(latest.values())),
            tasks,
            late,
            cancelled,
            sorted(node_id for (node_id,) in draining),
            [common_pb2.Task.FromString(blob) for (blob,) in owed],
            [common_pb2.Task.FromString(blob) for (blob,) in stopping],
        )

    @property
    def seq(self) -> int:
        """The number of the newest ending written."""
        return self._seq

    def mark_published(self, seq: int) -> None:
        """The endings up to ``seq`` are on the broker: a restarted LM publishes only
        those after it again."""
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO published (id, seq) VALUES (0, ?)", (seq,))
            self.written = True

    def accept(self, tasks: list[common_pb2.Task]) -> None:
        """Write ``tasks`` as accepted, in one transaction (a task's newer attempt
        replaces its older)."""
        if not tasks:
            return
        rows = [(t.task_id, t.attempt, t.SerializeToString()) for t in tasks]
        with self._lock, self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO accepted (task_id, attempt, task) VALUES (?, ?, ?)", rows
            )
            self.written = True

    def owe(self, again: common_pb2.Task) -> None:
        """Write that ``again``, a task's next attempt, is on its way to the broker: a
        restarted LM sends it again unless ``paid`` was written. The ending of the
        attempt before is written a turn later; should the LM die in between, the
        worker's report of that ending comes again to the new LM, which then finds
        this re-queue owed already (``LocalMaster._owe``)."""
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO owed (task_id, attempt, task) VALUES (?, ?, ?)",
                (again.task_id, again.attempt, again.SerializeToString()),
            )
            # The attempt before has ended on the books, its ending maybe not written yet:
            # recalled as an orphan, it would be queued a second time.
            self._db.execute(
                "DELETE FROM accepted WHERE task_id = ? AND attempt < ?",
                (again.task_id, again.attempt),
            )
            self.written = True

    def paid(self, task_id: str, attempt: int) -> None:
        """The broker has ``task_id``'s attempt ``attempt`` (``owe``)."""
        self._strike("owed", task_id, attempt)

    def stop(self, tasks: list[common_pb2.Task]) -> None:
        """Write that each of ``tasks`` (killed attempts) waits for its kill to take
        effect before its next attempt is queued (``Lifecycle.stopping``): a restarted
        LM still queues it."""
        if not tasks:
            return
        rows = [(t.task_id, t.attempt, t.SerializeToString()) for t in tasks]
        with self._lock, self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO stopping (task_id, attempt, task) VALUES (?, ?, ?)", rows
            )
            self.written = True

    def stopped(self, task_id: str, attempt: int) -> None:
        """``attempt`` of ``task_id`` can no longer run: its next attempt is owed now."""
        self._strike("stopping", task_id, attempt)

    def _strike(self, table: str, task_id: str, attempt: int) -> None:
        """Delete the row of ``attempt`` of ``task_id`` from ``owed`` or ``stopping``."""
        with self._lock, self._db:
            self._db.execute(
                f"DELETE FROM {table} WHERE task_id = ? AND attempt = ?",
                (task_id, attempt),
            )
            self.written = True

    def cancel(self, job_id: str, reason: str) -> None:
        """Write that ``job_id`` was cancelled (a restarted LM still refuses its tasks);
        only the newest ``CANCELS_KEPT`` are kept."""
        with self._lock, self._db:
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO cancelled (job_id, reason) VALUES (?, ?)", (job_id, reason)
            )
            if cursor.lastrowid and cursor.lastrowid % 1_000 == 0:
                self._db.execute(
                    "DELETE FROM cancelled WHERE seq <= ?", (cursor.lastrowid - CANCELS_KEPT,)
                )
            self.written = True

    def drain(self, node_id: str, on: bool) -> None:
        """Write that an operator drains ``node_id`` (or no longer does)."""
        with self._lock, self._db:
            if on:
                self._db.execute("INSERT OR IGNORE INTO draining (node_id) VALUES (?)", (node_id,))
            else:
                self._db.execute("DELETE FROM draining WHERE node_id = ?", (node_id,))
            self.written = True

    def append(self, events: list[common_pb2.TaskEvent]) -> None:
        """Write ``events`` in one transaction; a task's newer ending replaces its older,
        and each strikes its attempt (or an older one) from the accepted tasks."""
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
                self._db.executemany(
                    "DELETE FROM accepted WHERE task_id = ? AND attempt <= ?",
                    [(e.task_id, e.attempt) for e in events],
                )
            self.written = True
            self._since_trim += len(events)
            if self._since_trim >= TRIM_EVERY:
                self._since_trim = 0
                with self._db:  # freed pages are reused: the file stops growing
                    self._db.execute("DELETE FROM ended WHERE seq <= ?", (self._seq - self.keep,))
                    self._db.execute(
                        "DELETE FROM events WHERE seq <= ?", (self._seq - self.keep_events,)
                    )

    def checkpoint(self) -> None:
        """Move the log's committed pages into the main file, so the log does not grow
        for ever. PASSIVE: writers go on meanwhile (this takes the fsyncs, not them)."""
        self.written = False
        if self._checkpointer is None:
            self._checkpointer = sqlite3.connect(self.path, check_same_thread=False)
        self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def close(self) -> None:
        with self._lock:
            if self._checkpointer is not None:
                self._checkpointer.close()
            self._db.close()
