"""Sliding-window attention served whole (random weights): a Mistral whose every layer slides,
a Qwen2 whose upper layers slide (max_window_layers), and a Gemma 3 whose sliding and full
layers alternate, each kind on its own RoPE (and with Gemma's sandwich norms, 1 + w norm
weights, scaled embeddings, query_pre_attn_scalar and soft-capped logits), with windows far
shorter than the prompt. The engine's prompt logprobs (prompt chunks after cached prefixes,
so the window crosses the cache) and its greedy tokens past the window (decode) are
transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdmesh import LLM, SamplingParams
from tests.engine.test_tp_architectures import SMALL
from tests.random_llama import write_random_llama

pytestmark = [pytest.mark.slow]

PROMPT = torch.randint(3, 49152, (70,), generator=torch.Generator().manual_seed(5)).tolist()
CASES = {
    "mistral": {"sliding_window": 21},
    "qwen2": {"sliding_window": 21, "use_sliding_window": True, "max_window_layers": 2},
    "gemma3_text": {
        "sliding_window": 21, "final_logit_softcapping": 30.0,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}},
}


@pytest.mark.parametrize("architecture", sorted(CASES))
def test_a_sliding_window_computes_what_transformers_computes(tmp_path: Path,
                                                              architecture: str) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = write_random_llama(tmp_path / architecture, architecture=architecture,
                                   **SMALL, **CASES[architecture])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, :-1].float()
        greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24,
                             do_sample=False)[0, len(PROMPT):].tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    # 16-token chunks: each after a cached prefix the window reaches into.
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB",
              max_num_batched_tokens=16, max_num_seqs=4, long_prefill_token_threshold=16)
    try:
        scored = llm.generate([{"prompt_token_ids": PROMPT}],
                              SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        generated = llm.generate([{"prompt_token_ids": PROMPT}],
                                 SamplingParams(max_tokens=24, temperature=0.0,
                                                ignore_eos=True))[0]
    finally:
        llm.engine.core.close()
    got = torch.tensor([scored.prompt_logprobs[i][PROMPT[i]].logprob
                        for i in range(1, len(PROMPT))])
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    assert list(generated.outputs[0].token_ids) == greedy
