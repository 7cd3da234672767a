"""The LM's end of a worker host's ``HostHeartbeats`` call: each node stream on it served
as a ``WorkerHeartbeats`` call of its own (see ``services.worker.link`` for the host's).

``serve_host`` reads the host's messages and hands each node heartbeat to its node
stream's ``NodeContext``, the servicer context the per-node handler reads, writes and
aborts through; the commands the node handlers write while a write is under way go out
together in the next message. A node handler's end (it returned, aborted, or failed) is
written as the node stream's end, with the status a call would have ended with. When the
host's call ends, so does every node stream on it: its handlers are cancelled, as gRPC
cancels the handlers of calls whose connection went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from services._proto.megha.v1 import local_master_pb2
from services.common.checked_requests import ids_problem
from services.common.coalesce import Coalescer

log = logging.getLogger("megha.lm")

MAX_PER_MESSAGE = 256  # node commands in one message to the host


class NodeAborted(Exception):
    """A node handler ended its stream with a status (``NodeContext.abort``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class NodeContext:
    """A node stream on a host's call, as the servicer context of a ``WorkerHeartbeats``
    call: ``read``, ``write``, ``abort``, ``peer``."""

    def __init__(self, host: Coalescer[local_master_pb2.NodeCommand], stream: int, context: Any):
        self._host = host
        self.stream = stream
        self._context = context
        self._inbox: asyncio.Queue[local_master_pb2.WorkerHeartbeat | None] = asyncio.Queue()

    async def read(self) -> local_master_pb2.WorkerHeartbeat | object:
        beat = await self._inbox.get()
        if beat is None:
            self._inbox.put_nowait(None)
            return grpc.aio.EOF
        if (problem := ids_problem(beat)) is not None:
            await self.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        return beat

    async def write(self, command: local_master_pb2.WorkerCommand) -> None:
        await self._host.send(local_master_pb2.NodeCommand(stream=self.stream, command=command))

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise NodeAborted(code, details)

    def peer(self) -> str:
        return self._context.peer()

    def feed(self, beat: local_master_pb2.WorkerHeartbeat | None) -> None:
        self._inbox.put_nowait(beat)


NodeHandler = Callable[[NodeContext], Awaitable[None]]


async def serve_host(context: Any, serve_node: NodeHandler) -> None:
    """Serve a ``HostHeartbeats`` call: each node stream on it by ``serve_node``, until
    the host closes its side and every node stream has ended, or the call breaks."""

    async def write(commands: list[local_master_pb2.NodeCommand]) -> None:
        await context.write(local_master_pb2.HostHeartbeatsResponse(commands=commands))

    writer: Coalescer[local_master_pb2.NodeCommand] = Coalescer(
        write, lambda waiting: MAX_PER_MESSAGE, "host heartbeats writer"
    )
    nodes: dict[int, NodeContext] = {}
    handlers: dict[int, asyncio.Task[None]] = {}
    highest = 0  # streams up to this one were opened; one not in ``nodes`` has ended

    def ended(stream: int, task: asyncio.Task[None]) -> None:
        nodes.pop(stream, None)
        handlers.pop(stream, None)
        if task.cancelled():
            return  # the host gave up on it, or the call is going: nothing to tell
        error = task.exception()
        if error is None:
            code, details = grpc.StatusCode.OK, ""
        elif isinstance(error, NodeAborted):
            code, details = error.code, error.details
        else:
            log.error("a worker's heartbeat stream failed", exc_info=error)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected error: {error!r}"
        end = local_master_pb2.NodeCommand(
            stream=stream, end=True, code=code.value[0], details=details
        )
        writer.send_nowait(end)

    try:
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                break
            for item in message.heartbeats:
                stream = item.stream
                node = nodes.get(stream)
                if node is None:
                    if stream <= highest or item.cancel or not stream:
                        continue  # ended here already; what it wrote after is dropped
                    highest = stream
                    node = nodes[stream] = NodeContext(writer, stream, context)
                    task = asyncio.create_task(serve_node(node), name=f"node stream {stream}")
                    handlers[stream] = task
                    task.add_done_callback(lambda t, s=stream: ended(s, t))
                if item.cancel:
                    handlers[stream].cancel()
                    continue
                if item.HasField("heartbeat"):
                    node.feed(item.heartbeat)
                if item.end:
                    node.feed(None)
        # The host wrote all it will: its node streams end as their handlers do.
        if handlers:
            await asyncio.gather(*handlers.values(), return_exceptions=True)
        await writer.flush()
    finally:
        for task in list(handlers.values()):
            task.cancel()
        if handlers:
            await asyncio.gather(*handlers.values(), return_exceptions=True)
        writer.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await writer.task
