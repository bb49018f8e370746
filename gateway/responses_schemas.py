"""/v1/responses' bodies, in the subset vLLM serves without a response store: the request
(`input` as text or message items, `instructions`, `text.format`, sampling) and the response
object with its output message and usage.

A request is served as the chat completion it amounts to (`to_chat`): `instructions` is a
system message before the input's messages, `text.format` is chat's `response_format`, and
vLLM's sampling extensions pass through under the same names, so templates, structured
outputs and every sampling check are chat's. Nothing is stored (vLLM's default, without
VLLM_ENABLE_RESPONSES_API_STORE): `store` is accepted and has no effect, as in vLLM;
`previous_response_id` and `background`, which need a store, are 400s naming the field.
Fields vLLM serves beyond this subset (tools, reasoning, `include` logprobs) are ignored and
named in X-Ignored-Fields, or refused where ignoring them would change the answer (`tools`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdmesh.gateway.chat_schemas import ChatCompletionRequest
from pdmesh.gateway.errors import GatewayError, invalid_argument
from pdmesh.gateway.schemas import RequestModel, StructuredOutputsIn, UsageInfo, wire_int
from pdmesh.v1 import common_pb2, router_pb2

_SP = common_pb2.SamplingParams

PASSED_TO_CHAT = frozenset({
    "model", "temperature", "top_p", "stream", "user", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
    "logit_bias", "skip_special_tokens", "include_stop_str_in_output", "cache_salt",
    "priority", "structured_outputs", "chat_template_kwargs", "prompt_cache_key",
})
"""The request's fields that mean the same on chat completions, passed on as they are."""


class InputTextPart(RequestModel):
    """A message's text; `output_text` is an earlier answer's, sent back as history."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(RequestModel):
    """One conversation item: a message (other item kinds, tool calls and their outputs,
    reasoning, are not served)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart]
    id: str | None = None  # an earlier output item sent back: its id and status mean nothing
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TextFormat(RequestModel):
    """`text.format`: plain text, any JSON object, or JSON following `schema` (flat, unlike
    chat's `response_format.json_schema`)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str = ""
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return self

    def to_response_format(self) -> dict[str, Any] | None:
        """Chat's `response_format` for this format (None: plain text, no constraint)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {
            "name": self.name, "description": self.description, "schema": self.schema_,
            "strict": self.strict}}


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestModel):
    model: str = ""
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: Annotated[int, wire_int(_SP, "max_tokens", ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = True  # accepted; nothing is stored (vLLM without a store)
    previous_response_id: str | None = None
    background: bool = False
    tools: list[Any] = Field(default_factory=list)
    # vLLM's extensions, as on chat completions.
    top_k: Annotated[int, wire_int(_SP, "top_k")] = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: Annotated[int, wire_int(_SP, "seed")] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, wire_int(_SP, "stop_token_ids")]] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    cache_salt: str = ""
    priority: Annotated[int, wire_int(router_pb2.GenerateRequest, "priority")] = 0
    structured_outputs: StructuredOutputsIn | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # checked as chat checks it
    prompt_cache_key: str | None = None  # OpenAI's; routing affinity, as on chat

    @field_validator("input", mode="before")
    @classmethod
    def _only_text_messages(cls, value: Any) -> Any:
        """Name what is not served (other item kinds, images, files) rather than let the
        union's every branch fail on it."""
        if value == []:
            raise ValueError("must hold at least 1 message")
        for i, item in enumerate(value if isinstance(value, list) else []):
            if not isinstance(item, dict):
                continue
            kind = item.get("type", "message")
            if kind != "message":
                raise ValueError(f"input[{i}]: items of type {kind!r} are not supported "
                                 "(only messages)")
            parts = item.get("content")
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in (None, "input_text", "output_text"):
                    raise ValueError(f"input[{i}].content[{j}]: parts of type {kind!r} are "
                                     "not supported (only input_text and output_text)")
        return value

    @field_validator("previous_response_id")
    @classmethod
    def _no_stored_responses(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("not supported: pdmesh stores no responses (send the "
                             "conversation in `input` instead)")
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported: background mode needs a response store, and "
                             "pdmesh stores no responses")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools_yet(cls, value: list[Any]) -> list[Any]:
        if value:
            raise ValueError("not supported on /v1/responses yet (tool calling is served on "
                             "/v1/chat/completions)")
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, value: StructuredOutputsIn | None,
                        info: ValidationInfo) -> StructuredOutputsIn | None:
        text = info.data.get("text")
        if value is not None and text is not None and text.format is not None \
                and text.format.type != "text":
            raise ValueError("cannot be set together with text.format")
        return value

    def chat_response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        return fmt.to_response_format() if fmt is not None else None

    def chat_messages(self) -> list[dict[str, str]]:
        """The chat messages: `instructions` as the system message, then the input."""
        messages = [{"role": "system", "content": self.instructions}] \
            if self.instructions else []
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        return [*messages, *({"role": m.role, "content": m.text()} for m in self.input)]

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion this request amounts to."""
        body = self.model_dump(include=PASSED_TO_CHAT, exclude_unset=True, by_alias=True)
        body.update(messages=self.chat_messages(),
                    max_completion_tokens=self.max_output_tokens,
                    response_format=self.chat_response_format())
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:  # the checks chat makes beyond ours
            raise RequestValidationError(exc.errors(include_url=False)) from None


CHAT_TO_RESPONSES = {
    "messages": "input", "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens", "response_format": "text.format",
    "response_format.json_schema": "text.format.schema",
}
"""Chat's body fields → this body's, for a refusal of the chat call a request amounts to."""


def in_responses_terms(error: GatewayError, request: ResponsesRequest) -> GatewayError:
    """A router refusal naming its field as a responses body does (`text.format`, not chat's
    `response_format`); the error handler then leaves it as it is."""
    if error.router_message is None:
        return error
    named = invalid_argument(error.router_message, request.to_chat())
    param = CHAT_TO_RESPONSES.get(named.param or "", named.param)
    message = named.message
    if named.param and param and message.startswith(named.param):
        message = param + message[len(named.param):]
    return replace(error, message=message, param=param, router_message=None)


# -- responses -------------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, usage: UsageInfo) -> ResponseUsage:
        return cls(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                   total_tokens=usage.total_tokens, input_tokens_details=InputTokensDetails(
                       cached_tokens=usage.prompt_tokens_details.cached_tokens))


ResponseStatus = Literal["in_progress", "completed", "incomplete"]


class ResponsesResponse(BaseModel):
    """The response object. Sampling fields echo the request (null: the server's default,
    which the router applies and does not report)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: None = None
    tool_choice: Literal["none"] = "none"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] | None = None
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    service_tier: Literal["auto"] = "auto"
    usage: ResponseUsage | None = None
    user: str | None = None
