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
        ids = torch.tensor([hf_tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            expected = hf_bf16.generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=MAX_NEW, do_sample=False)
        assert list(out.outputs[0].token_ids) == expected[0, ids.shape[1]:].tolist(), prompt


def test_prompt_logprobs_match_transformers_in_bfloat16(llm_bf16, hf_bf16,
                                                        hf_tokenizer) -> None:
    out = llm_bf16.generate(PROMPTS[2], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_bf16(torch.tensor([ids])).logits[0].float(), dim=-1)
    ours = torch.tensor([out.prompt_logprobs[i + 1][ids[i + 1]].logprob
                         for i in range(len(ids) - 1)])
    theirs = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(ours, theirs, atol=0.1, rtol=0.05)
