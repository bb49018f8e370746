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
this module, so this module imports none of them. What a backend's kernels cannot take (the
block sizes of `BLOCK_SIZES`) is declared here, where selection reads it without importing the
backend (and triton with it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdmesh.kernels import torch_ref
from pdmesh.kernels.backend_names import BACKEND_NAMES

__all__ = [
    "BACKEND_NAMES",
    "BLOCK_SIZES",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "block_size_unsupported_reason",
    "host_to_device",
]

BLOCK_SIZES: dict[str, tuple[int, ...]] = {"triton": (16, 32, 64, 128)}
"""The KV block sizes a backend's kernels run with, for the backends that cannot take every
size the config allows. Triton's: a block is a `tl.dot` operand dimension, which must be at
least 16 on a GPU (the interpreter does not enforce it, so CPU tests cannot catch a smaller
one), and a `tl.arange` length, a power of two."""


def block_size_unsupported_reason(name: str, block_size: int) -> str | None:
    """Why backend `name` cannot run with `block_size`-token KV blocks, or None when it can:
    the one rule backend selection and the kernels themselves both apply."""
    sizes = BLOCK_SIZES.get(name)
    if sizes is None or block_size in sizes:
        return None
    return (f"the {name} kernels need block_size in {'/'.join(map(str, sizes))}, "
            f"got {block_size}")


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as an int64 tensor on `device` without blocking: on CUDA from pinned
    memory with `non_blocking=True` (torch's pinned allocator keeps the block until the copy is
    done), where a plain `torch.tensor(..., device=cuda)` waits for the copy and so for
    everything queued before it."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return host.to(device, non_blocking=True)


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
    # The two prefill lists on the device (int64), when whoever built the step staged them
    # with its inputs (the input batch does); None: `prefill_tensors` copies them over.
    prefill_query_start_loc_tensor: torch.Tensor | None = None
    prefill_seq_lens_tensor: torch.Tensor | None = None
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

    def prefill_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(query_start_loc, seq_lens) of the prefill chunks as int64 tensors on `device`,
        once per step: the staged ones, else copied from the host lists without blocking, so
        a step with a prompt chunk does not wait for the device."""

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            qsl, lens = self.prefill_query_start_loc_tensor, self.prefill_seq_lens_tensor
            if qsl is None:
                qsl = host_to_device(self.prefill_query_start_loc, device)
            if lens is None:
                lens = host_to_device(self.prefill_seq_lens, device)
            return qsl, lens

        return self.cached("prefill_tensors", build)  # type: ignore[return-value]


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
        window: int = 0,
    ) -> torch.Tensor:
        """query `[T, Hq, D]`, key/value `[T, Hkv, D]` → output `[T, Hq, D]`; `window`: the
        layer's sliding attention window in tokens, 0 for full attention (torch_ref)."""
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
        window: int = 0,
    ) -> torch.Tensor:
        torch_ref.reshape_and_cache(key, value, kv_layer, meta.slot_mapping)
        nd = meta.num_decode_tokens
        out = torch.empty_like(query)
        if nd:
            out[:nd] = torch_ref.paged_decode_attention(
                query[:nd], kv_layer, meta.decode_block_tables, meta.decode_seq_lens, scale,
                window)
        torch_ref.prefill_chunks(
            query, key, value, kv_layer, nd, meta.prefill_query_start_loc,
            meta.prefill_seq_lens, meta.prefill_block_tables, scale, out, torch_ref.gather_kv,
            window,
        )  # fmt: skip
        return out
