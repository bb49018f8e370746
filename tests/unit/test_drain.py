"""The drain gate (pdmesh/drain.py) on a real grpc.aio server: running work calls are counted
and run to their end after the drain began; new ones are refused before any work with the
refused-before-work marker; the small calls stay open; both handler kinds (async generator,
coroutine writing with context.write) keep working through the gate."""

from __future__ import annotations

import asyncio
import gc
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import grpc
import pytest

from pdmesh.grpc_common import DRAINING, GrpcServer, refused_reason
from pdmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

DECODE = "/pdmesh.v1.Decode/Decode"
GENERATE = "/pdmesh.v1.Router/Generate"


class SlowDecode(engine_pb2_grpc.DecodeServicer):
    """Streams `steps` messages, each after `release` is set once (async-generator handler)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.calls = 0

    async def Decode(self, request: engine_pb2.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[engine_pb2.DecodeResponse]:
        self.calls += 1
        self.started.set()
        yield engine_pb2.DecodeResponse()
        await self.release.wait()
        yield engine_pb2.DecodeResponse()

    async def GetLoad(self, request: engine_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> engine_pb2.EngineLoad:
        return engine_pb2.EngineLoad(num_running=self.calls)


class WritingRouter(router_pb2_grpc.RouterServicer):
    """A Generate that writes with context.write (coroutine handler), like the router's."""

    async def Generate(self, request: router_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        await context.write(router_pb2.GenerateResponse())


@pytest.mark.fast
@pytest.mark.anyio
async def test_running_calls_finish_new_ones_are_refused_small_calls_stay_open() -> None:
    decode, router = SlowDecode(), WritingRouter()
    server = GrpcServer(["pdmesh.v1.Decode", "pdmesh.v1.Router"],
                        drain_methods=[DECODE, GENERATE])
    engine_pb2_grpc.add_DecodeServicer_to_server(decode, server.server)
    router_pb2_grpc.add_RouterServicer_to_server(router, server.server)
    address = await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.DecodeStub(channel)
            router_stub = router_pb2_grpc.RouterStub(channel)
            assert len([r async for r in router_stub.Generate(router_pb2.GenerateRequest())]) == 1
            running = stub.Decode(engine_pb2.DecodeRequest(request_id="r1"))
            first = await running.read()
            assert first == engine_pb2.DecodeResponse()
            assert server.gate.inflight == 1

            drain = asyncio.create_task(server.drain(timeout_s=30))
            await asyncio.sleep(0)  # the drain has begun: health NOT_SERVING, gate closed
            while not server.gate.closed:
                await asyncio.sleep(0.01)
            for call in (stub.Decode(engine_pb2.DecodeRequest(request_id="r2")),
                         router_stub.Generate(router_pb2.GenerateRequest())):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in call:
                        pass
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert refused_reason(refused.value) == DRAINING
            assert decode.calls == 1, "a refused call reached the servicer"
            load = await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
            assert load.num_running == 1  # not gated: routers still see the load
            assert not drain.done()

            decode.release.set()
            assert await running.read() == engine_pb2.DecodeResponse()
            assert await running.code() == grpc.StatusCode.OK
            assert await asyncio.wait_for(drain, 10) == 0
    finally:
        await server.stop(grace_s=0)


@pytest.mark.fast
@pytest.mark.anyio
async def test_drain_timeout_returns_what_still_runs() -> None:
    decode = SlowDecode()
    server = GrpcServer(["pdmesh.v1.Decode"], drain_methods=[DECODE])
    engine_pb2_grpc.add_DecodeServicer_to_server(decode, server.server)
    address = await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = engine_pb2_grpc.DecodeStub(channel).Decode(engine_pb2.DecodeRequest())
            await call.read()
            assert await server.drain(timeout_s=0.2) == 1
            await server.stop(grace_s=0)  # cuts it
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await call.read()
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
            # The handler unwinds on the server's side after the client saw the cut: poll,
            # bounded, for its count to come back.
            deadline = asyncio.get_running_loop().time() + 5.0
            while server.gate.inflight and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert server.gate.inflight == 0
    finally:
        await server.stop(grace_s=0)


class FloodDecode(engine_pb2_grpc.DecodeServicer):
    """Streams 1 MB messages until cancelled: the server ends up blocked writing to a client
    that stopped reading. Counts the calls whose cleanup (`finally`) ran."""

    def __init__(self) -> None:
        self.cleaned = 0
        self.cleaned_event = asyncio.Event()

    async def Decode(self, request: engine_pb2.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[engine_pb2.DecodeResponse]:
        big = engine_pb2.DecodeResponse(delta=common_pb2.SequenceDelta(text="x" * (1 << 20)))
        try:
            for _ in range(1000):
                yield big
        finally:
            self.cleaned += 1
            self.cleaned_event.set()


@pytest.mark.fast
@pytest.mark.anyio
async def test_a_stream_cancelled_while_the_server_writes_leaves_the_gate() -> None:
    """The client stops reading and cancels while the server waits to write: the call leaves
    the gate when gRPC ends the RPC (its done callback), and the handler's own cleanup (its
    `finally`: in a real servicer, aborting the request and freeing its KV blocks) runs then
    too, as gRPC drops the generator: with the garbage collector off, nothing relies on it."""
    server = GrpcServer(["pdmesh.v1.Decode"], drain_methods=[DECODE],
                        max_message_bytes=4 << 20)
    flood = FloodDecode()
    engine_pb2_grpc.add_DecodeServicer_to_server(flood, server.server)
    address = await server.start()
    gc.disable()
    try:
        options = [("grpc.max_receive_message_length", 4 << 20)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            for i in range(3):
                call = engine_pb2_grpc.DecodeStub(channel).Decode(engine_pb2.DecodeRequest())
                await call.read()  # the next 1 MB messages overflow the flow-control window
                call.cancel()
                assert await server.gate.wait_idle(5) == 0
                await asyncio.wait_for(flood.cleaned_event.wait(), 5)
                flood.cleaned_event.clear()
                assert flood.cleaned == i + 1
    finally:
        gc.enable()
        await server.stop(grace_s=0)


# -- the exit watchdog: a process never outlives its drain deadline by more than a bound -------
_SERVICE = """
import asyncio, sys, time
import pdmesh.grpc_common as grpc_common
grpc_common.TEARDOWN_BOUND_S = 0.5

async def main() -> None:
    stop = asyncio.Event()
    grpc_common.install_shutdown_signals(stop, drain_timeout_s=0.0)
    print("ready", flush=True)
    await stop.wait()
    if sys.argv[1] == "stuck":
        time.sleep(60)  # a teardown blocked inside a library, event loop included

asyncio.run(main())
"""


def _signal_service(mode: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, "-c", _SERVICE, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.processes
def test_a_stuck_shutdown_dumps_its_stacks_and_exits_1() -> None:
    done = _signal_service("stuck")
    assert done.returncode == 1
    assert "Timeout (0:00:00.500000)!" in done.stderr
    assert "in main" in done.stderr  # the frame that was stuck, for the operator


@pytest.mark.processes
def test_a_clean_shutdown_is_not_touched_by_the_watchdog() -> None:
    done = _signal_service("clean")
    assert done.returncode == 0
    assert "Timeout" not in done.stderr


@pytest.mark.fast
@pytest.mark.anyio
async def test_a_stuck_teardown_step_is_bounded_and_named(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    """`await_bounded` gives up on a step that never ends (even one that swallows its
    cancellation, as a buggy client library may) and names it; a step that ends is awaited."""
    import io
    import logging

    from pdmesh.grpc_common import await_bounded, dump_tasks

    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # swallowed

    async def quick() -> int:
        return 1

    with caplog.at_level(logging.WARNING, logger="pdmesh.grpc_common"):
        assert not await await_bounded("the stubborn close", stubborn(), 0.2)
        assert await await_bounded("the quick close", quick(), 5.0)
    assert "the stubborn close did not finish within 0.2s" in caplog.text
    assert "quick" not in caplog.text
    out = io.StringIO()
    dump_tasks(out)
    assert "stubborn" in out.getvalue()  # still pending: where a stuck shutdown waits
    release.set()
    await asyncio.sleep(0)
