"""The gateway's gRPC client to the router; its failures are raised as OpenAI errors
(gateway/errors.py maps the statuses).

One `grpc.aio` channel serves every HTTP request. `generate()` hands back a `GenerateCall`
the caller iterates and *must* close: closing an unfinished call cancels it, and the router
turns that cancellation into aborts on the prefill and decode instances, which free the
request's KV blocks. That is how an HTTP client's disconnect reaches the engines.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.gateway.errors import error_from_rpc
from pdmesh.grpc_common import TLSConfig, open_channel
from pdmesh.v1 import router_pb2, router_pb2_grpc

ROUTER_SERVICE = "pdmesh.v1.Router"


@dataclass(frozen=True)
class RouterHealth:
    """What the gateway's /health reports: can the router serve a request now, and why not."""

    serving: bool
    status: str  # the health service's status name, or UNREACHABLE
    reason: str = ""


class GenerateCall:
    """One streaming Generate call. Iterate it; `close()` cancels it if still running."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    async def initial_request_id(self) -> str:
        """The id the router runs the request under (x-request-id initial metadata)."""
        try:
            metadata = await self._call.initial_metadata()
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        for key, value in metadata or ():
            if key == "x-request-id":
                return str(value)
        return ""

    async def __aiter__(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        try:
            async for response in self._call:
                yield response
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    def close(self) -> None:
        if not self._call.done():
            self._call.cancel()


class RouterClient:
    def __init__(
        self,
        address: str,
        *,
        tls: TLSConfig | None = None,
        max_message_bytes: int,
        request_timeout_s: float,
        control_timeout_s: float,
    ) -> None:
        self.address = address
        self._channel = open_channel(address, tls, max_message_bytes)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._request_timeout_s = request_timeout_s
        self._control_timeout_s = control_timeout_s

    def generate(
        self, request: router_pb2.GenerateRequest, metadata: tuple[tuple[str, str], ...] = ()
    ) -> GenerateCall:
        """Start a Generate call; `metadata` carries e.g. the W3C trace context."""
        call = self._stub.Generate(request, timeout=self._request_timeout_s, metadata=metadata)
        return GenerateCall(call)

    async def list_models(self) -> list[router_pb2.ModelInfo]:
        try:
            response = await self._stub.ListModels(
                router_pb2.ListModelsRequest(), timeout=self._control_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        return list(response.models)

    async def tokenize(self, request: router_pb2.TokenizeRequest) -> router_pb2.TokenizeResponse:
        try:
            return await self._stub.Tokenize(request, timeout=self._control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    async def detokenize(
        self, request: router_pb2.DetokenizeRequest
    ) -> router_pb2.DetokenizeResponse:
        try:
            return await self._stub.Detokenize(request, timeout=self._control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    async def healthy(self) -> RouterHealth:
        """The router's standard health for its Router service, which is SERVING only while
        a request can be routed; when it is not, GetStatus says why."""
        try:
            response = await self._health.Check(
                health_pb2.HealthCheckRequest(service=ROUTER_SERVICE),
                timeout=self._control_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            return RouterHealth(False, "UNREACHABLE",
                                f"router unreachable: {exc.code().name}: {exc.details()}")
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        if response.status == health_pb2.HealthCheckResponse.SERVING:
            return RouterHealth(True, status)
        try:
            detail = await self._stub.GetStatus(
                router_pb2.GetStatusRequest(), timeout=self._control_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            return RouterHealth(False, status, f"router reports {status} (no status: "
                                               f"{exc.code().name})")
        return RouterHealth(False, status, detail.serving_detail or f"router reports {status}")

    async def close(self) -> None:
        await self._channel.close()
