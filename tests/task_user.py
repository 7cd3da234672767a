"""What the tests' process tasks can reach: under a root test run they run as ``nobody``
(``services/worker/runas.py``), who can neither write in pytest's ``tmp_path`` (mode 0700)
nor run a Python kept under ``/root`` (a pyenv's, as this venv's may be)."""

from __future__ import annotations

import contextlib
import functools
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.worker.runas import RunAs


@functools.cache
def _runnable_python() -> str | None:
    user = RunAs.resolve().process
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    for candidate in filter(None, (sys.executable, system)):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            ran = subprocess.run([candidate, "-c", ""], timeout=30, **user.popen_kwargs())
            if ran.returncode == 0:
                return candidate
    return None


def task_python() -> str:
    """A Python the default ``ProcessExecutor()`` can run: this one, else the system's."""
    found = _runnable_python()
    if found is None:
        pytest.skip("no Python that the tasks' user can run")
    return found


@contextlib.contextmanager
def task_writable_dir() -> Iterator[Path]:
    """A directory the tasks may write in and the test may read (deleted at the end)."""
    path = Path(tempfile.mkdtemp(prefix="megha-test-"))
    try:
        path.chmod(0o777)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
