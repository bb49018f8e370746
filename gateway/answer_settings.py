"""The server's say in every answer, beside what each request asks (vLLM's flags of the same
names): a client that never sets `return_tokens_as_token_ids` or `stream_options` still gets
them when the operator turned them on for everyone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AnswerSettings:
    return_tokens_as_token_ids: bool = False
    """Logprob tokens read `token_id:<id>` in every answer (the request's field ORs in)."""
    enable_force_include_usage: bool = False
    """Every stream ends with a usage chunk, with or without `stream_options.include_usage`."""

    def tokens_as_ids(self, asked: bool | None) -> bool:
        return bool(asked) or self.return_tokens_as_token_ids

    def include_usage(self, asked: bool) -> bool:
        return asked or self.enable_force_include_usage


AS_ASKED = AnswerSettings()
"""Each answer as its request asks, nothing added (the flags' defaults)."""
