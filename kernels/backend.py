"""The small interface between the model and attention kernels, and backend selection.

The model runner orders each step's tokens as [decode tokens (one per sequence)] then
[prefill/extend chunks], builds one `AttentionMetadata`, and every layer calls
`backend.forward`. A backend writes the step's K/V into the paged cache and attends; later
backends (Triton, flash-attn) plug in behind the same call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdmesh.kernels import torch_ref


@dataclass
class AttentionMetadata:
    """Per-step layout shared by all layers."""

    slot_mapping: torch.Tensor  # [T] cache slot of every token of the step
    num_decode_tokens: int  # rows [0, num_decode_tokens) are single-token decodes
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor  # [num_decodes] context length incl. the new token
    prefill_query_start_loc: list[int]  # offsets into the prefill rows, len = num_prefills + 1
    prefill_seq_lens: list[int]  # context length incl. the chunk, per prefill sequence
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks]

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_seq_lens)


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """query `[T, Hq, D]`, key/value `[T, Hkv, D]` → output `[T, Hq, D]`."""
        ...


class TorchAttentionBackend:
    """Reference backend: correct everywhere, the CPU default."""

    name = "torch"

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
        out = torch.empty_like(query)
        if nd:
            out[:nd] = torch_ref.paged_decode_attention(
                query[:nd], kv_layer, meta.decode_block_tables, meta.decode_seq_lens, scale
            )
        qsl = meta.prefill_query_start_loc
        for i, ctx in enumerate(meta.prefill_seq_lens):
            start, end = nd + qsl[i], nd + qsl[i + 1]
            if ctx == end - start:
                # Nothing cached before this chunk: attend to the fresh K/V, skip the gather.
                k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
            else:
                k, v = torch_ref.gather_kv(kv_layer, meta.prefill_block_tables[i], ctx)
            out[start:end] = torch_ref.prefill_attention_one(query[start:end], k, v, scale)
        return out


_BACKENDS: dict[str, type] = {"torch": TorchAttentionBackend}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str | None = None) -> AttentionBackend:
    """Pick a backend by name, or automatically (`None`/"auto")."""
    if name in (None, "auto"):
        name = "torch"
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend: unknown backend {name!r}; available here: {available_backends()}"
        )
    return _BACKENDS[name]()
