"""vLLM's request fields that used to be ignored and now act, each from the gateway's body to
where it takes effect: `chat_template_kwargs` (the template render), `truncate_prompt_tokens`
(the router's tokenizing), `bad_words` (tokenized by the router, masked by the engine core),
`return_tokens_as_token_ids` (the answer's logprobs). In-process, with a word-level tokenizer
built in memory (no model files); the routing side of `prompt_cache_key` is
tests/unit/test_routing_affinity.py, the real-model paths tests/unit/test_vllm_fields_model.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError

from pdmesh.engine.bad_words import MAX_BAD_WORDS, banned_next_tokens, tokenize_bad_words
from pdmesh.engine.chat_template import (
    MAX_TEMPLATE_KWARGS_BYTES,
    RESERVED_TEMPLATE_KWARGS,
    apply_chat_template,
    check_template_kwargs,
)
from pdmesh.engine.request_rules import RuleViolation, truncate_prompt
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.engine.worker.in_flight import may_overlap
from pdmesh.engine.worker.sampler import SampledToken, Sampler, SamplingMetadata, make_generator
from pdmesh.engine.worker.step_sampling import StepSampler, mask_bad_words
from pdmesh.engine_svc import codec
from pdmesh.gateway.app import create_app
from pdmesh.gateway.chat_formatter import ChatFormatter
from pdmesh.gateway.chat_schemas import ChatCompletionRequest
from pdmesh.gateway.completion_formatter import CompletionFormatter
from pdmesh.gateway.completion_schemas import CompletionRequest
from pdmesh.gateway.config import GatewayConfig
from pdmesh.gateway.formatter import Outputs, ResponseHead
from pdmesh.gateway.info_schemas import TokenizeRequest
from pdmesh.gateway.openai_format import SequenceState
from pdmesh.gateway.schemas import UsageInfo, ignored_fields
from pdmesh.gateway.token_id_logprobs import TokenIdLogprobs
from pdmesh.gateway.translate import count_prompt_tokens
from pdmesh.router.admission import InvalidRequest
from pdmesh.router.prompt_tokenizer import chat_template_kwargs
from pdmesh.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.fast

WORDS = ["[UNK]", "hello", "world", "think", "off", "on", "user", "Ġbad", "bad", "word", "ok"]
THINKING_TEMPLATE = ("{% for m in messages %}{{ m.content }} {% endfor %}"
                     "think {{ 'off' if enable_thinking is false else 'on' }}")


@pytest.fixture(scope="module", name="tokenizer")
def tokenizer_fixture() -> Any:
    """A word-level fast tokenizer over WORDS whose chat template prints `enable_thinking`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.chat_template = THINKING_TEMPLATE
    return tok


def ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


# -- chat_template_kwargs ------------------------------------------------------------------------
def test_a_template_kwarg_reaches_the_template(tokenizer: Any) -> None:
    chat = [{"role": "user", "content": "hello"}]
    assert apply_chat_template(tokenizer, chat) == ids("hello", "think", "on")
    assert apply_chat_template(tokenizer, chat, template_kwargs={"enable_thinking": False}) \
        == ids("hello", "think", "off")


def test_template_kwargs_travel_gateway_to_router_as_json() -> None:
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False, "documents": [{"t": "x"}]}})
    assert ignored_fields(body) == []
    chat = body.to_generate("r").chat
    assert json.loads(chat.chat_template_kwargs_json) == {"enable_thinking": False,
                                                          "documents": [{"t": "x"}]}
    assert chat_template_kwargs(chat) == {"enable_thinking": False, "documents": [{"t": "x"}]}
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert plain.to_generate("r").chat.chat_template_kwargs_json == ""
    assert chat_template_kwargs(plain.to_generate("r").chat) is None


