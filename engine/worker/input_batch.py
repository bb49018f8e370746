"""The persistent batch: per-sequence rows that live across steps, and the step's input buffers.

Rebuilding a step from scratch meant walking every sequence's whole block table in Python,
padding it into nested lists and calling `torch.tensor(...)` on each list, every step. Here:

- Each sequence that has been scheduled owns a row of a host block table (numpy) for as long
  as it holds KV blocks. A step copies in only what changed — the blocks appended since the
  last step (a decode adds one every `block_size` tokens). A row leaves when the KV cache
  manager frees the sequence's blocks (finished, preempted, aborted): the manager's free hook
  tells the batch, so the engine core never has to.
- A step's inputs (token ids, positions, slot mapping, sequence lengths, rows of the logits,
  the step's block table) are computed with vectorised numpy into one preallocated int64
  staging buffer, packed back to back, and cross to the device in a single copy. On CUDA the
  staging buffers are pinned and there are two of them, used in turn, each guarded by an
  event, so a step can be prepared while the previous one's copy is still in flight. On CPU
  the staging buffer is the step's input: no copy at all. The prefill chunks' offsets and
  context lengths travel in the same copy, so attention backends never copy them themselves
  (a blocking copy on every step with a prompt chunk). Each section starts 16-byte aligned
  (`_ALIGN`): Triton specialises kernels on their pointers' alignment, and a view at an odd
  offset would compile another variant of the attention kernels mid-serving.

With async scheduling a step is prepared before the previous one's sampled ids reach the
host: a decode row whose input is such an in-flight token (`Sequence.num_pending`) is staged
as 0 and names its source row in the previous step's device tensor of sampled ids
(`PendingTokens`); the model runner gathers those ids on the device before the forward.

Row order in a step is what attention backends expect: decodes first (one token each), then
prompt chunks; `StepInputs` keeps the bookkeeping the engine core reads (`order`,
`sample_index`, `prompt_logits`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.engine.scheduling.scheduler import ScheduledSeq
from pdmesh.kernels.backend import AttentionMetadata


@dataclass
class PendingTokens:
    """The sampled ids of a step still in flight: on the device, and each sequence's row."""

    ids: torch.Tensor  # [rows] int64 on the device
    row_of: Mapping[str, int]  # seq_id -> row of `ids`


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
    logits_index: torch.Tensor | None = None  # `logits_rows` on the device (None: build it)
    # Rows of `input_ids` still to be gathered from an in-flight step's sampled ids, and
    # their sources in `pending_ids` (async scheduling); None when every input is known.
    pending_ids: torch.Tensor | None = None
    pending_dst: torch.Tensor | None = None
    pending_src: torch.Tensor | None = None

    def fill_pending(self) -> None:
        """Write the in-flight tokens into `input_ids`, on the device, without a sync."""
        if self.pending_ids is not None:
            assert self.pending_dst is not None and self.pending_src is not None
            self.input_ids.index_copy_(0, self.pending_dst,
                                       self.pending_ids.index_select(0, self.pending_src))


@dataclass
class _Logits:
    """Which rows of a step go through the LM head, and what the engine reads back."""

    rows: list[int]
    sample_index: dict[str, int]
    prompt_logits: dict[str, tuple[int, int]]


_ALIGN = 2
"""Sections of the staging buffer start at multiples of this many int64s: 16 bytes, the
pointer alignment Triton specialises a kernel on."""


_SECTIONS = 11  # of a step's packed layout (`InputBatch.prepare`)


