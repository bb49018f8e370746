"""FP8 checkpoints (block-wise `weight_scale_inv`, as Qwen and DeepSeek publish them) on random
weights: the engine's prompt logprobs are transformers' on the same FP8 checkpoint (which
transformers dequantizes where no GPU is), for a dense model, a MoE model whose every expert
is FP8, and two tensor-parallel ranks that each dequantize whole weights and keep their
slices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdmesh import LLM
from tests.engine.test_tp_architectures import SMALL, engine_logprobs, transformers_logprobs
from tests.random_llama import to_fp8, write_random_llama

pytestmark = [pytest.mark.slow]


def fp8_model(dest: Path, architecture: str) -> tuple[Path, torch.Tensor]:
    """An FP8 checkpoint and transformers' logprobs on it, checked to differ from the
    unquantized model's (so a loader that ignored the scales could not pass)."""
    model_dir = write_random_llama(dest, architecture=architecture, **SMALL)
    unquantized = transformers_logprobs(model_dir)
    expected = transformers_logprobs(to_fp8(model_dir))
    assert (expected - unquantized).abs().max() > 1e-3
    return model_dir, expected


@pytest.mark.parametrize("architecture", ["llama", "qwen3_moe"])
def test_fp8_weights_compute_what_transformers_computes(tmp_path: Path,
                                                        architecture: str) -> None:
    model_dir, expected = fp8_model(tmp_path / architecture, architecture)
    # vLLM's --quantization naming the checkpoint's method is taken.
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB", quantization="fp8")
    torch.testing.assert_close(engine_logprobs(llm), expected, atol=2e-3, rtol=1e-3)


@pytest.mark.processes
def test_two_ranks_slice_dequantized_fp8_weights(tmp_path: Path) -> None:
    model_dir, expected = fp8_model(tmp_path / "mixtral", "mixtral")
    llm = LLM(str(model_dir), tensor_parallel_size=2, cpu_threads=2, dtype="float32",
              kv_cache_memory="32MiB", max_model_len=256)
    torch.testing.assert_close(engine_logprobs(llm), expected, atol=2e-3, rtol=1e-3)
