"""The persistent batch gives every step exactly the inputs a from-scratch build gives.

The reference is the model runner's old `prepare()` (Python lists of every new token and a
padded block table, rebuilt each step), kept here verbatim as `reference_prepare`. A seeded
random workload adds, chunks, decodes, forks, preempts, finishes and re-admits sequences over
many steps (prefix-cache hits and prompt logprobs included), so rows are reused, block tables
grow, and rows leave the batch through every path the engine has.
"""

from __future__ import annotations

import random
from itertools import accumulate

import pytest
import torch

from pdmesh.engine.block_hash import HashScheme
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import ScheduledSeq
from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.engine.worker.input_batch import InputBatch
from pdmesh.engine.worker.model_runner import ModelRunner, StepInputs
from pdmesh.engine.worker.models.architecture import ModelConfig
from pdmesh.engine.worker.models.llama import LlamaForCausalLM, RotaryEmbedding
from pdmesh.kernels.backend_selection import get_attention_backend

pytestmark = pytest.mark.fast

BS = 4
MAX_POSITIONS = 256


def reference_prepare(kv: KVCacheManager, scheduled: list[ScheduledSeq]) -> dict[str, object]:
    """The old ModelRunner.prepare, field for field, as plain values."""
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    prefills = [s for s in scheduled if s.num_new_tokens > 1]
    order = decodes + prefills
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    row_start: list[int] = []
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    logits_rows: list[int] = []
    sample_index: dict[str, int] = {}
    prompt_logits: dict[str, tuple[int, int]] = {}
    for entry in order:
        seq, n = entry.seq, entry.num_new_tokens
        start = seq.num_computed_tokens
        end = start + n
        table = kv.block_ids(seq.seq_id)
        row_start.append(len(input_ids))
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += [table[p // BS] * BS + p % BS for p in range(start, end)]
        tables.append(table)
        seq_lens.append(end)
        rows_begin = len(input_ids) - n
        sample_row = len(input_ids) - 1 if end == seq.num_tokens else None
        if seq.want_prompt_logprobs and start < seq.num_prompt_tokens:
            first = len(logits_rows)
            logits_rows += range(rows_begin, rows_begin + min(end, seq.num_prompt_tokens) - start)
            prompt_logits[seq.seq_id] = (first, len(logits_rows))
            if sample_row == logits_rows[-1]:
                sample_index[seq.seq_id] = len(logits_rows) - 1
        if sample_row is not None and seq.seq_id not in sample_index:
            sample_index[seq.seq_id] = len(logits_rows)
            logits_rows.append(sample_row)
    nd = len(decodes)
    max_blocks = max((len(t) for t in tables), default=1) or 1
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    return {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": slots,
        "num_decode_tokens": nd,
        "decode_block_tables": padded[:nd],
        "decode_seq_lens": seq_lens[:nd],
        "prefill_query_start_loc": [0, *accumulate(e.num_new_tokens for e in prefills)],
        "prefill_seq_lens": seq_lens[nd:],
        "prefill_block_tables": padded[nd:],
        "order": [e.seq.seq_id for e in order],
        "row_start": row_start,
        "logits_rows": logits_rows,
        "sample_index": sample_index,
        "prompt_logits": prompt_logits,
    }


def observed(inputs: StepInputs) -> dict[str, object]:
    meta = inputs.meta
    return {
        "input_ids": inputs.input_ids.tolist(),
        "positions": inputs.positions.tolist(),
        "slot_mapping": meta.slot_mapping.tolist(),
        "num_decode_tokens": meta.num_decode_tokens,
        "decode_block_tables": meta.decode_block_tables.tolist(),
        "decode_seq_lens": meta.decode_seq_lens.tolist(),
        "prefill_query_start_loc": list(meta.prefill_query_start_loc),
        "prefill_seq_lens": list(meta.prefill_seq_lens),
        "prefill_block_tables": meta.prefill_block_tables.tolist(),
        "order": [e.seq.seq_id for e in inputs.order],
        "row_start": list(inputs.row_start),
        "logits_rows": list(inputs.logits_rows),
        "sample_index": dict(inputs.sample_index),
        "prompt_logits": dict(inputs.prompt_logits),
    }


def check_staging(inputs: StepInputs) -> None:
    """The prefill offsets and lengths travel staged, equal to the lists; every tensor a
    kernel reads starts 16-byte aligned (Triton specialises on pointer alignment)."""
    meta = inputs.meta
    assert meta.prefill_query_start_loc_tensor is not None
    assert meta.prefill_seq_lens_tensor is not None
    assert meta.prefill_query_start_loc_tensor.tolist() == meta.prefill_query_start_loc
    assert meta.prefill_seq_lens_tensor.tolist() == meta.prefill_seq_lens
    staged = [inputs.input_ids, inputs.positions, inputs.logits_index, meta.slot_mapping,
              meta.decode_block_tables, meta.decode_seq_lens, meta.prefill_block_tables,
              meta.prefill_query_start_loc_tensor, meta.prefill_seq_lens_tensor,
              inputs.pending_dst, inputs.pending_src]
    for tensor in staged:
        assert tensor is None or tensor.data_ptr() % 16 == 0


def tiny_runner(kv: KVCacheManager, **kwargs: object) -> ModelRunner:
    cfg = ModelConfig("llama", 64, 16, 32, 1, 2, 1, 8, 1e-5, MAX_POSITIONS, False, False, False)
    model = LlamaForCausalLM(cfg, RotaryEmbedding(torch.ones(4), 1.0, MAX_POSITIONS))
    cache = torch.zeros(1, 2, kv.pool.num_blocks, BS, 1, 8)
    cpu = torch.device("cpu")
    return ModelRunner(model, cache, kv, get_attention_backend("cpu", cpu), cpu, **kwargs)


class Workload:
    """A seeded stand-in for scheduler + engine: what reaches the runner, and the KV calls."""

    def __init__(self, kv: KVCacheManager, seed: int) -> None:
        self.kv = kv
        self.rng = random.Random(seed)
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.count = 0
        self.prefix = [self.rng.randrange(64) for _ in range(3 * BS)]  # shared: cache hits

    def new_seq(self) -> Sequence:
        self.count += 1
        n = self.rng.randrange(1, 30)
        tokens = (self.prefix[: self.rng.randrange(len(self.prefix))]
                  + [self.rng.randrange(64) for _ in range(n)])
        params = SamplingParams(prompt_logprobs=1 if self.rng.random() < 0.2 else None)
        seq = Sequence(f"s{self.count}", f"r{self.count}", 0, tokens, len(tokens), params)
        seq.want_prompt_logprobs = params.prompt_logprobs is not None
        return seq

    def schedule(self, max_seqs: int, budget: int) -> list[ScheduledSeq]:
        rng = self.rng
        if rng.random() < 0.3 or not self.running:
            self.waiting.append(self.new_seq())
        out: list[ScheduledSeq] = []
        for seq in list(self.running):
            if len(out) >= max_seqs or budget <= 0:
                break
            if rng.random() < 0.15:  # not scheduled this step: the row must survive
                continue
            n = min(seq.num_uncomputed_tokens, budget, rng.randrange(1, 12))
            if not self.kv.allocate_slots(seq, n):
                self.preempt(seq)
                continue
            out.append(ScheduledSeq(seq, n))
            budget -= n
        while self.waiting and len(out) < max_seqs and budget > 0:
            seq = self.waiting[0]
            hits = self.kv.find_cached_prefix(seq) if not seq.num_computed_tokens else []
            n = min(seq.num_tokens - len(hits) * BS, budget, rng.randrange(1, 40))
            if not self.kv.allocate_slots(seq, n, hits):
                break
            seq.num_computed_tokens = len(hits) * BS
            self.waiting.pop(0)
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        rng.shuffle(out)  # the runner orders them itself
        return out

    def preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self.running.remove(seq)
        self.waiting.append(seq)

    def after_step(self, scheduled: list[ScheduledSeq]) -> None:
        rng = self.rng
        for entry in scheduled:
            seq = entry.seq
            seq.num_computed_tokens += entry.num_new_tokens
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.want_prompt_logprobs = False
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(rng.randrange(64))  # "sampled"
        for seq in list(self.running):
            roll = rng.random()
            if roll < 0.04 or seq.num_tokens > MAX_POSITIONS - 40:  # finished
                self.kv.free(seq.seq_id)
                self.running.remove(seq)
            elif roll < 0.07:
                self.preempt(seq)
            elif roll < 0.10 and not seq.is_prefilling and seq.num_computed_tokens:
                self.fork(seq)

    def fork(self, parent: Sequence) -> None:
        self.count += 1
        child = Sequence(f"s{self.count}", parent.request_id, 1, list(parent.token_ids),
                         parent.num_prompt_tokens, parent.params)
        try:
            copy = self.kv.fork(parent, child)
        except RuntimeError:
            return
        del copy  # the KV copy is the engine's business, not the inputs'
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.append(child)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("sizes", ["runner", "one-of-each"])
def test_persistent_batch_matches_a_from_scratch_build(seed: int, sizes: str) -> None:
    kv = KVCacheManager(96, HashScheme(block_size=BS), enable_prefix_caching=True)
    # Small preallocations on purpose: rows, step buffers and the block table's width must
    # grow when a step needs more.
    if sizes == "runner":
        prepare = tiny_runner(kv, max_num_seqs=2, max_num_batched_tokens=8).prepare
    else:
        prepare = InputBatch(kv, torch.device("cpu"), 1, 1, max_blocks_per_seq=1).prepare
    work = Workload(kv, seed)
    kinds = {"decode": 0, "prefill": 0, "mixed": 0}
    for _ in range(400):
        scheduled = work.schedule(max_seqs=6, budget=48)
        if not scheduled:
            work.after_step([])
            continue
        expected = reference_prepare(kv, scheduled)
        inputs = prepare(scheduled)
        assert observed(inputs) == expected
        check_staging(inputs)
        nd = expected["num_decode_tokens"]
        kinds["decode" if nd == len(scheduled) else "prefill" if nd == 0 else "mixed"] += 1
        work.after_step(scheduled)
    assert all(kinds.values()), kinds  # every kind of step was exercised


def test_rows_leave_the_batch_when_blocks_are_freed() -> None:
    kv = KVCacheManager(32, HashScheme(block_size=BS), enable_prefix_caching=False)
    runner = tiny_runner(kv, max_num_seqs=4)
    seqs = [Sequence(f"s{i}", f"r{i}", 0, list(range(5 + i)), 5 + i, SamplingParams())
            for i in range(3)]
    for seq in seqs:
        assert kv.allocate_slots(seq, seq.num_tokens)
    runner.prepare([ScheduledSeq(s, s.num_tokens) for s in seqs])
    assert runner.batch.num_rows == 3
    kv.free("s1")
    assert runner.batch.num_rows == 2
    kv.free("s0")
    kv.free("s2")
    assert runner.batch.num_rows == 0