def _pack(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of consecutive sections of `sizes` elements, each rounded up to `_ALIGN`, and
    the elements they span."""
    offsets: list[int] = []
    end = 0
    for size in sizes:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + size
    return offsets, end


class _Staging:
    """One int64 buffer on the host (pinned on CUDA) and, on CUDA, its device twin."""

    def __init__(self, size: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=cuda)
        self.np = self.host.numpy()
        self.device = torch.empty(size, dtype=torch.int64, device=device) if cuda else self.host
        self.copied = torch.cuda.Event(blocking=True) if cuda else None
        self.in_flight = False

    def wait_copy(self) -> None:
        """Block until the last copy out of `host` is done, so it may be overwritten."""
        if self.in_flight and self.copied is not None:
            self.copied.synchronize()
        self.in_flight = False

    def send(self, used: int) -> torch.Tensor:
        """The first `used` elements on the device (one async copy on CUDA)."""
        if self.copied is None:
            return self.host
        self.device[:used].copy_(self.host[:used], non_blocking=True)
        self.copied.record()
        self.in_flight = True
        return self.device


class InputBatch:
    """Persistent rows + step buffers; `prepare()` turns a scheduled step into `StepInputs`."""

    def __init__(
        self,
        kv_manager: KVCacheManager,
        device: torch.device,
        max_num_seqs: int = 256,
        max_num_tokens: int = 2048,
        max_blocks_per_seq: int = 128,
    ) -> None:
        self.kv = kv_manager
        self.device = device
        self.block_size = kv_manager.block_size
        self._max_seqs = max(1, max_num_seqs)
        self._max_tokens = max(1, max_num_tokens)
        # Host block table: one row per sequence holding blocks; grows by doubling.
        self._tables = np.zeros((self._max_seqs, max(1, max_blocks_per_seq)), dtype=np.int64)
        self._row_blocks: list[int] = [0] * self._max_seqs  # blocks copied into each row
        self._row_of: dict[str, int] = {}
        self._free_rows: list[int] = list(range(self._max_seqs - 1, -1, -1))
        # Two in turn: a step's inputs stay intact while the next step is prepared.
        self._staging = [self._new_staging(), self._new_staging()]
        self._turn = 0
        kv_manager.add_free_listener(self.remove)

    # -- rows ----------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self._row_of)

    @property
    def max_blocks_per_seq(self) -> int:
        return self._tables.shape[1]

    def remove(self, seq_id: str) -> None:
        """The sequence's blocks were freed: its row is free for another sequence."""
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._tables[row, : self._row_blocks[row]] = 0
            self._row_blocks[row] = 0
            self._free_rows.append(row)

    def _row(self, seq_id: str) -> int:
        """The sequence's row, its block table brought up to date with the KV cache manager."""
        row = self._row_of.get(seq_id)
        if row is None:
            if not self._free_rows:
                self._grow_rows()
            row = self._free_rows.pop()
            self._row_of[seq_id] = row
        have = self._row_blocks[row]
        num = self.kv.num_seq_blocks(seq_id)
        if num != have:
            if num < have:  # never happens with the free hook; rebuild rather than trust it
                self._tables[row, :have] = 0
                have = 0
            if num > self._tables.shape[1]:
                self._grow_width(num)
            self._tables[row, have:num] = self.kv.block_ids(seq_id, have)
            self._row_blocks[row] = num
        return row

    def _grow_rows(self) -> None:
        old = self._tables.shape[0]
        self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)])
        self._row_blocks += [0] * old
        self._free_rows += range(2 * old - 1, old - 1, -1)

    def _grow_width(self, needed: int) -> None:
        rows, width = self._tables.shape
        wider = np.zeros((rows, max(needed, 2 * width)), dtype=np.int64)
        wider[:, :width] = self._tables
        self._tables = wider

    # -- staging -------------------------------------------------------------------------------
    def _capacity(self) -> int:
        # ids, positions, slots, logits rows: one per token; seq lens, prefill offsets (one
        # more) and the two pending lists: one per sequence; the step's block table:
        # sequences x widest row; and each of the sections' alignment padding.
        per_seq = 4 + self._tables.shape[1]
        return 4 * self._max_tokens + self._max_seqs * per_seq + 1 + _SECTIONS * _ALIGN

    def _new_staging(self) -> _Staging:
        return _Staging(self._capacity(), self.device)

    def _take_staging(self, num_tokens: int, num_seqs: int, used: int) -> _Staging:
        size = self._staging[0].host.numel()
        if num_tokens > self._max_tokens or num_seqs > self._max_seqs or used > size:
            for staging in self._staging:
                staging.wait_copy()
            self._max_tokens = max(self._max_tokens, num_tokens)
            self._max_seqs = max(self._max_seqs, num_seqs)
            self._staging = [self._new_staging() for _ in self._staging]
        self._turn = (self._turn + 1) % len(self._staging)
        staging = self._staging[self._turn]
        staging.wait_copy()
        return staging

    # -- the step ------------------------------------------------------------------------------
    def prepare(
        self, scheduled: list[ScheduledSeq], pending: PendingTokens | None = None
    ) -> StepInputs:
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        order = decodes + prefills
        nd, num_seqs = len(decodes), len(order)
        rows = [self._row(e.seq.seq_id) for e in order]
        starts = [e.seq.num_computed_tokens for e in order]
        counts = [e.num_new_tokens for e in order]
        row_start = [0, *np.cumsum(counts).tolist()]
        num_tokens = row_start[-1]
        row_start.pop()
        logits = _logits_rows(order, starts, row_start)
        width = max((self._row_blocks[r] for r in rows), default=1) or 1

        # Decode rows whose input token is still in flight (async scheduling).
        pending_dst: list[int] = []
        pending_src: list[int] = []
        for i in range(nd):
            seq = order[i].seq
            if starts[i] >= len(seq.token_ids):
                if pending is None or seq.seq_id not in pending.row_of:
                    raise RuntimeError(f"{seq.seq_id}: its input token is in flight but no "
                                       "step in flight sampled it")
                pending_dst.append(i)
                pending_src.append(pending.row_of[seq.seq_id])
        num_pending = len(pending_dst)

        # Packed layout, each section aligned: ids | positions | slots | decode seq lens |
        # prefill seq lens | logits rows | prefill query offsets | decode block table |
        # prefill block table | pending destinations | pending sources.
        num_prefills = num_seqs - nd
        (o_ids, o_pos, o_slots, o_dlens, o_plens, o_rows, o_qsl, o_dtable, o_ptable, o_dst,
         o_src), used = _pack([
             num_tokens, num_tokens, num_tokens, nd, num_prefills, len(logits.rows),
             num_prefills + 1, nd * width, num_prefills * width, num_pending, num_pending])
        staging = self._take_staging(num_tokens, num_seqs, used)
        buf = staging.np

        ids = buf[o_ids : o_ids + num_tokens]
        if num_pending:
            ids[:nd] = [e.seq.token_ids[s] if s < len(e.seq.token_ids) else 0
                        for e, s in zip(decodes, starts[:nd], strict=True)]
            buf[o_dst : o_dst + num_pending] = pending_dst
            buf[o_src : o_src + num_pending] = pending_src
        else:
            ids[:nd] = [e.seq.token_ids[s] for e, s in zip(decodes, starts[:nd], strict=True)]
        for i in range(nd, num_seqs):
            begin, start, n = row_start[i], starts[i], counts[i]
            ids[begin : begin + n] = order[i].seq.token_ids[start : start + n]
        starts_np = np.asarray(starts, dtype=np.int64)
        counts_np = np.asarray(counts, dtype=np.int64)
        rows_np = np.asarray(rows, dtype=np.int64)
        if nd == num_seqs:  # a pure decode step: one token per sequence
            positions = starts_np
            token_rows = rows_np
        else:
            offsets = np.asarray(row_start, dtype=np.int64) - starts_np
            positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(offsets, counts_np)
            token_rows = np.repeat(rows_np, counts_np)
        bs = self.block_size
        num_rows = len(logits.rows)
        buf[o_pos : o_pos + num_tokens] = positions
        blocks = self._tables[token_rows, positions // bs]
        np.add(blocks * bs, positions % bs, out=buf[o_slots : o_slots + num_tokens])
        np.add(starts_np[:nd], counts_np[:nd], out=buf[o_dlens : o_dlens + nd])
        np.add(starts_np[nd:], counts_np[nd:], out=buf[o_plens : o_plens + num_prefills])
        buf[o_rows : o_rows + num_rows] = logits.rows
        buf[o_qsl] = 0
        np.cumsum(counts_np[nd:], out=buf[o_qsl + 1 : o_qsl + 1 + num_prefills])
        buf[o_dtable : o_dtable + nd * width].reshape(nd, width)[:] = \
            self._tables[rows_np[:nd], :width]
        buf[o_ptable : o_ptable + num_prefills * width].reshape(num_prefills, width)[:] = \
            self._tables[rows_np[nd:], :width]

        dev = staging.send(used)
        meta = AttentionMetadata(
            slot_mapping=dev[o_slots : o_slots + num_tokens],
            num_decode_tokens=nd,
            decode_block_tables=dev[o_dtable : o_dtable + nd * width].view(nd, width),
            decode_seq_lens=dev[o_dlens : o_dlens + nd],
            prefill_query_start_loc=buf[o_qsl : o_qsl + 1 + num_prefills].tolist(),
            prefill_seq_lens=buf[o_plens : o_plens + num_prefills].tolist(),
            prefill_block_tables=dev[o_ptable : o_ptable + num_prefills * width].view(
                num_prefills, width),
            prefill_query_start_loc_tensor=dev[o_qsl : o_qsl + 1 + num_prefills],
            prefill_seq_lens_tensor=dev[o_plens : o_plens + num_prefills],
        )
        inputs = StepInputs(
            input_ids=dev[o_ids : o_ids + num_tokens],
            positions=dev[o_pos : o_pos + num_tokens],
            meta=meta,
            order=order,
            row_start=row_start,
            logits_rows=logits.rows,
            sample_index=logits.sample_index,
            prompt_logits=logits.prompt_logits,
            logits_index=dev[o_rows : o_rows + num_rows],
        )
        if num_pending:
            assert pending is not None
            inputs.pending_ids = pending.ids
            inputs.pending_dst = dev[o_dst : o_dst + num_pending]
            inputs.pending_src = dev[o_src : o_src + num_pending]
        return inputs


def _logits_rows(order: list[ScheduledSeq], starts: list[int], row_start: list[int]) -> _Logits:
    """The last row of every sequence that catches up (it samples), and every prompt row of a
    sequence that wants prompt logprobs; a row needed by both goes through the head once."""
    rows: list[int] = []
    sample_index: dict[str, int] = {}
    prompt_logits: dict[str, tuple[int, int]] = {}
    for entry, start, begin in zip(order, starts, row_start, strict=True):
        seq, n = entry.seq, entry.num_new_tokens
        end = start + n
        sample_row = begin + n - 1 if end == seq.num_tokens + seq.num_pending else None
        if seq.want_prompt_logprobs and start < seq.num_prompt_tokens:
            first = len(rows)
            rows += range(begin, begin + min(end, seq.num_prompt_tokens) - start)
            prompt_logits[seq.seq_id] = (first, len(rows))
            if sample_row == rows[-1]:
                sample_index[seq.seq_id] = len(rows) - 1
        if sample_row is not None and seq.seq_id not in sample_index:
            sample_index[seq.seq_id] = len(rows)
            rows.append(sample_row)
    return _Logits(rows, sample_index, prompt_logits)
