"""Requests that do not decode are the caller's fault: INVALID_ARGUMENT, not UNKNOWN.

grpc decodes a request with the method's deserializer before any servicer code runs, and a
`DecodeError` there (a corrupt wire format, invalid UTF-8 in a string field) reaches the
client as UNKNOWN "Exception deserializing request!", which reads like a server bug and is
retried by clients that retry UNKNOWN. This interceptor, the innermost of every pdmesh gRPC
server, moves decoding into the handler, where a failure aborts with INVALID_ARGUMENT naming
the message type. Only unary requests are wrapped (pdmesh has no client-streaming method).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class RequestDecoding(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        return _decoding_inside(handler, details.method)  # type: ignore[arg-type]


def _decoding_inside(handler: Any, method: str) -> Any:
    deserialize = handler.request_deserializer

    async def decode(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request to {method} does not decode: {exc}")

    if not handler.response_streaming:
        unary = handler.unary_unary
        if not inspect.iscoroutinefunction(unary):
            return handler

        async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await unary(await decode(raw, context), context)

        return handler._replace(request_deserializer=None, unary_unary=unary_unary)

    streaming = handler.unary_stream
    if inspect.isasyncgenfunction(streaming):
        async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext
                               ) -> AsyncIterator[Any]:
            async for item in streaming(await decode(raw, context), context):
                yield item
    elif inspect.iscoroutinefunction(streaming):  # writes with context.write
        async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext
                               ) -> Any:  # type: ignore[misc]
            return await streaming(await decode(raw, context), context)
    else:
        return handler
    return handler._replace(request_deserializer=None, unary_stream=unary_stream)
