import sqlite3

import pytest

from services._proto.megha.v1 import common_pb2
from services.local_master import journal as journal_module
from services.local_master.journal import EndingsJournal, JournalError

SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED
LOST = common_pb2.TASK_STATE_LOST


def ended(task_id: str, attempt: int = 0, state: int = SUCCEEDED) -> common_pb2.TaskEvent:
    return common_pb2.TaskEvent(task_id=task_id, job_id="j", state=state, attempt=attempt)


def ids(journal: EndingsJournal) -> list[str]:
    attempts, events = journal.load()
    assert [e.task_id for e in events] == [task_id for task_id, _ in attempts][-len(events) :]
    return [task_id for task_id, _ in attempts]


def test_endings_survive_a_reopen_oldest_first(tmp_path):
    path = tmp_path / "lm-1.journal"
    journal = EndingsJournal(path, keep=10, keep_events=10)
    journal.append([ended("a"), ended("b")])
    journal.append([ended("c")])
    journal.close()  # as good as a kill: every append is committed
    again = EndingsJournal(path, keep=10, keep_events=10)
    assert ids(again) == ["a", "b", "c"]
    assert again.load()[1][0] == ended("a")


def test_a_later_ending_of_a_task_replaces_the_earlier_and_is_the_newest(tmp_path):
    journal = EndingsJournal(tmp_path / "j", keep=10, keep_events=10)
    journal.append([ended("a", 0, LOST), ended("b")])
    journal.append([ended("a", 1)])
    attempts, events = journal.load()
    assert attempts == [("b", 0), ("a", 1)]
    assert [(e.task_id, e.attempt, e.state) for e in events] == [
        ("b", 0, SUCCEEDED),
        ("a", 1, SUCCEEDED),
    ]
    journal.close()
    # Numbering goes on after a reopen: a new ending is still the newest.
    journal = EndingsJournal(tmp_path / "j", keep=10, keep_events=10)
    journal.append([ended("b", 1)])
    assert ids(journal) == ["a", "b"]


def test_only_the_newest_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "TRIM_EVERY", 4)
    path = tmp_path / "j"
    journal = EndingsJournal(path, keep=3, keep_events=1)
    journal.append([ended(f"t{i}") for i in range(5)])
    attempts, events = journal.load()
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
        EndingsJournal(path, keep=10, keep_events=10)


def test_a_journal_in_a_missing_directory_is_created(tmp_path):
    journal = EndingsJournal(tmp_path / "state" / "lm-1" / "journal", keep=10, keep_events=10)
    journal.append([ended("a")])
    assert ids(journal) == ["a"]
