"""Whom tasks run as: never root unless the operator says so, and what limits they get.

```
worker_run_as, worker_allow_root_tasks ──RunAs.resolve──▶ RunAs
    .process:   TaskUser ──▶ ProcessExecutor: setpriv --reuid --regid --groups,
                             cwd/HOME/TMPDIR = a directory of its own (TaskDirs)
    .container: "uid:gid" ──▶ DockerExecutor: --user
worker_task_max_processes ──▶ RLIMIT_NPROC of a switched process task (prlimit), pids limit
```

A worker host that runs as root runs process tasks as ``worker_run_as``, by default
``nobody`` (65534:65534, present on Debian); a host that runs as another user cannot switch
and runs them as itself. Containers run as ``worker_run_as`` (its numeric ids, which need
not exist in the image), by default 65534:65534, whoever the worker is. No setuid code is
ours: util-linux's ``setpriv`` switches (it is already the task's ``--pdeathsig`` wrapper),
and where it is missing, the standard library does (``subprocess``'s ``user``, ``group``,
``extra_groups``; the executor says why setpriv comes first).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import re
import resource
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

NOBODY = "nobody"
NOBODY_ID = 65534  # nobody:nogroup on Debian, also when the name is missing
# Processes (threads count too) a task may have, unless worker_task_max_processes says.
MAX_PROCESSES = 4096
_UID_GID = re.compile(r"(\d+)(?::(\d+))?")


class RunAsError(ValueError):
    """``worker_run_as`` names no user, names root without leave, or cannot be applied."""


@dataclass(frozen=True)
class TaskUser:
    """The identity a process task runs as; ``switch`` when it is not the worker's own."""

    uid: int
    gid: int
    name: str
    groups: tuple[int, ...] = ()  # supplementary groups, set only when switching
    switch: bool = False

    def popen_kwargs(self) -> dict[str, object]:
        """What ``subprocess`` needs to start the task as this user (nothing if not
        switching); the process executor uses it only where setpriv is missing."""
        if not self.switch:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def setpriv_args(self) -> tuple[str, ...]:
        """setpriv's options that switch to this user (with ``popen_kwargs``' effect)."""
        groups = ",".join(map(str, self.groups))
        return (
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            f"--groups={groups}" if groups else "--clear-groups",
        )

    def env(self, home: Path) -> dict[str, str]:
        """The environment that says who the task is and where it may write: the worker's
        own HOME and TMPDIR are another user's (root's) and not writable by this one."""
        if not self.switch:
            return {}
        return {"USER": self.name, "LOGNAME": self.name, "HOME": str(home), "TMPDIR": str(home)}

    def can_search(self, path: Path) -> Path | None:
        """The first directory on the way to ``path`` (itself included) this user may not
        pass through, by its mode bits; None if there is none."""
        groups = {self.gid, *self.groups}
        for part in (*reversed(path.parents), path):
            try:
                info = part.stat()
            except OSError:
                return part
            if info.st_uid == self.uid:
                bit = stat.S_IXUSR
            elif info.st_gid in groups:
                bit = stat.S_IXGRP
            else:
                bit = stat.S_IXOTH
            if not info.st_mode & bit:
                return part
        return None


@dataclass(frozen=True)
class RunAs:
    """Whom a worker host's tasks run as, and how many processes each may have."""

    process: TaskUser
    container: str  # docker's --user, "uid:gid"
    max_processes: int = MAX_PROCESSES  # 0: no limit

    @classmethod
    def resolve(
        cls, run_as: str = "", allow_root: bool = False, max_processes: int = MAX_PROCESSES
    ) -> RunAs:
        """The identities for ``worker_run_as`` on this host (its user database, its
        effective uid). Raises ``RunAsError`` saying why when it names no user, names root
        without ``allow_root``, or names another user while the worker is not root."""
        me = os.geteuid()
        if run_as.strip():
            uid, gid, name, groups = _lookup(run_as.strip())
            if 0 in (uid, gid) and not allow_root:
                raise RunAsError(
                    f"worker_run_as {run_as!r} is {'root' if uid == 0 else 'group 0 (root)'}: "
                    "tasks would run as root; set worker_allow_root_tasks: true to allow it"
                )
            container = f"{uid}:{gid}"
        elif me == 0:
            uid, gid, name, groups = _lookup(NOBODY, missing_ok=True)
            container = f"{NOBODY_ID}:{NOBODY_ID}"
        else:
            uid, gid, name, groups = me, os.getegid(), _name_of(me), []
            container = f"{NOBODY_ID}:{NOBODY_ID}"
        if me != 0 and uid != me:
            raise RunAsError(
                f"worker_run_as {run_as!r} is uid {uid}, but this worker runs as uid {me} and "
                "only root can start tasks as another user: run the worker as root, or leave "
                "worker_run_as empty and tasks run as the worker's own user"
            )
        switch = me == 0 and (uid, gid) != (0, 0)
        user = TaskUser(uid, gid, name, tuple(groups) if switch else (), switch)
        return cls(user, container, max(0, max_processes))

    def limits(self) -> tuple[str, ...]:
        """The command prefix that sets a process task's resource limits (``prlimit`` of
        util-linux, so nothing runs between fork and exec but the standard library's
        switch): no core dumps (a crash does not fill the disk with copies of its memory),
        and, for a switched user, at most ``max_processes`` processes and threads, counted
        over every process of that user (RLIMIT_NPROC is per user, not per task). Not for a
        worker's own user: that count would take in the worker and all else it runs.
        Empty where prlimit is missing or refused."""
        nproc = self.max_processes if self.process.switch else 0
        return _prlimit(_within_hard_limit(nproc))


