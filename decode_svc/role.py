"""The decode role's part of an engine process: the Decode servicer and the KV receiver that
pulls a remote prefill's KV (see `pdmesh.engine_svc.process`)."""

from __future__ import annotations

import grpc

from pdmesh.decode_svc.servicer import DecodeServicer
from pdmesh.engine_svc.service import EngineService
from pdmesh.kvstore.transfer.receiver import KVReceiver, KVReceiverConfig
from pdmesh.metrics import EngineMetrics
from pdmesh.v1 import engine_pb2, engine_pb2_grpc


class DecodePart:
    service_name = engine_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
    work_methods = (f"/{service_name}/Decode",)
    kv_address = ""

    def __init__(self, service: EngineService, metrics: EngineMetrics) -> None:
        config = service.config
        self.receiver = KVReceiver(
            KVReceiverConfig(backends=service.kv_backends),
            tls=config.tls,
            token=config.cluster_token,
        )
        self.servicer = DecodeServicer(
            service, self.receiver,
            kv_fetch_timeout_s=getattr(config, "kv_fetch_timeout_s", 30.0),
            kv_load_failure_policy=getattr(config, "kv_load_failure_policy", "recompute"),
            metrics=metrics,
        )

    async def start(self, server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_DecodeServicer_to_server(self.servicer, server)

    def pending(self) -> int:
        return 0  # a Decode call holds its request to the end

    async def stop(self) -> None:
        await self.receiver.close()
