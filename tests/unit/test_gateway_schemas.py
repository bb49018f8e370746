"""The gateway's OpenAI formats: request bodies → request models → router proto (integers
bounded by the proto fields they travel in), router messages → OpenAI objects, and the gRPC
status → HTTP error mapping (on real grpc.aio errors)."""

from __future__ import annotations

import grpc
import pytest
from pydantic import ValidationError

from pdmesh.engine_svc import codec
from pdmesh.gateway.body import BadBody, parse_json_object
from pdmesh.gateway.chat_schemas import ChatCompletionRequest
from pdmesh.gateway.completion_schemas import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    CompletionRequest,
    CompletionResponseChoice,
)
from pdmesh.gateway.errors import error_from_rpc, validation_param
from pdmesh.gateway.info_schemas import DetokenizeRequest
from pdmesh.gateway.openai_format import (
    SequenceState,
    chat_choice,
    completion_choice,
    completion_logprobs,
    echo_logprobs,
    finish_reason,
    format_prompt_logprobs,
    stop_reason,
)
from pdmesh.gateway.schemas import MAX_N, UsageInfo, ignored_fields
from pdmesh.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.fast


def test_completion_request_maps_every_sampling_field() -> None:
    req = CompletionRequest(
        model="smollm2", prompt="hi", max_tokens=7, temperature=0.5, top_p=0.9, n=2,
        stop="END", seed=3, presence_penalty=0.1, frequency_penalty=0.2,
        logit_bias={"42": -5.0}, logprobs=3, top_k=10, min_p=0.05, repetition_penalty=1.1,
        min_tokens=2, ignore_eos=True, skip_special_tokens=False, cache_salt="t1", priority=4,
        stream=True, stream_options={"include_usage": True}, user="u", stream_interval=4,
    )
    g = req.to_generate("hi", "rid-0")
    s = g.sampling
    assert (g.request_id, g.model, g.text, g.cache_salt, g.priority, g.stream) == (
        "rid-0", "smollm2", "hi", "t1", 4, True)
    assert (s.n, s.max_tokens, s.seed, s.top_k, s.min_tokens, s.logprobs) == (2, 7, 3, 10, 2, 3)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert s.min_p == pytest.approx(0.05) and s.repetition_penalty == pytest.approx(1.1)
    assert list(s.stop) == ["END"] and dict(s.logit_bias) == {42: -5.0}
    assert s.ignore_eos and not s.skip_special_tokens and s.HasField("skip_special_tokens")
    assert s.stream_interval == 4
    assert req.include_usage_in_stream


def test_unset_fields_stay_unset_so_the_router_defaults_apply() -> None:
    s = CompletionRequest(prompt="hi").to_generate("hi", "r").sampling
    for name in ("temperature", "top_p", "repetition_penalty", "seed", "logprobs",
                 "skip_special_tokens", "stream_interval"):
        assert not s.HasField(name), name
    assert s.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).to_generate("r")
    assert not chat.sampling.HasField("max_tokens")  # chat: up to the context limit


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_shapes(prompt: object, expected: list[object]) -> None:
    req = CompletionRequest(prompt=prompt)
    assert req.prompts() == expected
    g = req.to_generate(req.prompts()[-1], "r")
    if isinstance(expected[-1], str):
        assert g.text == expected[-1]
    else:
        assert list(g.token_ids.ids) == expected[-1]


def test_chat_request_joins_text_parts_and_prefers_max_completion_tokens() -> None:
    req = ChatCompletionRequest(
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}],
        max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=2,
    )
    g = req.to_generate("r")
    assert [(m.role, m.content) for m in g.chat.messages] == [("system", "be brief"),
                                                             ("user", "ab")]
    assert g.sampling.max_tokens == 9 and g.sampling.logprobs == 2
    assert g.chat.add_generation_prompt
    no_top = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert no_top.to_generate("r").sampling.logprobs == 0


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": []},
        {"prompt": [[1], []]},
        {"prompt": "x", "n": 0},
        {"prompt": "x", "logit_bias": {"abc": 1.0}},
        {"prompt": "x", "stream_options": {"include_usage": True}},  # needs stream
        {"prompt": "x", "stream_interval": 0},
    ],
)
def test_invalid_completion_requests(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest(**body)


def test_invalid_chat_requests() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2)


