"""FP8 checkpoints (`quantization_config.quant_method: fp8`, as Qwen, DeepSeek, GLM and MiniMax
publish them, and as vLLM and llm-compressor's fp8 method write them), dequantized at load.

Each quantized linear weight is stored as `float8_e4m3fn` beside its scales: one per tensor, or
one per `weight_block_size` block of the weight (`[128, 128]` in the published checkpoints), as
`weight_scale_inv` (block-wise; despite the name, a multiplier) or `weight_scale` (per tensor).
The value is `fp8 * scale`. pdmesh computes in `--dtype`, so the loader multiplies each weight
out as it is read, on its device, and the model never sees FP8: a checkpoint published only
in FP8 serves with its weights at the memory of `--dtype` (twice FP8's), as GGUF files are served
dequantized (engine/model_store.py). Running the FP8 GEMMs themselves is later work.

Activation scales of static schemes (`input_scale`) and FP8 KV-cache scales (`k_scale`,
`v_scale`, `kv_scale`) are dropped: activations and the KV cache stay in `--dtype`. Any other
quantization method (AWQ, GPTQ, compressed-tensors, bitsandbytes, FP4 experts) is refused at
start-up, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
"""A quantized weight's scale tensor: `<module>.weight_scale_inv` or `<module>.weight_scale`."""
DROPPED_SUFFIXES = ("input_scale", "k_scale", "v_scale", "kv_scale")
"""Scales of activations and of an FP8 KV cache: not used where both stay in --dtype."""


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a checkpoint's FP8 weights are scaled: `block` (rows, columns) per scale, or None
    for one scale per tensor."""

    block: tuple[int, int] | None

    @classmethod
    def of(cls, hf: object) -> Fp8Checkpoint | None:
        """The FP8 scheme of the config's `quantization_config`; None for an unquantized model;
        ValueError for a method or variant pdmesh cannot dequantize."""
        config = getattr(hf, "quantization_config", None)
        if config is None:
            return None
        if not isinstance(config, Mapping):
            config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
        method = config.get("quant_method")
        if method != "fp8":
            raise ValueError(f"model: {method!r} quantization is not supported (pdmesh serves "
                             "fp8 checkpoints, dequantized to --dtype at load, and GGUF files)")
        fmt = str(config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3" or config.get("expert_dtype", "fp8") != "fp8":
            raise ValueError("model: only e4m3 FP8 weights are supported "
                             f"(fmt {fmt!r}, experts {config.get('expert_dtype')!r})")
        block = config.get("weight_block_size")
        if block is None:
            return cls(None)
        if (not isinstance(block, list | tuple) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"model: weight_block_size must be two positive integers, "
                             f"got {block!r}")
        return cls((int(block[0]), int(block[1])))


def check_requested(requested: str | None, scheme: Fp8Checkpoint | None) -> None:
    """vLLM's --quantization: ValueError unless it names the checkpoint's own method (pdmesh
    never quantizes an unquantized checkpoint at load)."""
    if requested is None or (requested == "fp8" and scheme is not None):
        return
    found = "fp8" if scheme is not None else "none (an unquantized checkpoint)"
    raise ValueError(f"--quantization {requested}: the checkpoint's quantization is {found}; "
                     "pdmesh serves a checkpoint as it was saved (fp8 dequantized to --dtype) "
                     "and never quantizes one at load")


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def is_dropped(name: str) -> bool:
    return name.endswith(DROPPED_SUFFIXES)


def keeps_stored_dtype(name: str, dtype: torch.dtype) -> bool:
    """Whether a checkpoint tensor must reach its device as stored, not cast to --dtype: an
    FP8 weight (cast first, its scale would be lost) and any scale (a bfloat16 scale would
    round every weight of its block by up to 0.4 %)."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) or is_scale(name) \
        or is_dropped(name)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """`weight` (FP8, `[rows, cols]`) times its scale(s), in `dtype`, on the weight's device:
    with `block`, scale `[i, j]` multiplies rows `i*block[0]:` and columns `j*block[1]:`
    (the last block of each may be partial); otherwise a single scale."""
    values = weight.to(torch.float32)
    scale = scale.to(device=values.device, dtype=torch.float32)
    if block is None or scale.numel() == 1:
        if scale.numel() != 1:
            raise ValueError(f"model: a per-tensor FP8 weight has {scale.numel()} scales")
        return (values * scale.reshape(())).to(dtype)
    rows, cols = values.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if values.dim() != 2 or tuple(scale.shape) != grid:
        raise ValueError(f"model: FP8 weight {tuple(values.shape)} needs a {grid} grid of "
                         f"scales for blocks {block}, got {tuple(scale.shape)}")
    expanded = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (values * expanded).to(dtype)


def dequantized_state(state: dict[str, Any], scheme: Fp8Checkpoint,
                      dtype: torch.dtype) -> dict[str, Any]:
    """`state` with every FP8 weight multiplied out into `dtype` and the scales gone. `state`
    is emptied as it goes, so on a GPU each FP8 weight is freed as its `dtype` copy is made:
    the peak is the dequantized model plus one weight's float32 temporaries, not both models."""
    out: dict[str, Any] = {}
    for name in [n for n in state if not (is_scale(n) or is_dropped(n))]:
        tensor = state.pop(name)
        scale = next((state[n] for n in scale_names(name) if n in state), None)
        if scale is not None:
            out[name] = dequantize(tensor, scale, scheme.block, dtype)
        elif tensor.dtype == torch.float8_e4m3fn:
            raise ValueError(f"model: FP8 tensor {name} has no weight_scale_inv/weight_scale")
        else:
            out[name] = tensor
    state.clear()
    return out


def scale_names(name: str) -> tuple[str, ...]:
    """Where weight `name`'s scale may be stored (`q_proj.weight` -> `q_proj.weight_scale_inv`,
    `q_proj.weight_scale`); none for a tensor that is not a weight."""
    if not name.endswith(".weight"):
        return ()
    stem = name.removesuffix("weight")
    return tuple(stem + suffix for suffix in SCALE_SUFFIXES)
