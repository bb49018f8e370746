"""/v1/chat/completions' bodies: the request (messages, tools, tool_choice) and the response,
whole and streamed."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from pdmesh.engine.chat_template import check_template_kwargs
from pdmesh.gateway.schemas import (
    PromptLogprobs,
    RequestModel,
    SamplingFields,
    UsageInfo,
    wire_int,
)
from pdmesh.v1 import common_pb2, router_pb2

_SP = common_pb2.SamplingParams


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(RequestModel):
    """An assistant message's earlier tool call (conversation history)."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(RequestModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers
    # Assistant messages: an earlier answer's reasoning sent back (vLLM's `reasoning`, and
    # its older name `reasoning_content`).
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _tool_calls_from_the_assistant(self) -> ChatMessageIn:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls are only allowed on assistant messages")
        if (self.reasoning or self.reasoning_content) and self.role != "assistant":
            raise ValueError("reasoning is only allowed on assistant messages")
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
            reasoning=self.reasoning or self.reasoning_content or "",
            tool_calls=[router_pb2.ToolCall(id=c.id, name=c.function.name,
                                             arguments=c.function.arguments)
                        for c in self.tool_calls or []],
        )


class FunctionDefinition(RequestModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None = no parameters
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_tokens: Annotated[int, wire_int(_SP, "max_tokens", ge=1)] | None = None
    max_completion_tokens: Annotated[int, wire_int(_SP, "max_tokens", ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, wire_int(_SP, "logprobs", ge=0)] | None = None
    add_generation_prompt: bool = True
    # Tool calling (gateway/tools.py reads these against the server's flags).
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: extra variables for the chat template (e.g. {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: with --reasoning-parser, false leaves the reasoning out of the answer.
    include_reasoning: bool = True
    # OpenAI's; as in vLLM, the template's `reasoning_effort` variable (unless
    # chat_template_kwargs sets it), for templates that read it.
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: the tokenizer's special tokens (BOS) on top of what the template places; off, as
    # there, since most templates place their own.
    add_special_tokens: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_allowed(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if kwargs is None else check_template_kwargs(kwargs)

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
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        chat = router_pb2.Chat(
            messages=[m.to_proto() for m in self.messages],
            add_generation_prompt=self.add_generation_prompt,
            tools_json=tools_json,
            chat_template_kwargs_json=json.dumps(kwargs) if kwargs else "",
        )
        return self._prompt_options(router_pb2.GenerateRequest(
            request_id=request_id,
            model=self.model,
            chat=chat,
            sampling=self._sampling(max_tokens, logprobs, structured_output,
                                    self.returned_prompt_logprobs),
            cache_salt=self.cache_salt,
            priority=self.priority,
            stream=self.stream,
            add_special_tokens=self.add_special_tokens,
        ))


# -- responses -------------------------------------------------------------------------------------
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
    reasoning: str | None = None  # vLLM's field, with --reasoning-parser
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
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
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
