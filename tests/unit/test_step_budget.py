"""The ITL target: the step-cost model learns a known cost, and under a known cost the scheduler
never plans a step past the target (beyond the prefill minimum), while prompts still progress.
"""

from __future__ import annotations

import random

import pytest

from pdmesh.engine.scheduling.step_budget import (
    AUTO_PREFILL_SHARE,
    AUTO_STALL_STREAM_S,
    ItlTarget,
    StepBudget,
    min_prefill_tokens,
)
from pdmesh.engine.scheduling.step_cost import (
    MIN_STEPS,
    StepCost,
    StepCostModel,
    StepWork,
    attention_pairs,
    provisional_cost,
    work_of,
)
from tests.unit.test_scheduler import make_scheduler, make_seq, prompt, run_step

pytestmark = pytest.mark.fast

K = 3.3e-4
TRUE = StepCost(base_s=0.004, per_token_s=0.0003, per_row_s=0.001, per_pair_s=K * 0.0003)


def random_step(rng: random.Random) -> StepWork:
    """A step as serving makes them: some decode rows, sometimes a prefill chunk."""
    rows = [(rng.randrange(16, 2000), 1) for _ in range(rng.randrange(1, 24))]
    if rng.random() < 0.4:
        rows.append((rng.randrange(0, 1500), rng.randrange(16, 1024)))
    return work_of(rows)


def trained_model(noise: float = 0.02, steps: int = 300) -> StepCostModel:
    rng = random.Random(7)
    model = StepCostModel(K)
    for _ in range(steps):
        work = random_step(rng)
        model.observe(work, TRUE.seconds(work) * (1 + rng.uniform(-noise, noise)))
    return model


def test_the_model_learns_a_known_cost() -> None:
    model = trained_model()
    rng = random.Random(11)
    for _ in range(50):
        work = random_step(rng)
        predicted = model.predict(work)
        assert predicted == pytest.approx(TRUE.seconds(work), rel=0.05)


def test_the_model_knows_nothing_until_it_has_seen_prefill_steps() -> None:
    model = StepCostModel(K)
    for i in range(3 * MIN_STEPS):
        work = work_of([(100 + i, 1)] * 8)  # decode steps only
        model.observe(work, TRUE.seconds(work))
    assert not model.ready and model.predict(StepWork(64, 1, 0)) is None
    for i in range(8):
        work = work_of([(0, 200 + i)])
        model.observe(work, TRUE.seconds(work))
    assert model.ready


def test_costs_never_come_out_negative() -> None:
    # Steps whose time falls with their size would fit a negative cost per token.
    model = StepCostModel(K)
    for i in range(64):
        model.observe(work_of([(0, 16 + i * 8)]), 0.5 - i * 0.001)
    assert model.cost is not None
    assert min(model.cost.base_s, model.cost.per_token_s, model.cost.per_row_s,
               model.cost.per_pair_s) >= 0


@pytest.mark.parametrize("context", [0, 100, 3000])
@pytest.mark.parametrize("seconds", [0.0005, 0.01, 0.2, 2.0])
def test_tokens_within_is_the_largest_that_fits(context: int, seconds: float) -> None:
    x = TRUE.tokens_within(seconds, context)

    def cost(n: int) -> float:
        return TRUE.per_row_s + TRUE.per_token_s * n + TRUE.per_pair_s * attention_pairs(
            context, n)

    assert x == 0 or cost(x) <= seconds * (1 + 1e-9)
    assert cost(x + 1) > seconds


def test_auto_target() -> None:
    two = work_of([(100, 1)] * 2)  # few streams: the prompt may take their stall budget
    assert ItlTarget().for_decodes(TRUE, two) == pytest.approx(
        TRUE.seconds(two) + AUTO_STALL_STREAM_S / 2)
    big = work_of([(1000, 1)] * 200)  # many: a share of their own step
    assert ItlTarget().for_decodes(TRUE, big) == pytest.approx(
        (1 + AUTO_PREFILL_SHARE) * TRUE.seconds(big))
    assert ItlTarget(0.05).for_decodes(TRUE, big) == 0.05


def test_budget_is_unbounded_without_decodes_or_a_model() -> None:
    model = trained_model()
    assert not StepBudget.for_step(ItlTarget(0.01), model, []).bounded
    assert not StepBudget.for_step(ItlTarget(0), model, [(10, 1)]).bounded
    assert not StepBudget.for_step(ItlTarget(0.01), StepCostModel(), [(10, 1)]).bounded
    assert StepBudget.unbounded().take_prefill(5, 700) == 700


def test_one_prefill_step_bounds_the_next_mixed_step_before_the_model_is_fitted() -> None:
    """A fresh server's first burst: a full prefill step, then its streams decode beside the
    next prompts. Those steps are bounded by a provisional cost, not left at the full budget;
    nothing is predicted or exported until the fit."""
    model = StepCostModel(K)
    assert model.budget_cost is None  # no prefill step seen: unbounded, as before
    first = work_of([(0, 256)] * 8)
    model.observe(first, TRUE.seconds(first))
    assert not model.ready and model.predict(first) is None
    budget = StepBudget.for_step(ItlTarget(), model, [(256, 1)] * 8)
    assert budget.bounded
    taken = budget.take_prefill(0, 2048)
    assert min_prefill_tokens(2048, 16) <= taken < 2048
    decodes = work_of([(256, 1)] * 8)
    planned = work_of([(256, 1)] * 8 + [(0, taken)])
    allowed = ItlTarget().for_decodes(model.budget_cost, decodes)  # type: ignore[arg-type]
    assert TRUE.seconds(planned) <= allowed * 1.05  # the true step keeps the target


