"""An engine core's load as the serving side reads it: one `EngineLoadSnapshot` per reply.

The figures come from the core's parts (scheduler, KV cache manager, exports, pulls in
flight, step statistics) and, with KV offloading on, from its tiers
(engine/core/kv_offload.py); kept here so the core itself stays about admitting and stepping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdmesh.engine.core.kv_offload import KVOffload
from pdmesh.engine.core_types import EngineLoadSnapshot
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager

if TYPE_CHECKING:
    from pdmesh.engine.core.engine_core import EngineCore


def load_snapshot(core: EngineCore) -> EngineLoadSnapshot:
    """The core's load now (pulls in flight count as waiting, pinned exports as pinned)."""
    stats = core.kv_manager.stats
    return EngineLoadSnapshot(
        num_running=len(core.scheduler.running),
        num_waiting=len(core.scheduler.waiting) + len(core.admission.loads.loading),
        num_free_blocks=core.num_free_blocks,
        num_total_blocks=core.num_total_blocks,
        num_pinned_blocks=core.exports.pinned_blocks(),
        prefix_hit_tokens=stats.hits,
        prefix_query_tokens=stats.queries,
        num_steps=core.num_steps,
        step_seconds=core.step_seconds,
        scheduled_tokens=core.scheduled_tokens,
        num_preemptions=core.scheduler.num_preemptions,
        num_predicted_steps=core.step_cost_stats.steps,
        predicted_step_seconds=core.step_cost_stats.predicted_s,
        predicted_steps_actual_seconds=core.step_cost_stats.actual_s,
        itl_target_seconds=core.scheduler.itl_target_s,
        model_prefill_tokens_per_s=core.scheduler.step_cost.prefill_tokens_per_s(
            core.scheduler.config.max_num_batched_tokens),
        **offload_figures(core.kv_offload, core.kv_manager),
    )


def offload_figures(kv_offload: KVOffload | None, kv_manager: KVCacheManager) -> dict[str, int]:
    """The offload tiers' part of the load snapshot (none without a tier)."""
    if kv_offload is None:
        return {}
    f = kv_offload.figures()
    return dict(
        kv_offload_host_blocks=f.host_blocks, kv_offload_disk_blocks=f.disk_blocks,
        kv_offload_host_saved_blocks=f.host_saved_blocks,
        kv_offload_disk_saved_blocks=f.disk_saved_blocks,
        kv_offload_host_restored_blocks=f.host_restored_blocks,
        kv_offload_disk_restored_blocks=f.disk_restored_blocks,
        kv_offload_restore_failures=f.restore_failures,
        kv_offload_restored_tokens=kv_manager.tier_restored_tokens,
        kv_offload_block_bytes=f.block_bytes)
