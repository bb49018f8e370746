"""The fused layer ops (kernels/layer_ops.py) against the reference formulas.

The `cpu` implementation runs here; the Triton kernels run in Triton's interpreter in a child
process (tests/triton_interpreter.py), and compiled on a CUDA device where there is one.
Shapes cover what the kernels branch on: row sizes that are not powers of two, GQA (fewer k
heads than q heads), q/k as strided views of a fused QKV output, float32 and bfloat16.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdmesh.kernels import cpu_native
from pdmesh.kernels.layer_ops import (
    CpuLayerOps,
    LayerOps,
    TorchLayerOps,
    select_layer_ops,
)
from tests.triton_interpreter import outcomes_of, run_cases

REF = TorchLayerOps()
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CASES: dict[str, Callable[[LayerOps], None]] = {}


def case(name: str) -> Callable:
    def register(fn: Callable[[LayerOps], None]) -> Callable[[LayerOps], None]:
        CASES[name] = fn
        return fn

    return register


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])


def _inputs(rows: int, cols: int, dtype: torch.dtype, device: str = "cpu",
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen).to(dtype).to(device)
    res = torch.randn(rows, cols, generator=gen).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(cols, generator=gen)).to(dtype).to(device)
    return x, res, w


def _rms_norm(ops: LayerOps, rows: int, cols: int, dtype: torch.dtype,
              device: str = "cpu") -> None:
    x, res, w = _inputs(rows, cols, dtype, device)
    close(ops.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), dtype)
    res_ref = res.clone()
    expected = REF.add_rms_norm(x, res_ref, w, 1e-6)
    actual = ops.add_rms_norm(x, res, w, 1e-6)
    close(actual, expected, dtype)
    close(res, res_ref, dtype)  # the residual stream was updated in place


def _rope(ops: LayerOps, tokens: int, q_heads: int, k_heads: int, dim: int,
          dtype: torch.dtype, device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * dim, generator=gen).to(dtype).to(device)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 6.0
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([q_heads * dim, k_heads * dim, k_heads * dim], dim=-1)
        return q.view(tokens, q_heads, dim), k.view(tokens, k_heads, dim)

    expected = qkv.clone()
    REF.rope_(*views(expected), cos, sin)
    ops.rope_(*views(qkv), cos, sin)  # strided views of the fused output, rotated in place
    close(qkv, expected, dtype)


def _silu_and_mul(ops: LayerOps, rows: int, cols: int, dtype: torch.dtype,
                  device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = (3 * torch.randn(rows, 2 * cols, generator=gen)).to(dtype).to(device)
    close(ops.silu_and_mul(gate_up), REF.silu_and_mul(gate_up), dtype)


for _dtype in (torch.float32, torch.bfloat16):
    _name = str(_dtype)[6:]
    for _rows, _cols in ((1, 576), (7, 576), (3, 100), (64, 576)):  # 64 rows: threaded
        case(f"rms_norm-{_rows}x{_cols}-{_name}")(
            lambda ops, r=_rows, c=_cols, d=_dtype: _rms_norm(ops, r, c, d))
    for _shape in ((5, 9, 3, 64), (2, 4, 4, 128), (1, 8, 1, 64), (64, 9, 3, 64)):
        case(f"rope-{'x'.join(map(str, _shape))}-{_name}")(
            lambda ops, s=_shape, d=_dtype: _rope(ops, *s, d))
    for _rows, _cols in ((4, 1536), (1, 100), (3, 2500), (24, 1536)):
        case(f"silu_and_mul-{_rows}x{_cols}-{_name}")(
            lambda ops, r=_rows, c=_cols, d=_dtype: _silu_and_mul(ops, r, c, d))


@pytest.mark.fast
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_ops_match_reference(name: str, native: bool, monkeypatch: pytest.MonkeyPatch
                                 ) -> None:
    """Both CPU paths: the native kernels (float32 and bfloat16, where a compiler built
    them) and the plain-torch forms used without them."""
    if native and cpu_native.library() is None:
        pytest.skip("no C compiler: the native kernels are not built")
    if not native:
        monkeypatch.setattr(cpu_native, "supports_layer_ops", lambda *tensors: False)
        monkeypatch.setattr(cpu_native, "can_rope", lambda q, k: False)
    CASES[name](CpuLayerOps())


@pytest.mark.fast
def test_native_silu_at_extreme_gates_and_the_native_path_is_taken() -> None:
    if cpu_native.library() is None:
        pytest.skip("no C compiler: the native kernels are not built")
    gate_up = torch.tensor([[-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0] + [1.5] * 7])
    assert cpu_native.supports_layer_ops(gate_up)
    got = cpu_native.silu_and_mul(gate_up)
    assert torch.isfinite(got).all()
    close(got, REF.silu_and_mul(gate_up), torch.float32)
    q = torch.randn(3, 4, 8)
    assert cpu_native.can_rope(q, q[:, :2])
    assert not cpu_native.can_rope(q.transpose(0, 1), q)  # heads not contiguous: torch path


@pytest.mark.fast
@pytest.mark.parametrize("rows", [1, 7, 64])  # 64: rows split over threads
def test_native_bfloat16_ops_round_where_the_reference_rounds(rows: int) -> None:
    """In bfloat16 the native kernels compute in float32 and round back where the reference
    (and transformers) round: the same bits, not just close ones."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler: the native kernels are not built")
    x, res, w = _inputs(rows, 576, torch.bfloat16, seed=rows)
    assert cpu_native.supports_layer_ops(x, res, w)
    assert not cpu_native.supports_layer_ops(x, w.float())  # mixed dtypes: the torch path
    assert torch.equal(cpu_native.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5))
    res_ref = res.clone()
    assert torch.equal(cpu_native.add_rms_norm(x, res, w, 1e-6),
                       REF.add_rms_norm(x, res_ref, w, 1e-6))
    assert torch.equal(res, res_ref)
    gen = torch.Generator().manual_seed(rows)
    gate_up = (3 * torch.randn(rows, 2 * 1536, generator=gen)).bfloat16()
    assert torch.equal(cpu_native.silu_and_mul(gate_up), REF.silu_and_mul(gate_up))
    qkv = torch.randn(rows, 15 * 64, generator=gen).bfloat16()
    angles = torch.rand(rows, 32, generator=gen) * 6.0
    expected = qkv.clone()
    REF.rope_(expected[:, :576].view(rows, 9, 64), expected[:, 576:768].view(rows, 3, 64),
              angles.cos(), angles.sin())
    q, k = qkv[:, :576].view(rows, 9, 64), qkv[:, 576:768].view(rows, 3, 64)
    assert cpu_native.can_rope(q, k)
    cpu_native.rope_(q, k, angles.cos(), angles.sin())
    assert torch.equal(qkv, expected)


