import sqlite3

import pytest

from services._proto.megha.v1 import common_pb2
from services.local_master import journal as journal_module
from services.local_master.journal import JournalError, TaskJournal

SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED
LOST = common_pb2.TASK_STATE_LOST


def ended(task_id: str, attempt: int = 0, state: int = SUCCEEDED) -> common_pb2.TaskEvent:
    return common_pb2.TaskEvent(task_id=task_id, job_id="j", state=state, attempt=attempt)


def ids(journal: TaskJournal) -> list[str]:
    recalled = journal.load()
    attempts, events = recalled.attempts, recalled.events
    assert [e.task_id for e in events] == [task_id for task_id, _ in attempts][-len(events) :]
    return [task_id for task_id, _ in attempts]


def test_endings_survive_a_reopen_oldest_first(tmp_path):
    path = tmp_path / "lm-1.journal"
    journal = TaskJournal(path, keep=10, keep_events=10)
    journal.append([ended("a"), ended("b")])
    journal.append([ended("c")])
    journal.close()  # as good as a kill: every append is committed
    again = TaskJournal(path, keep=10, keep_events=10)
    assert ids(again) == ["a", "b", "c"]
    assert again.load().events[0] == ended("a")


def test_a_later_ending_of_a_task_replaces_the_earlier_and_is_the_newest(tmp_path):
    journal = TaskJournal(tmp_path / "j", keep=10, keep_events=10)
    journal.append([ended("a", 0, LOST), ended("b")])
    journal.append([ended("a", 1)])
    recalled = journal.load()
    attempts, events = recalled.attempts, recalled.events
    assert attempts == [("b", 0), ("a", 1)]
    assert [(e.task_id, e.attempt, e.state) for e in events] == [
        ("b", 0, SUCCEEDED),
        ("a", 1, SUCCEEDED),
    ]
    journal.close()
    # Numbering goes on after a reopen: a new ending is still the newest.
    journal = TaskJournal(tmp_path / "j", keep=10, keep_events=10)
    journal.append([ended("b", 1)])
    assert ids(journal) == ["a", "b"]


def test_only_the_newest_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "TRIM_EVERY", 4)
    path = tmp_path / "j"
    journal = TaskJournal(path, keep=3, keep_events=1)
    journal.append([ended(f"t{i}") for i in range(5)])
    recalled = journal.load()
    attempts, events = recalled.attempts, recalled.events
    assert attempts == [("t2", 0), ("t3", 0), ("t4", 0)]
    assert events == [ended("t4")]
    journal.close()
    with sqlite3.connect(path) as db:  # trimmed on disk too, not just on load
        assert db.execute("SELECT COUNT(*) FROM ended").fetchone() == (3,)
        assert db.execute("SELECT COUNT(*) FROM events").fetchone() == (1,)


def test_a_file_that_is_not_a_journal_is_refused_by_name(tmp_path):
    path = tmp_path / "lm-1.journal"
    path.write_bytes(b"this is not a SQLite database, just some text" * 100)
    with pytest.raises(JournalError, match=r"lm-1\.journal"):
        TaskJournal(path, keep=10, keep_events=10)


def test_a_journal_in_a_missing_directory_is_created(tmp_path):
    journal = TaskJournal(tmp_path / "state" / "lm-1" / "journal", keep=10, keep_events=10)
    journal.append([ended("a")])
    assert ids(journal) == ["a"]


def accepted(task_id: str, attempt: int = 0, decided: int = 1) -> common_pb2.Task:
    task = common_pb2.Task(task_id=task_id, job_id="j", attempt=attempt)
    task.timestamps.lm_decided_unix_nanos = decided
    return task


def test_accepted_tasks_are_recalled_until_their_attempt_ends(tmp_path):
    path = tmp_path / "j"
    journal = TaskJournal(path, keep=10, keep_events=10)
    journal.accept([accepted("b", decided=2), accepted("a", decided=1)])
    journal.accept([accepted("c", decided=3)])
    journal.append([ended("b")])
    journal.accept([accepted("c", 1, decided=4)])  # the next attempt replaces the first
    journal.append([ended("c", 0, LOST)])  # the older attempt's end: the newer stays
    journal.close()
    recalled = TaskJournal(path, keep=10, keep_events=10).load()
    assert [(t.task_id, t.attempt) for t in recalled.accepted] == [("a", 0), ("c", 1)]