@pytest.mark.parametrize("kwargs", [
    {"add_generation_prompt": False}, {"messages": []}, {"tools": []}, {"tokenize": False},
    {"chat_template": "{{ 1 }}"}, {"return_dict": True}, {"x": "y" * MAX_TEMPLATE_KWARGS_BYTES},
])
def test_template_kwargs_the_render_sets_or_too_large_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        check_template_kwargs(kwargs)
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "chat_template_kwargs": kwargs})
    assert refused.value.errors()[0]["loc"] == ("chat_template_kwargs",)
    # The router refuses the same for a gRPC caller, naming the field.
    with pytest.raises(InvalidRequest, match=r"^chat_template_kwargs: ") as router_says:
        chat_template_kwargs(router_pb2.Chat(chat_template_kwargs_json=json.dumps(kwargs)))
    assert router_says.value.field == "chat_template_kwargs"
    assert {"messages", "tools", "add_generation_prompt"} <= RESERVED_TEMPLATE_KWARGS


@pytest.mark.parametrize("text", ["[1]", "{", '"x"'])
def test_router_refuses_template_kwargs_that_are_no_json_object(text: str) -> None:
    with pytest.raises(InvalidRequest, match="chat_template_kwargs"):
        chat_template_kwargs(router_pb2.Chat(chat_template_kwargs_json=text))


# -- truncate_prompt_tokens ----------------------------------------------------------------------
def test_truncation_keeps_the_last_tokens() -> None:
    prompt = list(range(10))
    assert truncate_prompt(prompt, None, 100) == prompt
    assert truncate_prompt(prompt, 3, 100) == [7, 8, 9]
    assert truncate_prompt(prompt, 30, 100) == prompt
    assert truncate_prompt(prompt, -1, 6) == [5, 6, 7, 8, 9]  # max_model_len - 1
    assert truncate_prompt(prompt, -1, None) == prompt  # no limit known: nothing to keep to
    with pytest.raises(RuleViolation, match="cannot be greater than max_model_len=8") as big:
        truncate_prompt(prompt, 9, 8)
    assert big.value.field == "truncate_prompt_tokens"
    with pytest.raises(RuleViolation, match=">= 1 or -1"):
        truncate_prompt(prompt, 0, 8)


def test_truncation_is_validated_and_carried_for_both_apis() -> None:
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                 truncate_prompt_tokens=-1)
    assert chat.to_generate("r").truncate_prompt_tokens == -1
    completion = CompletionRequest(prompt="x", truncate_prompt_tokens=5)
    assert completion.to_generate("x", "r").truncate_prompt_tokens == 5
    assert not CompletionRequest(prompt="x").to_generate("x", "r").HasField(
        "truncate_prompt_tokens")
    for bad in (0, -2, 2**31):
        with pytest.raises(ValidationError) as refused:
            CompletionRequest(prompt="x", truncate_prompt_tokens=bad)
        assert refused.value.errors()[0]["loc"] == ("truncate_prompt_tokens",)


