"""Turns a scheduled step into tensors, runs the model, and returns the logits it needs.

Tokens of the step are laid out decodes first (one token per sequence), then prompt chunks,
which is the order attention backends expect. Only rows whose logits are used — the last
token of a sequence that will sample, and every prompt row when prompt logprobs were asked
for — go through the LM head, which is the largest GEMM of a small model.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from pdmesh.engine.kv_cache_manager import KVCacheManager
from pdmesh.engine.models.llama import LlamaForCausalLM, can_pack_linears, pack_linears
from pdmesh.engine.scheduler import ScheduledSeq
from pdmesh.kernels.backend import AttentionBackend, AttentionMetadata
from pdmesh.kernels.layer_ops import select_layer_ops


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[ScheduledSeq]  # scheduled sequences in row order
    row_start: list[int]  # first row of each entry of `order`
    logits_rows: list[int]  # rows whose logits are computed
    sample_index: dict[str, int]  # seq_id -> index into logits of its sampling row
    prompt_logits: dict[str, tuple[int, int]]  # seq_id -> (first, end) index into logits


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        kv_manager: KVCacheManager,
        backend: AttentionBackend,
        device: torch.device,
    ) -> None:
        if can_pack_linears(device, kv_cache.dtype):
            pack_linears(model)
        model.ops = select_layer_ops(device)
        self.model = model
        self.kv_cache = kv_cache
        self.kv = kv_manager
        self.backend = backend
        self.device = device
        self.block_size = kv_manager.block_size

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
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
        bs = self.block_size
        for entry in order:
            seq, n = entry.seq, entry.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            table = self.kv.block_ids(seq.seq_id)
            row_start.append(len(input_ids))
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            tables.append(table)
            seq_lens.append(end)
            rows_begin = len(input_ids) - n
            sample_row = len(input_ids) - 1 if end == seq.num_tokens else None
            if seq.want_prompt_logprobs and start < seq.num_prompt_tokens:
                first = len(logits_rows)
                logits_rows += range(
                    rows_begin, rows_begin + min(end, seq.num_prompt_tokens) - start
                )
                prompt_logits[seq.seq_id] = (first, len(logits_rows))
                if sample_row == logits_rows[-1]:
                    sample_index[seq.seq_id] = len(logits_rows) - 1
            if sample_row is not None and seq.seq_id not in sample_index:
                sample_index[seq.seq_id] = len(logits_rows)
                logits_rows.append(sample_row)
        nd = len(decodes)
        max_blocks = max((len(t) for t in tables), default=1) or 1
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        dev = self.device
        table_tensor = torch.tensor(padded, dtype=torch.long, device=dev).view(-1, max_blocks)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode_tokens=nd,
            decode_block_tables=table_tensor[:nd],
            decode_seq_lens=torch.tensor(seq_lens[:nd], dtype=torch.long, device=dev),
            prefill_query_start_loc=[0, *accumulate(e.num_new_tokens for e in prefills)],
            prefill_seq_lens=seq_lens[nd:],
            prefill_block_tables=table_tensor[nd:],
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            order=order,
            row_start=row_start,
            logits_rows=logits_rows,
            sample_index=sample_index,
            prompt_logits=prompt_logits,
        )

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run the model; returns float32 logits `[len(logits_rows), vocab]`."""
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, self.backend
        )
        if not inputs.logits_rows:
            return hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        rows = torch.tensor(inputs.logits_rows, dtype=torch.long, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V): copy-on-write when a sequence forks."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.kv_cache.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.kv_cache.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
