"""``--json`` on the listing commands and ``megha submit --dry-run``, against a real
(embedded) GM: one LM with two workers of 4 CPUs."""

from __future__ import annotations

import json

import pytest

from services._proto.megha.v1 import common_pb2
from services.app.operator import client_command
from services.cli import build_parser
from tests.integration.harness import embedded_federation, job_in_state, sim_tasks

pytestmark = pytest.mark.integration


async def megha(config, capsys, *argv: str) -> tuple[int, str, str]:
    """A client command as ``megha`` parses it, run against ``config``'s GM."""
    capsys.readouterr()
    code = await client_command(build_parser().parse_args(list(argv)), config)
    out = capsys.readouterr()
    return code, out.out, out.err


async def test_a_dry_run_says_where_each_task_would_go_and_queues_nothing(capsys):
    async with embedded_federation("cli-dry-run") as (config, _gm, _bus, client):
        view_before = await client.cluster()
        code, out, _ = await megha(
            config, capsys, "submit", "--dry-run", "--json", "--count", "3",
            "--resources", "cpu=3,mem=1Gi",
        )  # fmt: skip
        plan = json.loads(out)
        assert code == 1  # one task would wait
        assert plan["gm_id"] == "gm-1" and plan["queue"] == "default" and plan["served_here"]
        first, second, third = plan["tasks"]
        # Two 4-CPU nodes hold one 3-CPU task each: the job's own tasks are counted.
        assert first["outcome"] == second["outcome"] == "placed"
        assert {first["node_id"], second["node_id"]} == {"lm-1-w0", "lm-1-w1"}
        assert third["outcome"] == "waits"
        assert third["reason"].startswith("waiting for resources: needs cpu=3"), third
        # Nothing was queued or kept: no job, the view's free room as it was.
        assert await client.jobs() == []
        after = await client.cluster()
        assert after.lms[0].partitions == view_before.lms[0].partitions

        code, out, _ = await megha(config, capsys, "submit", "--dry-run", "--count", "2")
        assert code == 0
        lines = out.splitlines()
        assert lines[0] == "dry run on gm-1 for queue default; nothing was queued"
        assert lines[1].split()[:4] == ["task", "0", "would", "run"]

        code, out, _ = await megha(config, capsys, "submit", "--dry-run", "--resources", "cpu=64")
        assert code == 2
        assert "task 0     would never run: no node is large enough: needs cpu=64" in out

        code, _, err = await megha(config, capsys, "submit", "--dry-run", "--wait")
        assert code == 2 and "not with --dry-run or --json" in err


async def test_a_gang_dry_run_judges_the_gang_whole(capsys):
    """Two 4-CPU nodes: three 3-CPU tasks one by one place two and queue one; as a gang
    they never start whole, with min_tasks 2 two start together and one waits."""
    async with embedded_federation("cli-dry-run-gang") as (config, _gm, _bus, client):
        three = ("submit", "--dry-run", "--json", "--count", "3", "--resources", "cpu=3,mem=1Gi")
        code, out, _ = await megha(config, capsys, *three, "--gang")
        tasks = json.loads(out)["tasks"]
        assert code == 2 and {t["outcome"] for t in tasks} == {"never"}
        assert tasks[0]["reason"].startswith("the gang can never start whole here"), tasks

        code, out, _ = await megha(config, capsys, *three, "--min-tasks", "2")
        first, second, third = json.loads(out)["tasks"]
        assert code == 1 and first["outcome"] == second["outcome"] == "placed"
        assert {first["node_id"], second["node_id"]} == {"lm-1-w0", "lm-1-w1"}
        assert third["outcome"] == "waits" and "min_tasks" in third["reason"]

        code, out, _ = await megha(config, capsys, "submit", "--dry-run", "--gang", "--count",
                                   "2", "--resources", "cpu=3,mem=1Gi")  # fmt: skip
        assert code == 0 and out.count("would run on") == 2
        assert await client.jobs() == []


async def test_listing_commands_print_json(capsys):
    async with embedded_federation("cli-json") as (config, _gm, _bus, client):
        code, out, _ = await megha(config, capsys, "submit", "--json", "--count", "2",
                                   "--duration", "0.01", "--job-id", "two")  # fmt: skip
        assert code == 0 and json.loads(out) == {"job_id": "two", "task_ids": ["two.0", "two.1"]}
        await job_in_state(client, "two", common_pb2.TASK_STATE_SUCCEEDED)

        code, out, _ = await megha(config, capsys, "jobs", "--json")
        assert code == 0
        assert json.loads(out) == [
            {"job_id": "two", "queue": "default", "tasks": 2, "states": {"succeeded": 2}}
        ]

        code, out, _ = await megha(config, capsys, "job", "two", "--json")
        job = json.loads(out)
        assert job["states"] == {"succeeded": 2} and len(job["task_list"]) == 2
        task = job["task_list"][0]
        assert task["state"] == "succeeded" and task["lm_id"] == "lm-1" and task["node_id"]
        assert task["allocation_s"] > 0 and task["pending_reason"] == ""

        await client.submit(sim_tasks(1, 30.0), job_id="long")
        await job_in_state(client, "long", common_pb2.TASK_STATE_RUNNING)
        code, out, _ = await megha(config, capsys, "status", "--json")
        status = json.loads(out)
        (lm,) = status["lms"]
        assert lm["lm_id"] == "lm-1" and not lm["silent"]
        assert lm["partitions"] == [
            {"gm_id": "gm-1", "nodes": 2,
             "free": {"cpu_milli": 7000, "memory_mb": 16384 - 256, "disk_mb": 0, "net_mbps": 0}}
        ]  # fmt: skip
        (queue,) = status["queues"]
        assert queue["queue"] == "default" and queue["running_tasks"] == 1
        assert queue["pending_tasks"] == 0 and queue["limit"] is None
        assert status["allocation_s"]["count"] == 3

        code, _, err = await megha(config, capsys, "job", "two", "--json", "--watch")
        assert code == 2 and "--watch prints events as they come: not with --json" in err
