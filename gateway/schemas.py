"""The OpenAI wire formats' shared pieces: the request base model, the sampling fields every
generation request has, usage and prompt logprobs (pydantic models). Each API kind's own
bodies sit in their module (completion_schemas.py, chat_schemas.py; info_schemas.py for the
routes that generate nothing).

Unknown request fields are accepted and ignored, as vLLM does (its request models have many
fields pdmesh does not act on: `store`, `metadata`, `service_tier`, ...; and clients
send fields of newer API versions): each request model notes the keys it ignored
(`RequestModel.ignored`, `ignored_fields` for the whole tree), and the gateway logs them once
and names them in the answer's `X-Ignored-Fields` header (gateway/ignored_fields.py), so a
typo is still visible.

Each request model turns itself into the router's `SamplingParams` message (`_sampling`),
keeping unset fields unset so the router applies its documented defaults. vLLM's extensions
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, skip_special_tokens, ...) sit beside
OpenAI's. Value ranges are checked once, by the engine's own validation in the router, whose
INVALID_ARGUMENT becomes a 400 here; these modules only check what the router cannot see
(shapes, OpenAI-only combinations) and that every integer fits the proto field it travels in
(`wire_int`, with the codec's bounds): protobuf refuses one that does not with an error naming
no field, so it must never reach a message.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Self

from google.protobuf.message import Message
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from pdmesh.engine.bad_words import MAX_BAD_WORDS
from pdmesh.engine.request_rules import check_allowed_token_ids, check_prompt_cache_key
from pdmesh.engine_svc import codec
from pdmesh.gateway.request_id import check_request_id
from pdmesh.v1 import common_pb2, router_pb2

MAX_N = 128
"""Choices per prompt; a guard against one request fanning out without bound."""

_SP = common_pb2.SamplingParams
_GR = router_pb2.GenerateRequest


def wire_int(message: type[Message], path: str, *, ge: int | None = None,
             le: int | None = None) -> FieldInfo:
    """Bounds for an integer field (use in `Annotated[int, ...]`): what the proto field at
    `path` carries (`codec.int_range`), narrowed by `ge`/`le`. Out of range is a 400 naming
    the field, before any message is built."""
    low, high = codec.int_range(message, path)
    return Field(ge=low if ge is None else max(ge, low), le=high if le is None else min(le, high))


class RequestModel(BaseModel):
    """A request body or a part of one: keys it does not know are ignored and noted."""

    model_config = ConfigDict(extra="ignore")
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        model = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields)
            known |= {f.alias for f in cls.model_fields.values() if f.alias}
            model._ignored = [key for key in data if key not in known]
        return model

    @property
    def ignored(self) -> list[str]:
        """The keys of this object's input that no field took."""
        return self._ignored


def ignored_fields(model: RequestModel) -> list[str]:
    """Every ignored key in a request, as paths (`messages[0].refusal`), outer ones first."""
    found: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, RequestModel):
            found.extend(f"{path}.{key}" if path else key for key in value.ignored)
            for name in type(value).model_fields:
                walk(getattr(value, name), f"{path}.{name}" if path else name)
        elif isinstance(value, list) and value and isinstance(value[0], RequestModel | list):
            for i, item in enumerate(value):  # not lists of plain values (token ids)
                walk(item, f"{path}[{i}]")

    walk(model, "")
    return found


