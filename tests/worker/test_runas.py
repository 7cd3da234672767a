"""Tasks do not run as root (``runas.py``): process tasks through the real executor,
containers by the options they are started with."""

from __future__ import annotations

import asyncio
import os
import pwd
from pathlib import Path

import pytest

from services._proto.megha.v1 import common_pb2
from services.common.config import ConfigError, parse_config
from services.worker import executors, runas
from services.worker.executors import DockerExecutor, ProcessExecutor, container_options
from services.worker.host import WorkerHost
from services.worker.outputs import TaskOutputs
from services.worker.runas import RunAs, RunAsError
from tests.docker_engine import local_image, needs_docker

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only a root worker switches users")

# Who the task is, where it is, what it may write, which limits it has.
WHOAMI = (
    'id -u; id -g; id -G; pwd; echo "$HOME $TMPDIR $USER"; '
    'touch "$HOME/home" "$TMPDIR/tmp" ./cwd && echo wrote; '
    "grep -E '^Max (core file size|processes)' /proc/self/limits; "
    "grep -E '^(Uid|Gid|CapEff):' /proc/self/status"
)


async def run(executor: ProcessExecutor, script: str, outputs: TaskOutputs) -> list[str]:
    task = common_pb2.Task(
        task_id="who", process=common_pb2.ProcessExecutor(args=["sh", "-c", script])
    )
    result = await asyncio.wait_for(executor.run(task), 10)
    assert result.exit_code == 0, result.message
    chunk = outputs.read("who", 0, "out")
    assert chunk is not None
    return chunk.data.decode().splitlines()


# ----------------------------------------------------------------------- process
async def test_a_process_task_never_runs_as_root_by_default(tmp_path: Path) -> None:
    outputs = TaskOutputs(tmp_path)
    uid, gid, groups, cwd, env, wrote, *limits, uids, gids, caps = await run(
        ProcessExecutor(outputs=outputs), WHOAMI, outputs
    )
    assert int(uid) != 0 and int(gid) != 0 and "0" not in groups.split()
    assert "0" not in uids.split()[1:] + gids.split()[1:]  # real, effective, saved, fs
    if os.geteuid() == 0:  # a root worker runs its tasks as nobody, in a directory of theirs
        assert (uid, gid, groups) == ("65534", "65534", "65534")
        assert uids.split()[1:] == ["65534"] * 4 and gids.split()[1:] == ["65534"] * 4
        assert caps.split() == ["CapEff:", "0000000000000000"]
        assert env == f"{cwd} {cwd} nobody"
        assert wrote == "wrote"
        assert not Path(cwd).exists()  # deleted when the task ended
        core, processes = (line.split() for line in limits)
        assert core[-3:-1] == ["0", "0"]
        assert processes[-3:-1] == [str(runas.MAX_PROCESSES)] * 2
    else:  # any other worker cannot switch: its tasks run as itself
        assert (int(uid), int(gid)) == (os.geteuid(), os.getegid())


@as_root
@pytest.mark.parametrize("switch", ["setpriv", "subprocess"])
async def test_a_process_task_runs_as_the_configured_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, switch: str
) -> None:
    if switch == "subprocess":  # a host without setpriv: the standard library switches
        monkeypatch.setattr(executors, "_die_with_worker", lambda: ())
        monkeypatch.setattr(executors, "switch_prefix", lambda user: ())
    outputs = TaskOutputs(tmp_path)
    run_as = RunAs.resolve("4242:4243", max_processes=300)
    uid, gid, groups, cwd, env, wrote, core, processes, uids, gids, caps = await run(
        ProcessExecutor(outputs=outputs, run_as=run_as), WHOAMI, outputs
    )
    assert (uid, gid, groups) == ("4242", "4243", "4243")  # root's groups dropped
    assert uids.split()[1:] == ["4242"] * 4 and gids.split()[1:] == ["4243"] * 4
    assert caps.split() == ["CapEff:", "0000000000000000"]
    assert env.split()[:2] == [cwd, cwd]
    assert wrote == "wrote"
    assert processes.split()[-3:-1] == ["300", "300"]
    assert core.split()[-3:-1] == ["0", "0"]
    # Its output still reached the host's files, which the task itself cannot read.
    assert (os.stat(outputs.path("who", 0, "out")).st_mode & 0o077) == 0


@as_root
async def test_a_named_user_runs_with_its_own_groups(tmp_path: Path) -> None:
    outputs = TaskOutputs(tmp_path)
    nobody = pwd.getpwnam("nobody")
    uid, gid, groups, *_ = await run(
        ProcessExecutor(outputs=outputs, run_as=RunAs.resolve("nobody")), WHOAMI, outputs
    )
    assert (int(uid), int(gid)) == (nobody.pw_uid, nobody.pw_gid)
    assert {int(g) for g in groups.split()} == set(os.getgrouplist(nobody.pw_name, nobody.pw_gid))


@as_root
async def test_a_program_closed_to_the_tasks_user_says_so(tmp_path: Path) -> None:
    program = tmp_path / "private.sh"  # tmp_path is root's, mode 0700
    program.write_text("#!/bin/sh\ntrue\n")
    program.chmod(0o755)
    task = common_pb2.Task(task_id="p", process=common_pb2.ProcessExecutor(args=[str(program)]))
    result = await asyncio.wait_for(ProcessExecutor().run(task), 10)
    assert result.exit_code == 126
    assert result.message == f"cannot run {str(program)!r} as nobody: permission denied"


