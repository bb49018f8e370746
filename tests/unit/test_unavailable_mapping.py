"""An unreachable backend, from the failed gRPC call to the HTTP answer: which failures the
router re-routes, the retry hint it attaches, and the gateway's 503 + Retry-After."""

from __future__ import annotations

import grpc
import pytest

from pdmesh.gateway.errors import RETRY_AFTER_KEY, error_from_rpc
from pdmesh.router.failures import UNAVAILABLE_RETRY_AFTER_S, RouteError, unreached_reason

pytestmark = pytest.mark.fast


def rpc_error(code: grpc.StatusCode, details: str,
              trailing: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing),
                                details=details)


@pytest.mark.parametrize(("code", "details", "reason"), [
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
     "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused", "unreachable"),
    (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls", "shutting_down"),
    (grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)", "connection_lost"),
    # The instance answered: its own refusal is not retried elsewhere.
    (grpc.StatusCode.UNAVAILABLE, "KV transfer from 127.0.0.1:9 failed (KVTimeout): late", None),
    (grpc.StatusCode.INVALID_ARGUMENT, "failed to connect", None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "KV cache full", None),
    (grpc.StatusCode.INTERNAL, "Socket closed", None),
])
def test_only_grpc_own_unavailable_is_rerouted(
    code: grpc.StatusCode, details: str, reason: str | None
) -> None:
    assert unreached_reason(rpc_error(code, details)) == reason


def test_unavailable_route_errors_carry_a_retry_hint() -> None:
    assert RouteError(grpc.StatusCode.UNAVAILABLE, "x").retry_after_s == UNAVAILABLE_RETRY_AFTER_S
    assert RouteError(grpc.StatusCode.UNAVAILABLE, "x", retry_after_s=4).retry_after_s == 4
    assert RouteError(grpc.StatusCode.INVALID_ARGUMENT, "x").retry_after_s is None


def test_gateway_maps_unavailable_to_503_with_the_routers_retry_hint() -> None:
    hinted = error_from_rpc(rpc_error(grpc.StatusCode.UNAVAILABLE, "no decode instance left",
                                      ((RETRY_AFTER_KEY, "2500"),)))
    assert hinted.status == 503
    assert hinted.headers == {"Retry-After": "3"}
    assert hinted.body() == {"error": {"message": "no decode instance left",
                                       "type": "Service Unavailable", "param": None,
                                       "code": 503}}
    plain = error_from_rpc(rpc_error(grpc.StatusCode.UNAVAILABLE, ""))  # e.g. no router
    assert (plain.status, plain.headers) == (503, {"Retry-After": "1"})


@pytest.mark.parametrize(("code", "status"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400),
    (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (grpc.StatusCode.INTERNAL, 500),
])
def test_other_statuses_keep_their_mapping(code: grpc.StatusCode, status: int) -> None:
    assert error_from_rpc(rpc_error(code, "why")).status == status
