"""HTTP generation requests → router calls: a `GenerationPlan` per request, the `Generate`
calls to make and the formatter that answers them.

One call per prompt (completions accept several; choice index = prompt index × n + sequence
index, as OpenAI numbers them), each under the client's X-Request-Id (suffixed `-<prompt
index>` when there are several), so the id names the request in every service's logs and
traces. Chat messages go as a `Chat` prompt (the router applies the template); tool calling
adds the tools and, for `required` or a named function, a structured output (gateway/tools.py).
What the answer needs of the prompts besides (the echoed text, its first token) is asked of the
router here, before any call starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdmesh.engine.request_rules import truncate_prompt
from pdmesh.engine.sampling_params import MAX_LOGPROBS
from pdmesh.gateway.answer_settings import AS_ASKED, AnswerSettings
from pdmesh.gateway.chat_formatter import ChatFormatter
from pdmesh.gateway.chat_schemas import ChatCompletionRequest
from pdmesh.gateway.completion_formatter import CompletionFormatter
from pdmesh.gateway.completion_schemas import CompletionRequest
from pdmesh.gateway.errors import GatewayError
from pdmesh.gateway.formatter import Formatter
from pdmesh.gateway.logprobs_limit import check_max_logprobs
from pdmesh.gateway.reply import NO_REASONING, ReasoningSettings, plan_reply
from pdmesh.gateway.responses_formatter import ResponsesFormatter
from pdmesh.gateway.responses_schemas import ResponsesRequest
from pdmesh.gateway.router_client import RouterClient
from pdmesh.gateway.token_id_logprobs import TokenIdLogprobs
from pdmesh.gateway.tools import ToolPlan, ToolSettings, plan_tools
from pdmesh.v1 import router_pb2


@dataclass
class GenerationPlan:
    """One generation request, translated."""

    id: str  # the response's id
    model: str  # as requested ("": the served one)
    n: int
    stream: bool
    include_usage: bool  # stream_options.include_usage
    continuous_usage: bool  # ... and continuous_usage_stats
    requests: list[router_pb2.GenerateRequest]  # one per prompt
    formatter: Formatter


async def completion_plan(
    client: RouterClient, body: CompletionRequest, request_id: str,
    answers: AnswerSettings = AS_ASKED,
) -> GenerationPlan:
    prompts = body.prompts()
    requests = [body.to_generate(p, request_id if len(prompts) == 1 else f"{request_id}-{i}")
                for i, p in enumerate(prompts)]
    formatter = CompletionFormatter(
        n=body.n, prompts=len(prompts), want_logprobs=body.logprobs is not None,
        prompt_logprobs=body.returned_prompt_logprobs,
        echo=await _echo_texts(client, body) if body.echo else None,
        echo_first_tokens=await _first_tokens(client, body) if body.echo_logprobs else None,
        echo_k=body.logprobs,
    )
    return GenerationPlan(
        id=f"cmpl-{request_id}", model=body.model, n=body.n, stream=body.stream,
        include_usage=answers.include_usage(body.include_usage_in_stream),
        continuous_usage=body.continuous_usage, requests=requests,
        formatter=_by_token_id(answers.tokens_as_ids(body.return_tokens_as_token_ids),
                               formatter),
    )


def chat_plan(
    body: ChatCompletionRequest, request_id: str, tool_settings: ToolSettings,
    answers: AnswerSettings = AS_ASKED, reasoning: ReasoningSettings = NO_REASONING,
) -> GenerationPlan:
    tools = plan_tools(body, tool_settings)
    request = (body.to_generate(request_id) if tools is None else
               body.to_generate(request_id, tools.tools_json, tools.structured_output))
    reply = plan_reply(body, tools, reasoning, request)
    return GenerationPlan(
        id=f"chatcmpl-{request_id}", model=body.model, n=body.n, stream=body.stream,
        include_usage=answers.include_usage(body.include_usage_in_stream),
        continuous_usage=body.continuous_usage, requests=[request],
        formatter=_by_token_id(answers.tokens_as_ids(body.return_tokens_as_token_ids),
                               ChatFormatter(
            n=body.n, want_logprobs=body.logprobs, prompt_logprobs=body.returned_prompt_logprobs,
            reply=reply)),
    )


def _by_token_id(asked: bool, formatter: Formatter) -> Formatter:
    """`formatter`, naming logprob tokens by id when asked (`return_tokens_as_token_ids`)."""
    return TokenIdLogprobs(formatter) if asked else formatter


def responses_plan(
    body: ResponsesRequest, request_id: str, tool_settings: ToolSettings,
    max_logprobs: int = MAX_LOGPROBS, reasoning: ReasoningSettings = NO_REASONING,
) -> GenerationPlan:
    """A /v1/responses request as the chat completion it amounts to (its messages as a `Chat`
    prompt, its function tools planned as chat's are, its `include`d output logprobs as chat's
    `logprobs`), answered by the responses formatter; a stream always ends with the usage
    (response.completed carries it)."""
    chat = body.to_chat()
    check_max_logprobs(chat, max_logprobs)
    tools = _responses_tools(chat, tool_settings)
    request = (chat.to_generate(request_id) if tools is None else
               chat.to_generate(request_id, tools.tools_json, tools.structured_output))
    reply = plan_reply(chat, tools, reasoning, request)
    return GenerationPlan(
        id=f"resp_{request_id}", model=body.model, n=1, stream=body.stream,
        include_usage=True, continuous_usage=False, requests=[request],
        formatter=ResponsesFormatter(request=body, request_id=request_id, reply=reply),
    )


def _responses_tools(chat: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan | None:
    """Chat's tool plan for the chat a responses request amounts to, its one refusal that
    names chat's fields worded with this API's (`text.format`, not `response_format`)."""
    choice = chat.tool_choice
    if chat.tools and choice not in (None, "auto", "none") and chat.has_structured_output():
        what = repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
        raise GatewayError(400, f"tool_choice {what} is enforced with a structured output and "
                           "cannot be combined with text.format or structured_outputs",
                           param="tool_choice")
    return plan_tools(chat, settings)


async def count_prompt_tokens(
    client: RouterClient, requests: list[router_pb2.GenerateRequest]
) -> int:
    """The prompts' tokens, as the router counts them (for usage in every streamed chunk):
    after `truncate_prompt_tokens`, which the router applies to Tokenize as to Generate."""
    total = 0
    for r in requests:
        kind = r.WhichOneof("prompt")
        keep = r.truncate_prompt_tokens if r.HasField("truncate_prompt_tokens") else None
        if kind == "token_ids":
            model_len = None
            if keep == -1:  # the context limit less one: the router knows the limit
                model_len = (await client.tokenize(router_pb2.TokenizeRequest(
                    model=r.model, text=""))).max_model_len or None
            total += len(truncate_prompt(list(r.token_ids.ids), keep, model_len))
            continue
        tokenize = router_pb2.TokenizeRequest(model=r.model, truncate_prompt_tokens=keep)
        if r.HasField("add_special_tokens"):
            tokenize.add_special_tokens = r.add_special_tokens
        if kind == "text":
            tokenize.text = r.text
        else:
            tokenize.chat.CopyFrom(r.chat)
        total += len((await client.tokenize(tokenize)).token_ids)
    return total


async def _echo_texts(client: RouterClient, body: CompletionRequest) -> list[str]:
    """Each prompt's text for `echo` (token-id prompts decoded by the router)."""
    texts = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            texts.append(prompt)
        else:
            texts.append((await client.detokenize(router_pb2.DetokenizeRequest(
                model=body.model, token_ids=prompt))).text)
    return texts


async def _first_tokens(client: RouterClient, body: CompletionRequest) -> list[str]:
    """Each prompt's first token's text, for `echo` with logprobs."""
    firsts = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            prompt = list((await client.tokenize(router_pb2.TokenizeRequest(
                model=body.model, text=prompt))).token_ids)
        out = await client.detokenize(router_pb2.DetokenizeRequest(
            model=body.model, token_ids=prompt[:1]))
        firsts.append(out.text)
    return firsts
