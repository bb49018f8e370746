"""The engine core: admit requests, then step — schedule, run and sample, commit.

One `EngineCore` owns one model, one paged KV cache, the scheduler and the model runner. It
deals in token ids only: tokenizing prompts, decoding text, stop strings and logprob formatting
belong to the output processor, which runs outside the core's loop (in another process when
serving). Grammar matchers need the vocabulary: the serving side, which has the tokenizer,
sends it once (`set_grammar_vocabulary`, xgrammar's own serialized form) before the first
request that asks for a grammar; the core never loads a tokenizer.

Every request comes in one way, `add(EngineRequest)`, whether it brings imported KV (the decode
role) or output tokens produced elsewhere (migration, KV-load fallback); an exporting request
(the prefill role) leaves after its first token with its KV pinned (`read_kv`, `release_kv`).
The work is the other modules': start-up sizing (engine/core/startup.py), admission
(engine/core/admission.py), the step's device side (engine/worker/model_runner.py) and its commit
(engine/core/output_commit.py). Single-threaded on purpose: whoever drives `step()` owns the core.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from typing import Any

import msgspec
import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.admission import Admission
from pdmesh.engine.core.kv_exports import KVExports
from pdmesh.engine.core.output_commit import OutputCommit
from pdmesh.engine.core.request_state import CoreRequest, SampleMaker
from pdmesh.engine.core.startup import core_info, set_up_engine
from pdmesh.engine.core_types import CoreInfo, CoreOutput, EngineLoadSnapshot
from pdmesh.engine.engine_request import (
    EngineRequest,
    check_kv_capacity,
    check_prompt,
    check_request,
)
from pdmesh.engine.kv_events import AllBlocksCleared, BlockStored, KVEvent
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from pdmesh.engine.scheduling.sequence import SequenceStatus
from pdmesh.engine.scheduling.step_budget import ItlTarget, min_prefill_tokens
from pdmesh.engine.scheduling.step_cost import (
    PredictionStats,
    StepCostModel,
    attention_weight,
    work_of,
)
from pdmesh.engine.structured.grammar import GrammarCompiler, GrammarMatcher
from pdmesh.engine.structured_output import StructuredOutput
from pdmesh.engine.worker.in_flight import InFlightStep
from pdmesh.engine.worker.model_runner import ModelRunner
from pdmesh.engine.worker.models.llama import ModelConfig
from pdmesh.engine.worker.sampler import Sampler
from pdmesh.engine.worker.selfcheck import (
    apply_fallbacks,
    engine_selfcheck,
    fallback_layer_ops,
    with_runner_capture,
)
from pdmesh.engine.worker.step_sampling import StepSampler
from pdmesh.kernels.backend_selection import get_attention_backend
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.connector import ExportInfo, KVConnector


def build_scheduler(config: EngineConfig, kv_manager: KVCacheManager, max_model_len: int,
                    mc: ModelConfig) -> Scheduler:
    """The scheduler an engine of this config and model shape runs: its limits, its ITL target
    and a step-cost model weighted by the model's attention share."""
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            itl_target=ItlTarget.from_ms(config.itl_target_ms, min_prefill_tokens(
                config.max_num_batched_tokens, config.block_size)),
        ),
        kv_manager,
        max_model_len,
        StepCostModel(attention_weight(mc.num_heads, mc.num_kv_heads, mc.head_dim,
                                       mc.hidden_size, mc.intermediate_size)),
    )


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_ids: Collection[int],
                 connector: KVConnectorConfig | None = None) -> None:
        """`connector`: lend and pull KV blocks from this core (the engine services' roles);
        None for an engine that only generates (offline `LLM`)."""
        self.eos_token_ids = set(eos_token_ids)
        setup = set_up_engine(config, connector)
        # The accelerator paths checked on a probe before anything is built on them; what
        # failed is off in the config the runner is built from (engine/worker/selfcheck.py).
        selfcheck = engine_selfcheck(config, setup.model, setup.device)
        config = apply_fallbacks(config, selfcheck.fallbacks)
        self.config = config
        self.model_dir, self.device, self.dtype = setup.model_dir, setup.device, setup.dtype
        self.model, self.model_config, self.hf_config = (
            setup.model, setup.model_config, setup.hf_config)
        self.scheme, self.kv_cache = setup.scheme, setup.kv_cache
        self.max_model_len, self.capacity_summary = setup.max_model_len, setup.capacity_summary
        self.kv_manager = KVCacheManager(setup.num_blocks, self.scheme,
                                         config.enable_prefix_caching)
        self.scheduler = build_scheduler(config, self.kv_manager, self.max_model_len,
                                         self.model_config)
        self.sampler = Sampler(seed=config.seed, device=self.device)
        self.async_scheduling = config.use_async_scheduling(self.device)
        self.runner = ModelRunner(
            self.model, self.kv_cache, self.kv_manager,
            get_attention_backend(config.attention_backend, self.device,
                                  block_size=config.block_size), self.device,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enforce_eager=config.enforce_eager,
            sampling=StepSampler(self.sampler, self.eos_token_ids, self.device),
            async_scheduling=self.async_scheduling,
            max_model_len=self.max_model_len,
        )
        if (ops := fallback_layer_ops(selfcheck.fallbacks)) is not None:
            self.runner.model.ops = ops
        selfcheck = with_runner_capture(selfcheck, self.runner)
        self.requests: dict[str, CoreRequest] = {}
        samples = SampleMaker(self.scheduler, self.kv_manager, self.runner.copy_blocks,
                              self._grammar_matcher, self.device)
        self.commit = OutputCommit(self.requests, self.scheduler, self.kv_manager, samples,
                                   self.eos_token_ids, self.max_model_len)
        self.scheduler.on_preempt = self.commit.on_preempt
        self.connector: KVConnector | None = None
        if connector is not None:
            self.connector = KVConnector(connector, self.kv_cache, setup.cache_file)
            self.connector.start()
        self.exports = KVExports(self.requests, self.kv_manager, self.kv_cache, self.connector)
        self.admission = Admission(self.scheduler, self.kv_manager, self.kv_cache, samples,
                                   self.commit, self.model_config.vocab_size, self.connector)
        self._pending_outputs: set[str] = set()  # changed outside step() (commands)
        self._grammar_compiler: GrammarCompiler | None = None  # built on first structured output
        self._in_flight: InFlightStep | None = None  # async scheduling: a step not landed yet
        self.num_steps = 0
        self.step_seconds = 0.0  # host wall time inside steps: busy = its rate
        self.scheduled_tokens = 0
        self.step_cost_stats = PredictionStats()
        self._info = msgspec.structs.replace(
            core_info(setup, config.block_size), selfcheck=selfcheck.summary(),
            selfcheck_fallbacks=selfcheck.fallbacks)
        if self.connector is not None:
            self._info = msgspec.structs.replace(
                self._info, kv_cache_file=self.connector.cache_file_name,
                kv_block_server=self.connector.block_server_address,
                kv_cache_ipc=self.connector.cache_ipc)

    def info(self) -> CoreInfo:
        return self._info

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        check_prompt(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)

    def check_kv_capacity(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse a request whose `n` samples, each run to `max_tokens`, could never be held
        at once (prompt blocks shared). Reads only fixed figures, so any thread may call it.
        """
        check_kv_capacity(self.info(), num_prompt_tokens, params)

    def add(self, request: EngineRequest) -> CoreRequest:
        """Queue a request (engine/engine_request.py says what it may bring). Raises
        ValueError for bad input and KVCacheFullError for a request that can never fit,
        before anything is allocated; a request given tokens reports them never, but its
        samples' state (a given token may have finished one) at the next step."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        check_request(request, self.model_config.vocab_size, self.max_model_len)
        if request.kv is not None:
            self._check_kv_shape(len(request.prompt_token_ids), request.kv)
        if request.kv_source is not None:
            if self.connector is None:
                raise ValueError("kv_source: this engine has no KV connector")
            self.connector.check_source(request.kv_source)
            if request.kv_source.num_tokens != len(request.prompt_token_ids):
                raise ValueError(f"kv_source: covers {request.kv_source.num_tokens} tokens, "
                                 f"the prompt has {len(request.prompt_token_ids)}")
        if not request.export_kv:  # an export only ever holds its prompt, which is bounded
            self.check_kv_capacity(len(request.prompt_token_ids), request.params)
        state = CoreRequest(request.request_id, list(request.prompt_token_ids), request.params,
                            [], export_kv=request.export_kv)
        self.requests[request.request_id] = state
        try:  # from here on, any failure frees whatever the request holds
            self.admission.place(state, request)
        except BaseException:
            self.abort_request(request.request_id)
            raise
        if request.given_tokens is not None and request.request_id not in self.admission.loading:
            self._pending_outputs.add(request.request_id)  # (a pull owes its output on landing)
        return state

    def _check_kv_shape(self, num_prompt_tokens: int, kv: torch.Tensor) -> None:
        mc = self.model_config
        nb = self.kv_manager.num_blocks_for(num_prompt_tokens)
        expected = (mc.num_layers, 2, nb, self.config.block_size, mc.num_kv_heads, mc.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"kv: shape {tuple(kv.shape)} does not match {expected}")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; every block it holds is returned (a lent export's
        too: its lease is then over)."""
        released = self.exports.release(request_id) if request_id in self.exports.lent else False
        state = self.requests.pop(request_id, None)
        self._pending_outputs.discard(request_id)
        if state is None:
            return released
        if self.admission.abandon(request_id):
            return True  # its blocks go back once its pull has stopped writing them
        seqs = list(state.seqs)  # and any sample scheduled but not recorded in it yet
        scheduled = (*self.scheduler.running, *self.scheduler.waiting)
        seqs += [s for s in scheduled if s.request_id == request_id and s not in seqs]
        for seq in seqs:
            if not seq.status.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            elif seq.status is SequenceStatus.FINISHED_EXPORTED:
                self.kv_manager.free(seq.seq_id)
        if self.connector is not None:
            self.connector.release(request_id)
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
                or self._in_flight is not None or bool(self.admission.loading))

    def loads_in_flight(self) -> list[Future[int]]:
        """The KV pulls running on the connector's threads (the loop wakes when one ends)."""
        return [loading.future for loading in self.admission.loading.values()]

    # -- structured output ----------------------------------------------------------------------
    def _grammar_matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        if self._grammar_compiler is None:
            raise ValueError("structured_output: this engine has no grammar vocabulary yet "
                             "(its serving side sends one before the first structured request)")
        return self._grammar_compiler.matcher(spec)

    def prepare_grammar(self, params: SamplingParams) -> Future[Any] | None:
        """Start compiling a request's grammar off the step loop; the future to wait for
        before adding it, or None when adding it now would not compile anything (no grammar,
        already compiled, or no vocabulary yet: `add` then refuses it)."""
        if params.structured_output is None or self._grammar_compiler is None:
            return None
        future = self._grammar_compiler.prepare(params.structured_output)
        return None if future.done() else future

    @property
    def has_grammar_vocabulary(self) -> bool:
        return self._grammar_compiler is not None

    def set_grammar_vocabulary(self, vocabulary: str) -> None:
        """The vocabulary grammars compile against (`structured_output.grammar_vocabulary`)."""
        compiler = GrammarCompiler(vocabulary, self.config.structured_output_compile_timeout_s)
        if compiler.vocab_size != self.model_config.vocab_size:
            compiler.close()
            raise ValueError(f"grammar vocabulary: {compiler.vocab_size} tokens, but the model "
                             f"has {self.model_config.vocab_size}")
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()
        self._grammar_compiler = compiler

    def close(self) -> None:
        """Release what outlives a step: the grammar compiler's threads and sandbox workers."""
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()
            self._grammar_compiler = None
        if self.connector is not None:
            self.connector.close()
            self.connector = None

    # -- KV export (the prefill role: engine/core/kv_exports.py)
    # -------------------------------------
    def read_kv(self, request_id: str) -> torch.Tensor:
        return self.exports.read(request_id)

    def export_kv(self, request_id: str) -> ExportInfo:
        return self.exports.lend(request_id)

    def release_kv(self, request_id: str) -> bool:
        return self.exports.release(request_id)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """Schedule, run and sample one step, commit it; the outputs of every request it (or
        a command since the last step) changed.

        With async scheduling the step's sampled tokens may stay in flight until the next
        call (engine/worker/in_flight.py): this call then commits the previous step's tokens after
        launching its own, so the device is never left waiting for the host.
        """
        self._pending_outputs.update(self.admission.land_loads())
        touched = {rid: self.requests[rid] for rid in self._pending_outputs
                   if rid in self.requests}
        self._pending_outputs.clear()
        previous, self._in_flight = self._in_flight, None
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if previous is None:
                self._check_progress()
            return self.commit.update_from_output(touched, previous=previous)
        self.num_steps += 1
        work = work_of([(s.seq.num_computed_tokens, s.num_new_tokens) for s in sched.scheduled])
        predicted = self.scheduler.step_cost.predict(work)
        started = time.monotonic()
        output = self.runner.execute_model(sched, previous)
        self._in_flight = output.in_flight
        outputs = self.commit.update_from_output(touched, output, previous, started)
        seconds = time.monotonic() - started
        self.scheduler.step_cost.observe(work, seconds)
        self.step_seconds += seconds
        self.scheduled_tokens += sched.num_batched_tokens
        if predicted is not None:
            self.step_cost_stats.add(predicted, seconds)
        return outputs

    def _check_progress(self) -> None:
        """Nothing was scheduled and nothing is in flight: only pinned KV may hold it up."""
        pinned = self.exports.any_pinned() or bool(self.admission.loading)
        if self.scheduler.num_unfinished and not self.scheduler.running and not pinned:
            raise RuntimeError("scheduler made no progress: a request cannot fit the KV cache")

    def drop_in_flight(self) -> None:
        """After a failed step: forget the step in flight (its requests are being failed)."""
        if self._in_flight is not None:
            self._in_flight.drop()
            self._in_flight = None

    # -- introspection -----------------------------------------------------------------------------
    def take_kv_events(self) -> list[KVEvent]:
        return self.kv_manager.pool.take_events()

    def kv_snapshot(self) -> list[KVEvent]:
        """Everything cached right now as one batch (drops the events it supersedes)."""
        self.take_kv_events()
        hashes = tuple(self.kv_manager.pool.cached.keys())
        return [AllBlocksCleared(), BlockStored(hashes)] if hashes else [AllBlocksCleared()]

    def load(self) -> EngineLoadSnapshot:
        pinned = self.exports.pinned_blocks()
        stats = self.kv_manager.stats
        return EngineLoadSnapshot(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.admission.loading),
            num_free_blocks=self.num_free_blocks,
            num_total_blocks=self.num_total_blocks,
            num_pinned_blocks=pinned,
            prefix_hit_tokens=stats.hits,
            prefix_query_tokens=stats.queries,
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
            scheduled_tokens=self.scheduled_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_predicted_steps=self.step_cost_stats.steps,
            predicted_step_seconds=self.step_cost_stats.predicted_s,
            predicted_steps_actual_seconds=self.step_cost_stats.actual_s,
            itl_target_seconds=self.scheduler.itl_target_s,
        )

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_manager.pool.num_blocks
