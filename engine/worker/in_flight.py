"""Async scheduling: a step whose sampled ids have not reached the host yet.

Without it, every step ends with the host waiting for the device (the sampled ids), and the
device then idles while the host lands those tokens, builds outputs, schedules and prepares
the next step. With it, the core launches step N+1 first — a decode row whose input is step
N's token reads that token on the device (`PendingTokens`) — and lands step N while N+1 runs.
Stop checks therefore see a token one step late: a sequence that ends at step N has computed
one token past its end in step N+1, which is discarded (vLLM's async scheduling does the
same). The scheduler never schedules past a known length limit.

Only steps whose samples need nothing from the host to sample their *next* token are left in
flight (`may_overlap`): no grammar (its bitmask needs the token accepted), no penalties or
bad words (they read the output tokens), no logprobs, no prompt logprobs, no pending fan-out
or KV export, min_tokens already met. Any other step lands at once, exactly as without async
scheduling. On CPU the host *is* the device, so there is nothing to overlap and it is off by
default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.engine.worker.input_batch import PendingTokens


def may_overlap(seq: Sequence) -> bool:
    """Whether `seq` can sample its next token before this step's token reaches the host."""
    params = seq.params
    return (
        seq.grammar is None
        and params.logprobs is None
        and not params.needs_penalties
        and not params.bad_words_token_ids
        and not seq.export_kv
        and seq.fork_into == 1
        and not seq.want_prompt_logprobs
        and seq.num_output_tokens >= params.min_tokens
    )


@dataclass
class InFlightStep:
    """A launched step: its sampled sequences (in row order) and their ids, on their way to
    the host. Each sequence counts the token in `num_pending` until the step lands."""

    seqs: list[Sequence]
    ids: torch.Tensor  # [len(seqs)] int64 on the device
    host: torch.Tensor  # the host copy (pinned on CUDA), valid once `ready` has passed
    ready: torch.cuda.Event | None = None
    row_of: dict[str, int] = field(default_factory=dict)

    @classmethod
    def launch(cls, seqs: list[Sequence], ids: torch.Tensor) -> InFlightStep:
        """Start the ids' copy to the host without waiting for it."""
        ready = None
        host = ids
        if ids.device.type == "cuda":
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        for seq in seqs:
            seq.num_pending += 1
        return cls(seqs, ids, host, ready, {seq.seq_id: i for i, seq in enumerate(seqs)})

    def pending(self) -> PendingTokens:
        return PendingTokens(self.ids, self.row_of)

    def land(self) -> list[tuple[Sequence, int]]:
        """Wait for the ids; each sequence with its token (no longer pending)."""
        if self.ready is not None:
            self.ready.synchronize()
        for seq in self.seqs:
            seq.num_pending -= 1
        return list(zip(self.seqs, self.host.tolist(), strict=True))

    def drop(self) -> None:
        """Forget the step (its requests were failed): nothing is pending any more."""
        for seq in self.seqs:
            seq.num_pending -= 1
        self.seqs = []