class CountingRouter:
    """`tokenize` as the router answers it: truncation applied, the context limit given."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.asked: list[router_pb2.TokenizeRequest] = []

    async def tokenize(self, request: router_pb2.TokenizeRequest) -> router_pb2.TokenizeResponse:
        self.asked.append(request)
        tokens = list(range(len(request.text.split())))
        keep = (request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens")
                else None)
        return router_pb2.TokenizeResponse(
            token_ids=truncate_prompt(tokens, keep, self.max_model_len),
            max_model_len=self.max_model_len)


def test_usage_in_every_chunk_counts_the_kept_tokens() -> None:
    router = CountingRouter(max_model_len=8)
    words = CompletionRequest(prompt="a b c d e f", truncate_prompt_tokens=2)
    tokens = CompletionRequest(prompt=[[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2]],
                               truncate_prompt_tokens=-1)
    requests = [words.to_generate("a b c d e f", "r0"),
                *(tokens.to_generate(p, f"r{i}") for i, p in enumerate(tokens.prompts()))]
    assert asyncio.run(count_prompt_tokens(router, requests)) == 2 + 7 + 2  # type: ignore[arg-type]
    assert router.asked[0].truncate_prompt_tokens == 2


# -- bad_words -----------------------------------------------------------------------------------
def test_bad_words_tokenize_as_vllm_does(tokenizer: Any) -> None:
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text.replace(" bad", " Ġbad"), add_special_tokens=False))

    # "bad" with a leading space is another token: both are banned; "world" has no spaced
    # form of its own (the same sequence), "bad word" is two tokens.
    assert tokenize_bad_words(encode, ["bad", " world", "bad word", "bad"]) == [
        ids("bad"), ids("Ġbad"), ids("world"), ids("bad", "word"), ids("Ġbad", "word")]
    with pytest.raises(ValueError, match="at least one token"):
        tokenize_bad_words(encode, ["  "])
    with pytest.raises(ValueError, match="too many"):
        tokenize_bad_words(encode, [f"bad {'ok ' * i}" for i in range(MAX_BAD_WORDS)])


def test_banned_tokens_follow_the_output_tail() -> None:
    words = [[5], [7, 8], [1, 2, 3]]
    prompt = [7, 1, 2]  # a word's prefix in the prompt does not count, as in vLLM
    assert banned_next_tokens(words, prompt, num_prompt_tokens=3) == [5]
    assert banned_next_tokens(words, [*prompt, 7], 3) == [5, 8]
    assert banned_next_tokens(words, [*prompt, 1, 2], 3) == [5, 3]
    assert banned_next_tokens(words, [*prompt, 2], 3) == [5]


def test_bad_words_travel_in_sampling_params_and_are_checked() -> None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                 bad_words=["Paris", "London"])
    proto = body.to_generate("r").sampling
    assert list(proto.bad_words) == ["Paris", "London"]
    proto.bad_words_token_ids.add(token_ids=[4, 5])  # what the router adds once tokenized
    params = codec.sampling_from_proto(proto)
    assert params.bad_words == ["Paris", "London"] and params.bad_words_token_ids == [[4, 5]]
    with pytest.raises(ValueError, match="bad_words token id 9"):
        SamplingParams(bad_words_token_ids=[[1, 9]]).verify_vocab(9)
    with pytest.raises(codec.SamplingError) as empty:
        codec.sampling_from_proto(common_pb2.SamplingParams(
            bad_words_token_ids=[common_pb2.TokenSequence()]))
    assert empty.value.field == "sampling.bad_words_token_ids"
    for bad in ([""], [" "], ["w"] * (MAX_BAD_WORDS + 1)):
        with pytest.raises(ValidationError) as refused:
            CompletionRequest(prompt="x", bad_words=bad)
        assert refused.value.errors()[0]["loc"][0] == "bad_words"


def _seq(prompt: list[int], output: list[int], params: SamplingParams, name: str) -> Sequence:
    return Sequence(seq_id=name, request_id=name, index=0, token_ids=[*prompt, *output],
                    num_prompt_tokens=len(prompt), params=params)


def test_the_engine_masks_bad_words_on_their_rows_only() -> None:
    banned = SamplingParams(temperature=0, bad_words_token_ids=[[3], [1, 2]])
    plain = SamplingParams(temperature=0)
    logits = torch.zeros(3, 6)
    logits[:, 3] = 5.0  # every row's favourite
    logits[:, 2] = 4.0  # ... its second
    logits[:, 4] = 3.0  # ... and its third
    rows = [_seq([0], [], banned, "a"), _seq([0], [1], banned, "b"), _seq([0], [1], plain, "c")]
    step = StepSampler(Sampler(seed=0), eos_token_ids=[], device=torch.device("cpu"))
    picks = step.sample(logits.clone(), rows, {"a": 0, "b": 1, "c": 2})
    assert [samples[0].token_id for _, samples in picks] == [2, 4, 3]  # b: 3 and 2 both banned
    masked = mask_bad_words(logits, rows)
    assert torch.isinf(masked[0, 3]) and not torch.isinf(masked[0, 2])
    assert torch.isinf(masked[1, [2, 3]]).all() and torch.equal(masked[2], logits[2])
    assert not torch.isinf(logits).any()  # a copy: the model's logits stay as they were
    assert mask_bad_words(logits, [rows[2]] * 3) is logits  # no bad words: nothing copied
    # A sample with bad words reads its output on the host each step: never left in flight.
    assert not may_overlap(rows[0]) and may_overlap(rows[2])


# -- return_tokens_as_token_ids ------------------------------------------------------------------
def _lp(token_id: int, text: str) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=token_id, text=text, logprob=-0.5, rank=1,
        top=[common_pb2.TokenLogprob.Candidate(token_id=token_id + 1, text="x", logprob=-1.0)])


def test_logprob_tokens_named_by_id() -> None:
    seq = SequenceState(text="ab", token_ids=[7, 8], logprobs=[_lp(7, "a"), _lp(8, "b")])
    outputs = Outputs(sequences={0: seq}, prompt_logprobs={}, usage=UsageInfo())
    head = ResponseHead(id="x", created=0, model="m")
    chat = TokenIdLogprobs(ChatFormatter(n=1, want_logprobs=True)).whole(head, outputs)
    content = chat.choices[0].logprobs.content  # type: ignore[attr-defined]
    assert [c.token for c in content] == ["token_id:7", "token_id:8"]
    assert content[0].top_logprobs[0].token == "token_id:8"
    seq = SequenceState(text="ab", token_ids=[7, 8], logprobs=[_lp(7, "a"), _lp(8, "b")])
    outputs = Outputs(sequences={0: seq}, prompt_logprobs={}, usage=UsageInfo())
    completion = TokenIdLogprobs(CompletionFormatter(n=1, prompts=1, want_logprobs=True))
    logprobs = completion.whole(head, outputs).choices[0].logprobs  # type: ignore[attr-defined]
    assert logprobs.tokens == ["token_id:7", "token_id:8"]
    assert logprobs.text_offset == [0, len("token_id:7")]  # as vLLM counts them
    delta = common_pb2.SequenceDelta(index=0, token_ids=[7], text="a", logprobs=[_lp(7, "a")])
    streamed = TokenIdLogprobs(ChatFormatter(n=1, want_logprobs=True)).delta(0, delta)
    assert streamed.choices[0]["logprobs"]["content"][0]["token"] == "token_id:7"
    assert delta.logprobs[0].text == "a"  # the caller's delta is left as it was
    assert CompletionRequest(prompt="x", return_tokens_as_token_ids=True).ignored == []


def test_the_server_may_turn_token_ids_and_stream_usage_on_for_everyone() -> None:
    """vLLM's --return-tokens-as-token-ids and --enable-force-include-usage: the request's own
    fields still turn them on; the flags turn them on where it does not."""
    from pdmesh.gateway.answer_settings import AnswerSettings
    from pdmesh.gateway.tools import ToolSettings
    from pdmesh.gateway.translate import chat_plan, completion_plan

    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True)
    text = CompletionRequest(prompt="x", stream=True)
    tools = ToolSettings(False, None, False)
    for answers, by_id, usage in ((AnswerSettings(), False, False),
                                  (AnswerSettings(True, True), True, True)):
        plans = [chat_plan(chat, "r", tools, answers),
                 asyncio.run(completion_plan(None, text, "r", answers))]  # type: ignore[arg-type]
        for plan in plans:
            assert isinstance(plan.formatter, TokenIdLogprobs) is by_id
            assert plan.include_usage is usage
    asked = CompletionRequest(prompt="x", stream=True, return_tokens_as_token_ids=True,
                              stream_options={"include_usage": True})
    plan = asyncio.run(completion_plan(None, asked, "r"))  # type: ignore[arg-type]
    assert isinstance(plan.formatter, TokenIdLogprobs) and plan.include_usage


# -- through the app: a 400 naming each field ------------------------------------------------------
@pytest.fixture(name="http")
def http_fixture() -> Iterator[TestClient]:
    config = GatewayConfig(model_root="/models/m")
    with TestClient(create_app(config, client=object())) as http:  # type: ignore[arg-type]
        yield http


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"bad_words": "one"}, "bad_words"),
    ("/v1/chat/completions", {"prompt_cache_key": "k" * 1025}, "prompt_cache_key"),
    ("/v1/completions", {"suffix": ""}, "suffix"),  # refused as vLLM does: no FIM
])
def test_invalid_fields_are_400s_naming_them(http: TestClient, path: str, body: dict,
                                             param: str) -> None:
    prompt = ({"prompt": "x"} if path == "/v1/completions"
              else {"messages": [{"role": "user", "content": "x"}]})
    answer = http.post(path, json={**prompt, **body})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_a_null_suffix_is_no_suffix() -> None:
    assert CompletionRequest(prompt="x", suffix=None).ignored == []


# -- allowed_token_ids ---------------------------------------------------------------------------
def test_allowed_token_ids_travel_in_sampling_params_and_are_checked() -> None:
    body = CompletionRequest(prompt="x", allowed_token_ids=[5, 3, 5])
    assert ignored_fields(body) == []
    proto = body.to_generate("x", "r").sampling
    assert list(proto.allowed_token_ids) == [5, 3, 5]
    params = codec.sampling_from_proto(proto)
    assert params.allowed_token_ids == [3, 5] and params.needs_logit_processing
    params.verify_vocab(6)
    with pytest.raises(ValueError, match="allowed_token_ids entry 5 is out of range"):
        params.verify_vocab(5)
    assert codec.sampling_from_proto(common_pb2.SamplingParams()).allowed_token_ids is None
    for bad in ([], [-1], [2**31]):
        with pytest.raises(ValidationError) as refused:
            CompletionRequest(prompt="x", allowed_token_ids=bad)
        assert refused.value.errors()[0]["loc"][0] == "allowed_token_ids"
    for bad in ([], [-1], ["3"]):  # the offline API's own check
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)  # type: ignore[arg-type]


def test_the_sampler_keeps_to_allowed_token_ids() -> None:
    logits = torch.tensor([[9.0, 1.0, 3.0, 2.0, 8.0, 0.5]])
    allowed = [1, 2, 3]
    sampler = Sampler(seed=0)

    def meta(params: list[SamplingParams]) -> Any:
        rows = len(params)
        return SamplingMetadata(params=params, generators=[None] * rows,
                                prompt_token_ids=[[]] * rows, output_token_ids=[[]] * rows,
                                eos_token_ids=set())

    greedy = SamplingParams(temperature=0, allowed_token_ids=allowed, logprobs=1,
                            logit_bias={0: 50.0, 1: 2.5})  # a bias moves only what is allowed
    token = sampler(logits.clone(), meta([greedy]))[0]
    assert token.token_id == 1  # 1 + 2.5 beats 3.0; 0 and 4 are out, whatever their bias
    raw = torch.log_softmax(logits[0], dim=0)
    assert token.logprob == pytest.approx(raw[1].item())  # logprobs stay the model's
    rows = 400
    draws = SamplingParams(temperature=1.0, allowed_token_ids=allowed)
    picked = sampler.sample_ids(logits.repeat(rows, 1), meta([draws] * rows)).tolist()
    assert set(picked) == set(allowed)  # all three drawn, nothing else ever
    seeded = SamplingParams(temperature=1.0, seed=7, top_k=2, allowed_token_ids=allowed)
    gens = [make_generator(7 + i) for i in range(rows)]
    picked = sampler.sample_ids(logits.repeat(rows, 1), SamplingMetadata(
        params=[seeded] * rows, generators=gens, prompt_token_ids=[[]] * rows,
        output_token_ids=[[]] * rows, eos_token_ids=set())).tolist()
    assert set(picked) == {2, 3}  # top-k over the allowed tokens only
    plain = sampler.sample_ids(logits.clone(), meta([SamplingParams(temperature=0)]))
    assert plain.tolist() == [0]


def test_a_row_whose_masks_leave_no_token_is_a_dead_end_not_a_pick() -> None:
    """allowed_token_ids that min_tokens bans (both stop tokens): no token is left. The row
    says so, whichever way it would have picked; the other rows of the batch pick as ever."""
    logits = torch.tensor([[9.0, 1.0, 3.0, 2.0, 8.0, 0.5]]).repeat(5, 1)
    boxed = dict(allowed_token_ids=[2, 3], stop_token_ids=[2, 3], min_tokens=1)
    params = [SamplingParams(temperature=0, **boxed),
              SamplingParams(temperature=1.0, **boxed),
              SamplingParams(temperature=1.0, top_p=0.5, **boxed),
              SamplingParams(temperature=1.0, seed=3, logprobs=2, **boxed),
              SamplingParams(temperature=1.0, allowed_token_ids=[2, 3])]
    meta = SamplingMetadata(params=params, generators=[None, None, None, make_generator(3), None],
                            prompt_token_ids=[[]] * 5, output_token_ids=[[]] * 5,
                            eos_token_ids=set())
    picked = Sampler(seed=0)(logits, meta)
    assert [t.dead_end for t in picked] == [True, True, True, True, False]
    assert picked[4].token_id in (2, 3)
    once_past = SamplingMetadata(params=params[:1], generators=[None], prompt_token_ids=[[]],
                                 output_token_ids=[[]], eos_token_ids=set(),
                                 num_output_tokens=[1])  # min_tokens met: 2 is the argmax
    assert Sampler(seed=0)(logits[:1], once_past)[0] == SampledToken(token_id=2)


# -- add_special_tokens --------------------------------------------------------------------------
def test_add_special_tokens_reaches_the_router_and_usage(tokenizer: Any, tmp_path: Any) -> None:
    from tokenizers.processors import TemplateProcessing

    from pdmesh.router.prompt_tokenizer import PromptTokenizer

    body = CompletionRequest(prompt="hello world", add_special_tokens=False)
    assert ignored_fields(body) == []
    request = body.to_generate("hello world", "r")
    assert request.HasField("add_special_tokens") and not request.add_special_tokens
    default = CompletionRequest(prompt="hello world").to_generate("hello world", "r")
    assert default.add_special_tokens
    ids_request = CompletionRequest(prompt=[1, 2]).to_generate([1, 2], "r")
    assert not ids_request.HasField("add_special_tokens")  # token ids are taken as given
    router = CountingRouter(max_model_len=8)
    asyncio.run(count_prompt_tokens(router, [request]))  # type: ignore[arg-type]
    assert not router.asked[0].add_special_tokens  # usage counts the same tokens

    # The router's tokenizer honours it: a tokenizer that puts "ok" first as its BOS.
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="ok $A", special_tokens=[("ok", WORDS.index("ok"))])
    tokenizer.save_pretrained(tmp_path)
    pool = PromptTokenizer(str(tmp_path), pool_size=1)
    try:
        assert asyncio.run(pool.encode(default)) == ids("ok", "hello", "world")
        assert asyncio.run(pool.encode(request)) == ids("hello", "world")
        # A chat is the other way round, as in vLLM: off unless asked for.
        messages = [{"role": "user", "content": "hello"}]
        chat = ChatCompletionRequest(messages=messages)
        assert ignored_fields(chat) == []
        plain = chat.to_generate("r")
        assert asyncio.run(pool.encode(plain)) == ids("hello", "think", "on")
        with_bos = ChatCompletionRequest(messages=messages, add_special_tokens=True)
        assert (asyncio.run(pool.encode(with_bos.to_generate("r")))
                == ids("ok", "hello", "think", "on"))
        # /tokenize follows the same defaults, and usage counts what Generate tokenized.
        assert asyncio.run(pool.encode(TokenizeRequest(prompt="hello").to_proto())) == ids(
            "ok", "hello")
        asked = TokenizeRequest(messages=messages).to_proto()
        assert not asked.HasField("add_special_tokens")
        assert asyncio.run(pool.encode(asked)) == ids("hello", "think", "on")
        router = CountingRouter(max_model_len=8)
        asyncio.run(count_prompt_tokens(router, [with_bos.to_generate("r")]))  # type: ignore[arg-type]
        assert router.asked[0].add_special_tokens
    finally:
        pool.close()
