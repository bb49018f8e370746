"""How many prefill tokens a step may take so the streams in it keep their inter-token latency.

Every running stream waits for the whole step its next token is in. A step that carries ~2,000
prefill tokens runs 5-10x longer than a decode step, so with a fixed token budget
(`max_num_batched_tokens`) a burst of prompts freezes every stream's text for that long. Here
the step's prefill tokens are bounded by *time* instead (Sarathi-Serve's stall-free batching,
with the costs learned online, engine/scheduling/step_cost.py): the decode rows are counted first,
and
prefill chunks take only what fits the ITL target beside them.

Rules (`ItlTarget`, `StepBudget`):
- A step without decode rows is not bounded by time: nobody is waiting on it between tokens
  (a prefill-only instance never is), and the fixed token budget applies as before.
- Prefill never starves: the first prefill row of a step gets at least `min_prefill_tokens`
  (or all it wants, if less), whatever the target says, so waiting prompts progress every step
  and TTFT stays bounded.
- The fixed budget still caps the step (the scheduler applies both).
- `--itl-target-ms` unset is *auto*, which bounds the delay a step's prefill imposes on the
  streams in it, in stream-seconds: the prefill part may take `AUTO_STALL_STREAM_S` divided
  among the running streams, or `AUTO_PREFILL_SHARE` of the decodes' own time when that is
  more. Beside six streams (1 req/s of 64-token answers on a 2-core CPU) a prompt of a few
  hundred tokens still goes in one step, so light load keeps its TTFT, while a burst of
  prompts is spread over several steps instead of freezing every stream for seconds; beside
  sixteen the prefill part is 150 ms. Measured trade-offs (bench/README.md, "Inter-token
  latency"): on a CPU, chunking a prompt finely costs TTFT and some throughput (a chunk after
  earlier ones attends over the paged context, a slower kernel), so a strict ITL is a choice
  made with a number. 0 turns it off; a number is a fixed target for the whole step.
- Until the cost model has fitted its steps, a provisional cost from the first prefill step
  plans the budget (`StepCostModel.budget_cost`); before any prefill step, nothing is bounded.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdmesh.engine.scheduling.step_cost import StepCost, StepCostModel, StepWork

AUTO_STALL_STREAM_S = 2.4
"""Auto target: the stream-seconds of delay a step's prefill may impose (0.4 s beside six
streams, 150 ms beside sixteen)."""
AUTO_PREFILL_SHARE = 0.5
"""Auto target: the prefill part may always take this share of the decodes' own time."""


@dataclass(frozen=True)
class ItlTarget:
    """The engine's ITL target: `seconds` fixed (> 0), None for auto, 0 for off."""

    seconds: float | None = None
    min_prefill_tokens: int = 64

    @classmethod
    def from_ms(cls, itl_target_ms: float | None, min_prefill_tokens: int) -> ItlTarget:
        return cls(None if itl_target_ms is None else itl_target_ms / 1000, min_prefill_tokens)

    @property
    def off(self) -> bool:
        return self.seconds == 0

    def for_decodes(self, cost: StepCost, decodes: StepWork) -> float:
        """The step time allowed when its decode rows alone are `decodes`."""
        if self.seconds is not None:
            return self.seconds
        own = cost.seconds(decodes)
        return own + max(AUTO_PREFILL_SHARE * own, AUTO_STALL_STREAM_S / max(decodes.rows, 1))


def min_prefill_tokens(max_num_batched_tokens: int, block_size: int) -> int:
    """Prefill tokens a step always allows: a 64th of the fixed budget, at least a block (32
    tokens by default: ~45 ms on a 2-core CPU for a 135M model, a few ms on a GPU)."""
    return max(block_size, max_num_batched_tokens // 64)


class StepBudget:
    """One step's prefill allowance in time. `unbounded()` when nothing limits it."""

    def __init__(self, cost: StepCost | None, seconds: float, min_prefill: int) -> None:
        self._cost = cost
        self._work = StepWork()
        self._seconds = seconds
        self._plan_s = seconds  # the target in the model's (uncorrected) seconds
        self._min_prefill = min_prefill
        self._prefill_rows = 0

    @classmethod
    def unbounded(cls) -> StepBudget:
        return cls(None, 0.0, 0)

    @classmethod
    def for_step(cls, target: ItlTarget, model: StepCostModel,
                 decode_rows: list[tuple[int, int]]) -> StepBudget:
        """The budget of a step whose decode rows are `decode_rows` ((context, tokens) each)."""
        cost = model.budget_cost
        if target.off or not decode_rows or cost is None:
            return cls.unbounded()
        budget = cls(cost, 0.0, target.min_prefill_tokens)
        for context, tokens in decode_rows:
            budget._work = budget._work.plus_row(context, tokens)
        budget._seconds = target.for_decodes(cost, budget._work)
        budget._plan_s = budget._seconds / model.mixed_ratio
        return budget

    @property
    def bounded(self) -> bool:
        return self._cost is not None

    @property
    def seconds(self) -> float:
        """The step time this budget aims at (0 when unbounded)."""
        return self._seconds

    def take_prefill(self, context: int, wanted: int) -> int:
        """How many of `wanted` prefill tokens (after `context` computed ones) the step takes;
        they are counted in. The first prefill row gets at least the minimum."""
        if self._cost is None or wanted <= 0:
            return wanted
        left = self._plan_s - self._cost.seconds(self._work)
        fits = self._cost.tokens_within(left, context)
        if self._prefill_rows == 0:
            fits = max(fits, self._min_prefill)
        take = min(wanted, fits)
        if take > 0:
            self._prefill_rows += 1
            self._work = self._work.plus_row(context, take)
        return take
