"""Per-request sampling parameters, with vLLM-compatible names, defaults and validation.

Validation happens once, at construction, so the sampler and detokenizer can trust every field;
each error names the offending field so the API layer can return it verbatim as a 422 /
INVALID_ARGUMENT. Checks that need the model (vocabulary size) live in `verify_vocab`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from pdmesh.engine.bad_words import MAX_BAD_WORDS
from pdmesh.engine.request_rules import (
    RuleViolation,
    check_allowed_token_ids,
    check_stream_interval,
)
from pdmesh.engine.structured_output import StructuredOutput

MAX_LOGPROBS = 20
"""Upper bound for `logprobs` and `prompt_logprobs` (OpenAI caps top_logprobs at 20)."""

GREEDY_EPSILON = 1e-5
"""Temperatures below this are treated as greedy: dividing logits by ~0 only overflows."""

MAX_LOGIT_BIAS = 100.0
"""OpenAI bounds logit_bias values to [-100, 100]; -100 effectively bans a token."""

_PENALTY_RANGE = (-2.0, 2.0)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    result = float(value)
    if math.isnan(result):
        raise ValueError(f"{name} must not be NaN")
    return result


def _require_int(name: str, value: object) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value  # type: ignore[return-value]


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request and when to stop.

    `top_k` of 0 or -1 disables top-k. `max_tokens=None` means "until the context is full".
    `logprobs=N` returns the top-N raw logprobs per generated token (0 = only the sampled
    token's). `stop` and `stop_token_ids` are normalized to lists.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None
    """A grammar the output must follow (JSON schema, regex, choice, ...); compiled here once
    without a tokenizer so a spec that cannot compile is refused at construction."""
    stream_interval: int | None = None
    """Streaming: hand out new output once this many tokens are pending (the first and the
    last at once). Raises the engine's `stream_interval`, never lowers it (vLLM's)."""
    bad_words: list[str] | None = None
    """Words the output must never contain (vLLM's). Whoever holds the tokenizer (the router,
    engine/bad_words.py) turns them into `bad_words_token_ids`, which is all the core
    reads."""
    bad_words_token_ids: list[list[int]] | None = None
    """Token sequences never to generate (the tokenized `bad_words`)."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled (vLLM's): every other logit is masked."""

    def __post_init__(self) -> None:
        self._validate_counts()
        self._validate_distribution()
        self._validate_penalties()
        self._normalize_logit_bias()
        self._normalize_stops()
        self._validate_logprobs()
        self._validate_bad_words()
        self._validate_allowed_token_ids()
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.seed is not None:
            _require_int("seed", self.seed)
        if self.stream_interval is not None:
            check_stream_interval(self.stream_interval)
        # A spec's limits were checked when it was built; whether it compiles (in time) is the
        # grammar sandbox's verdict where a vocabulary is known (router, engine core).
        if self.structured_output is not None and \
                not isinstance(self.structured_output, StructuredOutput):
            raise ValueError("structured_output must be a StructuredOutput, got "
                             f"{type(self.structured_output).__name__}")

    def _validate_counts(self) -> None:
        if _require_int("n", self.n) < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens is not None and _require_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if _require_int("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    def _validate_distribution(self) -> None:
        self.temperature = _as_float("temperature", self.temperature)
        if self.temperature < 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p:g}")
        if _require_int("top_k", self.top_k) < -1:
            raise ValueError(f"top_k must be >= -1 (0 or -1 disables it), got {self.top_k}")
        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p:g}")

    def _validate_penalties(self) -> None:
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty:g}"
            )
        low, high = _PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value:g}")
            setattr(self, name, value)

    def _normalize_logit_bias(self) -> None:
        """Accept JSON-style string keys ("50256") and store int token id -> float bias."""
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict, got {type(self.logit_bias).__name__}")
        normalized: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                token_id = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if isinstance(key, bool | float) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
            bias = _as_float(f"logit_bias[{token_id}]", value)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias:g} for token {token_id}"
                )
            normalized[token_id] = bias
        self.logit_bias = normalized

    def _normalize_stops(self) -> None:
        stops = self.stop
        if stops is None:
            stops = []
        elif isinstance(stops, str):
            stops = [stops]
        elif not isinstance(stops, list | tuple):
            raise ValueError(f"stop must be a string or a list of strings, got {stops!r}")
        for item in stops:
            if not isinstance(item, str) or not item:
                raise ValueError(f"stop strings must be non-empty strings, got {item!r}")
        self.stop = list(stops)

        token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(token_ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of ints, got {token_ids!r}")
        for token_id in token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"stop_token_ids must be ints >= 0, got {token_id!r}")
        self.stop_token_ids = list(token_ids)

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if not 0 <= _require_int(name, value) <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    def _validate_bad_words(self) -> None:
        words = self.bad_words or []
        if not isinstance(words, list | tuple) or not all(isinstance(w, str) for w in words):
            raise ValueError(f"bad_words must be a list of strings, got {words!r}")
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words must hold at most {MAX_BAD_WORDS} words, got "
                             f"{len(words)}")
        self.bad_words = list(dict.fromkeys(words)) or None
        sequences = self.bad_words_token_ids or []
        if not isinstance(sequences, list | tuple) or len(sequences) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words_token_ids must be a list of at most {MAX_BAD_WORDS} "
                             f"token-id lists")
        for seq in sequences:
            if not isinstance(seq, list | tuple) or not seq or \
                    not all(_is_int(t) and t >= 0 for t in seq):
                raise ValueError(f"bad_words_token_ids entries must be non-empty lists of "
                                 f"token ids >= 0, got {seq!r}")
        self.bad_words_token_ids = [list(seq) for seq in sequences] or None

    def _validate_allowed_token_ids(self) -> None:
        if self.allowed_token_ids is None:
            return
        try:
            self.allowed_token_ids = check_allowed_token_ids(self.allowed_token_ids)
        except RuleViolation as exc:
            raise ValueError(f"{exc.field} {exc}") from None

    # ------------------------------------------------------------------ derived views

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def stop_strings(self) -> list[str]:
        """`stop` after normalization (always a list; typed for callers)."""
        return self.stop if isinstance(self.stop, list) else []

    @property
    def all_stop_token_ids(self) -> list[int]:
        return self.stop_token_ids or []

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0

    @property
    def uses_min_p(self) -> bool:
        return self.min_p > 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def needs_logit_processing(self) -> bool:
        """Whether logits must be altered before the pick, ignoring step-dependent min_tokens."""
        return self.needs_penalties or bool(self.logit_bias) or bool(self.allowed_token_ids)

    def verify_vocab(self, vocab_size: int) -> None:
        """Check token ids against the model's vocabulary; call once at admission."""
        for token_id in self.logit_bias or {}:
            if token_id >= vocab_size:
                raise ValueError(
                    f"logit_bias token id {token_id} is out of range for vocab size {vocab_size}"
                )
        for token_id in self.all_stop_token_ids:
            if token_id >= vocab_size:
                raise ValueError(
                    f"stop_token_ids entry {token_id} is out of range for vocab size {vocab_size}"
                )
        if self.allowed_token_ids and self.allowed_token_ids[-1] >= vocab_size:
            raise ValueError(f"allowed_token_ids entry {self.allowed_token_ids[-1]} is out of "
                             f"range for vocab size {vocab_size}")
        for seq in self.bad_words_token_ids or ():
            if max(seq) >= vocab_size:
                raise ValueError(
                    f"bad_words token id {max(seq)} is out of range for vocab size {vocab_size}"
                )

    def clone(self) -> SamplingParams:
        """A deep copy, so per-sequence tweaks (e.g. a derived seed) never leak between requests."""
        return copy.deepcopy(self)
