"""Triton kernels for the fused layer ops (see layer_ops.py for the contract of each).

One program per token row (RMSNorm, add+RMSNorm), per (token, head) (RoPE, in place through
the tensors' strides, so q and k may stay views of the fused QKV output), and per (row, column
block) (SiLU-and-mul). Every reduction and activation runs in float32 and stores in the
tensor's dtype. Launch parameters depend on shapes only, never on values, so the launches can
be captured in a CUDA graph.

Row offsets are computed in int64 (`_row_offset`): program ids are int32, and a row index
times a row stride passes 2^31 within one step (75k tokens of an 8B model's 28,672-wide
gate/up rows), where int32 arithmetic would wrap to a negative address.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_offset(index, stride):
    """`index * stride` in int64, whatever the integer types of the two."""
    return index.to(tl.int64) * stride


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, x_stride, res_stride, out_stride, n_cols,
                     eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + _row_offset(row, x_stride) + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_row = res_ptr + _row_offset(row, res_stride)
        r = tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
        x = x + r
        tl.store(res_row + cols, x.to(res_ptr.dtype.element_ty), mask=mask)
        # The reference normalises the residual as stored (rounded to its dtype).
        x = x.to(res_ptr.dtype.element_ty).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / n_cols
    # Rounded to the output dtype before the weight multiplies it, as the reference does.
    normed = (x * tl.rsqrt(mean_sq + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + _row_offset(row, out_stride) + cols,
             (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(t_ptr, cos_ptr, sin_ptr, t_stride_tok, t_stride_head, cs_stride, half,
                 BLOCK: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    base = t_ptr + _row_offset(tok, t_stride_tok) + head * t_stride_head
    a = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base + half + offs, mask=mask, other=0.0).to(tl.float32)
    cs = _row_offset(tok, cs_stride)
    c = tl.load(cos_ptr + cs + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cs + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + offs, (a * c - b * s).to(t_ptr.dtype.element_ty), mask=mask)
    tl.store(base + half + offs, (b * c + a * s).to(t_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(in_ptr, out_ptr, in_stride, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    in_row = in_ptr + _row_offset(row, in_stride)
    gate = tl.load(in_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + _row_offset(row, out_stride) + cols,
             (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError("layer ops need a unit stride in the last dimension")
    return x


class TritonLayerOps:
    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(_rows(x), None, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self._norm(_rows(x), _rows(residual), weight, eps)

    @staticmethod
    def _norm(
        x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        rows, cols = x.shape
        out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
        if rows:
            res = residual if residual is not None else x
            _rms_norm_kernel[(rows,)](
                x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), cols, eps,
                HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
            )
        return out

    def rope_(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        cos, sin = _rows(cos.contiguous()), _rows(sin.contiguous())
        half = cos.shape[-1]
        for t in (q, k):
            tokens, heads, dim = t.shape
            if dim != 2 * half or t.stride(-1) != 1:
                raise ValueError(f"rope: head size {dim} does not match cos/sin {half} x 2")
            if tokens:
                _rope_kernel[(tokens, heads)](
                    t, cos, sin, t.stride(0), t.stride(1), cos.stride(0), half,
                    BLOCK=triton.next_power_of_2(half),
                )

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        x = _rows(gate_up)
        rows, cols = x.shape[0], x.shape[1] // 2
        out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
        block = min(1024, triton.next_power_of_2(cols))
        if rows:
            _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](
                x, out, x.stride(0), out.stride(0), cols, BLOCK=block,
            )
        return out
