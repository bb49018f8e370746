"""The elementwise ops of one decoder layer, fused: RMSNorm (alone and with the residual add),
RoPE applied in place to q and k, and SiLU-and-mul.

On a GPU each of these is one kernel instead of the 3-6 that eager torch issues (RMSNorm alone
was five: cast, pow, mean, rsqrt, mul), which matters because a decode step is host-bound by
its launch count. On CPU a decode step's few rows make each op a few kilobytes of work
wrapped in several ATen dispatches, so the CPU path runs native kernels (`cpu_native`,
csrc/layer_ops_cpu.c: one pass per row) for float32 and bfloat16, and
the fastest plain torch form of each op (bench/layer_ops.py) where they are not built.

Three implementations of one small interface:

| name     | where | what |
|----------|-------|------|
| `torch`  | any   | the reference: the textbook formulas, as transformers computes them |
| `cpu`    | CPU   | native C kernels (float32, bfloat16), else `F.rms_norm`, half-view RoPE |
| `triton` | CUDA (CPU with TRITON_INTERPRET=1, for tests) | our kernels, triton_layer_ops.py |

`add_rms_norm(x, residual, ...)` is the residual stream's step: `residual += x`, then the
normalised residual is returned. Written that way, a layer reads `h` once per norm and the
float32 result is bit-identical to "add, then norm" (the reference order).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Protocol

import torch
import torch.nn.functional as F

from pdmesh.kernels import cpu_native

LAYER_OPS_NAMES = ("torch", "cpu", "triton")


class LayerOps(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of `x` `[T, H]`, computed in float32."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """`residual += x` (in place), then return RMSNorm(residual)."""
        ...

    def rope_(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotate q `[T, Hq, D]` and k `[T, Hk, D]` in place (NeoX / rotate-half layout);
        cos and sin are `[T, D/2]`, one row per token. q and k may be strided views."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of `gate_up` = `[T, 2I]` (gate first), as `[T, I]`."""
        ...


def _halves(
    t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two rotate-half views of `t` `[T, H, D]` and cos/sin shaped to broadcast over H."""
    half = t.shape[-1] // 2
    return (t[..., :half], t[..., half:],
            cos.unsqueeze(1).to(t.dtype), sin.unsqueeze(1).to(t.dtype))


class TorchLayerOps:
    """The reference formulas (what transformers' Llama computes)."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    def rope_(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        for t in (q, k):
            a, b, c, s = _halves(t, cos, sin)
            t.copy_(torch.cat((a * c - b * s, b * c + a * s), dim=-1))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuLayerOps(TorchLayerOps):
    """The fastest form of each op on CPU: the native kernels (`cpu_native`, one pass per row)
    for float32 and bfloat16 where they are built, else the plain-torch forms
    bench/layer_ops.py picked."""

    name = "cpu"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if cpu_native.supports_layer_ops(x, weight):
            return cpu_native.rms_norm(x, weight, eps)
        if x.dtype != torch.float32:  # F.rms_norm would normalise in the input's precision
            return super().rms_norm(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if residual.is_contiguous() and cpu_native.supports_layer_ops(x, residual, weight):
            return cpu_native.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def rope_(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        if cpu_native.can_rope(q, k):
            cpu_native.rope_(q, k, cos, sin)
            return
        for t in (q, k):
            a, b, c, s = _halves(t, cos, sin)
            new_a = a * c - b * s
            b.mul_(c).addcmul_(a, s)
            a.copy_(new_a)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if cpu_native.supports_layer_ops(gate_up):
            return cpu_native.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


def _triton_usable(device: torch.device) -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_layer_ops(device: torch.device | str, requested: str | None = None) -> LayerOps:
    """`requested` by name, or the best for `device`: triton on CUDA, cpu on CPU, else torch."""
    device = torch.device(device)
    if requested is None:
        if device.type == "cuda" and _triton_usable(device):
            requested = "triton"
        else:
            requested = "cpu" if device.type == "cpu" else "torch"
    if requested not in LAYER_OPS_NAMES:
        raise ValueError(f"layer ops must be one of {', '.join(LAYER_OPS_NAMES)}, "
                         f"got {requested!r}")
    if requested == "triton":
        if not _triton_usable(device):
            raise ValueError("triton layer ops need triton and a CUDA device")
        from pdmesh.kernels.triton_layer_ops import TritonLayerOps

        return TritonLayerOps()
    return CpuLayerOps() if requested == "cpu" else TorchLayerOps()
