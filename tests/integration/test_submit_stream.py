"""SubmitStream: the same answers and errors as SubmitJob, many jobs on one stream."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from prometheus_client import REGISTRY

from services._proto.megha.v1 import common_pb2
from services.common.client import GlobalMasterClient
from tests.integration.harness import embedded_federation, job_in_state, sim_tasks

pytestmark = pytest.mark.integration


def _sample(name: str) -> float:
    """A counter of gm-1's (the federation runs in this process)."""
    return REGISTRY.get_sample_value(name, {"gm": "gm-1"}) or 0.0


@contextlib.asynccontextmanager
async def streaming_client(config):
    async with GlobalMasterClient(config.gm("gm-1").target, streaming=True) as client:
        yield client


async def test_jobs_on_one_stream_are_answered_each_with_its_own_ids_and_all_run():
    async with (
        embedded_federation("submit-stream") as (config, _gm, _bus, _client),
        streaming_client(config) as client,
    ):
        messages_before = _sample("megha_queue_messages_total")
        jobs_before = _sample("megha_queue_message_jobs_total")
        replies = await asyncio.gather(
            *(
                client.submit(sim_tasks(1 + i % 3, 0.05, cpu_milli=100), job_id=f"s{i}")
                for i in range(30)
            )
        )
        for i, reply in enumerate(replies):
            assert reply.job_id == f"s{i}"
            assert reply.task_ids == [f"s{i}.{k}" for k in range(1 + i % 3)]
        # Those that waited while the first was written went out together (``more_jobs``).
        assert client._submitter is not None and client._submitter.written < 30
        # And those the GM took while its publishes awaited their confirms went to the
        # broker together (``TaskBatch.more_jobs``).
        assert _sample("megha_queue_message_jobs_total") - jobs_before == 30
        assert _sample("megha_queue_messages_total") - messages_before < 30
        for i in range(30):
            await job_in_state(client, f"s{i}", common_pb2.TASK_STATE_SUCCEEDED)


async def test_a_refused_job_gets_the_unary_error_and_the_stream_goes_on():
    bad = [
        (sim_tasks(0, 0.05), "", grpc.StatusCode.INVALID_ARGUMENT),
        (sim_tasks(1, 0.05), "nope", grpc.StatusCode.INVALID_ARGUMENT),
        (sim_tasks(1, 0.05, cpu_milli=64_000), "", grpc.StatusCode.FAILED_PRECONDITION),
    ]
    async with (
        embedded_federation("submit-stream-errors") as (config, _gm, _bus, unary),
        streaming_client(config) as client,
    ):
        for tasks, queue, code in bad:
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                await client.submit(tasks, queue=queue, job_id="bad")
            with pytest.raises(grpc.aio.AioRpcError) as called:
                await unary.submit(tasks, queue=queue, job_id="bad")
            assert streamed.value.code() == called.value.code() == code
            assert streamed.value.details() == called.value.details()
        ok = await client.submit(sim_tasks(1, 0.05, cpu_milli=100), job_id="after")
        assert ok.task_ids == ["after.0"]
