"""One long-lived ``LaunchStream`` per LM: a GM's launches as stream messages, not calls.

    launch(request) ──write (request_id)──▶ LM ──responses, in order──▶ reader ──▶ its future

A unary call costs a new HTTP/2 stream, headers and trailers each way; the GM sends one
launch per scheduling round per LM, so at a few hundred tasks per second the calls were a
visible share of its CPU. Failures look like the unary call's: any broken stream, a
deadline, or an LM that went away raise ``grpc.aio.AioRpcError`` for every launch on it,
and the next launch opens a new stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import grpc

from services._proto.megha.v1 import local_master_pb2, local_master_pb2_grpc


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Launcher:
    """Launches on one LM over one stream; opened lazily, reopened after a failure."""

    def __init__(self, stub: local_master_pb2_grpc.LocalMasterStub) -> None:
        self._stub = stub
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[local_master_pb2.LaunchResponse]] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()  # grpc.aio allows one write at a time per call

    async def launch(
        self, request: local_master_pb2.LaunchRequest, timeout: float
    ) -> local_master_pb2.LaunchResponse:
        rid = next(self._ids)
        message = local_master_pb2.LaunchStreamRequest(request_id=rid, launch=request)
        reply: asyncio.Future[local_master_pb2.LaunchResponse] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[rid] = reply
        try:
            async with asyncio.timeout(timeout):
                async with self._write_lock:
                    call = self._open()
                    try:
                        await call.write(message)
                    except Exception as err:
                        # The stream broke (gRPC reports a write on a dead call as
                        # INTERNAL "execute_batch" or as a state error): the LM is away.
                        self._close(call)
                        details = err.details() if isinstance(err, grpc.aio.AioRpcError) else err
                        raise rpc_error(
                            grpc.StatusCode.UNAVAILABLE, f"launch stream broke: {details!r}"
                        ) from None
                return await reply
        except TimeoutError:
            raise rpc_error(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no launch reply in {timeout:g} s"
            ) from None
        finally:
            self._pending.pop(rid, None)
            if reply.done() and not reply.cancelled():
                reply.exception()  # retrieved: a failed write already raised its own error

    def _open(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            self._call = self._stub.LaunchStream()
            self._reader = asyncio.create_task(self._read(self._call), name="gm-launch-stream")
        return self._call

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the LM ended the launch stream")
        try:
            async for reply in call:
                waiting = self._pending.pop(reply.request_id, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(reply.launch)
        except grpc.aio.AioRpcError as err:
            error = rpc_error(
                grpc.StatusCode.UNAVAILABLE,
                f"the launch stream ended: {err.code().name}: {err.details()}",
            )
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the GM is shutting down")
            raise
        finally:
            self._close(call, error)

    def _close(self, call: grpc.aio.StreamStreamCall, error: Exception | None = None) -> None:
        """Forget ``call`` (the next launch opens a new stream) and fail what waits on it."""
        if self._call is call:
            self._call = None
            call.cancel()
            error = error or rpc_error(grpc.StatusCode.UNAVAILABLE, "launch stream broke")
            for waiting in self._pending.values():
                if not waiting.done():
                    waiting.set_exception(error)
            self._pending.clear()

    async def close(self) -> None:
        call, reader = self._call, self._reader
        if call is not None:
            self._close(call, rpc_error(grpc.StatusCode.CANCELLED, "the GM is shutting down"))
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
