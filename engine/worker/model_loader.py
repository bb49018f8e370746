"""Build our Llama-family model from a Hugging Face checkpoint directory.

The checkpoint is read through a private, read-only-in-practice mapping of each safetensors
file: the tensors the model keeps as they are (the embedding, the norms) stay views of the
file, so their pages are the page cache's, shared by every engine core on the host and resident
only where touched (a token's embedding row), and the projections that the CPU GEMMs repack
(engine/worker/models/llama.py, `pack_linears`) are never copied before packing. `drop_file_pages`
then returns the pages that loading and packing touched, and `release_free_heap` the heap that
the load's temporaries (the fused q/k/v and gate/up copies) left free. An idle SmolLM2 engine
core went from 1,140 to 802 MiB of RSS (bench/README.md, "RSS").

On another device (CUDA) each tensor goes to the device, in the model's dtype, as it is read,
and the fused projections are concatenated there: the host never holds more than the pages of
the tensor being copied, where a host copy of the checkpoint (15 GiB for an 8B model in bf16)
would outgrow a GPU pod's memory limit.

With tensor parallelism (`tp`, more than one rank) each rank reads only its slices of each
tensor (safetensors' `get_slice`; which slice: engine/worker/parallel/sharding.py), straight to
its device in the model's dtype: no rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import struct
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdmesh.engine.worker.checkpoint_names import FUSED, fused_name, our_name, split_fused
from pdmesh.engine.worker.fp8_checkpoint import (
    Fp8Checkpoint,
    check_requested,
    dequantize,
    dequantized_state,
    is_dropped,
    is_scale,
    keeps_stored_dtype,
    scale_names,
)
from pdmesh.engine.worker.hf_config import load_hf_config
from pdmesh.engine.worker.models.architecture import ModelConfig, rope_inv_freq
from pdmesh.engine.worker.models.llama import LlamaForCausalLM, RotaryEmbedding
from pdmesh.engine.worker.parallel.group import SINGLE, TensorParallel
from pdmesh.engine.worker.parallel.sharding import ModelShard

logger = logging.getLogger(__name__)

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu,
}


def read_safetensors(
    model_dir: Path, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], list[mmap.mmap]]:
    """Every tensor of the checkpoint, and the mappings the tensors view.

    On the CPU (`device` None or cpu) each tensor is a view of a private mapping of its file
    (never written: copy-on-write only so torch may view it). On another device each tensor is
    copied there (`to_device`) as it is read, one at a time; no mapping is kept, and each
    file's pages leave this process's RSS once its tensors are on the device."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors in {model_dir}")
    target = None if device is None or device.type == "cpu" else device
    tensors: dict[str, torch.Tensor] = {}
    maps: list[mmap.mmap] = []
    for f in files:
        mapped = _map_safetensors(f)
        if mapped is None:  # a dtype or layout we do not view: copies, as safetensors makes
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                    if our_name(name) is None:
                        continue  # a vision tower's: never read
                    tensor = fh.get_tensor(name)
                    tensors[name] = (tensor.clone() if target is None
                                     else to_device(tensor, target, _cast_to(name, tensor, dtype)))
            continue
        views, buffer = mapped
        if target is None:
            tensors.update(views)
            maps.append(buffer)
            continue
        for name in list(views):
            tensor = views.pop(name)
            if our_name(name) is not None:  # a vision tower's tensors never reach the device
                tensors[name] = to_device(tensor, target, _cast_to(name, tensor, dtype))
        with contextlib.suppress(OSError, ValueError, AttributeError):
            buffer.madvise(mmap.MADV_DONTNEED)
    return tensors, maps