@as_root
def test_working_directories_only_where_the_task_reaches_them_and_no_one_else_can_swap_them(
    tmp_path: Path, task_tmp: Path
) -> None:
    user = RunAs.resolve().process
    with pytest.raises(RunAsError, match=r"pytest-of-root is closed to them"):
        runas.TaskDirs(tmp_path / "tasks", user)  # tmp_path's parents are root's, 0700
    planted = task_tmp / "planted"  # task_tmp is writable by all (no sticky bit)
    with pytest.raises(RunAsError, match="writable by others"):
        runas.TaskDirs(planted / "tasks", user)
    os.chmod(task_tmp, 0o1777)
    planted.mkdir()
    os.chown(planted, 4242, 4242)  # made first by another user
    with pytest.raises(RunAsError, match="another user's"):
        runas.TaskDirs(planted / "tasks", user)
    dirs = runas.TaskDirs(task_tmp / "mine" / "tasks", user)
    made = dirs.make("a/b", 3)
    assert made.name.startswith("a%2Fb.3.") and made.parent == dirs.base
    assert (made.stat().st_uid, made.stat().st_mode & 0o777) == (user.uid, 0o700)
    assert dirs.base.stat().st_mode & 0o777 == 0o711
    dirs.sweep()
    assert list(dirs.base.iterdir()) == []


# -------------------------------------------------------------------------- root
@pytest.mark.parametrize("run_as", ["root", "0", "00", "0:0", "4242:0"])
def test_root_is_refused_unless_allowed(run_as: str) -> None:
    with pytest.raises(RunAsError, match="set worker_allow_root_tasks: true"):
        RunAs.resolve(run_as)
    with pytest.raises(ConfigError, match="worker_allow_root_tasks"):
        federation(worker_run_as=run_as)
    allowed = RunAs.resolve(run_as, allow_root=True).process
    assert 0 in (allowed.uid, allowed.gid)
    assert federation(worker_run_as=run_as, worker_allow_root_tasks=True).worker_run_as == run_as


def test_a_user_this_host_does_not_have_is_refused_when_the_worker_starts() -> None:
    cfg = federation(worker_run_as="megha-no-such-user")
    with pytest.raises(ConfigError, match="'megha-no-such-user': no such user on this host"):
        WorkerHost(cfg, cfg.workers[0])
    with pytest.raises(ConfigError, match="a user name or uid"):
        federation(worker_run_as="two words")


def test_a_worker_that_is_not_root_runs_tasks_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runas.os, "geteuid", lambda: 4242)
    monkeypatch.setattr(runas.os, "getegid", lambda: 4243)
    own = RunAs.resolve()
    assert (own.process.uid, own.process.gid, own.process.switch) == (4242, 4243, False)
    assert own.container == "65534:65534"  # the engine switches for it
    assert RunAs.resolve("4242").process.switch is False
    with pytest.raises(RunAsError, match="only root can start tasks as another user"):
        RunAs.resolve("nobody")


# ------------------------------------------------------------------------ docker
def docker_task(**env: str) -> common_pb2.Task:
    return common_pb2.Task(
        task_id="d1",
        resources=common_pb2.Resources(cpu_milli=500, memory_mb=64),
        docker=common_pb2.DockerExecutor(image="alpine:3.20", args=["true"], env=env),
    )


def test_a_container_runs_unprivileged_read_only_and_limited() -> None:
    options = container_options(docker_task(), RunAs.resolve())
    assert options["user"] == "65534:65534"
    assert options["read_only"] is True
    assert list(options["tmpfs"]) == ["/tmp"]
    assert options["cap_drop"] == ["ALL"]
    assert options["security_opt"] == ["no-new-privileges"]
    assert options["pids_limit"] == runas.MAX_PROCESSES
    assert (options["nano_cpus"], options["mem_limit"]) == (500_000_000, "64m")
    assert options["environment"]["HOME"] == "/tmp"
    assert options["environment"]["MEGHA_TASK_ID"] == "d1"
    assert (options["command"], options["labels"]) == (["true"], {"megha.task_id": "d1"})


def test_a_container_runs_as_the_configured_user_by_its_numeric_ids() -> None:
    nobody = pwd.getpwnam("nobody")
    named = container_options(docker_task(HOME="/work"), RunAs.resolve("nobody", max_processes=0))
    assert named["user"] == f"{nobody.pw_uid}:{nobody.pw_gid}"  # the image may lack the name
    assert "pids_limit" not in named
    assert named["environment"]["HOME"] == "/work"  # the task's own word wins
    if os.geteuid() == 0:
        assert container_options(docker_task(), RunAs.resolve("4242:4243"))["user"] == "4242:4243"


@needs_docker
async def test_a_container_cannot_write_its_root_nor_gain_privileges(tmp_path: Path) -> None:
    outputs = TaskOutputs(tmp_path)
    script = (
        "id -u; touch /x 2>/dev/null && echo root-writable; touch /tmp/y && echo tmp-ok; "
        "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status"
    )
    task = common_pb2.Task(
        task_id="d-confined",
        resources=common_pb2.Resources(cpu_milli=500, memory_mb=64),
        docker=common_pb2.DockerExecutor(image=local_image(), args=["sh", "-c", script]),
    )
    executor = DockerExecutor(outputs=outputs)
    try:
        result = await asyncio.wait_for(executor.run(task), 300)
    finally:
        executor.close()
    assert result.exit_code == 0, result.message
    lines = outputs.read("d-confined", 0, "out").data.decode().split()
    assert lines == ["65534", "tmp-ok", "CapEff:", "0000000000000000", "NoNewPrivs:", "1"]


def federation(**settings: object):
    return parse_config(
        {
            "gms": [{"id": "gm-1", "port": 1}],
            "lms": [{"id": "lm-1", "port": 2}],
            "workers": [{"lm": "lm-1", "count": 1}],
            **settings,
        },
        env={},
    )
