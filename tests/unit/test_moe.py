"""The mixture-of-experts MLP (engine/worker/models/moe.py) against transformers' own MoE
blocks on the same random weights: Mixtral, Qwen2-MoE (with its gated shared expert) and
Qwen3-MoE, with and without renormalised top-k weights; the grouped GEMM against one GEMM per
expert, empty experts and shapes the grouped kernel does not take included; and which layers
of a Qwen config are sparse."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdmesh.engine.worker.models.architecture import MoeSpec
from pdmesh.engine.worker.models.moe import (
    SparseMoe,
    grouped_linear,
    loop_linear,
    route,
)
from pdmesh.engine.worker.parallel.group import SINGLE
from pdmesh.kernels.layer_ops import CpuLayerOps, TorchLayerOps

pytestmark = pytest.mark.fast

HIDDEN, EXPERT_WIDTH, EXPERTS, TOP_K = 64, 32, 8, 2


def hf_block(model_type: str, norm_topk_prob: bool = False) -> tuple[torch.nn.Module, object]:
    """transformers' sparse MoE block of `model_type`, random weights (routers included)."""
    import transformers

    torch.manual_seed(0)
    common = {"hidden_size": HIDDEN, "num_experts_per_tok": TOP_K, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 64}
    if model_type == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=EXPERTS,
                                            intermediate_size=EXPERT_WIDTH, **common)
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    elif model_type == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            num_experts=EXPERTS, moe_intermediate_size=EXPERT_WIDTH, intermediate_size=96,
            shared_expert_intermediate_size=48, norm_topk_prob=norm_topk_prob, **common)
        block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config)
    else:
        config = transformers.Qwen3MoeConfig(
            num_experts=EXPERTS, moe_intermediate_size=EXPERT_WIDTH, intermediate_size=96,
            norm_topk_prob=norm_topk_prob, **common)
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.2)
    return block.eval(), config


def ours_of(block: torch.nn.Module, config: object) -> SparseMoe:
    """Our SparseMoe holding `block`'s weights (the shared expert's gate/up fused, gate first)."""
    from pdmesh.engine.worker.models.architecture import ModelConfig
    from pdmesh.engine.worker.models.llama import MLP

    spec = MoeSpec.from_hf(config, 1)
    assert spec is not None
    shared = None
    if spec.shared_intermediate_size:
        cfg = ModelConfig.from_hf(config)
        shared = MLP(cfg, spec.shared_intermediate_size, SINGLE)
    ours = SparseMoe(HIDDEN, spec, spec.intermediate_size, shared, SINGLE)
    theirs = dict(block.named_parameters())
    with torch.no_grad():
        ours.gate.weight.copy_(theirs["gate.weight"])
        ours.experts.gate_up_proj.copy_(theirs["experts.gate_up_proj"])
        ours.experts.down_proj.copy_(theirs["experts.down_proj"])
        if shared is not None and ours.shared_expert_gate is not None:
            shared.gate_up_proj.weight.copy_(torch.cat([theirs["shared_expert.gate_proj.weight"],
                                                        theirs["shared_expert.up_proj.weight"]]))
            shared.down_proj.weight.copy_(theirs["shared_expert.down_proj.weight"])
            ours.shared_expert_gate.weight.copy_(theirs["shared_expert_gate.weight"])
    return ours.eval()


@pytest.mark.parametrize(("model_type", "norm"), [("mixtral", True), ("qwen2_moe", False),
                                                  ("qwen3_moe", False), ("qwen3_moe", True)])
@pytest.mark.parametrize("ops", [TorchLayerOps(), CpuLayerOps()], ids=lambda o: o.name)
def test_the_block_computes_what_transformers_computes(model_type: str, norm: bool,
                                                       ops: object) -> None:
    block, config = hf_block(model_type, norm)
    ours = ours_of(block, config)
    x = torch.randn(1, 37, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = block(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = ours(x[0], ops)  # type: ignore[arg-type]
    torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=1e-5)


def test_routing_is_softmax_then_top_k_then_optionally_renormalised() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 5.0]])
    experts, weights = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert experts[0].tolist() == [1, 2]
    torch.testing.assert_close(weights[0], probs[0, [1, 2]])
    _, renormalised = route(logits, 2, renormalize=True)
    torch.testing.assert_close(renormalised.sum(dim=-1), torch.ones(2))
    assert weights.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("width_in", "width_out"), [(64, 32), (36, 20)])  # 36/20: no kernel
