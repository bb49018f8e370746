"""OpenAI wire formats: request bodies in, response bodies out (pydantic models).

Requests are strict (`extra="forbid"`): like OpenAI's own API, an unknown or unsupported
parameter is a 400 naming it rather than being silently ignored. Each request model turns
itself into the router's `SamplingParams` message (`to_sampling`), keeping unset fields unset
so the router applies its documented defaults. vLLM's extensions (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, skip_special_tokens, ...) sit beside OpenAI's.
Value ranges are checked once, by the engine's own validation in the router, whose
INVALID_ARGUMENT becomes a 400 here; this module only checks what the router cannot see
(shapes, OpenAI-only combinations).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdmesh.v1 import common_pb2, router_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) default for /v1/completions; chat defaults to the context limit."""

MAX_N = 128
"""Choices per prompt; a guard against one request fanning out without bound."""

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""vLLM's range for `seed` (a signed 64-bit integer, the proto's int64)."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`: the schema sits under the key `schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = ""
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class StructuredOutputsIn(StrictModel):
    """vLLM's `structured_outputs` extension: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class SamplingFields(StrictModel):
    """Parameters shared by completions and chat completions."""

    model: str = ""
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    cache_salt: str = ""
    priority: int = 0
    # Tokens per streamed chunk (the first and last chunks at once); raises the engines'
    # --stream-interval, never lowers it.
    stream_interval: int | None = Field(default=None, ge=1, le=2**31)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* names. At most one constraint per request; the router compiles it (a spec that
    # does not compile is a 400 naming the problem).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids (integers as strings), got {key!r}")
        return bias

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
        for constraint in self._structured_candidates():
            proto.structured_output.CopyFrom(constraint)
        if structured_output is not None:  # tool calling's (never together with the above)
            proto.structured_output.CopyFrom(structured_output)
        return proto

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM: only together with include_usage)."""
        return self.include_usage_in_stream and bool(
            self.stream_options and self.stream_options.continuous_usage_stats)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(default=COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    # Completions: the number of alternatives per token (0 = the sampled token only).
    logprobs: int | None = Field(default=None, ge=0)
    # The prompt's text before each choice's output.
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: Prompt) -> Prompt:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        if isinstance(prompt, list) and any(isinstance(p, list) and not p for p in prompt):
            raise ValueError("prompt must not contain an empty token list")
        return prompt

    @property
    def echo_logprobs(self) -> bool:
        """echo with logprobs: the prompt's tokens and logprobs come first (vLLM)."""
        return self.echo and self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as separate items: one string, or one token-id list, each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_generate(self, prompt: str | list[int], request_id: str) -> router_pb2.GenerateRequest:
        request = router_pb2.GenerateRequest(
            request_id=request_id,
            model=self.model,
            sampling=self._sampling(self.max_tokens, self.logprobs),
            cache_salt=self.cache_salt,
            priority=self.priority,
            stream=self.stream,
        )
        if self.echo_logprobs:
            request.sampling.prompt_logprobs = self.logprobs or 0
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return request


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(StrictModel):
    """An assistant message's earlier tool call (conversation history)."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(StrictModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers

    @model_validator(mode="after")
    def _tool_calls_from_the_assistant(self) -> ChatMessageIn:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls are only allowed on assistant messages")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def to_proto(self) -> router_pb2.ChatMessage:
        return router_pb2.ChatMessage(
            role=self.role, content=self.text(), name=self.name or "",
            tool_call_id=self.tool_call_id or "",
            tool_calls=[router_pb2.ToolCall(id=c.id, name=c.function.name,
                                             arguments=c.function.arguments)
                        for c in self.tool_calls or []],
        )


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None = no parameters
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    # Tool calling (gateway/tools.py reads these against the server's flags).
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def to_generate(
        self, request_id: str, tools_json: str = "",
        structured_output: common_pb2.StructuredOutput | None = None,
    ) -> router_pb2.GenerateRequest:
        """The router call; `tools_json` and `structured_output` come from the request's
        ToolPlan (gateway/tools.py)."""
        # max_completion_tokens is OpenAI's newer name; it wins when both are given.
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        chat = router_pb2.Chat(
            messages=[m.to_proto() for m in self.messages],
            add_generation_prompt=self.add_generation_prompt,
            tools_json=tools_json,
        )
        return router_pb2.GenerateRequest(
            request_id=request_id,
            model=self.model,
            chat=chat,
            sampling=self._sampling(max_tokens, logprobs, structured_output),
            cache_salt=self.cache_salt,
            priority=self.priority,
            stream=self.stream,
        )


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: a completion-style `prompt` or a chat-style `messages` list."""

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True  # prompt only; a chat template places its own
    add_generation_prompt: bool = True  # messages only
    tools: list[ChatTool] | None = None  # messages only: rendered by the chat template
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self

    def to_proto(self) -> router_pb2.TokenizeRequest:
        if self.prompt is not None:
            return router_pb2.TokenizeRequest(model=self.model, text=self.prompt,
                                              add_special_tokens=self.add_special_tokens)
        tools = json.dumps([t.model_dump(exclude_none=True) for t in self.tools or []])
        chat = router_pb2.Chat(
            messages=[m.to_proto() for m in self.messages or []],
            add_generation_prompt=self.add_generation_prompt,
            tools_json=tools if self.tools else "",
        )
        return router_pb2.TokenizeRequest(model=self.model, chat=chat)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str = ""
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


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


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per generated token (with
    echo, per prompt token first; the first prompt token's entries are null)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # ToolCallDelta.to_openai()


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdmesh"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


_UNION_BRANCHES = frozenset({"str", "int", "float", "bool", "dict"})
_UNION_BRANCH_PREFIXES = ("function-", "list[", "dict[", "literal[", "json-or-python[")


def validation_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """The OpenAI `param` for a pydantic error location, e.g. ('body', 'messages', 0) ->
    'messages[0]'."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_BRANCHES or part.startswith(_UNION_BRANCH_PREFIXES):
            continue  # a union branch name, not a field (a field may start with "str")
        else:
            out += f".{part}" if out else part
    return out or None
