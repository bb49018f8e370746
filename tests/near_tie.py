"""Telling a numerical near-tie from a real divergence between two runs of one request.

Float32 logits depend slightly on the batch a row is computed in (GEMM blocking, a prefill
recomputing what decode steps built, a mixed prefill/decode step): about 1e-5 in a logprob on
the CPU path. Two runs of the same request in different batches therefore pick the same tokens
except where two candidates are that close, and from there on they legitimately differ. An
end-to-end test comparing a disturbed run (migration, fallback) with an undisturbed one accepts
a divergence only when it is such a near-tie: the two picks score within `TOLERANCE` of each
other under the request's own sampling (greedy: the logits; seeded: the logits with penalties
and temperature against the sequence's reconstructed random draw). A lost, duplicated or
misaligned token, or a random stream resumed at the wrong draw, is not a near-tie and fails.

Covers what the callers use: greedy, or seeded temperature sampling over the whole vocabulary
(no top-k / top-p / min-p mask, whose boundaries would need the full distribution) with
frequency and presence penalties.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from pdmesh.engine.worker.sampler import child_seed, make_generator, race_noise, skip_one_draw

TOLERANCE = 1e-3  # in score units; batch effects are ~1e-5


@dataclass(frozen=True)
class Pick:
    """One sampled token with its raw logprob (the request asked for logprobs)."""

    token_id: int
    logprob: float


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where the token lists differ (or one ends early); None if equal."""
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def drawn_noise(seed: int, index: int, position: int, vocab_size: int) -> torch.Tensor:
    """The exponential draw a seeded sequence's `position`-th token raced against (CPU)."""
    generator = make_generator(child_seed(seed, index), "cpu")
    assert generator is not None
    for _ in range(position):
        skip_one_draw(generator, vocab_size)
    return race_noise(vocab_size, generator)


class Sampling(Protocol):
    """The sampling fields read here: the engine's SamplingParams and the proto's both have
    them (the proto's unset fields read 0, meaning "off")."""

    temperature: float
    seed: int
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float


def _penalty(params: Sampling, token_id: int, output: list[int]) -> float:
    count = output.count(token_id)
    return params.frequency_penalty * count + (params.presence_penalty if count else 0.0)


def score_margin(
    params: Sampling, index: int, output: list[int], pick: Pick, other: Pick, vocab_size: int,
) -> float:
    """How much `pick` outscores `other` at the position after `output` (the sequence's tokens
    so far) under the request's sampling: the logit gap for greedy, the race's log-score gap
    for seeded sampling. Raw logprobs differ from logits by a per-row constant, which cancels."""
    if params.repetition_penalty not in (0.0, 1.0) or params.top_k > 0 or params.min_p or (
            params.top_p not in (0.0, 1.0)):
        raise ValueError("score_margin covers greedy and plain temperature sampling only")
    diff = (pick.logprob - _penalty(params, pick.token_id, output)) - (
        other.logprob - _penalty(params, other.token_id, output))
    if params.temperature == 0.0:
        return diff
    noise = drawn_noise(params.seed, index, len(output), vocab_size)
    return (diff / params.temperature
            - math.log(float(noise[pick.token_id])) + math.log(float(noise[other.token_id])))


def near_tie_gap(
    params: Sampling, index: int, output: list[int], ref: Pick, got: Pick, vocab_size: int,
) -> float:
    """How far apart two runs' picks score at the same position: 0 is an exact tie."""
    return abs(score_margin(params, index, output, ref, got, vocab_size))


@functools.cache
def model_vocab_size(model: str) -> int:
    """The logits' width for `model` (an alias or directory): the random draw's length."""
    from pdmesh.engine.model_store import resolve_model

    config = json.loads((resolve_model(model) / "config.json").read_text())
    return int(config["vocab_size"])


def assert_same_or_near_tie(
    params: Sampling,
    want: tuple[dict[int, list[int]], dict[int, list[float]]],
    got: tuple[dict[int, list[int]], dict[int, list[float]]],
    vocab_size: int,
    where: str,
) -> set[int]:
    """Each sequence (index -> tokens, index -> their logprobs) of `got` equals `want`'s, or
    parts from it at a near-tie and then still has as many tokens. The indices that parted."""
    (want_tokens, want_logprobs), (got_tokens, got_logprobs) = want, got
    assert got_tokens.keys() == want_tokens.keys(), f"{where}: sequences differ"
    parted: set[int] = set()
    for index, expected in want_tokens.items():
        have = got_tokens[index]
        at = f"{where} sequence {index}"
        assert len(have) == len(expected) == len(got_logprobs[index]), f"{at}: token counts"
        d = first_divergence(have, expected)
        if d is None:
            continue
        gap = near_tie_gap(params, index, expected[:d], Pick(expected[d], want_logprobs[index][d]),
                           Pick(have[d], got_logprobs[index][d]), vocab_size)
        assert gap <= TOLERANCE, (
            f"{at}: token {d} is {have[d]}, the reference's is {expected[d]}, and that is no "
            f"near-tie (gap {gap:.3g}): {have[:d + 3]} vs {expected[:d + 3]}")
        parted.add(index)
    return parted
