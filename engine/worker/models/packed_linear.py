"""A float32 CPU linear layer whose weight is packed once, at load time.

`F.linear` goes to MKL's sgemm, which re-packs the whole weight on every call; at the few rows
of a decode step (M = batch size) the packing costs more than the multiply. Two packings, the
faster where it runs:

- the native kernel's (`kernels/csrc/linear_cpu.c`): blocks of 16 output features, k-major,
  multiplied as outer products with no horizontal sums; on CPUs with AVX-512, where it was
  measured (bench/README.md, "The decode step's kernels"; `bench/linear.py`): fastest up to
  256 rows, 5-9 % behind oneDNN from 512;
- oneDNN's reorder (`torch.ops.mkldnn`), elsewhere: 2x faster than `F.linear` at M=4..8 on the
  2-core dev VM, equal at M=1 and M>=512.

Either way the layer holds one copy of the weight (the packed one) and its results differ from
`F.linear` only in the float32 summation order.
"""

from __future__ import annotations

import torch
from torch import nn

from pdmesh.kernels import cpu_native


class PackedLinear(nn.Module):
    """`linear` packed: natively where `cpu_native.supports_linear` says so and `native` allows
    (a bias always goes to oneDNN), else by oneDNN."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 8, native: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        weight = linear.weight.detach()
        # Opaque packed tensors: kept as plain attributes, not parameters or buffers.
        self.native: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        if native and self.bias is None and cpu_native.supports_linear(weight):
            self.native = cpu_native.pack_linear_weight(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return cpu_native.linear(x, self.native, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack_linears(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )
