"""A tensor-parallel engine's KV cache as its connector sees it: one cache per rank.

Each rank of an engine holds its KV heads' slice of every block (`ModelShard.kv_heads`), in a
cache of its own `[layers, 2, num_blocks, block_size, its heads, head_dim]`; all ranks use the
same block ids, handed out by rank 0's one scheduler. On a CPU host every rank's cache is a
shared-memory file (`cache_file.py`), so rank 0 — the engine core, the only rank with a
connector — maps its other ranks' caches too and moves KV for all of them, without a step or
a message to the ranks: a pulled block lands in every rank's cache before the step that reads
it is broadcast, and an exported block is served once the step that wrote it is over on
every rank (its last collective completed on rank 0).

A block is a block whatever the layout: what moves between engines of different
tensor-parallel sizes is each destination rank's heads, copied straight from the source
rank(s) that hold them (`kv_head_plan`: rank to rank at equal sizes, gathered when the source
has more ranks, split when it has fewer), one copy of each byte. A block's checksum is that of
its *canonical* form — every KV head once, in model order — which at one rank is the cache
itself, so engines of any two layouts agree on what a block's bytes are.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdmesh.engine.worker.parallel.kv_layout import HeadCopy, kv_head_plan
from pdmesh.engine.worker.parallel.sharding import ModelShape, ModelShard, Span
from pdmesh.kvstore.connector.blocks import block_checksums, copy_blocks, copy_blocks_checked, runs
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo

CANONICAL_CHUNK_BLOCKS = 32
"""Blocks assembled at once to checksum a multi-rank cache (the assembled copy is temporary)."""


@dataclass(frozen=True)
class RankCaches:
    """Every rank's cache of one engine, in rank order (`caches[0]` is the engine core's)."""

    caches: tuple[torch.Tensor, ...]
    shape: ModelShape | None = None  # the model's sizes; None: one rank holding every head

    def __post_init__(self) -> None:
        if not self.caches:
            raise ValueError("RankCaches: no cache")
        if len(self.caches) > 1:
            if self.shape is None:
                raise ValueError("RankCaches: several ranks need the model's shape")
            for rank, cache in enumerate(self.caches):
                heads = ModelShard.of(self.shape, rank, self.world).kv_heads.size
                if cache.dim() != 6 or cache.shape[4] != heads:
                    raise ValueError(f"RankCaches: rank {rank}'s cache {tuple(cache.shape)} "
                                     f"does not hold its {heads} KV heads")

    @property
    def world(self) -> int:
        return len(self.caches)

    @property
    def first(self) -> torch.Tensor:
        return self.caches[0]

    @property
    def num_kv_heads(self) -> int:
        """The model's KV heads (every rank's, each once)."""
        if self.shape is None:
            return int(self.first.shape[4])
        return self.shape.num_kv_heads

    @property
    def layout(self) -> tuple[int, int, int, int]:
        """A block as every engine names it: (layers, block_size, KV heads, head_dim)."""
        layers, _, _, block_size, _, head_dim = self.first.shape
        return (int(layers), int(block_size), self.num_kv_heads, int(head_dim))

    def plan_from(self, source: RankCaches) -> list[HeadCopy]:
        """Which source rank's heads fill which of ours."""
        return _plan(self.shape or source.shape, self.num_kv_heads, source.world, self.world)

    @functools.cached_property
    def to_whole(self) -> list[HeadCopy]:
        """Where each head of the canonical block is read from (its first holder)."""
        return _plan(self.shape, self.num_kv_heads, self.world, 1)

    @functools.cached_property
    def from_whole(self) -> list[HeadCopy]:
        """Which heads of the canonical block each rank holds (replicas included)."""
        return _plan(self.shape, self.num_kv_heads, 1, self.world)

    def canonical(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks with every KV head once, in model order, on rank 0's device:
        `[layers, 2, len(block_ids), block_size, num_kv_heads, head_dim]` (a copy)."""
        self.wait_for_steps()
        first = self.first
        layers, _, _, block_size, _, head_dim = first.shape
        out = first.new_empty((layers, 2, len(block_ids), block_size, self.num_kv_heads,
                               head_dim))
        for copy in self.to_whole:
            src = self.caches[copy.src_rank]
            ids = torch.tensor(list(block_ids), device=src.device)
            n = copy.heads.size
            picked = src[..., copy.src_offset:copy.src_offset + n, :].index_select(2, ids)
            out[..., copy.dst_offset:copy.dst_offset + n, :] = picked.to(out.device)
        return out

    @property
    def block_nbytes(self) -> int:
        """Bytes of one canonical block (every KV head once) across every layer."""
        layers, block_size, heads, head_dim = self.layout
        return layers * 2 * block_size * heads * head_dim * self.first.element_size()

    def wait_for_steps(self) -> None:
        """Before reading or writing another rank's cache on CUDA: wait on the host for this
        thread's stream on rank 0's device (the core's model stream, or a pull's receiving
        stream, which waits for what the model stream had queued when the pull began). The
        other rank's cache is reached through its IPC mapping on this process's streams, which
        nothing orders after that rank's own process using it, and a step left in flight
        (async scheduling: a chunk with nothing to sample returns at once, a request computes
        one token past its stop) may still be writing or reading it; rank 0's step ends only
        after every rank reached its last collective, which follows the step's KV writes on
        each rank, so once rank 0's work is done theirs is."""
        if self.world > 1 and self.first.is_cuda:
            torch.cuda.current_stream(self.first.device).synchronize()

    def wait_for_writes(self) -> None:
        """After this thread wrote blocks into the ranks' caches on CUDA: wait on the host for
        its copies (each device's current stream here: the pull's receiving stream on rank
        0's, the one a cross-device copy is ordered on elsewhere), before the rank
        processes' next step reads them. Not the devices: a device-wide synchronize on rank
        0's would also wait for every step the engine queued meanwhile."""
        for device in {c.device for c in self.caches if c.is_cuda}:
            torch.cuda.current_stream(device).synchronize()

    def read_piece(self, layer: int, kv: int, start: int, out: torch.Tensor) -> None:
        """`out` (`[n, block_size, num_kv_heads, head_dim]`, any device) = the canonical
        (layer, K/V) piece of blocks start..start+n: what a block server sends of them."""
        n = out.shape[0]
        for copy in self.to_whole:
            k = copy.heads.size
            src = self.caches[copy.src_rank][layer, kv, start:start + n]
            out[..., copy.dst_offset:copy.dst_offset + k, :].copy_(
                src[..., copy.src_offset:copy.src_offset + k, :])

    def write_piece(self, layer: int, kv: int, start: int, piece: torch.Tensor) -> None:
        """Blocks start..start+n of every rank = their heads of the canonical `piece`: what a
        pull received of them."""
        n = piece.shape[0]
        for copy in self.from_whole:
            k = copy.heads.size
            dst = self.caches[copy.dst_rank][layer, kv, start:start + n]
            dst[..., copy.dst_offset:copy.dst_offset + k, :].copy_(
                piece[..., copy.src_offset:copy.src_offset + k, :])

    def checksums(self, algo: ChecksumAlgo, block_ids: Sequence[int]) -> list[int]:
        """Each block's checksum in its canonical form (at one rank: in place)."""
        if self.world == 1:
            return block_checksums(algo, self.first, block_ids)
        ids = list(block_ids)
        sums: list[int] = []
        for start in range(0, len(ids), CANONICAL_CHUNK_BLOCKS):
            part = ids[start:start + CANONICAL_CHUNK_BLOCKS]
            sums += block_checksums(algo, self.canonical(part), range(len(part)))
        return sums


def _plan(shape: ModelShape | None, num_kv_heads: int, src_world: int,
          dst_world: int) -> list[HeadCopy]:
    """`kv_head_plan`, or without the model's shape (one rank each side) every head."""
    if shape is None:
        return [HeadCopy(0, 0, Span(0, num_kv_heads), 0, 0)]
    return kv_head_plan(shape, src_world, dst_world)


def copy_across(algo: ChecksumAlgo, dst: RankCaches, dst_ids: Sequence[int],
                src: RankCaches, src_ids: Sequence[int]) -> list[int]:
    """Copy blocks `src_ids` of `src` into `dst_ids` of `dst`, each destination rank's heads
    from the source rank(s) holding them; the landed blocks' canonical checksums. One rank
    each side is the plain same-host pull (copied and hashed in one pass where it can)."""
    if dst.world == 1 and src.world == 1:
        return copy_blocks_checked(algo, dst.first, dst_ids, src.first, src_ids)
    dst.wait_for_steps()  # a landing block may still be in use by a step in flight
    for copy in dst.plan_from(src):
        n = copy.heads.size
        whole_dst, whole_src = dst.caches[copy.dst_rank], src.caches[copy.src_rank]
        if n == whole_dst.shape[4] == whole_src.shape[4]:  # rank to rank, every head
            copy_blocks(whole_dst, dst_ids, whole_src, src_ids)
            continue
        into = whole_dst[..., copy.dst_offset:copy.dst_offset + n, :]
        out_of = whole_src[..., copy.src_offset:copy.src_offset + n, :]
        for s, d, length in runs(src_ids, dst_ids):
            into[:, :, d:d + length].copy_(out_of[:, :, s:s + length])
    dst.wait_for_writes()  # landed before a rank's step reads it
    return dst.checksums(algo, dst_ids)
