"""FP8 checkpoint arithmetic (engine/worker/fp8_checkpoint.py): block-wise scales with partial
edge blocks, one scale per tensor, which tensors keep their stored dtype, which scales are
dropped, and the quantization schemes refused at start-up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdmesh.engine.worker.fp8_checkpoint import (
    Fp8Checkpoint,
    dequantize,
    dequantized_state,
    keeps_stored_dtype,
)

pytestmark = pytest.mark.fast

E4M3 = torch.float8_e4m3fn


def test_each_block_is_multiplied_by_its_own_scale_edges_included() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 7, generator=g).to(E4M3)
    scale = torch.rand(3, 3, generator=g) + 0.5  # blocks of 2 x 3: the last row/column partial
    got = dequantize(weight, scale, (2, 3), torch.float32)
    expected = torch.empty(5, 7)
    for r in range(5):
        for c in range(7):
            expected[r, c] = weight[r, c].float() * scale[r // 2, c // 3]
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert dequantize(weight, scale, (2, 3), torch.bfloat16).dtype == torch.bfloat16


def test_a_per_tensor_scale_multiplies_everything() -> None:
    weight = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).to(E4M3)
    got = dequantize(weight, torch.tensor([0.25]), None, torch.float32)
    torch.testing.assert_close(got, torch.tensor([[0.25, -0.5], [0.125, 1.0]]))


def test_a_scale_grid_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"needs a \(3, 3\) grid"):
        dequantize(torch.zeros(5, 7).to(E4M3), torch.ones(2, 3), (2, 3), torch.float32)


def test_the_state_loses_its_scales_and_keeps_what_is_not_quantized() -> None:
    state = {
        "layers.0.mlp.down_proj.weight": torch.ones(2, 2).to(E4M3),
        "layers.0.mlp.down_proj.weight_scale_inv": torch.full((1, 1), 3.0),
        "layers.0.self_attn.o_proj.weight": torch.ones(2, 2).to(E4M3),
        "layers.0.self_attn.o_proj.weight_scale": torch.tensor(0.5),
        "layers.0.self_attn.o_proj.input_scale": torch.tensor(1.0),
        "layers.0.self_attn.k_scale": torch.tensor(1.0),
        "norm.weight": torch.ones(2),
    }
    out = dequantized_state(state, Fp8Checkpoint((128, 128)), torch.float32)
    assert sorted(out) == ["layers.0.mlp.down_proj.weight", "layers.0.self_attn.o_proj.weight",
                           "norm.weight"]
    assert out["layers.0.mlp.down_proj.weight"].eq(3.0).all()
    assert out["layers.0.self_attn.o_proj.weight"].eq(0.5).all()
    with pytest.raises(ValueError, match="has no weight_scale_inv"):
        dequantized_state({"lm_head.weight": torch.ones(1, 1).to(E4M3)},
                          Fp8Checkpoint(None), torch.float32)


def test_fp8_weights_and_scales_reach_the_device_as_stored() -> None:
    assert keeps_stored_dtype("layers.0.mlp.up_proj.weight", E4M3)
    assert keeps_stored_dtype("layers.0.mlp.up_proj.weight_scale_inv", torch.float32)
    assert not keeps_stored_dtype("layers.0.mlp.up_proj.weight", torch.bfloat16)
    assert not keeps_stored_dtype("embed_tokens.weight", torch.float32)


@pytest.mark.parametrize(("config", "expected"), [
    (None, None),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, Fp8Checkpoint((128, 128))),
    ({"quant_method": "fp8", "activation_scheme": "static"}, Fp8Checkpoint(None)),
])
def test_the_scheme_is_read_from_the_config(config: dict | None,
                                            expected: Fp8Checkpoint | None) -> None:
    assert Fp8Checkpoint.of(SimpleNamespace(quantization_config=config)) == expected


@pytest.mark.parametrize(("config", "error"), [
    ({"quant_method": "awq", "bits": 4}, "'awq' quantization is not supported"),
    ({"quant_method": "compressed-tensors"}, "'compressed-tensors' quantization"),
    ({"quant_method": "fp8", "expert_dtype": "fp4"}, "only e4m3"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
])
def test_other_schemes_are_refused_by_name(config: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Fp8Checkpoint.of(SimpleNamespace(quantization_config=config))


def test_quantization_flag_must_name_the_checkpoints_own_method() -> None:
    """vLLM's --quantization: taken when it names what the checkpoint is; pdmesh never
    quantizes an unquantized checkpoint at load, nor serves one as another method."""
    from pdmesh.engine.worker.fp8_checkpoint import check_requested

    check_requested(None, None)
    check_requested(None, Fp8Checkpoint((128, 128)))
    check_requested("fp8", Fp8Checkpoint((128, 128)))
    with pytest.raises(ValueError, match="--quantization fp8: the checkpoint's quantization "
                                         "is none"):
        check_requested("fp8", None)
    with pytest.raises(ValueError, match="--quantization awq: the checkpoint's quantization "
                                         "is fp8"):
        check_requested("awq", Fp8Checkpoint(None))
