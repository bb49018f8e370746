"""Batched next-token sampling over a [B, V] logits tensor.

Order of operations for one step (one row per sequence):

1. Logprobs, when any row asks for them, come from the *raw* model logits (log_softmax before
   any bias, penalty or temperature). This is vLLM v1's default: the numbers describe the model,
   not the sampling recipe, so they are comparable across requests and across P/D placement.
2. Logit processing: allowed_token_ids, logit_bias, the min_tokens ban on EOS/stop tokens, the
   repetition penalty (HF semantics over prompt + output tokens), presence and frequency
   penalties (OpenAI semantics over output tokens).
3. Greedy rows take the argmax of the processed logits. Other rows divide by their temperature,
   apply top-k, top-p and min-p masks (one sort shared by the batch), and sample.

Two exact ways to draw from a row's `probs`:

- Rows without a generator (the common case) use the inverse transform: one uniform u per row
  from the sampler's global generator, and the first token whose cumulative probability
  exceeds u times the row's mass. A cumulative sum over the row is the whole cost (~1 ms for
  16 rows of a 49k vocabulary on CPU, against ~20 ms for torch's per-token exponentials).
- A seeded row races: argmax(probs / E) with E ~ Exponential(1) i.i.d. per token, the V
  exponentials drawn from the row's own generator (as -log(1 - U), ~5x cheaper than
  `exponential_` on CPU). Its tokens then do not depend on which rows share the batch or
  where it sits, and a pick depends only on two tokens' scores: that is what lets a resumed
  or migrated sequence skip exactly one draw per token (`skip_one_draw`), and tests tell a
  float near-tie from a divergence (tests/near_tie.py).

Everything per row stays on the logits' device: row indices and per-row parameters cross to
it with asynchronous copies, never by indexing with Python lists (which on CUDA copies and
synchronises each time), and ids that need deduplication are deduplicated on the host. Off
the CPU nothing in `sample_ids` waits for the device (the candidate shortcut of top-p, which
needs one look at a device value, is CPU-only), so async scheduling keeps its overlap. The
sampled ids come back in one device-to-host copy per step; logprob tensors follow only when a
row asked for them.

Host work per step grows with the batch, not with its context: token histories are read only
for rows with a penalty, and only seeded rows are visited one by one.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import torch

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.worker.sampling_masks import (
    candidates_hold_support,
    device_tensor,
    masked_candidates,
    row_index,
    sampling_probs,
)


@dataclass
class SamplingMetadata:
    """Everything the sampler needs about the rows of one step, in row order."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    """Per-row generator; None means "use the sampler's global generator"."""
    prompt_token_ids: list[list[int]]
    """Used by the repetition penalty together with output_token_ids (HF semantics). Read only
    for rows with a penalty (`params.needs_penalties`): a caller may leave the others' empty,
    as `StepSampler` does, since copying every row's history each step costs batch x context."""
    output_token_ids: list[list[int]]
    """Used by presence/frequency penalties; read only for rows with a penalty, as above."""
    eos_token_ids: set[int]
    """Banned, with each row's stop_token_ids, while the row has fewer than min_tokens outputs."""
    num_output_tokens: list[int] | None = None
    """Each row's output length, which decides whether min_tokens is still active; None: the
    lengths of output_token_ids (then every row's history must be given)."""

    def __post_init__(self) -> None:
        rows = len(self.params)
        if self.num_output_tokens is None:
            self.num_output_tokens = [len(ids) for ids in self.output_token_ids]
        for name in ("generators", "prompt_token_ids", "output_token_ids", "num_output_tokens"):
            if len(getattr(self, name)) != rows:
                raise ValueError(f"{name} has {len(getattr(self, name))} rows, params has {rows}")

    def num_outputs(self, row: int) -> int:
        """Row `row`'s output length."""
        assert self.num_output_tokens is not None  # set by __post_init__
        return self.num_output_tokens[row]


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    """Raw logprob of token_id; None unless params.logprobs is set."""
    rank: int | None = None
    """1-based rank of token_id under the raw logprobs; None unless params.logprobs is set."""
    top_logprobs: dict[int, float] | None = None
    """The params.logprobs most likely tokens and their raw logprobs, nothing else."""
    dead_end: bool = False
    """No token was left to pick: the row's masks (allowed_token_ids, grammar, bad words, the
    min_tokens ban) together forbade every one. `token_id` is then meaningless; the sample
    ends with what it has (engine/core/output_commit.py)."""


