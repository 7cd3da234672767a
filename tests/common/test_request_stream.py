"""A coalesced request stream keeps at most ``window`` messages out unread: requests that
come meanwhile wait in its outbox and go together, instead of one message each piling up
in the transport of a server that reads late (gRPC's write is done once the transport
holds the message). The server here is a scripted SubmitStream peer: what is tested is
the client's stream, and the test decides when the peer answers."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services._proto.megha.v1 import global_master_pb2, global_master_pb2_grpc
from services.common.request_stream import NotSent, Submitter


class Peer(global_master_pb2_grpc.GlobalMasterServicer):
    """Reads every message at once, records how many jobs each carried, and answers
    only the requests the test releases (``release``)."""

    def __init__(self) -> None:
        self.jobs_per_message: list[int] = []
        self.read: list[int] = []  # request ids, in the order read
        self._released: asyncio.Queue[int] = asyncio.Queue()

    def release(self, *request_ids: int) -> None:
        for rid in request_ids:
            self._released.put_nowait(rid)

    async def SubmitStream(self, request_iterator, context):
        async def read() -> None:
            async for message in request_iterator:
                self.jobs_per_message.append(1 + len(message.more_jobs))
                self.read.extend(one.request_id for one in (message, *message.more_jobs))

        reader = asyncio.create_task(read())
        try:
            while True:
                rid = await self._released.get()
                yield global_master_pb2.SubmitStreamResponse(
                    request_id=rid,
                    submit=global_master_pb2.SubmitJobResponse(job_id=f"j{rid}"),
                )
        finally:
            reader.cancel()


@pytest.fixture
async def peer():
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    peer = Peer()
    global_master_pb2_grpc.add_GlobalMasterServicer_to_server(peer, server)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    peer.stub = global_master_pb2_grpc.GlobalMasterStub(channel)
    yield peer
    await channel.close()
    await server.stop(None)


async def until(condition, seconds: float = 5.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.01)


def job(i: int) -> global_master_pb2.SubmitJobRequest:
    return global_master_pb2.SubmitJobRequest(job_id=f"j{i}")


async def test_past_the_window_requests_wait_and_go_together_once_a_message_is_answered(peer):
    stream = Submitter(peer.stub, window=4, send_within_s=None)
    asked = []
    for i in range(4):  # each alone: the window has room
        asked.append(asyncio.create_task(stream.request(job(i), timeout=10)))
        await until(lambda n=i + 1: len(peer.read) == n)
    for i in range(4, 20):
        asked.append(asyncio.create_task(stream.request(job(i), timeout=10)))
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert peer.jobs_per_message == [1, 1, 1, 1]  # 16 wait: four messages out unread
    peer.release(1)  # the first message is read: room for one more
    await until(lambda: len(peer.read) == 20)
    assert peer.jobs_per_message == [1, 1, 1, 1, 16]
    peer.release(*range(2, 21))
    replies = await asyncio.gather(*asked)
    assert [r.job_id for r in replies] == [f"j{rid}" for rid in range(1, 21)]
    await stream.close()


async def test_by_default_one_message_is_out_at_a_time(peer):
    stream = Submitter(peer.stub, send_within_s=None)
    asked = [asyncio.create_task(stream.request(job(0), timeout=10))]
    await until(lambda: len(peer.read) == 1)
    for i in range(1, 20):
        asked.append(asyncio.create_task(stream.request(job(i), timeout=10)))
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.1)
    assert peer.jobs_per_message == [1]
    peer.release(1)
    await until(lambda: len(peer.read) == 20)
    assert peer.jobs_per_message == [1, 19]
    peer.release(*range(2, 21))
    await asyncio.gather(*asked)
    await stream.close()


async def test_what_waits_too_long_to_be_sent_is_refused_by_the_client(peer):
    stream = Submitter(peer.stub, send_within_s=0.3)
    first = asyncio.create_task(stream.request(job(0), timeout=10))
    await until(lambda: len(peer.read) == 1)
    began = asyncio.get_running_loop().time()
    waiting = [asyncio.create_task(stream.request(job(i), timeout=10)) for i in range(1, 6)]
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, NotSent) for r in results), results
    assert {r.code() for r in results} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert "not sent" in results[0].details()
    assert 0.3 <= asyncio.get_running_loop().time() - began < 2.0
    assert peer.read == [1]  # none of them reached the server
    later = asyncio.create_task(stream.request(job(6), timeout=10))
    peer.release(1)  # the first is answered: the stream goes on with the next request
    assert (await first).job_id == "j1"
    await until(lambda: len(peer.read) == 2)
    peer.release(7)
    assert (await later).job_id == "j7"
    await stream.close()


async def test_a_message_none_waits_for_any_more_leaves_the_window(peer):
    stream = Submitter(peer.stub, send_within_s=None)
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await stream.request(job(0), timeout=0.3)  # never answered
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = asyncio.create_task(stream.request(job(1), timeout=10))
    await until(lambda: len(peer.read) == 2)  # written: the unanswered one left the window
    peer.release(2)
    assert (await after).job_id == "j2"
    await stream.close()
