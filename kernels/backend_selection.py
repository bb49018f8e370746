"""Choosing an attention backend (`--attention-backend`, the names in `backend.py`) for this
machine, and building it.

`auto` picks triton on a CUDA device (the torch reference where triton is absent or cannot
take the configured block size, said in the log), and `cpu` on a CPU. It never picks
flash-attn: upstream flash-attn reads a paged cache only in blocks of 256 tokens, a size no
config allows, so every decode step would fall back to eager Triton, and as a backend CUDA
graphs cannot capture, flash-attn also turns the graphs off. With flash-attn installed, decode
got slower; asked for by name, it still runs (its prompt-only prefill kernels are fast).
Asking for a backend that cannot run here is a start-up `ValueError` naming the reason.

A module apart from `backend.py` (the interface every backend imports) because it imports the
backends: in one module the two were an import cycle. Each backend is imported when it is built,
so a machine without triton or flash-attn still selects among the others.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

from pdmesh.kernels.backend import (
    BACKEND_NAMES,
    AttentionBackend,
    TorchAttentionBackend,
    block_size_unsupported_reason,
)

logger = logging.getLogger(__name__)

AUTO_CUDA = ("triton", "torch")
"""What `auto` tries on CUDA, in order (flash-attn is left out on purpose: see above); on any
other device it takes `cpu`."""

_ALIASES = {"flash_attn": "flash-attn", "flashattn": "flash-attn", "flash": "flash-attn"}


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


def unavailable_reason(name: str, env: Environment, block_size: int | None = None
                       ) -> str | None:
    """Why backend `name` cannot run in `env` with `block_size`-token KV blocks (None: any
    size), or None when it can."""
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
    if block_size is not None:
        return block_size_unsupported_reason(name, block_size)
    return None


def available_backends(env: Environment | None = None, block_size: int | None = None
                       ) -> list[str]:
    env = env or current_environment()
    return [name for name in BACKEND_NAMES if unavailable_reason(name, env, block_size) is None]


def select_backend(requested: str | None, env: Environment, block_size: int | None = None
                   ) -> str:
    """The backend name to use for `requested` ("auto"/None or a name) in `env`, with
    `block_size`-token KV blocks (None: not known, any size)."""
    name = _ALIASES.get((requested or "auto").lower(), (requested or "auto").lower())
    if name == "auto":
        skipped: list[str] = []
        for candidate in AUTO_CUDA if env.device_type == "cuda" else ("cpu",):
            reason = unavailable_reason(candidate, env, block_size)
            if reason is None:
                if skipped:
                    logger.warning("attention backend auto: %s; using %s",
                                   "; ".join(skipped), candidate)
                return candidate
            skipped.append(reason)
        return "torch"
    reason = unavailable_reason(name, env, block_size)
    if reason is not None:
        raise ValueError(
            f"attention_backend {requested!r} cannot run here: {reason}; "
            f"available here: {available_backends(env, block_size)}"
        )
    return name


def get_attention_backend(
    name: str | None = None,
    device: torch.device | str | None = None,
    block_size: int | None = None,
) -> AttentionBackend:
    """Pick a backend by name, or automatically (`None`/"auto"), for tensors on `device`
    (default: CUDA when present) and a KV cache of `block_size`-token blocks (pass it: a
    backend whose kernels cannot take it is then refused here, not at the first step)."""
    chosen = select_backend(name, current_environment(device), block_size)
    if chosen == "flash-attn":
        from pdmesh.kernels.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend(block_size=block_size)
    if chosen == "triton":
        from pdmesh.kernels.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    if chosen == "cpu":
        from pdmesh.kernels.cpu_attention import CpuAttentionBackend

        return CpuAttentionBackend()
    return TorchAttentionBackend()
