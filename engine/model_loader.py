"""Build our Llama-family model from a Hugging Face checkpoint directory."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from pdmesh.engine.models.llama import LlamaForCausalLM, ModelConfig, RotaryEmbedding, rope_inv_freq

logger = logging.getLogger(__name__)

# HF tensor names of a layer, grouped by the fused parameter they feed (in concat order).
_FUSED = {
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attn.qkv_proj.bias": (
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.gate_up_proj.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
}


def load_hf_config(model_dir: Path) -> object:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                # A copy, not a view of the file's mapping: one tensor still viewing it (the
                # embeddings) kept the whole file mapped and resident next to the fused and
                # packed copies the model really uses (513 MiB of RSS for SmolLM2-135M).
                tensors[name] = fh.get_tensor(name).clone()
    return tensors


def load_model(
    model_dir: Path, dtype: torch.dtype, device: torch.device, max_positions: int
) -> tuple[LlamaForCausalLM, ModelConfig, object]:
    hf = load_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf)
    inv_freq, scaling = rope_inv_freq(hf, cfg.head_dim)
    rope = RotaryEmbedding(inv_freq, scaling, max_positions)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, None)
    model.rope = rope

    raw = read_safetensors(model_dir)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        state[name.removeprefix("model.")] = tensor
    for i in range(cfg.num_layers):
        prefix = f"layers.{i}."
        for fused, parts in _FUSED.items():
            names = [prefix + p for p in parts]
            if all(n in state for n in names):
                state[prefix + fused] = torch.cat([state.pop(n) for n in names], dim=0)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {
        k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"model: checkpoint in {model_dir} does not match the {cfg.model_type} architecture "
            f"(missing: {sorted(missing)[:5]}, unexpected: {sorted(unexpected)[:5]})"
        )
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype).eval()
    return model, cfg, hf