def test_the_provisional_cost_errs_towards_small_chunks() -> None:
    prefill, decode = work_of([(0, 512)]), work_of([(300, 1)] * 8)
    cost = provisional_cost([(prefill, TRUE.seconds(prefill)), (decode, TRUE.seconds(decode))],
                            K)
    assert cost is not None
    assert cost.per_token_s == pytest.approx(TRUE.seconds(prefill) / (512 + K * prefill.pairs))
    assert cost.per_token_s >= TRUE.per_token_s  # a token costs at least what it truly does
    assert cost.per_pair_s == pytest.approx(K * cost.per_token_s)
    assert cost.seconds(prefill) >= TRUE.seconds(prefill)
    assert cost.seconds(decode) >= TRUE.seconds(decode)
    assert provisional_cost([(decode, 0.05)]) is None


def known_cost_scheduler(target_s: float | None, *, budget: int = 512, min_prefill: int = 16):
    """A scheduler whose cost model is `TRUE`, exactly."""
    sched = make_scheduler(1024, budget=budget, max_model_len=4096, max_num_seqs=64)
    sched.config.itl_target = ItlTarget(target_s, min_prefill)
    sched.step_cost.cost = TRUE
    return sched


def step_seconds(out) -> float:
    return TRUE.seconds(work_of([(e.seq.num_computed_tokens, e.num_new_tokens)
                                 for e in out.scheduled]))


def start_decodes(sched, n: int) -> None:
    """`n` short prompts, run until every one decodes."""
    for i in range(n):
        sched.add(make_seq(f"d{i}", prompt(i + 1, 8), max_tokens=400))
    while any(s.is_prefilling for s in sched.running) or len(sched.waiting):
        run_step(sched)


@pytest.mark.parametrize("target_s", [0.03, 0.06, None])
def test_no_step_with_decodes_passes_the_target(target_s: float | None) -> None:
    sched = known_cost_scheduler(target_s)
    start_decodes(sched, 12)
    for i in range(3):  # long prompts arrive together
        sched.add(make_seq(f"p{i}", prompt(100 + i, 900), max_tokens=4))
    prefill_tokens = 0
    for _ in range(200):
        if not any(s.seq_id.startswith("p") for s in (*sched.running, *sched.waiting)):
            break
        # What the step is planned on: work counted before it computes.
        out = sched.schedule()
        seconds = step_seconds(out)
        decodes = [e for e in out.scheduled if e.num_new_tokens == 1]
        prefills = [e for e in out.scheduled if e.num_new_tokens > 1]
        target = ItlTarget(target_s).for_decodes(
            TRUE, work_of([(e.seq.num_computed_tokens, 1) for e in decodes]))
        if decodes and prefills and sum(e.num_new_tokens for e in prefills) > 16:
            assert seconds <= target * (1 + 1e-9), (seconds, target)
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        prefill_tokens += sum(e.num_new_tokens for e in prefills)
        for entry in out.scheduled:  # play the engine's part
            seq = entry.seq
            seq.num_computed_tokens += entry.num_new_tokens
            if seq.num_computed_tokens >= seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= (seq.params.max_tokens or 0):
                    sched.finish(seq, seq.status.FINISHED_LENGTH)
    else:
        pytest.fail("the long prompts never finished")
    assert prefill_tokens >= 3 * 899  # a chunk may leave one token, computed as a 1-token row


def test_prefill_progresses_every_step_even_under_an_impossible_target() -> None:
    sched = known_cost_scheduler(1e-6, min_prefill=16)
    start_decodes(sched, 4)
    sched.add(make_seq("p", prompt(99, 160), max_tokens=1))
    for _ in range(10):
        out = run_step(sched)
        assert [e.num_new_tokens for e in out.scheduled if e.seq.seq_id == "p"] in ([16], [])
        if not any(s.seq_id == "p" for s in sched.running):
            break
    assert not any(s.seq_id == "p" for s in (*sched.running, *sched.waiting))


def test_prefill_alone_takes_the_whole_token_budget() -> None:
    sched = known_cost_scheduler(1e-6, budget=512)
    sched.add(make_seq("p", prompt(5, 2000), max_tokens=1))
    out = run_step(sched)
    assert out.num_batched_tokens == 512


def test_min_prefill_tokens() -> None:
    assert min_prefill_tokens(2048, 16) == 32
    assert min_prefill_tokens(256, 16) == 16


def test_mixed_steps_slower_than_predicted_shrink_the_plan() -> None:
    model = trained_model()
    decodes = [(500, 1)] * 8
    before = StepBudget.for_step(ItlTarget(0.2), model, decodes).take_prefill(0, 4000)
    mixed = work_of([*decodes, (0, 64)])
    for _ in range(60):  # every mixed step takes 1.5x its prediction
        model.observe(mixed, 1.5 * TRUE.seconds(mixed))
    assert model.mixed_ratio == pytest.approx(1.5, rel=0.05)
    after = StepBudget.for_step(ItlTarget(0.2), model, decodes).take_prefill(0, 4000)
    assert after < before
    assert TRUE.seconds(work_of([*decodes, (0, after)])) * 1.5 <= 0.2 * 1.01
