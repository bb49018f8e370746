"""A request's run with its KV streamed by chunk (`--kv-stream-chunks`, the default).

The router calls `PrefillStream` instead of `Prefill`, and starts Decode as soon as its first
message names the growing export, so the decode instance pulls each chunk's blocks while the
next one computes; when the prefill ends its first tokens go to the client and to the decode
instance (`Decode.PrefillDone`). A prefill that fails before its end cancels that Decode call
(its pull stops, its blocks come back) and the request is re-planned as after any prefill
failure: nothing reached the client yet. An instance that cannot stream (staged ucxx, an older
peer) is asked `Prefill` (`execute` returns False having done nothing).

A part of the request's run (router/request_run.py), which it delegates to: its state (plan,
responses, recovery) and its calls (`decode`, `finish`, ...) stay on the `RequestRun`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from pdmesh.router.failures import (
    RouteError,
    Unreached,
    cancelled_from_outside,
    cancelled_under_us,
    fault_reason,
    unreached_reason,
)
from pdmesh.router.instance import Instance
from pdmesh.router.watchdog import CallWatch
from pdmesh.tracing import inject_metadata
from pdmesh.v1 import engine_pb2, kv_transfer_pb2

if TYPE_CHECKING:
    from pdmesh.router.request_run import Remote, RequestRun


class _CannotStream(Exception):
    """The prefill instance does not serve PrefillStream (staged ucxx, an older peer)."""


class StreamedPrefill:
    """The streamed-prefill path of one `RequestRun` (module docstring)."""

    def __init__(self, run: RequestRun) -> None:
        self.run = run

    async def execute(self) -> bool:
        """The request's run with its KV streamed by chunk (module docstring); False, having
        done nothing, when the prefill instance cannot stream (the caller asks `Prefill`)."""
        req, prefill = self.run.req, self.run.plan.prefill
        assert prefill is not None
        loan, timeout = await self.run.lend_prefix(prefill)
        message = engine_pb2.PrefillRequest(
            **req.engine_fields(), peer_prefix=loan.peer if loan is not None else None)
        call = prefill.prefill_stub().PrefillStream(
            message, timeout=timeout, metadata=inject_metadata())
        decode: asyncio.Future[None] | None = None

        def start_decode(kv: kv_transfer_pb2.KVHandle) -> None:
            nonlocal decode
            if decode is None:
                decode = asyncio.ensure_future(self.run.decode(
                    self.run.plan.decode, engine_pb2.RemotePrefill(kv=kv, streamed=True), []))

        try:
            resp = await self._prefill_stream(call, prefill, start_decode)
        except _CannotStream:
            self.run.prefix_unused(loan, "prefill instance cannot stream")
            return False
        except Unreached as failure:
            self.run.prefix_unused(loan, "prefill call failed")
            if decode is not None:
                await self._stop_streamed_decode(decode)
            return await self._replan_after_prefill(prefill, failure)
        except BaseException:
            self.run.prefix_unused(loan, "prefill call failed")
            call.cancel()
            if decode is not None:
                await self._stop_streamed_decode(decode)
            raise
        self.run.prefix_pulled(loan, resp.peer_prefix if resp.HasField("peer_prefix")
                               else None)
        remote = engine_pb2.RemotePrefill(kv=resp.kv, first=resp.first,
                                          cached_prompt_tokens=resp.cached_prompt_tokens)
        try:
            handed = await self._hand_over(resp, remote, decode)
        except BaseException:
            # Refused, cancelled (the client left) or failed before a Decode call took the
            # KV over: the streamed call would wait for first tokens that never come, and the
            # export is still ours to release.
            if decode is not None and not decode.done():
                await self._stop_streamed_decode(decode)
            if resp.HasField("kv"):
                self.run.ctx.cleanup.release_kv(prefill, req.request_id, resp.kv.transfer_id,
                                                "request ended before decode")
            raise
        if not resp.HasField("kv"):  # every sequence finished on the prefill instance
            await self.run.finish()
        else:  # the streamed call decodes, or else a fresh one, the unary way
            await self.run.decode_rerouting(remote, started=decode if handed else None)
        return True

    async def _hand_over(self, resp: engine_pb2.PrefillResponse,
                         remote: engine_pb2.RemotePrefill,
                         decode: asyncio.Future[None] | None) -> bool:
        """The prefill ended: its first tokens to the client, then to the streamed Decode
        call; True when that call took them (it decodes and owns the KV from now on), else
        it is stopped. A refusal of the request by the decode instance goes up first."""
        refused = decode.exception() if decode is not None and decode.done() \
            and not decode.cancelled() else None
        if isinstance(refused, RouteError):  # about the request (e.g. it can never fit
            raise refused                    # there): fail it before any output goes out
        await self._first_tokens(resp)
        if decode is None:
            return False
        if resp.HasField("kv") and await self._prefill_done_to_decode(self.run.plan.decode,
                                                                      remote):
            return True
        await self._stop_streamed_decode(decode)
        return False

    async def _prefill_stream(self, call: grpc.aio.UnaryStreamCall, instance: Instance,
                              on_handle: Callable[[kv_transfer_pb2.KVHandle], None]
                              ) -> engine_pb2.PrefillResponse:
        """Read a PrefillStream under the progress watchdog: its growing export's handle to
        `on_handle`, and its last message returned. Unreached when it fails before that;
        `_CannotStream` when the instance does not stream at all."""
        watch = CallWatch(self.run.ctx.pool, instance, call.cancel, "prefill")
        streaming = False
        try:
            async with watch:
                while True:
                    msg = await call.read()
                    if msg is grpc.aio.EOF:
                        raise Unreached(RouteError(
                            grpc.StatusCode.UNAVAILABLE,
                            f"prefill instance {instance.address} ended its stream early"),
                            "no_result")
                    watch.progressed()
                    if msg.HasField("kv"):
                        streaming = True
                        on_handle(msg.kv)
                    elif msg.HasField("done"):
                        return msg.done  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            call.cancel()
            if cancelled_from_outside():
                self.run.abort(instance, "prefill", "client cancelled")
                raise
            if watch.fired:
                raise Unreached(self.run.stalled(instance, "prefill", watch), "stalled") from None
            raise Unreached(cancelled_under_us(instance, "prefill"), "channel_closed") from None
        except grpc.aio.AioRpcError as exc:
            if not streaming and exc.code() in (grpc.StatusCode.UNIMPLEMENTED,
                                                grpc.StatusCode.FAILED_PRECONDITION):
                raise _CannotStream from None
            error = self.run.failed(instance, "prefill", exc)
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                              grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise error from None  # about the request: no instance does better
            raise Unreached(error, unreached_reason(exc) or fault_reason(exc)
                            or exc.code().name.lower()) from None

    async def _first_tokens(self, resp: engine_pb2.PrefillResponse) -> None:
        """The prefill's answer to the client, as `RequestRun._prefill` sends it (a failure
        here releases its export: `execute`)."""
        self.run.prefill_resp = resp
        self.run.responses.timings.append(resp.timing)
        await self.run.responses.send_prompt_logprobs(resp.prompt_logprobs)
        for delta in resp.first:
            await self.run.responses.emit(delta)

    async def _prefill_done_to_decode(self, decode: Instance,
                                      remote: engine_pb2.RemotePrefill) -> bool:
        """Hand the first tokens to the streamed Decode call; False when they did not get
        there (that call would wait for them until cancelled)."""
        try:
            reply = await decode.decode_stub().PrefillDone(
                engine_pb2.PrefillDoneRequest(request_id=self.run.req.request_id,
                                              remote_prefill=remote),
                timeout=max(min(self.run.req.remaining_s(), 10.0), 0.001),
                metadata=inject_metadata())
        except grpc.aio.AioRpcError as exc:
            trace.get_current_span().add_event("pdmesh.prefill_done_failed", {
                "pdmesh.decode.address": decode.address, "grpc.status": exc.code().name})
            return False
        return bool(reply.accepted)

    async def _stop_streamed_decode(self, decode: asyncio.Future[None]) -> None:
        """Stop a streamed Decode call that will not decode (its pull stops, its blocks are
        freed, the transfer is released): cancel it, then abort the request there and wait
        for the answer, so that a Decode call of the re-planned request on the same instance
        (a local prefill) never meets the old one or its abort."""
        instance = self.run.plan.decode
        self.run.superseded = True
        try:
            decode.cancel()
            await asyncio.wait([decode])
            if not decode.cancelled():
                decode.exception()  # retrieved: superseded by the prefill's failure
        finally:
            self.run.superseded = False
        remaining = self.run.req.deadline - time.monotonic()
        if remaining <= 0:
            return  # nothing re-planned will come; the cancelled call's end aborts it there
        # (Unreachable: a re-planned call there fails and is re-routed as usual.)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await instance.decode_stub().Abort(
                engine_pb2.AbortRequest(request_id=self.run.req.request_id,
                                        reason="streamed prefill failed"),
                timeout=min(remaining, 10.0), metadata=inject_metadata())

    async def _replan_after_prefill(self, prefill: Instance, failure: Unreached) -> bool:
        """The streamed prefill failed before its end (nothing reached the client): re-plan
        as `RequestRun.prefill_rerouting` does, then run the unary way."""
        self.run.abort(prefill, "prefill", "re-routed")
        remote: Remote = None
        try:
            self.run.recovery.reroute("prefill", prefill, failure)
        except RouteError as final:
            if final.code != grpc.StatusCode.UNAVAILABLE:  # deadline exceeded
                raise
            self.run.recovery.prefill_locally(prefill, failure)
        if self.run.plan.prefill is not None:
            remote = await self.run.prefill_rerouting()
            if remote is None and self.run.plan.prefill is not None:
                await self.run.finish()
                return True
        await self.run.decode_rerouting(remote)
        return True

