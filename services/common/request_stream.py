"""Requests as messages on one long-lived bidirectional stream instead of unary calls.

    request(r) ──write (request_id, r)──▶ server ──answers (request_id)──▶ reader ──▶ its future

A unary call costs a new HTTP/2 stream, headers and trailers each way: between two
processes at 200 calls/s it takes 1.7x the round trip and 1.4x the CPU of a stream
message (``megha bench hops``). Used by the GM for launches (one ``LaunchStream`` per
LM) and by the load generator for submissions (``SubmitStream``). Failures look like the
unary call's: any broken stream, a deadline, or a server that went away raise
``grpc.aio.AioRpcError`` for every request on it, and the next request opens a new
stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import grpc

from services._proto.megha.v1 import (
    global_master_pb2,
    global_master_pb2_grpc,
    local_master_pb2,
    local_master_pb2_grpc,
)

Request = TypeVar("Request")
Reply = TypeVar("Reply")


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


# The most requests one coalesced stream message carries (``wrap_many``).
MAX_COALESCED = 256
# The most coalesced messages out unread on one stream (``RequestStream``): one, so
# that under load a client's submissions go as one message per answer, each as big as
# what waited meanwhile (up to MAX_COALESCED): its own clock, as TCP's acks are.
WINDOW = 1
# How long a submission may wait in a client's outbox before the client answers it itself
# (``NotSent``): a GM answers every submission within a second (issue 32), and one that
# reads slower than its clients ask would otherwise have them wait without bound.
SEND_WITHIN_S = 0.5

Answers = Iterable[tuple[int, Any]]


class NotSent(grpc.aio.AioRpcError):
    """A request the stream did not send within its ``send_within_s``: the server read
    the stream's earlier messages too slowly. RESOURCE_EXHAUSTED, as a busy server's
    refusal: nothing of it was sent, so it may be asked again."""

    def __init__(self, what: str, waited_s: float) -> None:
        super().__init__(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            f"not sent: waited {waited_s:g} s to go on the {what} stream (the server "
            "reads this client's earlier requests slower than it asks); retry it in a "
            "moment, backing off",
        )


class RequestStream(Generic[Request, Reply]):
    """Requests on one stream; opened lazily, reopened after a failure.

    ``wrap(request_id, request)`` makes the stream message; ``unwrap(message)`` gives the
    request ids and their answers, or an ``AioRpcError`` to raise for a request. With
    ``wrap_many`` (a list of (request id, request, when it was asked: wall clock, ns)
    into one message), at most ``window`` messages are out unread, and the requests
    that queue meanwhile go out together as the next message: under load a stream then
    carries fewer, bigger messages instead of falling behind. A message counts until
    the first answer to one of its requests (a GM answers a message's refusals as it
    reads it) or until none of its requests is waited for. A gRPC write is done once the
    transport holds the message, not once the server read it: without the window a busy
    server's unread messages piled up in the transport, a few requests each, and every
    request waited behind them (a GM reading one message a turn of its loop, 35-100 a
    second, while its client wrote about 150, and the tries waited seconds before its
    read). With ``send_within_s``, a request that waited that long in the outbox is
    answered ``NotSent`` and never sent."""

    def __init__(
        self,
        open_call: Callable[[], grpc.aio.StreamStreamCall],
        wrap: Callable[[int, Request], Any],
        unwrap: Callable[[Any], Answers],
        what: str,
        wrap_many: Callable[[list[tuple[int, Request, int]]], Any] | None = None,
        window: int = WINDOW,
        send_within_s: float | None = None,
    ) -> None:
        self._open_call = open_call
        self._wrap = wrap
        self._unwrap = unwrap
        self._wrap_many = wrap_many
        self._what = what
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()  # grpc.aio allows one write at a time per call
        # With wrap_many: not written yet, with when each was asked (wall clock, ns).
        self._outbox: list[tuple[int, Request, int]] = []
        self._writer: asyncio.Task[None] | None = None
        self.written = 0  # stream messages written (fewer than requests when coalesced)
        # With wrap_many: how many messages are out unread (``window``), and for each
        # request in one, the ids of that message's requests still waited for.
        self._window = window
        self._unread = 0
        self._message_of: dict[int, set[int]] = {}
        self._room = asyncio.Event()
        self._send_within_s = send_within_s

    async def request(self, request: Request, timeout: float) -> Reply:
        rid = next(self._ids)
        reply: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = reply
        try:
            async with asyncio.timeout(timeout):
                if self._wrap_many is not None:
                    self._outbox.append((rid, request, time.time_ns()))
                    if self._writer is None or self._writer.done():
                        self._writer = asyncio.create_task(self._write_outbox())
                else:
                    async with self._write_lock:
                        await self._write(self._open(), self._wrap(rid, request))
                return await reply
        except TimeoutError:
            raise rpc_error(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no {self._what} reply in {timeout:g} s"
            ) from None
        finally:
            self._pending.pop(rid, None)
            self._settled(rid, answered=False)
            if reply.done() and not reply.cancelled():
                reply.exception()  # retrieved: a failed write already raised its own error

    async def _write(self, call: grpc.aio.StreamStreamCall, message: Any) -> None:
        try:
            await call.write(message)
            self.written += 1
        except Exception as err:
            # The stream broke (gRPC reports a write on a dead call as INTERNAL
            # "execute_batch" or as a state error): the server is away.
            self._close(call)
            details = err.details() if isinstance(err, grpc.aio.AioRpcError) else err
            raise rpc_error(
                grpc.StatusCode.UNAVAILABLE, f"{self._what} stream broke: {details!r}"
            ) from None

    async def _write_outbox(self) -> None:
        """Write what waits in the outbox, as few messages as it takes, until it is
        empty; a request given up on meanwhile (its deadline) is left out."""
        assert self._wrap_many is not None
        # While it waits for room, the outbox is looked at this often for requests that
        # waited too long (``send_within_s``).
        check_s = None if self._send_within_s is None else self._send_within_s / 4
        while self._outbox:
            self._shed()
            if self._unread >= self._window:
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(check_s):
                        await self._room.wait()
                continue
            take = [one for one in self._outbox[:MAX_COALESCED] if one[0] in self._pending]
            del self._outbox[:MAX_COALESCED]
            if not take:
                continue
            message = {rid for rid, *_ in take}
            self._unread += 1
            for rid in message:
                self._message_of[rid] = message
            try:
                await self._write(self._open(), self._wrap_many(take))
            except Exception as err:  # a broken stream, or a request that cannot be sent
                for rid, *_ in take:
                    waiting = self._pending.get(rid)
                    if waiting is not None and not waiting.done():
                        waiting.set_exception(err)

    def _shed(self) -> None:
        """Answer ``NotSent`` to the requests that waited in the outbox longer than
        ``send_within_s`` (the oldest are first)."""
        if self._send_within_s is None:
            return
        now = time.time_ns()
        oldest = now - int(self._send_within_s * 1e9)
        shed = 0
        for rid, _, asked in self._outbox:
            if asked > oldest:
                break
            shed += 1
            waiting = self._pending.get(rid)
            if waiting is not None and not waiting.done():
                waiting.set_exception(NotSent(self._what, round((now - asked) / 1e9, 2)))
        del self._outbox[:shed]

    def _settled(self, rid: int, answered: bool) -> None:
        """Request ``rid`` was answered, or is not waited for any more: its message is
        read (the first answer to any of its requests), or leaves the window once none of
        its requests is waited for."""
        message = self._message_of.pop(rid, None)
        if message is None:
            return
        message.discard(rid)
        if answered or not message:
            for other in message:
                del self._message_of[other]
            self._unread -= 1
            self._room.set()

    def _open(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            self._call = self._open_call()
            self._reader = asyncio.create_task(self._read(self._call), name=f"{self._what}-stream")
        return self._call

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the server ended the {self._what} stream")
        try:
            async for message in call:
                for rid, answer in self._unwrap(message):
                    self._settled(rid, answered=True)
                    waiting = self._pending.pop(rid, None)
                    if waiting is not None and not waiting.done():
                        if isinstance(answer, grpc.aio.AioRpcError):
                            waiting.set_exception(answer)
                        else:
                            waiting.set_result(answer)
        except grpc.aio.AioRpcError as err:
            error = rpc_error(
                grpc.StatusCode.UNAVAILABLE,
                f"the {self._what} stream ended: {err.code().name}: {err.details()}",
            )
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the stream's owner is closing")
            raise
        finally:
            self._close(call, error)

    def _close(self, call: grpc.aio.StreamStreamCall, error: Exception | None = None) -> None:
        """Forget ``call`` (the next launch opens a new stream) and fail what waits on it."""
        if self._call is call:
            self._call = None
            call.cancel()
            error = error or rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self._what} stream broke")
            for waiting in self._pending.values():
                if not waiting.done():
                    waiting.set_exception(error)
            self._pending.clear()
            self._unread = 0  # none of them will be read now
            self._message_of.clear()
            self._room.set()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._writer
        call, reader = self._call, self._reader
        if call is not None:
            self._close(call, rpc_error(grpc.StatusCode.CANCELLED, "the stream's owner is closing"))
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader


class Launcher(RequestStream[local_master_pb2.LaunchRequest, local_master_pb2.LaunchResponse]):
    """A GM's launches on one LM (``LaunchStream``; answered in order)."""

    def __init__(self, stub: local_master_pb2_grpc.LocalMasterStub) -> None:
        super().__init__(
            stub.LaunchStream,
            lambda rid, request: local_master_pb2.LaunchStreamRequest(
                request_id=rid, launch=request
            ),
            lambda message: [(message.request_id, message.launch)],
            "launch",
        )

    async def launch(
        self, request: local_master_pb2.LaunchRequest, timeout: float
    ) -> local_master_pb2.LaunchResponse:
        return await self.request(request, timeout)


