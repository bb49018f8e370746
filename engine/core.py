"""The engine core: admit requests, schedule a step, run the model, sample, emit token deltas.

One `EngineCore` owns one model, one paged KV cache, the scheduler and the sampler. It deals
in token ids only: tokenizing prompts, decoding text, stop strings and logprob formatting
belong to the output processor, which runs outside the core's loop (in another process when
serving). Grammar matchers need the vocabulary: the serving side, which has the tokenizer,
sends it once (`set_grammar_vocabulary`, xgrammar's own serialized form) before the first
request that asks for a grammar; the core never loads a tokenizer.

Requests can leave after prefill with their KV pinned (`export_kv`, the prefill role) or start
from KV written in from outside (`add_imported_request`, the decode role), or from output
tokens produced elsewhere without their KV (`add_resumed_request`: migration, KV-load
fallback). Single-threaded on purpose: whoever drives `step()` owns the core.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Collection
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from pdmesh.engine.block_hash import HashScheme
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core_types import (
    CoreInfo,
    CoreOutput,
    EngineLoadSnapshot,
    KVExportInfo,
    RawLogprob,
    SampleDelta,
)
from pdmesh.engine.host_allocator import keep_temporaries_on_heap
from pdmesh.engine.in_flight import InFlightStep, may_overlap
from pdmesh.engine.kv_cache_manager import KVCacheManager, request_kv_blocks
from pdmesh.engine.kv_events import AllBlocksCleared, BlockStored, KVEvent
from pdmesh.engine.memory import lazy_zeros
from pdmesh.engine.model_loader import load_hf_config, load_model
from pdmesh.engine.model_runner import ModelRunner
from pdmesh.engine.model_store import resolve_model
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
class CoreRequest:
    """The core's view of one request: its samples and what it has reported so far."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    prompt_logprobs: list[RawLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    export_kv: bool = False
    kv_export: KVExportInfo | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    timing_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs) and len(self.seqs) == self.params.n


def child_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed: the request's own for sample 0, a hash of it for the others."""
    if seed is None or index == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little")


