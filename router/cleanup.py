"""Cleanup calls: what a request leaves on an instance is freed, even after it is gone.

When a call is cancelled, re-routed, migrated or failed, the instance it was on is told to
forget the request (Abort), and a prefill instance holding its KV under a lease is told to
release it (ReleaseKV), so every block comes back before its lease would expire. These calls
run in the background: they must outlive a request whose task was cancelled, and a request
never waits on them. Shutdown waits for those still in flight (`drain`). A failure is only
logged: the instance is gone (its blocks with it) or its lease expires.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import grpc

from pdmesh.router.instance import Instance
from pdmesh.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)


class CleanupCalls:
    """Fire-and-forget Abort and ReleaseKV calls, each bounded by `rpc_timeout_s`."""

    def __init__(self, rpc_timeout_s: float) -> None:
        self.rpc_timeout_s = rpc_timeout_s
        self._background: set[asyncio.Task[Any]] = set()

    def abort(self, instance: Instance, role: str, request_id: str, reason: str) -> None:
        """Tell `instance`'s `role` ("prefill", "decode") service to forget the request."""
        self._spawn(self._abort(instance, role, request_id, reason))

    def release_kv(self, instance: Instance, request_id: str, transfer_id: str,
                   reason: str) -> None:
        """Tell the prefill `instance` to release the KV it leased for the request."""
        self._spawn(self._release_kv(instance, request_id, transfer_id, reason))

    def release_prefix(self, lender: Instance, loan_id: str, transfer_id: str,
                       reason: str) -> None:
        """Tell `lender` to drop a prefix it lent for a call that will not pull it (the call
        failed or went elsewhere); a pull already started was ended by its puller."""
        self._spawn(self._release_prefix(lender, loan_id, transfer_id, reason))

    async def _release_prefix(self, lender: Instance, loan_id: str, transfer_id: str,
                              reason: str) -> None:
        request = engine_pb2.ReleaseKVRequest(request_id=loan_id, transfer_id=transfer_id,
                                              reason=reason)
        try:
            await engine_pb2_grpc.KVPeerStub(lender.channel).ReleasePrefix(
                request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.info("ReleasePrefix on %s failed: %s", lender.address, exc.code().name)
        except grpc.aio.UsageError:  # the lender left and its channel closed: lease expires
            logger.info("ReleasePrefix on %s skipped: its channel is closed", lender.address)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for cleanup calls still in flight (shutdown)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_kv(self, instance: Instance, request_id: str, transfer_id: str,
                          reason: str) -> None:
        request = engine_pb2.ReleaseKVRequest(
            request_id=request_id, transfer_id=transfer_id, reason=reason
        )
        try:
            await instance.prefill_stub().ReleaseKV(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.info("ReleaseKV on %s failed: %s", instance.address, exc.code().name)
        except grpc.aio.UsageError:  # the instance left and its channel closed: lease expires
            logger.info("ReleaseKV on %s skipped: its channel is closed", instance.address)

    async def _abort(self, instance: Instance, role: str, request_id: str, reason: str) -> None:
        stub = instance.prefill_stub() if role == "prefill" else instance.decode_stub()
        request = engine_pb2.AbortRequest(request_id=request_id, reason=reason)
        try:
            await stub.Abort(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.debug("Abort on %s failed: %s", instance.address, exc.code().name)
        except grpc.aio.UsageError:  # the instance left and its channel closed
            logger.debug("Abort on %s skipped: its channel is closed", instance.address)
