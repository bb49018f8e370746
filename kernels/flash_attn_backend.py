"""Attention through flash-attn (`pip install 'pdmesh[flash-attn]'`), CUDA only.

- Prompt chunks with nothing cached before them (the bulk of prefill work): one
  `flash_attn_varlen_func` call over all of them, causal, on the step's contiguous K/V.
- Decode rows: `flash_attn_with_kvcache` with the block table, reading the paged cache.
- Chunks after a cached prefix: `flash_attn_varlen_func` with `block_table`.

Upstream flash-attn 2 reads a paged cache only when a page holds a multiple of 256 tokens
(`PAGED_BLOCK_MULTIPLE`), and computes in fp16/bf16 only. Steps or parts it cannot take —
paged reads with smaller blocks, float32 — go to the Triton kernels (or the torch reference
when Triton is absent or cannot take the block size), so the backend is always correct and
flash-attn does what it can. Since every block size the config allows is below 256, that
means every decode step: `auto` never picks this backend (see backend_selection.py).

flash-attn is imported when the backend is built, never at module import, so this module
can be imported (and the selection logic tested) on machines without it.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging

import torch

from pdmesh.kernels import torch_ref
from pdmesh.kernels.backend import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttentionBackend,
    block_size_unsupported_reason,
)

logger = logging.getLogger(__name__)

PAGED_BLOCK_MULTIPLE = 256
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _fallback(block_size: int | None) -> AttentionBackend:
    """Triton where it is installed and takes `block_size` (None: unknown, assume it does),
    else the torch reference."""
    triton_takes = block_size is None or block_size_unsupported_reason("triton", block_size) is None
    if triton_takes and importlib.util.find_spec("triton") is not None:
        from pdmesh.kernels.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    return TorchAttentionBackend()


class FlashAttnBackend:
    name = "flash-attn"

    def __init__(
        self, paged_block_multiple: int = PAGED_BLOCK_MULTIPLE, block_size: int | None = None
    ) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self.paged_block_multiple = paged_block_multiple
        self.fallback = _fallback(block_size)
        self._warned = False

    def _note_fallback(self, why: str) -> None:
        if not self._warned:
            logger.info(
                "flash-attn: %s; those parts run on the %s backend", why, self.fallback.name
            )
            self._warned = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        if query.dtype not in _HALF_DTYPES:
            self._note_fallback(f"dtype {query.dtype} is not fp16/bf16")
            return self.fallback.forward(query, key, value, kv_layer, meta, scale, window)
        # flash-attn's window counts keys to the left of the query: (window - 1, 0) is the
        # query and the `window - 1` before it, as transformers masks; (-1, -1): unbounded.
        sides = (window - 1, 0) if window else (-1, -1)
        block_size = kv_layer.shape[2]
        paged = block_size % self.paged_block_multiple == 0
        prefixed = any(
            ctx != b - a
            for ctx, (a, b) in zip(
                meta.prefill_seq_lens,
                itertools.pairwise(meta.prefill_query_start_loc),
                strict=True,
            )
        )
        if not paged and (meta.num_decode_tokens or prefixed):
            # Paged reads are needed and flash-attn cannot do them with these pages: the
            # fallback takes the step whole (it writes the cache itself).
            self._note_fallback(
                f"block_size {block_size} is not a multiple of {self.paged_block_multiple}"
            )
            return self.fallback.forward(query, key, value, kv_layer, meta, scale, window)

        torch_ref.reshape_and_cache(key, value, kv_layer, meta.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = meta.num_decode_tokens
        if nd:
            tables = meta.cached("fa.decode_tables", lambda: meta.decode_block_tables.int())
            seq_lens = meta.cached("fa.decode_lens", lambda: meta.decode_seq_lens.int())
            out[:nd] = self._with_kvcache(
                query[:nd].unsqueeze(1),
                kv_layer[0],
                kv_layer[1],
                cache_seqlens=seq_lens,
                block_table=tables,
                softmax_scale=scale,
                causal=True,
                window_size=sides,
            ).squeeze(1)
        if meta.num_prefills:
            out[nd:] = self._prefill(
                query[nd:], key[nd:], value[nd:], kv_layer, meta, scale, prefixed, sides
            )
        return out

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        prefixed: bool,
        sides: tuple[int, int],
    ) -> torch.Tensor:
        qsl = meta.prefill_query_start_loc
        # On the device already (staged, or copied without blocking): int32 and the
        # cumulative key lengths are device ops, so a prompt chunk never waits for the GPU.
        query_start_loc, seq_lens = meta.prefill_tensors(query.device)
        cu_q = meta.cached("fa.cu_q", lambda: query_start_loc.int())
        max_q = max(b - a for a, b in itertools.pairwise(qsl))
        if not prefixed:
            return self._varlen(
                query, key, value, cu_q, cu_q, max_q, max_q, softmax_scale=scale, causal=True,
                window_size=sides,
            )
        cu_k = meta.cached(
            "fa.cu_k", lambda: torch.nn.functional.pad(seq_lens.cumsum(0), (1, 0)).int()
        )
        tables = meta.cached("fa.prefill_tables", lambda: meta.prefill_block_tables.int())
        # Causal masks are aligned bottom-right: query i of a chunk sees its prefix + i + 1.
        return self._varlen(
            query,
            kv_layer[0],
            kv_layer[1],
            cu_q,
            cu_k,
            max_q,
            max(meta.prefill_seq_lens),
            softmax_scale=scale,
            causal=True,
            window_size=sides,
            block_table=tables,
        )