class Submitter(
    RequestStream[global_master_pb2.SubmitJobRequest, global_master_pb2.SubmitJobResponse]
):
    """A client's jobs on one GM (``SubmitStream``); a refused job raises the
    ``AioRpcError`` the unary ``SubmitJob`` would have."""

    def __init__(
        self,
        stub: global_master_pb2_grpc.GlobalMasterStub,
        window: int = WINDOW,
        send_within_s: float | None = SEND_WITHIN_S,
    ) -> None:
        super().__init__(
            stub.SubmitStream,
            lambda rid, request: global_master_pb2.SubmitStreamRequest(
                request_id=rid, submit=request
            ),
            _submit_answers,
            "submit",
            wrap_many=_submit_many,
            window=window,
            send_within_s=send_within_s,
        )


def _submit_many(
    requests: list[tuple[int, global_master_pb2.SubmitJobRequest, int]],
) -> global_master_pb2.SubmitStreamRequest:
    """Jobs as one stream message, each saying when it was asked: the GM measures from it
    the wait in front of its read (``services/core/admission.py``, ``QueueingDelay``)."""
    (rid, first, asked), rest = requests[0], requests[1:]
    return global_master_pb2.SubmitStreamRequest(
        request_id=rid,
        submit=first,
        asked_unix_nanos=asked,
        more_jobs=[
            global_master_pb2.SubmitStreamRequest(request_id=r, submit=q, asked_unix_nanos=at)
            for r, q, at in rest
        ],
    )


def _submit_answers(
    message: global_master_pb2.SubmitStreamResponse,
) -> list[tuple[int, global_master_pb2.SubmitJobResponse | grpc.aio.AioRpcError]]:
    return [_submit_answer(one) for one in (message, *message.more_answers)]


def _submit_answer(
    message: global_master_pb2.SubmitStreamResponse,
) -> tuple[int, global_master_pb2.SubmitJobResponse | grpc.aio.AioRpcError]:
    if message.error_code:
        return message.request_id, rpc_error(_CODES[message.error_code], message.error_message)
    return message.request_id, message.submit


_CODES = {code.value[0]: code for code in grpc.StatusCode}
