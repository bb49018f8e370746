"""The step's inputs, from the first rank to the others: explicitly laid-out int64 tensors.

Every step of a tensor-parallel engine runs SPMD: the first rank (the engine core) prepares
the step as it always does, then broadcasts it as two tensors: a fixed header of sizes, on the
host over the group's CPU side (`TensorParallel.broadcast_host`: an idle rank waits for the
next header asleep, not in a spinning NCCL kernel), and one int64 payload whose sections the
header lays out, over the group itself (gloo on CPU, NCCL on CUDA, where the inputs already
live on the device). Nothing is pickled; a header that does not add up is refused. The other
ranks rebuild the step's `StepInputs` from them and run the same forward (whose all-reduces
pair up with the first rank's), then their columns of the logits for the rows the first rank
samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import torch

from pdmesh.engine.worker.input_batch import StepInputs
from pdmesh.engine.worker.parallel.group import TensorParallel
from pdmesh.kernels.backend import AttentionMetadata

HEADER = 8


class Op(IntEnum):
    STEP = 1  # run a step's forward
    COPY = 2  # copy KV blocks (copy-on-write of a forked sequence)
    STOP = 3  # the engine is closing


@dataclass(frozen=True)
class Layout:
    """A step's sizes, as the header carries them."""

    tokens: int
    decodes: int
    prefills: int
    logit_rows: int
    decode_width: int
    prefill_width: int

    def sections(self) -> list[int]:
        """ids | positions | slots | decode lens | prefill lens | logits rows | prefill
        query offsets | decode block table | prefill block table."""
        t, d, p = self.tokens, self.decodes, self.prefills
        return [t, t, t, d, p, self.logit_rows, p + 1, d * self.decode_width,
                p * self.prefill_width]

    @property
    def size(self) -> int:
        return sum(self.sections())


@dataclass
class StepMessage:
    """What a non-first rank received: an op and its inputs."""

    op: Op
    inputs: StepInputs | None = None
    copies: list[tuple[int, int]] | None = None


class StepChannel:
    """Both ends: the first rank sends (`send_step`, `send_copies`, `send_stop`), the others
    `receive`. Each message is one header broadcast, then its payload's.

    A step that failed on the first rank after its inputs were sent (an error inside the
    forward, a rank gone) leaves the ranks out of step: some wait in a collective the first
    rank never reaches. `fail` records it and calls `on_broken` (engine/core/ranks.py ends
    the ranks); every later send raises."""

    def __init__(self, tp: TensorParallel, device: torch.device,
                 on_broken: Callable[[str], None] | None = None) -> None:
        self.tp = tp
        self.device = device
        self.on_broken = on_broken
        self.broken: str | None = None

    def fail(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            if self.on_broken is not None:
                self.on_broken(reason)

    # -- the first rank -------------------------------------------------------------------
    def send_step(self, inputs: StepInputs) -> None:
        meta = inputs.meta
        qsl, plens = meta.prefill_tensors(self.device)
        rows = inputs.logits_index
        if rows is None:
            rows = torch.tensor(inputs.logits_rows, dtype=torch.int64, device=self.device)
        layout = Layout(int(inputs.input_ids.shape[0]), meta.num_decode_tokens,
                        meta.num_prefills, len(inputs.logits_rows),
                        int(meta.decode_block_tables.shape[1]),
                        int(meta.prefill_block_tables.shape[1]))
        parts = [inputs.input_ids, inputs.positions, meta.slot_mapping, meta.decode_seq_lens,
                 plens, rows, qsl, meta.decode_block_tables.reshape(-1),
                 meta.prefill_block_tables.reshape(-1)]
        payload = torch.cat([p.to(torch.int64) for p in parts])
        self._send(Op.STEP, [layout.tokens, layout.decodes, layout.prefills, layout.logit_rows,
                             layout.decode_width, layout.prefill_width], payload)

    def send_copies(self, pairs: list[tuple[int, int]]) -> None:
        flat = [b for pair in pairs for b in pair]
        self._send(Op.COPY, [len(pairs)],
                   torch.tensor(flat, dtype=torch.int64, device=self.device))

    def send_stop(self) -> None:
        self._send(Op.STOP, [], None)

    def _send(self, op: Op, sizes: list[int], payload: torch.Tensor | None) -> None:
        if self.broken is not None:
            raise RuntimeError(f"tensor parallel: the ranks are out of step after a failed "
                               f"step ({self.broken})")
        n = 0 if payload is None else int(payload.numel())
        header = [int(op), n, *sizes]
        header += [0] * (HEADER - len(header))
        self.tp.broadcast_host(torch.tensor(header, dtype=torch.int64))
        if payload is not None and n:
            self.tp.broadcast(payload)

    # -- the other ranks ------------------------------------------------------------------
    def receive(self) -> StepMessage:
        header = self.tp.broadcast_host(torch.zeros(HEADER, dtype=torch.int64))
        op_value, n, *sizes = header.tolist()
        if op_value not in {int(o) for o in Op} or n < 0:
            raise ValueError(f"step channel: malformed header {header.tolist()}")
        op = Op(op_value)
        payload = torch.empty(n, dtype=torch.int64, device=self.device)
        if n:
            self.tp.broadcast(payload)
        if op is Op.STOP:
            return StepMessage(op)
        if op is Op.COPY:
            if n != 2 * sizes[0]:
                raise ValueError(f"step channel: {n} values for {sizes[0]} block copies")
            flat = payload.tolist()
            return StepMessage(op, copies=list(zip(flat[0::2], flat[1::2], strict=True)))
        layout = Layout(*sizes[:6])
        if min(sizes[:6]) < 0 or layout.size != n:
            raise ValueError(f"step channel: header {header.tolist()} does not lay out {n} values")
        return StepMessage(op, inputs=_inputs(layout, payload))


def _inputs(layout: Layout, payload: torch.Tensor) -> StepInputs:
    """`StepInputs` over views of `payload`: what the forward and the LM head read."""
    (ids, positions, slots, dlens, plens, rows, qsl, dtable, ptable) = payload.split(
        layout.sections())
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=layout.decodes,
        decode_block_tables=dtable.view(layout.decodes, layout.decode_width),
        decode_seq_lens=dlens,
        prefill_query_start_loc=qsl.tolist(),
        prefill_seq_lens=plens.tolist(),
        prefill_block_tables=ptable.view(layout.prefills, layout.prefill_width),
        prefill_query_start_loc_tensor=qsl,
        prefill_seq_lens_tensor=plens,
    )
    return StepInputs(input_ids=ids, positions=positions, meta=meta, order=[], row_start=[],
                      logits_rows=rows.tolist(), sample_index={}, prompt_logits={},
                      logits_index=rows)
