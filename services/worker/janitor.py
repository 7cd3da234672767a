"""A worker host's janitor: the process that ends its tasks' leftovers when the host dies.

``leftovers.GroupLedger`` lets a host's *next* start kill what a crashed life left
running. Until that start (and for ever, if the host never comes back) those leftovers
run on while the LM, after ``worker_timeout_s``, runs their tasks again elsewhere: a
process task's children (its main process dies with the host, ``setpriv --pdeathsig``)
and every container, which is the engine's child and not the host's.

So each life of a host starts a janitor: a small process of its own (``python -m
services.worker.janitor LIFE``, in a session of its own so that a kill of the host's
process group spares it) that reads the ledger's lines on a pipe (``+ pgid ticks``,
``- pgid``, ``d`` for "ran containers") and keeps the live groups in memory. The host
holds the pipe's only write end. When the host exits for good it writes ``q`` first and
the janitor just leaves; when it dies (``kill -9``, the OOM killer, a crash) the kernel
closes the pipe, the janitor reads end-of-file, kills the groups (the same checks as the
next start: a reused pid is left alone) and force-removes the containers labelled with
this life (``megha.life``), and exits. Only its own life's groups and containers: a host
that ``megha up`` restarted at once has a new life, whose tasks the old janitor never
heard of.

What it cannot cover: a janitor killed with its host (a ``kill -9`` of both, a worker
container taken down whole, the machine itself). The next start's sweep is still there
for that.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from services.worker.leftovers import kill_groups, remove_containers, replay

log = logging.getLogger("megha.worker")

LIFE_LABEL = "megha.life"  # the label naming the life of a host that started a container
QUIT = b"q\n"  # the host's last line when it exits in order: nothing to end


class Janitor:
    """The host's end of the janitor: start it, tell it each ledger line, let it go."""

    def __init__(self, life: str) -> None:
        self.life = life
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd = -1

    def start(self) -> bool:
        """Start the janitor; False (and a warning) if it cannot be started."""
        read, write = os.pipe()  # both close-on-exec: no task inherits the write end
        root = str(Path(__file__).resolve().parents[2])  # where ``services`` is importable
        path = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "services.worker.janitor", self.life],
                stdin=read,
                stdout=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": path},
                start_new_session=True,
            )
        except OSError as err:
            os.close(write)
            log.warning(
                "cannot start the worker host's janitor; if the host dies, its tasks' "
                "leftovers run on until it starts again",
                extra={"error": str(err)},
            )
            return False
        finally:
            os.close(read)
        os.set_blocking(write, False)  # a janitor that stops reading must not stop the host
        self._fd = write
        return True

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def tell(self, line: str) -> None:
        """Pass one ledger line (short: one atomic write to a pipe)."""
        if self._fd < 0:
            return
        try:
            os.write(self._fd, line.encode())
        except OSError as err:
            # EAGAIN: it stopped reading (64 KB behind); EPIPE: it died. Either way the
            # next start's sweep is what is left.
            why = "fell behind" if err.errno == errno.EAGAIN else "died"
            log.warning(
                f"the worker host's janitor {why}; if the host dies, its tasks' leftovers "
                "run on until it starts again",
                extra={"janitor_pid": self.pid, "error": str(err)},
            )
            self._abandon()

    def close(self, all_ended: bool = True, timeout_s: float = 2.0) -> None:
        """The host exits in order. If its tasks all ended, the janitor leaves without
        ending anything; else it ends what it was told still runs, as after a death."""
        if self._fd < 0:
            return
        if all_ended:
            with contextlib.suppress(OSError):
                os.write(self._fd, QUIT)
        os.close(self._fd)
        self._fd = -1
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout_s)  # else it finishes on its own, reparented

    def _abandon(self) -> None:
        # Killed before its pipe closes, so it does not take the close for a death.
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            self._proc.wait()
        os.close(self._fd)
        self._fd = -1


def main() -> None:
    from services.common.logs import setup_logging

    (life,) = sys.argv[1:]
    setup_logging("worker-janitor")
    noted = replay(sys.stdin.buffer)  # until the host says q, or its pipe closes
    if noted.quit:
        return
    died = time.monotonic()
    killed = kill_groups(noted.groups)
    removed = remove_containers({LIFE_LABEL: life}) if noted.containers else 0
    if killed or removed:
        log.warning(
            "the worker host died; its janitor ended what its tasks left running",
            extra={
                "life": life,
                "groups": killed,
                "containers": removed or 0,
                "ms": round((time.monotonic() - died) * 1000, 1),
            },
        )


if __name__ == "__main__":
    main()
