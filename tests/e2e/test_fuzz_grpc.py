"""Malformed gRPC input against the real router (and the engine behind it): every case ends
with the documented status (INVALID_ARGUMENT, or NOT_FOUND / RESOURCE_EXHAUSTED where
router.proto says so) and a message naming the field or the problem, fast (a GenerateRequest
without `sampling` used to run until the client's deadline), and the next call on the same
channel succeeds.

One colocated engine behind a router (`LocalMesh`), started once for the module; one channel.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from pdmesh.serve import LocalMesh, MeshConfig
from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

KV_MEMORY = "96MiB"
VOCAB = 49152  # SmolLM2's
DEADLINE_S = 30.0
INT32_MAX, UINT32_MAX = 2**31 - 1, 2**32 - 1
NAN, INF = float("nan"), float("inf")
INVALID = grpc.StatusCode.INVALID_ARGUMENT

S = common_pb2.SamplingParams
SO = common_pb2.StructuredOutput


@dataclass(frozen=True)
class Case:
    name: str
    request: Any  # a GenerateRequest, or the request of `rpc`
    says: str  # a substring of the status details naming the field or the problem
    code: grpc.StatusCode = INVALID
    rpc: str = "Generate"


def text(sampling: common_pb2.SamplingParams | None = None, **fields: Any) -> Any:
    """A text prompt, greedy and short unless the case says otherwise."""
    if sampling is None:
        sampling = S(temperature=0, max_tokens=2)
    return router_pb2.GenerateRequest(sampling=sampling, **{"text": "Hi", **fields})


def sampled(**fields: Any) -> Any:
    return text(S(**{"max_tokens": 2, **fields}))


def chat(*messages: router_pb2.ChatMessage, tools_json: str = "") -> Any:
    return router_pb2.GenerateRequest(
        chat=router_pb2.Chat(messages=messages, tools_json=tools_json), sampling=S(max_tokens=2))


def ids(*token_ids: int) -> Any:
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=token_ids),
                                      sampling=S(max_tokens=2))


def constrained(**kind: Any) -> Any:
    return sampled(structured_output=SO(**kind))


USER = router_pb2.ChatMessage(role="user", content="hi")

CASES = [
    # -- the request's shape ---------------------------------------------------------------------
    Case("no sampling", router_pb2.GenerateRequest(text="Hi"), "sampling: required"),
    Case("no sampling, streamed", router_pb2.GenerateRequest(text="Hi", stream=True),
         "sampling: required"),
    Case("no prompt", router_pb2.GenerateRequest(sampling=S(max_tokens=2)),
         "prompt: one of text, token_ids or chat is required"),
    Case("empty text", text(text=""), "prompt: the prompt is empty"),
    Case("empty token ids", ids(), "prompt: the prompt is empty"),
    Case("token id -1", ids(1, -1), "prompt.token_ids: token id -1 is outside"),
    Case("token id = vocabulary size", ids(VOCAB), f"token id {VOCAB} is outside"),
    Case("token id int32 max", ids(INT32_MAX), "prompt.token_ids"),
    Case("token id int32 min", ids(-(2**31)), "prompt.token_ids"),
    Case("prompt past the context", text(text="hello " * 5000), "prompt: "),
    Case("chat without messages", chat(), "chat.messages: a chat needs at least one message"),
    Case("chat unknown role", chat(router_pb2.ChatMessage(role="wizard", content="x")),
         "messages[0].role: unknown role 'wizard'"),
    Case("chat empty role", chat(USER, router_pb2.ChatMessage(content="x")), "messages[1].role"),
    Case("chat tools not JSON", chat(USER, tools_json="{nope"), "chat.tools_json: not valid JSON"),
    Case("chat tools not a list", chat(USER, tools_json="{}"), "chat.tools_json: expected a JSON "
         "list"),
    Case("request_id too long", text(request_id="r" * 200), "request_id: must be printable ASCII"),
    Case("request_id with a NUL", text(request_id="a\x00b"), "request_id"),
    Case("request_id not ASCII", text(request_id="caf\u00e9"), "request_id"),
    Case("request_id with a newline", text(request_id="a\nb"), "request_id"),
    Case("unknown model", text(model="gpt-none"), "model 'gpt-none' is not served here",
         grpc.StatusCode.NOT_FOUND),
    # -- sampling ----------------------------------------------------------------------------------
    Case("max_tokens 0", sampled(max_tokens=0), "sampling.max_tokens: max_tokens must be >= 1"),
    Case("max_tokens uint32 max", sampled(max_tokens=UINT32_MAX), "sampling.max_tokens: "
         f"{UINT32_MAX} tokens do not fit"),
    Case("min_tokens over max_tokens", sampled(min_tokens=3), "sampling.min_tokens: min_tokens "
         "must be <= max_tokens"),
    Case("min_tokens past the context", text(S(min_tokens=UINT32_MAX)),
         f"sampling.min_tokens: {UINT32_MAX} tokens do not fit"),
    Case("n past the KV capacity", sampled(n=UINT32_MAX), f"n={UINT32_MAX}",
         grpc.StatusCode.RESOURCE_EXHAUSTED),
    Case("temperature NaN", sampled(temperature=NAN), "sampling.temperature: temperature must "
         "not be NaN"),
    Case("temperature -1", sampled(temperature=-1), "sampling.temperature"),
    Case("temperature inf", sampled(temperature=INF), "temperature must be >= 0 and finite"),
    Case("top_p 0", sampled(top_p=0), "sampling.top_p: top_p must be in (0, 1]"),
    Case("top_p 1.5", sampled(top_p=1.5), "sampling.top_p"),
    Case("top_p NaN", sampled(top_p=NAN), "sampling.top_p"),
    Case("top_k -2", sampled(top_k=-2), "sampling.top_k: top_k must be >= -1"),
    Case("top_k int32 min", sampled(top_k=-(2**31)), "sampling.top_k"),
    Case("min_p -0.5", sampled(min_p=-0.5), "sampling.min_p"),
    Case("min_p 2", sampled(min_p=2), "sampling.min_p: min_p must be in [0, 1]"),
    Case("repetition_penalty 0", sampled(repetition_penalty=0), "sampling.repetition_penalty"),
    Case("repetition_penalty -1", sampled(repetition_penalty=-1), "repetition_penalty must be > 0"),
    Case("repetition_penalty inf", sampled(repetition_penalty=INF), "repetition_penalty"),
    Case("presence_penalty 3", sampled(presence_penalty=3), "sampling.presence_penalty: "
         "presence_penalty must be in [-2, 2]"),
    Case("frequency_penalty -3", sampled(frequency_penalty=-3), "sampling.frequency_penalty"),
    Case("frequency_penalty NaN", sampled(frequency_penalty=NAN), "frequency_penalty must not "
         "be NaN"),
    Case("logit_bias key -1", sampled(logit_bias={-1: 1.0}), "sampling.logit_bias: logit_bias "
         "keys must be token ids >= 0"),
    Case("logit_bias key past the vocabulary", sampled(logit_bias={INT32_MAX: 1.0}),
         f"logit_bias token id {INT32_MAX} is out of range for vocab size {VOCAB}"),
    Case("logit_bias value 200", sampled(logit_bias={5: 200.0}), "logit_bias values must be in"),
    Case("logit_bias value NaN", sampled(logit_bias={5: NAN}), "logit_bias[5] must not be NaN"),
    Case("empty stop string", sampled(stop=["ok", ""]), "sampling.stop: stop strings must be "
         "non-empty"),
    Case("stop_token_ids -1", sampled(stop_token_ids=[-1]), "sampling.stop_token_ids"),
    Case("stop_token_ids past the vocabulary", sampled(stop_token_ids=[VOCAB]),
         f"stop_token_ids entry {VOCAB} is out of range"),
    Case("logprobs -1", sampled(logprobs=-1), "sampling.logprobs: logprobs must be in [0, 20]"),
    Case("logprobs 21", sampled(logprobs=21), "sampling.logprobs"),
    Case("prompt_logprobs -1", sampled(prompt_logprobs=-1), "sampling.prompt_logprobs"),
    Case("prompt_logprobs int32 max", sampled(prompt_logprobs=INT32_MAX),
         "sampling.prompt_logprobs: prompt_logprobs must be in [0, 20]"),
    Case("stream_interval 0", sampled(stream_interval=0), "sampling.stream_interval: "
         "stream_interval must be an integer >= 1"),
    # -- structured outputs ------------------------------------------------------------------------
    Case("structured output of no kind", constrained(), "sampling.structured_output: "
         "structured_output is set but names no kind"),
    Case("json_object false", constrained(json_object=False),
         "sampling.structured_output.json_object"),
    Case("regex that does not compile", constrained(regex="(("),
         "sampling.structured_output.regex: structured_output.regex does not compile"),
    Case("json_schema not JSON", constrained(json_schema="{nope"),
         "sampling.structured_output.json_schema"),
    Case("json_schema not a schema", constrained(json_schema="5"),
         "sampling.structured_output.json_schema"),
    Case("grammar that does not compile", constrained(grammar="root ::= "),
         "sampling.structured_output.grammar"),
    Case("empty choice", constrained(choice=SO.Choice()), "sampling.structured_output.choice"),
    Case("choice with an empty string", constrained(choice=SO.Choice(choices=["a", ""])),
         "sampling.structured_output.choice"),
    # -- the small RPCs ----------------------------------------------------------------------------
    Case("tokenize nothing", router_pb2.TokenizeRequest(), "prompt: one of text",
         rpc="Tokenize"),
    Case("tokenize an empty chat", router_pb2.TokenizeRequest(chat=router_pb2.Chat()),
         "chat.messages", rpc="Tokenize"),
    Case("tokenize for an unknown model", router_pb2.TokenizeRequest(model="x", text="a"),
         "model 'x' is not served here", grpc.StatusCode.NOT_FOUND, rpc="Tokenize"),
    Case("detokenize -1", router_pb2.DetokenizeRequest(token_ids=[5, -1]),
         "token_ids: token id -1 is outside", rpc="Detokenize"),
    Case("detokenize past the vocabulary", router_pb2.DetokenizeRequest(token_ids=[INT32_MAX]),
         f"token_ids: token id {INT32_MAX} is outside", rpc="Detokenize"),
]


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    """One channel to the mesh's router, for the whole module."""
    config = MeshConfig(colocated=True, num_decode=1, port=-1, kv_cache_memory=KV_MEMORY)
    with LocalMesh(config) as local, grpc.insecure_channel(local.router_address) as channel:
        yield channel


