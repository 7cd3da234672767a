"""A worker host's task output files (``outputs.py``) and the executors writing them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services._proto.megha.v1 import common_pb2
from services.worker.executors import DockerExecutor, ProcessExecutor
from services.worker.outputs import READ_LIMIT, TaskOutputs
from tests.docker_engine import local_image, needs_docker


def _write(outputs: TaskOutputs, task_id: str, attempt: int, stream: str, data: bytes) -> None:
    fd = outputs.open(task_id, attempt, stream)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def test_a_read_returns_the_part_asked_for_and_the_size(tmp_path: Path) -> None:
    outputs = TaskOutputs(tmp_path)
    _write(outputs, "t1", 0, "out", b"0123456789")
    whole = outputs.read("t1", 0, "out")
    assert (whole.data, whole.offset, whole.size) == (b"0123456789", 0, 10)
    middle = outputs.read("t1", 0, "out", offset=3, limit=4)
    assert (middle.data, middle.offset, middle.size) == (b"3456", 3, 10)
    tail = outputs.read("t1", 0, "out", offset=-3)
    assert (tail.data, tail.offset) == (b"789", 7)
    assert outputs.read("t1", 0, "out", offset=-30).data == b"0123456789"
    assert outputs.read("t1", 0, "out", offset=30).data == b""
    assert outputs.read("t1", 0, "err") is None  # never opened
    assert outputs.read("t1", 1, "out") is None  # another attempt
    assert outputs.read("t2", 0, "out") is None
    with pytest.raises(ValueError, match="stream must be one of out, err"):
        outputs.read("t1", 0, "in")


def test_one_read_returns_at_most_a_mebibyte(tmp_path: Path) -> None:
    outputs = TaskOutputs(tmp_path)
    _write(outputs, "big", 0, "out", b"x" * (READ_LIMIT + 10))
    assert len(outputs.read("big", 0, "out", limit=10 * READ_LIMIT).data) == READ_LIMIT


def test_only_the_newest_attempts_are_kept_also_across_lives(tmp_path: Path) -> None:
    outputs = TaskOutputs(tmp_path, keep=3)
    for i in range(5):
        _write(outputs, f"t{i}", 0, "out", b"o")
        _write(outputs, f"t{i}", 0, "err", b"e")
    assert [outputs.read(f"t{i}", 0, "out") is not None for i in range(5)] == [
        False, False, True, True, True,
    ]  # fmt: skip
    assert len(list(tmp_path.iterdir())) == 6  # both streams of the three kept
    # The host's next life counts the files it finds, oldest first.
    os.utime(tmp_path / "t2.0.out", (1, 1))
    os.utime(tmp_path / "t2.0.err", (1, 1))
    again = TaskOutputs(tmp_path, keep=2)
    assert again.read("t2", 0, "out") is None
    assert again.read("t3", 0, "out") is not None and again.read("t4", 0, "out") is not None
    with pytest.raises(ValueError, match="keep must be at least 1"):
        TaskOutputs(tmp_path, keep=0)


@given(st.text(min_size=1, max_size=40))
def test_no_task_id_reaches_outside_the_directory(task_id: str) -> None:
    outputs = TaskOutputs.__new__(TaskOutputs)  # no directory needed to name a path
    outputs.directory = Path("/srv/out")
    path = outputs.path(task_id, 0, "out")
    assert path.parent == Path("/srv/out")
    assert path.name not in (".", "..")


async def test_a_process_tasks_stdout_and_stderr_go_to_its_attempts_files(tmp_path: Path):
    outputs = TaskOutputs(tmp_path)
    task = common_pb2.Task(
        task_id="p/1",
        attempt=2,
        process=common_pb2.ProcessExecutor(
            args=["sh", "-c", "echo hello; echo oops >&2; echo world; exit 3"]
        ),
    )
    result = await asyncio.wait_for(ProcessExecutor(outputs=outputs).run(task), 5)
    assert result.message == "exit code 3: oops"  # the stderr tail is still in the message
    assert outputs.read("p/1", 2, "out").data == b"hello\nworld\n"
    assert outputs.read("p/1", 2, "err").data == b"oops\n"
    # A task that cannot start leaves empty files, not open descriptors.
    missing = common_pb2.Task(task_id="m", process=common_pb2.ProcessExecutor(args=["/no/such"]))
    before = len(os.listdir("/proc/self/fd"))
    await ProcessExecutor(outputs=outputs).run(missing)
    assert len(os.listdir("/proc/self/fd")) == before


@needs_docker
async def test_a_containers_logs_go_to_its_attempts_files_as_they_come(tmp_path: Path):
    outputs = TaskOutputs(tmp_path)
    script = "echo out $MEGHA_TASK_ID; echo err >&2; sleep 3; echo later"
    task = common_pb2.Task(
        task_id="d-logs",
        resources=common_pb2.Resources(cpu_milli=500, memory_mb=64),
        docker=common_pb2.DockerExecutor(image=local_image(), args=["sh", "-c", script]),
    )
    executor = DockerExecutor(outputs=outputs)
    try:
        running = asyncio.create_task(executor.run(task))
        deadline = asyncio.get_running_loop().time() + 120  # the engine may be slow to start
        while (early := outputs.read("d-logs", 0, "out")) is None or not early.data:
            assert asyncio.get_running_loop().time() < deadline, "no output while it ran"
            await asyncio.sleep(0.1)
        assert early.data == b"out d-logs\n"  # its environment too
        assert not running.done()  # read while the container ran
        result = await asyncio.wait_for(running, 300)
    finally:
        executor.close()
    assert result.exit_code == 0
    assert outputs.read("d-logs", 0, "out").data == b"out d-logs\nlater\n"
    assert outputs.read("d-logs", 0, "err").data == b"err\n"


async def test_a_task_whose_output_cannot_be_kept_runs_all_the_same(tmp_path: Path, caplog):
    outputs = TaskOutputs(tmp_path / "gone")
    (tmp_path / "gone").rmdir()  # e.g. deleted under the host's feet
    task = common_pb2.Task(task_id="t", process=common_pb2.ProcessExecutor(args=["true"]))
    before = len(os.listdir("/proc/self/fd"))
    result = await asyncio.wait_for(ProcessExecutor(outputs=outputs).run(task), 5)
    assert result.exit_code == 0
    assert "cannot keep a task's output" in caplog.text
    assert len(os.listdir("/proc/self/fd")) == before
