"""Calls the end-to-end tests make on a running mesh's router and engines, outside the
request path: waiting for instances to be routable, an engine's load."""

from __future__ import annotations

import grpc

from pdmesh.serve import Child
from pdmesh.v1 import engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from tests.polling import wait_for


def wait_routable(router_address: str, count: int) -> None:
    """Until the router counts `count` healthy instances."""
    with grpc.insecure_channel(router_address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        wait_for(lambda: sum(i.healthy for i in router.GetStatus(
            router_pb2.GetStatusRequest(), timeout=5).instances) >= count,
            f"{count} instances routable")


def engine_load(child: Child, role: str) -> engine_pb2.EngineLoad:
    """`child`'s GetLoad, asked on its Prefill service (`role` "prefill") or Decode service."""
    assert child.address
    with grpc.insecure_channel(child.address) as channel:
        stub = (engine_pb2_grpc.PrefillStub(channel) if role == "prefill"
                else engine_pb2_grpc.DecodeStub(channel))
        return stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
