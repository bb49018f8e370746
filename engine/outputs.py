"""What the engine hands back: vLLM-shaped request and completion outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdmesh.kvstore.connector.source import LoadResult


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per token: token id -> Logprob (the chosen token plus the top-N).
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class KVExport:
    """Where an exported request's KV lives on this engine (prefill role)."""

    block_ids: list[int]
    num_tokens: int


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    kv_export: KVExport | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    kv_load: LoadResult | None = None
    """How the engine core placed the prompt's KV it pulled (`EngineRequest.kv_source`);
    set from the output that follows the pull on."""
