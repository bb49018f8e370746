"""The engine loop: admit requests, schedule a step, run the model, sample, detokenize, emit.

One `LLMEngine` owns one model, one paged KV cache and one scheduler. It is synchronous and
single-threaded on purpose; the gRPC services drive `step()` from a worker thread. Requests can
also leave after prefill with their KV pinned (`export_kv`, the prefill role) or start from KV
written in from outside (`add_imported_request`, the decode role).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import psutil
import torch

from pdmesh.engine.block_hash import HashScheme
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.detokenizer import IncrementalDetokenizer
from pdmesh.engine.kv_cache_manager import KVCacheManager, request_kv_blocks
from pdmesh.engine.kv_events import KVEvent
from pdmesh.engine.memory import lazy_zeros
from pdmesh.engine.model_loader import load_model
from pdmesh.engine.model_runner import ModelRunner
from pdmesh.engine.model_store import resolve_model
from pdmesh.engine.outputs import (
    CompletionOutput,
    KVExport,
    Logprob,
    RequestOutput,
    TokenLogprobs,
)
from pdmesh.engine.sampler import (
    SampledToken,
    Sampler,
    SamplingMetadata,
    compute_prompt_logprobs,
    make_generator,
    skip_one_draw,
)
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduler import Scheduler, SchedulerConfig
from pdmesh.engine.sequence import Sequence, SequenceStatus
from pdmesh.engine.stopping import check_stop
from pdmesh.engine.structured_output import GrammarCompiler, apply_bitmasks
from pdmesh.kernels.backend import get_attention_backend

logger = logging.getLogger(__name__)


class KVCacheFullError(RuntimeError):
    """The request needs more KV blocks than this engine holds in all: it can never run here
    (the services answer RESOURCE_EXHAUSTED). Raised before anything is allocated.

    Blocks that are merely taken *right now* never raise: the sequences that find no room
    (an imported prompt, a fork's copy-on-write block) wait in the scheduler like preempted
    ones and recompute their KV once blocks free up.
    """


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    export_kv: bool = False
    kv_export: KVExport | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs) and len(self.seqs) == self.params.n


def _child_seed(seed: int | None, index: int) -> int | None:
    if seed is None or index == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.model_dir = resolve_model(config.model)
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        torch.manual_seed(config.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        max_positions = self._max_positions()
        self.model, self.model_config, self.hf_config = load_model(
            self.model_dir, self.dtype, self.device, max_positions
        )
        self.scheme = HashScheme(
            block_size=config.block_size,
            algorithm=config.hash_algorithm,
            root_seed=config.hash_root_seed,
        )
        num_blocks = self._num_kv_blocks()
        mc = self.model_config
        self.kv_cache = lazy_zeros(  # host pages committed as blocks are first used
            (mc.num_layers, 2, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        capacity = num_blocks * config.block_size
        self.max_model_len = self._resolve_max_model_len(max_positions, capacity)
        self.capacity_summary = (
            f"KV cache: {num_blocks} blocks x {config.block_size} tokens = {capacity} tokens "
            f"({self.kv_cache.numel() * self.kv_cache.element_size() / 2**20:.1f} MiB, "
            f"{self.dtype}, {self.device}); max_model_len={self.max_model_len}"
        )
        logger.info(self.capacity_summary)
        self.kv_manager = KVCacheManager(num_blocks, self.scheme, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                policy=config.scheduling_policy,
            ),
            self.kv_manager,
            self.max_model_len,
        )
        self.scheduler.on_preempt = self._on_preempt
        backend = get_attention_backend(config.attention_backend, self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv_manager, backend, self.device)
        self.sampler = Sampler(seed=config.seed, device=self.device)
        self.eos_token_ids = self._eos_token_ids()
        self.requests: dict[str, RequestState] = {}
        self._pending_outputs: set[str] = set()  # changed outside step() (imported requests)
        self._grammar_compiler: GrammarCompiler | None = None  # built on first structured output
        self.num_steps = 0

    # -- start-up helpers -------------------------------------------------------------------
    def _max_positions(self) -> int:
        from pdmesh.engine.model_loader import load_hf_config

        hf = load_hf_config(self.model_dir)
        limit = int(getattr(hf, "max_position_embeddings", 2048))
        if self.config.max_model_len is not None and self.config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.config.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}"
            )
        return limit

    def _num_kv_blocks(self) -> int:
        mc, bs = self.model_config, self.config.block_size
        bytes_per_block = (
            mc.num_layers * 2 * bs * mc.num_kv_heads * mc.head_dim * self.dtype.itemsize
        )
        if self.device.type == "cuda":
            available, total = torch.cuda.mem_get_info(self.device)
        else:
            available = total = psutil.virtual_memory().available
        budget = self.config.kv_budget(available, total, cuda=self.device.type == "cuda")
        if budget > available:
            raise ValueError(
                f"kv_cache_memory: {budget / 2**30:.2f} GiB requested but only "
                f"{available / 2**30:.2f} GiB is available"
            )
        num_blocks = budget // bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes holds fewer than 2 blocks "
                f"({bytes_per_block} bytes each)"
            )
        return int(num_blocks)

    def _resolve_max_model_len(self, max_positions: int, capacity: int) -> int:
        wanted = self.config.max_model_len
        if wanted is not None and wanted > capacity:
            raise ValueError(
                f"max_model_len={wanted} does not fit in the KV cache ({capacity} tokens); "
                "raise kv_cache_memory or lower max_model_len"
            )
        return wanted if wanted is not None else min(max_positions, capacity)

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            import json

            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("prompt: a dict prompt needs 'prompt_token_ids'")
            ids = [int(t) for t in prompt["prompt_token_ids"]]
            return prompt.get("prompt"), ids
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: expected a string or a dict, got {type(prompt).__name__}")
        return prompt, self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"logit_bias: token id {bad[0]} is outside [0, {vocab})")

    def check_kv_capacity(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse a request whose `n` samples, each run to `max_tokens`, could never be held
        at once (prompt blocks shared). Reads only fixed figures, so any thread may call it.
        """
        bs = self.config.block_size
        room = max(1, self.max_model_len - num_prompt_tokens)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        need = request_kv_blocks(num_prompt_tokens, max_tokens, params.n, bs)
        total = self.num_total_blocks
        if need > total:
            unset = " (max_tokens unset: the rest of the context)" if (
                params.max_tokens is None) else ""
            raise KVCacheFullError(
                f"request needs {need} KV blocks of {bs} tokens for n={params.n} x "
                f"(prompt {num_prompt_tokens} + max_tokens {max_tokens}{unset}), prompt blocks "
                f"shared, but this instance holds {total} blocks in all; lower n or max_tokens"
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        export_kv: bool = False,
    ) -> RequestState:
        """Queue a request. With `export_kv`, it stops after its first token with KV pinned."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        params = params or SamplingParams()
        text, ids = self.tokenize(prompt)
        self.validate(ids, params)
        if not export_kv:  # an export only ever holds its prompt, which validate() bounds
            self.check_kv_capacity(len(ids), params)
        seq = self._new_seq(request_id, 0, list(ids), len(ids), params, priority, cache_salt)
        seq.fork_into = params.n
        seq.export_kv = export_kv
        seq.want_prompt_logprobs = params.prompt_logprobs is not None
        state = RequestState(request_id, text, list(ids), params, [seq], export_kv=export_kv)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.requests[request_id] = state
        self.scheduler.add(seq)
        return state

    def _new_seq(
        self,
        request_id: str,
        index: int,
        token_ids: list[int],
        num_prompt: int,
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
    ) -> Sequence:
        seq = Sequence(
            seq_id=f"{request_id}#{index}",
            request_id=request_id,
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=num_prompt,
            params=params,
            priority=priority,
            cache_salt=cache_salt,
            generator=make_generator(_child_seed(params.seed, index), self.device),
        )
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids[:num_prompt], params)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.structured_output is not None:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
                )
            seq.grammar = self._grammar_compiler.matcher(params.structured_output)
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; every block it holds is returned."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        seqs = list(state.seqs)  # and any sample scheduled but not recorded in it yet
        scheduled = (*self.scheduler.running, *self.scheduler.waiting)
        seqs += [s for s in scheduled if s.request_id == request_id and s not in seqs]
        for seq in seqs:
            if not seq.status.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                if seq.detokenizer is not None and not seq.detokenizer.finished:
                    seq.detokenizer.finish()
            elif seq.status is SequenceStatus.FINISHED_EXPORTED:
                self.kv_manager.free(seq.seq_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- KV export / import (the two roles of the mesh) ---------------------------------------
    def read_kv(self, request_id: str) -> torch.Tensor:
        """KV of an exported request: `[layers, 2, n_blocks, block_size, kv_heads, head_dim]`."""
        state = self.requests.get(request_id)
        if state is None or state.kv_export is None:
            raise KeyError(f"request {request_id!r} has no exported KV")
        ids = torch.tensor(state.kv_export.block_ids, device=self.device)
        return self.kv_cache.index_select(2, ids)

    def release_kv(self, request_id: str) -> bool:
        """Free an exported request's pinned blocks (they stay in the prefix cache)."""
        state = self.requests.get(request_id)
        if state is None or state.kv_export is None:
            return False
        self.requests.pop(request_id)
        self.kv_manager.free(state.seqs[0].seq_id)
        return True

    def add_imported_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_ids: list[int],
        kv: torch.Tensor,
        params: SamplingParams,
        *,
        first_logprobs: list[TokenLogprobs | None] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        num_cached_tokens: int = 0,
    ) -> RequestState:
        """Continue decoding a request whose prompt KV was computed elsewhere.

        `kv` covers the prompt (`[layers, 2, ceil(len/bs), bs, kv_heads, head_dim]`);
        `first_token_ids` holds the first sampled token of each of the `n` samples.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.validate(prompt_token_ids, params)
        if len(first_token_ids) != params.n:
            raise ValueError(f"first_token_ids: expected {params.n}, got {len(first_token_ids)}")
        mc = self.model_config
        nb = self.kv_manager.num_blocks_for(len(prompt_token_ids))
        expected = (mc.num_layers, 2, nb, self.config.block_size, mc.num_kv_heads, mc.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"kv: shape {tuple(kv.shape)} does not match {expected}")
        self.check_kv_capacity(len(prompt_token_ids), params)
        ids = list(prompt_token_ids)
        parent = self._new_seq(request_id, 0, list(ids), len(ids), params, priority, cache_salt)
        parent.num_cached_tokens = num_cached_tokens
        parent.scheduled_once = True  # the prefill instance computed (and counted) the prompt
        state = RequestState(request_id, None, ids, params, [parent])
        state.first_token_time = time.monotonic()
        self.requests[request_id] = state
        try:  # from here on, any failure frees whatever the request holds
            if self.kv_manager.allocate_slots(parent, len(ids)):
                block_ids = torch.tensor(
                    self.kv_manager.block_ids(parent.seq_id), device=self.device
                )
                self.kv_cache.index_copy_(2, block_ids, kv.to(device=self.device, dtype=self.dtype))
                parent.num_computed_tokens = len(ids)
                self.scheduler.add_running(parent)
            else:
                # No room right now: wait like a preempted sequence and recompute the prompt
                # here once blocks free up, instead of failing a request that fits the pool.
                logger.debug("request_id=%s: no room for %d imported blocks; it waits",
                             request_id, nb)
                self.scheduler.add(parent)
            for i in range(1, params.n):
                state.seqs.append(self._fork_or_queue(parent, i))
            if not params.is_greedy:
                for seq in state.seqs:
                    if seq.generator is not None:
                        skip_one_draw(seq.generator, mc.vocab_size)
            for i, seq in enumerate(list(state.seqs)):
                lp = first_logprobs[i] if first_logprobs else None
                self._append_token(seq, first_token_ids[i], lp, replay=True)
        except BaseException:
            self.abort_request(request_id)
            raise
        self._pending_outputs.add(request_id)
        return state

    def add_resumed_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[list[int]],
        params: SamplingParams,
        *,
        output_logprobs: list[list[TokenLogprobs | None]] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestState:
        """Continue a request whose first output tokens were produced elsewhere, without its KV.

        Used when a prefill's KV cannot be pulled (the decode instance recomputes) and when a
        decode stream moves to another instance. `output_token_ids[i]` holds sample i's tokens
        so far (one list per sample, possibly empty). Each sample restarts from prompt + its
        tokens and prefills both here (prefix-cache hits make the shared prompt cheap). The
        given tokens are *output*: max_tokens, min_tokens, penalties and stop checks count
        them, and a seeded sample's generator skips one draw per given token, so the
        continuation is exactly what an uninterrupted run samples. Prompt logprobs are not
        recomputed (the caller already has them). Raises ValueError for bad input and
        KVCacheFullError for a request that can never fit, before anything is allocated.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        ids = list(prompt_token_ids)
        self.validate(ids, params)
        self._validate_resumed(ids, output_token_ids, params, output_logprobs)
        self.check_kv_capacity(len(ids), params)
        state = RequestState(request_id, None, ids, params, [])
        self.requests[request_id] = state
        try:  # from here on, any failure frees whatever the request holds
            for i, given in enumerate(output_token_ids):
                seq = self._new_seq(request_id, i, list(ids), len(ids), params, priority,
                                    cache_salt)
                state.seqs.append(seq)
                if seq.generator is not None and not params.is_greedy:
                    for _ in given:
                        skip_one_draw(seq.generator, self.model_config.vocab_size)
                for j, token_id in enumerate(given):
                    if seq.status.is_finished:
                        raise ValueError(
                            f"output_token_ids: sample {i} goes on after it stopped at "
                            f"position {j - 1}")
                    lp = output_logprobs[i][j] if output_logprobs else None
                    self._append_token(seq, int(token_id), lp, replay=True)
                if not seq.status.is_finished:
                    self.scheduler.add(seq)
            if any(output_token_ids):
                state.first_token_time = time.monotonic()
        except BaseException:
            self.abort_request(request_id)
            raise
        self._pending_outputs.add(request_id)
        return state

    def _validate_resumed(
        self,
        prompt_token_ids: list[int],
        output_token_ids: list[list[int]],
        params: SamplingParams,
        output_logprobs: list[list[TokenLogprobs | None]] | None,
    ) -> None:
        if len(output_token_ids) != params.n:
            raise ValueError(f"output_token_ids: expected one list per sample (n={params.n}), "
                             f"got {len(output_token_ids)}")
        vocab = self.model_config.vocab_size
        for i, given in enumerate(output_token_ids):
            bad = [t for t in given if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"output_token_ids: sample {i}: token id {bad[0]} is outside "
                                 f"[0, {vocab})")
            if params.max_tokens is not None and len(given) > params.max_tokens:
                raise ValueError(f"output_token_ids: sample {i} has {len(given)} tokens, more "
                                 f"than max_tokens={params.max_tokens}")
            if len(prompt_token_ids) + len(given) > self.max_model_len:
                raise ValueError(f"output_token_ids: sample {i} runs past "
                                 f"max_model_len={self.max_model_len}")
            if output_logprobs is not None and len(output_logprobs[i]) != len(given):
                raise ValueError(f"output_logprobs: sample {i} has {len(output_logprobs[i])} "
                                 f"entries for {len(given)} tokens")
        if output_logprobs is not None and len(output_logprobs) != params.n:
            raise ValueError(f"output_logprobs: expected {params.n} lists, "
                             f"got {len(output_logprobs)}")

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {}
        for request_id in self._pending_outputs:
            if request_id in self.requests:
                touched[request_id] = self.requests[request_id]
        self._pending_outputs.clear()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            pinned = any(s.kv_export is not None for s in self.requests.values())
            if self.scheduler.num_unfinished and not self.scheduler.running and not pinned:
                raise RuntimeError("scheduler made no progress: a request cannot fit the KV cache")
            return [self._make_output(state) for state in touched.values()]
        self.num_steps += 1
        inputs = self.runner.prepare(sched.scheduled)
        logits = self.runner.execute(inputs)
        to_sample: list[Sequence] = []
        for entry in inputs.order:
            seq = entry.seq
            state = self.requests[seq.request_id]
            touched[state.request_id] = state
            if seq.seq_id in inputs.prompt_logits:
                first, end = inputs.prompt_logits[seq.seq_id]
                self._record_prompt_logprobs(state, seq, logits[first:end])
            seq.num_computed_tokens += entry.num_new_tokens
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.want_prompt_logprobs = False
            if seq.seq_id in inputs.sample_index:
                to_sample.append(seq)
        if to_sample:
            self._sample(to_sample, logits, inputs.sample_index)
        return [self._make_output(state) for state in touched.values()]

    def _record_prompt_logprobs(
        self, state: RequestState, seq: Sequence, logits: torch.Tensor
    ) -> None:
        start = seq.num_computed_tokens
        end = min(seq.num_prompt_tokens, start + 1 + logits.shape[0])
        targets = seq.token_ids[start + 1 : end]
        rows = compute_prompt_logprobs(
            logits[: len(targets)], targets, seq.params.prompt_logprobs or 0
        )
        assert state.prompt_logprobs is not None
        for target, (lp, rank, top) in zip(targets, rows, strict=True):
            state.prompt_logprobs.append(self._make_logprob_entry(target, lp, rank, top))

    def _make_logprob_entry(
        self, token_id: int, logprob: float, rank: int | None, top: dict[int, float] | None
    ) -> TokenLogprobs:
        ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])
        entry = {tid: Logprob(lp, r, self._piece(tid)) for r, (tid, lp) in enumerate(ranked, 1)}
        entry[token_id] = Logprob(logprob, rank, self._piece(token_id))
        return entry

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _sample(
        self, seqs: list[Sequence], logits: torch.Tensor, sample_index: dict[str, int]
    ) -> None:
        rows: list[int] = []
        owners: list[tuple[Sequence, int]] = []  # (sequence, sample index for forks)
        gens: list[torch.Generator | None] = []
        for seq in seqs:
            fan_out = seq.fork_into if seq.num_output_tokens == 0 else 1
            for i in range(fan_out):
                rows.append(sample_index[seq.seq_id])
                owners.append((seq, i))
                gens.append(
                    seq.generator
                    if i == 0
                    else make_generator(_child_seed(seq.params.seed, i), self.device)
                )
        meta = SamplingMetadata(
            params=[o[0].params for o in owners],
            generators=gens,
            prompt_token_ids=[o[0].prompt_token_ids for o in owners],
            output_token_ids=[o[0].output_token_ids for o in owners],
            eos_token_ids=self.eos_token_ids,
        )
        row_tensor = torch.tensor(rows, device=logits.device)
        row_logits = logits.index_select(0, row_tensor)
        if any(o[0].grammar is not None for o in owners):  # fan-out rows share the parent's
            row_logits = apply_bitmasks(row_logits, [o[0].grammar for o in owners])
        sampled = self.sampler(row_logits, meta)
        by_seq: dict[str, list[tuple[SampledToken, torch.Generator | None]]] = {}
        for (seq, _), tok, gen in zip(owners, sampled, gens, strict=True):
            by_seq.setdefault(seq.seq_id, []).append((tok, gen))
        for seq in seqs:
            results = by_seq[seq.seq_id]
            state = self.requests[seq.request_id]
            if state.first_token_time is None:
                state.first_token_time = time.monotonic()
            if seq.export_kv and seq.num_output_tokens == 0:
                seq.fork_into = 1
                self._export(state, seq, [r[0] for r in results])
            elif len(results) > 1:
                self._fan_out(state, seq, results)
            else:
                tok = results[0][0]
                self._append_token(seq, tok.token_id, self._logprob_entry(seq, tok))

    def _fan_out(
        self,
        state: RequestState,
        parent: Sequence,
        results: list[tuple[SampledToken, torch.Generator | None]],
    ) -> None:
        """The prompt of an n > 1 request is done: one first token per sample, then fork."""
        parent.fork_into = 1
        state.seqs = [parent]
        for i in range(1, len(results)):
            child = self._fork_or_queue(parent, i)
            child.generator = results[i][1]
            state.seqs.append(child)
        for seq, (tok, _) in zip(list(state.seqs), results, strict=True):
            self._append_token(seq, tok.token_id, self._logprob_entry(seq, tok))

    def _fork_or_queue(self, parent: Sequence, index: int) -> Sequence:
        """Sample `index` of the parent's request: a fork sharing the parent's blocks, or, when
        there is no room for it right now (or the parent holds no blocks yet), a sequence that
        waits in the scheduler and recomputes the prompt once blocks free up (prefix-cache hits
        on the parent's full blocks make that cheap). Never fails for lack of blocks."""
        child = self._fork(parent, index)
        if child is None:
            child = self._sibling(parent, index)
            child.arrival_time = parent.arrival_time  # queued as part of its request
            self.scheduler.add(child)
        return child

    def _sibling(self, parent: Sequence, index: int) -> Sequence:
        """Sample `index` of the parent's request: its tokens so far, its own generator."""
        return self._new_seq(parent.request_id, index, list(parent.token_ids),
                             parent.num_prompt_tokens, parent.params, parent.priority,
                             parent.cache_salt)

    def _fork(self, parent: Sequence, index: int) -> Sequence | None:
        """A running copy of `parent` sharing its blocks; None without room or parent blocks."""
        if not self.kv_manager.has_blocks(parent.seq_id):
            return None
        child = self._sibling(parent, index)
        try:
            copy = self.kv_manager.fork(parent, child)
        except RuntimeError:
            return None
        if copy is not None:
            self.runner.copy_blocks([copy])
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.scheduled_once = True
        self.scheduler.add_running(child)
        return child

    def _export(self, state: RequestState, seq: Sequence, first: list[SampledToken]) -> None:
        """Prefill role: record the first token(s), keep the prompt's blocks pinned."""
        for i, tok in enumerate(first):
            if i == 0:
                self._append_token(seq, tok.token_id, self._logprob_entry(seq, tok), export=True)
            else:
                extra = self._new_seq(
                    state.request_id,
                    i,
                    list(seq.prompt_token_ids),
                    seq.num_prompt_tokens,
                    seq.params,
                    seq.priority,
                    seq.cache_salt,
                )
                extra.status = SequenceStatus.FINISHED_EXPORTED
                self._append_token(
                    extra, tok.token_id, self._logprob_entry(extra, tok), export=True
                )
                state.seqs.append(extra)
        state.kv_export = KVExport(self.kv_manager.block_ids(seq.seq_id), seq.num_prompt_tokens)
        self.scheduler.finish(seq, SequenceStatus.FINISHED_EXPORTED, free_blocks=False)

    def _logprob_entry(self, seq: Sequence, tok: SampledToken) -> TokenLogprobs | None:
        if seq.params.logprobs is None or tok.logprob is None:
            return None
        return self._make_logprob_entry(tok.token_id, tok.logprob, tok.rank, tok.top_logprobs)

    def _append_token(
        self,
        seq: Sequence,
        token_id: int,
        logprob: TokenLogprobs | None,
        export: bool = False,
        replay: bool = False,
    ) -> None:
        """Record one output token. `replay`: it was produced elsewhere (P/D, a resume), so a
        token its grammar forbids is bad input (ValueError) rather than a finished sample."""
        grammar_ok = seq.grammar is None or seq.grammar.accept(token_id)
        if not grammar_ok and replay:
            raise ValueError(f"output_token_ids: token {token_id} of sample {seq.index} does not "
                             "follow the request's structured_output grammar")
        seq.token_ids.append(token_id)
        if seq.logprobs is not None:
            seq.logprobs.append(logprob or {})
            if logprob and token_id in logprob:
                seq.cumulative_logprob += logprob[token_id].logprob
        assert seq.detokenizer is not None
        is_eos = token_id in self.eos_token_ids and not seq.params.ignore_eos
        stop_str = seq.detokenizer.update(
            [token_id], stop_terminated=is_eos and seq.num_output_tokens > seq.params.min_tokens
        )
        if export:
            return
        status = self._check_stop(seq, token_id, stop_str)
        if status is None and seq.grammar is not None and (
                not grammar_ok or seq.grammar.is_terminated):
            if not grammar_ok:  # e.g. min_tokens banned the only token the grammar allowed
                logger.warning("request_id=%s: sample %d left its grammar; stopped",
                               seq.request_id, seq.index)
            status = SequenceStatus.FINISHED_STOPPED
        if status is not None:
            if not seq.detokenizer.finished:
                seq.detokenizer.finish()
            self.scheduler.finish(seq, status)
            state = self.requests.get(seq.request_id)
            if state is not None and state.finished:
                state.finished_time = time.monotonic()

    def _check_stop(
        self, seq: Sequence, token_id: int, stop_str: str | None
    ) -> SequenceStatus | None:
        finish = check_stop(
            token_id, num_output_tokens=seq.num_output_tokens, num_tokens=seq.num_tokens,
            params=seq.params, eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len, stop_str=stop_str,
        )
        if finish is None:
            return None
        reason, stop_reason = finish
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        return (SequenceStatus.FINISHED_STOPPED if reason == "stop"
                else SequenceStatus.FINISHED_LENGTH)

    def _on_preempt(self, seq: Sequence) -> None:
        state = self.requests.get(seq.request_id)
        if state is not None and seq.want_prompt_logprobs:
            state.prompt_logprobs = [None]  # recomputed from the first prompt token

    # -- outputs ---------------------------------------------------------------------------------
    def _make_output(self, state: RequestState) -> RequestOutput:
        outputs = []
        for seq in state.seqs:
            finish = None
            if seq.status.is_finished and seq.status is not SequenceStatus.FINISHED_EXPORTED:
                finish = seq.status.value
            elif seq.status is SequenceStatus.FINISHED_EXPORTED:
                finish = "length"  # done *here*; the decode instance continues it
            assert seq.detokenizer is not None
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.output_text,
                    token_ids=seq.output_token_ids,
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=seq.logprobs,
                    finish_reason=finish,
                    stop_reason=seq.stop_reason,
                )
            )
        finished = state.finished or state.kv_export is not None
        if finished and state.kv_export is None:
            self.requests.pop(state.request_id, None)
        metrics = {}
        if state.first_token_time is not None:
            metrics["ttft_s"] = state.first_token_time - state.arrival_time
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.seqs[0].num_cached_tokens,
            kv_export=state.kv_export,
            metrics=metrics,
        )

    # -- introspection -----------------------------------------------------------------------------
    def take_kv_events(self) -> list[KVEvent]:
        return self.kv_manager.pool.take_events()

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_manager.pool.num_blocks
