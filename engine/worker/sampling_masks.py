"""The distribution a sampled row draws from: its temperature, then its top-k, top-p and min-p
masks, on the logits' own device without a host sync. The sampler (sampler.py) draws from it;
kept apart because it is the part of sampling with the numerical rules (which token survives
a mask, how ties at the top-p boundary fall) that tests pin against vLLM's semantics."""

from __future__ import annotations

import torch

from pdmesh.engine.sampling_params import SamplingParams


def device_tensor(
    values: list[int] | list[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A small host list on `device` without waiting for the device (an async copy on CUDA)."""
    host = torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    return device_tensor(rows, torch.long, device)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks, then softmax; one row per params entry.

    top-k keeps the k largest logits. top-p keeps the smallest prefix of the sorted,
    top-k-renormalized distribution whose mass reaches top_p (a token stays if the mass strictly
    before it is < top_p). min-p drops tokens whose probability is below min_p times the most
    likely token's. Masked tokens get probability exactly 0.
    """
    temperatures = device_tensor([p.temperature for p in params], logits.dtype, logits.device)
    scaled = logits / temperatures.unsqueeze(1)
    if any(p.uses_top_k or p.uses_top_p for p in params):
        scaled = _apply_top_k_top_p(scaled, params)
    if any(p.uses_min_p for p in params):
        scaled = _apply_min_p(scaled, params)
    return torch.softmax(scaled, dim=-1)


TOP_P_CANDIDATES = 256
"""Top-p rows without top-k first look at this many best tokens only; when they hold the
row's nucleus (their mass reaches top_p) nothing past them can survive, and a partial top-k
replaces the full sort of the vocabulary (~10x cheaper on CPU at vocab 49k)."""


def candidates_hold_support(params: list[SamplingParams]) -> bool:
    """Whether every row's top-k / top-p masks decide its support (min-p needs the full row's
    probabilities, and a row with neither mask keeps the whole vocabulary)."""
    return all((p.uses_top_k or p.uses_top_p) and not p.uses_min_p for p in params)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    candidates, order, drop = masked_candidates(logits, params)
    masked = torch.full_like(logits, -torch.inf)
    return masked.scatter_(1, order, candidates.masked_fill_(drop, -torch.inf))


def masked_candidates(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(candidates, their vocabulary ids, the top-k / top-p drop mask), candidates sorted
    descending: every token the masks can keep is among them."""
    vocab = logits.shape[1]
    device = logits.device
    k_max = max((p.top_k for p in params if p.uses_top_k), default=vocab)
    if k_max < vocab and all(p.uses_top_k for p in params):
        # Every row keeps at most k_max tokens, and top-p works on the top-k renormalized
        # distribution, so ordering the k_max best suffices: far cheaper than a full sort.
        candidates, order = logits.topk(k_max, dim=-1)
        coverage = None
    else:
        candidates, order, coverage = _nucleus_candidates(logits, params)
    width = candidates.shape[1]

    positions = torch.arange(width, device=device).unsqueeze(0)
    top_k = row_index([p.top_k if p.uses_top_k else width for p in params], device).unsqueeze(1)
    drop = positions >= top_k

    if any(p.uses_top_p for p in params):
        probs = torch.softmax(candidates.masked_fill(drop, -torch.inf), dim=-1)
        if coverage is not None:  # a top-p-only row's mass is its share of the whole row
            probs = probs * coverage.unsqueeze(1)
        mass_before = probs.cumsum(dim=-1) - probs
        # A row with top_p == 1 must keep everything, even where rounding pushes the running
        # mass to 1.0 before the tail.
        top_p = device_tensor(
            [p.top_p if p.uses_top_p else torch.inf for p in params], logits.dtype, device
        ).unsqueeze(1)
        drop |= mass_before >= top_p
        drop[:, 0] = False  # the most likely token always survives
    return candidates, order, drop


EXP_FLOOR = -87.0
"""Where a sum of exp(logit - max) may floor its terms: e^-87 is just above float32's smallest
normal, and a term that small cannot move a sum holding exp(0) = 1, so the sum is unchanged.
Flooring matters for speed: x86 computes exp into the denormal range ~30x slower, and a
low-temperature row (logits / 0.2) puts most of a 49k vocabulary there (1.9 -> 0.5 ms per
batch-16 row sum on the dev machine). Flooring only ever raises the sum: conservative below."""


def _nucleus_candidates(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The sorted candidates every row's masks can keep: the TOP_P_CANDIDATES best when that
    provably loses nothing, else the whole vocabulary sorted; and, for the former, each row's
    coverage: the candidates' share of the row's whole probability mass for a top-p-only row
    (top-p measures mass against the whole distribution, not against the candidates), 1 for
    a row whose top-k renormalizes anyway. None when the candidates are the whole row.

    It loses nothing when every row either uses top-k with k <= the candidate count, or uses
    top-p only and the candidates' probability under the full row already reaches top_p: every
    token past them then has at least that much mass before it and is dropped anyway. Rows
    using neither need the whole row.

    Whether a top-p-only row's candidates reach its top_p is a device value the host must
    read: free on CPU, but on a GPU a sync every step, which would end async scheduling's
    overlap. Off the CPU such rows therefore take the full sort (as vLLM's torch sampler
    does): the same kept tokens, in the same order.
    """
    vocab = logits.shape[1]
    width = min(TOP_P_CANDIDATES, vocab)
    top_p_only = [i for i, p in enumerate(params) if p.uses_top_p and not p.uses_top_k]
    if width == vocab or (top_p_only and logits.device.type != "cpu") or any(
            (not p.uses_top_p and not p.uses_top_k) or (p.uses_top_k and p.top_k > width)
            for p in params):
        candidates, order = logits.sort(dim=-1, descending=True)
        return candidates, order, None
    candidates, order = logits.topk(width, dim=-1)
    if not top_p_only:
        return candidates, order, None
    if len(top_p_only) == len(params):
        full, kept = logits, candidates
    else:
        rows = row_index(top_p_only, logits.device)
        full, kept = logits.index_select(0, rows), candidates.index_select(0, rows)
    peak = kept[:, :1]
    mass = (kept - peak).exp().sum(dim=-1) / (
        (full - peak).clamp_(min=EXP_FLOOR).exp_().sum(dim=-1))
    need = device_tensor([params[i].top_p for i in top_p_only], logits.dtype, logits.device)
    if not bool((mass >= need).all()):  # on the CPU: a read, cheaper than the sort it saves
        candidates, order = logits.sort(dim=-1, descending=True)
        return candidates, order, None
    if len(top_p_only) == len(params):
        return candidates, order, mass
    coverage = torch.ones(len(params), dtype=logits.dtype, device=logits.device)
    return candidates, order, coverage.index_copy_(0, rows, mass)


def _apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    min_p = device_tensor([p.min_p for p in params], logits.dtype, logits.device)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, -torch.inf)
