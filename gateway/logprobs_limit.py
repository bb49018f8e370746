"""`--max-logprobs` (vLLM's flag): a request asking for more logprobs than the server allows is
a 400 naming the field, answered by the gateway before the router or any engine sees it."""

from __future__ import annotations

from pdmesh.gateway.chat_schemas import ChatCompletionRequest
from pdmesh.gateway.completion_schemas import CompletionRequest
from pdmesh.gateway.errors import GatewayError


def check_max_logprobs(body: CompletionRequest | ChatCompletionRequest, limit: int) -> None:
    """Raise a 400 when a logprobs count of `body` exceeds `limit` (vLLM's message)."""
    sample = (body.logprobs if isinstance(body, CompletionRequest)
              else body.top_logprobs if body.logprobs else None)
    sample_field = "logprobs" if isinstance(body, CompletionRequest) else "top_logprobs"
    for name, kind, asked in ((sample_field, "sample", sample),
                              ("prompt_logprobs", "prompt", body.prompt_logprobs)):
        if asked is not None and asked > limit:
            raise GatewayError(400, f"Requested {kind} logprobs of {asked}, which is greater "
                                    f"than max allowed: {limit} (--max-logprobs)", param=name)
