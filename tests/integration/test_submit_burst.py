"""Many submissions at once: each is taken, or refused with a code that says to retry;
none is dropped as a bare CANCELLED, and the load generator retries what a busy GM
refused."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from loadgen.replay import replay_jobs
from loadgen.trace import TraceJob, TraceTask
from services.common.client import BUSY_TRIES, GlobalMasterClient
from tests.integration.harness import Federation, embedded_federation, sim_tasks

pytestmark = pytest.mark.integration

BURST = 2_000  # gRPC's own queue dropped calls at random past 1,000 waiting


@pytest.mark.slow  # ~13 s of load: run apart by .ci/run (MEGHA_SLOW_TESTS=1)
async def test_a_burst_of_submissions_is_taken_whole(tmp_path):
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=2) as fed:
        client = fed.gm()
        codes: Counter[str] = Counter()

        async def submit(n: int) -> None:
            try:
                # A GM takes on only so many at once (``Admission``): past that it says to
                # retry after a pause, as the client does.
                await client.submit(
                    sim_tasks(1, 0.01, cpu_milli=100),
                    job_id=f"burst-{n}",
                    busy_tries=BUSY_TRIES,
                    on_busy=lambda _pause: codes.update(["busy"]),
                )
                codes["OK"] += 1
            except grpc.aio.AioRpcError as err:
                codes[f"{err.code().name}: {err.details()}"] += 1

        await asyncio.gather(*(submit(n) for n in range(BURST)))
        assert codes["OK"] == BURST, codes
        assert set(codes) <= {"OK", "busy"}, codes


async def test_a_busy_gm_says_to_retry_and_the_replay_does():
    async with embedded_federation("submit-busy") as (config, gm, _bus, client):
        gm.admission.max_limit = 0  # as if that many were under way
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await client.submit(sim_tasks(1, 0.05), job_id="busy")
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = busy.value.details()
        assert "submissions under way, its limit now: job busy was not queued" in details
        assert "retry it in a moment, backing off" in busy.value.details()
        # Streamed, the same refusal, given by the stream's reader itself (``_refusal``).
        target = config.gm("gm-1").target
        async with GlobalMasterClient(target, streaming=True) as streamed:
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                await streamed.submit(sim_tasks(1, 0.05), job_id="busy")
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "job busy was not queued" in busy.value.details()
            assert gm.jobs.get("busy") is None  # nothing of it taken

        jobs = [TraceJob(f"j{j}", 0.0, (TraceTask(1.0),)) for j in range(3)]
        replay = asyncio.create_task(replay_jobs(jobs, [target], speedup=20.0, timeout_s=30))
        await asyncio.sleep(0.5)  # the first job was refused at least twice by then
        gm.admission.max_limit = 100
        result = await replay
        summary = result.summary
        assert summary["submit_errors"] == {}
        assert summary["retried_submissions"] >= 2
        assert summary["completed"] == summary["tasks"] == 3
        assert "submissions after a pause (a GM was too busy for them)" in result.render()
