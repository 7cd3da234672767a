"""Requests parsed where their call can still answer: bad bytes and oversized ids are
INVALID_ARGUMENT, with a reason a person can read.

    bytes ──(gRPC: no deserializer)──▶ CheckedRequests ──parse, check ids──▶ servicer
                                            └── bad ──▶ INVALID_ARGUMENT

gRPC parses a request before the servicer runs, and a parse that fails ends the call
UNKNOWN ("Unexpected <class 'DecodeError'>"), a code that says nothing of whose fault it
is. On a stream the servicer sees the error instead, and may end the stream as if the
client had left. So every service (``Service``) takes its requests as bytes and parses
them here, in the call, through its context: a request that is no valid message ends the
call INVALID_ARGUMENT, and so does one whose top-level ids (``*_id``, ``*_ids`` and
``queue`` fields: job, task, node and queue names) are longer than ``MAX_ID_BYTES``,
with the id cut short in the message. Ids nested in messages are the services' to check
(a task's, by ``parse_task``).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message

from services.core.ids import id_problem

if TYPE_CHECKING:
    from services.common.authz import Authorizer

MAX_DETAILS_CHARS = 300  # of a parse error quoted back to the client


def ids_problem(request: Message) -> str | None:
    """Why one of ``request``'s top-level ids cannot be, or None."""
    for field, value in request.ListFields():
        name = field.name
        if field.type != field.TYPE_STRING or not (
            name.endswith(("_id", "_ids")) or name == "queue"
        ):
            continue
        for one in (value,) if isinstance(value, str) else value:
            if (problem := id_problem(name, one)) is not None:
                return problem
    return None


class CheckedRequests(grpc.aio.ServerInterceptor):
    """Makes each method take bytes and parse them itself (see the module docstring).
    Handlers whose behaviour is not a coroutine or async generator are left as they are."""

    def __init__(self, authorizer: Authorizer | None = None) -> None:
        self.authorizer = authorizer  # checks each call after its parse (authz.py)
        # Per method: the handler gRPC gave, and what it is served as instead.
        self._handlers: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        known = self._handlers.get(details.method)
        if known is None or known[0] is not handler:
            known = self._handlers[details.method] = (
                handler,
                _checked(handler, details.method, self.authorizer),
            )
        return known[1]


async def _parse(raw: bytes, parse: Callable[[bytes], Any], method: str, context) -> Any:
    try:
        request = parse(raw)
    except Exception as err:  # DecodeError, or whatever a deserializer raises
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the bytes sent are not a valid {method} request: {err}"[:MAX_DETAILS_CHARS],
        )
    if isinstance(request, Message) and (problem := ids_problem(request)) is not None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
    return request


class _ParsingContext:
    """A servicer context whose ``read`` parses (``WorkerHeartbeats`` reads its stream
    with ``context.read``); everything else is the call's own context."""

    def __init__(
        self, context, parse: Callable[[bytes], Any], method: str, check: Check | None = None
    ) -> None:
        self._context = context
        self._parse = parse
        self._method = method
        self._check = check

    async def _one(self, raw: bytes) -> Any:
        request = await _parse(raw, self._parse, self._method, self._context)
        if self._check is not None:
            await self._check(request)
        return request

    async def read(self) -> Any:
        raw = await self._context.read()
        if raw is grpc.aio.EOF:
            return raw
        return await self._one(raw)

    async def requests(self, raw_requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        async for raw in raw_requests:
            yield await self._one(raw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


Check = Callable[[Any], Awaitable[None]]


async def _authorized(authz: Authorizer | None, method: str, context) -> Check | None:
    """The call's role checked (PERMISSION_DENIED if refused); then the check of each of
    its requests (None without authorization)."""
    if authz is None:
        return None
    who = await authz.check_call(method, context)

    async def check(request: Any) -> None:
        await authz.check(method, request, context, who)

    return check


async def _answered(
    behavior: Callable, request: Any, context, method: str, authz: Authorizer | None
) -> Any:
    """``behavior``'s answer to ``request``; with authorization, a state-changing call
    leaves its audit line once answered, with its status (``Authorizer.answered``)."""
    if authz is None:
        return await behavior(request, context)
    code = grpc.StatusCode.OK
    try:
        return await behavior(request, context)
    except BaseException:
        code = context.code() or grpc.StatusCode.UNKNOWN
        raise
    finally:
        authz.answered(method, request, code)


def _checked(
    handler: grpc.RpcMethodHandler, method: str, authz: Authorizer | None = None
) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    serialize = handler.response_serializer
    if not handler.request_streaming:
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if inspect.isasyncgenfunction(behavior):

            async def unary_replies(raw: bytes, context) -> AsyncIterator[Any]:
                check = await _authorized(authz, method, context)
                request = await _parse(raw, parse, method, context)
                if check is not None:
                    await check(request)
                async for reply in behavior(request, context):
                    yield reply

            return grpc.unary_stream_rpc_method_handler(unary_replies, None, serialize)
        if not inspect.iscoroutinefunction(behavior):
            return handler

        async def unary(raw: bytes, context) -> Any:
            check = await _authorized(authz, method, context)
            request = await _parse(raw, parse, method, context)
            if check is not None:
                await check(request)
            return await _answered(behavior, request, context, method, authz)

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(unary, None, serialize)
        return grpc.unary_unary_rpc_method_handler(unary, None, serialize)

    behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary
    if inspect.isasyncgenfunction(behavior):

        async def stream_replies(raw_requests, context) -> AsyncIterator[Any]:
            check = await _authorized(authz, method, context)
            parsing = _ParsingContext(context, parse, method, check)
            async for reply in behavior(parsing.requests(raw_requests), parsing):
                yield reply

        return grpc.stream_stream_rpc_method_handler(stream_replies, None, serialize)
    if not inspect.iscoroutinefunction(behavior):
        return handler

    async def stream(raw_requests, context) -> Any:
        check = await _authorized(authz, method, context)
        parsing = _ParsingContext(context, parse, method, check)
        return await behavior(parsing.requests(raw_requests), parsing)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, None, serialize)
    return grpc.stream_unary_rpc_method_handler(stream, None, serialize)
