"""The self-check's probe: a model of the engine's shape with two layers and random weights,
driven by real model runners over KV caches of its own, to check CUDA-graph replay and async
scheduling's pending-token path against eager, synchronous steps (engine/worker/selfcheck.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from pdmesh.engine.block_hash import HashScheme
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import ScheduledSeq, SchedulerOutput
from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.engine.worker.cuda_graphs import graphs_unavailable_reason
from pdmesh.engine.worker.in_flight import InFlightStep
from pdmesh.engine.worker.model_loader import dummy_state, meta_without_init
from pdmesh.engine.worker.model_runner import ModelRunner
from pdmesh.engine.worker.models.llama import LlamaForCausalLM
from pdmesh.engine.worker.sampler import Sampler
from pdmesh.engine.worker.selfcheck_result import (
    CheckResult,
    Skip,
    dtype_name,
    first_problem,
    mismatch,
    run_check,
)
from pdmesh.engine.worker.step_sampling import StepSampler
from pdmesh.kernels.backend import AttentionBackend

PROBE_LAYERS = 2
PROBE_VOCAB = 4096
PROBE_MAX_SEQS = 4  # buckets 1, 2, 4: the probe's 3 sequences replay bucket 4, one row padded
PROBE_DECODE_STEPS = 4


def probe_model(model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype,
                seed: int = 0) -> LlamaForCausalLM:
    """A model of `model`'s shape with `PROBE_LAYERS` layers, a vocabulary of at most
    `PROBE_VOCAB` and random weights (norms 1, matrices N(0, 0.02), as `--load-format dummy`);
    it shares `model`'s RoPE tables, which nothing writes."""
    cfg = dataclasses.replace(model.cfg, num_layers=PROBE_LAYERS,
                              vocab_size=min(model.cfg.vocab_size, PROBE_VOCAB))
    with meta_without_init():  # the loader's way: no initializer runs on meta tensors
        probe = LlamaForCausalLM(cfg, None)
    state = dummy_state(probe, dtype, device, seed)
    probe.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        probe.lm_head.weight = probe.embed_tokens.weight
    probe.rope = model.rope
    return probe.eval()


def probe_prompts(probe: LlamaForCausalLM, block_size: int, steps: int, seed: int = 0
                  ) -> list[list[int]]:
    """Three prompts: one 20 blocks and some long (its decode context spans several splits of
    the Triton decode kernel), a short one, one just past two blocks; none longer than the
    RoPE table leaves room for `steps` more tokens."""
    assert probe.rope is not None
    room = probe.rope.cos.shape[0] - steps - 1
    gen = torch.Generator().manual_seed(seed)
    lengths = (20 * block_size + 5, 7, 2 * block_size + 1)
    return [torch.randint(0, probe.cfg.vocab_size, (min(n, room),), generator=gen).tolist()
            for n in lengths]


