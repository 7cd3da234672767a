"""One heartbeat call per worker host, carrying every node's stream (``HostHeartbeats``).

A host of many agents opened one ``WorkerHeartbeats`` stream per node: a gRPC write per
heartbeat and per report, each framed and sent on its own (in gRPC's asyncio stack a
write holds the GIL while the core sends it), and every node heartbeating on its own
clock, so a host of 100 idle nodes wrote 100 messages a second and its LM read them.
``HostLink`` carries the same streams as node streams on one call: what the agents write
while a write is under way goes out together in the next message, the LM's commands for
several nodes come back together, and the agents heartbeat on the host's one clock
(``next_beat``), so idle heartbeats go out as one message per interval.

An agent uses a ``NodeCall`` exactly as the ``grpc.aio`` stream it replaces: ``write``,
``read`` (``grpc.aio.EOF`` once the LM ended the node stream cleanly), ``done_writing``,
``cancel``. The LM serves each node stream as a ``WorkerHeartbeats`` call
(``services.local_master.host_streams``). When the host's call breaks, every node
stream on it fails with the call's error, as every node's stream broke when their one
connection did.

A call is replaced after about ``life_s`` as a node's stream is (gRPC keeps native
memory per message written on a stream until it ends): new node streams open on a new
call, and the old one is closed once its last node stream has ended (each agent replaces
its own within its stream life).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Sequence

import grpc

from services._proto.megha.v1 import local_master_pb2, local_master_pb2_grpc
from services.common.coalesce import Coalescer

log = logging.getLogger("megha.worker")

# A host's message carries at most this many node heartbeats (a node's heartbeat holds
# up to the agent's MAX_REPORTS_PER_HEARTBEAT reports; a few big ones go alone).
MAX_PER_MESSAGE = 256
MAX_REPORTS_PER_MESSAGE = 4000
# How long a retired call waits for the LM to end it after the host closed its side.
RETIRE_WAIT_S = 10.0
_GOLDEN = 0.6180339887  # spreads the heartbeat groups of a big host over the interval


class NodeCall:
    """One node's heartbeat stream on its host's call: the ``grpc.aio`` stream API that
    ``WorkerAgent`` uses."""

    def __init__(self, host: _HostCall, stream: int) -> None:
        self._host = host
        self.stream = stream
        self._inbox: asyncio.Queue[local_master_pb2.WorkerCommand | None] = asyncio.Queue()
        self._error: BaseException | None = None  # how it ended, if not cleanly
        self._ended = False  # the LM ended it (cleanly or not), or it failed
        self._closed = False  # we wrote our end, or cancelled

    async def write(self, heartbeat: local_master_pb2.WorkerHeartbeat) -> None:
        self._check_writable()
        item = local_master_pb2.NodeHeartbeat(stream=self.stream, heartbeat=heartbeat)
        await self._host.send(item)

    async def done_writing(self) -> None:
        self._check_writable()
        self._closed = True
        await self._host.send(local_master_pb2.NodeHeartbeat(stream=self.stream, end=True))

    async def read(self) -> local_master_pb2.WorkerCommand | object:
        if self._error is not None and self._inbox.empty():
            raise self._error
        command = await self._inbox.get()
        if command is None:  # the end: clean, or with an error
            self._inbox.put_nowait(None)  # every later read sees it too
            if self._error is not None:
                raise self._error
            return grpc.aio.EOF
        return command

    def cancel(self) -> bool:
        if self._ended and self._closed:
            return False
        if not self._closed and not self._ended:
            self._host.send_nowait(local_master_pb2.NodeHeartbeat(stream=self.stream, cancel=True))
        self._closed = True
        self._end(_rpc_error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
        return True

    def _check_writable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._ended or self._closed:
            # As a grpc.aio call written after it ended (the agent expects this one).
            raise asyncio.InvalidStateError("the node stream has ended")

    # ------------------------------------------------------------ from the host call
    def _command(self, command: local_master_pb2.WorkerCommand) -> None:
        if not self._ended:
            self._inbox.put_nowait(command)

    def _end(self, error: BaseException | None) -> None:
        if self._ended:
            return
        self._ended = True
        self._error = error
        self._inbox.put_nowait(None)
        self._host.forget(self)


class _HostCall:
    """One ``HostHeartbeats`` call and the node streams open on it."""

    def __init__(self, stub: local_master_pb2_grpc.LocalMasterStub, link: HostLink) -> None:
        self._call = stub.HostHeartbeats()
        self._link = link
        self.opened = time.monotonic()
        self.retired = False
        self.streams: dict[int, NodeCall] = {}
        self._next_stream = 1
        self._error: BaseException | None = None
        self._out: Coalescer[local_master_pb2.NodeHeartbeat] = Coalescer(
            self._write, _message_size, "host heartbeats writer"
        )
        self._reader = asyncio.create_task(self._read_loop(), name="host heartbeats reader")
        self._closing: asyncio.Task[None] | None = None

    @property
    def broken(self) -> bool:
        return self._error is not None

    def open(self) -> NodeCall:
        node = NodeCall(self, self._next_stream)
        self.streams[node.stream] = node
        self._next_stream += 1
        return node

    async def send(self, item: local_master_pb2.NodeHeartbeat) -> None:
        try:
            await self._out.send(item)
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self._fail(_as_rpc_error(err))
            raise self._error from None  # type: ignore[misc]

    def send_nowait(self, item: local_master_pb2.NodeHeartbeat) -> None:
        self._out.send_nowait(item)

    async def _write(self, items: list[local_master_pb2.NodeHeartbeat]) -> None:
        await self._call.write(local_master_pb2.HostHeartbeatsRequest(heartbeats=items))
        self._link.messages_written += 1
        self._link.heartbeats_written += sum(1 for item in items if item.HasField("heartbeat"))

    def forget(self, node: NodeCall) -> None:
        if self.streams.get(node.stream) is node:
            del self.streams[node.stream]
        self._maybe_close()

    def retire(self) -> None:
        self.retired = True
        self._maybe_close()

    def _maybe_close(self) -> None:
        if self.retired and not self.streams and self._closing is None and not self.broken:
            self._closing = asyncio.create_task(self._close(), name="host heartbeats close")

    async def _close(self) -> None:
        """Our side closed once all is written; the call ends when the LM has ended it."""
        with contextlib.suppress(Exception):
            await self._out.flush()
            await self._call.done_writing()
            await asyncio.wait_for(asyncio.shield(self._reader), RETIRE_WAIT_S)
        self.stop()

    def stop(self) -> None:
        """End the call now: its node streams fail (CANCELLED)."""
        self._fail(
            _rpc_error(grpc.StatusCode.CANCELLED, "the worker host closed its heartbeat call")
        )
        self._out.stop()
        if self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._call.cancel()

    def _fail(self, error: BaseException) -> None:
        """The call broke: every node stream on it fails with its error."""
        if self._error is None:
            self._error = error
        self._out.fail(self._error)
        for node in list(self.streams.values()):
            node._end(self._error)
        self._link.done(self)

    async def _read_loop(self) -> None:
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    break
                for command in message.commands:
                    node = self.streams.get(command.stream)
                    if node is None:
                        continue  # a stream we gave up on
                    if command.HasField("command"):
                        node._command(command.command)
                    if command.end:
                        node._end(_ended_with(command))
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self._fail(_as_rpc_error(err))
            return
        # The LM ended the call: so are the streams it had not ended.
        self._fail(
            _rpc_error(grpc.StatusCode.UNAVAILABLE, "the LM ended the host's heartbeat call")
        )


def _message_size(waiting: Sequence[local_master_pb2.NodeHeartbeat]) -> int:
    """How many of the waiting node heartbeats go in the next message."""
    reports = 0
    for count, item in enumerate(waiting[:MAX_PER_MESSAGE]):
        reports += len(item.heartbeat.reports)
        if count and reports > MAX_REPORTS_PER_MESSAGE:
            return count
    return min(len(waiting), MAX_PER_MESSAGE)


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a node stream fails with, as its own call would have."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def _ended_with(command: local_master_pb2.NodeCommand) -> BaseException | None:
    if command.code == grpc.StatusCode.OK.value[0]:
        return None
    code = next((c for c in grpc.StatusCode if c.value[0] == command.code), None)
    return _rpc_error(code or grpc.StatusCode.UNKNOWN, command.details)


def _as_rpc_error(err: BaseException) -> BaseException:
    if isinstance(err, grpc.aio.AioRpcError):
        return err
    return _rpc_error(grpc.StatusCode.UNAVAILABLE, f"the host's heartbeat call failed: {err!r}")


class HostLink:
    """Every node stream of one worker host, on one ``HostHeartbeats`` call at a time."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        life_s: float,
        rng: random.Random | None = None,
    ) -> None:
        self._stub = local_master_pb2_grpc.LocalMasterStub(channel)
        self.life_s = life_s
        self._rng = rng or random.Random()
        self._current: _HostCall | None = None
        self._calls: set[_HostCall] = set()
        self.calls_opened = 0
        self.messages_written = 0  # HostHeartbeats messages
        self.heartbeats_written = 0  # node heartbeats in them
        self._phase: float | None = None
        self._groups: dict[str, int] = {}  # node id -> its share of the clock

    def open(self) -> NodeCall:
        """A new node stream, on the current call (a new one if it broke or is old)."""
        current = self._current
        if current is not None and (
            current.broken or time.monotonic() - current.opened >= self.life_s
        ):
            current.retire()
            current = self._current = None
        if current is None:
            current = self._current = _HostCall(self._stub, self)
            self._calls.add(current)
            self.calls_opened += 1
        return current.open()

    def next_beat(self, interval_s: float, node_id: str = "") -> float:
        """When (``loop.time()``) node ``node_id`` of this host, heartbeating now,
        heartbeats next: on the host's one clock, every ``interval_s`` (a phase of its own
        per host), at least a tenth of an interval from now (asyncio may wake a timer a
        little early: the same tick again would be a second heartbeat at once), so no
        node goes more than 1.1 intervals without one. The nodes share a tick a
        message's worth (``MAX_PER_MESSAGE``) at a time: a host of thousands sends a
        few full messages spread over the interval, not all of them at once."""
        now = asyncio.get_running_loop().time()
        if self._phase is None:
            self._phase = now + self._rng.random() * interval_s
        group = self._groups.setdefault(node_id, len(self._groups) // MAX_PER_MESSAGE)
        phase = self._phase + (group * _GOLDEN % 1.0) * interval_s
        ticks = math.floor((now + 0.1 * interval_s - phase) / interval_s) + 1
        return phase + ticks * interval_s

    def done(self, call: _HostCall) -> None:
        """``call`` ended: node streams open on a new one from now on."""
        self._calls.discard(call)
        if self._current is call:
            self._current = None

    async def close(self) -> None:
        """Stop every call (after the agents have shut down)."""
        for call in list(self._calls):
            call.stop()
        self._calls.clear()
        self._current = None
