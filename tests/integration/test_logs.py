"""``megha logs``: a task attempt's output, read from its worker host through GM and LM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, shell_task, sim_tasks

ENDED = {common_pb2.TASK_STATE_SUCCEEDED, common_pb2.TASK_STATE_FAILED}


async def _ended(fed: Federation, job_id: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        job = await fed.gm().job(job_id)
        if all(t.state in ENDED for t in job.tasks):
            return
        assert time.monotonic() < deadline, job
        await asyncio.sleep(0.1)


@pytest.mark.slow  # ~20-45 s: run apart by .ci/run (MEGHA_SLOW_TESTS=1)
async def test_megha_logs_reads_each_attempts_stdout_and_stderr(tmp_path, task_tmp):
    marker = task_tmp / "ran-once"
    first_then_second = (
        f"if [ -f {marker} ]; then echo second; exit 0; fi; "
        f"touch {marker}; echo first; echo why >&2; exit 1"
    )
    big = "yes 0123456789abcdef | head -c 3000000"  # three reads of at most 1 MiB
    async with Federation(tmp_path, gms=2, lms=1, workers_per_lm=2) as fed:
        retried = await fed.gm().submit([shell_task(first_then_second, retries=1)])
        chunked = await fed.gm().submit([shell_task(big)])
        several = await fed.gm().submit([shell_task("echo a"), shell_task("echo b")])
        simulated = await fed.gm().submit(sim_tasks(1, 0.05))
        for reply in (retried, chunked, several, simulated):
            await _ended(fed, reply.job_id)

        async def logs(*args: str) -> subprocess.CompletedProcess:
            # Through gm-2: another GM than the one the jobs were submitted to.
            command = [sys.executable, "-m", "services.cli", "logs", "--config"]
            command += [str(fed.config_path), "--gm", fed.config.gm("gm-2").target, *args]
            return await asyncio.to_thread(subprocess.run, command, capture_output=True, timeout=60)

        job = retried.job_id
        latest = await logs(job)  # a job of one task: no task id needed
        assert (latest.returncode, latest.stdout) == (0, b"second\n"), latest.stderr
        first = await logs(job, retried.task_ids[0], "--attempt", "0")
        assert (first.returncode, first.stdout) == (0, b"first\n"), first.stderr
        why = await logs(job, "--attempt", "0", "--stderr")
        assert why.stdout == b"why\n"
        assert (await logs(job, "--tail", "3")).stdout == b"nd\n"

        whole = await logs(chunked.job_id)
        assert whole.returncode == 0, whole.stderr
        assert len(whole.stdout) == 3_000_000
        assert whole.stdout == (b"0123456789abcdef\n" * 176_471)[:3_000_000]

        many = await logs(several.job_id)
        assert many.returncode == 2
        assert f"job {several.job_id} has 2 tasks: name one" in many.stderr.decode()
        named = await logs(several.job_id, several.task_ids[1])
        assert named.stdout == b"b\n"

        none = await logs(simulated.job_id)
        assert none.returncode == 1
        assert b"no stdout of task" in none.stderr
        assert b"a simulated task writes none" in none.stderr
        unknown = await logs(job, "no-such-task")
        assert unknown.returncode == 1
        assert b"NOT_FOUND" in unknown.stderr

        # Each task of a job of identical ones knows which it is, and gets --env.
        megha = [sys.executable, "-m", "services.cli", "submit", "--config", str(fed.config_path)]
        script = 'echo "$MEGHA_TASK_INDEX of $MEGHA_JOB_ID, attempt $MEGHA_ATTEMPT: $GREETING"'
        command = ["--resources", "cpu=500m,mem=128Mi", "--command", "sh", "-c", script]
        submitted = await asyncio.to_thread(
            subprocess.run,
            [*megha, "--count", "3", "--env", "GREETING=hi there", "--wait", *command],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert submitted.returncode == 0, submitted.stderr
        array = submitted.stdout.split()[1].rstrip(":")
        said = [f"{i} of {array}, attempt 0: hi there\n" for i in range(3)]
        for i in range(3):
            assert (await logs(array, f"{array}.{i}")).stdout == said[i].encode()
        every = await logs(array, "--all")  # every task's, one after the other
        assert every.returncode == 0, every.stderr
        assert every.stdout.decode() == "".join(f"==> {array}.{i} <==\n{said[i]}" for i in range(3))
        assert (await logs(array, f"{array}.0", "--all")).returncode == 2
        sim_env = await asyncio.to_thread(
            subprocess.run, [*megha, "--env", "A=b"], capture_output=True, text=True, timeout=60
        )
        assert sim_env.returncode == 2
        assert "--env is for a process (--command) or a container (--image)" in sim_env.stderr

        # A job file: tasks that differ, each with its own command, env and count.
        job_file = tmp_path / "job.yaml"
        job_file.write_text(
            "job_id: from-a-file\n"
            "defaults: {resources: 'cpu=500m,mem=128Mi', env: {WHO: all}}\n"
            "tasks:\n"
            "  - command: echo first $WHO\n"
            "  - command: [sh, -c, 'echo $MEGHA_TASK_INDEX $WHO']\n"
            "    env: {WHO: me}\n"
            "    count: 2\n"
        )
        from_file = await asyncio.to_thread(
            subprocess.run,
            [*megha, "--file", str(job_file), "--wait"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert from_file.returncode == 0, from_file.stderr
        assert from_file.stdout.startswith("job from-a-file: 3 tasks queued (3 process)")
        every = await logs("from-a-file", "--all")
        assert every.stdout.decode() == "".join(
            f"==> from-a-file.{i} <==\n{said}\n"
            for i, said in enumerate(["first all", "1 me", "2 me"])
        )
        # Read from stdin; its mistakes, and task options beside it, are refused first.
        wrong = await asyncio.to_thread(
            subprocess.run,
            [*megha, "-f", "-"],
            input="tasks:\n  - {command: ls, resources: 'cpu=lots'}\n  - {comand: ls}\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert wrong.returncode == 2
        assert wrong.stderr.splitlines() == [
            "megha: stdin: tasks[1].comand: Extra inputs are not permitted",
        ]
        both = await asyncio.to_thread(
            subprocess.run,
            [*megha, "-f", str(job_file), "--count", "2", "--command", "ls"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert both.returncode == 2
        assert "the job file describes the tasks: no --count, --command with it" in both.stderr


@pytest.mark.slow  # ~20-45 s: run apart by .ci/run (MEGHA_SLOW_TESTS=1)
async def test_megha_logs_follow_prints_as_the_task_writes_and_ends_with_it(tmp_path):
    script = "for i in 1 2 3 4 5 6; do echo line $i; sleep 0.4; done"
    # Output held to 1 MiB a stream: the last test below reads past what was dropped.
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=1, worker_output_max_mb=1) as fed:
        logs = [sys.executable, "-m", "services.cli", "logs", "--config", str(fed.config_path)]
        follow = [*logs, "--follow"]
        reply = await fed.gm().submit([shell_task(script)])
        # Started at once: the task may not be on its worker yet, which --follow waits for.
        follower = await asyncio.create_subprocess_exec(
            *follow,
            reply.job_id,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert follower.stdout is not None
        first = await asyncio.wait_for(follower.stdout.readline(), 20)
        assert first == b"line 1\n"
        (task,) = (await fed.gm().job(reply.job_id)).tasks
        # Printed while it ran (the GM may not have heard it run yet: placed, then).
        assert task.state in {common_pb2.TASK_STATE_PLACED, common_pb2.TASK_STATE_RUNNING}
        rest, errors = await asyncio.wait_for(follower.communicate(), 20)
        assert follower.returncode == 0, errors
        assert first + rest == b"".join(f"line {i}\n".encode() for i in range(1, 7))
        await _ended(fed, reply.job_id)  # the worker said it ended; the GM hears it next
        (task,) = (await fed.gm().job(reply.job_id)).tasks
        assert task.state == common_pb2.TASK_STATE_SUCCEEDED

        # A task cancelled while it waited never runs: --follow says so and ends.
        blocker, waiting = shell_task("exec sleep 30"), shell_task("echo never")
        blocker.resources.cpu_milli = waiting.resources.cpu_milli = 4000  # the whole worker
        await fed.gm().submit([blocker])
        queued = await fed.gm().submit([waiting])
        await fed.gm().cancel(queued.job_id)
        never = await asyncio.to_thread(
            subprocess.run,
            [*follow, queued.job_id],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert never.returncode == 1, never.stderr
        assert f"task {queued.task_ids[0]} ended cancelled without running" in never.stderr

        # A task that wrote more than its host keeps: the last MiB or so, and a note.
        chatty = await fed.gm().submit([shell_task("yes 0123456789abcdef | head -c 3000000")])
        await _ended(fed, chatty.job_id)
        held = await asyncio.to_thread(
            subprocess.run, [*logs, chatty.job_id], capture_output=True, timeout=60
        )
        assert held.returncode == 0, held.stderr
        whole = (b"0123456789abcdef\n" * 176_471)[:3_000_000]
        assert 1 << 20 <= len(held.stdout) < (1 << 20) + 4096
        assert whole.endswith(held.stdout)
        dropped = 3_000_000 - len(held.stdout)
        assert f"[{dropped} bytes of stdout not kept here".encode() in held.stderr


async def test_the_attempt_before_is_read_on_the_host_it_ran_on(tmp_path):
    # One 1-CPU worker host per LM: a task lost on one runs again on the other.
    groups = [
        {"lm": "lm-1", "count": 1, "capacity": "cpu=1,mem=1Gi", "name_prefix": "one-"},
        {"lm": "lm-2", "count": 1, "capacity": "cpu=1,mem=1Gi", "name_prefix": "two-"},
    ]
    task = shell_task('echo "attempt $MEGHA_ATTEMPT"; exec sleep 30')
    task.resources.cpu_milli = 1000
    async with Federation(tmp_path, gms=1, lms=2, worker_groups=groups) as fed:
        reply = await fed.gm().submit([task])

        async def running(attempt: int) -> common_pb2.TaskEvent:
            deadline = time.monotonic() + 20
            while True:
                for event in fed.events.events:
                    if event.state == common_pb2.TASK_STATE_RUNNING and event.attempt == attempt:
                        return event
                assert time.monotonic() < deadline, f"attempt {attempt} never ran"
                await asyncio.sleep(0.05)

        first = await running(0)
        host = f"workers-{first.lm_id}"
        fed.children.kill(host, signal.SIGTERM)  # a graceful stop: its task is LOST
        second = await running(1)
        assert second.lm_id != first.lm_id
        fed.children.restart(host)  # back with the same nodes and its output files

        megha = [sys.executable, "-m", "services.cli", "logs", "--config", str(fed.config_path)]

        async def logs(*args: str) -> subprocess.CompletedProcess:
            return await asyncio.to_thread(
                subprocess.run, [*megha, reply.job_id, *args], capture_output=True, timeout=60
            )

        deadline = time.monotonic() + 20
        while (latest := await logs()).stdout != b"attempt 1\n":  # echoed as it started
            assert time.monotonic() < deadline, latest
            await asyncio.sleep(0.2)
        while (before := await logs("--attempt", "0")).returncode != 0:  # until it is back
            assert time.monotonic() < deadline, before.stderr
            await asyncio.sleep(0.2)
        assert before.stdout == b"attempt 0\n"
