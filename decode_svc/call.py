"""One Decode call's working state, shared by the servicer and the remote-KV step: what it
observed (for its span and metrics) and what it hands the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.outputs import TokenLogprobs
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kvstore.connector.source import KVSource
from pdmesh.kvstore.transfer.core_pull import Pull
from pdmesh.tracing import Span
from pdmesh.v1 import engine_pb2

if TYPE_CHECKING:
    import torch

    from pdmesh.decode_svc.streamed import StreamedPrefill


@dataclass
class Observed:
    """What one Decode call did, for its span and metrics (filled as it runs)."""

    span: Span
    received: float = field(default_factory=time.monotonic)
    ttft_s: float | None = None
    queue_s: float | None = None
    streamed_tokens: int = 0
    outcome: str = "error"
    finish_reasons: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    kv_load_fallback: str = ""  # the KV pull failed for this reason; the prompt was recomputed
    last_delta_at: float | None = None  # for the inter-token latency


@dataclass
class Admit:
    """What a Decode call hands the engine: the request, and its given tokens' logprobs;
    with `pull`, a transfer the engine core pulls itself (the request's `kv_source`)."""

    request: EngineRequest
    given_logprobs: list[list[TokenLogprobs | None]] | None = None
    pull: Pull | None = None
    streamed: StreamedPrefill | None = None
    """The prefill still runs: its progress and first tokens come while the call runs."""


def engine_request(request: engine_pb2.DecodeRequest, params: SamplingParams, *,
                    kv: torch.Tensor | None = None, given_tokens: list[list[int]] | None = None,
                    num_cached_tokens: int = 0, kv_source: KVSource | None = None,
                    prefix_source: KVSource | None = None) -> EngineRequest:
    """The engine request of a Decode call, with the KV or the tokens it brings."""
    return EngineRequest(request.request_id, list(request.prompt_token_ids), params,
                         request.priority, request.cache_salt or None, kv=kv,
                         given_tokens=given_tokens, num_cached_tokens=num_cached_tokens,
                         kv_source=kv_source, prefix_source=prefix_source)
