"""Requests a service cannot take are refused with INVALID_ARGUMENT and a reason a person
can read: bytes that are no request, ids past their bound (without echoing them back),
and task fields only the federation sets."""

from __future__ import annotations

import grpc
import pytest

from services._proto.megha.v1 import common_pb2, local_master_pb2
from services.common.names import user_queue
from services.common.server import channel
from tests.integration.harness import Federation, job_in_state, shell_task, sim_tasks

pytestmark = pytest.mark.integration

NOT_A_MESSAGE = b"\xff\xff\xff\xff"  # a field number 0 in a varint that never ends


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def stream_refused(call, message: bytes) -> tuple[grpc.StatusCode, str]:
    await call.write(message)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    return caught.value.code(), caught.value.details()


async def stream_refused_replies(ch, method: str) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in ch.unary_stream(method)(NOT_A_MESSAGE, timeout=5):
            pass
    return caught.value.code(), caught.value.details()


async def test_bytes_that_are_no_request_and_huge_ids_are_invalid_arguments(tmp_path):
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=1) as fed:
        gm_target, lm_target = fed.config.gm("gm-1").target, fed.config.lm("lm-1").target
        async with channel(gm_target) as gm, channel(lm_target) as lm:
            # Unary, server streaming, and on streams: the call ends INVALID_ARGUMENT
            # (gRPC's own answer is UNKNOWN, and a stream's servicer just saw it end).
            for ch, method, kind in [
                (gm, "/megha.v1.GlobalMaster/SubmitJob", "unary"),
                (gm, "/megha.v1.GlobalMaster/WatchJob", "replies"),
                (gm, "/megha.v1.GlobalMaster/SubmitStream", "stream"),
                (lm, "/megha.v1.LocalMaster/LaunchStream", "stream"),
                (lm, "/megha.v1.LocalMaster/WorkerHeartbeats", "stream"),
            ]:
                if kind == "unary":
                    err = await refused(ch.unary_unary(method)(NOT_A_MESSAGE, timeout=5))
                    code, details = err.code(), err.details()
                elif kind == "replies":
                    code, details = await stream_refused_replies(ch, method)
                else:
                    code, details = await stream_refused(
                        ch.stream_stream(method)(timeout=5), NOT_A_MESSAGE
                    )
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
                assert f"the bytes sent are not a valid {method} request" in details

        # A megabyte id: refused, named cut short, not sent back.
        huge = "x" * 1_000_000
        client = fed.gm()
        for call in (
            client.submit(sim_tasks(1, 0.05), job_id=huge),
            client.job(huge),
            client.cancel(huge),
            client.submit(sim_tasks(1, 0.05), queue=huge),
        ):
            err = await refused(call)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is 1000000 bytes long; at most 256" in err.details()
            assert len(err.details()) < 200
        (big_task,) = sim_tasks(1, 0.05)
        big_task.task_id = huge
        err = await refused(client.submit([big_task]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "task_id 'xxxx" in err.details() and len(err.details()) < 200
        # On a SubmitStream the job id is in each message: refused there too.
        async with type(client)(gm_target, streaming=True) as streaming:
            err = await refused(streaming.submit(sim_tasks(1, 0.05), job_id=huge))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(err.details()) < 200
        async with channel(lm_target) as lm:
            lookup = local_master_pb2.LookupTasksRequest(task_ids=["fine", huge])
            err = await refused(
                lm.unary_unary(
                    "/megha.v1.LocalMaster/LookupTasks",
                    request_serializer=local_master_pb2.LookupTasksRequest.SerializeToString,
                )(lookup, timeout=5)
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "task_ids 'xxxx" in err.details() and len(err.details()) < 200

        # The services still serve.
        reply = await client.submit(sim_tasks(1, 0.05), job_id="fine")
        await job_in_state(client, reply.job_id, common_pb2.TASK_STATE_SUCCEEDED)


async def test_a_task_may_not_set_its_attempt_lease_or_failures(tmp_path):
    """A client-set attempt 2**32 - 1 with retries was queued, failed, and could not be
    queued again as attempt 2**32: the task stayed RETRYING for ever, and the LM, failing
    to write the next attempt, ended that worker's heartbeat stream without a word."""
    async with Federation(tmp_path, gms=1, lms=1, workers_per_lm=1) as fed:
        client = fed.gm()
        for field, value in (("attempt", 2**32 - 1), ("lease", 7), ("failures", 3)):
            task = shell_task("exit 1", retries=2)
            setattr(task, field, value)
            err = await refused(client.submit([task], job_id=f"set-{field}"))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"{field} is {value}, but " in err.details()
            assert "leave it 0" in err.details()

        # Queued with such an attempt anyway (a GM of before): never placed, so its next
        # attempt is never written; it ends REJECTED saying why.
        queue = fed.config.effective_queues()[0].name
        task = shell_task("exit 1", retries=2)
        task.task_id, task.job_id, task.queue, task.attempt = "last", "old", queue, 2**32 - 1
        batch = common_pb2.TaskBatch(job_id="old", queue=queue, tasks=[task])
        await fed.bus.enqueue(user_queue(queue), batch.SerializeToString())
        job = await job_in_state(client, "old", common_pb2.TASK_STATE_REJECTED)
        assert "attempt is 4294967295; at most 4294967294" in job.tasks[0].pending_reason

        # The worker is still there and runs the next job's retries to the end.
        reply = await client.submit([shell_task("exit 1", retries=1)], job_id="retried")
        job = await job_in_state(client, reply.job_id, common_pb2.TASK_STATE_FAILED)
        assert job.tasks[0].attempt == 1
