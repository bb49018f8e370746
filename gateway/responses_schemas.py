"""/v1/responses' request, in the subset vLLM serves without a response store: `input` as
text or items (messages, function calls and their outputs), `instructions`, `text.format`,
function `tools` and `tool_choice`, sampling. The response object is `responses_output.py`.

A request is served as the chat completion it amounts to (`to_chat`): `instructions` is a
system message before the input's messages, a `function_call` item is an assistant message's
tool call (merged into the assistant message before it, as vLLM does), a
`function_call_output` item is a `tool` message, the flat function tools are chat's nested
ones, `text.format` is chat's `response_format`, and vLLM's sampling extensions pass through
under the same names, so templates, tool calling (gateway/tools.py), structured outputs and
every sampling check are chat's. `include: ["message.output_text.logprobs"]` with
`top_logprobs` is chat's `logprobs: true, top_logprobs: N` (so N is checked as chat's is),
answered in the output text part's `logprobs`; the other `include` values vLLM lists are
accepted and have no effect here, as in vLLM without its built-in tools. Nothing is stored
(vLLM's default, without VLLM_ENABLE_RESPONSES_API_STORE): `store` is accepted and has no
effect, as in vLLM; `previous_response_id` and `background`, which need a store, are 400s
naming the field. `reasoning.effort` is chat's `reasoning_effort` (the template's variable).
Fields vLLM serves beyond this subset are ignored and named in X-Ignored-Fields, or refused
where ignoring them would change the answer (tools other than functions, other input item
kinds).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdmesh.gateway.chat_schemas import ChatCompletionRequest, FunctionDefinition, ReasoningEffort
from pdmesh.gateway.errors import GatewayError, invalid_argument, validation_param
from pdmesh.gateway.schemas import RequestModel, StructuredOutputsIn, wire_int
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
    """One conversation message (an earlier answer's message item sent back included)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart]
    id: str | None = None  # an earlier output item sent back: its id and status mean nothing
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallInput(RequestModel):
    """An earlier answer's function call, sent back so the conversation can go on after it."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the answer gave it
    id: str | None = None
    status: str | None = None

    def to_chat(self) -> dict[str, Any]:
        """Chat's `tool_calls[]` entry for this call."""
        return {"id": self.call_id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class FunctionCallOutputInput(RequestModel):
    """A function call's result: the `tool` message answering `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningTextPart(RequestModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningInput(RequestModel):
    """An earlier answer's reasoning item sent back (an agent's loop passes a response's whole
    `output` on): the reasoning of the assistant turn it opens. Its summary is not read."""

    type: Literal["reasoning"]
    content: list[ReasoningTextPart] | None = None
    summary: list[Any] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


InputItem = InputMessage | FunctionCallInput | FunctionCallOutputInput | ReasoningInput

INPUT_ITEMS: dict[str, type[RequestModel]] = {
    "message": InputMessage, "function_call": FunctionCallInput,
    "function_call_output": FunctionCallOutputInput, "reasoning": ReasoningInput,
}
"""The input items served, by `type` (a message may leave it out)."""

TEXT_PARTS = (None, "input_text", "output_text")

OUTPUT_LOGPROBS = "message.output_text.logprobs"
"""The `include` value that asks for the output text's logprobs."""

Include = Literal[
    "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "file_search_call.results", "message.input_image.image_url", "message.output_text.logprobs",
    "reasoning.encrypted_content",
]
"""The `include` values vLLM accepts (any other is a 400, as there); only OUTPUT_LOGPROBS
changes an answer pdmesh gives (the others name outputs of tools or inputs it does not serve)."""


class FunctionTool(FunctionDefinition):
    """A function the model may call, in the Responses API's flat shape (chat nests the same
    fields under `function`); the name is checked as chat checks it."""

    type: Literal["function"]

    def to_chat(self) -> dict[str, Any]:
        return {"type": "function",
                "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(RequestModel):
    """`tool_choice` naming the function to call (flat; chat nests the name)."""

    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


def _validated(model: type[RequestModel], data: Any, *where: str | int) -> RequestModel:
    """`data` as `model`, or a ValueError naming the field inside `where` ("input[2].call_id:
    Field required") rather than a union's branch names."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        ctx = first.get("ctx") or {}
        why = str(ctx["error"]) if first["type"] == "value_error" and "error" in ctx \
            else first["msg"]
        raise ValueError(f"{validation_param((*where, *first['loc']))}: {why}") from None


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


class ReasoningConfig(RequestModel):
    """`reasoning`: its effort reaches the template; a summary is not made (none is asked of
    the model), as in vLLM."""

    effort: ReasoningEffort | None = None
    summary: str | None = None


class ResponsesRequest(RequestModel):
    model: str = ""
    input: str | list[InputItem]
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
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none" (vLLM's)
    parallel_tool_calls: bool | None = True
    include: list[Include] | None = None
    # Alternatives per output token with OUTPUT_LOGPROBS (null: 0, as vLLM reads it); checked
    # as chat's `top_logprobs` only then, since vLLM ignores it otherwise.
    top_logprobs: int | None = None
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
    reasoning: ReasoningConfig | None = None
    prompt_cache_key: str | None = None  # OpenAI's; routing affinity, as on chat

    @field_validator("input", mode="before")
    @classmethod
    def _served_items(cls, value: Any) -> Any:
        """Each item as its kind's model, naming what is not served (other item kinds, images,
        files) rather than letting the union's every branch fail on it."""
        if value == []:
            raise ValueError("must hold at least 1 message")
        if not isinstance(value, list):
            return value
        items = []
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                items.append(item)
                continue
            kind = item.get("type", "message")
            if kind not in INPUT_ITEMS:
                raise ValueError(f"input[{i}]: items of type {kind!r} are not supported (only "
                                 f"{', '.join(INPUT_ITEMS)})")
            key = "output" if kind == "function_call_output" else "content"
            allowed = ("reasoning_text",) if kind == "reasoning" else TEXT_PARTS
            parts = item.get(key)
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                part_kind = part.get("type") if isinstance(part, dict) else None
                if part_kind not in allowed:
                    names = " and ".join(p for p in allowed if p)
                    raise ValueError(f"input[{i}].{key}[{j}]: parts of type {part_kind!r} are "
                                     f"not supported (only {names})")
            items.append(_validated(INPUT_ITEMS[kind], item, "input", i))
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        """Only function tools: built-in ones (web search, file search, MCP, ...) need a tool
        server, which pdmesh does not run."""
        for i, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind is not None and kind != "function":
                raise ValueError(f"tools[{i}]: tools of type {kind!r} are not supported (only "
                                 "function tools)")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _served_tool_choice(cls, value: Any) -> Any:
        """One of the three modes or a named function, each refusal in this API's words."""
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ValueError(f"must be 'none', 'auto', 'required' or a function, got {value!r}")
        if isinstance(value, dict):
            if value.get("type") != "function":
                raise ValueError(f"tool_choice of type {value.get('type')!r} is not supported "
                                 "(only {'type': 'function', 'name': ...})")
            return _validated(FunctionChoice, value, "tool_choice")
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

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, value: StructuredOutputsIn | None,
                        info: ValidationInfo) -> StructuredOutputsIn | None:
        text = info.data.get("text")
        if value is not None and text is not None and text.format is not None \
                and text.format.type != "text":
            raise ValueError("cannot be set together with text.format")
        return value

    def output_logprobs(self) -> int | None:
        """How many alternatives per output token to answer with (0: the token's own logprob
        only); None when the output's logprobs are not asked for (`include`)."""
        if self.include is None or OUTPUT_LOGPROBS not in self.include:
            return None
        return self.top_logprobs or 0

    def chat_logprobs(self) -> dict[str, Any]:
        """Chat's `logprobs` and `top_logprobs` for this request's `include`."""
        k = self.output_logprobs()
        return {} if k is None else {"logprobs": True, "top_logprobs": k}

    def chat_reasoning(self) -> dict[str, Any]:
        """Chat's `reasoning_effort` for this request's `reasoning.effort`."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        return {} if effort is None else {"reasoning_effort": effort}

    def chat_response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        return fmt.to_response_format() if fmt is not None else None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The chat messages: `instructions` as the system message, then the input's items.
        As vLLM builds them: a function call joins the assistant message just before it (one
        turn that said something and called), else it is an assistant message of its own; an
        assistant message after a turn of calls only is that turn's text."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] \
            if self.instructions else []
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
            if isinstance(item, FunctionCallInput):
                if last is not None:
                    last.setdefault("tool_calls", []).append(item.to_chat())
                else:
                    messages.append({"role": "assistant", "content": None,
                                     "tool_calls": [item.to_chat()]})
            elif isinstance(item, ReasoningInput):  # opens the assistant turn it belongs to
                messages.append({"role": "assistant", "content": None,
                                 "reasoning": item.text()})
            elif isinstance(item, FunctionCallOutputInput):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": item.text()})
            elif item.role == "assistant" and last is not None and last["content"] is None:
                last["content"] = item.text()
            else:
                messages.append({"role": item.role, "content": item.text()})
        return messages

    def effective_tool_choice(self) -> str | FunctionChoice:
        """`tool_choice` as vLLM reads it: unset is "auto" with tools, and without tools
        "auto" is "none" (what the response echoes)."""
        choice = self.tool_choice or "auto"
        return "none" if not self.tools and choice == "auto" else choice

    def chat_tools(self) -> dict[str, Any]:
        """Chat's `tools`, `tool_choice` and `parallel_tool_calls` for this request's."""
        choice = self.effective_tool_choice()
        if not self.tools:  # "required" or a function without tools: chat refuses it
            return {} if choice == "none" else {"tool_choice": _chat_choice(choice)}
        return {"tools": [tool.to_chat() for tool in self.tools],
                "tool_choice": _chat_choice(choice),
                "parallel_tool_calls": self.parallel_tool_calls is not False}

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion this request amounts to."""
        body = self.model_dump(include=PASSED_TO_CHAT, exclude_unset=True, by_alias=True)
        body.update(messages=self.chat_messages(),
                    max_completion_tokens=self.max_output_tokens,
                    response_format=self.chat_response_format(), **self.chat_tools(),
                    **self.chat_logprobs(), **self.chat_reasoning())
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:  # the checks chat makes beyond ours
            raise RequestValidationError(exc.errors(include_url=False)) from None


def _chat_choice(choice: str | FunctionChoice) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


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
