"""`LLMEngine`: the in-process engine — tokenizer, engine core and output processor together.

The offline `LLM` and the tests drive it synchronously (`add_request` or `add`, then `step()`:
`add_request` tokenizes a prompt, `add` takes an `EngineRequest` of token ids). Serving
uses the same two halves apart: the core steps in its own process and the output processor
runs in the service (see `async_engine.py`). Here a stop string found by the processor stops
its sample in the core before the next step, so no token is computed past it.
"""

from __future__ import annotations

from typing import Any

import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.engine_core import EngineCore
from pdmesh.engine.core.request_state import CoreRequest
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.frontend.output_processor import OutputProcessor
from pdmesh.engine.model_store import model_dir_for
from pdmesh.engine.outputs import RequestOutput, TokenLogprobs
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.structured.grammar import grammar_vocabulary
from pdmesh.engine.tokenizing import (
    check_given_logprobs,
    eos_token_ids,
    load_tokenizer,
    tokenize_prompt,
)
from pdmesh.kvstore.connector.config import KVConnectorConfig


class LLMEngine:
    def __init__(self, config: EngineConfig, connector: KVConnectorConfig | None = None
                 ) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.model_dir = model_dir_for(config)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_dir)
        self.core = EngineCore(config, self.eos_token_ids, connector)
        self.processor = OutputProcessor(self.tokenizer, self.eos_token_ids,
                                         config.stream_interval)

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        export_kv: bool = False,
    ) -> CoreRequest:
        """Tokenize a prompt and queue it (`add`). With `export_kv`, it stops after its first
        token with KV pinned."""
        params = params or SamplingParams()
        text, ids = self.tokenize(prompt)
        request = EngineRequest(request_id, ids, params, priority, cache_salt, export_kv)
        return self.add(request, prompt_text=text)

    def add(
        self,
        request: EngineRequest,
        *,
        prompt_text: str | None = None,
        given_logprobs: list[list[TokenLogprobs | None]] | None = None,
    ) -> CoreRequest:
        """Queue a request (`EngineCore.add`). `given_logprobs`: the logprobs of its given
        tokens, if any, for the outputs (the core never sees them)."""
        given, n = request.given_tokens, request.params.n
        if given_logprobs is not None and given is not None and len(given) == n:
            check_given_logprobs(given, given_logprobs, n)
        self._ensure_grammar_vocabulary(request.params)
        state = self.core.add(request)
        stopped = self.processor.add_request(
            request.request_id, prompt_text, request.prompt_token_ids, request.params,
            export_kv=request.export_kv, given=given, given_logprobs=given_logprobs)
        if stopped:
            self.core.stop_sequences(request.request_id, stopped)
        return state

    def _ensure_grammar_vocabulary(self, params: SamplingParams) -> None:
        """The core compiles grammars from our tokenizer's vocabulary: hand it over once, the
        first time a request asks for a grammar."""
        if params.structured_output is not None and not self.core.grammars.has_vocabulary:
            self.core.grammars.set_vocabulary(grammar_vocabulary(
                self.tokenizer, self.core.model_config.vocab_size, self.eos_token_ids))

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; every block it holds is returned."""
        self.processor.abort(request_id)
        return self.core.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def read_kv(self, request_id: str) -> torch.Tensor:
        return self.core.read_kv(request_id)

    def release_kv(self, request_id: str) -> bool:
        return self.core.release_kv(request_id)

    def check_kv_capacity(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        self.core.check_kv_capacity(num_prompt_tokens, params)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.core.validate(prompt_token_ids, params)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, stops = self.processor.process(self.core.step())
        for request_id, indices in stops:
            self.core.stop_sequences(request_id, indices)
        return outputs

    # -- introspection (the core's figures) ----------------------------------------------------
    @property
    def requests(self) -> dict[str, CoreRequest]:
        return self.core.requests

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def kv_manager(self) -> Any:
        return self.core.kv_manager

    @property
    def runner(self) -> Any:
        return self.core.runner

    @property
    def sampler(self) -> Any:
        return self.core.sampler

    @property
    def scheme(self) -> Any:
        return self.core.scheme

    @property
    def model_config(self) -> Any:
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def capacity_summary(self) -> str:
        return self.core.capacity_summary

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def num_free_blocks(self) -> int:
        return self.core.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.core.num_total_blocks

    def take_kv_events(self) -> list:
        return self.core.take_kv_events()
