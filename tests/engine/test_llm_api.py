"""The offline API's contract on real weights: errors, sampling features, n > 1, KV roles."""

from __future__ import annotations

import pytest
import torch

from pdmesh import LLM, SamplingParams
from pdmesh.engine.engine_request import EngineRequest

pytestmark = [pytest.mark.slow, pytest.mark.weights]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", kv_cache_memory="256MiB", max_model_len=1024)


def all_blocks_free(llm: LLM) -> bool:
    return llm.engine.num_free_blocks == llm.engine.num_total_blocks


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ("word " * 1100, SamplingParams(), "max_model_len"),
        ({"prompt_token_ids": [1, 10**9]}, SamplingParams(), "prompt_token_ids"),
        ("hi", SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
        ("hi", SamplingParams(allowed_token_ids=[1, 10**9]), "allowed_token_ids"),
    ],
)
def test_bad_input_is_a_clear_value_error(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt, params)
    assert not llm.engine.has_unfinished_requests()
    assert all_blocks_free(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="model"):
        LLM("/nonexistent/model/dir")


def test_chat_applies_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=8)
    )[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).startswith("<|im_start|>")
    assert out.prompt_token_ids[-3:] == tok("<|im_start|>assistant\n")["input_ids"][-3:]
    assert out.outputs[0].text


def test_seeded_sampling_is_reproducible_regardless_of_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20)
    alone = llm.generate("Tell me a story about a dragon", params)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=20)
    batch = llm.generate(
        ["Some other prompt", "Tell me a story about a dragon", "And a third"],
        [other, params, other],
    )
    assert batch[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=20)
    assert (
        llm.generate("Tell me a story about a dragon", different_seed)[0].outputs[0].token_ids
        != alone
    )


def test_n_samples_share_prompt_blocks(llm):
    prompt = "Write a list of fruits: " * 10
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12)
    engine = llm.engine
    engine.add_request("n-test", prompt, params)
    seen_shared = False
    while engine.has_unfinished_requests():
        engine.step()
        state = engine.requests.get("n-test")
        if state and len(state.seqs) == 4 and not any(s.status.is_finished for s in state.seqs):
            tables = [engine.kv_manager.block_ids(s.seq_id) for s in state.seqs]
            full = len(state.seqs[0].prompt_token_ids) // 16
            seen_shared = all(t[:full] == tables[0][:full] for t in tables)
    assert seen_shared
    outs = llm.generate(prompt, params)[0].outputs
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert all(len(o.token_ids) == 12 for o in outs)
    assert all_blocks_free(llm)


def test_greedy_n_gives_identical_samples(llm):
    outs = llm.generate("The sky is", SamplingParams(n=3, temperature=0, max_tokens=10))[0].outputs
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


def test_stop_string_excluded_and_included(llm):
    base = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20))[0]
    assert " 7," in base.outputs[0].text
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop=[" 7"]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == " 7"
    assert c.text == base.outputs[0].text.split(" 7")[0]
    out = llm.generate(
        "1, 2, 3, 4,",
        SamplingParams(temperature=0, max_tokens=20, stop=[" 7"], include_stop_str_in_output=True),
    )[0]
    assert out.outputs[0].text.endswith(" 7")


def test_stop_token_ids_and_ignore_eos_and_min_tokens(llm):
    tok = llm.get_tokenizer()
    comma = tok(",")["input_ids"][-1]
    out = llm.generate(
        "1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[comma])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == comma and out.token_ids[-1] == comma
    out = llm.generate(
        "1, 2, 3, 4,",
        SamplingParams(temperature=0, max_tokens=20, min_tokens=5, stop_token_ids=[comma]),
    )[0].outputs[0]
    assert len(out.token_ids) >= 5 and comma not in out.token_ids[:4]
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"


def test_logprobs_match_transformers(llm, hf_model):
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=5, logprobs=3)
    )[0]
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    n_prompt = len(out.prompt_token_ids)
    for i, (tid, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        row = ref[n_prompt - 1 + i]
        assert entry[tid].rank == 1  # greedy picks the top token
        assert abs(entry[tid].logprob - row[tid].item()) < 1e-4
        top3 = row.topk(3).indices.tolist()
        assert set(top3) <= set(entry)
    assert (
        abs(
            comp.cumulative_logprob
            - sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs, strict=True))
        )
        < 1e-5
    )


