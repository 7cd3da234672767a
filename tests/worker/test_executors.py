"""The executors run real work: real sleeps, real processes, a real Docker client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services._proto.megha.v1 import common_pb2
from services.worker.executors import (
    DockerExecutor,
    ExecutionResult,
    ProcessExecutor,
    SimExecutor,
    executor_for,
)
from services.worker.leftovers import GroupLedger
from tests.docker_engine import local_image, needs_docker
from tests.task_user import task_python

SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED
FAILED = common_pb2.TASK_STATE_FAILED


def process_task(*args: str, timeout_s: float = 0, **env: str) -> common_pb2.Task:
    return common_pb2.Task(
        task_id="p1", process=common_pb2.ProcessExecutor(args=args, timeout_s=timeout_s, env=env)
    )


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (PID 1 here may never reap)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


async def read_pid(path: Path) -> int:
    async def poll() -> int:
        while not (path.exists() and path.read_text().strip()):
            await asyncio.sleep(0.01)
        return int(path.read_text())

    return await asyncio.wait_for(poll(), 5)


async def gone(pid: int) -> bool:
    for _ in range(200):
        if not alive(pid):
            return True
        await asyncio.sleep(0.01)
    return False


# --------------------------------------------------------------------------- sim
async def test_sim_holds_the_task_for_its_duration() -> None:
    task = common_pb2.Task(task_id="s1", sim=common_pb2.SimExecutor(duration_s=0.05))
    began = time.monotonic()
    result = await asyncio.wait_for(SimExecutor().run(task), 2)
    elapsed = time.monotonic() - began
    assert result == ExecutionResult(exit_code=0, message="", state=SUCCEEDED)
    assert 0.05 <= elapsed < 0.5


async def test_sim_without_settings_uses_the_expected_duration() -> None:
    task = common_pb2.Task(task_id="s2", expected_duration_s=0.05)
    began = time.monotonic()
    await asyncio.wait_for(SimExecutor().run(task), 2)
    assert time.monotonic() - began >= 0.05


# ----------------------------------------------------------------------- process
async def test_process_success() -> None:
    result = await asyncio.wait_for(ProcessExecutor().run(process_task("true")), 5)
    assert result.state == SUCCEEDED
    assert result.exit_code == 0


async def test_process_gets_the_task_env_on_top_of_the_worker_env(task_tmp: Path) -> None:
    out = task_tmp / "env"
    task = process_task("sh", "-c", f'echo "$MEGHA_X:$PATH" > {out}', MEGHA_X="hello")
    result = await asyncio.wait_for(ProcessExecutor().run(task), 5)
    assert result.state == SUCCEEDED
    value, path = out.read_text().strip().split(":", 1)
    assert value == "hello"
    assert path == os.environ["PATH"]


async def test_process_sees_its_identity_in_its_environment(task_tmp: Path) -> None:
    out = task_tmp / "env"
    names = ["JOB_ID", "TASK_ID", "TASK_INDEX", "ATTEMPT", "CPU_MILLI", "MEMORY_MB"]
    script = " ".join(f"$MEGHA_{name}" for name in names)
    task = process_task("sh", "-c", f'echo "{script}" > {out}', MEGHA_TASK_ID="spoofed")
    task.job_id, task.index, task.attempt = "j", 7, 2
    task.resources.cpu_milli, task.resources.memory_mb = 1500, 256
    result = await asyncio.wait_for(ProcessExecutor().run(task), 5)
    assert result.state == SUCCEEDED
    assert out.read_text().split() == ["j", "p1", "7", "2", "1500", "256"]


async def test_process_failure_carries_exit_code_and_stderr_tail() -> None:
    # 10 KB of noise, then the line that explains the failure: only the tail is kept.
    script = (
        "head -c 10000 /dev/zero | tr '\\0' x >&2; echo >&2; echo 'boom: disk full' >&2; exit 3"
    )
    result = await asyncio.wait_for(ProcessExecutor().run(process_task("sh", "-c", script)), 5)
    assert result.state == FAILED
    assert result.exit_code == 3
    assert result.message.startswith("exit code 3: ")
    assert result.message.endswith("boom: disk full")
    assert 2000 <= len(result.message) <= 2100


async def test_process_timeout_kills_the_whole_process_group(task_tmp: Path) -> None:
    pid_file = task_tmp / "pid"
    # The sleep runs in the background, so killing only the shell would leave it behind.
    task = process_task("sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait", timeout_s=0.3)
    began = time.monotonic()
    result = await asyncio.wait_for(ProcessExecutor(kill_grace_s=1).run(task), 10)
    assert time.monotonic() - began < 3
    assert result.state == FAILED
    assert result.message == "timed out after 0.3 s"
    assert await gone(await read_pid(pid_file))


async def test_process_that_ignores_sigterm_is_killed_after_the_grace_period(
    task_tmp: Path,
) -> None:
    pid_file = task_tmp / "pid"
    script = f"trap '' TERM; echo $$ > {pid_file}; while :; do sleep 0.05; done"
    task = process_task("sh", "-c", script, timeout_s=0.2)
    began = time.monotonic()
    result = await asyncio.wait_for(ProcessExecutor(kill_grace_s=0.3).run(task), 10)
    assert 0.5 <= time.monotonic() - began < 3
    assert result.state == FAILED
    assert result.exit_code == 137  # 128 + SIGKILL
    assert await gone(await read_pid(pid_file))


async def test_leftovers_of_a_finished_process_are_killed(task_tmp: Path) -> None:
    pid_file = task_tmp / "pid"
    task = process_task("sh", "-c", f"sleep 30 > /dev/null 2>&1 & echo $! > {pid_file}")
    result = await asyncio.wait_for(ProcessExecutor().run(task), 5)
    assert result.state == SUCCEEDED
    assert await gone(await read_pid(pid_file))


async def test_missing_binary_fails_cleanly() -> None:
    result = await asyncio.wait_for(
        ProcessExecutor().run(process_task("/no/such/megha-binary", "x")), 5
    )
    assert result.state == FAILED
    assert result.exit_code == 127
    assert "/no/such/megha-binary" in result.message
    assert "not found" in result.message


async def test_process_task_without_args_fails_cleanly() -> None:
    result = await ProcessExecutor().run(process_task())
    assert result.state == FAILED
    assert "no args" in result.message


async def test_cancelling_kills_the_process(task_tmp: Path) -> None:
    pid_file = task_tmp / "pid"
    task = process_task("sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait")
    runner = asyncio.create_task(ProcessExecutor(kill_grace_s=1).run(task))
    pid = await read_pid(pid_file)
    assert alive(pid)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(runner, 5)
    # The cancellation completes only once the work has stopped.
    assert not alive(pid)


async def test_python_process_exit_code_is_reported() -> None:
    task = process_task(task_python(), "-c", "import sys; sys.exit(7)")
    result = await asyncio.wait_for(ProcessExecutor().run(task), 10)
    assert (result.state, result.exit_code, result.message) == (FAILED, 7, "exit code 7")


# ------------------------------------------------------------------------ docker
async def test_docker_engine_unavailable_fails_the_task_cleanly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:1")
    task = common_pb2.Task(
        task_id="d1",
        resources=common_pb2.Resources(cpu_milli=500, memory_mb=64),
        docker=common_pb2.DockerExecutor(image="alpine:3.20", args=["true"]),
    )
    result = await asyncio.wait_for(DockerExecutor().run(task), 30)
    assert result.state == FAILED
    assert result.message.startswith("docker engine unavailable: ")


@needs_docker
async def test_docker_runs_a_container_and_removes_it() -> None:
    import docker

    task = common_pb2.Task(
        task_id="d-real",
        resources=common_pb2.Resources(cpu_milli=500, memory_mb=64),
        docker=common_pb2.DockerExecutor(
            image=local_image(), args=["sh", "-c", "echo no >&2; exit 4"]
        ),
    )
    result = await asyncio.wait_for(DockerExecutor().run(task), 300)
    assert (result.state, result.exit_code) == (FAILED, 4)
    assert result.message.endswith("no")
    left = docker.from_env().containers.list(all=True, filters={"label": "megha.task_id=d-real"})
    assert left == []


@contextlib.asynccontextmanager
async def _killed_docker_host(tmp_path: Path, task_id: str, life: str = ""):
    """A worker host (a process: its ledger, with a janitor of life ``life`` if given)
    that runs one 300 s container and is then killed -9. Yields (engine client, the
    container's filter, the container as it ran); removes it at the end whatever happened."""
    import docker

    janitor = f", Janitor({life!r})" if life else ""
    script = f"""
import asyncio
from services._proto.megha.v1 import common_pb2
from services.worker.executors import DockerExecutor
from services.worker.janitor import Janitor
from services.worker.leftovers import GroupLedger
ledger = GroupLedger({str(tmp_path / "host.groups")!r}{janitor})
ledger.sweep()
image = common_pb2.DockerExecutor(image={local_image()!r}, args=["sleep", "300"])
task = common_pb2.Task(task_id={task_id!r}, docker=image)
asyncio.run(DockerExecutor(ledger=ledger).run(task))
"""
    client = docker.from_env()
    labelled = {"label": f"megha.task_id={task_id}"}
    host = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not (running := client.containers.list(filters=labelled)):
            assert host.poll() is None and time.monotonic() < deadline, "never started"
            await asyncio.sleep(0.1)
        host.kill()
        host.wait(10)
        yield client, labelled, running[0]
    finally:
        host.kill()
        for container in client.containers.list(all=True, filters=labelled):
            container.remove(force=True)
        client.close()


@needs_docker
async def test_a_container_of_a_killed_host_is_removed_by_its_next_start(tmp_path: Path) -> None:
    # A container is the engine's child: a worker host killed -9 leaves it running while
    # the LM queues its task again elsewhere. The host's next start removes it.
    async with _killed_docker_host(tmp_path, f"d-left-{os.getpid()}") as (client, labelled, ran):
        await asyncio.sleep(0.5)
        assert [c.id for c in client.containers.list(filters=labelled)] == [ran.id]
        assert ran.labels["megha.host"] == "host"
        assert GroupLedger(tmp_path / "host.groups").sweep() == 1
        assert client.containers.list(all=True, filters=labelled) == []


@needs_docker
async def test_a_container_of_a_killed_host_is_removed_by_its_janitor(tmp_path: Path) -> None:
    # With a janitor, the container goes as soon as the host dies, not at its next start.
    life = f"life-{os.getpid()}"
    task_id = f"d-janitor-{os.getpid()}"
    async with _killed_docker_host(tmp_path, task_id, life) as (client, labelled, ran):
        killed = time.monotonic()
        assert ran.labels["megha.life"] == life
        while client.containers.list(all=True, filters=labelled):
            assert time.monotonic() - killed < 15, "the janitor did not remove the container"
            await asyncio.sleep(0.05)
        assert GroupLedger(tmp_path / "host.groups").sweep() == 0  # nothing left for it


# ---------------------------------------------------------------------- choosing
def test_executor_for_follows_the_task_then_the_default() -> None:
    executors = {"sim": SimExecutor(), "process": ProcessExecutor()}
    assert executor_for(process_task("true"), "sim", executors) is executors["process"]
    assert executor_for(common_pb2.Task(task_id="x"), "sim", executors) is executors["sim"]
    docker_task = common_pb2.Task(task_id="d", docker=common_pb2.DockerExecutor(image="a"))
    with pytest.raises(ValueError, match="unknown executor 'docker'"):
        executor_for(docker_task, "sim", executors)
    assert executor_for(docker_task, "sim").name == "docker"
