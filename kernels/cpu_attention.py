"""The CPU attention path: the reference's math with the waste taken out.

Same results as `torch_ref` (bit-for-bit in float32: the same SDPA calls on the same values),
but faster where the profile showed time going:

- The paged gather uses `index_select` over whole blocks (a memcpy per block) instead of
  advanced indexing `kv_layer[:, block_tables]`, which runs a generic per-element index
  kernel; measured ~10x faster for the gather of a decode batch.
- What every layer of a step shares — the flat list of blocks to gather, the padded length,
  the length mask — is built once per step (`AttentionMetadata.cached`), not once per layer.
- SDPA reads K/V through strided views of the gathered blocks; nothing is made contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdmesh.kernels import torch_ref
from pdmesh.kernels.backend import AttentionMetadata


@dataclass(frozen=True)
class _DecodeLayout:
    blocks: torch.Tensor  # [B * nb] block ids to gather, sequence-major
    num_blocks: int  # nb: blocks per sequence after padding to the longest
    mask: torch.Tensor  # [B, 1, 1, nb * block_size] True where a position is in context


def _decode_layout(meta: AttentionMetadata, block_size: int) -> _DecodeLayout:
    def build() -> _DecodeLayout:
        seq_lens = meta.decode_seq_lens
        nb = -(-int(seq_lens.max()) // block_size)
        tables = meta.decode_block_tables[:, :nb]
        positions = torch.arange(nb * block_size, device=seq_lens.device)
        mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]
        return _DecodeLayout(tables.reshape(-1), nb, mask)

    return meta.cached("cpu.decode", build)  # type: ignore[return-value]


def gather_kv(
    kv_layer: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch_ref.gather_kv` with `index_select`: K, V as `[Hkv, num_tokens, D]` views."""
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    nb = -(-num_tokens // block_size)
    blocks = kv_layer.index_select(1, block_table[:nb])  # [2, nb, bs, Hkv, D]
    kv = blocks.view(2, nb * block_size, num_kv_heads, head_dim)[:, :num_tokens]
    return kv[0].transpose(0, 1), kv[1].transpose(0, 1)


def paged_decode_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Decode rows `query[B, Hq, D]` against their paged context; see `torch_ref`."""
    batch, num_q_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_layer.shape
    layout = _decode_layout(meta, block_size)
    length = layout.num_blocks * block_size
    kv = kv_layer.index_select(1, layout.blocks)  # [2, B * nb, bs, Hkv, D]
    kv = kv.view(2, batch, length, num_kv_heads, head_dim).transpose(2, 3)  # [2, B, Hkv, L, D]
    q = query.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=layout.mask, scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


class CpuAttentionBackend:
    """The CPU default."""

    name = "cpu"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        torch_ref.reshape_and_cache(key, value, kv_layer, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if not meta.num_prefills:
            return paged_decode_attention(query, kv_layer, meta, scale)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = paged_decode_attention(query[:nd], kv_layer, meta, scale)
        qsl = meta.prefill_query_start_loc
        for i, ctx in enumerate(meta.prefill_seq_lens):
            start, end = nd + qsl[i], nd + qsl[i + 1]
            if ctx == end - start:
                # Nothing cached before this chunk: attend to the fresh K/V, skip the gather.
                k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
            else:
                k, v = gather_kv(kv_layer, meta.prefill_block_tables[i], ctx)
            out[start:end] = torch_ref.prefill_attention_one(query[start:end], k, v, scale)
        return out
