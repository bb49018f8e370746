"""Tensor parallelism on CPU (gloo, two ranks, real SmolLM2 weights) against the transformers
reference: greedy output token for token, however the engine schedules the work (batched,
prefix-cache hits, tiny prefill chunks, preemption, async scheduling); prompt logprobs; seeded
sampling (n > 1: forked samples copy blocks on every rank) reproducible and equal to one
rank's; structured output intact. SmolLM2-135M's 3 KV heads split 2 + 1 over the ranks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jsonschema
import pytest
import torch

from pdmesh import LLM, SamplingParams
from pdmesh.engine.structured_output import StructuredOutput
from tests.engine.test_parity_hf import (
    PROMPTS,
    assert_same,
    greedy,
    hf_greedy,
    prompt_logprobs_pair,
)

pytestmark = [pytest.mark.slow, pytest.mark.weights, pytest.mark.processes]

BYTES_PER_BLOCK_RANK0 = 30 * 2 * 16 * 2 * 64 * 4  # rank 0 holds 2 of the 3 KV heads


@pytest.fixture(scope="module")
def reference(hf_model, hf_tokenizer):  # type: ignore[no-untyped-def]
    prompt_ids = [hf_tokenizer(p)["input_ids"] for p in PROMPTS]
    return prompt_ids, [hf_greedy(hf_model, ids, 24) for ids in prompt_ids]


@contextmanager
def tp_llm(**kwargs: Any) -> Iterator[LLM]:
    llm = LLM("smollm2", tensor_parallel_size=2, **kwargs)
    try:
        yield llm
    finally:
        llm.engine.core.close()  # stops its rank


def test_batch_and_prefix_hits_match_transformers(reference) -> None:  # type: ignore[no-untyped-def]
    with tp_llm(kv_cache_memory="128MiB", max_num_batched_tokens=512) as llm:
        ranks = llm.engine.core.ranks
        assert ranks is not None and ranks.tp.world_size == 2
        assert_same(llm.generate(PROMPTS, greedy()), reference)
        before = llm.engine.kv_manager.stats.hits
        assert_same(llm.generate(PROMPTS, greedy()), reference)
        assert llm.engine.kv_manager.stats.hits > before
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_small_chunks_match(reference) -> None:  # type: ignore[no-untyped-def]
    with tp_llm(kv_cache_memory="64MiB", max_num_batched_tokens=16,
                enable_prefix_caching=False) as llm:
        assert_same(llm.generate(PROMPTS, greedy()), reference)


def test_preemption_matches(reference) -> None:  # type: ignore[no-untyped-def]
    # 16 blocks on rank 0 (rank 1, one KV head, could hold 32: the ranks agree on 16).
    with tp_llm(kv_cache_memory=16 * BYTES_PER_BLOCK_RANK0, max_num_batched_tokens=256) as llm:
        assert llm.engine.num_total_blocks == 16
        outs = llm.generate(PROMPTS, greedy())
        assert llm.engine.scheduler.num_preemptions > 0
        assert_same(outs, reference)
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_async_scheduling_matches(reference) -> None:  # type: ignore[no-untyped-def]
    with tp_llm(kv_cache_memory="64MiB", max_num_batched_tokens=16,
                enable_prefix_caching=False, async_scheduling=True) as llm:
        assert_same(llm.generate(PROMPTS, greedy()), reference)
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_prompt_logprobs_match_transformers(hf_model) -> None:  # type: ignore[no-untyped-def]
    with tp_llm(kv_cache_memory="64MiB", max_num_batched_tokens=64) as llm:
        out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ours, theirs = prompt_logprobs_pair(out, hf_model)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def samples(outs) -> list[list[list[int]]]:  # type: ignore[no-untyped-def]
    return [[s.token_ids for s in o.outputs] for o in outs]


def test_seeded_sampling_is_reproducible_and_equal_to_one_rank() -> None:
    params = [SamplingParams(n=3, temperature=0.8, seed=100 + i, max_tokens=16)
              for i in range(len(PROMPTS))]
    one = LLM("smollm2", kv_cache_memory="64MiB", max_num_batched_tokens=512)
    try:
        expected = samples(one.generate(PROMPTS, params))
    finally:
        one.engine.core.close()
    with tp_llm(kv_cache_memory="64MiB", max_num_batched_tokens=512) as llm:
        channel = llm.engine.core.ranks.channel  # type: ignore[union-attr]
        copies: list[list[tuple[int, int]]] = []
        send_copies = channel.send_copies
        channel.send_copies = lambda pairs: (copies.append(pairs), send_copies(pairs))[1]
        first = samples(llm.generate(PROMPTS, params))
        again = samples(llm.generate(PROMPTS, params))
    assert copies  # forked samples' shared last blocks were copied on the other rank too
    assert first == again
    assert first == expected


def test_structured_output_is_intact() -> None:
    schema = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer"}}}
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=60,
                            structured_output=StructuredOutput(json_schema=json.dumps(schema)))
    with tp_llm(kv_cache_memory="64MiB", max_model_len=512) as llm:
        out = llm.generate("Describe a person as JSON.", params)[0]
    assert len(out.outputs) == 2
    for sample in out.outputs:
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), schema)
