"""Executors: how a worker agent runs one task.

Every executor has one coroutine, ``run(task) -> ExecutionResult``. A task that ends on its
own, well or badly, returns a result; the only exception ``run`` raises is
``CancelledError``, and only after the work has really stopped (process group killed,
container stopped and removed). The agent kills a task by cancelling the asyncio task
that awaits ``run``.

Exit codes follow the shell: 126 = cannot execute, 127 = not found, 128+N = killed by
signal N (so a ``SIGKILL`` is 137 for a process and a container alike).

No task runs as root unless the operator says so (``runas.py``): a process task as
``RunAs.process`` (``nobody`` under a root worker), a container as ``RunAs.container``
(65534:65534 by default), read-only, without capabilities or new privileges.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from services._proto.megha.v1 import common_pb2
from services.worker.janitor import LIFE_LABEL
from services.worker.leftovers import HOST_LABEL, GroupLedger, group_running
from services.worker.memwatch import MemoryWatch
from services.worker.outputs import TaskOutputs
from services.worker.runas import RunAs, RunAsError, TaskDirs, TaskUser, default_task_dirs

log = logging.getLogger("megha.worker")

SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED
FAILED = common_pb2.TASK_STATE_FAILED

EXECUTOR_NAMES = ("sim", "process", "docker")
# How much of stderr / container logs a failure message carries.
TAIL_BYTES = 2048
# How long a container's log copies may take to catch up once it has stopped.
LOGS_DRAIN_S = 5.0
# SIGTERM first, SIGKILL after this long: a task gets a moment to clean up.
DEFAULT_KILL_GRACE_S = 2.0

EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127


def task_env(task: common_pb2.Task) -> dict[str, str]:
    """What a process or container task learns of itself from its environment (set over
    the task's own ``env``): its job, id, position in the job, attempt and resources."""
    return {
        "MEGHA_JOB_ID": task.job_id,
        "MEGHA_TASK_ID": task.task_id,
        "MEGHA_TASK_INDEX": str(task.index),
        "MEGHA_ATTEMPT": str(task.attempt),
        "MEGHA_CPU_MILLI": str(task.resources.cpu_milli),
        "MEGHA_MEMORY_MB": str(task.resources.memory_mb),
    }


@dataclass(frozen=True)
class ExecutionResult:
    """How a task ended: ``state`` is ``TASK_STATE_SUCCEEDED`` or ``TASK_STATE_FAILED``."""

    exit_code: int
    message: str
    state: common_pb2.TaskState.ValueType
    peak_memory_mb: int = 0  # a process task's, as its host's memory watch saw it

    @classmethod
    def succeeded(cls, message: str = "") -> ExecutionResult:
        return cls(exit_code=0, message=message, state=SUCCEEDED)

    @classmethod
    def failed(cls, exit_code: int, message: str) -> ExecutionResult:
        return cls(exit_code=exit_code, message=message, state=FAILED)


class Executor(Protocol):
    """Runs one task to its end; cancel the awaiting asyncio task to kill it."""

    name: str

    async def run(self, task: common_pb2.Task) -> ExecutionResult: ...


# --------------------------------------------------------------------------- sim
class SimExecutor:
    """Holds the task's resources for its duration without running anything.

    The duration is ``task.sim.duration_s`` when the task names this executor, else the
    task's ``expected_duration_s`` (a trace replayed with the worker's default executor).
    """

    name = "sim"

    async def run(self, task: common_pb2.Task) -> ExecutionResult:
        duration = task.sim.duration_s if task.HasField("sim") else task.expected_duration_s
        await asyncio.sleep(max(0.0, duration))
        return ExecutionResult.succeeded()


# ----------------------------------------------------------------------- process
class ProcessExecutor:
    """Runs ``task.process.args`` as a local process in its own process group.

    The group is the task: a timeout or a kill signals the whole group (SIGTERM, then
    SIGKILL after ``kill_grace_s``), and when the main process exits, whatever it left
    behind in the group is killed too, because the LM gives the task's resources to the
    next task at that moment. With ``outputs``, stdout goes into the attempt's file and
    stderr into another (``outputs.py``), else stdout is discarded; the tail of stderr goes
    into the failure message. If the worker host itself dies, the main process dies with it
    (``setpriv --pdeathsig``) and the next start of the host kills the rest of the group
    (``leftovers.py``). With ``memory``, a task whose group holds more resident memory
    than its request is killed (SIGKILL, at once) and fails (``memwatch.py``).

    It runs as ``run_as.process`` (``runas.py``; by default ``nobody`` when the worker is
    root, else the worker's own user), with no core dumps and, when that is another user
    than the worker's, at most ``run_as.max_processes`` processes of that user; such a task
    runs in a directory of its own (``task_dirs``), which is also its HOME and TMPDIR and
    is deleted when it ends.
    """

    name = "process"

    def __init__(
        self,
        kill_grace_s: float = DEFAULT_KILL_GRACE_S,
        ledger: GroupLedger | None = None,
        outputs: TaskOutputs | None = None,
        memory: MemoryWatch | None = None,
        run_as: RunAs | None = None,
        task_dirs: TaskDirs | None = None,
    ) -> None:
        self.kill_grace_s = kill_grace_s
        # Where the host notes each task's group, for its next life to kill after a crash.
        self.ledger = ledger
        self.outputs = outputs
        self.memory = memory
        self.run_as = run_as if run_as is not None else RunAs.resolve()
        self.user = self.run_as.process
        self.task_dirs = None
        if self.user.switch:
            self.task_dirs = task_dirs or TaskDirs(default_task_dirs(), self.user)
        # A task that cannot run says as whom it tried: the path may be closed to that user.
        self._who = f" as {self.user.name}" if self.user.switch else ""
        # Found out here, at start-up, not by a blocking call in the first task's spawn.
        self._prefix = (*switch_prefix(self.user), *self.run_as.limits())
        # No setpriv: the standard library's switch (and its fork: see switch_prefix).
        self._popen_user = {} if _die_with_worker() else self.user.popen_kwargs()

    async def run(self, task: common_pb2.Task) -> ExecutionResult:
        spec = task.process
        args = list(spec.args)
        if not args:
            return ExecutionResult.failed(EXIT_NOT_FOUND, "process task has no args to run")
        stdout = err_file = None
        if self.outputs is not None:
            try:
                stdout = self.outputs.open(task.task_id, task.attempt, "out")
                err_file = self.outputs.open(task.task_id, task.attempt, "err")
            except OSError as err:  # the task runs all the same, its output not kept
                self._close_output(stdout)
                stdout = err_file = None
                log.warning(
                    "cannot keep a task's output",
                    extra={"task_id": task.task_id, "why": err.strerror or str(err)},
                )
        dirs, workdir = self.task_dirs, None
        try:
            if dirs is not None:
                workdir = dirs.make(task.task_id, task.attempt)
            identity = self.user.env(workdir) if workdir is not None else {}
            env = {**os.environ, **identity, **spec.env, **task_env(task)}
            proc = await _spawn([*self._prefix, *args], env, stdout, workdir, self._popen_user)
        except BaseException as err:
            self._close_output(stdout, err_file)
            if dirs is not None and workdir is not None:
                dirs.remove(workdir)
            if not isinstance(err, OSError):
                raise
            return self._cannot_run(args[0], err)

        if self.ledger is not None:
            self.ledger.add(proc.pid)
        memory_mb = task.resources.memory_mb
        # Every task is watched, for its peak; one that asked for memory, against it too.
        over = None if self.memory is None else self.memory.watch(proc.pid, memory_mb << 20)
        try:
            result = await self._supervise(proc, args, spec, err_file, over, memory_mb)
            if self.memory is not None:
                result = replace(result, peak_memory_mb=_mib(self.memory.peak(proc.pid)))
            return result
        finally:
            if self.memory is not None:
                self.memory.unwatch(proc.pid)
            # The child wrote its stdout itself; the host kept its copy of the file open
            # until now so that outputs could hold it to worker_output_max_mb.
            self._close_output(stdout, err_file)
            if self.ledger is not None:
                self.ledger.remove(proc.pid)
            if dirs is not None and workdir is not None:  # its processes are gone
                removing = asyncio.ensure_future(asyncio.to_thread(dirs.remove, workdir))
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(removing)

    def _cannot_run(self, program: str, err: OSError) -> ExecutionResult:
        if isinstance(err, FileNotFoundError):
            code, why = EXIT_NOT_FOUND, "not found"
        elif isinstance(err, PermissionError):
            code, why = EXIT_CANNOT_EXECUTE, "permission denied"
        else:
            code, why = EXIT_CANNOT_EXECUTE, err.strerror or str(err)
        return ExecutionResult.failed(code, f"cannot run {program!r}{self._who}: {why}")

    def _close_output(self, *fds: int | None) -> None:
        for fd in fds:
            if fd is not None and self.outputs is not None:
                self.outputs.close(fd)

    async def _supervise(
        self,
        proc: asyncio.subprocess.Process,
        args: list[str],
        spec: common_pb2.ProcessExecutor,
        err_file: int | None,
        over: asyncio.Future[int] | None,
        memory_mb: int,
    ) -> ExecutionResult:
        assert proc.stderr is not None
        tail = _Tail(TAIL_BYTES, err_file)
        reader = asyncio.create_task(tail.drain(proc.stderr))
        timeout = spec.timeout_s if spec.timeout_s > 0 else None
        try:
            returncode = await asyncio.wait_for(_exited(proc, over), timeout)
        except TimeoutError:
            await self._stop(proc)
            await _finish_reader(reader)
            return ExecutionResult.failed(
                _exit_code(proc.returncode), f"timed out after {spec.timeout_s:g} s"
            )
        except asyncio.CancelledError:
            # Killed by the agent: the work must stop before the cancellation completes,
            # even if a second cancel arrives while we wait for the grace period.
            stopping = asyncio.create_task(self._stop(proc))
            try:
                await asyncio.shield(stopping)
            except asyncio.CancelledError:
                _signal_group(proc.pid, signal.SIGKILL)
            reader.cancel()
            raise
        # The main process is gone, or is killed here for its memory; its leftovers
        # must not outlive the task.
        _signal_group(proc.pid, signal.SIGKILL)
        if returncode is None:
            await proc.wait()
        await _group_gone(proc.pid)
        await _finish_reader(reader)
        if returncode is None:
            assert over is not None
            return ExecutionResult.failed(
                _exit_code(proc.returncode),
                f"killed: its processes held {_mib(over.result())} MiB resident, "
                f"more than the {memory_mb} MiB it asked for",
            )
        if returncode == 0:
            return ExecutionResult.succeeded()
        code = _exit_code(returncode)
        stderr = tail.text()
        if code in (EXIT_NOT_FOUND, EXIT_CANNOT_EXECUTE) and stderr.startswith(_PREFIX_FAILED):
            why = "not found" if code == EXIT_NOT_FOUND else "permission denied"
            return ExecutionResult.failed(code, f"cannot run {args[0]!r}{self._who}: {why}")
        cause = f"killed by signal {-returncode}" if returncode < 0 else f"exit code {code}"
        return ExecutionResult.failed(code, f"{cause}: {stderr}" if stderr else cause)

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        _signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), self.kill_grace_s)
        # Also reaches children that ignored SIGTERM after the main process exited.
        _signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()
        await _group_gone(proc.pid)