def _cast_to(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype a checkpoint tensor is read in: `dtype`, but FP8 weights and their scales as
    stored (engine/worker/fp8_checkpoint.py multiplies them out)."""
    return None if keeps_stored_dtype(name, tensor.dtype) else dtype


def to_device(
    tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None
) -> torch.Tensor:
    """One checkpoint tensor on `device` in `dtype`: copied as it is stored, converted there
    (a conversion on the host would allocate the converted copy on the host)."""
    placed = tensor.to(device)
    return placed if dtype is None else placed.to(dtype)


def _map_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], mmap.mmap] | None:
    """The file's tensors as views of one private mapping; None where one cannot be a view
    (a dtype not in `_DTYPES`, a misaligned offset, a big-endian host)."""
    if sys.byteorder != "little":
        return None
    with open(path, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(header_len))
        size = fh.seek(0, 2)
        if size == 0:
            return None
        buffer = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
    start = 8 + header_len
    views: dict[str, torch.Tensor] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(meta["dtype"])
        begin, end = meta["data_offsets"]
        if dtype is None or (start + begin) % dtype.itemsize or start + end > size:
            return None
        shape = tuple(meta["shape"])
        count = (end - begin) // dtype.itemsize
        if count == 0:
            views[name] = torch.empty(shape, dtype=dtype)
            continue
        views[name] = torch.frombuffer(buffer, dtype=dtype, count=count,
                                       offset=start + begin).view(shape)
    return views, buffer


def drop_file_pages(model: torch.nn.Module) -> None:
    """Take the checkpoint pages that loading (and packing) read out of this process's RSS:
    they stay in the page cache, and a view still in use faults its pages back on access."""
    for buffer in getattr(model, "checkpoint_maps", ()):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            buffer.madvise(mmap.MADV_DONTNEED)


def release_free_heap() -> bool:
    """Give the heap's free pages back to the system (glibc's malloc_trim): the load's
    temporaries are freed by then, but a CPU engine keeps up to 256 MiB of free heap
    (engine/core/host_allocator.py) and the holes between the packed weights besides."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


LOAD_FORMATS = ("auto", "dummy")


