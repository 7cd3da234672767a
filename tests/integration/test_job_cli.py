"""``megha job`` against a real (embedded) GM: a big job reads as a summary first."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest

from services._proto.megha.v1 import common_pb2
from services.app.operator import JOB_ROWS, _follow, _job, _jobs
from tests.integration.harness import embedded_federation, sim_tasks

pytestmark = pytest.mark.integration


async def test_a_big_job_lists_its_unfinished_tasks_first_and_says_what_it_left_out(capsys):
    async with embedded_federation("job-cli") as (_config, _gm, _bus, client):
        # The short tasks end at once; then 8 long ones fill the two 4-CPU workers.
        tasks = sim_tasks(JOB_ROWS + 2, 0.01) + sim_tasks(8, 60.0)
        await client.submit(tasks, job_id="big")
        total = len(tasks)
        args = argparse.Namespace(job_id="big", watch=False, all=False)
        summary = f"job big (queue default): {total} tasks: {total - 8} succeeded, 8 running"
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            capsys.readouterr()
            assert await _job(client, args) == 0
            lines = capsys.readouterr().out.splitlines()
            if lines[0] == summary:
                break
            assert asyncio.get_running_loop().time() < deadline, lines[0]
            await asyncio.sleep(0.1)
        assert len(lines) == 1 + JOB_ROWS + 1
        assert {line.split()[1] for line in lines[1:9]} == {"running"}
        assert lines[-1] == f"  ... {total - JOB_ROWS} more (--all lists every task)"
        args.all = True
        await _job(client, args)
        assert len(capsys.readouterr().out.splitlines()) == 1 + total


async def test_following_a_big_job_prints_what_went_wrong_and_its_counts(capsys):
    async with embedded_federation("job-follow") as (_config, _gm, _bus, client):
        failing = common_pb2.Task(process=common_pb2.ProcessExecutor(args=["false"]))
        failing.resources.cpu_milli, failing.resources.memory_mb = 1000, 256
        reply = await client.submit([*sim_tasks(JOB_ROWS + 5, 0.01), failing], job_id="big")
        capsys.readouterr()
        assert await _follow(client, "big", reply.task_ids) == 1
        out = capsys.readouterr().out.splitlines()
        # One line for the failure, not four for each of the 56 tasks; then the counts.
        assert len(out) == 2, out
        assert out[0].split()[:2] == [reply.task_ids[-1], "failed"]
        assert out[0].endswith("(exit code 1)")
        assert out[1] == f"job big: {JOB_ROWS + 6} tasks: {JOB_ROWS + 5} succeeded, 1 failed"
        # A small job is still followed event by event.
        small = await client.submit(sim_tasks(2, 0.01), job_id="small")
        assert await _follow(client, "small", small.task_ids) == 0
        assert capsys.readouterr().out.count(" succeeded ") == 2


async def test_jobs_lists_the_newest_first_with_their_counts_and_filters(capsys):
    async with embedded_federation("jobs-cli") as (_config, _gm, _bus, client):
        done = await client.submit(sim_tasks(3, 0.01), job_id="quick")
        await _follow(client, done.job_id, done.task_ids)  # all three succeeded
        await client.submit(sim_tasks(2, 60.0), job_id="long")
        args = argparse.Namespace(queue="", limit=20, unfinished=False)
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            capsys.readouterr()
            assert await _jobs(client, args) == 0
            lines = capsys.readouterr().out.splitlines()
            if lines[1:] and lines[1].split()[3:] == ["2", "running"]:
                break
            assert asyncio.get_running_loop().time() < deadline, lines
            await asyncio.sleep(0.1)
        assert lines[0].split() == ["job", "queue", "tasks", "states"]
        assert lines[1].split()[:3] == ["long", "default", "2"]
        assert lines[2].split() == ["quick", "default", "3", "3", "succeeded"]
        args.unfinished = True
        await _jobs(client, args)
        assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["long"]
        args.unfinished, args.queue = False, "no-such-queue"
        await _jobs(client, args)
        assert capsys.readouterr().out.startswith("no job")
        with pytest.raises(grpc.aio.AioRpcError, match="limit must be between 0"):
            await client.jobs(limit=1001)