# How setpriv and prlimit (the command prefix) say that they could not exec the task.
_PREFIX_FAILED = ("setpriv: failed", "prlimit: failed")


@functools.cache
def _die_with_worker() -> tuple[str, ...]:
    """The prefix that makes a task's main process die with its worker host (a kill -9
    leaves no parent to kill it): ``setpriv --pdeathsig KILL --`` where it works."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    prefix = (setpriv, "--pdeathsig", "KILL", "--")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        if subprocess.run([*prefix, "true"], capture_output=True, timeout=5).returncode == 0:
            return prefix
    return ()


@functools.cache
def switch_prefix(user: TaskUser) -> tuple[str, ...]:
    """The prefix that makes a task die with its worker and, when ``user`` is another than
    the worker's, start as ``user``: ``setpriv --reuid --regid --groups --pdeathsig KILL
    --``; empty where setpriv is missing (subprocess then switches users itself).

    Not subprocess's ``user=``/``group=``/``extra_groups=`` where setpriv is there: with
    them, subprocess fork()s this multi-threaded gRPC process instead of vfork()ing it, and
    gRPC's fork handlers ran in the child, which died of SIGSEGV before its exec in about
    half the spawns of a live worker host. Raises ``RunAsError`` saying why when setpriv
    cannot switch (e.g. a root without CAP_SETUID): at start-up, not in every task."""
    setpriv = _die_with_worker()
    if not (user.switch and setpriv):
        return setpriv
    prefix = (setpriv[0], *user.setpriv_args(), *setpriv[1:])
    why = ""
    try:
        ran = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=10)
        if ran.returncode != 0:
            why = ran.stderr.strip() or f"exit code {ran.returncode}"
    except (OSError, subprocess.SubprocessError) as err:
        why = str(err)
    if why:
        raise RunAsError(f"cannot start tasks as {user.name} (uid {user.uid}): {why}")
    return prefix


def _mib(size: int) -> int:
    """Bytes in MiB, rounded up (a task that held a byte more than asked is over)."""
    return -(-size >> 20)


async def _exited(proc: asyncio.subprocess.Process, over: asyncio.Future[int] | None) -> int | None:
    """The process's return code once it exits, or None if ``over`` comes first."""
    if over is None:
        return await proc.wait()
    exiting = asyncio.ensure_future(proc.wait())
    try:
        await asyncio.wait({exiting, over}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        exiting.cancel()  # proc.wait() may be awaited again
    return exiting.result() if exiting.done() and not exiting.cancelled() else None


async def _spawn(
    args: list[str],
    env: dict[str, str],
    stdout: int | None = None,
    cwd: Path | None = None,
    user: Mapping[str, Any] | None = None,
) -> asyncio.subprocess.Process:
    spawning = asyncio.ensure_future(
        asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL if stdout is None else stdout,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,
            **(user or {}),  # only where setpriv is missing (ProcessExecutor.__init__)
        )
    )
    try:
        return await asyncio.shield(spawning)
    except asyncio.CancelledError:
        # Cancelled halfway, asyncio would kill only the main process and leave its
        # children running: let the spawn finish, then kill the whole group.
        with contextlib.suppress(Exception):
            proc = await spawning
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
            await _group_gone(proc.pid)
        raise


