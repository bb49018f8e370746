"""The prefill role's part of an engine process: the Prefill servicer and the KV sender that
lends its exported KV (see `pdmesh.engine_svc.process`)."""

from __future__ import annotations

import grpc

from pdmesh.engine_svc.process import SENDER_BACKENDS
from pdmesh.engine_svc.service import EngineService
from pdmesh.kvstore.transfer.sender import KVSender, KVSenderConfig
from pdmesh.kvstore.transfer.worker_planes import CoreCache
from pdmesh.metrics import EngineMetrics
from pdmesh.prefill_svc.servicer import PrefillServicer
from pdmesh.v1 import engine_pb2, engine_pb2_grpc


class PrefillPart:
    service_name = engine_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
    work_methods = (f"/{service_name}/Prefill", f"/{service_name}/PrefillStream")

    def __init__(self, service: EngineService, metrics: EngineMetrics) -> None:
        config = service.config
        lease_s = getattr(config, "lease_s", 30.0)
        self.servicer = PrefillServicer(service, metrics=metrics)
        backends = service.kv_backends
        self.sender = KVSender(
            KVSenderConfig(
                host=config.host,
                port=config.kv_port,
                advertise_host=config.public_host,
                backends=tuple(b for b in backends if b in SENDER_BACKENDS) or backends,
                lease_s=lease_s,
                max_lease_s=max(getattr(config, "max_lease_s", 300.0), lease_s),
            ),
            on_release=self.servicer.on_release,
            on_sent=self.servicer.on_sent,
            tls=config.tls,
            token=config.cluster_token,
            core=core_cache(service),
        )

    @property
    def kv_address(self) -> str:
        return self.sender.address

    async def start(self, server: grpc.aio.Server) -> None:
        await self.sender.start()
        self.servicer.sender = self.sender
        engine_pb2_grpc.add_PrefillServicer_to_server(self.servicer, server)

    def pending(self) -> int:
        return self.sender.pinned_count()  # published KV a decode instance has yet to pull

    async def stop(self) -> None:
        await self.sender.stop()  # releases every lease; on_release frees pinned blocks


def core_cache(service: EngineService) -> CoreCache | None:
    """What the KV sender tells receivers about the engine core's own transports."""
    if service.connector is None:
        return None
    info = service.engine.info
    return CoreCache(info.kv_cache_file, info.num_total_blocks, info.kv_block_server,
                     service.connector.grant_secret, info.kv_cache_ipc,
                     info.kv_ucx_server)
