"""The batched sampler: masks, penalties, bans, seeded reproducibility, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    compute_prompt_logprobs,
    make_generator,
    sampling_probs,
)

pytestmark = pytest.mark.fast

GREEDY = SamplingParams(temperature=0.0)


def meta_for(
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    eos: set[int] | None = None,
) -> SamplingMetadata:
    rows = len(params)
    return SamplingMetadata(
        params=params,
        generators=generators or [None] * rows,
        prompt_token_ids=prompts or [[] for _ in range(rows)],
        output_token_ids=outputs or [[] for _ in range(rows)],
        eos_token_ids=eos or set(),
    )


def log_probs(values: list[float]) -> torch.Tensor:
    """Logits whose softmax is exactly the given (normalized) distribution."""
    return torch.tensor(values, dtype=torch.float32).log().unsqueeze(0)


def kept(probs: torch.Tensor) -> list[int]:
    return torch.nonzero(probs[0] > 0).flatten().tolist()


# ---------------------------------------------------------------------------- masks


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0, 0.0]])
    probs = sampling_probs(logits, [SamplingParams(top_k=2)])
    assert kept(probs) == [1, 3]
    expected = torch.softmax(torch.tensor([4.0, 3.0]), dim=0)
    torch.testing.assert_close(probs[0, [1, 3]], expected)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.45, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_smallest_prefix_reaching_the_mass(top_p: float, expected: list[int]) -> None:
    probs = sampling_probs(log_probs([0.5, 0.3, 0.15, 0.05]), [SamplingParams(top_p=top_p)])
    assert kept(probs) == expected
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])[expected]
    torch.testing.assert_close(probs[0, expected], base / base.sum())


def test_top_p_stops_once_the_mass_is_reached_exactly() -> None:
    # Uniform logits: the running masses 0.25, 0.5, 0.75 are exact in float32.
    probs = sampling_probs(torch.zeros(1, 4), [SamplingParams(top_p=0.5)])
    assert len(kept(probs)) == 2
    torch.testing.assert_close(probs[0][probs[0] > 0], torch.tensor([0.5, 0.5]))


def test_top_p_applies_to_the_top_k_renormalized_distribution() -> None:
    logits = log_probs([0.4, 0.3, 0.2, 0.1])
    assert kept(sampling_probs(logits, [SamplingParams(top_p=0.5)])) == [0, 1]
    # After top-k=2 the distribution is [4/7, 3/7]: the first token alone reaches 0.5.
    assert kept(sampling_probs(logits, [SamplingParams(top_k=2, top_p=0.5)])) == [0]


@pytest.mark.parametrize(("min_p", "expected"), [(0.2, [0, 1, 2]), (0.5, [0, 1]), (0.7, [0])])
def test_min_p_drops_tokens_below_fraction_of_the_top(min_p: float, expected: list[int]) -> None:
    probs = sampling_probs(log_probs([0.5, 0.3, 0.15, 0.05]), [SamplingParams(min_p=min_p)])
    assert kept(probs) == expected


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    probs = sampling_probs(logits, [SamplingParams(temperature=2.0)])
    torch.testing.assert_close(probs[0], torch.softmax(logits[0] / 2.0, dim=0))


MIXED_ROWS = [
    SamplingParams(),
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.6, temperature=0.7),
    SamplingParams(min_p=0.3),
    SamplingParams(top_k=1000),  # larger than the vocabulary: keeps everything
    SamplingParams(top_k=10, top_p=0.9, min_p=0.05, temperature=1.5),
]
ALL_TOP_K_ROWS = [  # every row has top-k: only the best max(k) candidates get sorted
    SamplingParams(top_k=3),
    SamplingParams(top_k=20, top_p=0.5),
    SamplingParams(top_k=30, top_p=0.8, temperature=0.5),
    SamplingParams(top_k=48),
]


@pytest.mark.parametrize("params", [MIXED_ROWS, ALL_TOP_K_ROWS], ids=["mixed", "all-top-k"])
def test_batched_masks_match_each_row_alone(params: list[SamplingParams]) -> None:
    logits = torch.randn(len(params), 64, generator=torch.Generator().manual_seed(0))
    batched = sampling_probs(logits, params)
    for row, p in enumerate(params):
        alone = sampling_probs(logits[row : row + 1], [p])[0]
        torch.testing.assert_close(batched[row], alone)
        if p.uses_top_k:
            assert int((alone > 0).sum()) <= p.top_k
    reference = torch.softmax(logits[1] / params[1].temperature, dim=0)
    top = reference.topk(params[1].top_k)
    if not params[1].uses_top_p:
        torch.testing.assert_close(batched[1, top.indices], top.values / top.values.sum())


# ---------------------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    row = torch.tensor([2.0, -2.0, 1.0, 0.5])
    apply_repetition_penalty(row, [0, 1, 1, 0], 2.0)  # duplicates are penalized once
    assert row.tolist() == [1.0, -4.0, 1.0, 0.5]


def test_presence_and_frequency_penalties_follow_openai() -> None:
    row = torch.zeros(5)
    apply_presence_frequency_penalties(row, [2, 2, 3], presence=0.5, frequency=0.25)
    assert row.tolist() == [0.0, 0.0, -1.0, -0.75, 0.0]


def test_sampler_applies_penalties_over_the_right_tokens() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0]])
    sampler = Sampler(seed=0)
    # Token 0 appears only in the prompt: the repetition penalty sees it, presence does not.
    rep = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert sampler(logits, meta_for([rep], prompts=[[0]]))[0].token_id == 1
    pres = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sampler(logits, meta_for([pres], prompts=[[0]]))[0].token_id == 0
    assert sampler(logits, meta_for([pres], outputs=[[0, 1]]))[0].token_id == 2
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.06)
    # 0.06 * 2 occurrences pushes token 0 below token 1 (2.9) but one occurrence does not.
    assert sampler(logits, meta_for([freq], outputs=[[0]]))[0].token_id == 0
    assert sampler(logits, meta_for([freq], outputs=[[0, 0]]))[0].token_id == 1


def test_logit_bias_changes_the_pick_but_not_the_logprobs() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, logit_bias={2: 5.0}, logprobs=1)
    token = Sampler(seed=0)(logits, meta_for([params]))[0]
    raw = torch.log_softmax(logits[0], dim=0)
    assert token.token_id == 2
    assert token.logprob == pytest.approx(raw[2].item())
    assert token.rank == 3
    assert token.top_logprobs == pytest.approx({0: raw[0].item()})


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])  # eos=0 best, stop token 1 second
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    sampler = Sampler(seed=0)
    eos = {0}
    assert sampler(logits, meta_for([params], outputs=[[3]], eos=eos))[0].token_id == 2
    assert sampler(logits, meta_for([params], outputs=[[3, 3]], eos=eos))[0].token_id == 0
    ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert sampler(logits, meta_for([ignore], outputs=[[3]], eos=eos))[0].token_id == 0


def test_min_tokens_ban_holds_under_random_sampling() -> None:
    logits = torch.tensor([[10.0, 10.0, 0.0, 0.0]]).repeat(200, 1)
    params = [SamplingParams(min_tokens=1, stop_token_ids=[1])] * 200
    sampled = Sampler(seed=1)(logits, meta_for(params, eos={0}))
    assert {s.token_id for s in sampled} <= {2, 3}


# ---------------------------------------------------------------------------- greedy


def test_greedy_fast_path_is_argmax_and_leaves_the_generator_alone() -> None:
    torch.manual_seed(3)
    logits = torch.randn(8, 100)
    sampler = Sampler(seed=11)
    state = sampler.generator.get_state()
    sampled = sampler(logits, meta_for([GREEDY] * 8))
    assert [s.token_id for s in sampled] == logits.argmax(dim=-1).tolist()
    assert all(s.logprob is None and s.rank is None and s.top_logprobs is None for s in sampled)
    assert torch.equal(sampler.generator.get_state(), state)


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    torch.manual_seed(4)
    logits = torch.randn(6, 50)
    params = [GREEDY, SamplingParams(), GREEDY, SamplingParams(top_k=5), GREEDY, GREEDY]
    params[4] = SamplingParams(temperature=0.0, logprobs=2)
    sampled = Sampler(seed=0)(logits, meta_for(params))
    for row in (0, 2, 4, 5):
        assert sampled[row].token_id == int(logits[row].argmax())
    assert sampled[3].token_id in logits[3].topk(5).indices.tolist()


def test_logits_shape_must_match_the_rows() -> None:
    with pytest.raises(ValueError, match="B=2 rows"):
        Sampler(seed=0)(torch.zeros(3, 4), meta_for([GREEDY, GREEDY]))
    with pytest.raises(ValueError, match="generators has 1 rows"):
        SamplingMetadata([GREEDY, GREEDY], [None], [[], []], [[], []], set())


# ---------------------------------------------------------------------------- randomness


def _run_seeded(row_logits: list[torch.Tensor], position: int, others: int, seed: int) -> list[int]:
    """Sample a seeded row for several steps while other rows (seeded or not) share the batch."""
    generator = make_generator(seed)
    noise_generators = [make_generator(1000 + i) if i % 2 else None for i in range(others)]
    sampler = Sampler(seed=99 + others)
    tokens = []
    for step, logits in enumerate(row_logits):
        batch = torch.randn(
            others + 1, logits.shape[0], generator=torch.Generator().manual_seed(step)
        )
        batch[position] = logits
        generators = list(noise_generators)
        generators.insert(position, generator)
        params = [
            SamplingParams(top_k=40) if i % 3 else SamplingParams() for i in range(others + 1)
        ]
        params[position] = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
        sampled = sampler(batch, meta_for(params, generators=generators))
        tokens.append(sampled[position].token_id)
    return tokens


def test_seeded_rows_do_not_depend_on_batch_composition_or_order() -> None:
    steps = [torch.randn(500, generator=torch.Generator().manual_seed(50 + i)) for i in range(12)]
    alone = _run_seeded(steps, position=0, others=0, seed=7)
    assert _run_seeded(steps, position=0, others=3, seed=7) == alone
    assert _run_seeded(steps, position=3, others=3, seed=7) == alone
    assert _run_seeded(steps, position=2, others=6, seed=7) == alone
    assert len(set(alone)) > 3  # genuinely random, not collapsed onto the argmax
    assert _run_seeded(steps, position=0, others=0, seed=8) != alone


def test_unseeded_rows_are_reproducible_from_the_sampler_seed() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams()] * 16
    first = [s.token_id for s in Sampler(seed=123)(logits, meta_for(params))]
    again = [s.token_id for s in Sampler(seed=123)(logits, meta_for(params))]
    other = [s.token_id for s in Sampler(seed=124)(logits, meta_for(params))]
    assert first == again and first != other


def test_make_generator_only_for_seeded_requests() -> None:
    assert make_generator(None) is None
    a, b = make_generator(5), make_generator(5)
    assert a is not None and b is not None
    assert torch.rand(3, generator=a).tolist() == torch.rand(3, generator=b).tolist()
    assert make_generator(-1) is not None  # negative seeds wrap instead of failing


def test_temperature_sampling_frequencies_match_the_distribution() -> None:
    rows = 6000
    probs = [0.6, 0.3, 0.1]
    logits = log_probs(probs).repeat(rows, 1)
    sampler = Sampler(seed=2024)
    for temperature, expected in ((1.0, probs), (0.5, [p * p / 0.46 for p in probs])):
        params = [SamplingParams(temperature=temperature)] * rows
        tokens = torch.tensor([s.token_id for s in sampler(logits, meta_for(params))])
        counts = torch.bincount(tokens, minlength=3).tolist()
        for count, p in zip(counts, expected, strict=True):
            sigma = math.sqrt(rows * p * (1 - p))
            assert abs(count - rows * p) < 5 * sigma, (temperature, counts)


def test_masked_tokens_are_never_sampled() -> None:
    rows = 2000
    logits = torch.tensor([[3.0, 2.9, 2.8, 2.7, 2.6]]).repeat(rows, 1)
    sampled = Sampler(seed=9)(logits, meta_for([SamplingParams(top_k=2)] * rows))
    counts = torch.bincount(torch.tensor([s.token_id for s in sampled]), minlength=5)
    assert counts[2:].sum() == 0 and counts[0] > 0 and counts[1] > 0


# ---------------------------------------------------------------------------- logprobs


def test_logprobs_rank_and_top_n_come_from_raw_logits() -> None:
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(8))
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(logprobs=0, temperature=2.0),
        SamplingParams(temperature=0.0),
        SamplingParams(logprobs=5, top_k=10),
    ]
    sampled = Sampler(seed=0)(logits, meta_for(params, prompts=[[1, 2], [], [], []]))
    raw = torch.log_softmax(logits, dim=-1)
    for row, count in ((0, 3), (1, 0), (3, 5)):
        token = sampled[row]
        assert token.logprob == pytest.approx(raw[row, token.token_id].item())
        assert token.rank == int((raw[row] > raw[row, token.token_id]).sum()) + 1
        values, ids = raw[row].topk(count) if count else (torch.empty(0), torch.empty(0))
        expected = dict(zip(ids.tolist(), values.tolist(), strict=True))
        assert token.top_logprobs == pytest.approx(expected)
        assert list(token.top_logprobs) == list(expected)  # ordered best first
    assert sampled[1].top_logprobs == {}
    assert sampled[2].logprob is None and sampled[2].top_logprobs is None


def test_prompt_logprobs_match_log_softmax() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(12))
    targets = [3, 0, 29, 7, 7, 15]
    result = compute_prompt_logprobs(logits, targets, k=2)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(result) == 6
    for t, (logprob, rank, top) in enumerate(result):
        assert logprob == pytest.approx(raw[t, targets[t]].item())
        assert rank == int((raw[t] > raw[t, targets[t]]).sum()) + 1
        values, ids = raw[t].topk(2)
        assert top == pytest.approx(dict(zip(ids.tolist(), values.tolist(), strict=True)))
    assert all(top == {} for _, _, top in compute_prompt_logprobs(logits, targets, k=0))
    assert compute_prompt_logprobs(torch.zeros(0, 30), [], k=3) == []
    with pytest.raises(ValueError, match="T=2 rows"):
        compute_prompt_logprobs(logits, [1, 2], k=1)
