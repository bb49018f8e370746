"""pdmesh's engine against the transformers reference on the same SmolLM2 weights (float32).

Greedy decoding must be token-for-token identical, however the engine schedules the work:
batched, alone, with prefix-cache hits, with tiny prefill chunks and under preemption.
"""

from __future__ import annotations

import pytest
import torch

from pdmesh import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.weights]

MAX_NEW = 24
LONG = (
    "You are a careful assistant. Answer briefly and precisely. "
    "The following is a record of measurements taken at a weather station over a week. "
) * 6

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Hi",
    LONG + "Question: what is being recorded? Answer:",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4, 5,",
    LONG + "Question: how long was the record kept? Answer:",
    "Once upon a time in a small village by the sea, there lived",
]


def hf_greedy(hf_model, prompt_ids: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()


def prompt_logprobs_pair(out, hf_model) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt token's log-probability as the engine reported it (`prompt_logprobs=0`)
    and as `hf_model` computes it over the same ids."""
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    ours = torch.tensor(
        [out.prompt_logprobs[i + 1][ids[i + 1]].logprob for i in range(len(ids) - 1)]
    )
    return ours, ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@pytest.fixture(scope="module")
def reference(hf_model, hf_tokenizer):
    prompt_ids = [hf_tokenizer(p)["input_ids"] for p in PROMPTS]
    return prompt_ids, [hf_greedy(hf_model, ids, MAX_NEW) for ids in prompt_ids]


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def assert_same(outputs, reference) -> None:
    prompt_ids, expected = reference
    for out, ids, ref in zip(outputs, prompt_ids, expected, strict=True):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == ref, f"mismatch for prompt {out.prompt!r}"


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", kv_cache_memory="256MiB", max_num_batched_tokens=512)


def test_batch_matches_transformers(llm, reference):
    assert_same(llm.generate(PROMPTS, greedy()), reference)


def test_each_prompt_alone_matches(llm, reference):
    outs = [llm.generate(p, greedy())[0] for p in PROMPTS]
    assert_same(outs, reference)


def test_prefix_cache_hits_keep_output(llm, reference):
    llm.generate(PROMPTS, greedy())  # warm the cache
    before = llm.engine.kv_manager.stats.hits
    outs = llm.generate(PROMPTS, greedy())
    assert_same(outs, reference)
    assert llm.engine.kv_manager.stats.hits > before
    long_out = outs[3]
    assert long_out.num_cached_tokens >= 16 * (len(long_out.prompt_token_ids) // 16 - 1)


def test_shared_prefix_in_one_batch(reference):
    # Prompts 3 and 6 share a long prefix; with a budget that admits one per step the second
    # one hits blocks the first just computed.
    llm = LLM("smollm2", kv_cache_memory="128MiB", max_num_batched_tokens=256)
    outs = llm.generate([PROMPTS[3], PROMPTS[6]], greedy())
    _, expected = reference
    assert outs[0].outputs[0].token_ids == expected[3]
    assert outs[1].outputs[0].token_ids == expected[6]
    assert outs[1].num_cached_tokens > 0


def test_small_chunks_match(reference):
    llm = LLM(
        "smollm2", kv_cache_memory="128MiB", max_num_batched_tokens=16, enable_prefix_caching=False
    )
    assert_same(llm.generate(PROMPTS, greedy()), reference)


def test_long_prefill_threshold_matches(reference):
    """Prompts in chunks of at most 5 tokens each step, several prompts per step."""
    llm = LLM("smollm2", kv_cache_memory="128MiB", max_num_batched_tokens=256,
              long_prefill_token_threshold=5, enable_prefix_caching=False)
    assert_same(llm.generate(PROMPTS, greedy()), reference)


def test_preemption_matches(reference):
    # 16 blocks of 16 tokens cannot hold all eight growing sequences at once.
    llm = LLM("smollm2", num_gpu_blocks_override=16, max_num_batched_tokens=256)
    assert llm.engine.num_total_blocks == 16
    outs = llm.generate(PROMPTS, greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same(outs, reference)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


# Async scheduling (on by default on CUDA) must not change a token: the next step reads the
# in-flight token on the device, and stop checks land one step later.
@pytest.mark.parametrize("budget", [512, 16], ids=["batched", "small-chunks"])
def test_async_scheduling_matches(reference, budget):
    llm = LLM("smollm2", kv_cache_memory="128MiB", max_num_batched_tokens=budget,
              enable_prefix_caching=False, async_scheduling=True)
    assert_same(llm.generate(PROMPTS, greedy()), reference)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_async_scheduling_under_preemption_matches(reference):
    llm = LLM("smollm2", num_gpu_blocks_override=16, max_num_batched_tokens=256,
              async_scheduling=True)
    outs = llm.generate(PROMPTS, greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same(outs, reference)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_prefill_logits_match_transformers(llm, hf_model, hf_tokenizer):
    prompt = PROMPTS[3]
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs[0] is None
    ours, theirs = prompt_logprobs_pair(out, hf_model)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_raw_logits_match_transformers(llm, hf_model, hf_tokenizer):
    """Every row of logits from our model runner, prompt in two chunks, vs one HF forward."""
    from pdmesh.engine.scheduling.scheduler import ScheduledSeq
    from pdmesh.engine.scheduling.sequence import Sequence

    engine = llm.engine
    ids = hf_tokenizer(PROMPTS[6])["input_ids"]
    seq = Sequence("logits-test", "logits-test", 0, list(ids), len(ids), SamplingParams())
    seq.want_prompt_logprobs = True  # ask the runner for logits of every prompt row
    half = len(ids) // 2
    chunks = []
    for n in (half, len(ids) - half):
        assert engine.kv_manager.allocate_slots(seq, n)
        chunks.append(engine.runner.execute(engine.runner.prepare([ScheduledSeq(seq, n)])))
        seq.num_computed_tokens += n
    engine.kv_manager.free(seq.seq_id)
    ours = torch.cat(chunks)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
