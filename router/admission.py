"""Admission control: refuse early, clearly, and with a hint, instead of queueing forever.

Three kinds of refusal, mapped by the server onto the router.proto error taxonomy:

* `InvalidRequest` → INVALID_ARGUMENT, the message names the offending field (TGI's 422);
* `OverCapacity` → RESOURCE_EXHAUSTED with a retry hint in the trailing metadata (TGI's 429);
* `ExceedsKVCapacity` → RESOURCE_EXHAUSTED without a hint: the request's samples could never be
  held at once in a decode instance's KV pool (`check_kv_capacity`), so retrying cannot help.

Limits are per router: concurrent requests, tokens in flight (prompt + max output, the KV the
request may need), and how many requests may wait for a slot and for how long. Waiters are
served in arrival order, so a large request at the head is not starved by small ones behind it.
A waiter whose deadline passes leaves the queue and is refused (DEADLINE_EXCEEDED by the server).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdmesh.engine.request_rules import (
    RuleViolation,
    check_token_ids,
    kv_capacity_shortfall,
    request_kv_tokens,
    resolve_max_tokens,
)
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine_svc import codec
from pdmesh.v1 import common_pb2

RETRY_AFTER_KEY = "retry-after-ms"


class InvalidRequest(ValueError):
    """A request that can never be served as sent; `field` names what to fix."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message if message.startswith(field) else f"{field}: {message}")


class OverCapacity(RuntimeError):
    """Over a limit right now; the same request may succeed after `retry_after_s`.

    `reason` is a metric label: "queue_full" (no room to wait) or "queue_timeout" (waited
    `max_queue_wait_s` in vain).
    """

    def __init__(self, message: str, retry_after_s: float, reason: str = "queue_full") -> None:
        self.retry_after_s = retry_after_s
        self.reason = reason
        super().__init__(message)


class ExceedsKVCapacity(RuntimeError):
    """More KV than a decode instance holds in all; only a smaller request can succeed."""


class DeadlineExpired(TimeoutError):
    """The client's deadline passed while the request waited for admission."""


@dataclass(frozen=True)
class AdmissionLimits:
    max_concurrent_requests: int = 64
    max_inflight_tokens: int = 1_000_000
    max_queued_requests: int = 128
    max_queue_wait_s: float = 30.0
    retry_after_s: float = 1.0  # the base hint; scaled by how crowded the queue is

    def __post_init__(self) -> None:
        for name in ("max_concurrent_requests", "max_inflight_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not self.max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s must be > 0, got {self.max_queue_wait_s}")
        if not self.retry_after_s > 0:
            raise ValueError(f"retry_after_s must be > 0, got {self.retry_after_s}")


@dataclass
class _Waiter:
    tokens: int
    admitted: asyncio.Future[None]


