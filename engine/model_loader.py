"""Build our Llama-family model from a Hugging Face checkpoint directory."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
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


LOAD_FORMATS = ("auto", "dummy")


@contextmanager
def _meta_without_init() -> Iterator[None]:
    """Modules built on the meta device, their `normal_` initializer skipped: meta tensors hold
    no values to initialize, and `normal_` on one imports torch._dynamo (1.7 s of every core's
    start) and, through it, triton, whose nanobind leak report then fills the console at every
    exit even on a CPU-only host where triton cannot run."""
    normal = torch.nn.init.normal_
    torch.nn.init.normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.nn.init.normal_ = normal


DUMMY_INIT_STD = 0.02
"""Standard deviation of dummy weights: the usual Llama initializer range, small enough that
activations stay finite through 32 bf16 layers."""


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
) -> tuple[LlamaForCausalLM, ModelConfig, object]:
    """Our model of the config in `model_dir`, on `device` in `dtype`.

    `load_format` is vLLM's: "auto" reads the checkpoint's safetensors, "dummy" initialises
    random weights from `seed` (benchmarks of shapes nobody downloaded; the outputs are noise).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    hf = load_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf)
    inv_freq, scaling = rope_inv_freq(hf, cfg.head_dim)
    rope = RotaryEmbedding(inv_freq, scaling, max_positions)
    with _meta_without_init():
        model = LlamaForCausalLM(cfg, None)
    model.rope = rope
    if load_format == "dummy":
        state = dummy_state(model, dtype, device, seed)
    else:
        state = checkpoint_state(model_dir, model, cfg)
        state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype).eval()
    return model, cfg, hf


def dummy_state(
    model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    """Random weights for every parameter of the (meta) `model`, made on `device` in `dtype`.

    Each tensor is drawn where it will live, so an 8B shape costs its 16 GB of bf16 on the GPU
    and nothing on the host (no float32 staging copy). Norm weights are 1 and biases 0, as at
    the start of training; the same seed on the same device gives the same weights.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, meta in model.named_parameters():  # tied lm_head is yielded once, as embeddings
        tensor = torch.empty(meta.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith(".bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, DUMMY_INIT_STD, generator=gen)
        state[name] = tensor
    return state


def checkpoint_state(
    model_dir: Path, model: LlamaForCausalLM, cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors renamed and fused into our parameter names, checked complete."""
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
    return state


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under transformers' names (q/k/v and gate/up split again), as views.

    The inverse of the checkpoint load, for handing the same weights to transformers'
    LlamaForCausalLM (bench/gpu_throughput.py) without a second copy of an 8B model.
    A tied LM head is left out, as in a tied checkpoint.
    """
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    split_sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("lm_head."):
            if not cfg.tie_word_embeddings:
                state[name] = tensor
            continue
        if not name.startswith("layers."):
            state[f"model.{name}"] = tensor
            continue
        _, index, local = name.split(".", 2)  # layers.<i>.<module>.<param>
        prefix = f"model.layers.{index}."
        if local not in _FUSED:
            state[prefix + local] = tensor
            continue
        pieces = tensor.split(split_sizes[local.split(".")[1]], dim=0)
        for part, piece in zip(_FUSED[local], pieces, strict=True):
            state[prefix + part] = piece
    return state
