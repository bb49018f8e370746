"""The checkpoint is read through a mapping of its file, and a plain config.json without
transformers, yet the model gets exactly the weights and the config it got before.

The embedding and the norms stay views of the file (page cache: shared between engine cores,
resident only where read); the fused projections are the checkpoint's parts concatenated; after
`drop_file_pages` every value is still the file's (bench/README.md, "RSS").
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from pdmesh.engine.worker.hf_config import _plain_config, load_hf_config
from pdmesh.engine.worker.model_loader import drop_file_pages, load_model, release_free_heap
from pdmesh.engine.worker.models.architecture import ModelConfig, rope_inv_freq
from pdmesh.engine.worker.models.llama import pack_linears
from pdmesh.engine.worker.models.packed_linear import can_pack_linears
from tests.unit.test_dummy_load import write_config

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")


def write_checkpoint(path: Path, tied: bool) -> Path:
    """A tiny Llama checkpoint in transformers' tensor names, random float32 weights."""
    write_config(path, tie_word_embeddings=tied)
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (256, 32), "model.norm.weight": (32,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (32,), p + "post_attention_layernorm.weight": (32,),
            p + "self_attn.q_proj.weight": (32, 32), p + "self_attn.k_proj.weight": (16, 32),
            p + "self_attn.v_proj.weight": (16, 32), p + "self_attn.o_proj.weight": (32, 32),
            p + "mlp.gate_proj.weight": (64, 32), p + "mlp.up_proj.weight": (64, 32),
            p + "mlp.down_proj.weight": (32, 64),
        })
    if not tied:
        shapes["lm_head.weight"] = (256, 32)
    save_file({k: torch.randn(s, generator=gen) for k, s in shapes.items()},
              str(path / "model.safetensors"))
    return path


def _address(buffer: object) -> tuple[int, int]:
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))  # type: ignore[arg-type]
    return start, start + len(buffer)  # type: ignore[arg-type]


@pytest.mark.parametrize("tied", [True, False])
def test_weights_are_the_checkpoints_and_the_embedding_stays_in_the_file(
        tmp_path: Path, tied: bool) -> None:
    model_dir = write_checkpoint(tmp_path / "m", tied)
    model, _, _ = load_model(model_dir, torch.float32, CPU, 128)
    ref = load_file(str(model_dir / "model.safetensors"))
    start, end = _address(model.checkpoint_maps[0])
    assert start <= model.embed_tokens.weight.data_ptr() < end  # a view, not a copy
    if can_pack_linears(CPU, torch.float32):
        pack_linears(model)
    drop_file_pages(model)
    release_free_heap()
    assert torch.equal(model.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert torch.equal(model.norm.weight, ref["model.norm.weight"])
    assert torch.equal(model.layers[1].input_layernorm.weight,
                       ref["model.layers.1.input_layernorm.weight"])


def test_fused_projections_concatenate_the_parts(tmp_path: Path) -> None:
    model_dir = write_checkpoint(tmp_path / "m", tied=False)
    model, _, _ = load_model(model_dir, torch.float32, CPU, 128)
    ref = load_file(str(model_dir / "model.safetensors"))
    p = "model.layers.0."
    qkv = torch.cat([ref[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, qkv)
    gate_up = torch.cat([ref[p + "mlp.gate_proj.weight"], ref[p + "mlp.up_proj.weight"]])
    assert torch.equal(model.layers[0].mlp.gate_up_proj.weight, gate_up)
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])


def test_another_dtype_copies_and_keeps_values(tmp_path: Path) -> None:
    model_dir = write_checkpoint(tmp_path / "m", tied=True)
    model, _, _ = load_model(model_dir, torch.bfloat16, CPU, 128)
    ref = load_file(str(model_dir / "model.safetensors"))
    assert torch.equal(model.embed_tokens.weight, ref["model.embed_tokens.weight"].bfloat16())


@pytest.mark.parametrize("overrides", [
    {},
    {"rope_theta": 500000.0, "head_dim": 8},
    {"tie_word_embeddings": True, "num_key_value_heads": None},
    {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
    {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 8},
    {"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
    {"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
])
def test_a_plain_config_reads_as_transformers_reads_it(tmp_path: Path, overrides: dict) -> None:
    model_dir = write_config(tmp_path / "m", **overrides)
    plain = load_hf_config(model_dir)
    assert isinstance(plain, SimpleNamespace), "read without transformers"
    hf = AutoConfig.from_pretrained(model_dir)
    assert ModelConfig.from_hf(plain) == ModelConfig.from_hf(hf)
    ours, theirs = rope_inv_freq(plain, 8), rope_inv_freq(hf, 8)
    assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1]
    assert plain.max_position_embeddings == hf.max_position_embeddings


@pytest.mark.parametrize("overrides", [
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_theta": None},
    {"rms_norm_eps": None},
    {"model_type": "gemma"},
    {"model_type": "qwen3"},  # no head_dim: Qwen3's default is 128, not hidden / heads
])
def test_what_transformers_must_interpret_goes_to_transformers(
        tmp_path: Path, overrides: dict) -> None:
    model_dir = write_config(tmp_path / "m", **overrides)
    config = json.loads((model_dir / "config.json").read_text())
    config = {k: v for k, v in config.items() if v is not None}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert _plain_config(config) is None
