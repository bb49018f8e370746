"""The stop rule: does a sequence end with the token it just produced, and why.

One function for every place that decides it: the engine after each sampled token, and the
prefill instance for its first token (it hands the request to a decode instance, which must not
continue a sequence the engine would have stopped).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from pdmesh.engine.sampling_params import SamplingParams

Finish = tuple[Literal["stop", "length"], int | str | None]
"""(finish reason, stop reason): the stop token id or stop string, None for EOS and length."""


def check_stop(
    token_id: int,
    *,
    num_output_tokens: int,
    num_tokens: int,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    max_model_len: int,
    stop_str: str | None = None,
) -> Finish | None:
    """How the sequence ends at `token_id` (its `num_output_tokens`-th output token, making
    `num_tokens` in all), or None when it goes on. `stop_str` is the stop string the
    detokenizer found in the new text, if any.

    Stops count only past `min_tokens` (the sampler bans stop tokens until then).
    """
    if num_output_tokens > params.min_tokens:
        if token_id in params.all_stop_token_ids:
            return "stop", token_id
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop", None
        if stop_str is not None:
            return "stop", stop_str
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return "length", None
    if num_tokens >= max_model_len:
        return "length", None
    return None


def first_token_finish(
    token_id: int, num_prompt_tokens: int, params: SamplingParams, eos_token_ids: Collection[int],
    max_model_len: int,
) -> Finish | None:
    """`check_stop` for a sequence's first output token (the prefill instance's). Stop
    *strings* are left to the decode instance, which finishes such a sequence at once with the
    right text."""
    return check_stop(token_id, num_output_tokens=1, num_tokens=num_prompt_tokens + 1,
                      params=params, eos_token_ids=eos_token_ids, max_model_len=max_model_len)
