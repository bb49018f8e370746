"""Incremental detokenization of one output sequence, with stop strings and safe streaming.

Turning tokens into final text as they come is `token_decoder.py`'s part (a decode window,
UTF-8 safe, in Rust where the tokenizer is a fast one). This module adds what a served
sequence needs on top: stop strings, found as soon as their last character is final and cut
from the text, and one more hold-back for streaming: the tail of the text that could still
grow into a stop string is not released by `get_delta` until it is known not to be one, so a
client never sees text that is later cut off.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.engine.frontend.token_decoder import Tokenizer, make_token_decoder
from pdmesh.engine.sampling_params import SamplingParams


def find_stop(text: str, stops: Sequence[str], new_from: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends after index `new_from` (in the new text).

    Matches lying wholly before `new_from` were examined in an earlier step (or skipped on
    purpose, under min_tokens). On a tie the stop listed first wins.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, new_from - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a prefix of some stop string."""
    if not text:
        return 0
    last = text[-1]
    best = 0
    for stop in stops:
        # A suffix of `text` that begins `stop` ends, in `stop`, at an occurrence of the last
        # character; mostly there is none, and the check costs one `rfind`.
        end = min(len(stop), len(text))
        index = stop.rfind(last, 0, end)
        while index + 1 > best:
            if text.endswith(stop[: index + 1]):
                best = index + 1
                break
            index = stop.rfind(last, 0, index)
    return best


class IncrementalDetokenizer:
    """Text, stop-string detection and streaming deltas for one output sequence.

    Call `update` with each step's new tokens. It returns the stop string that matched, if
    any; the caller then finishes the sequence (finish_reason "stop", stop_reason = that
    string). Tokens in `params.stop_token_ids` — and the last token when the caller passes
    `stop_terminated=True` (EOS) — end the sequence and, unless include_stop_str_in_output, add
    no text. When the sequence ends for another reason (max_tokens, abort) call `finish()`, so
    that `get_delta` releases the held-back tail. Updating a finished sequence raises.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop_strings)
        self._stop_token_ids = frozenset(params.all_stop_token_ids)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Only the tail of committed text can take part in a stop string that ends later.
        self._tail_keep = max((len(s) for s in self._stops), default=1) - 1

        self._decoder = make_token_decoder(tokenizer, prompt_token_ids, self._skip_special)
        self._output_ids: list[int] = []

        self._parts: list[str] = []  # committed text, joined on demand
        self._tail = ""  # last _tail_keep committed characters
        self._unsent = ""  # committed text not yet returned by get_delta
        self._pending_released = False
        self.finished = False
        self.stop_reason: str | None = None
        """The stop string that ended the sequence, if one did."""

    # ------------------------------------------------------------------ inputs

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append this step's tokens; return the matched stop string, if any.

        `stop_terminated` says the last token ended the sequence (EOS); it is then treated like
        a stop token id. Tokens after a stop within the same call are ignored.
        """
        if self.finished:
            raise RuntimeError("update() called on a finished sequence")
        last = len(new_token_ids) - 1
        for position, token_id in enumerate(new_token_ids):
            self._output_ids.append(token_id)
            is_stop_token = (stop_terminated and position == last) or (
                token_id in self._stop_token_ids and self._past_min_tokens()
            )
            if is_stop_token and not self._include_stop:
                self.finished = True
                return None
            matched = self._decode_next(token_id)
            if matched is not None or is_stop_token:
                self.finished = True
                return matched
        return None

    def finish(self) -> None:
        """Mark the sequence as ended for a reason other than a stop (length, abort)."""
        self.finished = True

    # ------------------------------------------------------------------ outputs

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens accepted so far, including a terminating stop token; excluding any that
        followed a stop within the same update."""
        return list(self._output_ids)

    @property
    def output_text(self) -> str:
        """The text so far. Without stops this equals decoding all output tokens (so while
        running it may end in U+FFFD for an incomplete character; stream with `get_delta`).
        After a stop string it is cut there (kept if include_stop_str_in_output)."""
        text = "".join(self._parts)
        if len(self._parts) > 1:
            self._parts = [text]
        return text + self._pending()

    def get_delta(self) -> str:
        """Text that is safe to stream since the previous call.

        While running, holds back an incomplete character and any tail that could still become
        a stop string; once finished, releases everything left.
        """
        if self.finished:
            delta = self._unsent
            if not self._pending_released:
                delta += self._pending()
                self._pending_released = True
            self._unsent = ""
            return delta
        hold = 0
        if self._stops and not self._include_stop:
            hold = min(stop_prefix_length(self._tail, self._stops), len(self._unsent))
        cut = len(self._unsent) - hold
        delta, self._unsent = self._unsent[:cut], self._unsent[cut:]
        return delta

    # ------------------------------------------------------------------ internals

    def _past_min_tokens(self) -> bool:
        """Stops count from token min_tokens + 1 on, as in the sampler's min_tokens ban."""
        return len(self._output_ids) > self._min_tokens

    def _decode_next(self, token_id: int) -> str | None:
        return self._commit(self._decoder.step(token_id))

    def _pending(self) -> str:
        """Decoded, not yet final (an incomplete character); nothing after a stop string."""
        return "" if self.stop_reason is not None else self._decoder.pending()

    def _commit(self, chunk: str) -> str | None:
        if not chunk:
            return None
        searchable = self._tail + chunk
        self._parts.append(chunk)
        self._unsent += chunk
        if self._stops and self._past_min_tokens():
            match = find_stop(searchable, self._stops, new_from=len(self._tail))
            if match is not None:
                index, stop = match
                end = index + len(stop) if self._include_stop else index
                self._drop_last(len(searchable) - end)
                self.stop_reason = stop
                return stop
        self._tail = searchable[-self._tail_keep :] if self._tail_keep else ""
        return None

    def _drop_last(self, count: int) -> None:
        """Remove `count` committed characters (text after a stop); none were streamed yet."""
        if count == 0:
            return
        if count > len(self._unsent):
            raise AssertionError("stop-string hold-back let part of a stop string stream out")
        self._unsent = self._unsent[:-count]
        text = "".join(self._parts)
        self._parts = [text[:-count]]