@contextmanager
def meta_without_init() -> Iterator[None]:
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
    tp: TensorParallel = SINGLE,
    hf_overrides: Mapping[str, Any] | None = None,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig, object]:
    """Our model of the config in `model_dir`, on `device` in `dtype`: with `tp`, this rank's
    shard of it.

    `load_format` is vLLM's: "auto" reads the checkpoint's safetensors, "dummy" initialises
    random weights from `seed` (benchmarks of shapes nobody downloaded; the outputs are noise).
    `hf_overrides` (`--hf-overrides`) are merged over config.json first. An FP8 checkpoint's
    weights are multiplied out into `dtype` as they are read (engine/worker/fp8_checkpoint.py);
    `quantization` (`--quantization`) must name the checkpoint's method.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    hf = load_hf_config(model_dir, hf_overrides)
    cfg = ModelConfig.from_hf(hf)
    fp8 = Fp8Checkpoint.of(hf)
    check_requested(quantization, fp8)
    rope = RotaryEmbedding(*rope_inv_freq(hf, cfg.head_dim), max_positions)
    shard = ModelShard.of(cfg, tp.rank, tp.world_size)
    with meta_without_init():
        model = LlamaForCausalLM(cfg, None, shard, tp)
    model.rope = rope
    if any(cfg.local_rope_layers):
        model.local_rope = RotaryEmbedding(
            *rope_inv_freq(hf, cfg.head_dim, "sliding_attention"), max_positions)
    if load_format == "dummy":
        state = dummy_state(model, dtype, device, seed)
    elif not shard.is_whole:
        state = sharded_state(model_dir, model, cfg, shard, device, dtype, fp8)
        model.checkpoint_maps = []  # every tensor read is this rank's own copy
    else:
        state, maps = checkpoint_state(model_dir, model, cfg, device, dtype, fp8)
        state = {k: v.to(dtype) for k, v in state.items()}  # no-op off the CPU: converted
        # Kept while a parameter may still view them (a CPU model in the checkpoint's dtype).
        model.checkpoint_maps = maps
    model.load_state_dict(state, strict=False, assign=True)
    del state
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype).eval()
    if device.type != "cpu":
        model.checkpoint_maps = []  # every parameter was copied to the device
    drop_file_pages(model)
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
    model_dir: Path,
    model: LlamaForCausalLM,
    cfg: ModelConfig,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    fp8: Fp8Checkpoint | None = None,
) -> tuple[dict[str, torch.Tensor], list[mmap.mmap]]:
    """The checkpoint's tensors renamed and fused into our parameter names, checked complete,
    and the mappings. On the CPU they are views of the file's mapping but for the fused ones;
    on another device they are there already, in `dtype`, fused there (`read_safetensors`).
    `fp8`: the checkpoint's FP8 scheme, its weights multiplied out into `dtype` (float32
    where None)."""
    raw, maps = read_safetensors(model_dir, device, dtype)
    named = ((our_name(name), tensor) for name, tensor in raw.items()
             if not name.endswith("rotary_emb.inv_freq"))
    state = {key: part for ours, tensor in named if ours is not None
             for key, part in split_fused(ours, tensor, cfg)}
    del raw  # `state` holds the only references: dequantizing frees each FP8 weight
    if fp8 is not None:
        state = dequantized_state(state, fp8, dtype or torch.float32)
    return _fused_checked(state, model, cfg, model_dir), maps


def sharded_state(
    model_dir: Path,
    model: LlamaForCausalLM,
    cfg: ModelConfig,
    shard: ModelShard,
    device: torch.device,
    dtype: torch.dtype,
    fp8: Fp8Checkpoint | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's slices of the checkpoint under our parameter names, on `device` in
    `dtype`, fused and checked complete. safetensors reads just the slice's bytes of a
    row slice (a column slice reads the rows' spans). An FP8 weight is read whole with its
    scales, multiplied out on the device, then sliced (its blocks need not align with the
    slice)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors in {model_dir}")
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        where = {name: fh for fh in handles for name in fh.keys()}  # noqa: SIM118
        state: dict[str, torch.Tensor] = {}
        for name, fh in where.items():
            if name.endswith("rotary_emb.inv_freq") or is_scale(name) or is_dropped(name):
                continue
            key = our_name(name)
            if key is None:
                continue
            if cfg.tie_word_embeddings and key == "lm_head.weight":
                continue
            scale = next((n for n in scale_names(name) if n in where), None)
            quantized = fp8 is not None and scale is not None
            if not quantized and fused_name(key) is None:
                state[key] = to_device(_read_slice(fh, name, key, shard), device, dtype)
                continue
            # Read whole: an FP8 weight's blocks, or a checkpoint-fused tensor's parts, need
            # not align with this rank's slice.
            if quantized:
                assert fp8 is not None and scale is not None
                whole = dequantize(fh.get_tensor(name).to(device),
                                   where[scale].get_tensor(scale), fp8.block, dtype)
            else:
                whole = to_device(fh.get_tensor(name), device, dtype)
            for part, tensor in split_fused(key, whole, cfg):
                state[part] = _slice(tensor, part, shard)
    return _fused_checked(state, model, cfg, model_dir)


def _slice(tensor: torch.Tensor, key: str, shard: ModelShard) -> torch.Tensor:
    """`_read_slice` of a tensor already read whole."""
    where = shard.checkpoint_slice(key)
    if where is None:
        return tensor if shard.keeps_whole_bias(key) else torch.zeros_like(tensor)
    dim, span = where
    return tensor.narrow(dim, span.start, span.size).contiguous()


def _read_slice(fh: object, name: str, key: str, shard: ModelShard) -> torch.Tensor:
    """Checkpoint tensor `name` (ours: `key`) as this rank holds it."""
    view = fh.get_slice(name)  # type: ignore[attr-defined]
    where = shard.checkpoint_slice(key)
    if where is None:
        return _slice(view[:], key, shard)
    dim, span = where
    if dim == 0:
        return view[span.start:span.stop]
    return view[:, span.start:span.stop]


def _fused_checked(state: dict[str, torch.Tensor], model: LlamaForCausalLM, cfg: ModelConfig,
                   model_dir: Path) -> dict[str, torch.Tensor]:
    """`state` (our names, q/k/v and gate/up apart, experts apart) with the fused projections
    concatenated and the experts stacked, checked to be exactly the model's parameters."""
    for i in range(cfg.num_layers):
        prefix = f"layers.{i}."
        for fused, parts in FUSED.items():
            names = [prefix + p for p in parts]
            if all(n in state for n in names):
                state[prefix + fused] = torch.cat([state.pop(n) for n in names], dim=0)
        if cfg.moe is not None and cfg.moe.is_sparse(i):
            _stack_experts(state, prefix + "mlp.experts.", cfg.moe.num_experts)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if cfg.norm_offset:  # Gemma stores a norm's weight as w in x * (1 + w)
        for name in [n for n in state if n.endswith("norm.weight")]:
            state[name] = state[name] + cfg.norm_offset
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


def _stack_experts(state: dict[str, torch.Tensor], prefix: str, num_experts: int) -> None:
    """One layer's per-expert tensors (`<prefix><e>.gate_proj.weight`, ...) replaced by the
    stacked `<prefix>gate_up_proj` `[E, 2I, H]` and `<prefix>down_proj` `[E, H, I]`; left as
    they are when an expert is missing (the completeness check then names them)."""
    parts = ("gate_proj", "up_proj", "down_proj")
    names = [[f"{prefix}{e}.{part}.weight" for part in parts] for e in range(num_experts)]
    if not all(name in state for expert in names for name in expert):
        return
    gate_up = [torch.cat([state.pop(gate), state.pop(up)], dim=0) for gate, up, _ in names]
    state[prefix + "gate_up_proj"] = torch.stack(gate_up)
    state[prefix + "down_proj"] = torch.stack([state.pop(down) for _, _, down in names])


