"""What the engine core hands out: token-level results, load figures and static facts.

The core knows token ids and numbers, never text: these structs are all that leaves it, in
process (the offline `LLM`) or across the process boundary (`msgspec` encodes them as they
are). The output processor turns them into text and vLLM-shaped `RequestOutput`s.

Outputs are *deltas*: each `CoreOutput` carries only what happened to a request since the
previous one, so a decode step costs a few integers per sequence on the wire.
"""

from __future__ import annotations

import msgspec

from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.connector.source import LoadResult

SELFCHECK_FEATURES = ("cuda_graphs", "attention", "layer_ops", "async_scheduling")
"""What the start-up self-check (engine/worker/selfcheck.py) may turn off when its check fails:
decode CUDA graphs (eager steps), the attention kernels and the fused layer ops (the torch
reference instead) and async scheduling (synchronous sampling). One name each, everywhere:
`CoreInfo`, GetInfo and the `engine_selfcheck_fallback` metric's `feature` label."""


class RawLogprob(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Raw logprob of one chosen token: its value, 1-based rank, and the top-k alternatives
    (ids and logprobs, most likely first). Text pieces are the output processor's job."""

    token_id: int
    logprob: float
    rank: int | None = None
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class SampleDelta(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One sample (sequence) of a request: tokens appended since the last output and, when it
    ended, why. `finish_reason` is "stop", "length", "abort" or "exported" (prefill role: the
    KV stays pinned for a decode instance); `stop_reason` a stop token id (stop *strings* are
    found by the output processor, which tells the core to stop the sample)."""

    index: int
    new_token_ids: list[int] = []
    new_logprobs: list[RawLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


class KVExportInfo(msgspec.Struct, array_like=True, gc=False):
    """Where an exported request's KV lives on this engine (prefill role)."""

    block_ids: list[int]
    num_tokens: int


class CoreOutput(msgspec.Struct, gc=False, omit_defaults=True):
    """What one step (or one command) did to one request."""

    request_id: str
    samples: list[SampleDelta] = []
    prompt_logprobs: list[RawLogprob | None] | None = None
    """Sent once, complete, when the prompt has been computed (the first entry is None)."""
    num_cached_tokens: int = 0
    kv_export: KVExportInfo | None = None
    kv_load: LoadResult | None = None
    """Sent once: how this core placed the prompt's KV it was told to pull (`kv_source`)."""
    kv_stream: ExportProgress | None = None
    """A streamed export's blocks that became pullable in this step (prefill role)."""
    finished: bool = False
    """The core holds nothing more of this request (exported requests stay until released)."""
    ttft_s: float | None = None
    queue_s: float | None = None


class EngineLoadSnapshot(msgspec.Struct, frozen=True, gc=False):
    """Load figures the core takes after every step; safe to read anywhere."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_pinned_blocks: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    # Cumulative since start: steps run, host wall time inside them, tokens they computed.
    num_steps: int = 0
    step_seconds: float = 0.0
    scheduled_tokens: int = 0
    num_preemptions: int = 0
    # The step-cost model (engine/scheduling/step_cost.py): the steps it predicted, its
    # predictions' sum
    # and those steps' actual time; the ITL target of the last step it bounded (0: none yet).
    num_predicted_steps: int = 0
    predicted_step_seconds: float = 0.0
    predicted_steps_actual_seconds: float = 0.0
    itl_target_seconds: float = 0.0
    model_prefill_tokens_per_s: float = 0.0
    """The model's predicted prefill throughput in full chunks (0: not fitted yet; the
    router's queueing-delay rate, router/queue_delay.py)."""
    # The KV offload tiers (engine/core/kv_offload.py; all 0 without one): blocks held now,
    # cumulative blocks saved / spilled / restored per tier, failed restores (counted as
    # misses), and the prompt tokens restored instead of recomputed.
    kv_offload_host_blocks: int = 0
    kv_offload_disk_blocks: int = 0
    kv_offload_host_saved_blocks: int = 0
    kv_offload_disk_saved_blocks: int = 0
    kv_offload_host_restored_blocks: int = 0
    kv_offload_disk_restored_blocks: int = 0
    kv_offload_restore_failures: int = 0
    kv_offload_restored_tokens: int = 0
    kv_offload_block_bytes: int = 0

    @property
    def kv_usage(self) -> float:
        if not self.num_total_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks


class CoreInfo(msgspec.Struct, frozen=True):
    """Facts fixed at start-up that the serving side reads without asking the core."""

    block_size: int
    max_model_len: int
    num_total_blocks: int
    vocab_size: int
    kv_shape: tuple[int, int, int, int]
    """(layers, block_size, kv_heads, head_dim): one request's KV is
    [layers, 2, n_blocks, block_size, kv_heads, head_dim]."""
    kv_dtype: str
    hash_fingerprint: str
    hash_description: str
    capacity_summary: str
    torch_threads: int
    """The core's intra-op threads (engine/worker/cpu_threads.py)."""
    kv_cache_file: str = ""
    """The shm file holding a CPU cache that peer cores on this host copy blocks out of
    (its name in the connector's shm directory); a tensor-parallel core's ranks' files, in
    rank order, comma-separated; empty when the cache is not shared."""
    kv_block_server: str = ""
    """host:port of the core's block server (cross-host pulls); empty when off."""
    kv_cache_ipc: str = ""
    """A CUDA cache's IPC description (`kvstore/connector/cuda_ipc.py`): peer cores on the
    node copy blocks device to device; empty on CPU or when it cannot be shared."""
    kv_ucx_server: str = ""
    """host:port of the core's ucxx listener (`kvstore/connector/ucx_blocks.py`); empty
    when off or the package is not installed."""
    kv_checksum_algo: str = ""
    """The per-block checksum the core's KV connector uses (a streamed export's handle names
    it before any block is ready); empty without a connector."""
    selfcheck: str = ""
    """The start-up self-check's one-line outcome (engine/worker/selfcheck.py); empty when
    it did not run."""
    selfcheck_fallbacks: tuple[str, ...] = ()
    """The features (`SELFCHECK_FEATURES`) this core turned off because a check failed."""
