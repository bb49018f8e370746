"""The prefill role's part of an engine process: the Prefill servicer, publishing its exports
on the process's KV sender (`engine_svc/kv_peer.py`; see `pdmesh.engine_svc.process`)."""

from __future__ import annotations

import grpc

from pdmesh.engine_svc.service import EngineService
from pdmesh.metrics import EngineMetrics
from pdmesh.prefill_svc.servicer import PrefillServicer
from pdmesh.v1 import engine_pb2, engine_pb2_grpc


class PrefillPart:
    service_name = engine_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
    work_methods = (f"/{service_name}/Prefill", f"/{service_name}/PrefillStream")
    kv_address = ""  # the process's KV sender is the KV peer part's

    def __init__(self, service: EngineService, metrics: EngineMetrics) -> None:
        peer = service.kv_peer
        if peer is None:
            raise RuntimeError("the prefill role needs the process's KV sender")
        self.servicer = PrefillServicer(service, metrics=metrics)
        self.servicer.sender = peer.sender
        peer.on_release(self.servicer.on_release)

    async def start(self, server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_PrefillServicer_to_server(self.servicer, server)

    def pending(self) -> int:
        return 0  # its exports are the KV sender's (the KV peer part waits for them)

    async def stop(self) -> None:
        pass  # the KV peer part's sender releases every lease
