"""The engine core: admit requests, then step — schedule, run and sample, commit.

One `EngineCore` owns one model, one paged KV cache, the scheduler and the model runner. It
deals in token ids only: tokenizing prompts, decoding text, stop strings and logprob formatting
belong to the output processor, which runs outside the core's loop (in another process when
serving). Grammar matchers need the vocabulary: the serving side, which has the tokenizer,
sends it once (`CoreGrammars.set_vocabulary`, engine/core/grammars.py, xgrammar's own
serialized form) before the first request that asks for a grammar; the core never loads a
tokenizer.

Every request comes in one way, `add(EngineRequest)`, whether it brings imported KV (the decode
role) or output tokens produced elsewhere (migration, KV-load fallback); an exporting request
(the prefill role) leaves after its first token with its KV pinned (`read_kv`, `release_kv`).
The work is the other modules': start-up sizing (engine/core/startup.py; its tensor-parallel
ranks: engine/core/ranks.py), admission (engine/core/admission.py), the step's device side
(engine/worker/model_runner.py) and its commit (engine/core/output_commit.py), the load it
reports (engine/core/load_snapshot.py). Single-threaded on purpose: whoever drives `step()` owns
the core.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from concurrent.futures import Future

import msgspec
import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.admission import Admission, check_kv_import
from pdmesh.engine.core.grammars import CoreGrammars
from pdmesh.engine.core.kv_exports import KVExports
from pdmesh.engine.core.kv_offload import KVOffload
from pdmesh.engine.core.load_snapshot import load_snapshot
from pdmesh.engine.core.output_commit import OutputCommit
from pdmesh.engine.core.ranks import set_up_with_ranks
from pdmesh.engine.core.request_state import CoreRequest, SampleMaker
from pdmesh.engine.core.startup import core_info, with_connector
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
from pdmesh.engine.scheduling.sequence import Sequence, SequenceStatus
from pdmesh.engine.scheduling.step_budget import ItlTarget, min_prefill_tokens
from pdmesh.engine.scheduling.step_cost import (
    PredictionStats,
    StepCostModel,
    attention_weight,
    work_of,
)
from pdmesh.engine.worker.in_flight import InFlightStep
from pdmesh.engine.worker.model_runner import ModelRunner
from pdmesh.engine.worker.models.architecture import ModelConfig
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
from pdmesh.kvstore.connector.export_info import ExportProgress, PrefixLoan
from pdmesh.kvstore.connector.rank_caches import RankCaches


def build_scheduler(config: EngineConfig, kv_manager: KVCacheManager, max_model_len: int,
                    mc: ModelConfig) -> Scheduler:
    """The scheduler an engine of this config and model shape runs: its limits, its ITL target
    and a step-cost model weighted by the model's attention share."""
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=config.scheduling_policy,
            itl_target=ItlTarget.from_ms(config.itl_target_ms, min_prefill_tokens(
                config.max_num_batched_tokens, config.block_size)),
        ),
        kv_manager,
        max_model_len,
        StepCostModel(attention_weight(mc.num_heads, mc.num_kv_heads, mc.head_dim,
                                       mc.hidden_size, mc.active_intermediate_size)),
    )


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_ids: Collection[int],
                 connector: KVConnectorConfig | None = None,
                 on_rank_failure: Callable[[str], None] | None = None) -> None:
        """`connector`: lend and pull KV blocks from this core (the engine services' roles);
        None for an engine that only generates (offline `LLM`). With tensor parallelism the
        core starts its other ranks first (engine/core/ranks.py); `on_rank_failure` is called
        when one exits or a step fails with the ranks out of step."""
        self.eos_token_ids = set(eos_token_ids)
        config, connector, self.ranks, setup = set_up_with_ranks(config, connector,
                                                                 on_rank_failure)
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
        host_bytes, disk_bytes = config.kv_offload_sizes()
        self.kv_offload = KVOffload(self.kv_cache, host_bytes, config.kv_offload_disk_dir,
                                    disk_bytes) if host_bytes else None
        self.kv_manager = KVCacheManager(setup.num_blocks, self.scheme,
                                         config.enable_prefix_caching, tier=self.kv_offload)
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
            channel=self.ranks.channel if self.ranks is not None else None,
        )
        if (ops := fallback_layer_ops(selfcheck.fallbacks)) is not None:
            self.runner.model.ops = ops
        selfcheck = with_runner_capture(selfcheck, self.runner)
        self.requests: dict[str, CoreRequest] = {}
        self.grammars = CoreGrammars(self.model_config.vocab_size,
                                     config.structured_output_compile_timeout_s)
        samples = SampleMaker(self.scheduler, self.kv_manager, self.runner.copy_blocks,
                              self.grammars.matcher, self.device)
        self.commit = OutputCommit(self.requests, self.scheduler, self.kv_manager, samples,
                                   self.eos_token_ids, self.max_model_len)
        self.scheduler.on_preempt = self._on_preempt
        self.connector: KVConnector | None = None
        if connector is not None:
            shared = self.ranks.shared if self.ranks is not None else None
            self.connector = KVConnector(
                connector, self.kv_cache, setup.cache_file,
                ranks=shared.caches if shared else RankCaches((self.kv_cache,),
                                                              self.model_config),
                rank_files=shared.files if shared else (),
                rank_ipcs=shared.ipcs if shared else ())
            self.connector.start()
        self.exports = KVExports(self.requests, self.kv_manager, self.kv_cache, self.connector)
        self.admission = Admission(self.scheduler, self.kv_manager, self.kv_cache, samples,
                                   self.commit, self.model_config.vocab_size, self.connector)
        self._pending_outputs: set[str] = set()  # changed outside step() (commands)
        self._in_flight: InFlightStep | None = None  # async scheduling: a step not landed yet
        # Outputs that must leave before a step runs (a streamed export's announcement, which
        # starts the decode side's transfer while the first chunk computes); set by the loop
        # that sends outputs (core_loop.py). None: they are not sent (in-process `LLM`).
        self.send_early: Callable[[list[CoreOutput]], None] | None = None
        self.num_steps = 0
        self.step_seconds = 0.0  # host wall time inside steps: busy = its rate
        self.scheduled_tokens = 0
        self.step_cost_stats = PredictionStats()
        self._info = with_connector(msgspec.structs.replace(
            core_info(setup, config.block_size), selfcheck=selfcheck.summary(),
            selfcheck_fallbacks=selfcheck.fallbacks), self.connector)

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
        if self.ranks is not None and (request.kv is not None or (
                request.export_kv and self.connector is None)):
            raise ValueError("a tensor-parallel engine moves KV through its connector only "
                             "(kv_source, export_kv with a connector), not as a tensor")
        check_request(request, self.model_config.vocab_size, self.max_model_len)
        check_kv_import(request, self.model_config, self.kv_manager, self.config.block_size,
                        self.connector)
        if not request.export_kv:  # an export only ever holds its prompt, which is bounded
            self.check_kv_capacity(len(request.prompt_token_ids), request.params)
        state = CoreRequest(request.request_id, list(request.prompt_token_ids), request.params,
                            [], export_kv=request.export_kv)
        self.requests[request.request_id] = state
        try:  # from here on, any failure frees whatever the request holds
            self.admission.place(state, request)
            if request.stream_kv:
                self.exports.open_stream(state)
        except BaseException:
            self.abort_request(request.request_id)
            raise
        if (request.given_tokens is not None
                and request.request_id not in self.admission.loads.loading):
            self._pending_outputs.add(request.request_id)  # (a pull owes its output on landing)
        return state

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; every block it holds is returned (a lent export's
        too: its lease is then over)."""
        released = self.exports.release(request_id) if request_id in self.exports.lent else False
        self.exports.drop_stream(request_id)
        state = self.requests.pop(request_id, None)
        self._pending_outputs.discard(request_id)
        if state is None:
            return released
        if self.admission.loads.abandon(request_id):
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
                or self._in_flight is not None or bool(self.admission.loads.loading))

    def loads_in_flight(self) -> list[Future[int]]:
        """The KV pulls running on the connector's threads (the loop wakes when one ends)."""
        return self.admission.loads.futures()

    def kv_stream(self, request_id: str, progress: ExportProgress) -> bool:
        """A streamed source grew (the sender's `CoreOutput.kv_stream`, relayed by the
        serving processes); False if the request no longer waits for it."""
        return self.admission.loads.stream_progress(request_id, progress)

    def kv_stream_first_tokens(self, request_id: str, given_tokens: list[list[int]]) -> bool:
        """A streamed request's first tokens (its prefill ended): it decodes once its KV has
        landed; False if it no longer waits for them."""
        return self.admission.loads.stream_first_tokens(request_id, given_tokens,
                                                        self.max_model_len)

    def _on_preempt(self, seq: Sequence) -> None:
        self.commit.on_preempt(seq)
        self.exports.fail_stream(seq.request_id, "preempted")  # its blocks were freed

    # -- structured output ----------------------------------------------------------------------
    def close(self) -> None:
        """Release what outlives a step: the grammar compiler's threads and sandbox workers."""
        self.grammars.close()
        if self.connector is not None:
            self.connector.close()
            self.connector = None
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
        if self.kv_offload is not None:
            self.kv_offload.close()

    # -- KV export (the prefill role: engine/core/kv_exports.py)
    # -------------------------------------
    def read_kv(self, request_id: str) -> torch.Tensor:
        return self.exports.read(request_id)

    def export_kv(self, request_id: str) -> ExportInfo:
        return self.exports.lend(request_id)

    def release_kv(self, request_id: str) -> bool:
        return self.exports.release(request_id)

    def lend_prefix(self, lend_id: str, token_ids: list[int], cache_salt: str | None,
                    min_blocks: int = 1, max_blocks: int = 0) -> PrefixLoan:
        """Lend the leading blocks of `token_ids` this core holds (kv_exports.py), pinned
        under `lend_id` until `release_kv(lend_id)`."""
        params = SamplingParams()
        check_prompt(token_ids, params, self.model_config.vocab_size, self.max_model_len)
        seq = self.admission.samples.new(lend_id, 0, list(token_ids), len(token_ids), params,
                                         cache_salt=cache_salt)
        return self.exports.lend_prefix(lend_id, seq, min_blocks, max_blocks)

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
        if self.send_early is not None and self.exports.streams and not sched.is_empty:
            announced = self.exports.announce_scheduled(s.seq.request_id
                                                        for s in sched.scheduled)
            if announced:
                self.send_early(announced)
        if sched.is_empty:
            if previous is None:
                self._check_progress()
            return self.exports.with_progress(self.commit.update_from_output(
                touched, previous=previous))
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
        return self.exports.with_progress(outputs)

    def _check_progress(self) -> None:
        """Nothing was scheduled and nothing is in flight: only pinned KV may hold it up."""
        pinned = self.exports.any_pinned() or bool(self.admission.loads.loading)
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
        events: list[KVEvent] = [AllBlocksCleared()]
        if hashes:
            events.append(BlockStored(hashes))
        if self.kv_offload is not None:
            events += [BlockStored(tuple(held), None, medium)
                       for medium, held in self.kv_offload.held_hashes().items() if held]
        return events

    def load(self) -> EngineLoadSnapshot:
        return load_snapshot(self)  # (engine/core/load_snapshot.py)

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_manager.pool.num_blocks