def _signal_group(pgid: int, sig: int) -> None:
    # start_new_session made the process a group leader: its pid is the group id.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


async def _group_gone(pgid: int, limit_s: float = 1.0) -> None:
    """Wait (bounded) until no process of the group still runs, so a kill is over when
    the executor returns; zombies count as gone (their parent may be slow to reap)."""
    deadline = time.monotonic() + limit_s
    while group_running(pgid) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def _exit_code(returncode: int | None) -> int:
    if returncode is None:
        return -1
    return 128 - returncode if returncode < 0 else returncode


class _Tail:
    """The last ``limit`` bytes of a stream, read as it comes so the pipe never fills;
    every byte is also written to the file ``sink`` when one is given."""

    def __init__(self, limit: int, sink: int | None = None) -> None:
        self.limit = limit
        self.sink = sink
        self.data = bytearray()

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            if self.sink is not None:
                try:
                    os.write(self.sink, chunk)  # a local file: a short, bounded write
                except OSError:
                    self.sink = None  # disk full or gone: the tail is still kept
            self.data += chunk
            if len(self.data) > 2 * self.limit:
                del self.data[: -self.limit]

    def text(self) -> str:
        return _tail_text(bytes(self.data[-self.limit :]))


def _tail_text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace").strip()


async def _finish_reader(reader: asyncio.Task[None]) -> None:
    # A process that escaped the group (setsid) may still hold stderr open; don't hang.
    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(reader, 1.0)


