"""pdmesh's engine in bfloat16 on CPU against transformers in bfloat16 on the same SmolLM2
weights: the native bfloat16 kernels (layer ops rounded where the reference rounds, paged
decode attention computed in float32 and rounded once) keep greedy output token for token,
and the prompt's log-probabilities within bfloat16's reach.

bfloat16 carries 8 bits of mantissa, so the two engines may part where two tokens' logits
come within a rounding step of each other; these prompts and lengths do not come near that.
"""

from __future__ import annotations

import pytest
import torch

from pdmesh import LLM, SamplingParams
from tests.engine.test_parity_hf import hf_greedy, prompt_logprobs_pair

pytestmark = [pytest.mark.slow, pytest.mark.weights]

MAX_NEW = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
]


@pytest.fixture(scope="module")
def hf_bf16(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def llm_bf16():
    return LLM("smollm2", dtype="bfloat16", kv_cache_memory="256MiB")


def test_greedy_matches_transformers_in_bfloat16(llm_bf16, hf_bf16, hf_tokenizer) -> None:
    outputs = llm_bf16.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                        ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected = hf_greedy(hf_bf16, hf_tokenizer(prompt)["input_ids"], MAX_NEW)
        assert list(out.outputs[0].token_ids) == expected, prompt


def test_prompt_logprobs_match_transformers_in_bfloat16(llm_bf16, hf_bf16,
                                                        hf_tokenizer) -> None:
    out = llm_bf16.generate(PROMPTS[2], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ours, theirs = prompt_logprobs_pair(out, hf_bf16)
    torch.testing.assert_close(ours, theirs, atol=0.1, rtol=0.05)