def probe_runner(model: LlamaForCausalLM, block_size: int, backend: AttentionBackend,
                 device: torch.device, prompts: list[list[int]], steps: int, *,
                 enforce_eager: bool, async_scheduling: bool = False
                 ) -> tuple[ModelRunner, KVCacheManager]:
    """A model runner over a KV cache of its own, just large enough for `prompts` + `steps`."""
    blocks = sum(-(-(len(p) + steps) // block_size) for p in prompts) + 2
    kv = KVCacheManager(blocks, HashScheme(block_size=block_size), enable_prefix_caching=False)
    cfg, dtype = model.cfg, model.embed_tokens.weight.dtype
    cache = torch.zeros(cfg.num_layers, 2, blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                        dtype=dtype, device=device)
    runner = ModelRunner(model, cache, kv, backend, device, max_num_seqs=PROBE_MAX_SEQS,
                         max_num_batched_tokens=sum(len(p) for p in prompts),
                         enforce_eager=enforce_eager,
                         sampling=StepSampler(Sampler(seed=0, device=device), (), device),
                         async_scheduling=async_scheduling)
    return runner, kv


@dataclass
class ProbeRun:
    tokens: list[list[int]]  # greedy ids per sequence
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, sampling rows in order
    replays: int = 0  # decode steps that replayed a CUDA graph


def _sequences(prompts: list[list[int]]) -> list[Sequence]:
    greedy = SamplingParams(temperature=0.0)
    return [Sequence(f"probe-{i}", f"probe-{i}", 0, list(p), len(p), greedy)
            for i, p in enumerate(prompts)]


def _schedule(kv: KVCacheManager, seqs: list[Sequence], first: bool) -> list[ScheduledSeq]:
    scheduled = []
    for seq in seqs:
        n = seq.num_tokens if first else 1
        if not kv.allocate_slots(seq, n):
            raise RuntimeError("the probe's KV cache is too small")
        scheduled.append(ScheduledSeq(seq, n))
    return scheduled


def drive_logits(runner: ModelRunner, kv: KVCacheManager, prompts: list[list[int]], steps: int,
                 forced: list[list[int]] | None = None) -> ProbeRun:
    """Prefill every prompt in one step, then decode them together greedily, keeping each
    step's logits. With `forced`, those ids are fed instead of this run's own (teacher
    forcing), so two runners see the same inputs and their logits compare."""
    seqs = _sequences(prompts)
    run = ProbeRun([[] for _ in seqs])
    scheduled = _schedule(kv, seqs, first=True)
    try:
        for step in range(steps):
            inputs = runner.prepare(scheduled)
            graphs = runner.cuda_graphs
            run.replays += graphs is not None and graphs.bucket_for(inputs) is not None
            logits = runner.execute(inputs)
            for entry in inputs.order:
                entry.seq.num_computed_tokens += entry.num_new_tokens
            rows = [inputs.sample_index[seq.seq_id] for seq in seqs]
            picked = logits[rows]
            run.logits.append(picked)
            for i, (seq, tok) in enumerate(zip(seqs, picked.argmax(-1).tolist(), strict=True)):
                run.tokens[i].append(tok)
                seq.token_ids.append(forced[i][step] if forced is not None else tok)
            scheduled = _schedule(kv, seqs, first=False)
    finally:
        for seq in seqs:
            kv.free(seq.seq_id)
    return run


def drive_sampled(runner: ModelRunner, kv: KVCacheManager, prompts: list[list[int]],
                  steps: int) -> ProbeRun:
    """Greedy steps through `execute_model`, as the engine core runs them: with async
    scheduling each step is launched before the previous one's ids are landed (its decode
    rows read them on the device), and every step must be left in flight."""
    seqs = _sequences(prompts)
    run = ProbeRun([[] for _ in seqs])
    scheduled = _schedule(kv, seqs, first=True)
    previous: InFlightStep | None = None

    def land(step: InFlightStep) -> None:
        for seq, tok in step.land():
            seq.token_ids.append(tok)
            run.tokens[seqs.index(seq)].append(tok)

    try:
        for _ in range(steps):
            out = runner.execute_model(SchedulerOutput(scheduled), previous)
            for entry in out.order:
                entry.seq.num_computed_tokens += entry.num_new_tokens
            if previous is not None:
                land(previous)
            previous = out.in_flight
            if runner.async_scheduling and previous is None:
                raise RuntimeError("a greedy decode step was not left in flight")
            for seq, samples in out.sampled:
                seq.token_ids.append(samples[0].token_id)
                run.tokens[seqs.index(seq)].append(samples[0].token_id)
            scheduled = _schedule(kv, seqs, first=False)
        if previous is not None:
            land(previous)
    finally:
        for seq in seqs:
            kv.free(seq.seq_id)
    return run


def check_graph_replay(probe: LlamaForCausalLM, block_size: int, backend: AttentionBackend,
                       device: torch.device, enforce_eager: bool = False) -> CheckResult:
    """The probe's decode steps replayed from CUDA graphs against the same steps run eagerly:
    three sequences in the 4-row bucket (one padding row), one with a context of several
    decode splits. Logits finite and equal step by step, and the two KV caches equal at the
    end: a padding row (slot -1) that wrote anything, at capture or at a replay, shows."""
    dtype = probe.embed_tokens.weight.dtype

    def body() -> str | None:
        why_not = graphs_unavailable_reason(device, backend, enforce_eager)
        if why_not is not None:
            raise Skip(why_not)
        steps = PROBE_DECODE_STEPS + 1
        prompts = probe_prompts(probe, block_size, steps)
        eager, eager_kv = probe_runner(probe, block_size, backend, device, prompts, steps,
                                       enforce_eager=True)
        graphed, graphed_kv = probe_runner(probe, block_size, backend, device, prompts, steps,
                                           enforce_eager=False)
        if graphed.cuda_graphs is None:
            return f"capture: {graphed.graphs_disabled_reason or 'none captured'}"
        ref = drive_logits(eager, eager_kv, prompts, steps)
        got = drive_logits(graphed, graphed_kv, prompts, steps, forced=ref.tokens)
        if got.replays != PROBE_DECODE_STEPS:
            return f"{got.replays} of {PROBE_DECODE_STEPS} decode steps replayed a graph"
        problems = [mismatch(f"step {i} logits", b, a, dtype)
                    for i, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True))]
        problems.append(mismatch("kv cache", graphed.kv_cache, eager.kv_cache, dtype))
        return first_problem(*problems)

    return run_check(f"cuda_graphs[{dtype_name(dtype)}]", device, ("cuda_graphs",), body)


def check_async_pending(probe: LlamaForCausalLM, block_size: int, backend: AttentionBackend,
                        device: torch.device, enforce_eager: bool = False) -> CheckResult:
    """Greedy steps with async scheduling (each decode row's input read on the device from
    the step still in flight) against the same steps run synchronously: the same tokens."""
    dtype = probe.embed_tokens.weight.dtype

    def body() -> str | None:
        steps = PROBE_DECODE_STEPS + 1
        prompts = probe_prompts(probe, block_size, steps, seed=1)
        runs = []
        for overlap in (False, True):
            runner, kv = probe_runner(probe, block_size, backend, device, prompts, steps,
                                      enforce_eager=enforce_eager, async_scheduling=overlap)
            runs.append(drive_sampled(runner, kv, prompts, steps))
        sync, overlapped = runs
        if overlapped.tokens != sync.tokens:
            return f"tokens {overlapped.tokens} differ from the synchronous {sync.tokens}"
        return None

    return run_check(f"async_pending[{dtype_name(dtype)}]", device, ("async_scheduling",),
                     body)