# ------------------------------------------------------------------------ docker
class DockerExecutor:
    """Runs ``task.docker.image`` on the local Docker engine, limited to the task's resources.

    CPU and memory limits come from the task's request (``nano_cpus``, ``mem_limit``), and
    the container is confined (``container_options``): it runs as ``run_as.container``
    (65534:65534 by default), on a read-only root filesystem with a writable tmpfs ``/tmp``,
    without capabilities or new privileges, with at most ``run_as.max_processes``
    processes. The container carries the label ``megha.task_id`` so an operator can find
    it, and, with a ``ledger``, ``megha.host`` so that the host's next start removes it if
    this host dies first (``leftovers``), and with the ledger's janitor, ``megha.life``, so
    that the janitor removes it as soon as the host dies (``janitor``). The container is removed
    however the task ends. With ``outputs``, its stdout and stderr are copied into the
    attempt's files as they come. An engine that cannot be reached fails the task with a
    clear message instead of raising.

    ``docker.from_env()`` is called lazily, once, and the client is shared by every task.
    Short engine calls run in ``asyncio.to_thread``; the one call that blocks for the
    container's whole life (``wait``) runs in a pool of its own, so many long containers
    cannot starve the default pool that ``stop`` and ``remove`` need.
    """

    name = "docker"

    def __init__(
        self,
        kill_grace_s: float = DEFAULT_KILL_GRACE_S,
        client_factory: Any = None,
        max_containers: int = 256,
        ledger: GroupLedger | None = None,
        outputs: TaskOutputs | None = None,
        run_as: RunAs | None = None,
    ) -> None:
        self.kill_grace_s = kill_grace_s
        self.ledger = ledger
        self.outputs = outputs
        self.run_as = run_as if run_as is not None else RunAs.resolve()
        self._client_factory = client_factory
        self._client: Any = None
        self._cleanups: set[asyncio.Future[None]] = set()
        self._wait_pool = ThreadPoolExecutor(max_containers, thread_name_prefix="docker-wait")
        # With outputs: two threads a container copy its stdout and stderr as they come.
        self._log_pool = ThreadPoolExecutor(2 * max_containers, thread_name_prefix="docker-logs")

    async def run(self, task: common_pb2.Task) -> ExecutionResult:
        import docker.errors
        import requests

        engine_errors = (docker.errors.DockerException, requests.RequestException)
        spec = task.docker
        if not spec.image:
            return ExecutionResult.failed(EXIT_NOT_FOUND, "docker task has no image")
        try:
            client = await asyncio.to_thread(self._get_client)
        except engine_errors as err:
            return ExecutionResult.failed(-1, f"docker engine unavailable: {err}")

        kwargs = container_options(task, self.run_as)
        if self.ledger is not None:
            kwargs["labels"][HOST_LABEL] = self.ledger.host
            if self.ledger.janitor is not None:
                kwargs["labels"][LIFE_LABEL] = self.ledger.janitor.life
            self.ledger.note_containers()  # before the container exists

        loop = asyncio.get_running_loop()
        starting = asyncio.ensure_future(
            asyncio.to_thread(client.containers.run, spec.image, **kwargs)
        )
        try:
            container = await asyncio.shield(starting)
        except asyncio.CancelledError:
            # The engine call cannot be interrupted; remove the container once it exists.
            starting.add_done_callback(self._remove_when_started)
            raise
        except docker.errors.ImageNotFound as err:
            return ExecutionResult.failed(EXIT_NOT_FOUND, f"image {spec.image!r}: {err}")
        except engine_errors as err:
            return ExecutionResult.failed(-1, f"cannot start {spec.image!r}: {err}")

        copying = []
        if self.outputs is not None:
            copying = [
                loop.run_in_executor(
                    self._log_pool, _copy_logs, container, task, self.outputs, stream
                )
                for stream in ("out", "err")
            ]
        timeout = spec.timeout_s if spec.timeout_s > 0 else None
        try:
            waiting = loop.run_in_executor(self._wait_pool, _wait_container, container)
            try:
                exit_code = await asyncio.wait_for(waiting, timeout)
            except TimeoutError:
                await asyncio.to_thread(_stop_container, container, self.kill_grace_s)
                return ExecutionResult.failed(
                    await asyncio.to_thread(_wait_container, container),
                    f"timed out after {spec.timeout_s:g} s",
                )
            if exit_code == 0:
                return ExecutionResult.succeeded()
            return ExecutionResult.failed(
                exit_code, await asyncio.to_thread(_describe_failure, container, exit_code)
            )
        except asyncio.CancelledError:
            stopping = asyncio.ensure_future(
                asyncio.to_thread(_stop_container, container, self.kill_grace_s)
            )
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(stopping)
            raise
        except engine_errors as err:
            return ExecutionResult.failed(-1, f"docker engine failed while running: {err}")
        finally:
            if copying:  # the copies end with the container: let them take the last lines
                copied = asyncio.gather(*copying, return_exceptions=True)
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(asyncio.wait_for(copied, LOGS_DRAIN_S))
            removing = asyncio.ensure_future(asyncio.to_thread(_remove_container, container))
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(removing)

    def _get_client(self) -> Any:
        if self._client is None:
            import docker

            factory = self._client_factory or docker.from_env
            self._client = factory()
        return self._client

    def _remove_when_started(self, starting: asyncio.Future[Any]) -> None:
        if starting.cancelled() or starting.exception() is not None:
            return
        removing = asyncio.ensure_future(asyncio.to_thread(_remove_container, starting.result()))
        self._cleanups.add(removing)
        removing.add_done_callback(self._cleanups.discard)

    def close(self) -> None:
        self._wait_pool.shutdown(wait=False, cancel_futures=True)
        self._log_pool.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()
            self._client = None


