"""One step's sampling: which logits rows sample for whom, with what, under which grammar.

The model runner calls it once the forward pass has produced a step's logits. A sequence
samples one row, except the parent of an n > 1 request at its first token, which samples n
rows from the same logits: row i with sample i's generator (the fork made from it takes that
generator over) and the parent's grammar, since the forks do not exist yet. Rows under a
grammar are masked by its matcher (engine/structured/grammar.py) before the `Sampler` sees them,
and so
are the rows of samples with `bad_words` (engine/bad_words.py: the tokens that would
complete
one); only those rows pay.

Sampling ends either on the host (`sample`: tokens and logprobs per sample) or, with async
scheduling, on the device (`launch`: the ids stay in flight, engine/worker/in_flight.py). Prompt
logprobs come from the prompt rows of the same logits.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from pdmesh.engine.bad_words import banned_next_tokens
from pdmesh.engine.core_types import RawLogprob
from pdmesh.engine.scheduling.sequence import Sequence
from pdmesh.engine.structured.grammar import apply_bitmasks
from pdmesh.engine.worker.in_flight import InFlightStep
from pdmesh.engine.worker.sampler import (
    SampledToken,
    Sampler,
    SamplingMetadata,
    child_seed,
    compute_prompt_logprobs,
    make_generator,
)


@dataclass
class Sample:
    """One sampled token of a sequence, and the generator that drew it (a fan-out row's is
    the one its fork goes on with)."""

    token_id: int
    logprob: RawLogprob | None
    generator: torch.Generator | None
    dead_end: bool = False
    """Its masks left no token (`SampledToken.dead_end`): the sample ends without one."""


class StepSampler:
    def __init__(self, sampler: Sampler, eos_token_ids: Collection[int],
                 device: torch.device) -> None:
        self.sampler = sampler
        self.eos_token_ids = set(eos_token_ids)
        self.device = device

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], sample_index: dict[str, int],
               ) -> list[tuple[Sequence, list[Sample]]]:
        """Each sequence with its samples: one, or n for a parent that fans out now."""
        rows: list[int] = []
        owners: list[Sequence] = []
        gens: list[torch.Generator | None] = []
        for seq in seqs:
            fan_out = seq.fork_into if seq.num_output_tokens == 0 else 1
            for i in range(fan_out):
                rows.append(sample_index[seq.seq_id])
                owners.append(seq)
                gens.append(seq.generator if i == 0
                            else make_generator(child_seed(seq.params.seed, i), self.device))
        row_logits = gather_rows(logits, rows)
        if any(seq.grammar is not None for seq in owners):
            row_logits = apply_bitmasks(row_logits, [seq.grammar for seq in owners])
        row_logits = mask_bad_words(row_logits, owners)
        sampled = self.sampler(row_logits, self._metadata(owners, gens))
        by_seq: dict[str, list[Sample]] = {}
        for seq, tok, gen in zip(owners, sampled, gens, strict=True):
            by_seq.setdefault(seq.seq_id, []).append(
                Sample(tok.token_id, sample_logprob(seq, tok), gen, tok.dead_end))
        return [(seq, by_seq[seq.seq_id]) for seq in seqs]

    def launch(self, logits: torch.Tensor, seqs: list[Sequence], sample_index: dict[str, int],
               ) -> InFlightStep:
        """Sample on the device and leave the ids in flight (every seq passed `may_overlap`:
        one row each, nothing read back from the host)."""
        rows = [sample_index[seq.seq_id] for seq in seqs]
        meta = self._metadata(seqs, [seq.generator for seq in seqs])
        return InFlightStep.launch(seqs, self.sampler.sample_ids(gather_rows(logits, rows), meta))

    def _metadata(self, owners: list[Sequence], gens: list[torch.Generator | None],
                  ) -> SamplingMetadata:
        """Token histories (copies of the sequence's lists) only for rows with a penalty, the
        only readers: copying every row's each step made host work grow with batch x context."""
        penalised = [seq.params.needs_penalties for seq in owners]
        return SamplingMetadata(
            params=[seq.params for seq in owners],
            generators=gens,
            prompt_token_ids=[seq.prompt_token_ids if pen else []
                              for seq, pen in zip(owners, penalised, strict=True)],
            output_token_ids=[seq.output_token_ids if pen else []
                              for seq, pen in zip(owners, penalised, strict=True)],
            eos_token_ids=self.eos_token_ids,
            num_output_tokens=[seq.num_output_tokens for seq in owners],
        )


def prompt_logprobs(seq: Sequence, logits: torch.Tensor) -> list[RawLogprob]:
    """Logprobs of the prompt tokens after this step's prompt rows (the first one has none,
    so a row at position t scores token t + 1)."""
    start = seq.num_computed_tokens
    end = min(seq.num_prompt_tokens, start + 1 + logits.shape[0])
    targets = seq.token_ids[start + 1 : end]
    rows = compute_prompt_logprobs(logits[: len(targets)], targets,
                                   seq.params.prompt_logprobs or 0)
    return [raw_logprob(t, lp, rank, top) for t, (lp, rank, top) in zip(targets, rows,
                                                                          strict=True)]


def mask_bad_words(logits: torch.Tensor, owners: list[Sequence]) -> torch.Tensor:
    """`logits` with -inf on each row's tokens that would complete one of its sample's bad
    words (row i samples for `owners[i]`): the same tensor when no row has any, else a masked
    copy (the model's logits are inference tensors, never updated in place out here). Rows
    without bad words cost one attribute check; the rest one host-built index, copied without
    blocking."""
    rows: list[int] = []
    cols: list[int] = []
    width = logits.shape[-1]
    for row, seq in enumerate(owners):
        sequences = seq.params.bad_words_token_ids
        if not sequences:
            continue
        for token in banned_next_tokens(sequences, seq.token_ids, seq.num_prompt_tokens):
            if token < width:  # a padded vocabulary's width; the router checked the ids
                rows.append(row)
                cols.append(token)
    if not rows:
        return logits
    index = torch.tensor([rows, cols]).to(logits.device, non_blocking=True)
    return logits.index_put((index[0], index[1]), logits.new_full((), -torch.inf))


def gather_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if rows == list(range(logits.shape[0])):
        return logits  # one row per sequence, in order: nothing to gather
    # a host tensor copied without blocking: no sync on CUDA
    return logits.index_select(0, torch.tensor(rows).to(logits.device, non_blocking=True))


def raw_logprob(token_id: int, logprob: float, rank: int | None,
                top: dict[int, float] | None) -> RawLogprob:
    ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])
    return RawLogprob(token_id, float(logprob), rank, [t for t, _ in ranked],
                      [float(lp) for _, lp in ranked])


def sample_logprob(seq: Sequence, tok: SampledToken) -> RawLogprob | None:
    """The sampled token's logprob entry, when its request asked for logprobs."""
    if seq.params.logprobs is None or tok.logprob is None:
        return None
    return raw_logprob(tok.token_id, tok.logprob, tok.rank, tok.top_logprobs)