def test_allowed_token_ids_match_transformers_masked(llm, hf_model, hf_tokenizer):
    """Greedy within allowed_token_ids is the transformers argmax over those tokens alone."""
    allowed = sorted({t for word in (" Paris", " London", " Berlin", " the", " and", ",", ".")
                      for t in hf_tokenizer(word, add_special_tokens=False)["input_ids"]})
    prompt = "The capital of France is"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6,
                                              allowed_token_ids=allowed))[0]
    ids = list(out.prompt_token_ids)
    expected = []
    mask = torch.full((hf_model.config.vocab_size,), -torch.inf)
    mask[allowed] = 0.0
    with torch.no_grad():
        for _ in range(6):
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
            expected.append(int((logits + mask).argmax()))
            ids.append(expected[-1])
    assert out.outputs[0].token_ids == expected
    assert set(expected) <= set(allowed)
    unconstrained = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0]
    assert unconstrained.outputs[0].token_ids != expected  # the mask changed the output


def test_priority_policy_serves_everything():
    llm = LLM("smollm2", kv_cache_memory="64MiB", scheduling_policy="priority", max_num_seqs=2)
    outs = llm.generate(
        ["a", "b", "c", "d"], SamplingParams(temperature=0, max_tokens=4), priority=[3, 0, 2, 1]
    )
    assert all(o.finished and len(o.outputs[0].token_ids) == 4 for o in outs)


def test_abort_returns_every_block(llm):
    engine = llm.engine
    engine.add_request(
        "abort-me",
        "Tell me everything about " * 20,
        SamplingParams(n=2, max_tokens=50, temperature=1.0),
    )
    for _ in range(3):
        engine.step()
    assert engine.num_free_blocks < engine.num_total_blocks
    assert engine.abort_request("abort-me")
    assert all_blocks_free(llm)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=16),
        SamplingParams(n=2, temperature=0.8, top_k=50, seed=11, max_tokens=16),
    ],
    ids=["greedy", "seeded-n2"],
)
def test_kv_export_import_continues_exactly(llm, params):
    """Prefill role on one engine, decode role on another: same tokens as one engine."""
    prompt = "Explain in one sentence why the sky is blue. " * 3
    expected = [o.token_ids for o in llm.generate(prompt, params)[0].outputs]

    prefill = llm.engine
    prefill.add_request("xfer", prompt, params, export_kv=True)
    exported = None
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            if out.kv_export is not None:
                exported = out
    assert exported is not None
    assert [len(o.token_ids) for o in exported.outputs] == [1] * params.n
    kv = prefill.read_kv("xfer")
    assert prefill.num_free_blocks < prefill.num_total_blocks  # pinned until released

    decode = LLM("smollm2", kv_cache_memory="64MiB").engine
    first = [o.token_ids[0] for o in exported.outputs]
    decode.add(EngineRequest("xfer", exported.prompt_token_ids, params, kv=kv.clone(),
                             given_tokens=[[t] for t in first]))
    assert prefill.release_kv("xfer")
    assert all_blocks_free(llm)
    final = None
    while decode.has_unfinished_requests() or final is None:
        for out in decode.step():
            final = out
    assert final.finished
    assert [o.token_ids for o in final.outputs] == expected
    assert decode.num_free_blocks == decode.num_total_blocks


def test_step_counters_count_what_the_steps_computed(llm):
    """The load snapshot's cumulative step figures (pdmesh:engine_steps_total and friends):
    an uncached 40-token prompt and 5 tokens out is one prefill step and four decode steps,
    computing 40 + 4 tokens."""
    before = llm.engine.core.load()
    rng = torch.Generator().manual_seed(40)
    ids = torch.randint(1000, 40000, (40,), generator=rng).tolist()
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=5, ignore_eos=True))
    after = llm.engine.core.load()
    assert after.num_steps - before.num_steps == 5
    assert after.scheduled_tokens - before.scheduled_tokens == 44
    assert after.step_seconds > before.step_seconds
