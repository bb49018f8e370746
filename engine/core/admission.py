"""Placing a checked `EngineRequest`'s samples in the scheduler, whatever it brings.

One path for every request (engine/engine_request.py), in two moves:

1. *make the samples*: a prompt alone becomes one parent sequence that forks into `n` after its
   first token (`fork_into`), or exports then; imported KV is written into fresh blocks of
   a running parent, whose forks are made at once (no room for the prompt right now: the
   parent waits like a preempted sequence and recomputes it); given tokens alone make one
   waiting sequence per sample, each to prefill prompt + its tokens (prefix-cache hits make
   the shared prompt cheap);
2. *replay the given tokens*: a seeded sample's generator skips one draw per token (sampler
   `skip_one_draw`), then each token is committed as if sampled here: its grammar accepts it
   (or the request is refused), stop checks see it, and it counts as output. A sample they
   end is finished at once and never continued.

A prompt whose KV a peer or the prefill instance holds (a lent prefix, an import, a streamed
import) is pulled first (engine/core/kv_loads.py, `KVLoads`); an import is placed here once its
pull lands (`land_loads`), or recomputes the prompt when the pull fails.
"""

from __future__ import annotations

import logging
import time

import torch

from pdmesh.engine.core.kv_loads import KVLoads, Loading
from pdmesh.engine.core.output_commit import OutputCommit
from pdmesh.engine.core.request_state import CoreRequest, SampleMaker
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import Scheduler
from pdmesh.engine.scheduling.sequence import Sequence, SequenceStatus
from pdmesh.engine.worker.models.architecture import ModelConfig
from pdmesh.engine.worker.sampler import skip_one_draw
from pdmesh.kvstore.connector.connector import KVConnector

logger = logging.getLogger(__name__)


def check_kv_import(request: EngineRequest, mc: ModelConfig, kv_manager: KVCacheManager,
                    block_size: int, connector: KVConnector | None) -> None:
    """ValueError for imported KV this core cannot take: a tensor `kv` not shaped like the
    prompt's blocks of this model, a `kv_source` without a connector or not covering the
    prompt (the source's own checks are the connector's)."""
    if request.kv is not None:
        nb = kv_manager.num_blocks_for(len(request.prompt_token_ids))
        expected = (mc.num_layers, 2, nb, block_size, mc.num_kv_heads, mc.head_dim)
        if tuple(request.kv.shape) != expected:
            raise ValueError(f"kv: shape {tuple(request.kv.shape)} does not match {expected}")
    if request.prefix_source is not None:
        if connector is None:
            raise ValueError("prefix_source: this engine has no KV connector")
        connector.check_source(request.prefix_source)
        if request.prefix_source.num_tokens % block_size:
            raise ValueError("prefix_source: a lent prefix covers whole blocks only")
    if request.kv_source is not None:
        if connector is None:
            raise ValueError("kv_source: this engine has no KV connector")
        connector.check_source(request.kv_source)
        if request.kv_source.num_tokens != len(request.prompt_token_ids):
            raise ValueError(f"kv_source: covers {request.kv_source.num_tokens} tokens, "
                             f"the prompt has {len(request.prompt_token_ids)}")


