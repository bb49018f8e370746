"""Async scheduling (engine/worker/in_flight.py) against the same engine without it.

It is on by default only on CUDA; here it is forced on, on CPU, where the same code runs (the
host copy is the tensor itself). Greedy parity with transformers is in test_parity_hf.py;
these tests check that every other feature gives exactly what the synchronous engine gives —
seeded sampling, stops of every kind, logprobs, penalties, grammars, n > 1 — that steps are
really left in flight, that nothing is computed past a known length limit, and that aborts
and finished sequences leave no block behind.
"""

from __future__ import annotations

import pytest
import torch

from pdmesh import LLM, SamplingParams
from pdmesh.engine.structured_output import StructuredOutput

pytestmark = [pytest.mark.slow, pytest.mark.weights, pytest.mark.processes]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4, 5,",
    "Once upon a time in a small village by the sea, there lived",
    "Hi",
]


def mixed_params() -> list[SamplingParams]:
    """One request per feature; sampled ones are seeded (unseeded draws share a generator
    whose use depends on the batch, so they are not comparable run to run)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[13]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, stop=["\n\n"]),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, min_tokens=4),
        SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=16, n=2),
        SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]


def summary(outputs) -> list:
    rows = []
    for out in outputs:
        for c in out.outputs:
            lps = None
            if c.logprobs is not None:
                lps = [{t: (v.logprob, v.rank) for t, v in lp.items()} for lp in c.logprobs]
            rows.append((out.request_id, c.index, c.token_ids, c.text, c.finish_reason,
                         c.stop_reason, lps))
    return rows


@pytest.fixture(scope="module")
def engines():
    common = dict(kv_cache_memory="128MiB", max_num_batched_tokens=256, seed=0)
    pair = LLM("smollm2", async_scheduling=False, **common), \
        LLM("smollm2", async_scheduling=True, **common)
    yield pair
    for llm in pair:
        llm.engine.core.close()  # its grammar sandbox's workers


def test_mixed_features_match_the_synchronous_engine(engines):
    sync, overlapped = engines
    expected = summary(sync.generate(PROMPTS, mixed_params(), use_tqdm=False))
    got = summary(overlapped.generate(PROMPTS, mixed_params(), use_tqdm=False))
    assert got == expected
    for llm in engines:
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
        assert not llm.engine.has_unfinished_requests()


def test_grammar_requests_beside_overlapped_ones_match(engines):
    schema = {"type": "object", "properties": {"color": {"type": "string"}},
              "required": ["color"]}
    params = [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.0, max_tokens=24,
                       structured_output=StructuredOutput(json_schema=schema)),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ]
    prompts = [*PROMPTS[:2], "Give me a JSON object with a color:"]
    sync, overlapped = engines
    expected = summary(sync.generate(prompts, params, use_tqdm=False))
    assert summary(overlapped.generate(prompts, params, use_tqdm=False)) == expected


def test_decode_steps_are_left_in_flight(engines):
    _, overlapped = engines
    engine = overlapped.engine
    params = SamplingParams(temperature=0.0, max_tokens=8)
    before = engine.core.num_steps
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"in-flight-{i}", prompt, params)
    in_flight = 0
    steps = 0
    while engine.has_unfinished_requests() and steps < 50:
        engine.step()
        steps += 1
        in_flight += engine.core._in_flight is not None
    assert not engine.has_unfinished_requests()
    # Every step but the landing call leaves its tokens in flight: 8 tokens, 8 steps, 1 land.
    assert (steps, in_flight) == (9, 8)
    assert engine.core.num_steps - before == 8


def test_nothing_is_computed_past_max_tokens(engines):
    _, overlapped = engines
    engine = overlapped.engine
    before = engine.core.num_steps
    out = overlapped.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1),
                              use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1
    assert engine.core.num_steps - before == 1  # the prefill only, no wasted decode step


def test_abort_while_a_step_is_in_flight(engines):
    sync, overlapped = engines
    params = SamplingParams(temperature=0.0, max_tokens=10)
    expected = sync.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = overlapped.engine
    engine.add_request("keep", PROMPTS[1], params)
    engine.add_request("drop", PROMPTS[2], params)
    engine.step()
    engine.step()
    assert engine.core._in_flight is not None
    assert engine.abort_request("drop")
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests() and steps < 50:
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert "drop" not in tokens
    assert tokens["keep"] == expected
    assert engine.num_free_blocks == engine.num_total_blocks
    assert all(s.num_pending == 0 for s in engine.core.scheduler.running)


@pytest.fixture(scope="module")
def random_smollm2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """SmolLM2's shape and tokenizer with random weights (tests/random_llama.py): what a GPU
    machine, where no weights travel, can build."""
    from tests.random_llama import write_random_llama

    return str(write_random_llama(tmp_path_factory.mktemp("random-smollm2")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_default_overlaps_and_matches_the_synchronous_engine(random_smollm2: str) -> None:
    """On CUDA async scheduling is the default, with decode steps replayed as CUDA graphs:
    the pinned host copy, its event and the on-device input gather must change no token."""
    common = dict(kv_cache_memory="256MiB", max_num_batched_tokens=256, dtype="float32",
                  device="cuda", attention_backend="triton")
    sync = LLM(random_smollm2, async_scheduling=False, **common)
    overlapped = LLM(random_smollm2, **common)
    assert not overlapped.engine.core.info().selfcheck_fallbacks, \
        overlapped.engine.core.info().selfcheck
    assert overlapped.engine.core.async_scheduling
    assert overlapped.engine.core.runner.cuda_graphs is not None
    expected = summary(sync.generate(PROMPTS, mixed_params(), use_tqdm=False))
    assert summary(overlapped.generate(PROMPTS, mixed_params(), use_tqdm=False)) == expected
    assert overlapped.engine.num_free_blocks == overlapped.engine.num_total_blocks
