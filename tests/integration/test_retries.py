"""Task.max_retries on a real federation: a failed attempt is queued again, up to a
bound; lost, preempted and cancelled attempts are not failures."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from services._proto.megha.v1 import common_pb2
from tests.integration.harness import Federation, shell_task
from tests.task_user import task_python

FAILED = common_pb2.TASK_STATE_FAILED
RETRYING = common_pb2.TASK_STATE_RETRYING
SUCCEEDED = common_pb2.TASK_STATE_SUCCEEDED


async def test_failed_attempts_are_retried_up_to_the_bound_and_only_they(tmp_path, task_tmp):
    marker = task_tmp / "tried-once"
    tasks = [
        shell_task("echo broken >&2; exit 3", retries=2),  # fails every time
        shell_task(f"test -f {marker} && exit 0; touch {marker}; exit 1", retries=1),
        shell_task("exit 4", retries=0),  # no retry: fails at once, as before
        # Over its 128 MiB (the host looks every second, by default): its own failure.
        shell_task(
            f"{task_python()} -c 'import time; x = bytearray(300 << 20); time.sleep(30)'",
            retries=1,
        ),
    ]
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2) as fed:
        reply = await fed.gm().submit(tasks)
        always, once, never, hog = reply.task_ids
        job_id = reply.job_id
        deadline = time.monotonic() + 30
        while True:
            job = await fed.gm().job(job_id)
            final = {t.task_id: t for t in job.tasks}
            if {t.state for t in final.values()} <= {FAILED, SUCCEEDED}:
                break
            assert time.monotonic() < deadline, job
            await asyncio.sleep(0.1)

        def events(task_id: str) -> list[tuple[int, int]]:
            ends = (RETRYING, FAILED, SUCCEEDED)
            return [
                (e.state, e.attempt)
                for e in fed.events.events
                if e.task_id == task_id and e.state in ends
            ]

        await asyncio.sleep(0.5)  # the last events reach the test's subscription too
        assert events(always) == [(RETRYING, 0), (RETRYING, 1), (FAILED, 2)]
        assert (final[always].state, final[always].attempt) == (FAILED, 2)
        retried = [e for e in fed.events.events if e.task_id == always and e.state == RETRYING]
        assert all("exit code 3: broken" in e.reason for e in retried)
        assert events(once) == [(RETRYING, 0), (SUCCEEDED, 1)]
        assert events(never) == [(FAILED, 0)]
        assert events(hog) == [(RETRYING, 0), (FAILED, 1)]
        assert "more than the 128 MiB it asked for" in final[hog].previous_end.reason
        # How much it took, as seen: in each attempt's end, and in the GM's books.
        assert 128 < final[hog].peak_memory_mb < 400
        assert 128 < final[hog].previous_end.peak_memory_mb < 400
        hog_ends = [
            e for e in fed.events.events if e.task_id == hog and e.state in (RETRYING, FAILED)
        ]
        assert all(128 < e.peak_memory_mb < 400 for e in hog_ends)

        # The CLI's --retries sets the bound.
        cli = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "services.cli",
                "submit",
                "--config",
                str(fed.config_path),
                "--retries",
                "1",
                "--wait",
                "--command",
                "sh",
                "-c",
                "exit 5",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 1, cli.stderr  # it failed in the end
        job_id = cli.stdout.split()[1].rstrip(":")
        await asyncio.sleep(0.5)
        (task_id,) = {e.task_id for e in fed.events.events if e.job_id == job_id}
        assert events(task_id) == [(RETRYING, 0), (FAILED, 1)]


def test_a_bound_over_100_is_refused():
    from services.common.convert import InvalidTask, parse_task

    task = shell_task("true", retries=101)
    task.task_id = "t"
    try:
        parse_task(task, 8)
    except InvalidTask as err:
        assert "max_retries is 101; at most 100" in str(err)
    else:
        raise AssertionError("accepted")


async def test_a_watch_begun_after_a_retry_still_shows_why_the_attempt_before_failed(
    tmp_path, task_tmp
):
    marker = task_tmp / "failed-once"
    script = f"test -f {marker} && exec sleep 3; touch {marker}; echo broken >&2; exit 1"
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=1) as fed:
        reply = await fed.gm().submit([shell_task(script, retries=1)])
        deadline = time.monotonic() + 20
        while True:  # the second attempt runs: the first one's failure is past
            (task,) = (await fed.gm().job(reply.job_id)).tasks
            if (task.state, task.attempt) == (common_pb2.TASK_STATE_RUNNING, 1):
                break
            assert time.monotonic() < deadline, task
            await asyncio.sleep(0.05)
        cli = [sys.executable, "-m", "services.cli", "job", "--config", str(fed.config_path)]
        watch = await asyncio.to_thread(
            subprocess.run,
            [*cli, "--watch", reply.job_id],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert watch.returncode == 0, watch.stderr
        lines = [line.split(None, 2)[1:] for line in watch.stdout.splitlines()]
        assert lines[0][0] == "retrying" and "(exit code 1: broken)" in lines[0][1], watch.stdout
        # Then the second attempt: running (unless the watch began late), then succeeded.
        assert [state for state, *_ in lines[1:]] in (["running", "succeeded"], ["succeeded"])
        # megha job tells the same of the task's latest attempt.
        shown = await asyncio.to_thread(
            subprocess.run, [*cli, reply.job_id], capture_output=True, text=True, timeout=60
        )
        assert "[attempt 1, after attempt 0 retrying (exit code 1: broken)]" in shown.stdout
