"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) over the flat `[T]` batch.

A router picks `top_k` experts per token (softmax over the router's logits, in float32, then
the top k, renormalised to sum to one where the checkpoint says so). The step's (token, expert)
pairs are sorted by expert, so each expert's tokens are one contiguous run of rows, and every
expert's SwiGLU MLP runs as one grouped GEMM over those runs (`torch._grouped_mm`: a CUTLASS
kernel on CUDA, a per-group loop on CPU). Nothing in between reads a value on the host: the
run lengths stay on the device as cumulative offsets, so a decode step with experts is
captured in a CUDA graph like a dense one. Shapes the grouped GEMM does not take (rows not a
multiple of 16 bytes, a build without it, a device or dtype whose build refuses it or gets
it wrong on its first call: then never tried again) run one GEMM per expert instead, which
reads the offsets on the host (a graph capture then fails and the runner stays eager).

Each token's k results are weighted and summed by one batched GEMM (no atomic `index_add_`),
so a step's output does not depend on how the GPU scheduled it.

Tensor parallelism splits every expert by its intermediate columns, as the dense MLP is split
(engine/worker/parallel/sharding.py): the router is replicated (every rank routes the same
tokens the same way, its input being the all-reduced residual), each rank computes its
columns of every expert, and one all-reduce sums them. Qwen2-MoE's shared expert is a dense MLP
beside the experts, scaled per token by a sigmoid gate before that same all-reduce.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pdmesh.engine.worker.models.architecture import MoeSpec
from pdmesh.engine.worker.parallel.group import TensorParallel
from pdmesh.kernels.layer_ops import LayerOps

logger = logging.getLogger(__name__)


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts `[T, k]` (int64) and their weights `[T, k]` (float32), as
    transformers' routers compute them: softmax in float32, top k, optionally renormalised."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights


def _grouped_mm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands: a build that has it, one dtype, and
    rows in and out a multiple of 16 bytes (its alignment rule)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.dtype not in (torch.float32, torch.bfloat16):
        return False
    per_16 = 16 // x.element_size()
    return x.shape[1] % per_16 == 0 and weight.shape[1] % per_16 == 0


_REFUSED: set[tuple[str, torch.dtype]] = set()
"""(device type, dtype) pairs whose grouped GEMM raised or was wrong: one GEMM per expert."""
_VERIFIED: set[tuple[str, torch.dtype]] = set()
"""Pairs whose grouped GEMM matched one GEMM per expert on its first real call."""


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`x` `[N, in]` whose rows are runs by expert (run e ends at `offsets[e]`, int32,
    cumulative) times each run's expert `weight[e]` `[out, in]`: `[N, out]`.

    The grouped kernel checks itself: its first call on a device and dtype (the start-up
    memory profile's, before any CUDA graph is captured) is compared with one GEMM per
    expert, in every process that runs experts (each tensor-parallel rank checks its own
    shard), and a kernel that raises or disagrees is never used again there."""
    key = (x.device.type, x.dtype)
    if key in _REFUSED or not _grouped_mm_takes(x, weight):
        return loop_linear(x, weight, offsets)
    try:
        out = torch._grouped_mm(x.contiguous(), weight.transpose(1, 2), offs=offsets)
    except RuntimeError as exc:  # a device or dtype this build's kernel does not take
        return _refuse(key, f"raised {exc}", loop_linear(x, weight, offsets))
    if key not in _VERIFIED:
        reference = loop_linear(x, weight, offsets)
        error = (out.float() - reference.float()).abs().max().item()
        tolerance = (1e-4 if x.dtype == torch.float32 else 3e-2) * (
            1.0 + reference.float().abs().max().item())
        if not error <= tolerance:  # also catches NaN
            return _refuse(key, f"differs from one GEMM per expert by {error:.3g}", reference)
        _VERIFIED.add(key)
    return out


def _refuse(key: tuple[str, torch.dtype], why: str, result: torch.Tensor) -> torch.Tensor:
    _REFUSED.add(key)
    logger.warning("moe: grouped GEMM on %s %s %s; one GEMM per expert from now on", *key, why)
    return result


def loop_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` as one GEMM per expert that has rows (reads `offsets` on the host)."""
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, stop in enumerate(offsets.tolist()):
        if stop > start:
            out[start:stop] = F.linear(x[start:stop], weight[expert])
        start = stop
    return out


class Experts(nn.Module):
    """Every expert's fused gate/up `[E, 2I, H]` (gate rows first) and down `[E, H, I]`
    projections, I being this rank's columns: transformers' own in-memory layout and names."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                ops: LayerOps) -> torch.Tensor:
        """Σ_j weights[t, j] · expert_{experts[t, j]}(x[t]) for every token t: `[T, H]`."""
        tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offsets = counts.cumsum(0).to(torch.int32)
        rows = x.index_select(0, order // top_k)
        h = grouped_linear(rows, self.gate_up_proj, offsets)
        h = grouped_linear(ops.silu_and_mul(h), self.down_proj, offsets)
        per_slot = torch.empty_like(h).index_copy_(0, order, h).view(tokens, top_k, -1)
        # [T, 1, k] x [T, k, H]: the weighted sum in one batched GEMM (float32 accumulation,
        # no float32 copy of the T x k x H products).
        return torch.bmm(weights.unsqueeze(1).to(h.dtype), per_slot).squeeze(1)


class SparseMoe(nn.Module):
    """A layer's MoE MLP: router, experts and (Qwen2-MoE) the gated shared expert. Called like
    the dense MLP; its output is all-reduced once."""

    def __init__(self, hidden_size: int, spec: MoeSpec, intermediate: int,
                 shared: nn.Module | None, tp: TensorParallel) -> None:
        super().__init__()
        self.top_k, self.renormalize = spec.top_k, spec.renormalize
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec.num_experts, hidden_size, intermediate)
        self.shared_expert = shared
        self.shared_expert_gate = (nn.Linear(hidden_size, 1, bias=False)
                                   if shared is not None else None)
        self.tp = tp

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        experts, weights = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, experts, weights, ops)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            scale = torch.sigmoid(self.shared_expert_gate(x))
            out = out + scale * self.shared_expert.partial(x, ops)
        return self.tp.all_reduce(out)
