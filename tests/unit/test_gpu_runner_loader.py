"""Loading a checkpoint onto an accelerator holds about one tensor on the host, not the model.

Every tensor goes to the device as it is read, converted to the model's dtype there, and the
fused projections are concatenated there (issue 24, item 6: the host used to hold the fused
copies and, for another dtype, a converted copy of every weight: 15 GiB for an 8B model, over
a GPU pod's memory limit). Host allocations are measured with torch's profiler, which sees
every tensor torch allocates on the CPU; the `meta` device stands in for CUDA on a machine
without one (it takes the same path: any device but the CPU), and a CUDA test checks the
values where a GPU is present. CPU loads stay views of the file
(tests/unit/test_checkpoint_mapping.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.profiler import ProfilerActivity, profile

from pdmesh.engine.worker.model_loader import load_model
from tests.unit.test_dummy_load import write_config

pytestmark = pytest.mark.fast

SHAPE = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "max_position_embeddings": 256}
"""A Llama in miniature: Llama-3's head ratio (4 query heads per KV head), MLP 4x wide."""


def write_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A random float32 checkpoint of `SHAPE` in transformers' names, in two files."""
    write_config(path, **SHAPE)
    h, inter, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], 2 * 32
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (SHAPE["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (SHAPE["vocab_size"], h)}
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    tensors = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    names = sorted(tensors)
    for n, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        save_file({k: tensors[k] for k in part}, str(path / f"model-0000{n + 1}.safetensors"))
    return tensors


def host_peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes torch held on the CPU at once during `fn`, beyond what it held before."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage  # allocations at their op, frees as [memory]
        peak = max(peak, held)
    return peak


def test_a_device_load_holds_less_than_one_tensor_on_the_host(tmp_path: Path) -> None:
    tensors = write_checkpoint(tmp_path / "m")
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    loaded: list[torch.nn.Module] = []

    def load(device: str) -> None:
        model, _, _ = load_model(tmp_path / "m", torch.bfloat16, torch.device(device), 256)
        loaded.append(model)

    # The measure sees a loader's host copies: onto the CPU in another dtype, every weight
    # is converted on the host.
    assert host_peak_bytes(lambda: load("cpu")) >= total // 2
    assert host_peak_bytes(lambda: load("meta")) < largest
    model = loaded[-1]
    params = dict(model.named_parameters())
    assert params["layers.3.self_attn.qkv_proj.weight"].shape == (256 + 2 * 64, 256)
    assert params["layers.0.mlp.gate_up_proj.weight"].shape == (2 * 1024, 256)
    for name, p in params.items():
        assert p.is_meta and p.dtype == torch.bfloat16, name
    assert model.checkpoint_maps == []  # nothing of the files is kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_load_has_the_checkpoints_values_and_one_copy_on_the_device(
        tmp_path: Path) -> None:
    tensors = write_checkpoint(tmp_path / "m")
    total_bf16 = sum(t.numel() * 2 for t in tensors.values())
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    cuda = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model, _, _ = load_model(tmp_path / "m", torch.bfloat16, cuda, 256)
    torch.cuda.synchronize()
    # The weights, plus transients: one tensor as stored (float32) before its conversion, or
    # one fused projection before its parts are freed.
    assert torch.cuda.max_memory_allocated() - base <= total_bf16 + largest + 2**20
    ref = {k: v.bfloat16() for k, v in load_file(str(tmp_path / "m/model-00001.safetensors"),
                                                 device="cpu").items()}
    ref |= {k: v.bfloat16() for k, v in load_file(str(tmp_path / "m/model-00002.safetensors"),
                                                  device="cpu").items()}
    p = "model.layers.2."
    qkv = torch.cat([ref[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(model.layers[2].self_attn.qkv_proj.weight.cpu(), qkv)
    gate_up = torch.cat([ref[p + "mlp.gate_proj.weight"], ref[p + "mlp.up_proj.weight"]])
    assert torch.equal(model.layers[2].mlp.gate_up_proj.weight.cpu(), gate_up)
    assert torch.equal(model.embed_tokens.weight.cpu(), ref["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight.cpu(), ref["lm_head.weight"])
    assert all(q.device.type == "cuda" for q in model.parameters())