def test_an_accepted_row_written_after_its_ending_is_not_recalled(tmp_path):
    # Writes made out of order (or a retry's) must not bring back an ended attempt.
    journal = TaskJournal(tmp_path / "j", keep=10, keep_events=10)
    journal.append([ended("a", 1)])
    journal.accept([accepted("a", 1), accepted("a2", 0)])
    journal.accept([accepted("b", 0)])
    journal.append([ended("b", 2)])
    assert [t.task_id for t in journal.load().accepted] == ["a2"]


def test_checkpoints_keep_the_log_from_growing(tmp_path):
    # Commits do not checkpoint (that would fsync on the LM's event loop): without the
    # journal loop's checkpoints the log would grow with every accepted task.
    path = tmp_path / "j"
    journal = TaskJournal(path, keep=10, keep_events=10)
    wal = tmp_path / "j-wal"

    def one_round(start: int) -> None:
        for i in range(start, start + 500):
            journal.accept([accepted(f"t{i}")])
        journal.append([ended(f"t{i}") for i in range(start, start + 500)])

    one_round(0)
    unchecked = wal.stat().st_size
    journal.checkpoint()
    for start in range(500, 5_000, 500):
        one_round(start)
        journal.checkpoint()
    assert wal.stat().st_size <= 2 * unchecked
    one_round(5_000)
    one_round(5_500)  # no checkpoint between: it grows
    assert wal.stat().st_size > 1.5 * unchecked


def test_endings_written_after_the_last_mark_are_recalled_as_unpublished(tmp_path):
    path = tmp_path / "j"
    journal = TaskJournal(path, keep=10, keep_events=10)
    journal.append([ended("a"), ended("b")])
    journal.mark_published(journal.seq)
    journal.append([ended("c")])
    journal.close()
    journal = TaskJournal(path, keep=10, keep_events=10)
    assert [e.task_id for e in journal.load().unpublished] == ["c"]
    journal.mark_published(journal.seq)
    assert journal.load().unpublished == []


def test_a_journal_from_before_the_mark_takes_what_it_holds_for_published(tmp_path):
    # Written by an LM that did not mark what it published: nothing to publish again.
    path = tmp_path / "j"
    journal = TaskJournal(path, keep=10, keep_events=10)
    journal.append([ended("a")])
    journal.close()
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE published")
    assert TaskJournal(path, keep=10, keep_events=10).load().unpublished == []


def test_cancelled_jobs_survive_a_reopen_once_each_newest_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "CANCELS_KEPT", 1_500)
    path = tmp_path / "lm-1.journal"
    journal = TaskJournal(path, keep=10, keep_events=10)
    journal.cancel("j1", "wrong input")
    journal.cancel("j1", "again")  # the first reason stays
    journal.cancel("j2", "cancelled")
    journal.close()
    again = TaskJournal(path, keep=10, keep_events=10)
    assert again.load().cancelled == [("j1", "wrong input"), ("j2", "cancelled")]
    for i in range(3_000):
        again.cancel(f"k{i}", "r")
    recalled = again.load().cancelled
    assert len(recalled) == 1_500 and recalled[-1] == ("k2999", "r")
    rows = again._db.execute("SELECT COUNT(*) FROM cancelled").fetchone()[0]
    assert rows <= 1_500 + 1_000  # trimmed as it goes: the file does not grow for ever


def test_owed_requeues_are_recalled_until_paid(tmp_path):
    path = tmp_path / "lm-1.journal"
    journal = TaskJournal(path, keep=10, keep_events=10)
    for task_id in ("a", "b"):
        journal.owe(common_pb2.Task(task_id=task_id, job_id="j", attempt=1))
    journal.paid("a", 1)
    journal.paid("b", 0)  # another attempt's confirm pays nothing
    journal.close()
    owed = TaskJournal(path, keep=10, keep_events=10).load().owed
    assert [(t.task_id, t.attempt) for t in owed] == [("b", 1)]


def test_an_owed_requeue_strikes_the_attempt_before_from_the_accepted(tmp_path):
    """The attempt before has ended on the books, its ending maybe not written yet (the
    LM died first): recalled as accepted, it was queued a second time as an orphan
    (``megha-loadgen chaos-sim --small --seed 1029``)."""
    path = tmp_path / "lm-1.journal"
    journal = TaskJournal(path, keep=10, keep_events=10)
    journal.accept([common_pb2.Task(task_id="a", job_id="j", attempt=0)])
    journal.accept([common_pb2.Task(task_id="b", job_id="j", attempt=0)])
    journal.owe(common_pb2.Task(task_id="a", job_id="j", attempt=1))
    journal.close()
    recalled = TaskJournal(path, keep=10, keep_events=10).load()
    assert [t.task_id for t in recalled.accepted] == ["b"]
    assert [(t.task_id, t.attempt) for t in recalled.owed] == [("a", 1)]
