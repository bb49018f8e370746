"""The NCCL path of tensor parallelism: two ranks on two CUDA devices compute what one rank
computes. Runs only where two CUDA devices are (a random-weight SmolLM2-shaped checkpoint,
tests/random_llama.py: no weights travel to a lent GPU machine); float32, so the two layouts
agree to float32 summation order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdmesh import LLM, SamplingParams
from tests.random_llama import write_random_llama

pytestmark = [
    pytest.mark.slow, pytest.mark.processes,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def prompt_logprobs(llm: LLM) -> list[torch.Tensor]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0,
                                                prompt_logprobs=0))
    result = []
    for out in outs:
        ids = out.prompt_token_ids
        result.append(torch.tensor([out.prompt_logprobs[i][ids[i]].logprob
                                    for i in range(1, len(ids))]))
        assert len(out.outputs[0].token_ids) == 4
    return result


def test_two_ranks_on_two_gpus_compute_what_one_computes(tmp_path: Path) -> None:
    model = str(write_random_llama(tmp_path / "model"))
    kwargs = {"device": "cuda:0", "dtype": "float32", "kv_cache_memory": "512MiB",
              "max_model_len": 512}
    one = LLM(model, **kwargs)
    try:
        expected = prompt_logprobs(one)
    finally:
        one.engine.core.close()
    two = LLM(model, tensor_parallel_size=2, **kwargs)
    try:
        ranks = two.engine.core.ranks
        assert ranks is not None and ranks.tp.world_size == 2
        got = prompt_logprobs(two)
    finally:
        two.engine.core.close()
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-3)
