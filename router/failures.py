"""The failure taxonomy: what an instance's failure means for the request it was serving.

Every failed Prefill or Decode call is one of three kinds, and the kind decides what happens
next (router.proto states what the client sees):

* **unreached** (`Unreached`): the call never reached a working instance — gRPC's own
  UNAVAILABLE wording (connection refused or lost, server shutting down) or an instance's
  `refuse()` before any work — before that instance answered anything. Nothing of it reached
  the client, so it is *re-routed*: sent to another instance of the role, each instance at
  most once, within the request's deadline. A Prefill that fails through its instance's own
  fault counts here too: its answer comes before any output.
* **broken** (`Broken`): a Decode stream that failed through its instance's fault after the
  instance answered (the process died, UNAVAILABLE, INTERNAL, a lost connection, the call
  cancelled under the router, a stream without its result, no progress). It is *migrated*:
  resumed on another decode instance after what the client already has.
* **about the request** (`PASS_THROUGH`: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...): the
  instance's answer goes to the client as it is, never retried elsewhere.

A request that fails before any output becomes a `RouteError`, which the server turns into a
gRPC status; UNAVAILABLE carries a retry hint.
"""

from __future__ import annotations

import asyncio

import grpc

from pdmesh.grpc_common import refused_reason
from pdmesh.router.instance import Instance

# Statuses that say the instance itself is broken, not the request. CANCELLED comes back
# as a status only when the far end cut the call (the router's own cancellations raise
# CancelledError instead): its server tore the call down.
INSTANCE_FAULTS = frozenset({
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DATA_LOSS,
})
# gRPC's own wording when a call never reached a live server or the server went away before
# answering; our servicers word their UNAVAILABLE aborts differently ("KV transfer ...").
_UNREACHED_DETAILS = (
    ("failed to connect", "unreachable"),
    ("connection refused", "unreachable"),
    ("cancelling all calls", "shutting_down"),  # grpc server stop(): in-flight calls cut
    ("goaway", "shutting_down"),
    ("socket closed", "connection_lost"),
    ("connection reset", "connection_lost"),
    ("broken pipe", "connection_lost"),
)
UNAVAILABLE_RETRY_AFTER_S = 1.0
"""The retry hint sent with UNAVAILABLE: about a poll interval, when membership is known anew."""
# Statuses an instance may return that mean the same to the client.
PASS_THROUGH = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,
})


class RouteError(Exception):
    """A request that fails before any output: the server turns it into a gRPC status.

    `retry_after_s` (default for UNAVAILABLE) goes back as the retry hint trailing metadata."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None
    ) -> None:
        self.code = code
        if retry_after_s is None and code == grpc.StatusCode.UNAVAILABLE:
            retry_after_s = UNAVAILABLE_RETRY_AFTER_S
        self.retry_after_s = retry_after_s
        super().__init__(message)


class Unreached(Exception):
    """A call that failed before anything of it reached the client and may go to another
    instance: it never reached a working instance (or, for Prefill, whose answer comes before
    any output, the instance failed with a fault of its own). Re-route it, or fail with
    `error`."""

    def __init__(self, error: RouteError, reason: str) -> None:
        self.error = error
        self.reason = reason  # low-cardinality metric label
        super().__init__(str(error))


class Broken(Exception):
    """A Decode stream that broke through its instance's fault before the request finished
    (its instance already cleaned up): migrate it, or fail with `error`."""

    def __init__(self, error: RouteError, reason: str) -> None:
        self.error = error
        self.reason = reason  # low-cardinality metric label
        super().__init__(str(error))


def unreached_reason(exc: grpc.aio.AioRpcError) -> str | None:
    """Why a call failed without reaching a working instance ("unreachable",
    "connection_lost", "shutting_down", or the reason of an instance's `refuse()`), or None
    when the instance itself answered with an error. Only these failures are safe to send to
    another instance."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    refused = refused_reason(exc)
    if refused is not None:
        return refused
    details = (exc.details() or "").lower()
    return next((reason for marker, reason in _UNREACHED_DETAILS if marker in details), None)


def is_instance_fault(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the instance answered with a fault of its own (INTERNAL, UNAVAILABLE, ...),
    not an answer about the request (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...)."""
    return exc.code() in INSTANCE_FAULTS


def fault_reason(exc: grpc.aio.AioRpcError) -> str | None:
    """"instance_fault" for an instance's fault of its own (`is_instance_fault`); else None."""
    return "instance_fault" if is_instance_fault(exc) else None


def broken_reason(exc: grpc.aio.AioRpcError) -> str:
    """Why a Decode stream broke, as a metric label (connection_lost, unavailable, ...)."""
    return unreached_reason(exc) or exc.code().name.lower()


def cancelled_from_outside() -> bool:
    """Whether the running task was asked to cancel (its client went away, shutdown), as
    opposed to a CancelledError raised by a gRPC call that was cancelled under it."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _where(instance: Instance, what: str) -> str:
    return f"{what} instance {instance.instance_id or '?'} at {instance.address}"


def instance_error(instance: Instance, what: str, exc: grpc.aio.AioRpcError) -> RouteError:
    """The status a failed `what` ("prefill", "decode") call on `instance` means to the
    client: the instance's own where it is about the request, UNAVAILABLE otherwise."""
    code = exc.code()
    message = f"{_where(instance, what)} failed: {code.name}: {exc.details()}"
    if code in PASS_THROUGH:
        return RouteError(code, message)
    return RouteError(grpc.StatusCode.UNAVAILABLE, message)


def stalled_error(instance: Instance, what: str, quiet_s: float) -> RouteError:
    """The status of a call whose progress watchdog fired after `quiet_s` of silence."""
    return RouteError(grpc.StatusCode.UNAVAILABLE,
                      f"{_where(instance, what)} made no progress for {quiet_s:.1f}s")


def cancelled_under_us(instance: Instance, what: str) -> RouteError:
    """The status of a call cancelled under the router (its channel closed)."""
    return RouteError(grpc.StatusCode.UNAVAILABLE,
                      f"{what} call to {instance.address} was cancelled (channel closed)")
