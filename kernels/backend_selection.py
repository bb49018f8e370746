"""Choosing an attention backend (`--attention-backend`, the names in `backend.py`) for this
machine, and building it.

`auto` picks the first of flash-attn → triton that can run on a CUDA device, and `cpu` on a
CPU. Asking for a backend that cannot run here is a start-up `ValueError` naming the reason.

A module apart from `backend.py` (the interface every backend imports) because it imports the
backends: in one module the two were an import cycle. Each backend is imported when it is built,
so a machine without triton or flash-attn still selects among the others.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from pdmesh.kernels.backend import BACKEND_NAMES, AttentionBackend, TorchAttentionBackend

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
