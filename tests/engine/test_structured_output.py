"""Structured outputs in the engine, on real weights: the grammar's bitmask is applied to the
logits before sampling, each of n samples walks its own matcher, and a request resumed with
output produced elsewhere replays it into a new matcher before sampling continues."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import jsonschema
import pytest

from pdmesh import LLM, SamplingParams
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.outputs import RequestOutput
from pdmesh.engine.structured_output import MAX_SPEC_BYTES, StructuredOutput
from tests.engine_steps import run_to_finish as run

pytestmark = [pytest.mark.slow, pytest.mark.weights, pytest.mark.processes]

CHOICES = ["Paris", "London", "Berlin"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
_ids = itertools.count()


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM("smollm2", kv_cache_memory="64MiB", max_model_len=512)
    yield llm
    llm.engine.core.close()  # its grammar sandbox's workers




def generate(llm: LLM, prompt: str, params: SamplingParams) -> RequestOutput:
    llm.engine.add_request(f"so-{next(_ids)}", prompt, params)
    return run(llm.engine)


def test_choice_grammar_masks_greedy_output(llm: LLM) -> None:
    prompt = "Tell me a short story about a dog."
    free = generate(llm, prompt, SamplingParams(temperature=0.0, max_tokens=8))
    assert free.outputs[0].text.strip() not in CHOICES  # the mask, not the model, decides
    params = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_output=StructuredOutput(choice=tuple(CHOICES)))
    out = generate(llm, prompt, params).outputs[0]
    assert out.text in CHOICES
    assert out.finish_reason == "stop"


def test_json_schema_with_n_samples(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=60,
                            structured_output=StructuredOutput(json_schema=json.dumps(SCHEMA)))
    out = generate(llm, "Describe a person as JSON.", params)
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_prefix_cache_hit_keeps_the_grammar(llm: LLM) -> None:
    prompt = ("You are a registry clerk. Record the next visitor of the city archive as a JSON "
              "object with a name and an age, nothing else.")
    params = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_output=StructuredOutput(json_schema=json.dumps(SCHEMA)))
    first = generate(llm, prompt, params)
    second = generate(llm, prompt, params)
    assert second.num_cached_tokens > 0  # the prompt's blocks came from the prefix cache
    assert second.outputs[0].text == first.outputs[0].text
    jsonschema.validate(json.loads(second.outputs[0].text), SCHEMA)


def test_a_grammar_after_reasoning_starts_where_its_end_text_was_produced(llm: LLM) -> None:
    """`reasoning_end`: the output is free until it has produced that text (here the greedy
    output's first three tokens stand for the thinking, their text for its end tag), then
    follows the schema. Without it the schema holds from the first token, which that text
    cannot begin."""
    prompt = "The three largest cities of France are"
    free = generate(llm, prompt, SamplingParams(temperature=0.0, max_tokens=8)).outputs[0]
    assert free.finish_reason == "length", free  # eight tokens, none of them the end
    thinking = llm.get_tokenizer().decode(free.token_ids[:3])
    assert not thinking.lstrip().startswith("{")
    schema = StructuredOutput(json_schema=json.dumps(SCHEMA))
    gated = StructuredOutput(json_schema=json.dumps(SCHEMA), reasoning_end=thinking)
    at_once = generate(llm, prompt, SamplingParams(temperature=0.0, max_tokens=60,
                                                   structured_output=schema)).outputs[0]
    after = generate(llm, prompt, SamplingParams(temperature=0.0, max_tokens=60,
                                                 structured_output=gated)).outputs[0]
    assert not at_once.text.startswith(thinking)
    assert after.token_ids[:3] == free.token_ids[:3] and after.text.startswith(thinking)
    assert after.finish_reason == "stop", after.text
    jsonschema.validate(json.loads(after.text[len(thinking):]), SCHEMA)


def test_resumed_request_replays_partial_json(llm: LLM) -> None:
    engine = llm.engine
    _, prompt_ids = engine.tokenize("Describe a person as JSON.")
    prefix = engine.tokenizer('{"name": "Al', add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_output=StructuredOutput(json_schema=json.dumps(SCHEMA)))
    engine.add(EngineRequest(f"so-{next(_ids)}", prompt_ids, params, given_tokens=[prefix]))
    out = run(engine).outputs[0]
    assert out.text.startswith('{"name": "Al')  # the given tokens are output, then the rest
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_resumed_tokens_that_break_the_grammar_are_refused(llm: LLM) -> None:
    engine = llm.engine
    _, prompt_ids = engine.tokenize("Pick a city.")
    bad = engine.tokenizer("Rome", add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_output=StructuredOutput(choice=tuple(CHOICES)))
    with pytest.raises(ValueError, match="structured_output"):
        engine.add(EngineRequest(f"so-{next(_ids)}", prompt_ids, params, given_tokens=[bad]))
    assert engine.num_free_blocks == engine.num_total_blocks


def test_a_grammar_and_allowed_token_ids_with_no_token_in_common_end_the_sample(
        llm: LLM) -> None:
    """Where the grammar and allowed_token_ids leave no token, the sample stops with what it
    has ("stop"), never with a token either forbids: at its first token (every sample of n),
    and midway, once the allowed tokens no longer continue the grammar."""
    engine = llm.engine
    choice = ("Berlin Wall",)
    first, *rest = engine.tokenizer(choice[0], add_special_tokens=False)["input_ids"]
    assert rest and first not in rest  # the choice takes more tokens than the first
    never = engine.tokenizer(" zebra", add_special_tokens=False)["input_ids"]
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, allowed_token_ids=never,
                            structured_output=StructuredOutput(choice=choice))
    out = generate(llm, "Pick a city.", params)
    assert [(c.token_ids, c.finish_reason) for c in out.outputs] == [([], "stop")] * 2
    params = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=[first],
                            structured_output=StructuredOutput(choice=choice))
    completion = generate(llm, "Pick a city.", params).outputs[0]
    assert (completion.token_ids, completion.finish_reason) == ([first], "stop")
    assert engine.num_free_blocks == engine.num_total_blocks


def test_spec_that_does_not_compile_is_refused_and_frees_nothing(llm: LLM) -> None:
    """Whether a spec compiles is the engine's verdict (its sandbox), at add time."""
    for spec, match in ((StructuredOutput(json_schema='{"type": "nonsense"}'),
                         r"structured_output\.json_schema does not compile"),
                        (StructuredOutput(regex="(ab"),
                         r"structured_output\.regex does not compile")):
        with pytest.raises(ValueError, match=match):
            llm.engine.add_request(f"so-{next(_ids)}", "Hi", SamplingParams(structured_output=spec))
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_codec_maps_the_wire_oneof() -> None:
    from pdmesh.engine_svc.codec import SamplingError, sampling_from_proto
    from pdmesh.v1 import common_pb2

    msg = common_pb2.SamplingParams()
    msg.structured_output.choice.choices.extend(CHOICES)
    assert sampling_from_proto(msg).structured_output == StructuredOutput(choice=tuple(CHOICES))
    too_long = "a" * (MAX_SPEC_BYTES + 1)
    msg = common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(regex=too_long))
    with pytest.raises(SamplingError, match="the limit is") as info:
        sampling_from_proto(msg)
    assert info.value.field == "sampling.structured_output.regex"
    gated = common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(
        json_object=True, reasoning_end="</think>"))
    assert sampling_from_proto(gated).structured_output == StructuredOutput(
        json_object=True, reasoning_end="</think>")
    gated.structured_output.reasoning_end = "x" * 257
    with pytest.raises(SamplingError, match="the limit is") as info:
        sampling_from_proto(gated)
    assert info.value.field == "sampling.structured_output.reasoning_end"
    empty = common_pb2.SamplingParams()
    empty.structured_output.SetInParent()
    with pytest.raises(SamplingError, match="names no kind"):
        sampling_from_proto(empty)


