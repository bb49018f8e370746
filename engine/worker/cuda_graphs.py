"""CUDA graphs for pure-decode steps: captured once per padded batch size, then replayed.

A decode step of a Python engine is host-bound: hundreds of kernel launches per step, each a
few microseconds of Python and driver time, while the GPU finishes each in less. A CUDA graph
records the whole forward of one batch size once and replays it with one launch.

How it works (the vLLM shape):

- Batch-size buckets 1, 2, 4, 8, 16, 24, 32, ... up to `max_num_seqs` (which is always the
  last bucket). A step of `n` decodes runs the graph of the smallest bucket >= n; the
  `bucket - n` padding rows carry slot -1 (the cache write skips them, so they never touch a
  real block), context length 1 and block 0 (a valid read of one token, discarded).
- Graphs read their inputs from static buffers (ids, positions, slots, lengths, a block table
  `[max_num_seqs, width]`, the width from `max_model_len`); a replay first copies the step's
  inputs into them. Nothing inside the captured region depends on host values of the step.
- The Triton decode kernel cuts each sequence's block table into `num_splits` equal ranges
  that run in parallel, so its serial chain is `width / num_splits` blocks whatever the
  context. A graph fixes both at capture: `decode_splits` picks the split count from the
  device's SM count and the bucket's rows (enough programs to fill the SMs), and buckets whose
  rows do not fill the SMs on their own also get graphs over narrower block tables
  (`split_plans`), so a short context replays a graph whose splits are short: at batch 1 and
  768 tokens, 48 programs of 8 blocks instead of 8 programs of 48.
- Each graph is warmed up eagerly first (Triton compiles, cuBLAS picks its kernels), then
  captured, largest first, all into one memory pool: they never run at once, so they share it.
- Only the hidden states are captured; the LM head runs eagerly on the rows that sample.

Only the `triton` attention backend is captured. `torch` reads `seq_lens.max()` on the host
to size its gather, and `flash-attn` writes the cache with `index_copy_` (no "skip" slot) and
picks its path from host-side facts of the step; both stay eager. CPU has no graphs at all.
A capture that fails leaves the runner eager (engine/worker/model_runner.py).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdmesh.kernels.backend import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from pdmesh.engine.worker.input_batch import StepInputs
    from pdmesh.engine.worker.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

GRAPH_SAFE_BACKENDS = ("triton",)
"""Backends whose forward has no host synchronisation and honours slot -1 (padding)."""

PROGRAMS_PER_SM = 2
"""Decode programs wanted per SM: two waves' worth hides one program's tail."""
MIN_BLOCKS_PER_SPLIT = 8
"""No split shorter than this (as the kernel's own default): below it the merge of the
partial results costs more than the parallelism brings."""
NARROW_WIDTH = 64
"""The narrowest block table a graph is captured for (1,024 tokens at block size 16)."""
WIDTH_STEP = 4
"""Each narrower block table is this many times narrower: a context replays a graph at most
this many times wider than it needs, and a bucket gets log4(width / 64) + 1 graphs."""
NOMINAL_NUM_SMS = 132
"""The SM count planned for off CUDA (an H100's), so CPU tests run the GPU's plans."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes that get a graph: 1, 2, 4, 8, then every 8, and max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding `num_seqs` rows, or None when none is large enough."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def block_table_width(max_model_len: int, block_size: int, num_blocks: int) -> int:
    """Block-table columns a sequence can need: its longest context in blocks, never more than
    the cache holds. Both the persistent batch and the graphs' static table are this wide."""
    return max(1, min(num_blocks, -(-max_model_len // block_size)))


@dataclass(frozen=True)
class DecodeSplit:
    """What a captured decode graph fixes: the block-table columns it reads, and how many
    parallel ranges (`num_splits`) the attention kernel cuts them into."""

    width: int
    num_splits: int

    @property
    def blocks_per_split(self) -> int:
        """The longest serial chain of one program, in blocks (as the kernel rounds it)."""
        return -(-self.width // self.num_splits)


def decode_splits(rows: int, num_kv_heads: int, width: int, num_sms: int) -> int:
    """Splits per sequence for `rows` decode rows: enough (row, KV head, split) programs for
    `PROGRAMS_PER_SM` per SM, none shorter than `MIN_BLOCKS_PER_SPLIT` blocks. A batch that
    fills the SMs alone gets one split (the kernel then stops at each sequence's length)."""
    programs = max(1, rows * num_kv_heads)
    wanted = -(-PROGRAMS_PER_SM * max(1, num_sms) // programs)
    return max(1, min(wanted, width // MIN_BLOCKS_PER_SPLIT))


def split_plans(rows: int, num_kv_heads: int, width: int, num_sms: int) -> list[DecodeSplit]:
    """The graphs a bucket gets, narrowest first, the last one `width` wide.

    The kernel's chain is `width / num_splits` blocks whatever the context, so a bucket whose
    rows need several splits also gets graphs over narrower tables (`NARROW_WIDTH` x 4^k): a
    short context replays one of those. A bucket with one split needs none: its single
    program per (row, head) already stops at the sequence's end."""
    full = DecodeSplit(width, decode_splits(rows, num_kv_heads, width, num_sms))
    if full.num_splits == 1:
        return [full]
    plans = []
    narrow = NARROW_WIDTH
    while narrow < width:
        plans.append(DecodeSplit(narrow, decode_splits(rows, num_kv_heads, narrow, num_sms)))
        narrow *= WIDTH_STEP
    return [*plans, full]


def num_sms_of(device: torch.device) -> int:
    """The device's SM count (`NOMINAL_NUM_SMS` off CUDA)."""
    if device.type != "cuda":
        return NOMINAL_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def graphs_unavailable_reason(
    device: torch.device, backend: AttentionBackend, enforce_eager: bool
) -> str | None:
    """Why decode steps cannot use CUDA graphs here, or None when they can."""
    if device.type != "cuda":
        return "not a CUDA device"
    if enforce_eager:
        return "enforce_eager is set"
    if backend.name not in GRAPH_SAFE_BACKENDS:
        return f"the {backend.name} attention backend is not graph-safe (triton is)"
    return None


def _triton_with_splits(num_splits: int) -> AttentionBackend:
    """The triton backend with the split count a graph was planned for (`split_plans`): the
    backend alone would pick splits from the table's width, which a graph fixes at capture."""
    from pdmesh.kernels.triton_attention import TritonAttentionBackend  # triton: graphs only

    return TritonAttentionBackend(num_splits)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [bucket, hidden]: written by each replay


class DecodeGraphs:
    """Captured decode forwards per bucket (and block-table width), and the static buffers
    they read."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        *,
        num_sms: int | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.width = max_blocks_per_seq
        sms = num_sms if num_sms is not None else num_sms_of(device)
        self.plans = {
            bucket: split_plans(bucket, model.cfg.num_kv_heads, self.width, sms)
            for bucket in self.sizes
        }
        rows = self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((rows, self.width), dtype=torch.int64, device=device)
        self._graphs: dict[int, _Graph] = {}  # full width, by bucket
        self._narrow: dict[int, list[tuple[int, _Graph]]] = {}  # (width, graph), narrowest first
        self._pool: object | None = None

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs) + sum(len(g) for g in self._narrow.values())

    def _meta(self, bucket: int, width: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            num_decode_tokens=bucket,
            decode_block_tables=self.block_tables[:bucket, :width],
            decode_seq_lens=self.seq_lens[:bucket],
            prefill_query_start_loc=[0],
            prefill_seq_lens=[],
            prefill_block_tables=self.block_tables[:0],
        )

    def _forward(self, bucket: int, split: DecodeSplit | None = None) -> torch.Tensor:
        """The bucket's forward on the static buffers (the full-width plan by default)."""
        split = split if split is not None else self.plans[bucket][-1]
        return self.model(
            self.input_ids[:bucket],
            self.positions[:bucket],
            self.kv_cache,
            self._meta(bucket, split.width),
            _triton_with_splits(split.num_splits),
        )

    def capture(self) -> None:
        """Warm up and capture every graph, largest bucket and widest table first (the pool is
        sized by the first). On any failure every graph captured so far and their pool are
        released before the error propagates: the caller runs eagerly."""
        started = time.monotonic()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        try:
            for bucket in reversed(self.sizes):
                for split in reversed(self.plans[bucket]):
                    self._warm_up(bucket, split)
                    self._store(bucket, split, self._record(bucket, split))
        except BaseException:
            if stream is not None:  # a capture that failed to end leaves its stream current
                torch.cuda.set_stream(stream)
            self.release()
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("cuda graphs: captured %d graphs for %d decode batch sizes (1..%d) in "
                    "%.1f s", self.num_graphs, len(self._graphs), self.sizes[-1],
                    time.monotonic() - started)

    def _warm_up(self, bucket: int, split: DecodeSplit) -> None:
        """Two eager runs off the default stream, as capture requires of lazy inits (Triton
        compiles, cuBLAS workspaces)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bucket, split)
        current.wait_stream(side)
        torch.cuda.synchronize(self.device)

    def _record(self, bucket: int, split: DecodeSplit) -> _Graph:
        """Capture one forward into the shared pool."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._forward(bucket, split)
        return _Graph(graph, hidden)

    def _store(self, bucket: int, split: DecodeSplit, captured: _Graph) -> None:
        if split.width == self.width:
            self._graphs[bucket] = captured
        else:
            tiers = self._narrow.setdefault(bucket, [])
            tiers.append((split.width, captured))
            tiers.sort(key=lambda tier: tier[0])

    def release(self) -> None:
        """Drop every captured graph and the memory pool they share (a failed capture's too)."""
        graphs = [*self._graphs.values(), *(g for t in self._narrow.values() for _, g in t)]
        self._graphs.clear()
        self._narrow.clear()
        self._pool = None
        for captured in graphs:
            captured.graph.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def bucket_for(self, inputs: StepInputs) -> int | None:
        """The bucket a step replays, or None when it must run eagerly (prefill rows, too many
        sequences, a block table wider than captured)."""
        meta = inputs.meta
        if meta.num_prefills or not meta.num_decode_tokens:
            return None
        if meta.decode_block_tables.shape[1] > self.width:
            return None
        bucket = padded_size(meta.num_decode_tokens, self.sizes)
        return bucket if bucket in self._graphs else None

    def _graph_for(self, bucket: int, width: int) -> _Graph:
        """The narrowest graph of `bucket` whose block table holds `width` columns."""
        for narrow, captured in self._narrow.get(bucket, ()):
            if width <= narrow:
                return captured
        return self._graphs[bucket]

    def replay(self, inputs: StepInputs, bucket: int) -> torch.Tensor:
        """Copy the step into the static buffers, replay; hidden states `[n, hidden]`."""
        meta = inputs.meta
        n = meta.num_decode_tokens
        nb = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.decode_seq_lens, non_blocking=True)
        self.block_tables[:n, :nb].copy_(meta.decode_block_tables, non_blocking=True)
        if n < bucket:  # padding rows: no cache write, one token of context
            self.slot_mapping[n:bucket].fill_(-1)
            self.seq_lens[n:bucket].fill_(1)
            self.block_tables[n:bucket, 0].fill_(0)
        captured = self._graph_for(bucket, nb)
        captured.graph.replay()
        return captured.hidden[:n]
