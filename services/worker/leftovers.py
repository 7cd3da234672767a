"""What a crashed worker host's tasks left running, and how the next start ends it.

Each process task runs in a process group of its own (``ProcessExecutor``), in a session
of its own, so a worker host that dies (``kill -9``, the OOM killer) does not take its
tasks' processes with it: the main process of each task dies with the host (it is
started under ``setpriv --pdeathsig KILL``), but whatever that process started itself
goes on, reparented to init. Meanwhile the LM re-queues those tasks, and they run again
somewhere else: twice at once.

So a host notes each task's group in a small file (``GroupLedger``: an append-only log of
``+ pgid start-ticks`` and ``- pgid`` lines), and a host that starts kills every group the
file still names, before its agents register (and so before the LM hears that their
tasks are gone). A group id is only killed while the process that leads it, if it still
runs, is the one noted (its start time in clock ticks), so a reused pid is left alone.

Docker tasks are worse off: a container is the engine's child, not the host's, so it
outlives the host whole. Each container carries the label ``megha.host=<host>`` (the
ledger file's stem, one per host of one federation on this machine), and the first
container of a life writes a ``d`` line before it is created. A start whose file holds
that line removes, with ``force``, every container labelled with its host; a host that
never ran a container never asks the engine anything. If the engine cannot be asked, the
new file keeps the line, so the next start tries again.

The next start may be late, or never come: each life's janitor (``janitor.py``) is told
the same lines and ends that life's leftovers as soon as the host dies. The sweep here is
for what died with its janitor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.worker.janitor import Janitor

log = logging.getLogger("megha.worker")

GONE_WAIT_S = 2.0  # how long a start waits for the killed groups to be gone
COMPACT_AFTER = 10_000  # log lines past which the file is rewritten with the live groups
HOST_LABEL = "megha.host"  # the label naming the host that started a container
ENGINE_TIMEOUT_S = 30  # how long a start waits on each Docker engine call


def proc_stat(pid: int | str) -> list[bytes] | None:
    """/proc/<pid>/stat from field 3 (state) on, past the command name; None if gone."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)  # no buffered file:
        try:  # a memory watch reads every process's, each second
            return os.read(fd, 4096).rsplit(b")", 1)[1].split()
        finally:
            os.close(fd)
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (/proc); None if it does not run."""
    fields = proc_stat(pid)
    return None if fields is None else int(fields[19])  # field 22 of stat(5)


def group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs; zombies count as gone (their
    parent may be slow to reap them)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc"):
        return True  # no cheap way to tell zombies apart
    # fields: state, ppid, pgrp, ...
    return any(int(f[2]) == pgid and f[0] not in (b"Z", b"X") for f in proc_stats())


def proc_stats() -> Iterator[list[bytes]]:
    """``proc_stat`` of every process now running, in one pass over ``/proc``."""
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit() and (fields := proc_stat(entry.name)) is not None:
                yield fields


class GroupLedger:
    """The process groups of the tasks a worker host runs, and whether it runs
    containers, on disk."""

    def __init__(self, path: str | Path, janitor: Janitor | None = None) -> None:
        self.path = Path(path)
        self.host = self.path.stem  # the HOST_LABEL value of this host's containers
        # Told every line too; ends this life's leftovers at once if the host dies.
        self.janitor = janitor
        self._live: dict[int, int] = {}
        self._docker_noted = False
        self._lines = 0
        self._file = None

    def sweep(self) -> int:
        """Kill the groups and remove the containers a former life of this host left
        running; start a new log. Returns how many groups and containers it ended."""
        try:
            lines = self.path.read_bytes().splitlines()
        except OSError:  # none yet, or unreadable: nothing to kill
            lines = []
        noted = replay(lines)
        killed = kill_groups(noted.groups)
        removed = remove_containers({HOST_LABEL: self.host}) if noted.containers else 0
        if killed or removed:
            log.warning(
                "killed what the tasks of this host's last life left running",
                extra={"groups": killed, "containers": removed or 0, "ledger": str(self.path)},
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", buffering=1)  # noqa: SIM115 (lives with the host)
        except OSError as err:
            log.warning(
                "cannot note the tasks' process groups; after a crash of this host they may run on",
                extra={"ledger": str(self.path), "error": str(err)},
            )
        if self.janitor is not None and not self.janitor.start():
            self.janitor = None
        if removed is None:
            self.note_containers()  # the engine could not be asked: the next start asks
        return killed + (removed or 0)

    def note_containers(self) -> None:
        """Say, once per life and before the first container exists, that this host
        starts containers: a start after a crash then looks for them."""
        if not self._docker_noted and self._noting():
            self._docker_noted = True
            self._write("d\n")

    def add(self, pgid: int) -> None:
        ticks = start_ticks(pgid)
        if ticks is None or not self._noting():
            return
        self._live[pgid] = ticks
        self._write(f"+ {pgid} {ticks}\n")

    def remove(self, pgid: int) -> None:
        if self._live.pop(pgid, None) is not None:
            self._write(f"- {pgid}\n")

    def close(self) -> None:
        """The host exits in order (its tasks are over): its janitor leaves too."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.janitor is not None:
            self.janitor.close(all_ended=not self._live)  # a group not ended: it ends it

    def _noting(self) -> bool:
        return self._file is not None or self.janitor is not None

    def _write(self, line: str) -> None:
        if self.janitor is not None:
            self.janitor.tell(line)
        if self._file is None:
            return
        self._file.write(line)  # line-buffered: in the kernel at once, safe from a kill -9
        self._lines += 1
        if self._lines > COMPACT_AFTER:
            self._compact()

    def _compact(self) -> None:
        assert self._file is not None
        fresh = self.path.with_suffix(self.path.suffix + ".new")
        lines = [f"+ {pgid} {ticks}\n" for pgid, ticks in self._live.items()]
        if self._docker_noted:
            lines.append("d\n")
        fresh.write_text("".join(lines))
        os.replace(fresh, self.path)
        self._file.close()
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115
        self._lines = len(lines)