def test_the_core_compiles_grammars_only_from_a_vocabulary_it_was_sent(llm: LLM,
                                                                       hf_tokenizer) -> None:
    """The engine core has no tokenizer: without the vocabulary a structured request is a
    clear error, and a vocabulary that is not one, or of another model, is refused."""
    from pdmesh.engine.config import EngineConfig
    from pdmesh.engine.core.engine_core import EngineCore
    from pdmesh.engine.structured.grammar import grammar_vocabulary

    eos = llm.engine.eos_token_ids
    core = EngineCore(EngineConfig(model="smollm2", kv_cache_memory="16MiB"), eos)
    params = SamplingParams(max_tokens=4, structured_output=StructuredOutput(choice=("a", "b")))
    with pytest.raises(ValueError, match="no grammar vocabulary"):
        core.add(EngineRequest("r", [1, 2, 3], params))
    assert core.num_free_blocks == core.num_total_blocks and not core.requests
    with pytest.raises(ValueError, match="not a serialized xgrammar TokenizerInfo"):
        core.grammars.set_vocabulary("{")
    vocab = core.model_config.vocab_size
    with pytest.raises(ValueError, match="tokens, but the model has"):
        core.grammars.set_vocabulary(grammar_vocabulary(hf_tokenizer, vocab + 64, eos))
    core.grammars.set_vocabulary(grammar_vocabulary(hf_tokenizer, vocab, eos))
    try:
        core.add(EngineRequest("r", [1, 2, 3], params))
        while core.has_unfinished_requests():
            core.step()
        assert core.num_free_blocks == core.num_total_blocks
    finally:
        core.close()
