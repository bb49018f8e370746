"""Runs a scheduled step: its inputs from the persistent batch, the model, its samples.

Tokens of a step are laid out decodes first (one token per sequence), then prompt chunks,
which is the order attention backends expect (engine/worker/input_batch.py builds them). Only rows
whose logits are used — the last token of a sequence that will sample, and every prompt row
when prompt logprobs were asked for — go through the LM head, which is the largest GEMM of a
small model. On CUDA, pure-decode steps replay a CUDA graph captured for their padded batch
size (engine/worker/cuda_graphs.py) unless `enforce_eager` is set; everything else runs eagerly.
A capture that fails (a kernel that cannot be captured, memory) leaves the runner eager: one
WARNING, and `graphs_disabled_reason` says why (the start-up self-check reports it).

`execute_model` is the step's whole device side: inputs, forward, prompt logprobs, sampling
(engine/worker/step_sampling.py). With async scheduling, a step whose samples need nothing from the
host is sampled on the device and left in flight (engine/worker/in_flight.py); the engine commits
what it sampled (engine/core/output_commit.py).

With tensor parallelism the engine core's runner is the first rank's: it sends every step's
inputs (and block copies) to the other ranks (`channel`, engine/worker/parallel/step_channel.py)
before its own forward, whose collectives they join; they run `execute` on what they receive.
Decode steps then run eagerly (no CUDA graphs yet: a graph would have to capture the
collectives on every rank alike).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pdmesh.engine.core_types import RawLogprob
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import ScheduledSeq, SchedulerOutput
from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.engine.worker.cuda_graphs import (
    DecodeGraphs,
    block_table_width,
    graphs_unavailable_reason,
)
from pdmesh.engine.worker.in_flight import InFlightStep, may_overlap
from pdmesh.engine.worker.input_batch import InputBatch, PendingTokens, StepInputs
from pdmesh.engine.worker.model_loader import drop_file_pages, release_free_heap
from pdmesh.engine.worker.models.llama import LlamaForCausalLM, pack_linears
from pdmesh.engine.worker.models.packed_linear import can_pack_linears
from pdmesh.engine.worker.parallel.step_channel import StepChannel
from pdmesh.engine.worker.step_sampling import Sample, StepSampler, prompt_logprobs
from pdmesh.kernels.backend import AttentionBackend
from pdmesh.kernels.layer_ops import select_layer_ops

__all__ = ["ModelOutput", "ModelRunner", "PendingTokens", "StepInputs"]

logger = logging.getLogger(__name__)


@dataclass
class ModelOutput:
    """What one step computed, for the engine to commit: the sequences it ran (row order),
    prompt logprobs of the prompt positions it scored, and its samples, either on the host
    or still in flight on the device."""

    order: list[ScheduledSeq]
    prompt_logprobs: dict[str, list[RawLogprob]] = field(default_factory=dict)  # by seq_id
    sampled: list[tuple[Sequence, list[Sample]]] = field(default_factory=list)
    in_flight: InFlightStep | None = None


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        kv_manager: KVCacheManager,
        backend: AttentionBackend,
        device: torch.device,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enforce_eager: bool = False,
        sampling: StepSampler | None = None,
        async_scheduling: bool = False,
        max_model_len: int | None = None,
        channel: StepChannel | None = None,
    ) -> None:
        """`max_model_len`: the engine's context limit, which sizes the block tables (and so
        the graphs' decode splits); None: the model's position table. `channel`: the first
        rank's line to the other tensor-parallel ranks."""
        if can_pack_linears(device, kv_cache.dtype):
            pack_linears(model)
        if device.type == "cpu":
            # What packing read of the checkpoint's mapping, and the heap the load's
            # temporaries and the replaced weights left free, out of the core's RSS.
            drop_file_pages(model)
            release_free_heap()
        model.ops = select_layer_ops(device)
        self.model = model
        self.kv_cache = kv_cache
        self.kv = kv_manager
        self.backend = backend
        self.device = device
        self.block_size = kv_manager.block_size
        self.sampling = sampling  # None: a runner that only computes logits (tests)
        self.async_scheduling = async_scheduling
        self.channel = channel
        self.batch = InputBatch(
            kv_manager, device, max_num_seqs, max_num_batched_tokens,
            _max_blocks_per_seq(model, kv_manager, max_model_len),
        )  # fmt: skip
        self.cuda_graphs: DecodeGraphs | None = None
        # Why decode steps run eagerly (None while graphs are in use), and whether that is a
        # fallback (graphs were wanted, their capture failed) rather than a setting.
        self.graphs_disabled_reason: str | None = None
        self.graphs_capture_failed = False
        why_not = graphs_unavailable_reason(device, backend, enforce_eager)
        if why_not is None and model.tp.world_size > 1:
            why_not = "tensor parallelism (decode steps run eagerly)"
        if why_not is None:
            self.use_graphs(DecodeGraphs(
                model, kv_cache, backend, device, max_num_seqs, self.batch.max_blocks_per_seq
            ))  # fmt: skip
        else:
            self.graphs_disabled_reason = why_not
            if device.type == "cuda":
                logger.info("cuda graphs off: %s", why_not)

    def use_graphs(self, graphs: DecodeGraphs) -> bool:
        """Capture `graphs` and replay them from now on; on failure stay eager (their pool is
        freed by then) and say so once. Returns whether they are in use."""
        try:
            graphs.capture()
        except Exception as exc:  # whatever broke the capture, eager decode still works
            self.cuda_graphs = None
            self.graphs_capture_failed = True
            self.graphs_disabled_reason = f"capture failed: {type(exc).__name__}: {exc}"
            logger.warning("cuda_graphs=off fallback=eager reason=%r: decode steps run "
                           "without CUDA graphs", self.graphs_disabled_reason)
            return False
        self.cuda_graphs = graphs
        self.graphs_disabled_reason = None
        self.graphs_capture_failed = False
        return True

    def execute_model(
        self, sched: SchedulerOutput, previous: InFlightStep | None = None
    ) -> ModelOutput:
        """Run a scheduled step and sample it. `previous`: the step still in flight, whose
        ids this step's decode rows read on the device."""
        assert self.sampling is not None, "this runner was built without a sampler"
        pending = previous.pending() if previous is not None else None
        inputs = self.prepare(sched.scheduled, pending)
        logits = self.execute(inputs)
        out = ModelOutput(inputs.order)
        for seq in (e.seq for e in inputs.order if e.seq.seq_id in inputs.prompt_logits):
            first, end = inputs.prompt_logits[seq.seq_id]
            out.prompt_logprobs[seq.seq_id] = prompt_logprobs(seq, logits[first:end])
        to_sample = [e.seq for e in inputs.order if e.seq.seq_id in inputs.sample_index]
        if not to_sample:
            return out
        if (self.async_scheduling and not inputs.prompt_logits
                and all(may_overlap(seq) for seq in to_sample)):
            out.in_flight = self.sampling.launch(logits, to_sample, inputs.sample_index)
        else:
            out.sampled = self.sampling.sample(logits, to_sample, inputs.sample_index)
        return out

    def prepare(
        self, scheduled: list[ScheduledSeq], pending: PendingTokens | None = None
    ) -> StepInputs:
        return self.batch.prepare(scheduled, pending)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run the model; returns float32 logits `[len(logits_rows), vocab]`."""
        inputs.fill_pending()
        if self.channel is None:
            return self._execute(inputs)
        self.channel.send_step(inputs)
        try:
            return self._execute(inputs)
        except Exception as exc:  # the other ranks may wait in a collective forever
            self.channel.fail(f"{type(exc).__name__}: {exc}")
            raise

    def _execute(self, inputs: StepInputs) -> torch.Tensor:
        graphs = self.cuda_graphs
        bucket = graphs.bucket_for(inputs) if graphs is not None else None
        if graphs is not None and bucket is not None:
            hidden = graphs.replay(inputs, bucket)
        else:
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, self.backend
            )
        if not inputs.logits_rows:
            return hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        rows = inputs.logits_index
        if rows is None:
            rows = torch.tensor(inputs.logits_rows, dtype=torch.long, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V): copy-on-write when a sequence forks."""
        if not pairs:
            return
        if self.channel is not None:
            self.channel.send_copies(pairs)
        src = torch.tensor([p[0] for p in pairs], device=self.kv_cache.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.kv_cache.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]


def _max_blocks_per_seq(
    model: LlamaForCausalLM, kv_manager: KVCacheManager, max_model_len: int | None
) -> int:
    """No sequence outgrows the engine's max_model_len, the model's RoPE table, nor the whole
    cache."""
    num_blocks = kv_manager.pool.num_blocks
    tokens = None if model.rope is None else int(model.rope.cos.shape[0])
    if max_model_len is not None:
        tokens = max_model_len if tokens is None else min(tokens, max_model_len)
    if tokens is None:
        return num_blocks
    return block_table_width(tokens, kv_manager.block_size, num_blocks)