def test_validation_param_names_the_field() -> None:
    assert validation_param(("body", "messages", 0, "content")) == "messages[0].content"
    assert validation_param(("body", "temperature")) == "temperature"
    assert validation_param(("body",)) is None
    # Fields that begin like a union branch's name are fields ("str" -> "stream...").
    assert validation_param(("body", "stream_interval")) == "stream_interval"
    assert validation_param(("body", "stream_options", "include_usage")) == \
        "stream_options.include_usage"
    assert validation_param(("body", "structured_outputs", "json")) == "structured_outputs.json"
    assert validation_param(("body", "prompt", "str")) == "prompt"
    assert validation_param(("body", "prompt", "list[int]", 0)) == "prompt[0]"


def _lp(token_id: int, text: str, logprob: float, top: list[tuple[str, float]]):
    return common_pb2.TokenLogprob(
        token_id=token_id, text=text, logprob=logprob, rank=1,
        top=[common_pb2.TokenLogprob.Candidate(token_id=i, text=t, logprob=v)
             for i, (t, v) in enumerate(top)],
    )


def test_finish_and_stop_reasons() -> None:
    assert finish_reason(None) is None
    assert finish_reason(common_pb2.Finish(reason=common_pb2.FINISH_REASON_LENGTH)) == "length"
    stop = common_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP, stop_str="\n")
    assert (finish_reason(stop), stop_reason(stop)) == ("stop", "\n")
    eos = common_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP)
    assert stop_reason(eos) is None
    tok = common_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP, stop_token_id=7)
    assert stop_reason(tok) == 7


def test_sequence_state_and_choices() -> None:
    seq = SequenceState()
    seq.add(common_pb2.SequenceDelta(index=0, token_ids=[1, 2], text="He",
                                     logprobs=[_lp(1, "H", -0.1, [("H", -0.1), ("J", -2.0)]),
                                               _lp(2, "e", -0.2, [("a", -0.1)])]))
    seq.add(common_pb2.SequenceDelta(
        index=0, token_ids=[3], text="y", logprobs=[_lp(3, "y", -0.3, [])],
        finish=common_pb2.Finish(reason=common_pb2.FINISH_REASON_LENGTH)))
    assert (seq.text, seq.token_ids) == ("Hey", [1, 2, 3])
    c = completion_choice(4, seq, want_logprobs=True)
    assert (c.index, c.text, c.finish_reason) == (4, "Hey", "length")
    assert c.logprobs is not None
    assert c.logprobs.tokens == ["H", "e", "y"]
    assert c.logprobs.text_offset == [0, 1, 2]
    # The sampled token is always listed, even when outside the top k.
    assert c.logprobs.top_logprobs[1] == pytest.approx({"a": -0.1, "e": -0.2})
    assert completion_choice(0, seq, want_logprobs=False).logprobs is None
    chat = chat_choice(0, seq, want_logprobs=True)
    assert chat.message.content == "Hey" and chat.message.role == "assistant"
    assert chat.logprobs is not None
    first = chat.logprobs.content[0]
    assert (first.token, first.bytes, [t.token for t in first.top_logprobs]) == (
        "H", [72], ["H", "J"])


def test_completion_logprobs_offset_continues_a_stream() -> None:
    out = completion_logprobs([_lp(1, "ab", -1.0, []), _lp(2, "c", -1.0, [])], text_offset=5)
    assert out.text_offset == [5, 7]


def test_usage_sums_prompts() -> None:
    usage = UsageInfo()
    usage.add(common_pb2.Usage(prompt_tokens=5, completion_tokens=3, cached_prompt_tokens=2))
    usage.add(common_pb2.Usage(prompt_tokens=4, completion_tokens=1))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (9, 4, 13)
    assert usage.prompt_tokens_details.cached_tokens == 2


def _rpc_error(code: grpc.StatusCode, details: str, trailing=()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


@pytest.mark.parametrize(
    ("code", "status", "param"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "temperature"),
        (grpc.StatusCode.NOT_FOUND, 404, "model"),
        (grpc.StatusCode.UNAVAILABLE, 503, None),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, None),
        (grpc.StatusCode.INTERNAL, 500, None),
        (grpc.StatusCode.UNKNOWN, 500, None),
    ],
)
def test_status_mapping(code: grpc.StatusCode, status: int, param: str | None) -> None:
    err = error_from_rpc(_rpc_error(code, "sampling.temperature: must be >= 0"))
    assert err.status == status
    assert err.param == param
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]


