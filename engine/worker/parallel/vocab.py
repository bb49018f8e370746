"""Vocabulary-parallel embedding and LM head: each rank holds a span of vocabulary rows.

The embedding looks up the ids that fall in this rank's rows, zeroes the rest and sums over
the ranks (one all-reduce of `[T, hidden]`). The LM head computes this rank's columns of the
logits, gathered side by side on the first rank, the one that samples.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from pdmesh.engine.worker.parallel.group import TensorParallel
from pdmesh.engine.worker.parallel.sharding import Span


def embed(weight: torch.Tensor, ids: torch.Tensor, rows: Span, tp: TensorParallel
          ) -> torch.Tensor:
    """Embeddings `[T, hidden]` of `ids`, of which this rank holds the vocabulary `rows`."""
    if tp.world_size == 1:
        return F.embedding(ids, weight)
    local = ids - rows.start
    outside = (local < 0) | (local >= rows.size)
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out.masked_fill_(outside.unsqueeze(1), 0.0)
    return tp.all_reduce(out)


def gather_logits(local: torch.Tensor, widths: tuple[int, ...], tp: TensorParallel
                  ) -> torch.Tensor:
    """The whole vocabulary's logits on the first rank; elsewhere this rank's own columns
    (which nobody reads: only the first rank samples)."""
    whole = tp.gather_columns(local, list(widths))
    return local if whole is None else whole