@dataclass
class Noted:
    """What a ledger's lines say is still to end: live groups (pgid -> start ticks),
    whether containers ran, and whether the host said it exits in order (``q``)."""

    groups: dict[int, int] = field(default_factory=dict)
    containers: bool = False
    quit: bool = False


def replay(lines: Iterable[bytes]) -> Noted:
    """Read ledger lines (a file's, or a janitor's pipe until it closes or says ``q``);
    a line cut short by a crash is skipped."""
    noted = Noted()
    for line in lines:
        try:
            op, *values = line.split()
            if op == b"+":
                noted.groups[int(values[0])] = int(values[1])
            elif op == b"-":
                noted.groups.pop(int(values[0]), None)
            elif op == b"d":
                noted.containers = True
            elif op == b"q":
                noted.quit = True
                break
        except (IndexError, ValueError):
            continue
    return noted


def kill_groups(groups: dict[int, int]) -> int:
    """SIGKILL each group (pgid -> its leader's start ticks) that still runs and is the
    one noted; wait (bounded) until they are gone. Returns how many it killed."""
    killed = [pgid for pgid, ticks in groups.items() if _kill_group(pgid, ticks)]
    deadline = time.monotonic() + GONE_WAIT_S
    while killed and time.monotonic() < deadline and any(map(group_running, killed)):
        time.sleep(0.01)
    return len(killed)


def _kill_group(pgid: int, ticks: int) -> bool:
    if not group_running(pgid):
        return False
    leader = start_ticks(pgid)
    if leader is not None and leader != ticks:
        return False  # the pid was reused: another process leads a group of that id
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
        return True
    return False


def remove_containers(labels: dict[str, str]) -> int | None:
    """Force-remove every container that carries all these labels; None if the engine
    could not be asked (a warning says so)."""
    import docker.errors  # binds ``docker`` too
    import requests

    wanted = [f"{key}={value}" for key, value in labels.items()]
    try:
        client = docker.from_env(timeout=ENGINE_TIMEOUT_S)
        try:
            left = client.containers.list(all=True, filters={"label": wanted})
            for container in left:
                with contextlib.suppress(docker.errors.NotFound):
                    container.remove(force=True)
        finally:
            client.close()
    except (docker.errors.DockerException, requests.RequestException) as err:
        log.warning(
            "cannot ask the Docker engine for the containers a life of this host left "
            "running; the next start asks again",
            extra={"labels": ",".join(wanted), "error": str(err)},
        )
        return None
    return len(left)
