"""The prefill/decode decision: prefill on the decode instance, or on a prefill instance?

Conditional disaggregation (llm-d's `prefix_based_pd_decider`): moving a prompt's KV from a
prefill instance only pays when the decode instance would have much of the prompt to compute
itself. So once the decode instance is chosen, the tokens of the prompt it does *not* hold
(the prefix index's answer for it) decide: below `local_prefill_threshold` it prefills
locally and no KV moves; from there on a prefill instance does. A colocated instance always
prefills its own prompts. Blocks the decode instance holds only in an offload tier count as
held here: it restores them by a copy, computing none of their tokens (routing, which compares
instances, weighs them lower: router/routing/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdmesh.router.routing.base import RouteRequest


def uncached_tokens(route: RouteRequest, cached_blocks: int) -> int:
    """The prompt's tokens an instance holding `cached_blocks` leading blocks must compute."""
    held = min(cached_blocks * route.block_size, route.num_prompt_tokens)
    return route.num_prompt_tokens - held


@dataclass(frozen=True)
class PrefillDecision:
    remote: bool  # a prefill instance should prefill (when one is live)
    uncached_tokens: int  # on the decode instance
    reason: str


@dataclass(frozen=True)
class PrefillDecider:
    """Remote prefill from `local_prefill_threshold` uncached tokens on the decode instance."""

    local_prefill_threshold: int

    def decide(self, decode_role: str, route: RouteRequest, cached_blocks: int) -> PrefillDecision:
        uncached = uncached_tokens(route, cached_blocks)
        if decode_role == "colocated" or uncached < self.local_prefill_threshold:
            return PrefillDecision(False, uncached, f"local prefill ({uncached} uncached tokens)")
        return PrefillDecision(
            True, uncached, f"remote prefill ({uncached} uncached tokens on decode)")
