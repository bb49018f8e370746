"""Which rank's KV heads go where when KV moves between engines of different tensor-parallel
layouts (prefill at TP=a, decode at TP=b): the plan a KV connector follows, pure arithmetic.

Each rank of an engine holds its heads' slice of every block (`ModelShard.kv_heads`). A block
is a block whatever the layout (its hash, the Redis index and routing do not change); only
the heads of its bytes are spread differently. For every destination rank the plan names,
per run of consecutive heads, the source rank to read them from and where they sit in both
ranks' caches: with equal TP rank i reads rank i; with prefill TP > decode TP a destination
gathers from several sources; with prefill TP < decode TP several destinations read parts of
one source. A head replicated on several source ranks (fewer KV heads than ranks) is read
from one of them, spread over the destinations. `assemble` applies a plan to tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdmesh.engine.worker.parallel.sharding import ModelShape, ModelShard, Span


@dataclass(frozen=True)
class HeadCopy:
    """KV heads `heads` (model-wide indices) from `src_rank`'s cache to `dst_rank`'s."""

    src_rank: int
    dst_rank: int
    heads: Span
    src_offset: int  # index of the first of `heads` among the source rank's KV heads
    dst_offset: int  # ... among the destination rank's


def kv_head_plan(shape: ModelShape, src_world: int, dst_world: int) -> list[HeadCopy]:
    """Every copy that fills each destination rank's KV heads from the source layout,
    destination by destination, heads ascending."""
    sources = [ModelShard.of(shape, r, src_world) for r in range(src_world)]
    plan: list[HeadCopy] = []
    for dst_rank in range(dst_world):
        dst = ModelShard.of(shape, dst_rank, dst_world)
        for head in range(dst.kv_heads.start, dst.kv_heads.stop):
            holders = [s for s in sources if s.kv_heads.start <= head < s.kv_heads.stop]
            src = holders[dst_rank % len(holders)]  # replicas: spread the reads
            last = plan[-1] if plan else None
            if (last is not None and last.dst_rank == dst_rank and last.src_rank == src.rank
                    and last.heads.stop == head):
                plan[-1] = HeadCopy(src.rank, dst_rank, Span(last.heads.start,
                                                             last.heads.size + 1),
                                    last.src_offset, last.dst_offset)
                continue
            plan.append(HeadCopy(src.rank, dst_rank, Span(head, 1),
                                 head - src.kv_heads.start, head - dst.kv_heads.start))
    return plan


def assemble(plan: list[HeadCopy], sources: list[torch.Tensor], dst_rank: int,
             dst_heads: int) -> torch.Tensor:
    """Destination rank `dst_rank`'s KV (`[..., dst_heads, head_dim]`) from the source ranks'
    (`sources[r]`: `[..., its heads, head_dim]`, the same leading dims) by `plan`."""
    first = sources[0]
    out = first.new_empty((*first.shape[:-2], dst_heads, first.shape[-1]))
    for copy in plan:
        if copy.dst_rank != dst_rank:
            continue
        n = copy.heads.size
        out[..., copy.dst_offset:copy.dst_offset + n, :] = \
            sources[copy.src_rank][..., copy.src_offset:copy.src_offset + n, :]
    return out
