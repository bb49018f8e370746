"""The small interface between the model and attention kernels.

The model runner orders each step's tokens as [decode tokens (one per sequence)] then
[prefill/extend chunks], builds one `AttentionMetadata`, and every layer calls
`backend.forward`, which writes the step's K/V into the paged cache and attends.

Backends (`--attention-backend`):

| name         | runs on                          | what it is                                   |
|--------------|----------------------------------|----------------------------------------------|
| `flash-attn` | CUDA, `pip install pdmesh[flash-attn]` | flash-attn varlen / paged kernels      |
| `triton`     | CUDA (or CPU with TRITON_INTERPRET=1) | our Triton kernels (triton_attention.py) |
| `cpu`        | CPU                              | C decode kernel, gather + SDPA (cpu_attention) |
| `torch`      | anywhere                         | the plain-torch reference (torch_ref.py)     |

Choosing and building one is `backend_selection.py`'s: it imports the backends, which import
this module, so this module imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdmesh.kernels import torch_ref
from pdmesh.kernels.backend_names import BACKEND_NAMES

__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionMetadata", "TorchAttentionBackend"]


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
    # Derived tensors a backend builds once per step and reuses in every layer.
    step_cache: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_seq_lens)

    def cached(self, key: str, build: Callable[[], object]) -> object:
        """`build()` once per step (the first layer), the stored value for the others."""
        if key not in self.step_cache:
            self.step_cache[key] = build()
        return self.step_cache[key]


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
    """Reference backend: correct everywhere; the ground truth for the others."""

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
        torch_ref.prefill_chunks(
            query, key, value, kv_layer, nd, meta.prefill_query_start_loc,
            meta.prefill_seq_lens, meta.prefill_block_tables, scale, out, torch_ref.gather_kv,
        )  # fmt: skip
        return out