class Admission:
    def __init__(self, scheduler: Scheduler, kv_manager: KVCacheManager, kv_cache: torch.Tensor,
                 samples: SampleMaker, commit: OutputCommit, vocab_size: int,
                 connector: KVConnector | None = None) -> None:
        self.scheduler = scheduler
        self.loads = KVLoads(scheduler, kv_manager, connector, vocab_size)
        self.kv_manager = kv_manager
        self.kv_cache = kv_cache
        self.samples = samples
        self.commit = commit
        self.vocab_size = vocab_size

    def place(self, state: CoreRequest, request: EngineRequest) -> None:
        """Make `state`'s samples and queue them. On an error the caller aborts the request,
        which frees whatever it holds by then. A prompt whose KV a connector thread now pulls
        gets its samples when the pull lands (`land_loads`)."""
        given = request.given_tokens
        if request.kv is not None or request.kv_source is not None:
            if self._import(state, request):
                return
        elif given is not None:
            for i in range(request.params.n):
                seq = self._new(request, i)
                state.seqs.append(seq)
                self.scheduler.add(seq)
            if any(given):
                state.first_token_time = time.monotonic()
        else:
            seq = self._prompt_parent(state, request)
            if request.prefix_source is None or not self.loads.start_prefix_pull(state, seq,
                                                                                 request):
                self.scheduler.add(seq)
            return
        for seq, tokens in zip(list(state.seqs), given or [], strict=True):
            self._replay(seq, tokens)

    def _new(self, request: EngineRequest, index: int) -> Sequence:
        ids = request.prompt_token_ids
        return self.samples.new(request.request_id, index, list(ids), len(ids), request.params,
                                request.priority, request.cache_salt)

    def _prompt_parent(self, state: CoreRequest, request: EngineRequest) -> Sequence:
        """A fresh prompt's one parent (to queue); with `export_kv` it stops after its first
        token."""
        params = request.params
        seq = self._new(request, 0)
        seq.fork_into = params.n
        seq.export_kv = request.export_kv
        seq.want_prompt_logprobs = params.prompt_logprobs is not None
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        state.seqs.append(seq)
        return seq

    def _import(self, state: CoreRequest, request: EngineRequest) -> bool:
        """The prompt's KV computed elsewhere: a running parent holding it, and its forks.

        A `kv_source` is pulled by this core's connector on its own threads, only the blocks
        after this core's prefix-cache hits (True: the parent waits in `loading` until the
        pull lands). A tensor `kv` (a staged transport) is copied in whole now. No room right
        now, or a pull that fails: the parent waits like a preempted sequence and recomputes
        the prompt here, instead of failing a request that fits the pool.
        """
        parent = self._new(request, 0)
        parent.num_cached_tokens = request.num_cached_tokens
        parent.scheduled_once = True  # the prefill instance computed (and counted) the prompt
        state.first_token_time = state.first_scheduled_time = time.monotonic()
        state.seqs.append(parent)
        num_prompt = len(request.prompt_token_ids)
        if request.kv_source is not None:
            if self.loads.start_pull(state, parent, request):
                return True
            loaded = False
        elif self.kv_manager.allocate_slots(parent, num_prompt):
            assert request.kv is not None
            block_ids = torch.tensor(self.kv_manager.block_ids(parent.seq_id),
                                     device=self.kv_cache.device)
            self.kv_cache.index_copy_(2, block_ids, request.kv.to(self.kv_cache.device,
                                                                   self.kv_cache.dtype))
            loaded = True
        else:
            loaded = False
        self._place_parent(state, request, parent, loaded)
        return False

    def _place_parent(self, state: CoreRequest, request: EngineRequest, parent: Sequence,
                      loaded: bool) -> None:
        if loaded:
            parent.num_computed_tokens = len(request.prompt_token_ids)
            self.scheduler.add_running(parent)
        else:
            logger.debug("request_id=%s: imported KV not placed; it recomputes",
                         request.request_id)
            self.scheduler.add(parent)
        for i in range(1, request.params.n):
            state.seqs.append(self.samples.fork_or_queue(parent, i))

    def land_loads(self) -> list[str]:
        """Place the requests whose pull finished (between two steps): on success the parent
        runs with the pulled blocks, now cached; on failure the prompt is recomputed
        (`KVLoads.landed`). The ids of the requests placed (they owe an output)."""
        placed = []
        for landed in self.loads.landed():
            self._place_and_replay(landed.loading, landed.loaded)
            placed.append(landed.loading.request.request_id)
        return placed

    def _place_and_replay(self, loading: Loading, loaded: bool) -> None:
        request = loading.request
        self._place_parent(loading.state, request, loading.parent, loaded)
        try:
            for seq, tokens in zip(list(loading.state.seqs), request.given_tokens or [],
                                   strict=True):
                self._replay(seq, tokens)
        except ValueError as exc:  # cannot happen for the prefill's own first tokens
            logger.warning("request_id=%s: its given tokens were refused after its KV "
                           "landed: %s", request.request_id, exc)
            for seq in loading.state.seqs:
                if not seq.status.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def _replay(self, seq: Sequence, given: list[int]) -> None:
        """Commit tokens produced elsewhere as this sample's output (not reported back)."""
        if seq.generator is not None and not seq.params.is_greedy:
            for _ in given:
                skip_one_draw(seq.generator, self.vocab_size)
        for j, token_id in enumerate(given):
            if seq.status.is_finished:
                raise ValueError(f"given_tokens: sample {seq.index} goes on after it stopped "
                                 f"at position {j - 1}")
            self.commit.append_token(seq, int(token_id), None, replay=True)
        seq.num_emitted = seq.num_output_tokens

