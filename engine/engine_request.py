"""The one request type the engine core takes, and whether this engine can take it.

Every way into the core is an `EngineRequest`, whatever the request brings with it:

- a prompt alone: prefilled here, then decoded; with `export_kv` (the prefill role) it stops
  after its first token with the prompt's KV pinned for a decode instance;
- `kv`, the prompt's KV computed elsewhere (the decode role): written into fresh blocks, with
  each sample's first token in `given_tokens`;
- `given_tokens` alone, output tokens produced elsewhere whose KV is not here (decode
  migration, a KV pull that failed): each sample prefills prompt + its tokens here;
- `prefix_source`, a prompt computed here whose leading blocks a peer lends: pulled first,
  then only the rest is computed.

Given tokens are *output*: max_tokens, min_tokens, penalties, stop checks and grammars count
them, and a seeded sample's generator skips one draw per given token, so the continuation is
what an uninterrupted run samples. They are not reported back: the caller has them.

The checks read fixed figures only (vocabulary size, max_model_len, the pool's size), so any
thread may run them, and a service can refuse a request before spending anything on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdmesh.engine.core_types import CoreInfo
from pdmesh.engine.request_rules import kv_capacity_shortfall
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kvstore.connector.source import KVSource

if TYPE_CHECKING:
    import torch  # the type of imported KV only: serving processes never load torch for it


class KVCacheFullError(RuntimeError):
    """The request needs more KV blocks than this engine holds in all: it can never run here
    (the services answer RESOURCE_EXHAUSTED). Raised before anything is allocated.

    Blocks that are merely taken *right now* never raise: the sequences that find no room
    (an imported prompt, a fork's copy-on-write block) wait in the scheduler like preempted
    ones and recompute their KV once blocks free up.
    """


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    export_kv: bool = False
    """Prefill role: stop after the first token, the prompt's KV pinned until released."""
    stream_kv: bool = False
    """With `export_kv`: lend the blocks while the prompt is computed, each as soon as it is
    full (the core reports them in `CoreOutput.kv_stream`), so a decode instance pulls a
    chunk's blocks while the next chunk computes."""
    kv: torch.Tensor | None = None
    """Decode role: the prompt's KV, `[layers, 2, ceil(len/bs), bs, kv_heads, head_dim]`."""
    given_tokens: list[list[int]] | None = None
    """Per sample, its output tokens produced elsewhere (possibly none); with `kv`, exactly
    its first token."""
    num_cached_tokens: int = 0
    """With `kv` or `kv_source`: prompt tokens the prefill found in its prefix cache
    (reported as they are)."""
    kv_source: KVSource | None = None
    """Decode role: where this core pulls the prompt's KV from itself (its KV connector:
    only the blocks its own prefix cache lacks). A pull that fails recomputes the prompt."""
    prefix_source: KVSource | None = None
    """A prompt computed here whose leading blocks a peer lends (cluster-wide prefix
    caching): the blocks this core's prefix cache lacks among them are pulled first, then
    the rest of the prompt is computed as usual. A pull that fails computes it all."""

    @property
    def imports_kv(self) -> bool:
        return self.kv is not None or self.kv_source is not None

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens computed here before the first output (imported KV: none)."""
        if self.imports_kv:
            return 0
        return len(self.prompt_token_ids) + sum(map(len, self.given_tokens or ()))


def check_prompt(prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int,
                 max_model_len: int) -> None:
    """ValueError for a prompt (and token ids in its parameters) this model cannot take."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt: the prompt is empty")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside [0, {vocab_size})")
    if n >= max_model_len:
        raise ValueError(f"prompt: {n} tokens leave no room to generate within "
                         f"max_model_len={max_model_len}")
    params.verify_vocab(vocab_size)  # the router's check too (router/admission.py)


def check_request(request: EngineRequest, vocab_size: int, max_model_len: int) -> None:
    """ValueError for a request no engine with these figures could run as sent."""
    check_prompt(request.prompt_token_ids, request.params, vocab_size, max_model_len)
    imported, given = request.imports_kv, request.given_tokens
    if request.kv is not None and request.kv_source is not None:
        raise ValueError("kv_source: a request brings its KV or where to pull it, not both")
    if request.export_kv and (imported or given is not None):
        raise ValueError("export_kv: a request that brings KV or given tokens is not exported")
    if request.prefix_source is not None:
        source = request.prefix_source
        if imported:
            raise ValueError("prefix_source: a request that brings its KV needs no prefix")
        if source.streamed:
            raise ValueError("prefix_source: a lent prefix is whole, not streamed")
        if not 0 < source.num_tokens < len(request.prompt_token_ids):
            raise ValueError(f"prefix_source: covers {source.num_tokens} tokens of a "
                             f"{len(request.prompt_token_ids)}-token prompt")
        if request.params.prompt_logprobs is not None:
            raise ValueError("prefix_source: prompt logprobs need every prompt position "
                             "computed here")
    if request.stream_kv and not request.export_kv:
        raise ValueError("stream_kv: only an exported request streams its KV")
    streamed = request.kv_source is not None and request.kv_source.streamed
    if imported and given is None and not streamed:  # (a stream's come when it ends)
        raise ValueError("given_tokens: an imported request gives each sample's first token")
    if request.num_cached_tokens and not imported:
        raise ValueError("num_cached_tokens: only a request that imports its KV reports them")
    if given is not None:
        check_given_tokens(len(request.prompt_token_ids), given, request.params, vocab_size,
                           max_model_len, first_only=imported)


def check_given_tokens(num_prompt_tokens: int, given: list[list[int]], params: SamplingParams,
                       vocab_size: int, max_model_len: int, *, first_only: bool) -> None:
    """One list per sample, each within the vocabulary, max_tokens and max_model_len (a list
    an uninterrupted run would have stopped earlier is refused while it replays)."""
    if len(given) != params.n:
        raise ValueError(f"given_tokens: expected one list per sample (n={params.n}), "
                         f"got {len(given)}")
    for i, tokens in enumerate(given):
        if first_only and len(tokens) != 1:
            raise ValueError(f"given_tokens: sample {i}: an imported request gives its first "
                             f"token only, got {len(tokens)}")
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"given_tokens: sample {i}: token id {bad[0]} is outside "
                             f"[0, {vocab_size})")
        if params.max_tokens is not None and len(tokens) > params.max_tokens:
            raise ValueError(f"given_tokens: sample {i} has {len(tokens)} tokens, more than "
                             f"max_tokens={params.max_tokens}")
        if num_prompt_tokens + len(tokens) > max_model_len:
            raise ValueError(f"given_tokens: sample {i} runs past max_model_len={max_model_len}")


def check_kv_capacity(info: CoreInfo, num_prompt_tokens: int, params: SamplingParams) -> None:
    """KVCacheFullError for a request whose `n` samples, each run to `max_tokens`, could never
    be held at once (prompt blocks shared) by an engine with these fixed figures."""
    room = max(1, info.max_model_len - num_prompt_tokens)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    shortfall = kv_capacity_shortfall(num_prompt_tokens, max_tokens, params.n,
                                      block_size=info.block_size,
                                      total_blocks=info.num_total_blocks)
    if shortfall is not None:
        unset = " (max_tokens unset: the rest of the context)" if params.max_tokens is None else ""
        raise KVCacheFullError(shortfall + unset)