def _lookup(run_as: str, missing_ok: bool = False) -> tuple[int, int, str, list[int]]:
    """(uid, gid, name, supplementary groups) of a user name or ``uid[:gid]``."""
    numeric = _UID_GID.fullmatch(run_as)
    if numeric is not None:
        uid = int(numeric.group(1))
        try:
            entry: pwd.struct_passwd | None = pwd.getpwuid(uid)
        except KeyError:
            entry = None
        if numeric.group(2) is not None:
            gid = int(numeric.group(2))
        elif entry is not None:
            gid = entry.pw_gid
        elif uid == os.geteuid():  # the worker's own uid, which may have no name here
            gid = os.getegid()
        else:
            raise RunAsError(
                f"worker_run_as {run_as!r}: no user has uid {uid} here; give its group too "
                f"('{uid}:<gid>')"
            )
        # A bare uid gets no supplementary groups: only what it names.
        return uid, gid, entry.pw_name if entry else str(uid), []
    try:
        entry = pwd.getpwnam(run_as)
    except KeyError:
        if missing_ok:
            return NOBODY_ID, NOBODY_ID, run_as, []
        raise RunAsError(
            f"worker_run_as {run_as!r}: no such user on this host (give a user name or uid[:gid])"
        ) from None
    # A named user gets its groups, as a login would (e.g. 'video' for a GPU).
    return entry.pw_uid, entry.pw_gid, entry.pw_name, os.getgrouplist(entry.pw_name, entry.pw_gid)


def _name_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _within_hard_limit(nproc: int) -> int:
    # prlimit may lower a limit but not raise a hard one: never ask past what we have.
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    return min(nproc, hard) if nproc and hard != resource.RLIM_INFINITY else nproc


@functools.cache
def _prlimit(nproc: int) -> tuple[str, ...]:
    found = shutil.which("prlimit")
    if found is None:
        return ()
    prefix = (found, "--core=0", *((f"--nproc={nproc}",) if nproc else ()), "--")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        if subprocess.run([*prefix, "true"], capture_output=True, timeout=5).returncode == 0:
            return prefix
    return ()


class TaskDirs:
    """A working directory per attempt of a switched task, owned by its user (mode 0700),
    under ``base``; it is the task's cwd, HOME and TMPDIR, and is deleted when the attempt
    ends. The directories on the way that this creates are mode 0711 (passable, not
    listable): the task user reaches its own directory and sees no other."""

    def __init__(self, base: Path, user: TaskUser) -> None:
        self.base = Path(base).absolute()
        self.user = user
        me = os.geteuid()
        for part in (*reversed(self.base.parents), self.base):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o711)
                os.chmod(part, 0o711)  # not the umask's
            info = os.lstat(part)
            # In a shared temp dir another user could have made a name first, or a
            # symlink: this worker would then create and chown inside what they control.
            # Each part is checked before anything is made in it.
            foreign = info.st_uid not in (0, me) or stat.S_ISLNK(info.st_mode)
            open_to_all = info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX
            if foreign or open_to_all:
                why = "another user's" if foreign else "writable by others"
                raise RunAsError(
                    f"{part}, on the way to the tasks' working directories, is {why}: "
                    "remove it, or point TMPDIR of the worker elsewhere"
                )
        blocked = user.can_search(self.base)
        if blocked is not None:
            raise RunAsError(
                f"tasks run as {user.name} (uid {user.uid}) cannot reach their working "
                f"directories under {self.base}: {blocked} is closed to them; open it to "
                "them (chmod o+x) or point TMPDIR of the worker elsewhere"
            )

    def make(self, task_id: str, attempt: int) -> Path:
        # A prefix to know it by; mkdtemp's suffix makes it unique (and a name short enough).
        prefix = f"{quote(task_id, safe='')[:100]}.{attempt}."
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.base))
        os.chown(path, self.user.uid, self.user.gid)
        return path

    def remove(self, path: Path) -> None:
        # rmtree works on descriptors here: a symlink the task left cannot lead it out.
        shutil.rmtree(path, ignore_errors=True)

    def sweep(self) -> None:
        """Delete what attempts of a former life left (the host died before they ended)."""
        with contextlib.suppress(OSError), os.scandir(self.base) as entries:
            for entry in entries:
                self.remove(Path(entry.path))


def default_task_dirs() -> Path:
    """Where an executor with no host keeps its tasks' working directories."""
    return Path(tempfile.gettempdir()) / f"megha-{os.getuid()}" / "tasks" / "shared"
