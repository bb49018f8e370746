"""What every engine servicer shares, whatever its role: identity, counters, info and load.

Roles: `prefill` serves the Prefill service, `decode` the Decode service, `colocated` both
over one engine (see `engine_svc.process`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pdmesh.engine.core_types import SELFCHECK_FEATURES
from pdmesh.engine.frontend.async_engine import AsyncEngine
from pdmesh.engine_svc.config import EngineServiceConfig
from pdmesh.engine_svc.export_layout import export_layout
from pdmesh.engine_svc.watchdog import CoreWatchdog
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.instance_registry import new_instance_id
from pdmesh.metrics import EngineState
from pdmesh.v1 import engine_pb2

if TYPE_CHECKING:
    from pdmesh.engine_svc.kv_peer import KVPeerPart

Role = Literal["prefill", "decode", "colocated"]
ROLE_PROTO = {
    "prefill": engine_pb2.ROLE_PREFILL,
    "decode": engine_pb2.ROLE_DECODE,
    "colocated": engine_pb2.ROLE_COLOCATED,
}


@dataclass
class KVCounters:
    """KV bytes moved, for GetLoad; updated from transfer callbacks on any thread."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_sent: int = 0
    transfers_received: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_sent(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent += nbytes
            self.transfers_sent += 1

    def add_received(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_received += nbytes
            self.transfers_received += 1


def selfcheck_gauges(fallbacks: tuple[str, ...]) -> dict[str, bool]:
    """Every self-check feature, True where the core fell back from it: the metric shows
    each feature, 0 included, so a dashboard can tell "checked, fine" from "not reported"."""
    return {feature: feature in fallbacks for feature in SELFCHECK_FEATURES}


class EngineService:
    """Identity, static info and live load of one engine instance (shared by servicers)."""

    def __init__(
        self,
        config: EngineServiceConfig,
        role: Role,
        engine: AsyncEngine,
        *,
        instance_id: str | None = None,
        kv_backends: tuple[str, ...] = (),
        connector: KVConnectorConfig | None = None,
    ) -> None:
        self.config = config
        self.connector = connector  # how the engine core moves KV itself (None: staged only)
        self.role = role
        self.engine = engine
        self.instance_id = instance_id or new_instance_id(role)
        self.kv_backends = kv_backends
        self.counters = KVCounters()
        # The process's KV sender and prefix loans (engine_svc/kv_peer.py), set by `serve`
        # before the role parts are built; None for a decode instance whose core lends nothing.
        self.kv_peer: KVPeerPart | None = None
        self.watchdog = CoreWatchdog(engine, config.stall.bound(),
                                     config.engine.max_num_batched_tokens)

    def info(self) -> engine_pb2.EngineInfo:
        return engine_pb2.EngineInfo(
            model=self.config.model_name,
            instance_id=self.instance_id,
            role=ROLE_PROTO[self.role],
            block_size=self.engine.block_size,
            hash_scheme_fingerprint=self.engine.info.hash_fingerprint,
            max_model_len=self.engine.max_model_len,
            kv_capacity_tokens=self.engine.num_total_blocks * self.engine.block_size,
            kv_backends=list(self.kv_backends),
            selfcheck=self.engine.info.selfcheck,
            selfcheck_fallbacks=list(self.engine.info.selfcheck_fallbacks),
            kv_block_bytes=export_layout(self.engine.info, 1, self.engine.block_size).nbytes,
        )

    def load(self) -> engine_pb2.EngineLoad:
        snap = self.engine.load()
        c = self.counters
        return engine_pb2.EngineLoad(
            instance_id=self.instance_id,
            role=ROLE_PROTO[self.role],
            num_running=snap.num_running,
            num_waiting=snap.num_waiting,
            kv_usage=snap.kv_usage,
            num_free_blocks=snap.num_free_blocks,
            num_total_blocks=snap.num_total_blocks,
            num_pinned_blocks=snap.num_pinned_blocks,
            prefix_hit_tokens=snap.prefix_hit_tokens,
            prefix_query_tokens=snap.prefix_query_tokens,
            kv_bytes_sent=c.bytes_sent,
            kv_bytes_received=c.bytes_received,
            kv_transfers_sent=c.transfers_sent,
            kv_transfers_received=c.transfers_received,
            num_steps=snap.num_steps,
            step_seconds=snap.step_seconds,
            scheduled_tokens=snap.scheduled_tokens,
            max_step_s=self.watchdog.max_step_s(),
            core_silent_s=self.watchdog.silent_s(),
            core_stalled=self.watchdog.stalled,
            model_prefill_tokens_per_s=snap.model_prefill_tokens_per_s,
        )

    def metrics_state(self, index_up: bool | None) -> EngineState:
        """The scrape-time figures of this instance (see pdmesh.metrics.EngineCollector)."""
        snap = self.engine.load()
        return EngineState(
            num_running=snap.num_running,
            num_waiting=snap.num_waiting,
            kv_usage=snap.kv_usage,
            num_free_blocks=snap.num_free_blocks,
            num_total_blocks=snap.num_total_blocks,
            num_pinned_blocks=snap.num_pinned_blocks,
            prefix_query_tokens=snap.prefix_query_tokens,
            prefix_hit_tokens=snap.prefix_hit_tokens,
            index_up=index_up,
            num_steps=snap.num_steps,
            step_seconds=snap.step_seconds,
            scheduled_tokens=snap.scheduled_tokens,
            num_preemptions=snap.num_preemptions,
            num_predicted_steps=snap.num_predicted_steps,
            predicted_step_seconds=snap.predicted_step_seconds,
            predicted_steps_actual_seconds=snap.predicted_steps_actual_seconds,
            itl_target_seconds=snap.itl_target_seconds,
            model_prefill_tokens_per_s=snap.model_prefill_tokens_per_s,
            kv_offload_block_bytes=snap.kv_offload_block_bytes,
            kv_offload_host_blocks=snap.kv_offload_host_blocks,
            kv_offload_disk_blocks=snap.kv_offload_disk_blocks,
            kv_offload_host_saved_blocks=snap.kv_offload_host_saved_blocks,
            kv_offload_disk_saved_blocks=snap.kv_offload_disk_saved_blocks,
            kv_offload_host_restored_blocks=snap.kv_offload_host_restored_blocks,
            kv_offload_disk_restored_blocks=snap.kv_offload_disk_restored_blocks,
            kv_offload_restore_failures=snap.kv_offload_restore_failures,
            kv_offload_restored_tokens=snap.kv_offload_restored_tokens,
            selfcheck_fallbacks=selfcheck_gauges(self.engine.info.selfcheck_fallbacks),
        )

    def load_figures(self) -> dict[str, float]:
        """The heartbeat's load (flat numbers; see InstanceInfo.load)."""
        snap = self.engine.load()
        return {
            "running": snap.num_running,
            "waiting": snap.num_waiting,
            "kv_usage": snap.kv_usage,
            "free_blocks": snap.num_free_blocks,
            "total_blocks": snap.num_total_blocks,
            "pinned_blocks": snap.num_pinned_blocks,
        }
