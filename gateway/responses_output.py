"""/v1/responses' response object: its output items (a message with its text and logprobs,
function calls), usage and status, shaped as vLLM (and OpenAI) return them. The request side,
and how a request becomes a chat completion, is `responses_schemas.py`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pdmesh.gateway.responses_schemas import FunctionTool, ToolChoice
from pdmesh.gateway.schemas import UsageInfo


class OutputTopLogprob(BaseModel):
    """One of the most likely tokens at an output position."""

    token: str
    logprob: float
    bytes: list[int]  # the token's UTF-8


class OutputLogprob(BaseModel):
    """One output token's logprob and, with `top_logprobs`, the most likely tokens there."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[OutputTopLogprob] = Field(default_factory=list)

    def streamed(self) -> dict[str, Any]:
        """As a delta event carries it: without the bytes (the API's delta logprob shape)."""
        return {"token": self.token, "logprob": self.logprob,
                "top_logprobs": [{"token": t.token, "logprob": t.logprob}
                                 for t in self.top_logprobs]}


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[OutputLogprob] | None = None  # None: not asked for (`include`)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    """A call the model made: `call_id` is what a `function_call_output` answers."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The model's reasoning, split off its answer by the server's --reasoning-parser."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


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
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: None = None
    tool_choice: Literal["none"] = "none"
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none" (vLLM's)
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None  # what was answered with (`include`); None: no logprobs
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    service_tier: Literal["auto"] = "auto"
    usage: ResponseUsage | None = None
    user: str | None = None