def eos_token_ids(tokenizer: Any, model_dir: Path) -> set[int]:
    """The ids that end a sequence: the tokenizer's EOS plus generation_config.json's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        import json

        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_ids: Collection[int]) -> None:
        self.config = config
        self.model_dir = resolve_model(config.model, config.load_format)
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        if self.device.type == "cpu":
            keep_temporaries_on_heap()  # engine/host_allocator.py: no page faults per step
        torch.manual_seed(config.seed)
        self.eos_token_ids = set(eos_token_ids)
        max_positions = self._max_positions()
        self.model, self.model_config, self.hf_config = load_model(
            self.model_dir, self.dtype, self.device, max_positions,
            load_format=config.load_format,
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
        self.runner = ModelRunner(
            self.model, self.kv_cache, self.kv_manager, backend, self.device,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enforce_eager=config.enforce_eager,
        )
        self.sampler = Sampler(seed=config.seed, device=self.device)
        self.requests: dict[str, CoreRequest] = {}
        self._pending_outputs: set[str] = set()  # changed outside step() (commands)
        self._grammar_compiler: GrammarCompiler | None = None  # built on first structured output
        self.async_scheduling = config.use_async_scheduling(self.device)
        self._in_flight: InFlightStep | None = None  # async scheduling: a step not landed yet
        self.num_steps = 0
        self.step_seconds = 0.0  # host wall time inside steps: busy = its rate
        self.scheduled_tokens = 0
        self._info = self._make_info()

    # -- start-up helpers -------------------------------------------------------------------
    def _max_positions(self) -> int:
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

    def info(self) -> CoreInfo:
        return self._info

    def _make_info(self) -> CoreInfo:
        mc = self.model_config
        return CoreInfo(
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            num_total_blocks=self.num_total_blocks,
            vocab_size=mc.vocab_size,
            kv_shape=(mc.num_layers, self.config.block_size, mc.num_kv_heads, mc.head_dim),
            kv_dtype=str(self.dtype).removeprefix("torch."),
            hash_fingerprint=self.scheme.fingerprint(),
            hash_description=self.scheme.describe(),
            capacity_summary=self.capacity_summary,
            torch_threads=torch.get_num_threads(),
        )

    # -- requests -----------------------------------------------------------------------------
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
        check_kv_capacity(self.info(), num_prompt_tokens, params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        export_kv: bool = False,
    ) -> CoreRequest:
        """Queue a request. With `export_kv`, it stops after its first token with KV pinned."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        ids = list(prompt_token_ids)
        self.validate(ids, params)
        if not export_kv:  # an export only ever holds its prompt, which validate() bounds
            self.check_kv_capacity(len(ids), params)
        seq = self._new_seq(request_id, 0, list(ids), len(ids), params, priority, cache_salt)
        seq.fork_into = params.n
        seq.export_kv = export_kv
        seq.want_prompt_logprobs = params.prompt_logprobs is not None
        state = CoreRequest(request_id, ids, params, [seq], export_kv=export_kv)
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
            generator=make_generator(child_seed(params.seed, index), self.device),
        )
        if params.logprobs is not None:
            seq.logprobs = []
        if params.structured_output is not None:
            seq.grammar = self._grammars().matcher(params.structured_output)
        return seq

    def _grammars(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            raise ValueError("structured_output: this engine has no grammar vocabulary yet "
                             "(its serving side sends one before the first structured request)")
        return self._grammar_compiler

    def prepare_grammar(self, params: SamplingParams) -> Future[Any] | None:
        """Start compiling a request's grammar off the step loop; the future to wait for
        before adding it, or None when adding it now would not compile anything (no grammar,
        already compiled, or no vocabulary yet: `add_request` then refuses it)."""
        if params.structured_output is None or self._grammar_compiler is None:
            return None
        future = self._grammar_compiler.prepare(params.structured_output)
        return None if future.done() else future

    @property
    def has_grammar_vocabulary(self) -> bool:
        return self._grammar_compiler is not None

    def set_grammar_vocabulary(self, vocabulary: str) -> None:
        """The vocabulary grammars compile against (`structured_output.grammar_vocabulary`)."""
        compiler = GrammarCompiler(vocabulary)
        if compiler.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"grammar vocabulary: {compiler.vocab_size} tokens, but the model "
                             f"has {self.model_config.vocab_size}")
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()
        self._grammar_compiler = compiler

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; every block it holds is returned."""
        state = self.requests.pop(request_id, None)
        self._pending_outputs.discard(request_id)
        if state is None:
            return False
        seqs = list(state.seqs)  # and any sample scheduled but not recorded in it yet
        scheduled = (*self.scheduler.running, *self.scheduler.waiting)
        seqs += [s for s in scheduled if s.request_id == request_id and s not in seqs]
        for seq in seqs:
            if not seq.status.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            elif seq.status is SequenceStatus.FINISHED_EXPORTED:
                self.kv_manager.free(seq.seq_id)
        return True

    def stop_sequences(self, request_id: str, indices: Seq[int]) -> None:
        """The output processor found a stop string in these samples: end them here (their
        blocks are freed; the text already stops there). Drops a request left with nothing."""
        state = self.requests.get(request_id)
        if state is None:
            return
        for seq in state.seqs:
            if seq.index in indices and not seq.status.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
                seq.finish_emitted = True  # the processor decided it; nothing to report
        if state.finished and state.kv_export is None:
            self.requests.pop(request_id, None)
            self._pending_outputs.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.num_unfinished > 0 or bool(self._pending_outputs)
                or self._in_flight is not None)

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
        priority: int = 0,
        cache_salt: str | None = None,
        num_cached_tokens: int = 0,
    ) -> CoreRequest:
        """Continue decoding a request whose prompt KV was computed elsewhere.

        `kv` covers the prompt (`[layers, 2, ceil(len/bs), bs, kv_heads, head_dim]`);
        `first_token_ids` holds the first sampled token of each of the `n` samples. They are
        not reported back: the caller has them already.
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
        state = CoreRequest(request_id, ids, params, [parent])
        state.first_token_time = state.first_scheduled_time = time.monotonic()
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
                self._append_token(seq, first_token_ids[i], None, replay=True)
                seq.num_emitted = seq.num_output_tokens
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
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> CoreRequest:
        """Continue a request whose first output tokens were produced elsewhere, without its KV.

        Used when a prefill's KV cannot be pulled (the decode instance recomputes) and when a
        decode stream moves to another instance. `output_token_ids[i]` holds sample i's tokens
        so far (one list per sample, possibly empty). Each sample restarts from prompt + its
        tokens and prefills both here (prefix-cache hits make the shared prompt cheap). The
        given tokens are *output*: max_tokens, min_tokens, penalties and stop checks count
        them, and a seeded sample's generator skips one draw per given token, so the
        continuation is exactly what an uninterrupted run samples. The given tokens are not
        reported back. Raises ValueError for bad input and KVCacheFullError for a request
        that can never fit, before anything is allocated.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        ids = list(prompt_token_ids)
        self.validate(ids, params)
        self._validate_resumed(ids, output_token_ids, params)
        self.check_kv_capacity(len(ids), params)
        state = CoreRequest(request_id, ids, params, [])
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
                    self._append_token(seq, int(token_id), None, replay=True)
                seq.num_emitted = seq.num_output_tokens
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

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """Schedule and run one step; the outputs of every request it (or a command) changed.

        With async scheduling the step's sampled tokens may stay in flight until the next
        call (engine/in_flight.py): this call then lands the previous step's tokens after
        launching its own, so the device is never left waiting for the host.
        """
        touched: dict[str, CoreRequest] = {}
        for request_id in self._pending_outputs:
            if request_id in self.requests:
                touched[request_id] = self.requests[request_id]
        self._pending_outputs.clear()
        previous, self._in_flight = self._in_flight, None
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if previous is not None:
                self._land(previous, touched)
                return [self._make_output(state) for state in touched.values()]
            pinned = any(s.kv_export is not None for s in self.requests.values())
            if self.scheduler.num_unfinished and not self.scheduler.running and not pinned:
                raise RuntimeError("scheduler made no progress: a request cannot fit the KV cache")
            return [self._make_output(state) for state in touched.values()]
        self.num_steps += 1
        started = time.monotonic()
        inputs = self.runner.prepare(
            sched.scheduled, previous.pending() if previous is not None else None)
        logits = self.runner.execute(inputs)
        to_sample: list[Sequence] = []
        for entry in inputs.order:
            seq = entry.seq
            state = self.requests[seq.request_id]
            touched[state.request_id] = state
            if state.first_scheduled_time is None:
                state.first_scheduled_time = started
            if seq.seq_id in inputs.prompt_logits:
                first, end = inputs.prompt_logits[seq.seq_id]
                self._record_prompt_logprobs(state, seq, logits[first:end])
            seq.num_computed_tokens += entry.num_new_tokens
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.want_prompt_logprobs = False
            if seq.seq_id in inputs.sample_index:
                to_sample.append(seq)
        overlap = bool(to_sample) and self.async_scheduling and not inputs.prompt_logits \
            and all(may_overlap(seq) for seq in to_sample)
        if overlap:
            self._in_flight = self._launch_samples(to_sample, logits, inputs.sample_index)
        if previous is not None:  # its tokens come before this step's
            self._land(previous, touched)
            to_sample = [seq for seq in to_sample if not seq.status.is_finished]
        if to_sample and not overlap:
            self._sample(to_sample, logits, inputs.sample_index)
        self.step_seconds += time.monotonic() - started
        self.scheduled_tokens += sum(entry.num_new_tokens for entry in inputs.order)
        return [self._make_output(state) for state in touched.values()]

    def _launch_samples(
        self, seqs: list[Sequence], logits: torch.Tensor, sample_index: dict[str, int]
    ) -> InFlightStep:
        """Sample on the device and leave the ids in flight (every seq passed `may_overlap`:
        one row each, nothing read back from the host)."""
        rows = [sample_index[seq.seq_id] for seq in seqs]
        meta = SamplingMetadata(
            params=[seq.params for seq in seqs],
            generators=[seq.generator for seq in seqs],
            prompt_token_ids=[seq.prompt_token_ids for seq in seqs],
            output_token_ids=[seq.output_token_ids for seq in seqs],
            eos_token_ids=self.eos_token_ids,
        )
        ids = self.sampler.sample_ids(self._gather_rows(logits, rows), meta)
        return InFlightStep.launch(seqs, ids)

    def _land(self, step: InFlightStep, touched: dict[str, CoreRequest]) -> None:
        """Record a launched step's tokens; sequences that ended meanwhile (aborted, stopped
        by a stop string, or by their token of the step before) discard theirs."""
        now = time.monotonic()
        for seq, token_id in step.land():
            state = self.requests.get(seq.request_id)
            if state is None or seq.status.is_finished:
                continue
            touched[state.request_id] = state
            if state.first_token_time is None:
                state.first_token_time = now
            self._append_token(seq, token_id, None)

    def drop_in_flight(self) -> None:
        """After a failed step: forget the step in flight (its requests are being failed)."""
        if self._in_flight is not None:
            self._in_flight.drop()
            self._in_flight = None

    @staticmethod
    def _gather_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if rows == list(range(logits.shape[0])):
            return logits  # one row per sequence, in order: nothing to gather
        # a host tensor copied without blocking: no sync on CUDA
        return logits.index_select(0, torch.tensor(rows).to(logits.device, non_blocking=True))

    def _record_prompt_logprobs(
        self, state: CoreRequest, seq: Sequence, logits: torch.Tensor
    ) -> None:
        start = seq.num_computed_tokens
        end = min(seq.num_prompt_tokens, start + 1 + logits.shape[0])
        targets = seq.token_ids[start + 1 : end]
        rows = compute_prompt_logprobs(
            logits[: len(targets)], targets, seq.params.prompt_logprobs or 0
        )
        assert state.prompt_logprobs is not None
        for target, (lp, rank, top) in zip(targets, rows, strict=True):
            state.prompt_logprobs.append(raw_logprob(target, lp, rank, top))

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
                    else make_generator(child_seed(seq.params.seed, i), self.device)
                )
        meta = SamplingMetadata(
            params=[o[0].params for o in owners],
            generators=gens,
            prompt_token_ids=[o[0].prompt_token_ids for o in owners],
            output_token_ids=[o[0].output_token_ids for o in owners],
            eos_token_ids=self.eos_token_ids,
        )
        row_logits = self._gather_rows(logits, rows)
        if any(o[0].grammar is not None for o in owners):  # fan-out rows share the parent's
            row_logits = apply_bitmasks(row_logits, [o[0].grammar for o in owners])
        sampled = self.sampler(row_logits, meta)
        by_seq: dict[str, list[tuple[SampledToken, torch.Generator | None]]] = {}
        for (seq, _), tok, gen in zip(owners, sampled, gens, strict=True):
            by_seq.setdefault(seq.seq_id, []).append((tok, gen))
        now = time.monotonic()
        for seq in seqs:
            results = by_seq[seq.seq_id]
            state = self.requests[seq.request_id]
            if state.first_token_time is None:
                state.first_token_time = now
            if seq.export_kv and seq.num_output_tokens == 0:
                seq.fork_into = 1
                self._export(state, seq, [r[0] for r in results])
            elif len(results) > 1:
                self._fan_out(state, seq, results)
            else:
                tok = results[0][0]
                self._append_token(seq, tok.token_id, _raw(seq, tok))

    def _fan_out(
        self,
        state: CoreRequest,
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
            self._append_token(seq, tok.token_id, _raw(seq, tok))

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

    def _export(self, state: CoreRequest, seq: Sequence, first: list[SampledToken]) -> None:
        """Prefill role: record the first token(s), keep the prompt's blocks pinned."""
        for i, tok in enumerate(first):
            if i == 0:
                self._append_token(seq, tok.token_id, _raw(seq, tok), export=True)
            else:
                extra = self._sibling(seq, i)
                extra.token_ids = list(seq.prompt_token_ids)  # not sample 0's first token
                extra.status = SequenceStatus.FINISHED_EXPORTED
                self._append_token(extra, tok.token_id, _raw(extra, tok), export=True)
                state.seqs.append(extra)
        state.kv_export = KVExportInfo(self.kv_manager.block_ids(seq.seq_id),
                                       seq.num_prompt_tokens)
        self.scheduler.finish(seq, SequenceStatus.FINISHED_EXPORTED, free_blocks=False)

    def _append_token(
        self,
        seq: Sequence,
        token_id: int,
        logprob: RawLogprob | None,
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
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
        if export:
            return
        status = self._check_stop(seq, token_id)
        if status is None and seq.grammar is not None and (
                not grammar_ok or seq.grammar.is_terminated):
            if not grammar_ok:  # e.g. min_tokens banned the only token the grammar allowed
                logger.warning("request_id=%s: sample %d left its grammar; stopped",
                               seq.request_id, seq.index)
            status = SequenceStatus.FINISHED_STOPPED
        if status is not None:
            self.scheduler.finish(seq, status)

    def _check_stop(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        finish = check_stop(
            token_id, num_output_tokens=seq.num_output_tokens, num_tokens=seq.num_tokens,
            params=seq.params, eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
        )
        if finish is None:
            return None
        reason, stop_reason = finish
        if isinstance(stop_reason, int):
            seq.stop_reason = stop_reason
        return (SequenceStatus.FINISHED_STOPPED if reason == "stop"
                else SequenceStatus.FINISHED_LENGTH)

    def _on_preempt(self, seq: Sequence) -> None:
        state = self.requests.get(seq.request_id)
        if state is not None and seq.want_prompt_logprobs:
            state.prompt_logprobs = [None]  # recomputed from the first prompt token

    # -- outputs ---------------------------------------------------------------------------------
    def _make_output(self, state: CoreRequest) -> CoreOutput:
        samples: list[SampleDelta] = []
        for seq in state.seqs:
            new = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted:]
            finish = None
            if seq.status.is_finished and not seq.finish_emitted:
                finish = seq.status.value
                seq.finish_emitted = True
            if not new and finish is None:
                continue
            seq.num_emitted += len(new)
            lps = None
            if seq.logprobs is not None:
                lps, seq.logprobs = seq.logprobs, []
            samples.append(SampleDelta(seq.index, new, lps, finish,
                                       seq.stop_reason if finish == "stop" else None))
        out = CoreOutput(state.request_id, samples,
                         num_cached_tokens=state.seqs[0].num_cached_tokens if state.seqs else 0)
        if (state.prompt_logprobs is not None and not state.prompt_logprobs_sent
                and len(state.prompt_logprobs) >= len(state.prompt_token_ids)):
            out.prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_sent = True
        if state.kv_export is not None:
            out.kv_export = state.kv_export
        if state.first_token_time is not None and not state.timing_sent:
            state.timing_sent = True
            out.ttft_s = state.first_token_time - state.arrival_time
            if state.first_scheduled_time is not None:
                out.queue_s = max(0.0, state.first_scheduled_time - state.arrival_time)
        finished = state.finished or state.kv_export is not None
        if finished and state.kv_export is None:
            self.requests.pop(state.request_id, None)
            out.finished = True
        elif state.kv_export is not None:
            out.finished = True
        return out

    # -- introspection -----------------------------------------------------------------------------
    def take_kv_events(self) -> list[KVEvent]:
        return self.kv_manager.pool.take_events()

    def kv_snapshot(self) -> list[KVEvent]:
        """Everything cached right now as one batch (drops the events it supersedes)."""
        self.take_kv_events()
        hashes = tuple(self.kv_manager.pool.cached.keys())
        return [AllBlocksCleared(), BlockStored(hashes)] if hashes else [AllBlocksCleared()]

    def load(self) -> EngineLoadSnapshot:
        pinned = sum(
            len(s.kv_export.block_ids) for s in self.requests.values()
            if s.kv_export is not None
        )
        stats = self.kv_manager.stats
        return EngineLoadSnapshot(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.num_free_blocks,
            num_total_blocks=self.num_total_blocks,
            num_pinned_blocks=pinned,
            prefix_hit_tokens=stats.hits,
            prefix_query_tokens=stats.queries,
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
            scheduled_tokens=self.scheduled_tokens,
        )

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_manager.pool.num_blocks


def check_kv_capacity(info: CoreInfo, num_prompt_tokens: int, params: SamplingParams) -> None:
    """Raise KVCacheFullError for a request that could never be held at once by an engine with
    these fixed figures: callers refuse it before spending anything on it."""
    bs = info.block_size
    room = max(1, info.max_model_len - num_prompt_tokens)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    need = request_kv_blocks(num_prompt_tokens, max_tokens, params.n, bs)
    total = info.num_total_blocks
    if need > total:
        unset = " (max_tokens unset: the rest of the context)" if params.max_tokens is None else ""
        raise KVCacheFullError(
            f"request needs {need} KV blocks of {bs} tokens for n={params.n} x "
            f"(prompt {num_prompt_tokens} + max_tokens {max_tokens}{unset}), prompt blocks "
            f"shared, but this instance holds {total} blocks in all; lower n or max_tokens"
        )


def raw_logprob(token_id: int, logprob: float, rank: int | None,
                top: dict[int, float] | None) -> RawLogprob:
    ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])
    return RawLogprob(token_id, float(logprob), rank, [t for t, _ in ranked],
                      [float(lp) for _, lp in ranked])


def _raw(seq: Sequence, tok: SampledToken) -> RawLogprob | None:
    if seq.params.logprobs is None or tok.logprob is None:
        return None
    return raw_logprob(tok.token_id, tok.logprob, tok.rank, tok.top_logprobs)
