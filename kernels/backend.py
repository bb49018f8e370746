"""The small interface between the model and attention kernels, and backend selection.

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

`auto` picks the first of flash-attn → triton that can run on a CUDA device, and `cpu` on a
CPU. Asking for a backend that cannot run here is a start-up `ValueError` naming the reason.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdmesh.kernels import torch_ref

BACKEND_NAMES = ("flash-attn", "triton", "cpu", "torch")
_ALIASES = {"flash_attn": "flash-attn", "flashattn": "flash-attn", "flash": "flash-attn"}


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


# -- selection ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Environment:
    """The facts backend selection depends on, gathered once (see `current_environment`)."""

    device_type: str  # "cuda" or "cpu"
    has_flash_attn: bool
    has_triton: bool
    triton_interpret: bool


def current_environment(device: torch.device | str | None = None) -> Environment:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return Environment(
        device_type=torch.device(device).type,
        has_flash_attn=importlib.util.find_spec("flash_attn") is not None,
        has_triton=importlib.util.find_spec("triton") is not None,
        triton_interpret=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    )


def unavailable_reason(name: str, env: Environment) -> str | None:
    """Why backend `name` cannot run in `env`, or None when it can."""
    cuda = env.device_type == "cuda"
    if name == "flash-attn":
        if not cuda:
            return "flash-attn needs a CUDA device"
        if not env.has_flash_attn:
            return "flash-attn is not installed (pip install 'pdmesh[flash-attn]')"
    elif name == "triton":
        if not env.has_triton:
            return "triton is not installed"
        if not cuda and not env.triton_interpret:
            return "triton needs a CUDA device (TRITON_INTERPRET=1 runs it on CPU, for tests)"
    elif name == "cpu":
        if cuda:
            return "the cpu backend runs on CPU tensors only"
    elif name != "torch":
        return f"unknown backend (known: {', '.join(BACKEND_NAMES)})"
    return None


def available_backends(env: Environment | None = None) -> list[str]:
    env = env or current_environment()
    return [name for name in BACKEND_NAMES if unavailable_reason(name, env) is None]


def select_backend(requested: str | None, env: Environment) -> str:
    """The backend name to use for `requested` ("auto"/None or a name) in `env`."""
    name = _ALIASES.get((requested or "auto").lower(), (requested or "auto").lower())
    if name == "auto":
        order = ("flash-attn", "triton", "torch") if env.device_type == "cuda" else ("cpu",)
        return next(n for n in order if unavailable_reason(n, env) is None)
    reason = unavailable_reason(name, env)
    if reason is not None:
        raise ValueError(
            f"attention_backend {requested!r} cannot run here: {reason}; "
            f"available here: {available_backends(env)}"
        )
    return name


def get_attention_backend(
    name: str | None = None, device: torch.device | str | None = None
) -> AttentionBackend:
    """Pick a backend by name, or automatically (`None`/"auto"), for tensors on `device`
    (default: CUDA when present)."""
    chosen = select_backend(name, current_environment(device))
    if chosen == "flash-attn":
        from pdmesh.kernels.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    if chosen == "triton":
        from pdmesh.kernels.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    if chosen == "cpu":
        from pdmesh.kernels.cpu_attention import CpuAttentionBackend

        return CpuAttentionBackend()
    return TorchAttentionBackend()