class StreamOptions(RequestModel):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(RequestModel):
    """OpenAI's `response_format.json_schema`: the schema sits under the key `schema`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = ""
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class StructuredOutputsIn(RequestModel):
    """vLLM's `structured_outputs` extension: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class SamplingFields(RequestModel):
    """Parameters shared by completions and chat completions."""

    model: str = ""
    n: Annotated[int, wire_int(_SP, "n", ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, wire_int(_SP, "seed")] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: Annotated[int, wire_int(_SP, "top_k")] = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: Annotated[int, wire_int(_SP, "min_tokens")] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    stop_token_ids: list[Annotated[int, wire_int(_SP, "stop_token_ids")]] | None = None
    include_stop_str_in_output: bool = False
    cache_salt: str = ""
    priority: Annotated[int, wire_int(router_pb2.GenerateRequest, "priority")] = 0
    # Tokens per streamed chunk (the first and last chunks at once); raises the engines'
    # --stream-interval, never lowers it.
    stream_interval: Annotated[int, wire_int(_SP, "stream_interval", ge=1)] | None = None
    # vLLM's: logprobs of every prompt token (the k most likely alternatives beside it), in
    # the response (completions: each choice; chat: the response). Not with streaming (as in
    # vLLM; 0 is accepted there and returns nothing).
    prompt_logprobs: Annotated[int, wire_int(_SP, "prompt_logprobs")] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* names. At most one constraint per request; the router compiles it (a spec that
    # does not compile is a 400 naming the problem).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: keep only the last N prompt tokens (-1: the context limit less one), applied
    # where the router tokenizes; usage counts the tokens kept.
    truncate_prompt_tokens: Annotated[int, wire_int(_GR, "truncate_prompt_tokens", ge=-1)] | \
        None = None
    # vLLM's: words the output never contains (the router tokenizes them, the engines mask).
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None
    # vLLM's: only these tokens may be sampled.
    allowed_token_ids: list[Annotated[int, wire_int(_SP, "allowed_token_ids", ge=0)]] | None \
        = None
    # OpenAI's: requests with the same key go to the same instances (routing affinity).
    prompt_cache_key: str | None = None
    # vLLM's: logprobs name tokens `token_id:<id>` (gateway/token_id_logprobs.py).
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the request's id when no X-Request-Id header names one (gateway/request_id.py).
    request_id: str | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation_keeps_something(cls, keep: int | None) -> int | None:
        if keep == 0:
            raise ValueError("must be >= 1 or -1 (the context limit), got 0")
        return keep

    @field_validator("bad_words")
    @classmethod
    def _bad_words_are_words(cls, words: list[str] | None) -> list[str] | None:
        for word in words or ():
            if not word.strip():
                raise ValueError(f"entries must tokenize to at least one token, got {word!r}")
        return words

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_token_ids(cls, allowed: list[int] | None) -> list[int] | None:
        if allowed is not None:
            check_allowed_token_ids(allowed)  # sent as written; the engines normalize it
        return allowed

    @field_validator("request_id")
    @classmethod
    def _request_id_is_an_id(cls, request_id: str | None) -> str | None:
        return None if request_id is None else check_request_id(request_id)

    @field_validator("prompt_cache_key")
    @classmethod
    def _prompt_cache_key_bounded(cls, key: str | None) -> str | None:
        return None if key is None else check_prompt_cache_key(key)

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            try:
                token_id = int(key)
            except ValueError:
                raise ValueError(
                    f"keys must be token ids (integers as strings), got {key!r}") from None
            codec.check_int(_SP, "logit_bias.key", token_id, f"the token id {key!r}")
        return bias

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, k: int | None, info: ValidationInfo) -> int | None:
        if k is not None and (k > 0 or k == -1) and info.data.get("stream"):
            raise ValueError("`prompt_logprobs` are not available when `stream=True`")
        return k

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_structured_output(self) -> SamplingFields:
        if len(self._structured_candidates()) > 1:
            raise ValueError("set at most one structured output constraint (response_format, "
                             "structured_outputs or one guided_* field)")
        return self

    def has_structured_output(self) -> bool:
        return bool(self._structured_candidates())

    def _structured_candidates(self) -> list[common_pb2.StructuredOutput]:
        """Every constraint the body sets, as wire messages (validated: at most one)."""
        found: list[common_pb2.StructuredOutput] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(common_pb2.StructuredOutput(json_object=True))
        elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            found.append(common_pb2.StructuredOutput(
                json_schema=_schema_text(rf.json_schema.schema_)))
        so = self.structured_outputs
        kinds = [] if so is None else [
            ("json_schema", None if so.json_ is None else _schema_text(so.json_)),
            ("json_object", so.json_object or None),
            ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar),
        ]
        kinds += [
            ("json_schema", None if self.guided_json is None else _schema_text(self.guided_json)),
            ("regex", self.guided_regex), ("choice", self.guided_choice),
            ("grammar", self.guided_grammar),
        ]
        for kind, value in kinds:
            if value is None:
                continue
            if kind == "choice":
                found.append(common_pb2.StructuredOutput(
                    choice=common_pb2.StructuredOutput.Choice(choices=value)))
            else:
                found.append(common_pb2.StructuredOutput(**{kind: value}))
        return found

    def _sampling(
        self, max_tokens: int | None, logprobs: int | None,
        structured_output: common_pb2.StructuredOutput | None = None,
        prompt_logprobs: int | None = None,
    ) -> common_pb2.SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        proto = common_pb2.SamplingParams(
            n=self.n,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias,
            stop=stops,
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            bad_words=self.bad_words or [],
            allowed_token_ids=self.allowed_token_ids or [],
        )
        for name in ("temperature", "top_p", "repetition_penalty", "seed",
                     "skip_special_tokens", "stream_interval"):
            value = getattr(self, name)
            if value is not None:
                setattr(proto, name, value)
        if max_tokens is not None:
            proto.max_tokens = max_tokens
        if logprobs is not None:
            proto.logprobs = logprobs
        if prompt_logprobs is not None:
            proto.prompt_logprobs = prompt_logprobs
        for constraint in self._structured_candidates():
            proto.structured_output.CopyFrom(constraint)
        if structured_output is not None:  # tool calling's (never together with the above)
            proto.structured_output.CopyFrom(structured_output)
        return proto

    def _prompt_options(self, request: router_pb2.GenerateRequest) -> router_pb2.GenerateRequest:
        """`request` with the body's prompt-side options (truncation, routing affinity)."""
        if self.truncate_prompt_tokens is not None:
            request.truncate_prompt_tokens = self.truncate_prompt_tokens
        if self.prompt_cache_key:
            request.prompt_cache_key = self.prompt_cache_key
        return request

    @property
    def returned_prompt_logprobs(self) -> int | None:
        """k of the `prompt_logprobs` answer; None: no answer (a stream, which accepts only 0,
        returns none, as in vLLM)."""
        return None if self.stream else self.prompt_logprobs

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM: only together with include_usage)."""
        return self.include_usage_in_stream and bool(
            self.stream_options and self.stream_options.continuous_usage_stats)


# -- responses -------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    def add(self, usage: common_pb2.Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.total_tokens = self.prompt_tokens + self.completion_tokens
        self.prompt_tokens_details.cached_tokens += usage.cached_prompt_tokens


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's logprob at one prompt position, in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]
"""vLLM's `prompt_logprobs`: per prompt token, its own and the k most likely tokens' logprobs
by token id; the first token's entry is null (it has no context)."""