def test_the_grouped_gemm_is_one_gemm_per_expert(dtype: torch.dtype, width_in: int,
                                                 width_out: int) -> None:
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(5, width_out, width_in, generator=g).to(dtype)
    x = torch.randn(11, width_in, generator=g).to(dtype)
    offsets = torch.tensor([3, 3, 3, 10, 11], dtype=torch.int32)  # experts 1, 2: no rows
    expected = torch.cat([x[0:3] @ weight[0].T, x[3:10] @ weight[3].T, x[10:11] @ weight[4].T])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped_linear(x, weight, offsets), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(loop_linear(x, weight, offsets), expected, atol=tol, rtol=tol)


def test_every_token_gets_its_top_k_experts_whatever_the_batch_order() -> None:
    """Sorting by expert and back: a token's output is the same alone or in a batch."""
    block, config = hf_block("qwen3_moe")
    ours = ours_of(block, config)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(4))
    ops = TorchLayerOps()
    with torch.no_grad():
        batched = ours(x, ops)
        alone = torch.cat([ours(x[i:i + 1], ops) for i in range(9)])
    torch.testing.assert_close(batched, alone, atol=1e-6, rtol=1e-6)


def test_qwen_configs_say_which_layers_are_sparse() -> None:
    hf = SimpleNamespace(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, norm_topk_prob=True,
                         decoder_sparse_step=2, mlp_only_layers=[3])
    spec = MoeSpec.from_hf(hf, 6)
    assert spec is not None
    assert [spec.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    assert spec.active_intermediate_size == 64
    mixtral = SimpleNamespace(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2,
                              intermediate_size=14336)
    assert MoeSpec.from_hf(mixtral, 32) == MoeSpec(8, 2, 14336, renormalize=True)
    assert MoeSpec.from_hf(SimpleNamespace(model_type="llama"), 2) is None
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoeSpec.from_hf(SimpleNamespace(model_type="mixtral", num_local_experts=4,
                                        num_experts_per_tok=5, intermediate_size=8), 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_gemm_on_cuda_is_one_gemm_per_expert(dtype: torch.dtype) -> None:
    """The CUTLASS kernel (bfloat16 on sm90+) or, where it refuses, the loop: either way the
    per-expert products, and no host read on the bfloat16 path where it runs."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(8, 256, 128, generator=g).to("cuda", dtype)
    x = torch.randn(40, 128, generator=g).to("cuda", dtype)
    offsets = torch.tensor([0, 5, 5, 17, 30, 30, 39, 40], dtype=torch.int32, device="cuda")
    expected = loop_linear(x.float(), weight.float(), offsets)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(grouped_linear(x, weight, offsets).float(), expected,
                               atol=tol, rtol=tol)


def test_a_grouped_gemm_that_is_wrong_on_its_first_call_is_never_used_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel checks itself against one GEMM per expert once per device and dtype; a
    wrong one (here: a stand-in that drops the last expert's rows) is refused for good and its
    caller gets the right products all the same."""
    from pdmesh.engine.worker.models import moe

    monkeypatch.setattr(moe, "_REFUSED", set())
    monkeypatch.setattr(moe, "_VERIFIED", set())
    real = torch._grouped_mm
    calls = []

    def wrong(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        out = real(a, b, offs=offs)
        out[int(offs[-2]):] = 0
        return out

    monkeypatch.setattr(torch, "_grouped_mm", wrong)
    g = torch.Generator().manual_seed(6)
    weight, x = torch.randn(3, 32, 16, generator=g), torch.randn(9, 16, generator=g)
    offsets = torch.tensor([2, 5, 9], dtype=torch.int32)
    expected = loop_linear(x, weight, offsets)
    torch.testing.assert_close(grouped_linear(x, weight, offsets), expected)
    torch.testing.assert_close(grouped_linear(x, weight, offsets), expected)
    assert len(calls) == 1 and ("cpu", torch.float32) in moe._REFUSED
