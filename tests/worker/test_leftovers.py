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


def test_only_a_host_that_ran_containers_asks_the_engine_and_it_asks_until_answered(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:1")  # an engine that never answers
    path = tmp_path / "host.groups"
    ledger = GroupLedger(path)
    assert ledger.sweep() == 0
    assert "Docker engine" not in caplog.text  # no container in its last life: not asked
    ledger.note_containers()
    ledger.note_containers()  # once per life
    ledger.close()
    assert path.read_text() == "d\n"
    for _ in range(2):  # the engine is down: the line stays, and the next start asks again
        caplog.clear()
        again = GroupLedger(path)
        assert again.sweep() == 0
        again.close()
        assert "cannot ask the Docker engine" in caplog.text
        assert path.read_text() == "d\n"


def test_the_rewritten_log_still_says_the_host_ran_containers(tmp_path, monkeypatch):
    monkeypatch.setattr(leftovers, "COMPACT_AFTER", 10)
    path = tmp_path / "host.groups"
    ledger = GroupLedger(path)
    ledger.sweep()
    ledger.note_containers()
    for _ in range(6):  # 13 lines: past 10, the file was rewritten
        ledger.add(os.getpid())
        ledger.remove(os.getpid())
    ledger.close()
    lines = path.read_text().splitlines()
    assert len(lines) < 13 and "d" in lines