class Ticket:
    """One admitted request's share of the limits; `release()` is idempotent."""

    def __init__(self, admission: Admission, tokens: int) -> None:
        self._admission = admission
        self.tokens = tokens
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self.tokens)

    async def __aenter__(self) -> Ticket:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class Admission:
    """Concurrency, token-budget and queue limits for one router (one asyncio loop)."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.running = 0
        self.inflight_tokens = 0
        self._queue: deque[_Waiter] = deque()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def _fits(self, tokens: int) -> bool:
        return (
            self.running < self.limits.max_concurrent_requests
            and self.inflight_tokens + tokens <= self.limits.max_inflight_tokens
        )

    def _retry_hint(self) -> float:
        crowd = 1 + len(self._queue) / max(1, self.limits.max_concurrent_requests)
        return self.limits.retry_after_s * crowd

    async def acquire(self, tokens: int, timeout_s: float | None = None) -> Ticket:
        """Admit a request needing `tokens`, waiting in FIFO order for at most the smaller of
        `timeout_s` (the client's remaining deadline) and `max_queue_wait_s`."""
        if tokens > self.limits.max_inflight_tokens:
            raise InvalidRequest(
                "sampling.max_tokens",
                f"prompt + max_tokens = {tokens} tokens exceeds the router's token budget "
                f"of {self.limits.max_inflight_tokens}; lower max_tokens or shorten the prompt",
            )
        if not self._queue and self._fits(tokens):
            self._admit(tokens)
            return Ticket(self, tokens)
        if len(self._queue) >= self.limits.max_queued_requests:
            raise OverCapacity(
                f"router at capacity: {self.running} running, {self.inflight_tokens} tokens "
                f"in flight, {len(self._queue)} queued",
                self._retry_hint(),
            )
        waiter = _Waiter(tokens, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        wait_s = self.limits.max_queue_wait_s
        by_deadline = timeout_s is not None and timeout_s < wait_s
        if by_deadline:
            wait_s = max(0.0, timeout_s or 0.0)
        try:
            async with asyncio.timeout(wait_s):
                await asyncio.shield(waiter.admitted)
        except BaseException as exc:
            # Timed out or cancelled; if admission raced in just before, give it back.
            if waiter.admitted.done():
                self._release(tokens)
            else:
                waiter.admitted.cancel()
            if not isinstance(exc, TimeoutError):
                raise
            if by_deadline:
                raise DeadlineExpired("deadline passed while queued for admission") from None
            raise OverCapacity(
                f"waited {self.limits.max_queue_wait_s:g}s for a slot; router still at capacity",
                self._retry_hint(),
                reason="queue_timeout",
            ) from None
        finally:
            if waiter in self._queue:
                self._queue.remove(waiter)
                self._wake()
        return Ticket(self, tokens)

    def _admit(self, tokens: int) -> None:
        self.running += 1
        self.inflight_tokens += tokens

    def _release(self, tokens: int) -> None:
        self.running -= 1
        self.inflight_tokens -= tokens
        self._wake()

    def _wake(self) -> None:
        """Admit waiters from the head of the queue while they fit (strict FIFO)."""
        while self._queue and self._fits(self._queue[0].tokens):
            waiter = self._queue.popleft()
            if waiter.admitted.done():  # its wait was cancelled or timed out
                continue
            self._admit(waiter.tokens)
            waiter.admitted.set_result(None)


def sampling_from_proto(proto: common_pb2.SamplingParams) -> SamplingParams:
    """Engine SamplingParams from the wire message (the one codec's rules); InvalidRequest names
    the bad field.

    `max_tokens` stays None when unset ("up to the context limit"); the caller resolves it
    once the prompt length is known.
    """
    try:
        return codec.sampling_from_proto(proto)
    except codec.SamplingError as exc:
        raise InvalidRequest(exc.field, str(exc)) from None


def validate_prompt(
    token_ids: Sequence[int], params: SamplingParams, *, vocab_size: int, max_model_len: int
) -> int:
    """Check the tokenized prompt against the model; returns the resolved max_tokens."""
    try:
        if not token_ids:
            raise RuleViolation("prompt", "the prompt is empty")
        check_token_ids(token_ids, vocab_size)
        max_tokens = resolve_max_tokens(len(token_ids), params.max_tokens, max_model_len,
                                        params.min_tokens)
    except RuleViolation as exc:
        raise InvalidRequest(exc.field, str(exc)) from None
    try:
        params.verify_vocab(vocab_size)
    except ValueError as exc:
        raise InvalidRequest("sampling." + str(exc).split(" ", 1)[0], str(exc)) from None
    return max_tokens


def budget_tokens(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int | None) -> int:
    """Token slots a request may occupy in KV at its peak (the one footprint,
    `request_kv_tokens`); before any instance told its block size, unrounded."""
    return request_kv_tokens(num_prompt_tokens, max_tokens, n, block_size or 1)


def check_kv_capacity(
    num_prompt_tokens: int, max_tokens: int, n: int, *, block_size: int, capacity_tokens: int
) -> None:
    """Refuse a request whose `n` samples, each run to `max_tokens`, could never be held at once
    in a KV pool of `capacity_tokens` (prompt blocks shared, as the engine forks them). The
    decode engine checks the same rule again; refusing here spares the prefill."""
    shortfall = kv_capacity_shortfall(num_prompt_tokens, max_tokens, n, block_size=block_size,
                                      total_blocks=capacity_tokens // block_size,
                                      where="a decode instance")
    if shortfall is not None:
        raise ExceedsKVCapacity(shortfall)


def retry_after_ms(seconds: float) -> str:
    return str(math.ceil(seconds * 1000))
