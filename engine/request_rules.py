"""The rules a request must keep, each in one function that every layer calls.

A request's length and footprint are judged in four processes (gateway, router, engine service,
engine core); each used to carry its own arithmetic, and three KV-footprint formulas gave
different answers for the same request (P=1000, max_tokens=100, n=4, block 16: 90 vs 88
blocks). Here they are once: what an unset `max_tokens` means, whether a prompt leaves room to
generate, how many KV blocks a request holds at its peak (the one footprint: the router's
admission budget, its per-instance load slots and the engines' capacity check all use it), and
whether a request could ever fit an instance's KV pool.

Pure functions of plain numbers; no torch. Errors are `RuleViolation`s naming the request field
to fix, which each layer turns into its own status (the router's INVALID_ARGUMENT, the engine's
ValueError).
"""

from __future__ import annotations


class RuleViolation(ValueError):
    """A request that can never be served as sent; `field` names what to fix."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: int | None,
                       max_model_len: int, min_tokens: int = 0) -> int:
    """The output budget: `max_tokens`, or the rest of the context when unset ("up to the
    context limit", as vLLM); RuleViolation when the prompt leaves no room or the asked
    budget does not fit."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise RuleViolation("prompt", f"{num_prompt_tokens} tokens leave no room to generate "
                                      f"within max_model_len={max_model_len}")
    for field, value in (("min_tokens", min_tokens), ("max_tokens", max_tokens)):
        if value is not None and value > room:
            raise RuleViolation(f"sampling.{field}", f"{value} tokens do not fit: the prompt "
                                f"has {num_prompt_tokens} tokens and max_model_len is "
                                f"{max_model_len}")
    return room if max_tokens is None else max_tokens


def request_kv_blocks(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """Blocks a request holds at its peak if each of its `n` samples runs to `max_tokens`.

    The prompt's full blocks are shared by every sample (fork); the rest, the copied partial
    prompt block included, is each sample's own.
    """
    shared = num_prompt_tokens // block_size
    per_sample = -(-(num_prompt_tokens + max_tokens) // block_size) - shared
    return shared + max(1, n) * per_sample


def request_kv_tokens(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """`request_kv_blocks` in token slots: what a token budget (the router's admission) counts."""
    return request_kv_blocks(num_prompt_tokens, max_tokens, n, block_size) * block_size


def kv_capacity_shortfall(num_prompt_tokens: int, max_tokens: int, n: int, *, block_size: int,
                          total_blocks: int, where: str = "this instance") -> str | None:
    """Why a request's samples could never be held at once in a pool of `total_blocks` (so
    retrying cannot help), or None when they could. Callers raise their own error with it."""
    need = request_kv_blocks(num_prompt_tokens, max_tokens, n, block_size)
    if need <= total_blocks:
        return None
    return (f"request needs {need} KV blocks of {block_size} tokens for n={n} x (prompt "
            f"{num_prompt_tokens} + max_tokens {max_tokens}), prompt blocks shared, but "
            f"{where} holds {total_blocks} blocks in all; lower n or max_tokens")


def check_token_ids(token_ids: list[int] | tuple[int, ...], vocab_size: int,
                    field: str = "prompt.token_ids") -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RuleViolation(field, f"token id {bad} is outside [0, {vocab_size})")


def check_allowed_token_ids(value: object) -> list[int]:
    """vLLM's `allowed_token_ids`: a non-empty list of token ids >= 0 (empty is not "any
    token": that is unset), deduplicated and sorted. Checked against the vocabulary where the
    model is known (`SamplingParams.verify_vocab`)."""
    if not isinstance(value, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise RuleViolation("allowed_token_ids", "must be a list of token ids >= 0")
    if not value:
        raise RuleViolation("allowed_token_ids",
                            "must not be empty (leave it unset to allow every token)")
    return sorted(set(value))


def check_stream_interval(value: object) -> int:
    """`stream_interval` (a server flag or a request's own): an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RuleViolation("stream_interval", f"stream_interval must be an integer >= 1, got "
                                               f"{value!r}")
    return value


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int | None
                    ) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the last `keep` tokens of the prompt (its start is
    dropped, as vLLM's generate runner truncates on the left); -1 keeps max_model_len - 1,
    as much as still leaves room for one output token. None: the prompt as is, and so is a
    -1 while `max_model_len` is unknown (no instance live: nothing can run it anyway)."""
    if keep is None:
        return token_ids
    if keep == -1:
        if max_model_len is None:
            return token_ids
        keep = max_model_len - 1
    elif keep < 1:
        raise RuleViolation("truncate_prompt_tokens", f"must be >= 1 or -1, got {keep}")
    elif max_model_len is not None and keep > max_model_len:
        raise RuleViolation("truncate_prompt_tokens", f"{keep} cannot be greater than "
                            f"max_model_len={max_model_len}; request a smaller truncation size")
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


MAX_PROMPT_CACHE_KEY_BYTES = 1024
"""OpenAI's `prompt_cache_key`, a routing affinity key: long enough for any tenant/session id,
short enough that hashing it per routing decision costs nothing."""


def check_prompt_cache_key(key: str) -> str:
    """`prompt_cache_key`: at most MAX_PROMPT_CACHE_KEY_BYTES of UTF-8."""
    if len(key.encode("utf-8", "surrogatepass")) > MAX_PROMPT_CACHE_KEY_BYTES:
        raise RuleViolation("prompt_cache_key", f"must be at most {MAX_PROMPT_CACHE_KEY_BYTES} "
                                                "bytes of UTF-8")
    return key
