"""Checkpoint tensor names and ours, both ways: which Hugging Face tensors feed each of our
fused parameters (q/k/v, gate/up), Mixtral's MoE names as Qwen's, a multimodal checkpoint's
language-model prefixes (its vision tower is not ours), tensors a checkpoint stores fused
(Phi-3) split into the parts the rest of the loader expects, and the inverse: our parameters
under transformers' names (`hf_state_dict`). Pure naming: the loader does the reading."""

from __future__ import annotations

import torch

from pdmesh.engine.worker.models.architecture import ModelConfig
from pdmesh.engine.worker.models.llama import LlamaForCausalLM

# HF tensor names of a layer, grouped by the fused parameter they feed (in concat order).
FUSED = {
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
    "mlp.shared_expert.gate_up_proj.weight": (
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
    ),
}

# Mixtral's names for the MoE block and its experts' projections, as ours (Qwen's names).
_RENAMED = ((".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"),
            (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight"))


FUSED_IN_CHECKPOINT = ("phi3",)
"""Model types whose transformers modules hold q/k/v and gate/up fused, as we do."""


def fused_name(key: str) -> str | None:
    """The `FUSED` name `key` ends with when a checkpoint stores it fused (a layer's
    projection, not an expert's); None otherwise."""
    if not key.startswith("layers.") or ".experts." in key:
        return None
    return next((fused for fused in FUSED if key.endswith("." + fused)), None)


def split_fused(key: str, tensor: torch.Tensor, cfg: ModelConfig
                ) -> list[tuple[str, torch.Tensor]]:
    """A tensor a checkpoint stores fused (Phi-3's `qkv_proj` and `gate_up_proj`) as its parts
    under the names the unfused checkpoints use, so fusing and tensor-parallel slicing have one
    rule each (`FUSED`, `ModelShard.checkpoint_slice`); any other tensor as it is. The parts
    are views."""
    fused = fused_name(key)
    if fused is None:
        return [(key, tensor)]
    if "qkv_proj" in fused:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [tensor.shape[0] // 2] * 2
    if sum(sizes) != tensor.shape[0]:
        raise ValueError(f"model: fused tensor {key} has {tensor.shape[0]} rows, "
                         f"the config says {sum(sizes)}")
    prefix = key.removesuffix(fused)
    return list(zip([prefix + part for part in FUSED[fused]], tensor.split(sizes, dim=0),
                    strict=True))


def our_name(checkpoint_name: str) -> str | None:
    """A checkpoint tensor's name as the loader keys it: no `model.` prefix (nor a multimodal
    checkpoint's language-model prefix), Mixtral's MoE names as Qwen's
    (`block_sparse_moe.experts.<e>.w1` -> `mlp.experts.<e>.gate_proj`); None for a tensor of
    a vision tower, which is not loaded."""
    if checkpoint_name.startswith(_VISION_PREFIXES):
        return None
    for prefix, replacement in _LANGUAGE_PREFIXES:
        if checkpoint_name.startswith(prefix):
            checkpoint_name = replacement + checkpoint_name.removeprefix(prefix)
            break
    name = checkpoint_name.removeprefix("model.")
    if ".block_sparse_moe." in name:
        for old, new in _RENAMED:
            name = name.replace(old, new)
    return name


_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")
_LANGUAGE_PREFIXES = (("language_model.model.", ""), ("model.language_model.", ""),
                      ("language_model.lm_head.", "lm_head."))


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under transformers' names (q/k/v and gate/up split again), as views.

    The inverse of the checkpoint load, for handing the same weights to transformers'
    LlamaForCausalLM (bench/gpu_throughput.py) without a second copy of an 8B model.
    A tied LM head is left out, as in a tied checkpoint. Experts keep their stacked tensors,
    which are transformers' own in-memory layout.
    """
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("lm_head."):
            if not cfg.tie_word_embeddings:
                state[name] = tensor
            continue
        if cfg.norm_offset and name.endswith("norm.weight"):
            tensor = tensor - cfg.norm_offset  # a copy: Gemma's stored form
        if not name.startswith("layers."):
            state[f"model.{name}"] = tensor
            continue
        _, index, local = name.split(".", 2)  # layers.<i>.<module>.<param>
        prefix = f"model.layers.{index}."
        if local not in FUSED or cfg.model_type in FUSED_IN_CHECKPOINT:
            state[prefix + local] = tensor
            continue
        sizes = [q, kv, kv] if "qkv_proj" in local else [tensor.shape[0] // 2] * 2
        pieces = tensor.split(sizes, dim=0)
        for part, piece in zip(FUSED[local], pieces, strict=True):
            state[prefix + part] = piece
    return state
