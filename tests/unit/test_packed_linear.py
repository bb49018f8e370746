"""The packed float32 CPU linear layers compute what `F.linear` computes: the native kernel
(kernels/csrc/linear_cpu.c) over every row, feature and input count its tiles split on, and
the layer that picks it or oneDNN's packing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdmesh.engine.worker.models.packed_linear import PackedLinear, can_pack_linears
from pdmesh.kernels import cpu_native

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
native = pytest.mark.skipif(cpu_native.library() is None,
                            reason="no C compiler: the native CPU kernels cannot be built here")


@native
@pytest.mark.parametrize(("rows", "inputs", "outputs"), [
    (1, 576, 960),  # one decode row
    (16, 576, 3072),  # a decode step's rows: two tiles of 8
    (13, 1536, 576),  # a tile of 5 rows left over
    (97, 64, 80),  # five blocks: a tile of three, then one of two
    (200, 33, 50),  # features past a whole block (50 = 3 x 16 + 2), an odd input count
    (97, 4096, 48),  # two chunks of rows (a chunk's x is kept to ~1 MiB)
    (5, 7, 16),  # one block
    (0, 8, 32),  # no rows
])
def test_native_linear_is_f_linear(rows: int, inputs: int, outputs: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + outputs)
    weight = torch.randn(outputs, inputs, generator=gen)
    x = torch.randn(rows, inputs, generator=gen)
    packed = cpu_native.pack_linear_weight(weight)
    assert packed.shape == (-(-outputs // 16), inputs, 16)
    got = cpu_native.linear(x, packed, outputs)
    # float32 sums of `inputs` unit-variance products: rounding grows as their sqrt
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5 * inputs**0.5, rtol=1e-5)
    batched = cpu_native.linear(x.view(1, rows, inputs), packed, outputs)  # [..., K] inputs
    assert batched.shape == (1, rows, outputs) and torch.equal(batched[0], got)


@native
def test_native_linear_refuses_what_does_not_fit() -> None:
    packed = cpu_native.pack_linear_weight(torch.ones(40, 8))
    with pytest.raises(ValueError, match="inputs"):
        cpu_native.linear(torch.ones(2, 9), packed, 40)
    with pytest.raises(ValueError, match="inputs"):
        cpu_native.linear(torch.ones(2, 8, dtype=torch.float64), packed, 40)
    with pytest.raises(ValueError, match="blocks of 16"):
        cpu_native.linear(torch.ones(2, 8), packed, 49)  # 3 blocks hold 33..48 outputs
    with pytest.raises(ValueError, match="blocks of 16"):
        cpu_native.linear(torch.ones(2, 8), packed, 32)


@pytest.mark.skipif(not can_pack_linears(CPU, torch.float32), reason="no oneDNN packing")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_the_linear(bias: bool) -> None:
    """The layer packs once (natively where it may, else oneDNN; a bias always oneDNN) and
    keeps only the packed copy."""
    torch.manual_seed(3)
    linear = nn.Linear(96, 80, bias=bias)
    layer = PackedLinear(linear)
    assert (layer.native is None) == (layer.packed is not None)
    if bias or not cpu_native.supports_linear(linear.weight):
        assert layer.native is None
    for rows in (1, 8, 33):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(layer(x), linear(x), atol=1e-4, rtol=1e-5)
