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

On CUDA the ids land in pinned host buffers that a small ring (`LandingSlots`) reuses, each
with its event made once: no pinned allocation (a driver call that can synchronize) and no new
event per step. The events are blocking, so waiting for one sleeps the host thread instead of
spinning a core the tokenizer and the scheduler need.
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


class LandingSlot:
    """One host buffer sampled ids land in, and the event that says they have."""

    def __init__(self, capacity: int, pinned: bool) -> None:
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=pinned)
        self.ready = torch.cuda.Event(blocking=True) if pinned else None
        self.busy = False  # held by a step that has neither landed nor been dropped


class LandingSlots:
    """A ring of landing buffers, reused step after step.

    With async scheduling at most two steps are in flight at once (one landing while the next
    runs), so a ring of `size` slots rarely grows; a slot is handed out only once its step has
    landed or was dropped, and a step wider than a slot replaces that slot's buffer."""

    def __init__(self, pinned: bool, size: int = 4, capacity: int = 256) -> None:
        self.pinned = pinned
        self.capacity = capacity
        self.slots = [LandingSlot(capacity, pinned) for _ in range(size)]
        self._next = 0

    def take(self, rows: int) -> LandingSlot:
        """A free slot holding at least `rows` ids, marked busy."""
        for i in range(len(self.slots)):
            index = (self._next + i) % len(self.slots)
            slot = self.slots[index]
            if not slot.busy:
                self._next = (index + 1) % len(self.slots)
                break
        else:  # every slot is held: more steps in flight than the ring was sized for
            slot = LandingSlot(self.capacity, self.pinned)
            self.slots.append(slot)
        if slot.host.numel() < rows:
            self.capacity = max(rows, 2 * self.capacity)
            slot.host = torch.empty(self.capacity, dtype=torch.int64, pin_memory=self.pinned)
        slot.busy = True
        return slot


_RINGS: dict[torch.device, LandingSlots] = {}
"""One ring per CUDA device: steps are launched by the sampler (`InFlightStep.launch`), which
keeps no state of its own, and land on the core's one thread."""


def _landing_slot(device: torch.device, rows: int) -> LandingSlot:
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = LandingSlots(pinned=True)
    return ring.take(rows)


@dataclass
class InFlightStep:
    """A launched step: its sampled sequences (in row order) and their ids, on their way to
    the host. Each sequence counts the token in `num_pending` until the step lands."""

    seqs: list[Sequence]
    ids: torch.Tensor  # [len(seqs)] int64 on the device
    host: torch.Tensor  # the host copy (pinned on CUDA), valid once `ready` has passed
    ready: torch.cuda.Event | None = None
    row_of: dict[str, int] = field(default_factory=dict)
    slot: LandingSlot | None = None  # where `host` lives, given back when the step lands

    @classmethod
    def launch(cls, seqs: list[Sequence], ids: torch.Tensor) -> InFlightStep:
        """Start the ids' copy to the host without waiting for it."""
        ready = None
        host = ids
        slot = None
        if ids.device.type == "cuda":
            slot = _landing_slot(ids.device, ids.numel())
            host = slot.host[: ids.numel()].view(ids.shape)
            host.copy_(ids, non_blocking=True)
            ready = slot.ready
            assert ready is not None
            ready.record(torch.cuda.current_stream(ids.device))
        for seq in seqs:
            seq.num_pending += 1
        row_of = {seq.seq_id: i for i, seq in enumerate(seqs)}
        return cls(seqs, ids, host, ready, row_of, slot)

    def pending(self) -> PendingTokens:
        return PendingTokens(self.ids, self.row_of)

    def land(self) -> list[tuple[Sequence, int]]:
        """Wait for the ids; each sequence with its token (no longer pending)."""
        if self.ready is not None:
            self.ready.synchronize()
        for seq in self.seqs:
            seq.num_pending -= 1
        landed = list(zip(self.seqs, self.host.tolist(), strict=True))
        self._give_back()
        return landed

    def drop(self) -> None:
        """Forget the step (its requests were failed): nothing is pending any more."""
        for seq in self.seqs:
            seq.num_pending -= 1
        self.seqs = []
        self._give_back()

    def _give_back(self) -> None:
        """The slot may take another step's ids (a dropped step's copy may still be running:
        the slot's next `record` orders the next copy after it on the same stream)."""
        if self.slot is not None:
            self.slot.busy = False
            self.slot = None
