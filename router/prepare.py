"""A Generate request made ready to route: the router's one codec of a request's parameters.

Everything a request says is checked here, once, as it enters the mesh, and trusted after (the
engines re-check only what they must to protect themselves): the model name, the sampling
(server defaults applied: request > the model's generation config > API defaults, then
validated; `bad_words` tokenized into the token sequences the engines ban), the structured
output (compiled, within its budget), the prompt (tokenized, checked against the context
limit, `max_tokens` resolved), the prompt cache key, and whether the cluster's KV cache can
ever hold it. The result is a `PreparedRequest` with its deadline; refusals are
`InvalidRequest` (INVALID_ARGUMENT naming the field), `ExceedsKVCapacity` or `RouteError`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from pdmesh.engine.generation_config import GenerationDefaults, apply_to_proto
from pdmesh.engine.request_rules import RuleViolation, check_prompt_cache_key
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.router.admission import (
    InvalidRequest,
    check_kv_capacity,
    sampling_from_proto,
    validate_prompt,
)
from pdmesh.router.config import RouterConfig
from pdmesh.router.failures import RouteError
from pdmesh.router.grammar_check import GrammarCheck
from pdmesh.router.instances import InstancePool
from pdmesh.router.prompt_tokenizer import PromptTokenizer
from pdmesh.router.request import PreparedRequest
from pdmesh.v1 import router_pb2

UNSTREAMED_STREAM_INTERVAL = 64
"""The engines' stream interval for a request the client takes whole (stream=false): there
its deltas only keep the router's resume state (what a migration continues from), so one per
64 tokens saves the engine and the router nearly every per-token message while a migration
recomputes at most 64 tokens (vLLM hands such requests only their final output)."""


def check_model(model: str, names: tuple[str, ...]) -> None:
    """RouteError (NOT_FOUND) for a model name this router does not serve; "" is any."""
    if model and model not in names:
        raise RouteError(
            grpc.StatusCode.NOT_FOUND,
            f"model {model!r} is not served here; served: "
            + ", ".join(repr(name) for name in names),
        )


@dataclass
class RequestPreparer:
    config: RouterConfig
    defaults: GenerationDefaults  # the sampling a request leaves unset
    tokenizer: PromptTokenizer
    grammars: GrammarCheck
    pool: InstancePool

    async def prepare(self, request: router_pb2.GenerateRequest, request_id: str,
                      received: float, time_remaining: float | None
                      ) -> tuple[PreparedRequest, SamplingParams]:
        """The request ready to route, and its sampling as validated; `time_remaining`: the
        call's own deadline, if it has one (else --request-timeout-s)."""
        check_model(request.model, self.config.model_names)
        if not request.HasField("sampling"):
            # Unset would mean every default, max_tokens included: up to the context limit,
            # far more than a client that forgot the message expects.
            raise InvalidRequest(
                "sampling", "required; send an empty SamplingParams to take every default"
            )
        sampling = apply_to_proto(request.sampling, self.defaults)  # request > server default
        params = sampling_from_proto(sampling)
        if params.bad_words:  # tokenized here, once: the engines get token sequences
            for ids in await self.tokenizer.bad_words_token_ids(params.bad_words):
                sampling.bad_words_token_ids.add(token_ids=ids)
            params = sampling_from_proto(sampling)  # checks the count after tokenization
        prompt_cache_key = _prompt_cache_key(request.prompt_cache_key)
        await self.grammars.check(params.structured_output)  # compiles, within its budget
        max_model_len = self.pool.max_model_len()
        ids = await self.tokenizer.encode(request, max_model_len)  # refuses provably too long
        tokenize_ms = (time.monotonic() - received) * 1000
        if max_model_len is None:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "no live instance serves the model")
        max_tokens = validate_prompt(
            ids, params, vocab_size=self.tokenizer.vocab_size, max_model_len=max_model_len
        )
        sampling.max_tokens = max_tokens  # engines get the budget admission counted, not "unset"
        if not request.stream:
            sampling.stream_interval = max(sampling.stream_interval, UNSTREAMED_STREAM_INTERVAL)
        kv_capacity = self.pool.kv_capacity_tokens()
        if kv_capacity is not None and self.pool.block_size:
            check_kv_capacity(len(ids), max_tokens, params.n,
                              block_size=self.pool.block_size, capacity_tokens=kv_capacity)
        timeout_s = self.config.request_timeout_s if time_remaining is None else time_remaining
        prepared = PreparedRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling=sampling,
            n=params.n,
            max_tokens=max_tokens,
            cache_salt=request.cache_salt,
            priority=request.priority,
            stream=request.stream,
            prompt_cache_key=prompt_cache_key,
            received_at=received,
            deadline=received + timeout_s,
            tokenize_ms=tokenize_ms,
        )
        return prepared, params


def _prompt_cache_key(key: str) -> str:
    try:
        return check_prompt_cache_key(key)
    except RuleViolation as exc:
        raise InvalidRequest(exc.field, str(exc)) from None