def child_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed: the request's own for sample 0, a hash of it for the others."""
    if seed is None or index == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little")


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A per-sequence generator for a seeded request (None for unseeded ones).

    Give each of a request's n sequences a distinct seed (e.g. seed + index) so they differ.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (1 << 64))
    return generator


class Sampler:
    """Turns one step's logits into one token (plus optional logprobs) per row."""

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        # The global generator must live on the logits' device for torch.rand to accept it.
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> list[SampledToken]:
        """One token per row on the host, with logprobs for the rows that asked."""
        processed = self._processed(logits, meta)
        token_ids = self._pick(processed, meta)
        # A row whose every logit is -inf picks a token of logit -inf (argmax: the first;
        # a draw: from NaN probabilities); any other row picks a finite one. One gather tells
        # them apart, read back in the same copy as the ids.
        dead = processed.gather(1, token_ids.unsqueeze(1)).squeeze(1).isneginf()
        ids, dead_ends = torch.stack((token_ids, dead.to(token_ids.dtype))).tolist()
        sampled = [SampledToken(token_id=t, dead_end=bool(d))
                   for t, d in zip(ids, dead_ends, strict=True)]
        logprob_rows = [i for i, p in enumerate(meta.params) if p.logprobs is not None]
        if logprob_rows:  # from the raw logits: the pick read a processed copy of them
            picked = logits.index_select(0, row_index(logprob_rows, logits.device))
            raw_logprobs = torch.log_softmax(picked.float(), dim=-1)
            _attach_logprobs(sampled, raw_logprobs, logprob_rows, token_ids, meta)
        return sampled

    def sample_ids(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The sampled ids `[B]` on the logits' device. Nothing here waits for a GPU, so async
        scheduling can launch the next step before these ids reach the host. No row here can
        be a dead end (`SampledToken.dead_end`): a step left in flight has no grammar, bad
        words or min_tokens ban (engine/worker/in_flight.py `may_overlap`), and
        allowed_token_ids alone always leaves a token."""
        return self._pick(self._processed(logits, meta), meta)

    @staticmethod
    def _processed(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The logits the pick reads: `logits` itself for a plain greedy batch, else a float32
        copy with every row's logit processing applied."""
        if logits.dim() != 2 or logits.shape[0] != len(meta.params):
            raise ValueError(
                f"logits must be [B, V] with B={len(meta.params)} rows, got {tuple(logits.shape)}"
            )
        if _is_plain_greedy_batch(meta):
            return logits
        processed = logits.to(torch.float32, copy=True)
        _apply_logit_processing(processed, meta)
        return processed

    def _pick(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax; the rest sample from their masked distribution."""
        random_rows = [i for i, p in enumerate(meta.params) if not p.is_greedy]
        if not random_rows:
            return logits.argmax(dim=-1)
        row_params = [meta.params[i] for i in random_rows]
        generators = [meta.generators[i] for i in random_rows]
        every_row = len(random_rows) == len(meta.params)
        index = None if every_row else row_index(random_rows, logits.device)
        rows = logits if index is None else logits.index_select(0, index)
        if all(g is None for g in generators) and candidates_hold_support(row_params):
            chosen = self._draw_on_candidates(rows, row_params)
        else:
            chosen = self._draw(sampling_probs(rows, row_params), generators)
        if index is None:
            return chosen
        # Every row's argmax (greedy rows keep theirs); random rows are then overwritten.
        return logits.argmax(dim=-1).index_copy_(0, index, chosen)

    def _draw_on_candidates(self, logits: torch.Tensor, params: list[SamplingParams]
                            ) -> torch.Tensor:
        """Unseeded rows whose top-k / top-p masks keep only candidates: temperature, masks,
        softmax and the draw all run on the [rows, candidates] slice, never on the full
        vocabulary again. The same distribution as `sampling_probs` (masked tokens have
        probability 0 in both), without its scatter back, full softmax and second top-k."""
        temperatures = device_tensor([p.temperature for p in params], logits.dtype,
                                      logits.device)
        candidates, order, drop = masked_candidates(logits / temperatures.unsqueeze(1), params)
        probs = torch.softmax(candidates.masked_fill_(drop, -torch.inf), dim=-1)
        winner = inverse_transform(probs, self._uniforms(probs.shape[0], probs.device))
        return order.gather(1, winner.unsqueeze(1)).squeeze(1)

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]
              ) -> torch.Tensor:
        """One token per row of `probs`: seeded rows race against their own generator's
        noise (drawn row by row, in row order: each from its own generator), the others take
        the inverse transform of one global uniform each, in one batch. Only the seeded rows
        are visited in Python."""
        rows, device = probs.shape[0], probs.device
        seeded_generators = [g for g in generators if g is not None]
        if not seeded_generators:
            return inverse_transform(probs, self._uniforms(rows, device))
        noise = torch.stack([race_noise(probs.shape[1], g, device) for g in seeded_generators])
        if len(seeded_generators) == rows:
            return probs.div(noise).argmax(dim=-1)
        seeded = [i for i, g in enumerate(generators) if g is not None]
        unseeded = [i for i, g in enumerate(generators) if g is None]
        seeded_index, unseeded_index = row_index(seeded, device), row_index(unseeded, device)
        chosen = torch.empty(rows, dtype=torch.long, device=device)
        chosen.index_copy_(0, seeded_index,
                           probs.index_select(0, seeded_index).div_(noise).argmax(dim=-1))
        drawn = inverse_transform(probs.index_select(0, unseeded_index),
                                  self._uniforms(len(unseeded), device))
        return chosen.index_copy_(0, unseeded_index, drawn)

    def _uniforms(self, rows: int, device: torch.device) -> torch.Tensor:
        """`[rows, 1]` uniforms in [0, 1) from the global generator (float32, as the running
        sums they are compared with: a token's chance is its probability to ~1e-7)."""
        return torch.rand(rows, 1, dtype=torch.float32, device=device,
                          generator=self.generator)


def inverse_transform(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` `[R, W]` (non-negative, each with some mass, need not sum to 1), the
    first column whose cumulative mass exceeds `uniforms` `[R, 1]` (in [0, 1)) times the
    row's total: an exact draw. The target is held below the total, and a column of
    probability 0 adds nothing to a sequentially computed running sum, so the column found
    has mass. A parallel scan (CUDA) need not be monotone to the last bit: a pick of
    probability 0 is then replaced by the row's first column with mass (where the running sum
    first leaves 0, which no rounding can move), so a masked token is never returned."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    below_total = torch.minimum(uniforms.to(cdf.dtype) * total,
                                torch.nextafter(total, torch.zeros_like(total)))
    targets = torch.cat([below_total, torch.zeros_like(below_total)], dim=1)
    found = torch.searchsorted(cdf, targets, right=True).clamp_max_(probs.shape[1] - 1)
    picked, first = found[:, :1], found[:, 1:]
    return torch.where(probs.gather(1, picked) > 0, picked, first).squeeze(1)


def race_noise(vocab_size: int, generator: torch.Generator,
               device: torch.device | str | None = None) -> torch.Tensor:
    """A seeded row's race noise for one token: `vocab_size` Exponential(1) draws from its
    generator, as -log(1 - U) for U uniform in [0, 1) (never infinite), floored at the
    smallest normal float so that every token of positive probability scores above 0 and a
    masked one (probability exactly 0) can never win."""
    noise = torch.rand(vocab_size, dtype=torch.float32, device=device or generator.device,
                       generator=generator)
    return noise.neg_().log1p_().neg_().clamp_min_(torch.finfo(torch.float32).tiny)


def skip_one_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Advance a sequence's generator exactly as sampling one random token does.

    Used when that token was sampled on another instance (prefill in P/D), so the decode side
    continues the same random stream and seeded output matches colocated serving.
    """
    race_noise(vocab_size, generator)


def _is_plain_greedy_batch(meta: SamplingMetadata) -> bool:
    """The hot path: every row is greedy with nothing to adjust and no logprobs to return."""
    for row, params in enumerate(meta.params):
        if (
            not params.is_greedy
            or params.logprobs is not None
            or params.needs_logit_processing
            or meta.num_outputs(row) < params.min_tokens
        ):
            return False
    return True


def _apply_logit_processing(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """In place, row by row: only rows that need it pay, and the ids touched are sparse."""
    device = logits.device
    for row, params in enumerate(meta.params):
        if params.allowed_token_ids:  # first: what follows only moves the kept logits
            keep = row_index(params.allowed_token_ids, device)
            kept = logits[row].index_select(0, keep)
            logits[row].fill_(-torch.inf).index_copy_(0, keep, kept)
        if params.logit_bias:
            ids = row_index(list(params.logit_bias.keys()), device)
            bias = device_tensor(list(params.logit_bias.values()), logits.dtype, device)
            logits[row].index_add_(0, ids, bias)
        if meta.num_outputs(row) < params.min_tokens:
            banned = set(params.all_stop_token_ids)
            if not params.ignore_eos:
                banned |= meta.eos_token_ids
            if banned:
                logits[row].index_fill_(0, row_index(sorted(banned), device), -torch.inf)
        output_ids = meta.output_token_ids[row]
        if params.repetition_penalty != 1.0:
            apply_repetition_penalty(
                logits[row], meta.prompt_token_ids[row] + output_ids, params.repetition_penalty
            )
        if output_ids and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
            apply_presence_frequency_penalties(
                logits[row], output_ids, params.presence_penalty, params.frequency_penalty
            )


def apply_repetition_penalty(row: torch.Tensor, seen_ids: list[int], penalty: float) -> None:
    """HF semantics: for every token seen in prompt or output, shrink its logit toward "less
    likely" — positive logits are divided by the penalty, negative ones multiplied."""
    if not seen_ids:
        return
    ids = row_index(sorted(set(seen_ids)), row.device)  # deduplicated on the host: no sync
    values = row.index_select(0, ids)
    row.index_copy_(0, ids, torch.where(values > 0, values / penalty, values * penalty))


def apply_presence_frequency_penalties(
    row: torch.Tensor, output_ids: list[int], presence: float, frequency: float
) -> None:
    """OpenAI semantics: logit -= frequency * count + presence * (count > 0), output tokens only."""
    counted = Counter(output_ids)  # on the host: a device unique() would synchronise
    ids = row_index(sorted(counted), row.device)
    counts = device_tensor([counted[i] for i in sorted(counted)], row.dtype, row.device)
    row.index_copy_(0, ids, row.index_select(0, ids) - (frequency * counts + presence))


def _attach_logprobs(
    sampled: list[SampledToken],
    raw_logprobs: torch.Tensor,
    rows: list[int],
    token_ids: torch.Tensor,
    meta: SamplingMetadata,
) -> None:
    """Fill in logprobs from one host copy of each tensor, never one per row."""
    chosen = token_ids.index_select(0, row_index(rows, token_ids.device)).unsqueeze(1)
    chosen_logprobs = raw_logprobs.gather(1, chosen)
    ranks = ((raw_logprobs > chosen_logprobs).sum(dim=-1) + 1).tolist()
    chosen_values = chosen_logprobs.squeeze(1).tolist()
    max_top = max(meta.params[row].logprobs or 0 for row in rows)
    top_ids: list[list[int]] = [[] for _ in rows]
    top_values: list[list[float]] = [[] for _ in rows]
    if max_top > 0:
        values, ids = raw_logprobs.topk(max_top, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    for k, row in enumerate(rows):
        count = meta.params[row].logprobs or 0
        token = sampled[row]
        token.logprob = chosen_values[k]
        token.rank = ranks[k]
        token.top_logprobs = dict(zip(top_ids[k][:count], top_values[k][:count], strict=True))


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: list[int], k: int
) -> list[tuple[float, int, dict[int, float]]]:
    """Raw logprobs of each prompt token given its prefix.

    `logits[t]` is the model's output at position t and `target_ids[t]` the token that actually
    follows it (so for a prompt p, pass logits of p[:-1] and targets p[1:]). Returns, per
    position, the target's logprob, its 1-based rank, and the top-k tokens with their logprobs.
    """
    if logits.dim() != 2 or logits.shape[0] != len(target_ids):
        raise ValueError(
            f"logits must be [T, V] with T={len(target_ids)} rows, got {tuple(logits.shape)}"
        )
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not target_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = row_index(target_ids, logits.device).unsqueeze(1)
    target_logprobs = logprobs.gather(1, targets)
    ranks = ((logprobs > target_logprobs).sum(dim=-1) + 1).tolist()
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        tops = [
            dict(zip(ids, values, strict=True))
            for ids, values in zip(top_ids.tolist(), top_values.tolist(), strict=True)
        ]
    else:
        tops = [{} for _ in target_ids]
    return list(zip(target_logprobs.squeeze(1).tolist(), ranks, tops, strict=True))