def test_resource_exhausted_becomes_429_with_retry_after_rounded_up() -> None:
    err = error_from_rpc(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "over capacity",
                                    (("retry-after-ms", "2100"),)))
    assert err.status == 429 and err.headers == {"Retry-After": "3"}
    bare = error_from_rpc(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "over capacity"))
    assert bare.headers == {"Retry-After": "1"}


# -- integers the wire can carry -----------------------------------------------------------------
def test_int_range_comes_from_the_proto_field_types() -> None:
    assert codec.int_range(common_pb2.SamplingParams, "max_tokens") == (0, 2**32 - 1)
    assert codec.int_range(common_pb2.SamplingParams, "seed") == (-(2**63), 2**63 - 1)
    assert codec.int_range(common_pb2.SamplingParams, "top_k") == (-(2**31), 2**31 - 1)
    assert codec.int_range(common_pb2.SamplingParams, "logit_bias.key") == (-(2**31), 2**31 - 1)
    assert codec.int_range(router_pb2.GenerateRequest, "token_ids.ids") == (-(2**31), 2**31 - 1)
    with pytest.raises(TypeError, match="not an integer field"):
        codec.int_range(common_pb2.SamplingParams, "temperature")
    assert codec.check_int(common_pb2.SamplingParams, "n", 2**32 - 1, "n") == 2**32 - 1
    with pytest.raises(ValueError, match=r"stop_token_ids\[3\] must be in"):
        codec.check_int(common_pb2.SamplingParams, "stop_token_ids", 2**31, "stop_token_ids[3]")


# Every integer a request body can carry into a message, and the proto field it travels in.
_CHAT = {"messages": [{"role": "user", "content": "x"}]}
INT_FIELDS = [
    (CompletionRequest, {"prompt": "x"}, "max_tokens", "max_tokens"),
    (CompletionRequest, {"prompt": "x"}, "logprobs", "logprobs"),
    (CompletionRequest, {"prompt": "x"}, "prompt_logprobs", "prompt_logprobs"),
    (CompletionRequest, {"prompt": "x"}, "seed", "seed"),
    (CompletionRequest, {"prompt": "x"}, "top_k", "top_k"),
    (CompletionRequest, {"prompt": "x"}, "n", "n"),
    (CompletionRequest, {"prompt": "x"}, "min_tokens", "min_tokens"),
    (CompletionRequest, {"prompt": "x"}, "priority", "priority"),
    (CompletionRequest, {"prompt": "x"}, "stream_interval", "stream_interval"),
    (ChatCompletionRequest, _CHAT, "max_tokens", "max_tokens"),
    (ChatCompletionRequest, _CHAT, "max_completion_tokens", "max_tokens"),
    (ChatCompletionRequest, {**_CHAT, "logprobs": True}, "top_logprobs", "logprobs"),
]


@pytest.mark.parametrize("value", [2**64, -(2**64), 2**70])
@pytest.mark.parametrize(("model", "base", "name", "wire"), INT_FIELDS)
def test_out_of_wire_range_integers_are_validation_errors(
    model: type, base: dict, name: str, wire: str, value: int
) -> None:
    with pytest.raises(ValidationError) as info:
        model(**{**base, name: value})
    assert validation_param(info.value.errors()[0]["loc"]) == name


@pytest.mark.parametrize(("model", "base", "name", "wire"), INT_FIELDS)
def test_the_extreme_valid_integers_build_a_message(
    model: type, base: dict, name: str, wire: str
) -> None:
    """The bounds are the proto's own (n: the gateway's tighter MAX_N), on both ends."""
    message = router_pb2.GenerateRequest if wire == "priority" else common_pb2.SamplingParams
    low, high = codec.int_range(message, wire)
    if name == "n":
        high = MAX_N
    for value, outside in ((high, high + 1), (low, low - 1)):
        try:
            request = model(**{**base, name: value})
        except ValidationError:
            assert value == low, f"{name}={value} refused"  # a tighter lower bound (>= 1)
            continue
        generate = (request.to_generate("x", "r") if isinstance(request, CompletionRequest)
                    else request.to_generate("r"))
        assert generate.ByteSize() > 0  # protobuf took the value
        with pytest.raises(ValidationError):
            model(**{**base, name: outside})


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"prompt": [1, 2**31]}, "prompt[1]"),
        ({"prompt": [[1], [2, -(2**31) - 1]]}, "prompt[1][1]"),
        ({"prompt": "x", "stop_token_ids": [1, 10**12]}, "stop_token_ids"),
        ({"prompt": "x", "logit_bias": {str(2**40): 1.0}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"\u00b2": 1.0}}, "logit_bias"),  # isdigit(), not int
    ],
)
def test_collections_of_integers_are_checked_too(body: dict, where: str) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest(**body)
    assert where in str(info.value)


