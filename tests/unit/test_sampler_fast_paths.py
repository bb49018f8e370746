"""The sampler's shortcuts give what the long way gives: top-p on a partial top-k keeps the same
tokens as the full sort, and the draws (on the candidates, on the full row, seeded or not)
follow the masked distribution and never pick a masked token."""

from __future__ import annotations

import math

import pytest
import torch

import pdmesh.engine.worker.sampling_masks as sampler_module
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.worker.sampler import (
    Sampler,
    SamplingMetadata,
    inverse_transform,
    make_generator,
    race_noise,
    sampling_probs,
)

pytestmark = pytest.mark.fast


def _logits(rows: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize(("temperature", "top_p", "top_k", "scale"), [
    (0.2, 0.9, 0, 3.0),     # peaked: the nucleus is inside the candidates
    (1.0, 0.95, 0, 0.5),    # flat: it is not, the full sort is taken
    (0.7, 0.8, 40, 2.0),    # top-k and top-p together
    (1.0, 1.0, 0, 1.0),     # neither: the whole row
])
def test_candidate_top_p_equals_the_full_sort(monkeypatch: pytest.MonkeyPatch,
                                              temperature: float, top_p: float, top_k: int,
                                              scale: float) -> None:
    logits = _logits(6, 5000, scale, seed=1)
    params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)] * 6
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", 5000)
    full = sampling_probs(logits.clone(), params)
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", 64)
    fast = sampling_probs(logits.clone(), params)
    assert torch.equal(full > 0, fast > 0)
    torch.testing.assert_close(full, fast)


@pytest.mark.parametrize("rows", [
    [SamplingParams(top_p=0.95)],
    [SamplingParams(top_k=10), SamplingParams(top_p=0.95), SamplingParams(top_p=0.9, top_k=50)],
], ids=["top_p_only", "mixed_with_top_k"])
def test_top_p_on_candidates_measures_mass_against_the_whole_row(
        monkeypatch: pytest.MonkeyPatch, rows: list[SamplingParams]) -> None:
    # 64 leading tokens hold 96 % of the mass, evenly; a long tail holds the rest. top-p 0.95
    # keeps all 64 (the mass before the last is 0.945): renormalized over the candidates,
    # the last three would have had >= 0.95 before them and been dropped.
    vocab, lead = 5000, 64
    row = torch.zeros(vocab)
    row[:lead] = math.log((0.96 / lead) / (0.04 / (vocab - lead))) + 1e-3 * torch.arange(lead)
    logits = row.repeat(len(rows), 1)
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", vocab)
    full = sampling_probs(logits.clone(), rows)
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", lead)
    fast = sampling_probs(logits.clone(), rows)
    top_p_row = next(i for i, r in enumerate(rows) if r.top_p == 0.95 and not r.top_k)
    assert int((full[top_p_row] > 0).sum()) == lead
    assert torch.equal(full > 0, fast > 0)
    torch.testing.assert_close(full, fast)


@pytest.mark.parametrize(("row", "seeded"), [
    (SamplingParams(temperature=0.8, top_p=0.9), False),  # inverse transform on candidates
    (SamplingParams(temperature=0.8, top_k=20), False),  # the same, candidates from top-k
    (SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02), False),  # on the full row
    (SamplingParams(temperature=1.3), False),  # no mask: the full row
    (SamplingParams(temperature=0.8, top_p=0.9, seed=1), True),  # the seeded race
    (SamplingParams(temperature=1.3, seed=1), True),
], ids=["top_p", "top_k", "min_p", "plain", "seeded_top_p", "seeded_plain"])
def test_draws_follow_the_masked_distribution(row: SamplingParams, seeded: bool) -> None:
    vocab, draws = 50, 6000
    logits = _logits(1, vocab, 1.5, seed=2).expand(draws, vocab).contiguous()
    params = [row] * draws
    generators = [make_generator(10_000 + i) if seeded else None for i in range(draws)]
    meta = SamplingMetadata(params, generators, [[1]] * draws, [[]] * draws, set())
    tokens = torch.tensor([t.token_id for t in Sampler(seed=3)(logits, meta)])
    want = sampling_probs(logits[:1].clone(), params[:1])[0]
    got = torch.bincount(tokens, minlength=vocab).float() / draws
    assert set(tokens.tolist()) <= set(torch.nonzero(want).flatten().tolist())
    # Each token's frequency within 5 standard errors of its probability.
    sigma = (want * (1 - want) / draws).sqrt()
    assert bool(((got - want).abs() <= 5 * sigma + 1e-9).all())


def test_inverse_transform_never_picks_a_zero_probability_column() -> None:
    probs = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.7, 0.0, 0.0],
                          [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5],
                          [0.0, 0.0, 0.0, 1e-30, 0.0, 0.0, 0.0]])
    below_one = 1.0 - 2.0 ** -24  # the largest uniform torch.rand returns in float32
    # 0.5 lands on row 1's boundary exactly: the next column with mass takes it.
    for u, want in ((0.0, [2, 0, 3]), (0.25, [2, 0, 3]), (0.5, [4, 6, 3]),
                    (below_one, [4, 6, 3])):
        uniforms = torch.full((3, 1), u, dtype=torch.float32)
        assert inverse_transform(probs, uniforms).tolist() == want, u
    # u = 1 (beyond torch.rand's range, or a product rounded up to the total) would run past
    # the end: it stays on the last column with mass, never the zero tail.
    ones = torch.ones((3, 1), dtype=torch.float32)
    assert inverse_transform(probs, ones).tolist() == [4, 6, 3]
    # Unnormalised rows: the mass is the row's total.
    assert inverse_transform(torch.tensor([[2.0, 0.0, 6.0]]),
                             torch.tensor([[0.25]])).tolist() == [2]


def test_race_noise_is_unit_exponential_and_never_zero_or_infinite() -> None:
    generator = make_generator(5)
    assert generator is not None
    noise = race_noise(200_000, generator)
    assert bool(torch.isfinite(noise).all()) and bool((noise > 0).all())
    assert abs(float(noise.mean()) - 1.0) < 0.01  # Exponential(1): mean 1, sd 1 / sqrt(n)
    assert abs(float((noise > 1.0).float().mean()) - 0.36788) < 0.005  # P(E > 1) = 1/e