def container_options(task: common_pb2.Task, run_as: RunAs) -> dict[str, Any]:
    """The keyword arguments of ``containers.run`` for a docker task (``docker run``'s
    flags): its command, environment, label and limits, and the confinement every task
    gets whatever its image says (``--user``, ``--read-only``, ``--tmpfs /tmp``,
    ``--cap-drop ALL``, ``--security-opt no-new-privileges``, ``--pids-limit``)."""
    spec = task.docker
    # The image's HOME is read-only now, or not the user's: /tmp is where it may write.
    environment = {"HOME": "/tmp", **spec.env, **task_env(task)}
    kwargs: dict[str, Any] = {
        "command": list(spec.args) or None,
        "environment": environment,
        "labels": {"megha.task_id": task.task_id},
        "detach": True,
        "user": run_as.container,
        "read_only": True,
        # exec: the one place it may write is where a build or a JIT puts what it runs;
        # its pages count against the memory limit, like the container's own.
        "tmpfs": {"/tmp": "rw,exec,nosuid,nodev,mode=1777"},
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
    }
    if run_as.max_processes > 0:
        kwargs["pids_limit"] = run_as.max_processes
    if task.resources.cpu_milli > 0:
        kwargs["nano_cpus"] = task.resources.cpu_milli * 1_000_000
    if task.resources.memory_mb > 0:
        kwargs["mem_limit"] = f"{task.resources.memory_mb}m"
    return kwargs


