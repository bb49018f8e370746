"""The near-tie oracle (tests/near_tie.py) models the sampler exactly: on real weights, every
token a seeded or greedy request picks outscores each of its top-20 alternatives under the
oracle's scores. End-to-end tests trust the oracle to accept only genuine near-ties; were its
reconstruction of the random draw or of the penalties wrong, a pick would lose here."""

from __future__ import annotations

import pytest

from pdmesh import LLM, SamplingParams
from tests.near_tie import Pick, score_margin

pytestmark = [pytest.mark.slow, pytest.mark.weights]

PROMPT = "The quick brown fox jumps over the lazy dog. This sentence is famous because"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2", kv_cache_memory="64MiB", max_model_len=512)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=20),
    SamplingParams(temperature=0.8, seed=11, frequency_penalty=0.3, presence_penalty=0.2,
                   max_tokens=24, ignore_eos=True, logprobs=20),
    SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=16, ignore_eos=True, logprobs=20),
], ids=["greedy", "seeded-penalties", "seeded-n2"])
def test_every_pick_outscores_its_alternatives(llm: LLM, params: SamplingParams) -> None:
    vocab_size = llm.engine.core.model_config.vocab_size
    outputs = llm.generate(PROMPT, params)[0].outputs
    assert len(outputs) == params.n
    seen_runner_up = 0
    for out in outputs:
        assert out.logprobs is not None
        for position, (token, candidates) in enumerate(
                zip(out.token_ids, out.logprobs, strict=True)):
            pick = Pick(token, candidates[token].logprob)
            for other_id, other in candidates.items():
                if other_id == token:
                    continue
                margin = score_margin(params, out.index, list(out.token_ids[:position]), pick,
                                      Pick(other_id, other.logprob), vocab_size)
                assert margin >= -1e-4, (out.index, position, token, other_id, margin)
                seen_runner_up += 1
    assert seen_runner_up >= 15 * params.n
