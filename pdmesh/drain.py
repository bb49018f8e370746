"""Graceful drain of a gRPC server: count the work calls in flight, refuse new ones once
draining, and wait (bounded) for the running ones to end.

Every pdmesh gRPC process drains the same way on SIGTERM (`GrpcServer.drain`): health turns
NOT_SERVING, calls of the gated methods (the work: Prefill, Decode, Generate) arriving from
then on are refused before any work with a retryable status, and the calls already running
finish, up to a deadline. Only then is the server stopped, which cuts whatever is left. The
small RPCs (GetLoad, Abort, ReleaseKV, health) stay open throughout: a caller must still be able
to cancel, and routers to see the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import grpc

Refusal = Callable[[grpc.aio.ServicerContext], Awaitable[None]]
"""Ends a call that arrived while draining (must raise, as `context.abort` does)."""


class DrainGate(grpc.aio.ServerInterceptor):
    """Counts the calls of `methods` (full paths, `/pdmesh.v1.Decode/Decode`) in flight; after
    `close()` it answers new ones with `refusal` instead of running them."""

    def __init__(self, methods: Collection[str], refusal: Refusal) -> None:
        self._methods = frozenset(methods)
        self._refusal = refusal
        self._inflight = 0
        self._idle: asyncio.Event | None = None
        self.closed = False

    @property
    def inflight(self) -> int:
        return self._inflight

    def close(self) -> None:
        """Refuse every gated call from now on."""
        self.closed = True

    async def wait_idle(self, timeout_s: float) -> int:
        """Until no gated call runs or `timeout_s` passed; returns how many still run."""
        if self._inflight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle_event().wait(), timeout_s)
        return self._inflight

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:  # created on the server's loop, not at construction
            self._idle = asyncio.Event()
            if not self._inflight:
                self._idle.set()
        return self._idle

    def _enter(self, context: grpc.aio.ServicerContext) -> Callable[[], None]:
        """Count one call in; returns the (idempotent) way out. The call also leaves when gRPC
        ends the RPC (done callback): a streaming handler whose client cancelled while the
        server was writing is left suspended at a `yield`, and its `finally` would run only
        when the garbage collector gets to the generator — in an idle, draining process that
        can be never, and the drain then waited out its whole timeout."""
        self._inflight += 1
        self._idle_event().clear()
        left = False

        def leave(*_: Any) -> None:
            nonlocal left
            if left:
                return
            left = True
            self._inflight -= 1
            if not self._inflight:
                self._idle_event().set()

        with contextlib.suppress(AttributeError, RuntimeError):
            context.add_done_callback(leave)
        return leave

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._methods:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._gate_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._gate_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # client-streaming methods are not gated (pdmesh has none)

    def _gate_unary(self, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        async def gated(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if self.closed:
                await self._refusal(context)
            leave = self._enter(context)
            try:
                return await behavior(request, context)
            finally:
                leave()

        return gated

    def _gate_stream(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        # gRPC runs an async-generator handler by iterating it and a coroutine handler (one
        # that writes with context.write) by awaiting it: keep the kind.
        if inspect.isasyncgenfunction(behavior):

            async def gated_gen(request: Any, context: grpc.aio.ServicerContext
                                ) -> AsyncIterator[Any]:
                if self.closed:
                    await self._refusal(context)
                leave = self._enter(context)
                responses = behavior(request, context)
                try:
                    async for response in responses:
                        yield response
                finally:
                    leave()
                    await responses.aclose()  # its cleanup runs now, not at GC

            return gated_gen

        async def gated(request: Any, context: grpc.aio.ServicerContext) -> None:
            if self.closed:
                await self._refusal(context)
            leave = self._enter(context)
            try:
                await behavior(request, context)
            finally:
                leave()

        return gated