def test_detokenize_ids_fit_int32() -> None:
    with pytest.raises(ValidationError) as info:
        DetokenizeRequest(tokens=[1, 2**31])
    assert validation_param(info.value.errors()[0]["loc"]) == "tokens[1]"


# -- prompt logprobs -----------------------------------------------------------------------------
def test_prompt_logprobs_reach_the_router_unless_streamed() -> None:
    assert CompletionRequest(prompt="x", prompt_logprobs=3).to_generate(
        "x", "r").sampling.prompt_logprobs == 3
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], prompt_logprobs=0)
    assert chat.to_generate("r").sampling.HasField("prompt_logprobs")
    # vLLM: streaming refuses k > 0 (and -1) and takes 0, which returns nothing.
    with pytest.raises(ValidationError, match="not available when `stream=True`"):
        CompletionRequest(prompt="x", stream=True, prompt_logprobs=2)
    streamed = CompletionRequest(prompt="x", stream=True, prompt_logprobs=0)
    assert streamed.returned_prompt_logprobs is None
    assert not streamed.to_generate("x", "r").sampling.HasField("prompt_logprobs")


@pytest.mark.parametrize(
    ("echo_k", "prompt_k", "sent"), [(2, None, 2), (None, 4, 4), (2, 4, 4), (5, 1, 5), (3, -1, -1)]
)
def test_echo_and_prompt_logprobs_share_one_router_k(
    echo_k: int | None, prompt_k: int | None, sent: int
) -> None:
    body = CompletionRequest(prompt="x", echo=echo_k is not None, logprobs=echo_k,
                             prompt_logprobs=prompt_k)
    assert body.to_generate("x", "r").sampling.prompt_logprobs == sent


def test_format_prompt_logprobs_is_vllms() -> None:
    entries = [_lp(5, " sky", -3.0, [("-", -0.5), (",", -1.0), (" sky", -3.0)]),
               _lp(7, " is", -0.2, [(" is", -0.2)])]
    entries[0].rank = 3
    entries[0].top[2].token_id = 5
    out = format_prompt_logprobs(entries, k=2)
    assert out[0] is None and len(out) == 3
    first = out[1]
    assert first is not None and list(first) == [5, 0, 1]  # the prompt's token, then the top k
    assert (first[5].logprob, first[5].rank, first[5].decoded_token) == (-3.0, 3, " sky")
    assert (first[0].rank, first[1].rank) == (1, 2)
    assert list(format_prompt_logprobs(entries, k=0)[1] or {}) == [5]
    dumped = CompletionResponseChoice(index=0, text="", prompt_logprobs=out).model_dump(
        mode="json")
    assert dumped["prompt_logprobs"][1]["5"] == {"logprob": -3.0, "rank": 3,
                                                 "decoded_token": " sky"}


def test_echo_logprobs_keep_their_own_k() -> None:
    prompt = [_lp(5, " b", -1.0, [("a", -0.5), ("c", -0.7), ("d", -0.9)])]
    echo = echo_logprobs("x", prompt, [], 2, k=1)
    assert echo.top_logprobs == [None, {"a": -0.5, " b": -1.0}]


# -- request bodies ------------------------------------------------------------------------------
JSON = "application/json"


