"""The web console against a real embedded federation (one GM, one LM, two 4-CPU workers):
its pages and JSON endpoints, over HTTP as a browser or a script asks them."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from services._proto.megha.v1 import common_pb2
from services.console.server import bind, running_console
from tests.integration.harness import embedded_federation, hog, job_in_state, shell_task, sim_tasks

pytestmark = pytest.mark.integration


async def fetch(url: str) -> tuple[int, str]:
    def get() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    return await asyncio.to_thread(get)


async def api(base: str, path: str) -> dict:
    status, body = await fetch(base + "api/" + path)
    assert status == 200, body
    return json.loads(body)


async def until(probe, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (found := await probe()):
        assert time.monotonic() < deadline, "never came"
        await asyncio.sleep(0.1)
    return found


async def test_pages_show_the_federation_a_job_and_why_a_task_waits():
    async with (
        embedded_federation("console-pages") as (config, _gm, _bus, client),
        running_console(config, bind("127.0.0.1", 0), refresh_s=0.5) as base,
    ):
        # Federation: both nodes of lm-1, heard by gm-1 a moment ago.
        fed = await api(base, "federation")
        (lm1,) = fed["lms"]
        assert [n["node_id"] for n in lm1["nodes"]] == ["lm-1-w0", "lm-1-w1"]
        assert {n["state"] for n in lm1["nodes"]} == {"alive"}
        assert lm1["partitions"][0]["cpu_milli"] == 8000
        assert lm1["heartbeats"]["gm-1"]["age_s"] < 5 and not lm1["heartbeats"]["gm-1"]["silent"]
        status, page = await fetch(base + "federation")
        assert status == 200 and "lm-1-w0" in page and "lm-1-w1" in page
        assert 'data-live="/federation?fragment=1"' in page  # what console.js renews

        # A job that ran: listed with its counts, its tasks with node and allocation time.
        done = await client.submit(sim_tasks(3, 0.01), job_id="quick")
        await job_in_state(client, "quick", common_pb2.TASK_STATE_SUCCEEDED)
        jobs = await until(lambda: _listed(base, "quick"))
        assert jobs["counts"]["succeeded"] >= 3
        job = await api(base, "jobs/quick")
        assert [t["task_id"] for t in job["task_list"]] == list(done.task_ids)
        assert all(t["state"] == "succeeded" and t["node_id"] for t in job["task_list"])
        assert all(0 < t["allocation_s"] < 10 for t in job["task_list"])
        status, fragment = await fetch(base + "jobs/quick?fragment=1")
        assert status == 200 and "<html" not in fragment and "quick.2" in fragment

        # A task that cannot fit now says why, on its job's page.
        await hog(client, 30)
        await client.submit(sim_tasks(1, 1, cpu_milli=4000), job_id="waits")
        waiting = await until(lambda: _pending_reason(base, "waits"))
        assert waiting.startswith("waiting for resources: needs cpu=4"), waiting
        status, page = await fetch(base + "jobs/waits")
        assert "waiting for resources" in page
        status, page = await fetch(base + "jobs?state=queued")
        assert "waits" in page and "quick" not in page.split("<tbody>", 1)[-1]

        # Queues: the default queue's running and pending tasks.
        (queue,) = (await api(base, "queues"))["queues"]
        assert queue["queue"] == "default" and queue["running_tasks"] == 2
        assert queue["pending_tasks"] == 1

        # Allocation times: one sample per task started, in a histogram and a CDF.
        alloc = (await api(base, "allocations"))["gms"][0]
        assert alloc["count"] >= 5 and sum(alloc["histogram"]) == alloc["count"]
        assert alloc["cdf"][-1][1] == 1.0
        status, page = await fetch(base + "allocations")
        assert '<svg class="histogram"' in page and '<svg class="cdf"' in page


async def test_an_lm_that_does_not_answer_is_named_and_the_rest_shown():
    async with (
        embedded_federation("console-down", silent_lms=1) as (config, _gm, _bus, _client),
        running_console(config, bind("127.0.0.1", 0)) as base,
    ):
        lm1, lm2 = (await api(base, "federation"))["lms"]
        assert len(lm1["nodes"]) == 2 and not lm1["error"]
        assert lm2["error"].startswith("UNAVAILABLE") and lm2["nodes"] == []
        assert lm2["heartbeats"] == {}  # no GM hears it
        status, page = await fetch(base + "federation")
        assert status == 200 and "lm-2 does not answer: UNAVAILABLE" in page
        assert "no GM hears it" in page and "lm-1-w1" in page


async def _listed(base: str, job_id: str) -> dict | None:
    jobs = await api(base, "jobs")
    return jobs if any(j["job_id"] == job_id for j in jobs["jobs"]) else None


async def _pending_reason(base: str, job_id: str) -> str:
    status, body = await fetch(f"{base}api/jobs/{job_id}")
    return json.loads(body)["task_list"][0]["pending_reason"] if status == 200 else ""


async def test_a_task_output_bad_parameters_and_unknown_jobs():
    async with (
        embedded_federation("console-output") as (config, _gm, _bus, client),
        running_console(config, bind("127.0.0.1", 0)) as base,
    ):
        await client.submit([shell_task("echo hello from the console")], job_id="talks")
        await job_in_state(client, "talks", common_pb2.TASK_STATE_SUCCEEDED)
        out = await api(base, "jobs/talks/tasks/talks.0/output")
        assert out["text"] == "hello from the console\n" and out["stream"] == "stdout"
        status, page = await fetch(base + "jobs/talks?task=talks.0")
        assert status == 200 and "hello from the console" in page

        status, body = await fetch(base + "api/jobs?state=asleep")
        assert status == 400 and "unknown state 'asleep'; known: unfinished, queued" in body
        status, body = await fetch(base + "api/jobs?limit=0")
        assert status == 400 and "limit must be between 1 and 1000" in body
        status, body = await fetch(base + "api/jobs/nosuch")
        assert status == 404 and "no GM knows job 'nosuch'" in body
        status, page = await fetch(base + "jobs/talks?task=nosuch")
        assert status == 404 and "job &#x27;talks&#x27; has no task &#x27;nosuch&#x27;" in page
        status, script = await fetch(base + "static/console.js")
        assert (status == 200 and "fragment" not in script) or "dataset.live" in script