@pytest.mark.fast
def test_reference_is_transformers_llama_math() -> None:
    """float32 greedy parity with transformers rests on the reference being its numbers."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, _, w = _inputs(16, 576, torch.float32)
    hf = LlamaRMSNorm(576, eps=1e-5)
    hf.weight.data.copy_(w)
    with torch.no_grad():
        assert torch.equal(REF.rms_norm(x, w, 1e-5), hf(x))
    diff = (CpuLayerOps().rms_norm(x, w, 1e-5) - hf(x)).abs().max().item()
    assert diff <= 1e-6


@pytest.mark.fast
def test_selection() -> None:
    assert select_layer_ops("cpu").name == "cpu"
    assert select_layer_ops("cpu", "torch").name == "torch"
    with pytest.raises(ValueError, match="one of torch, cpu, triton"):
        select_layer_ops("cpu", "fast")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            select_layer_ops("cpu", "triton")


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str | None]:
    pytest.importorskip("triton")
    return outcomes_of(__file__)


@pytest.mark.processes
@pytest.mark.parametrize("name", list(CASES))
def test_triton_ops_match_reference_interpreted(interpreted: dict[str, Any], name: str) -> None:
    assert name in interpreted
    assert interpreted[name] is None, interpreted[name]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_ops_compiled_on_cuda() -> None:
    ops = select_layer_ops("cuda")
    assert ops.name == "triton"
    for dtype in (torch.float32, torch.bfloat16):
        _rms_norm(ops, 33, 4096, dtype, "cuda")
        _rope(ops, 17, 32, 8, 128, dtype, "cuda")
        _silu_and_mul(ops, 9, 14336, dtype, "cuda")


if __name__ == "__main__":
    from pdmesh.kernels.triton_layer_ops import TritonLayerOps

    print(json.dumps(run_cases(CASES, TritonLayerOps())))
