"""Resuming a broken decode on another engine (decode migration), on real weights.

A request whose decode instance died after k tokens is resumed elsewhere with those k tokens as
*output* (`EngineRequest.given_tokens`): the continuation must equal an uninterrupted run's,
token for token and character for character — greedy and seeded, with penalties, min_tokens,
logprobs, stop strings spanning the resume point, and n > 1 sequences resumed each from its own
point with its own child seed (a sequence that had already finished replays to the same finish
and is not continued).
"""

from __future__ import annotations

import itertools

import pytest

from pdmesh import LLM, SamplingParams
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.frontend.llm_engine import LLMEngine
from pdmesh.engine.outputs import CompletionOutput
from tests.engine_steps import run_to_finish as run

pytestmark = [pytest.mark.slow, pytest.mark.weights]

PROMPT = "Explain in one sentence why the sky is blue."
_ids = itertools.count()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2", kv_cache_memory="128MiB", max_model_len=1024)


@pytest.fixture(scope="module")
def other() -> LLMEngine:
    """A second engine: the instance the request migrates to (its own global generator)."""
    return LLM("smollm2", kv_cache_memory="64MiB", max_model_len=1024, seed=99).engine




def resume(
    engine: LLMEngine, prompt: str, ref: list[CompletionOutput], cut: dict[int, int],
    params: SamplingParams,
) -> dict[int, CompletionOutput]:
    """Resume every sequence on `engine`: those in `cut` (index -> tokens already produced)
    mid-way, the others with their complete (finished) output."""
    _, prompt_ids = engine.tokenize(prompt)
    given = [list(c.token_ids[:cut.get(c.index, len(c.token_ids))]) for c in ref]
    engine.add(EngineRequest(f"resume-{next(_ids)}", prompt_ids, params, given_tokens=given))
    return {c.index: c for c in run(engine).outputs}


def assert_same(got: CompletionOutput, want: CompletionOutput, k: int) -> None:
    assert got.token_ids == want.token_ids
    assert got.text == want.text
    assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
    if want.logprobs is not None:
        assert got.logprobs is not None
        for mine, theirs in zip(got.logprobs[k:], want.logprobs[k:], strict=True):
            assert mine.keys() == theirs.keys()
            for tid, lp in theirs.items():
                assert mine[tid].logprob == pytest.approx(lp.logprob, abs=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=50, seed=5, max_tokens=24, ignore_eos=True,
                       repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                       logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=24, min_tokens=12),
    ],
    ids=["greedy", "seeded-penalties-logprobs", "seeded-min-tokens"],
)
@pytest.mark.parametrize("k", [1, 5, 11])
def test_resume_after_k_tokens_continues_exactly(llm, other, params, k):
    ref = llm.generate(PROMPT, params)[0].outputs
    assert len(ref[0].token_ids) > k
    got = resume(other, PROMPT, ref, {0: k}, params)
    assert_same(got[0], ref[0], k)


def test_n_samples_resume_each_from_its_own_point(llm, other):
    params = SamplingParams(n=3, temperature=1.0, seed=17, max_tokens=20, ignore_eos=True,
                            frequency_penalty=0.4)
    ref = llm.generate(PROMPT, params)[0].outputs
    assert len({tuple(o.token_ids) for o in ref}) == 3  # child seeds differ
    cut = {0: 3, 1: 9, 2: 1}
    got = resume(other, PROMPT, ref, cut, params)
    assert sorted(got) == [0, 1, 2]
    for index, k in cut.items():
        assert_same(got[index], ref[index], k)
    # Sequences 0 and 1 had finished: they replay to the same finish, only 2 goes on.
    only = resume(other, PROMPT, ref, {2: 6}, params)
    for index in range(3):
        assert_same(only[index], ref[index], 6 if index == 2 else len(ref[index].token_ids))


def test_stop_string_spanning_the_resume_point(llm, other):
    prompt = "1, 2, 3, 4,"
    plain = SamplingParams(temperature=0, max_tokens=20)
    base = llm.generate(prompt, plain)[0].outputs[0]
    assert " 6, 7" in base.text
    tok = llm.get_tokenizer()
    # The first k tokens end inside the stop string: " 6" was produced, ", 7" was not.
    k = next(k for k in range(1, len(base.token_ids))
             if tok.decode(base.token_ids[:k]).endswith(" 6"))
    params = SamplingParams(temperature=0, max_tokens=20, stop=[" 6, 7"])
    ref = llm.generate(prompt, params)[0].outputs
    assert ref[0].finish_reason == "stop" and len(ref[0].token_ids) > k
    got = resume(other, prompt, ref, {0: k}, params)
    assert_same(got[0], ref[0], k)


def test_resume_refuses_what_an_uninterrupted_run_would_have_finished(other):
    _, ids = other.tokenize(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        other.add(EngineRequest("too-long", ids, params, given_tokens=[[11, 12, 13, 14, 15]]))
    with pytest.raises(ValueError, match="per sample"):
        other.add(EngineRequest("bad-n", ids, params, given_tokens=[[11], [12]]))
    assert not other.requests
    assert other.num_free_blocks == other.num_total_blocks