@pytest.mark.parametrize(
    ("body", "content_type", "message", "param"),
    [
        (b'{"prompt": "x"}', "text/plain", "Only 'application/json' is allowed, got "
         "Content-Type 'text/plain'", "Content-Type"),
        (b'{"prompt": "x"}', None, "no Content-Type", "Content-Type"),
        (b"prompt=x", "application/x-www-form-urlencoded", "Content-Type", "Content-Type"),
        (b"", JSON, "the body is empty", None),
        (b"  \n", JSON, "the body is empty", None),
        (b'{"prompt": "\xff"}', JSON, "not valid UTF-8: byte 0xff at offset 12", None),
        (b'"\xed\xa0\x80"', JSON, "not valid UTF-8: byte 0xed at offset 1", None),
        (b"[" * 10_000 + b"]" * 10_000, JSON, "deeper than 200 levels", None),
        (b'{"a":' * 201 + b"1" + b"}" * 201, JSON, "deeper than 200 levels", None),
        (b'{"prompt": "\\ud800"}', JSON, "prompt: lone UTF-16 surrogate \\ud800", "prompt"),
        (b'{"messages": [{"content": "ok \\udc00"}]}', JSON,
         "messages[0].content: lone UTF-16 surrogate \\udc00", "messages[0].content"),
        (b'{"stop": ["a", "\\ud83d"]}', JSON, "stop[1]: lone", "stop[1]"),
        (b'{"logit_bias": {"\\ud800": 1}}', JSON, "a key of logit_bias: lone", "logit_bias"),
        (b'{"prompt": "x",}', JSON, "not valid JSON: Expecting property name enclosed in double "
         "quotes: line 1 column 16", None),
        (b'{"prompt": "x"', JSON, "not valid JSON: Expecting ',' delimiter", None),
        (b'{"prompt": "x"} {}', JSON, "not valid JSON: Extra data", None),
        (b"[1, 2]", JSON, "must be a JSON object, got an array", None),
        (b'"x"', JSON, "must be a JSON object, got a string", None),
        (b"null", JSON, "must be a JSON object, got null", None),
    ],
)
def test_unreadable_bodies_say_why(
    body: bytes, content_type: str | None, message: str, param: str | None
) -> None:
    with pytest.raises(BadBody) as info:
        parse_json_object(body, content_type)
    assert message in str(info.value)
    assert info.value.param == param
    str(info.value).encode()  # never the surrogate itself: the answer must encode


@pytest.mark.parametrize(
    ("body", "content_type", "expected"),
    [
        (b'{"prompt": "x"}', "application/json; charset=utf-8", {"prompt": "x"}),
        (b'{"prompt": "x"}', "Application/JSON", {"prompt": "x"}),
        (b'{"p": "\\ud83d\\ude00", "n": 1180591620717411303424}', JSON,
         {"p": "\U0001f600", "n": 2**70}),
        (b'{"a":' * 200 + b"1" + b"}" * 200, JSON, None),  # 200 levels
    ],
)
def test_readable_bodies(body: bytes, content_type: str, expected: dict | None) -> None:
    data = parse_json_object(body, content_type)
    if expected is not None:
        assert data == expected


# -- unknown fields --------------------------------------------------------------------------------
VLLM_ONLY_FIELDS = {
    "kv_transfer_params": {"do_remote_decode": False}, "store": False, "metadata": {"a": "b"},
    "service_tier": "auto",
    "verbosity": "low", "modalities": ["text"], "prediction": {"type": "content", "content": "x"},
}
ACTED_ON_FIELDS = {  # vLLM's and OpenAI's, once ignored, now taken (tests/unit/test_vllm_fields.py)
    "chat_template_kwargs": {"enable_thinking": False}, "truncate_prompt_tokens": 5,
    "return_tokens_as_token_ids": True, "bad_words": ["x"], "prompt_cache_key": "k",
    "request_id": "r1", "reasoning_effort": "low",
}


def test_unknown_fields_are_ignored_and_named_as_paths() -> None:
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "system", "content": "s"},
                     {"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}],
                      "refusal": None}],
        **VLLM_ONLY_FIELDS, **ACTED_ON_FIELDS, "not_a_field_anywhere": 1, "max_tokens": 3,
        "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}},
    })
    assert ignored_fields(body) == [  # the body's own, then by field, depth first
        *VLLM_ONLY_FIELDS, "not_a_field_anywhere", "response_format.json_schema.extra",
        "messages[1].refusal", "messages[1].content[0].cache"]
    assert body.to_generate("r").sampling.max_tokens == 3  # the known fields still apply
    plain = CompletionRequest.model_validate({"prompt": [[1, 2], [3]], "max_tokens": 2})
    assert ignored_fields(plain) == [] and plain.ignored == []
    assert ignored_fields(DetokenizeRequest.model_validate({"tokens": [1], "x": 0})) == ["x"]
