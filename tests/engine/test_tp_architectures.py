"""Tensor parallelism for every architecture the engine runs (Llama, Mistral, Qwen2 with its
q/k/v biases): two ranks on CPU (gloo) give the prompt logprobs transformers gives on the same
random weights. A small shape with 4 KV heads over 2 ranks, float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdmesh import LLM, SamplingParams
from tests.random_llama import ARCHITECTURES, write_random_llama

pytestmark = [pytest.mark.slow, pytest.mark.processes]

SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
         "tie_word_embeddings": False}
PROMPT_IDS = [1, 504, 3458, 282, 4649, 314, 1345, 30, 378, 2389, 282, 260, 4198, 7181, 29]


def transformers_logprobs(model_dir: Path) -> torch.Tensor:
    """log p(token i | tokens < i) of the prompt under transformers, i >= 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, dim=-1)
    return picked.gather(1, torch.tensor(PROMPT_IDS[1:]).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_two_ranks_compute_what_transformers_computes(tmp_path: Path,
                                                      architecture: str) -> None:
    model_dir = write_random_llama(tmp_path / architecture, architecture=architecture,
                                   **SMALL)
    expected = transformers_logprobs(model_dir)
    llm = LLM(str(model_dir), tensor_parallel_size=2, cpu_threads=2, dtype="float32",
              kv_cache_memory="32MiB", max_model_len=256)
    torch.testing.assert_close(engine_logprobs(llm), expected, atol=2e-3, rtol=1e-3)


def engine_logprobs(llm: LLM) -> torch.Tensor:
    """The same prompt logprobs from the engine; its core is closed after."""
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT_IDS}],
                           SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    finally:
        llm.engine.core.close()
    return torch.tensor([out.prompt_logprobs[i][PROMPT_IDS[i]].logprob
                         for i in range(1, len(PROMPT_IDS))])
