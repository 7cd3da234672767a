"""The janitor ends a dead worker host's leftovers at once, and only its own life's.

Hosts here are real processes killed with SIGKILL; nothing is mocked.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.worker.janitor import Janitor
from services.worker.leftovers import GroupLedger, group_running

# A host: a ledger with a janitor, N task-like groups (a shell leading the group, a sleep
# it started), their pgids and the janitor's pid on stdout, then it waits to be killed.
HOST = """
import subprocess, sys, time
from services.worker.janitor import Janitor
from services.worker.leftovers import GroupLedger
ledger = GroupLedger(sys.argv[1], Janitor(sys.argv[2]))
ledger.sweep()
groups = []
for _ in range(int(sys.argv[3])):
    group = subprocess.Popen(
        ["sh", "-c", "sleep 40 & exec sleep 41"], start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    ledger.add(group.pid)
    groups.append(group.pid)
if sys.argv[4] == "end-one":
    ledger.remove(groups[0])  # its task ended: the janitor must leave it alone
if sys.argv[4] == "exit":  # its tasks ended (the groups are probes: they stay)
    for pgid in groups:
        ledger.remove(pgid)
    ledger.close()
if sys.argv[4] == "exit-with-one-running":
    ledger.close()
print(ledger.janitor.pid, *groups, flush=True)
time.sleep(60)
"""


def _host(
    tmp_path: Path, life: str, groups: int, how: str = ""
) -> tuple[subprocess.Popen, list[int]]:
    host = subprocess.Popen(
        [sys.executable, "-c", HOST, str(tmp_path / f"{life}.groups"), life, str(groups), how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert host.stdout is not None
    pids = [int(pid) for pid in host.stdout.readline().split()]
    assert pids, host.stderr.read() if host.stderr else "no output"
    return host, pids


def _wait_gone(pids: list[int], limit_s: float) -> float:
    """Seconds until no group of ``pids`` runs (fails past ``limit_s``)."""
    started = time.monotonic()
    while any(map(group_running, pids)):
        assert time.monotonic() - started < limit_s, "a group still runs"
        time.sleep(0.005)
    return time.monotonic() - started


def _process_gone(pid: int, limit_s: float = 5.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False


def _kill_groups(pids: list[int]) -> None:
    for pid in pids:
        if group_running(pid):
            os.killpg(pid, signal.SIGKILL)


def test_a_host_killed_has_its_tasks_groups_killed_at_once(tmp_path):
    host, (janitor, *groups) = _host(tmp_path, "a", 3, "end-one")
    try:
        ended, left = groups[0], groups[1:]
        host.kill()
        host.wait(5)
        _wait_gone(left, limit_s=3.0)  # includes the janitor's start if it was still starting
        assert group_running(ended)  # its task had ended: not the janitor's business
        assert _process_gone(janitor)
        assert host.stderr is not None
        logged = host.stderr.read()
        assert "its janitor ended what its tasks left running" in logged
        assert '"groups": 2' in logged
    finally:
        host.kill()
        _kill_groups(groups)


def test_a_host_that_exits_in_order_lets_its_janitor_go_without_killing(tmp_path):
    host, (janitor, *groups) = _host(tmp_path, "b", 1, "exit")
    try:
        assert _process_gone(janitor)  # gone once told q, while the host still runs
        host.kill()
        host.wait(5)
        time.sleep(0.3)
        assert group_running(groups[0])  # nobody killed it: the host said all was over
    finally:
        host.kill()
        _kill_groups(groups)


def test_a_host_that_exits_with_a_task_still_running_has_it_ended(tmp_path):
    host, (janitor, *groups) = _host(tmp_path, "b2", 1, "exit-with-one-running")
    try:
        _wait_gone(groups, limit_s=2.0)
        assert _process_gone(janitor)
    finally:
        host.kill()
        host.wait(5)
        _kill_groups(groups)


def test_a_janitor_ends_only_its_own_life(tmp_path):
    # Two lives of hosts (a host restarted at once has a new one): killing one host must
    # not touch the other's groups.
    first, (_, *mine) = _host(tmp_path, "c1", 1)
    second, (_, *theirs) = _host(tmp_path, "c2", 1)
    try:
        first.kill()
        first.wait(5)
        _wait_gone(mine, limit_s=2.0)
        time.sleep(0.2)
        assert group_running(theirs[0])
    finally:
        for host in (first, second):
            host.kill()
            host.wait(5)
        _kill_groups(mine + theirs)


def test_a_janitor_that_stops_reading_is_dropped_and_the_host_goes_on(tmp_path, caplog):
    ledger = GroupLedger(tmp_path / "host.groups", Janitor("d"))
    ledger.sweep()
    janitor = ledger.janitor
    assert janitor is not None and janitor.pid is not None
    os.kill(janitor.pid, signal.SIGSTOP)
    try:
        for _ in range(10_000):  # ~100 KB of lines: more than a pipe holds
            ledger.add(os.getpid())
            ledger.remove(os.getpid())
        assert "janitor fell behind" in caplog.text
        assert _process_gone(janitor.pid)  # killed, so it never takes the close for a death
        ledger.add(os.getpid())  # the file still takes the lines
        ledger.close()
        assert (tmp_path / "host.groups").read_text().splitlines()[-1].startswith("+ ")
    finally:
        with_pid = janitor.pid
        if not _process_gone(with_pid, 0.1):
            os.kill(with_pid, signal.SIGKILL)


def test_a_janitor_that_cannot_start_leaves_the_next_start_to_sweep(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    ledger = GroupLedger(tmp_path / "host.groups", Janitor("e"))
    assert ledger.sweep() == 0
    assert ledger.janitor is None
    assert "cannot start the worker host's janitor" in caplog.text
    ledger.add(os.getpid())  # noted in the file alone
    ledger.close()
    assert (tmp_path / "host.groups").read_text().startswith("+ ")


@pytest.mark.parametrize("lines", [[b"+ 12 34\n", b"- 12\n"], [b"+ 1\n", b"junk\n", b"\n"]])
def test_lines_the_janitor_is_told_that_end_nothing_kill_nothing(lines):
    from services.worker.leftovers import replay

    noted = replay(lines)
    assert noted.groups == {} and not noted.containers and not noted.quit
