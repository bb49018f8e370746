"""The gateway's OpenAI formats: request → router proto, router messages → OpenAI objects,
and the gRPC status → HTTP error mapping (on real grpc.aio errors)."""

from __future__ import annotations

import grpc
import pytest
from pydantic import ValidationError

from pdmesh.gateway.openai_format import (
    SequenceState,
    chat_choice,
    completion_choice,
    completion_logprobs,
    finish_reason,
    stop_reason,
)
from pdmesh.gateway.router_client import error_from_rpc
from pdmesh.gateway.schemas import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    UsageInfo,
    validation_param,
)
from pdmesh.v1 import common_pb2


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
        {"prompt": "x", "unknown_param": 1},
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
