"""Random-weight Llama checkpoints of real architectures' shapes, for tests that must run where
no weights travel (a lent GPU machine: ../shared/GPU.md, bench/gpu_check.sh).

`write_random_llama(dest, "smollm2-135m")` writes what `from_pretrained` and our loader read —
config.json and model.safetensors from transformers' own `LlamaForCausalLM` (its initializer:
N(0, 0.02) matrices, unit norms) — plus SmolLM2's tokenizer files, so `LLM(dest)` serves it
like the real model, with noise for outputs. The tokenizer comes from `PDMESH_TEST_TOKENIZER`,
else the ignored folder `.cache/smollm2-tokenizer` that the GPU runbook carries, else the
SmolLM2 alias (the local cache; downloaded once where there is a network).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_ENV = "PDMESH_TEST_TOKENIZER"
CARRIED_TOKENIZER = REPO / ".cache" / "smollm2-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")

SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct): what the CPU tests run with the real weights.
    "smollm2-135m": {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def tokenizer_dir() -> Path:
    """Where SmolLM2's tokenizer files are on this machine (see the module docstring)."""
    if os.environ.get(TOKENIZER_ENV):
        return Path(os.environ[TOKENIZER_ENV])
    if (CARRIED_TOKENIZER / "tokenizer.json").is_file():
        return CARRIED_TOKENIZER
    from pdmesh.engine.model_store import resolve_model

    return resolve_model("smollm2")


ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe",
                 "qwen3_moe", "gemma3_text")
"""The model types the engine runs (engine/worker/models/llama.py): Qwen2 adds q/k/v biases,
Qwen3 per-head q/k norms, Phi-3 stores q/k/v and gate/up fused, the last three have experts
(engine/worker/models/moe.py)."""

_CLASS_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
                "phi3": "Phi3", "gemma3_text": "Gemma3Text",
                "mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}

MOE_SHAPE: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 128,
                             "shared_expert_intermediate_size": 192, "norm_topk_prob": True}
"""What a MoE architecture adds to a shape unless the caller says otherwise: 2 of 8 experts
(Mixtral: of `num_local_experts`; Qwen: `num_experts`), each 128 wide (Mixtral's width is its
`intermediate_size`), Qwen2-MoE's shared expert 192 wide."""


def _moe_defaults(architecture: str) -> dict[str, Any]:
    if architecture == "mixtral":
        return {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 128}
    if architecture == "qwen3_moe":
        return {"num_experts": 8, **{k: v for k, v in MOE_SHAPE.items()
                                     if k != "shared_expert_intermediate_size"}}
    if architecture == "qwen2_moe":
        return {"num_experts": 8, **MOE_SHAPE}
    return {}


def write_random_llama(dest: Path, shape: str = "smollm2-135m", *, seed: int = 0,
                       tokenizer: bool = True, architecture: str = "llama",
                       **overrides: Any) -> Path:
    """A checkpoint of `shape` (with `overrides`) and random weights in `dest`, float32, as
    transformers' `architecture` (one of ARCHITECTURES) writes it."""
    import transformers

    name = _CLASS_NAMES[architecture]
    config = getattr(transformers, f"{name}Config")(
        **{**SHAPES[shape], **_moe_defaults(architecture), **overrides})
    torch.manual_seed(seed)
    model_class = "Gemma3ForCausalLM" if architecture == "gemma3_text" else f"{name}ForCausalLM"
    model = getattr(transformers, model_class)(config).eval()
    if architecture in ("qwen2", "qwen2_moe"):  # transformers zeroes biases: make them count
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, 0.02)
    if architecture.startswith("qwen3"):  # the q/k norms are identities: make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.normal_(1.0, 0.2)
    if architecture == "gemma3_text":  # norms start at 0 (x * (1 + w)): make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.2)
    if architecture in ("mixtral", "qwen2_moe", "qwen3_moe"):  # routers start at zero
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                    param.normal_(0.0, 0.1)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    if tokenizer:
        source = tokenizer_dir()
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy(source / name, dest / name)
        if not (dest / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {source} (set {TOKENIZER_ENV})")
    return dest


FP8_MAX = 448.0  # the largest float8_e4m3fn


def to_fp8(model_dir: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Rewrite `model_dir`'s checkpoint as an FP8 one, as Qwen and DeepSeek publish theirs:
    every layer projection (experts' too) `float8_e4m3fn` with a float32 `weight_scale_inv`
    per `block`, `quantization_config.quant_method: fp8` in config.json. Embeddings, norms,
    routers and the LM head stay as they were (published checkpoints' modules_to_not_convert)."""
    import json

    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    out: dict[str, torch.Tensor] = {}
    for name, weight in state.items():
        if not (name.endswith("_proj.weight") or name.endswith((".w1.weight", ".w2.weight",
                                                                 ".w3.weight"))):
            out[name] = weight
            continue
        rows, cols = weight.shape
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
        padded[:rows, :cols] = weight.float()
        blocks = padded.view(grid[0], block[0], grid[1], block[1])
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
        quantized = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
        out[name] = quantized.to(torch.float8_e4m3fn).contiguous()
        out[name + "_scale_inv"] = scale.contiguous()
    save_file(out, str(path), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": list(block)}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def write_random_gemma3_multimodal(dest: Path, *, seed: int = 0, **text: Any) -> Path:
    """A Gemma3ForConditionalGeneration checkpoint (a small vision tower beside a language
    model of SmolLM2's vocabulary and `text` sizes), random weights with the norms made to
    count, and SmolLM2's tokenizer files: what gemma-3-4b-it and larger look like on disk."""
    import transformers

    text_config = {**{k: v for k, v in SHAPES["smollm2-135m"].items()
                      if k not in ("rope_theta", "tie_word_embeddings")}, **text}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    config = transformers.Gemma3Config(text_config=text_config, vision_config=vision,
                                       mm_tokens_per_image=4)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                param.normal_(0.0, 0.2)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir() / name).is_file():
            shutil.copy(tokenizer_dir() / name, dest / name)
    return dest
