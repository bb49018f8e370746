"""An instance that leaves the registry keeps its channel until the calls on it end.

A draining engine leaves the registry first, then finishes its running streams. The router
used to close the departed instance's channel at once, which cancelled those streams on the
router's side (the client saw `CANCELLED`, or a request failed mid-stream) although the
instance was finishing them. Real Redis, a real gRPC server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from pdmesh.engine.block_hash import HashScheme
from pdmesh.kvstore.instance_registry import InstanceInfo, InstanceRegistry
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.kvstore.redis_server import RedisServer
from pdmesh.router.failures import cancelled_from_outside
from pdmesh.router.instances import Instance, InstancePool, PoolSettings
from pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.redis_fixture import anyio_backend_fixture  # noqa: F401  (fixture by import)

pytestmark = pytest.mark.anyio
MODEL = "test/pool-retire"
TOKENS = [11, 12, 13]


class _DrainingDecode(engine_pb2_grpc.DecodeServicer):
    """Streams its first token, then the rest once `go` is set (the instance has left)."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.cancelled = False

    async def Decode(self, request: engine_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[engine_pb2.DecodeResponse]:
        try:
            for i, token in enumerate(TOKENS):
                if i == 1:
                    await self.go.wait()
                yield engine_pb2.DecodeResponse(
                    delta=common_pb2.SequenceDelta(index=0, token_ids=[token]))
            yield engine_pb2.DecodeResponse(result=engine_pb2.DecodeResult(instance_id="d"))
        except asyncio.CancelledError:
            self.cancelled = True
            raise


@contextlib.asynccontextmanager
async def serving_decode() -> AsyncIterator[tuple[_DrainingDecode, str]]:
    """A real gRPC server on 127.0.0.1 with `_DrainingDecode`; yields it and its address."""
    servicer = _DrainingDecode()
    server = grpc.aio.server()
    engine_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@dataclass
class Departed:
    """An instance that left the registry while a Decode stream ran on it."""

    servicer: _DrainingDecode
    pool: InstancePool
    instance: Instance
    call: grpc.aio.UnaryStreamCall
    first: engine_pb2.DecodeResponse


@contextlib.asynccontextmanager
async def departed_mid_stream(model: str) -> AsyncIterator[Departed]:
    """Register a decode instance, let the pool find it, start a stream on it and read its
    first message; then the instance leaves the registry (it began draining) and the pool
    polls again. Real Redis, real gRPC."""
    async with serving_decode() as (servicer, address):
        redis = RedisServer().start()
        conn = RedisConnection.from_url(redis.url, retry_after_s=0.0)
        registry = InstanceRegistry(conn, KeySpace(model=model))
        pool = InstancePool(PoolSettings(model=model, rpc_timeout_s=0.3), registry=registry)
        info = InstanceInfo.create(role="decode", address=address, model=model,
                                   scheme=HashScheme(block_size=16))
        try:
            await registry.register(info)
            await pool.poll_once()
            [instance] = pool.instances()
            call = instance.decode_stub().Decode(engine_pb2.DecodeRequest(request_id="r"),
                                                 timeout=30)
            first = await call.read()
            await registry.deregister(info.instance_id)
            await pool.poll_once()
            yield Departed(servicer, pool, instance, call, first)
        finally:
            await pool.stop()
            await conn.aclose()
            redis.stop()


@pytest.mark.redis
async def test_a_departed_instance_finishes_its_running_stream() -> None:
    async with departed_mid_stream(MODEL) as departed:
        assert list(departed.first.delta.token_ids) == TOKENS[:1]
        assert departed.pool.instances() == []  # out of routing at once

        departed.servicer.go.set()
        call, rest = departed.call, []
        while (response := await call.read()) is not grpc.aio.EOF:
            rest.append(response)
        assert [t for r in rest if r.HasField("delta") for t in r.delta.token_ids] == TOKENS[1:]
        assert rest[-1].HasField("result")
        assert await call.code() == grpc.StatusCode.OK
        assert not departed.servicer.cancelled

        # With its last call over, the channel closes: nothing new goes to the instance.
        channel = departed.instance.channel
        for _ in range(200):
            if channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.UsageError):
            await departed.instance.decode_stub().Abort(engine_pb2.AbortRequest(request_id="r"))


@pytest.mark.redis
async def test_stopping_the_pool_does_not_wait_for_a_departed_instance_s_calls() -> None:
    """The router's own shutdown does not wait out the retired channel's grace (its own calls
    were drained, or cancelled, before the pool stops)."""
    async with departed_mid_stream(MODEL + "-stop") as departed:
        await asyncio.wait_for(departed.pool.stop(), timeout=10)
        with pytest.raises(grpc.aio.UsageError):  # closing: nothing new goes out on it
            await departed.instance.decode_stub().Abort(engine_pb2.AbortRequest(request_id="r"))
        departed.call.cancel()


@pytest.mark.fast
async def test_a_call_cancelled_under_a_task_is_told_from_the_task_s_own_cancellation() -> None:
    """The router migrates a stream whose call was cancelled under it (its channel closed)
    and stops for a request whose own task was cancelled (its client went away)."""
    async with serving_decode() as (_, address):
        await _tell_apart_the_cancellations(address)


async def _tell_apart_the_cancellations(address: str) -> None:
    channels = [grpc.aio.insecure_channel(address) for _ in range(2)]
    read_first = [asyncio.Event(), asyncio.Event()]

    async def stream(i: int) -> bool:
        call = engine_pb2_grpc.DecodeStub(channels[i]).Decode(
            engine_pb2.DecodeRequest(request_id=f"r{i}"), timeout=30)
        try:
            await call.read()
            read_first[i].set()
            await call.read()
        except asyncio.CancelledError:
            return cancelled_from_outside()
        raise AssertionError("the call was not cancelled")

    try:
        under = asyncio.create_task(stream(0))
        own = asyncio.create_task(stream(1))
        await read_first[0].wait()
        await read_first[1].wait()
        await channels[0].close()  # cancels the call, not the task
        assert await under is False
        own.cancel()
        assert await own is True
    finally:
        for channel in channels:
            await channel.close()