def _wait_container(container: Any) -> int:
    import requests

    while True:
        try:
            # The SDK's HTTP read timeout would end a long wait; ask again until it exits.
            return int(container.wait(timeout=300)["StatusCode"])
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout):
            container.reload()
            if container.status in ("exited", "dead"):
                return int(container.attrs["State"]["ExitCode"])


def _stop_container(container: Any, grace_s: float) -> None:
    container.stop(timeout=max(1, round(grace_s)))


def _remove_container(container: Any) -> None:
    import docker.errors

    with contextlib.suppress(docker.errors.NotFound):
        container.remove(force=True)


def _copy_logs(container: Any, task: common_pb2.Task, outputs: TaskOutputs, stream: str) -> None:
    """Copy the container's stdout or stderr into the attempt's file as it comes (so
    ``megha logs --follow`` sees it), until the container stops."""
    fd = outputs.open(task.task_id, task.attempt, stream)
    try:
        chunks = container.logs(
            stdout=stream == "out", stderr=stream == "err", stream=True, follow=True
        )
        for chunk in chunks:
            os.write(fd, chunk)
    finally:
        outputs.close(fd)


def _describe_failure(container: Any, exit_code: int) -> str:
    container.reload()
    state = container.attrs.get("State", {})
    if state.get("OOMKilled"):
        return f"exit code {exit_code}: out of memory (container memory limit reached)"
    logs = _tail_text(container.logs(stdout=True, stderr=True, tail=100)[-TAIL_BYTES:])
    return f"exit code {exit_code}: {logs}" if logs else f"exit code {exit_code}"


# ---------------------------------------------------------------------- choosing
def default_executors(
    ledger: GroupLedger | None = None,
    outputs: TaskOutputs | None = None,
    memory_check_s: float = 0.0,
    run_as: RunAs | None = None,
    task_dirs: TaskDirs | None = None,
) -> dict[str, Executor]:
    """One instance of each executor kind, to be shared by the agents of one process;
    with ``memory_check_s``, process tasks are held to their memory request; tasks run as
    ``run_as`` (by default: not root, ``runas.py``)."""
    memory = MemoryWatch(memory_check_s) if memory_check_s > 0 else None
    run_as = run_as if run_as is not None else RunAs.resolve()
    return {
        "sim": SimExecutor(),
        "process": ProcessExecutor(
            ledger=ledger, outputs=outputs, memory=memory, run_as=run_as, task_dirs=task_dirs
        ),
        "docker": DockerExecutor(ledger=ledger, outputs=outputs, run_as=run_as),
    }


def executor_for(
    task: common_pb2.Task, default: str, executors: Mapping[str, Executor] | None = None
) -> Executor:
    """The executor the task names in its ``executor`` oneof, else ``default``.

    Raises ``ValueError`` for a name that no executor has.
    """
    name = task.WhichOneof("executor") or default
    if executors is None:
        executors = _shared_executors()
    try:
        return executors[name]
    except KeyError:
        known = ", ".join(sorted(executors))
        raise ValueError(f"unknown executor {name!r}; this worker has {known}") from None


_SHARED: dict[str, Executor] = {}


def _shared_executors() -> dict[str, Executor]:
    # Lazily: a process that never runs a docker task never builds a docker client.
    if not _SHARED:
        _SHARED.update(default_executors())
    return _SHARED
