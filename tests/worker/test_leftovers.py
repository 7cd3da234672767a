import os
import subprocess

from services.worker import leftovers
from services.worker.leftovers import GroupLedger, group_running, start_ticks


def _group_of_sleeps() -> subprocess.Popen:
    """A task-like process group: a shell leading it, a sleep it started."""
    return subprocess.Popen(["sh", "-c", "sleep 30 & exec sleep 31"], start_new_session=True)


def _alive(pgid: int) -> bool:
    return group_running(pgid)  # a zombie is gone: init may be slow to reap it


def test_a_new_life_kills_the_groups_the_last_one_left_and_only_those(tmp_path):
    path = tmp_path / "host.groups"
    first = GroupLedger(path)
    assert first.sweep() == 0
    left, ended = _group_of_sleeps(), _group_of_sleeps()
    try:
        first.add(left.pid)
        first.add(ended.pid)
        first.remove(ended.pid)  # its task ended: not the next life's business
        # A crash: the file is not closed, and its last line is cut short.
        with open(path, "a") as log:
            log.write("\n+ 12")
        assert GroupLedger(path).sweep() == 1
        left.wait(5)
        assert not _alive(left.pid) and _alive(ended.pid)
    finally:
        for proc in (left, ended):
            if _alive(proc.pid):
                os.killpg(proc.pid, 9)
            proc.wait(5)


def test_a_reused_pid_is_not_killed(tmp_path):
    other = _group_of_sleeps()
    try:
        ticks = start_ticks(other.pid)
        assert ticks is not None
        # Noted with another start time: the group id now belongs to someone else.
        (tmp_path / "host.groups").write_text(f"+ {other.pid} {ticks + 1}\n")
        assert GroupLedger(tmp_path / "host.groups").sweep() == 0
        assert _alive(other.pid)
    finally:
        os.killpg(other.pid, 9)
        other.wait(5)


def test_the_log_is_rewritten_with_the_live_groups_once_long(tmp_path, monkeypatch):
    monkeypatch.setattr(leftovers, "COMPACT_AFTER", 10)
    path = tmp_path / "host.groups"
    ledger = GroupLedger(path)
    ledger.sweep()
    ledger.add(os.getpid())  # a live process, so that it has a start time
    for _ in range(5):  # 11 lines: past 10, the file holds the one live group again
        ledger.remove(os.getpid())
        ledger.add(os.getpid())
    ledger.close()
    assert path.read_text().splitlines() == [f"+ {os.getpid()} {start_ticks(os.getpid())}"]


def test_a_ledger_it_cannot_write_leaves_the_host_running(tmp_path):
    (tmp_path / "file").write_text("")
    ledger = GroupLedger(tmp_path / "file" / "host.groups")  # under a file: cannot be
    assert ledger.sweep() == 0
    ledger.add(os.getpid())  # noted nowhere, and no error
    ledger.remove(os.getpid())
