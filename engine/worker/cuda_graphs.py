"""CUDA graphs for pure-decode steps: captured once per padded batch size, then replayed.

A decode step of a Python engine is host-bound: hundreds of kernel launches per step, each a
few microseconds of Python and driver time, while the GPU finishes each in less. A CUDA graph
records the whole forward of one batch size once and replays it with one launch.

How it works (the vLLM shape):

- Batch-size buckets 1, 2, 4, 8, 16, 24, 32, ... up to `max_num_seqs` (which is always the
  last bucket). A step of `n` decodes runs the graph of the smallest bucket >= n; the
  `bucket - n` padding rows carry slot -1 (the cache write skips them, so they never touch a
  real block), context length 1 and block 0 (a valid read of one token, discarded).
- Graphs read their inputs from static buffers (ids, positions, slots, lengths, a block table
  `[max_num_seqs, max_blocks_per_seq]`); a replay first copies the step's inputs into them.
  The block table's width is fixed at capture, so the Triton decode kernel's split count —
  `default_num_splits(bucket, kv_heads, width)` — is fixed per bucket, and nothing inside the
  captured region depends on host values of the step.
- Each bucket is warmed up eagerly first (Triton compiles, cuBLAS picks its kernels), then
  captured, largest first, all into one memory pool: they never run at once, so they share it.
- Only the hidden states are captured; the LM head runs eagerly on the rows that sample.

Only the `triton` attention backend is captured. `torch` reads `seq_lens.max()` on the host
to size its gather, and `flash-attn` writes the cache with `index_copy_` (no "skip" slot) and
picks its path from host-side facts of the step; both stay eager. CPU has no graphs at all.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdmesh.kernels.backend import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from pdmesh.engine.worker.input_batch import StepInputs
    from pdmesh.engine.worker.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

GRAPH_SAFE_BACKENDS = ("triton",)
"""Backends whose forward has no host synchronisation and honours slot -1 (padding)."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes that get a graph: 1, 2, 4, 8, then every 8, and max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding `num_seqs` rows, or None when none is large enough."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def graphs_unavailable_reason(
    device: torch.device, backend: AttentionBackend, enforce_eager: bool
) -> str | None:
    """Why decode steps cannot use CUDA graphs here, or None when they can."""
    if device.type != "cuda":
        return "not a CUDA device"
    if enforce_eager:
        return "enforce_eager is set"
    if backend.name not in GRAPH_SAFE_BACKENDS:
        return f"the {backend.name} attention backend is not graph-safe (triton is)"
    return None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [bucket, hidden]: written by each replay


class DecodeGraphs:
    """One captured decode forward per bucket, and the static buffers they read."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.width = max_blocks_per_seq
        rows = self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((rows, self.width), dtype=torch.int64, device=device)
        self._graphs: dict[int, _Graph] = {}

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def _meta(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            num_decode_tokens=bucket,
            decode_block_tables=self.block_tables[:bucket],
            decode_seq_lens=self.seq_lens[:bucket],
            prefill_query_start_loc=[0],
            prefill_seq_lens=[],
            prefill_block_tables=self.block_tables[:0],
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:bucket],
            self.positions[:bucket],
            self.kv_cache,
            self._meta(bucket),
            self.backend,
        )

    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (the pool is sized by the first)."""
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.device)
        for bucket in reversed(self.sizes):
            # Warm-up off the default stream, as CUDA graph capture requires of lazy inits.
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(bucket)
            self._graphs[bucket] = _Graph(graph, hidden)
        torch.cuda.synchronize(self.device)
        logger.info("cuda graphs: captured %d decode batch sizes (1..%d) in %.1f s",
                    len(self._graphs), self.sizes[-1], time.monotonic() - started)

    def bucket_for(self, inputs: StepInputs) -> int | None:
        """The bucket a step replays, or None when it must run eagerly (prefill rows, too many
        sequences, a block table wider than captured)."""
        meta = inputs.meta
        if meta.num_prefills or not meta.num_decode_tokens:
            return None
        if meta.decode_block_tables.shape[1] > self.width:
            return None
        bucket = padded_size(meta.num_decode_tokens, self.sizes)
        return bucket if bucket in self._graphs else None

    def replay(self, inputs: StepInputs, bucket: int) -> torch.Tensor:
        """Copy the step into the static buffers, replay; hidden states `[n, hidden]`."""
        meta = inputs.meta
        n = meta.num_decode_tokens
        nb = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.decode_seq_lens, non_blocking=True)
        self.block_tables[:n, :nb].copy_(meta.decode_block_tables, non_blocking=True)
        if n < bucket:  # padding rows: no cache write, one token of context
            self.slot_mapping[n:bucket].fill_(-1)
            self.seq_lens[n:bucket].fill_(1)
            self.block_tables[n:bucket, 0].fill_(0)
        captured = self._graphs[bucket]
        captured.graph.replay()
        return captured.hidden[:n]
