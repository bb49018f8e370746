"""The offline API, vLLM-style: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from pdmesh.engine.chat_template import apply_chat_template
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.frontend.llm_engine import LLMEngine
from pdmesh.engine.generation_config import default_sampling_params, load_generation_defaults
from pdmesh.engine.outputs import RequestOutput
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.gc_heap import frozen_heap

PromptType = str | dict[str, Any]


class LLM:
    """Batch generation on one engine.

    Keyword arguments are `EngineConfig` fields (model, block_size, max_num_seqs,
    max_num_batched_tokens, max_model_len, kv_cache_memory, enable_prefix_caching,
    generation_config, tensor_parallel_size, ...). Calls that pass no SamplingParams sample
    with the model's generation config (`get_default_sampling_params`), as vLLM's `LLM` does.
    With `tensor_parallel_size=N` the engine starts N-1 rank processes
    (engine/core/ranks.py); `llm.engine.core.close()` stops them (at the latest they are
    killed when this process exits).
    """

    def __init__(self, model: str = "smollm2", **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments: {', '.join(unknown)}")
        config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(config)
        self.generation_defaults = load_generation_defaults(
            config.generation_config, self.engine.model_dir, config.override_generation_config)
        self._ids = itertools.count()
        print(f"pdmesh: {self.engine.capacity_summary}", file=sys.stderr)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the model's generation config (vLLM's precedence: what a call
        passes replaces these entirely; these replace the plain SamplingParams defaults)."""
        return default_sampling_params(self.generation_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompts)} prompts"
                )
        # Validate everything before queueing anything, so a bad prompt leaves nothing behind.
        tokenized = [self.engine.tokenize(p) for p in prompts]
        for (_, ids), params in zip(tokenized, params_list, strict=True):
            self.engine.validate(ids, params)
        order: dict[str, int] = {}
        for i, ((text, ids), params) in enumerate(zip(tokenized, params_list, strict=True)):
            request_id = f"llm-{next(self._ids)}"
            order[request_id] = i
            prompt = {"prompt_token_ids": ids, "prompt": text}
            self.engine.add_request(
                request_id, prompt, params, priority=priority[i] if priority else 0
            )
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them; `tools`
        (OpenAI function tools) go to the template, as in vLLM's `LLM.chat`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conv in conversations:
            ids = apply_chat_template(self.engine.tokenizer, conv, add_generation_prompt, tools)
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool | None) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not show)
        results: list[RequestOutput | None] = [None] * len(order)
        try:
            with frozen_heap():  # no GC scans of the model, torch and the rest meanwhile
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished and out.request_id in order:
                            results[order[out.request_id]] = out
                            bar.update(1)
        except BaseException:
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        missing = [rid for rid, i in order.items() if results[i] is None]
        if missing:
            raise RuntimeError(f"requests did not finish: {missing}")
        return [r for r in results if r is not None]
