"""The sampler's shortcuts give what the long way gives: top-p on a partial top-k keeps the same
tokens as the full sort, and the race on the support draws from the same distribution."""

from __future__ import annotations

import pytest
import torch

import pdmesh.engine.sampler as sampler_module
from pdmesh.engine.sampler import Sampler, SamplingMetadata, sampling_probs
from pdmesh.engine.sampling_params import SamplingParams


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


@pytest.mark.parametrize("row", [
    SamplingParams(temperature=0.8, top_p=0.9),  # the race on the candidates
    SamplingParams(temperature=0.8, top_k=20),  # the same, candidates from top-k
    SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02),  # min-p: the race on the support
], ids=["top_p", "top_k", "min_p"])
def test_race_on_the_support_draws_the_masked_distribution(row: SamplingParams) -> None:
    vocab, draws = 50, 6000
    logits = _logits(1, vocab, 1.5, seed=2).expand(draws, vocab).contiguous()
    params = [row] * draws
    meta = SamplingMetadata(params, [None] * draws, [[1]] * draws, [[]] * draws, set())
    tokens = torch.tensor([t.token_id for t in Sampler(seed=3)(logits, meta)])
    want = sampling_probs(logits[:1].clone(), params[:1])[0]
    got = torch.bincount(tokens, minlength=vocab).float() / draws
    assert set(tokens.tolist()) <= set(torch.nonzero(want).flatten().tolist())
    # Each token's frequency within 5 standard errors of its probability.
    sigma = (want * (1 - want) / draws).sqrt()
    assert bool(((got - want).abs() <= 5 * sigma + 1e-9).all())
