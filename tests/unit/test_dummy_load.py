"""`load_model(..., load_format="dummy")`: random weights of a config's shape, no checkpoint.

Benchmarks of shapes nobody downloaded (bench/gpu_throughput.py) build a directory holding
only config.json; these tests use such directories, so any read of safetensors fails them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdmesh.engine.worker.checkpoint_names import hf_state_dict
from pdmesh.engine.worker.model_loader import load_model

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")


def write_config(path: Path, **overrides: object) -> Path:
    """A tiny Llama config.json (and nothing else) in `path`."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    config.update(overrides)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_dummy_builds_the_configs_shape_from_config_json_alone(tmp_path: Path) -> None:
    model_dir = write_config(tmp_path / "m")
    model, cfg, _ = load_model(model_dir, torch.bfloat16, CPU, 128, load_format="dummy")
    assert list(model_dir.iterdir()) == [model_dir / "config.json"]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (32, 2, 2, 8)
    params = dict(model.named_parameters())
    assert params["embed_tokens.weight"].shape == (256, 32)
    assert params["layers.0.self_attn.qkv_proj.weight"].shape == ((4 + 2 * 2) * 8, 32)
    assert params["layers.1.mlp.gate_up_proj.weight"].shape == (128, 32)
    assert params["lm_head.weight"].shape == (256, 32)
    for name, p in params.items():
        assert p.dtype == torch.bfloat16 and p.device == CPU, name
        assert not p.is_meta, name
    # Norms start at 1 (as a trained model's roughly are); matrices are small and random.
    assert torch.equal(params["norm.weight"], torch.ones(32, dtype=torch.bfloat16))
    qkv = params["layers.0.self_attn.qkv_proj.weight"].float()
    assert 0.01 < qkv.std().item() < 0.04 and abs(qkv.mean().item()) < 0.01
    # The model runs: RoPE tables were built on the device as for a real checkpoint.
    assert model.rope is not None and model.rope.cos.shape == (128, 4)


def test_dummy_is_deterministic_and_tied_embeddings_stay_tied(tmp_path: Path) -> None:
    model_dir = write_config(tmp_path / "m", tie_word_embeddings=True)
    a, _, _ = load_model(model_dir, torch.float32, CPU, 64, load_format="dummy")
    b, _, _ = load_model(model_dir, torch.float32, CPU, 64, load_format="dummy")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert a.lm_head.weight is a.embed_tokens.weight
    c, _, _ = load_model(model_dir, torch.float32, CPU, 64, load_format="dummy", seed=1)
    assert not torch.equal(c.embed_tokens.weight, a.embed_tokens.weight)


def test_auto_still_needs_safetensors(tmp_path: Path) -> None:
    model_dir = write_config(tmp_path / "m")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_model(model_dir, torch.float32, CPU, 64)


def test_unknown_load_format_is_a_clear_error(tmp_path: Path) -> None:
    model_dir = write_config(tmp_path / "m")
    with pytest.raises(ValueError, match="load_format must be auto or dummy, got 'pt'"):
        load_model(model_dir, torch.float32, CPU, 64, load_format="pt")


@pytest.mark.parametrize("tied", [False, True])
def test_hf_state_dict_names_every_transformers_tensor_as_views(tmp_path: Path, tied: bool) -> None:
    from transformers import AutoConfig, LlamaForCausalLM

    model_dir = write_config(tmp_path / "m", tie_word_embeddings=tied)
    ours, _, _ = load_model(model_dir, torch.float32, CPU, 64, load_format="dummy")
    state = hf_state_dict(ours)
    reference = LlamaForCausalLM(AutoConfig.from_pretrained(model_dir))
    expected = set(reference.state_dict())
    if tied:
        expected.discard("lm_head.weight")
    assert set(state) == expected
    for name, tensor in state.items():
        assert tensor.shape == reference.state_dict()[name].shape, name
    qkv = ours.layers[1].self_attn.qkv_proj.weight
    v = state["model.layers.1.self_attn.v_proj.weight"]
    assert v.data_ptr() == qkv[-v.shape[0]:].data_ptr()  # a view, no copy


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_hf_state_dict_of_experts_is_transformers_state_dict(tmp_path: Path,
                                                             model_type: str) -> None:
    """MoE dummy weights (for `pdmesh selftest` and the GPU bench on MoE shapes) hand over to
    transformers: experts stacked as its in-memory layout, the shared expert split again."""
    from transformers import AutoConfig, AutoModelForCausalLM

    moe = {"num_experts_per_tok": 2, "num_local_experts": 4, "num_experts": 4,
           "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24}
    model_dir = write_config(tmp_path / "m", model_type=model_type, **moe)
    ours, cfg, _ = load_model(model_dir, torch.float32, CPU, 64, load_format="dummy")
    assert cfg.moe is not None and cfg.moe.num_experts == 4
    state = hf_state_dict(ours)
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    assert set(state) == set(reference.state_dict())
    for name, tensor in state.items():
        assert tensor.shape == reference.state_dict()[name].shape, name


def test_hf_state_dict_of_phi3_keeps_its_fused_projections(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = write_config(tmp_path / "m", model_type="phi3", pad_token_id=0)
    ours, _, _ = load_model(model_dir, torch.float32, CPU, 64, load_format="dummy")
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    assert set(hf_state_dict(ours)) == set(reference.state_dict())


@pytest.mark.parametrize(("rope", "error"), [
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}, "partial RoPE"),
    ({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
      "long_factor": [2.0] * 4, "original_max_position_embeddings": 64}, "longrope"),
])
def test_rope_variants_pdmesh_cannot_run_are_refused(tmp_path: Path, rope: dict,
                                                     error: str) -> None:
    model_dir = write_config(tmp_path / "m", model_type="phi3", rope_parameters=rope)
    with pytest.raises(ValueError, match=error):
        load_model(model_dir, torch.float32, CPU, 64, load_format="dummy")


def test_gemma3_norms_hand_over_in_gemmas_stored_form(tmp_path: Path) -> None:
    """Gemma keeps a norm's weight as w in x * (1 + w): loaded as 1 + w, handed back as w."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = write_config(tmp_path / "m", model_type="gemma3_text", head_dim=8)
    ours, cfg, _ = load_model(model_dir, torch.float32, CPU, 64, load_format="dummy")
    assert (cfg.norm_offset, cfg.sandwich_norms, cfg.qk_norm) == (1.0, True, True)
    state = hf_state_dict(ours)
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    assert set(state) == set(reference.state_dict())
    norm = ours.layers[0].pre_feedforward_layernorm.weight
    torch.testing.assert_close(state["model.layers.0.pre_feedforward_layernorm.weight"],
                               norm - 1.0)
