"""A worker host's task output files (``outputs.py``) and the executors writing them."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services._proto.megha.v1 import common_pb2
from services.worker import outputs as outputs_module
from services.worker.executors import DockerExecutor, ProcessExecutor
from services.worker.outputs import READ_LIMIT, TaskOutputs
from tests.docker_engine import local_image, needs_docker


def _write(outputs: TaskOutputs, task_id: str, attempt: int, stream: str, data: bytes) -> None:
    fd = outputs.open(task_id, attempt, stream)
    try:
        os.write(fd, data)
    finally:
        outputs.close(fd)


def _on_disk(path: Path) -> int:
    return os.stat(path).st_blocks * 512


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


MIB = 1 << 20


def test_a_capped_stream_keeps_its_last_bytes_and_frees_the_rest(tmp_path: Path) -> None:
    outputs = TaskOutputs(tmp_path, max_bytes=MIB, check_s=3600)  # held at close only
    data = os.urandom(5 * MIB + 123)
    _write(outputs, "t", 0, "out", data)
    path = outputs.path("t", 0, "out")
    assert os.stat(path).st_size == len(data)  # offsets stay where they were
    assert _on_disk(path) <= MIB + 2 * 4096
    start = outputs.read("t", 0, "out")
    block = os.stat(path).st_blksize
    assert start.dropped % block == 0 and MIB <= len(data) - start.dropped < MIB + block
    assert (start.offset, start.size) == (start.dropped, len(data))
    assert start.data == data[start.dropped :][:READ_LIMIT]  # from the first kept byte
    rest = outputs.read("t", 0, "out", offset=start.offset + len(start.data))
    assert start.data + rest.data == data[start.dropped :]
    assert outputs.read("t", 0, "out", offset=-100).data == data[-100:]
    assert outputs.read("t", 0, "out", offset=-(10 * MIB)).offset == start.dropped
    assert outputs.read("t", 0, "out", offset=len(data) - 5).data == data[-5:]
    # The next life of the host finds where the kept part begins in the file itself.
    assert TaskOutputs(tmp_path).read("t", 0, "out") == start
    # Short output is not touched.
    _write(outputs, "short", 0, "out", b"hello")
    assert outputs.read("short", 0, "out").data == b"hello"
    with pytest.raises(ValueError, match="max_bytes and max_total must be 0"):
        TaskOutputs(tmp_path, max_bytes=-1)


def test_a_filesystem_without_holes_keeps_output_whole_and_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(outputs_module, "_punch_hole", unsupported)
    outputs = TaskOutputs(tmp_path, max_bytes=4096, check_s=3600)
    for task_id in ("a", "b"):
        _write(outputs, task_id, 0, "out", b"x" * 20_000)
        assert outputs.read(task_id, 0, "out").data == b"x" * 20_000
    assert caplog.text.count("cannot drop the start of a file") == 1


def test_the_oldest_attempts_go_once_the_host_keeps_more_than_max_total(tmp_path: Path):
    kib = 1024
    outputs = TaskOutputs(tmp_path, max_total=350 * kib)
    long_running = outputs.open("long", 0, "out")  # the oldest, and still written
    os.write(long_running, b"l" * 400 * kib)  # not counted until it ends
    for i in range(5):
        _write(outputs, f"t{i}", 0, "out", b"o" * 100 * kib)
        _write(outputs, f"t{i}", 0, "err", b"")
    assert [outputs.read(f"t{i}", 0, "out") is not None for i in range(5)] == [
        False, False, True, True, True,
    ]  # fmt: skip
    assert outputs.total == 300 * kib
    assert outputs.read("long", 0, "out").size == 400 * kib  # never deleted while written
    outputs.close(long_running)  # now it counts, and is the oldest
    assert outputs.read("long", 0, "out") is None
    assert outputs.total == 300 * kib
    # The next life counts what it finds: 300 KiB, within a budget of 250 KiB once
    # the oldest kept attempt is gone (by the time they were written: the clock that
    # stamps files may not tell apart three written in a row).
    for age, i in enumerate((2, 3, 4)):
        for stream in ("out", "err"):
            os.utime(outputs.path(f"t{i}", 0, stream), (age + 1, age + 1))
    again = TaskOutputs(tmp_path, max_total=250 * kib)
    assert again.total == 200 * kib and again.read("t2", 0, "out") is None
    # An attempt that runs again (the same file) counts only its new size.
    _write(again, "t3", 0, "out", b"x")
    assert again.total == 100 * kib + 4096


def test_an_open_file_is_held_to_the_cap_while_it_is_written(tmp_path: Path) -> None:
    outputs = TaskOutputs(tmp_path, max_bytes=MIB, check_s=0.02)
    path = outputs.path("live", 0, "out")
    fd = outputs.open("live", 0, "out")
    try:
        for _ in range(24):  # 6 MiB in all
            os.write(fd, b"x" * (MIB // 4))
            time.sleep(0.03)
        deadline = time.monotonic() + 5
        while _on_disk(path) > MIB + 8192:
            assert time.monotonic() < deadline, f"{_on_disk(path)} bytes on disk"
            time.sleep(0.02)
        while_open = outputs.read("live", 0, "out", offset=-10)
        assert (while_open.data, while_open.size) == (b"x" * 10, 6 * MIB)
    finally:
        outputs.close(fd)
        outputs.stop()
    assert outputs.read("live", 0, "out").offset >= 5 * MIB - 4096


@settings(max_examples=60, deadline=None)
@given(
    writes=st.lists(st.integers(0, 40_000), min_size=1, max_size=12),
    cap=st.integers(1, 30_000),
    holds=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_what_is_kept_is_always_the_streams_last_bytes(
    tmp_path_factory: pytest.TempPathFactory, writes: list[int], cap: int, holds: list[bool]
) -> None:
    directory = tmp_path_factory.mktemp("held")
    outputs = TaskOutputs(directory, max_bytes=cap, check_s=3600)
    data = os.urandom(sum(writes))
    fd = outputs.open("p", 0, "err")
    written = 0
    for size, hold in zip(writes, holds, strict=False):
        os.write(fd, data[written : written + size])
        written += size
        if hold:
            outputs.hold()
        kept = outputs.read("p", 0, "err", limit=READ_LIMIT)
        assert kept.data == data[kept.offset : written]  # never a hole in what is kept
    outputs.close(fd)
    kept = outputs.read("p", 0, "err")
    block = os.stat(directory).st_blksize or 4096
    assert kept.data == data[kept.dropped :] and kept.offset == kept.dropped
    assert kept.dropped % block == 0
    assert min(cap, len(data)) <= len(data) - kept.dropped < cap + block


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


async def test_a_process_tasks_output_is_held_to_the_cap_while_it_runs(
    tmp_path: Path, task_tmp: Path
):
    outputs = TaskOutputs(tmp_path, max_bytes=MIB, check_s=0.05)
    script = (
        "head -c 4000000 /dev/zero | tr '\\0' o; head -c 3000000 /dev/zero | tr '\\0' e >&2;"
        f" touch {task_tmp / 'written'}; sleep 2; echo END; echo BYE >&2"
    )
    task = common_pb2.Task(
        task_id="chatty", process=common_pb2.ProcessExecutor(args=["sh", "-c", script])
    )
    out, err = outputs.path("chatty", 0, "out"), outputs.path("chatty", 0, "err")
    running = asyncio.create_task(ProcessExecutor(outputs=outputs).run(task))
    try:
        deadline = time.monotonic() + 10
        while not (task_tmp / "written").exists() or max(_on_disk(out), _on_disk(err)) > MIB + 8192:
            assert time.monotonic() < deadline and not running.done()
            await asyncio.sleep(0.05)
        assert not running.done()  # held while the task still ran
        assert (await asyncio.wait_for(running, 10)).exit_code == 0
    finally:
        running.cancel()
        outputs.stop()
    assert _on_disk(out) <= MIB + 8192 and _on_disk(err) <= MIB + 8192
    stdout, stderr = outputs.read("chatty", 0, "out", -5), outputs.read("chatty", 0, "err", -5)
    assert (stdout.data, stdout.size) == (b"oEND\n", 4_000_004)
    assert (stderr.data, stderr.size) == (b"eBYE\n", 3_000_004)
    assert stdout.dropped >= 4_000_004 - MIB - 4096 and stderr.dropped >= 3_000_004 - MIB - 4096


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


def test_a_read_racing_the_checker_never_returns_the_holes_zeros(tmp_path: Path) -> None:
    outputs = TaskOutputs(tmp_path, max_bytes=256 * 1024, check_s=0.0002)
    fd = outputs.open("race", 0, "out")
    line = b"0123456789abcdef" * 256  # 4 KiB without a zero byte
    stop = threading.Event()

    def write() -> None:
        while not stop.is_set():
            os.write(fd, line * 16)

    writer = threading.Thread(target=write)
    writer.start()
    deadline = time.monotonic() + 2
    reads = 0
    try:
        while time.monotonic() < deadline:
            chunk = outputs.read("race", 0, "out", limit=READ_LIMIT)
            assert b"\0" not in chunk.data, f"zeros at {chunk.offset + chunk.data.index(0)}"
            reads += 1
    finally:
        stop.set()
        writer.join()
        outputs.close(fd)
        outputs.stop()
    assert reads > 100