@pytest.fixture(scope="module")
def router(channel: grpc.Channel) -> router_pb2_grpc.RouterStub:
    return router_pb2_grpc.RouterStub(channel)


def call(stub: router_pb2_grpc.RouterStub, rpc: str, request: Any) -> list[Any]:
    if rpc == "Generate":
        return list(stub.Generate(request, timeout=DEADLINE_S))
    return [getattr(stub, rpc)(request, timeout=DEADLINE_S)]


def test_the_cases_are_many_and_distinct() -> None:
    assert len(CASES) >= 40
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_input_is_refused_and_the_channel_stays_usable(
    router: router_pb2_grpc.RouterStub, case: Case
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        call(router, case.rpc, case.request)
    assert refused.value.code() == case.code, refused.value.details()
    assert case.says in refused.value.details()

    answer = call(router, "Generate", text())
    assert answer[-1].HasField("result") and answer[-1].result.usage.completion_tokens >= 1


def _bad_utf8_prompt() -> bytes:
    wire = router_pb2.GenerateRequest(text="ab", sampling=S(max_tokens=1)).SerializeToString()
    return wire.replace(b"ab", b"\xff\xfe")


UNDECODABLE = {
    "truncated varint": b"\x08",
    "length past the end": b"\x12\x7fabc",
    "invalid utf-8 in a string": _bad_utf8_prompt(),
    "bad wire type": b"\x0f\x00",
}


@pytest.mark.parametrize("rpc", ["Generate", "Tokenize"])
@pytest.mark.parametrize("raw", UNDECODABLE.values(), ids=UNDECODABLE.keys())
def test_bytes_that_do_not_decode_are_invalid_argument(
    channel: grpc.Channel, router: router_pb2_grpc.RouterStub, rpc: str, raw: bytes
) -> None:
    """grpc decodes before any servicer runs; a DecodeError there was UNKNOWN."""
    method = f"/pdmesh.v1.Router/{rpc}"
    with pytest.raises(grpc.RpcError) as refused:
        if rpc == "Generate":
            list(channel.unary_stream(method)(raw, timeout=DEADLINE_S))
        else:
            channel.unary_unary(method)(raw, timeout=DEADLINE_S)
    assert refused.value.code() == INVALID, refused.value.details()
    assert f"the request to {method} does not decode" in refused.value.details()
    answer = call(router, "Generate", text())
    assert answer[-1].HasField("result")
