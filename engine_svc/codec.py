"""The one proto <-> engine codec: engine objects <-> pdmesh.v1 messages.

Used by the router and both engine roles. Kept in one place so sampling parameters are parsed
by one set of rules everywhere, and both roles produce byte-identical logprobs, finishes and
text deltas: the proto contract says usage and logprobs must not depend on where a request ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from pdmesh.engine.frontend.detokenizer import stop_prefix_length
from pdmesh.engine.frontend.token_decoder import REPLACEMENT_CHAR
from pdmesh.engine.outputs import CompletionOutput, Logprob, TokenLogprobs
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.structured_output import StructuredOutput
from pdmesh.v1 import common_pb2


class SamplingError(ValueError):
    """A sampling field the engine rejects. `str()` is the engine's message (it starts with the
    field's name); `field` is the field's path in a request (`sampling.top_p`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.field = "sampling." + message.split(" ", 1)[0].split("[", 1)[0]


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Proto -> engine params; `SamplingError` names the offending field (-> INVALID_ARGUMENT).

    `max_tokens` stays None when unset ("up to the context limit"): the router resolves it once
    the prompt length is known and forwards the resolved value to the engines.
    """

    def opt(name: str, default: object) -> object:
        return getattr(msg, name) if msg.HasField(name) else default

    try:
        return SamplingParams(
            n=msg.n or 1,
            temperature=opt("temperature", 1.0),  # type: ignore[arg-type]
            top_p=opt("top_p", 1.0),  # type: ignore[arg-type]
            top_k=msg.top_k,
            min_p=msg.min_p,
            repetition_penalty=opt("repetition_penalty", 1.0),  # type: ignore[arg-type]
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            logit_bias=dict(msg.logit_bias) or None,
            seed=opt("seed", None),  # type: ignore[arg-type]
            stop=list(msg.stop) or None,
            stop_token_ids=list(msg.stop_token_ids) or None,
            include_stop_str_in_output=msg.include_stop_str_in_output,
            ignore_eos=msg.ignore_eos,
            max_tokens=opt("max_tokens", None),  # type: ignore[arg-type]
            min_tokens=msg.min_tokens,
            logprobs=opt("logprobs", None),  # type: ignore[arg-type]
            prompt_logprobs=opt("prompt_logprobs", None),  # type: ignore[arg-type]
            skip_special_tokens=opt("skip_special_tokens", True),  # type: ignore[arg-type]
            structured_output=structured_output_from_proto(msg),
            stream_interval=opt("stream_interval", None),  # type: ignore[arg-type]
            bad_words=list(msg.bad_words) or None,
            bad_words_token_ids=[list(s.token_ids) for s in msg.bad_words_token_ids] or None,
            allowed_token_ids=list(msg.allowed_token_ids) or None,
        )
    except ValueError as exc:
        raise SamplingError(str(exc)) from None


def structured_output_from_proto(msg: common_pb2.SamplingParams) -> StructuredOutput | None:
    """The wire oneof -> the engine's spec (None when unset); ValueError names the field."""
    if not msg.HasField("structured_output"):
        return None
    so = msg.structured_output
    kind = so.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_output is set but names no kind (json_schema, json_object, "
                         "regex, choice or grammar)")
    if kind == "choice":
        return StructuredOutput(choice=tuple(so.choice.choices), reasoning_end=so.reasoning_end)
    if kind == "json_object" and not so.json_object:
        raise ValueError("structured_output.json_object must be true when set")
    return StructuredOutput(**{kind: getattr(so, kind)}, reasoning_end=so.reasoning_end)


# -- integer bounds of the wire ------------------------------------------------------------------
_INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}


def int_range(message: type[Message] | Descriptor, path: str) -> tuple[int, int]:
    """The integers the proto field at `path` can carry, from its declared type.

    `path` walks into message fields with dots: `"max_tokens"` (SamplingParams),
    `"token_ids.ids"` (GenerateRequest), `"logit_bias.key"` (a map's keys). Whoever builds a
    message from values it did not get off the wire (the gateway, from JSON) checks them
    against these bounds first: protobuf refuses an out-of-range integer with a ValueError that
    names no field, and clamping or wrapping would silently change the request.
    """
    descriptor = message if isinstance(message, Descriptor) else message.DESCRIPTOR
    *parents, name = path.split(".")
    for part in parents:
        descriptor = descriptor.fields_by_name[part].message_type
    field = descriptor.fields_by_name[name]
    if field.cpp_type not in _INT_RANGES:
        raise TypeError(f"{descriptor.full_name}.{name} is not an integer field")
    return _INT_RANGES[field.cpp_type]


def check_int(message: type[Message] | Descriptor, path: str, value: int, name: str) -> int:
    """`value` if the proto field at `path` can carry it; else a ValueError naming `name` (the
    caller's name for the value, e.g. `stop_token_ids[2]`) and the bounds."""
    low, high = int_range(message, path)
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


# -- logprobs ------------------------------------------------------------------------------------
def logprob_to_proto(token_id: int, entry: TokenLogprobs, k: int) -> common_pb2.TokenLogprob:
    """One engine logprob entry (chosen token + top-k by rank) as a TokenLogprob."""
    chosen = entry.get(token_id, Logprob(float("nan")))
    ranked = sorted(
        ((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k),
        key=lambda item: item[1].rank or 0,
    )
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=chosen.logprob,
        rank=chosen.rank or 0,
        text=chosen.decoded_token or "",
        top=[
            common_pb2.TokenLogprob.Candidate(
                token_id=tid, logprob=lp.logprob, text=lp.decoded_token or ""
            )
            for tid, lp in ranked
        ],
    )


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprobs:
    """Inverse of `logprob_to_proto` (the decode side continues the prefill's logprobs)."""
    entry = {
        c.token_id: Logprob(c.logprob, rank, c.text) for rank, c in enumerate(msg.top, 1)
    }
    entry[msg.token_id] = Logprob(msg.logprob, msg.rank or None, msg.text)
    return entry


def prompt_logprobs_to_proto(
    entries: Sequence[TokenLogprobs | None] | None, prompt_token_ids: Sequence[int], k: int
) -> list[common_pb2.TokenLogprob]:
    """Entry i describes prompt token i + 1; the first prompt token has no context."""
    if entries is None:
        return []
    out = []
    for position, entry in enumerate(entries):
        if entry is None or position == 0:
            continue
        out.append(logprob_to_proto(prompt_token_ids[position], entry, k))
    return out


# -- finishes and deltas ---------------------------------------------------------------------------
_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}


def finish_to_proto(
    reason: str, stop_reason: str | int | None = None, message: str = ""
) -> common_pb2.Finish:
    finish = common_pb2.Finish(reason=_REASONS.get(reason, common_pb2.FINISH_REASON_ERROR),
                               message=message)
    if isinstance(stop_reason, str):
        finish.stop_str = stop_reason
    elif isinstance(stop_reason, int):
        finish.stop_token_id = stop_reason
    return finish


def settled_text(text: str, stops: Sequence[str], finished: bool) -> str:
    """The prefix of a running sequence's cumulative text that can never change.

    Held back: an incomplete UTF-8 character (trailing U+FFFD) and a tail that could still
    grow into a stop string (the engine cuts text at a stop, but never before such a tail).
    """
    if finished:
        return text
    end = len(text.rstrip(REPLACEMENT_CHAR))
    if stops:
        end -= stop_prefix_length(text[:end], stops)
    return text[:end]


@dataclass
class SequenceCursor:
    """What was already sent of one output sequence (tokens, text) - the delta state."""

    index: int
    sent_tokens: int = 0
    sent_text: str = ""
    done: bool = False


@dataclass
class DeltaBuilder:
    """Turns cumulative `CompletionOutput`s into `SequenceDelta`s that never repeat output.

    `skip_tokens`/`sent_text` seed a cursor with output sent by someone else (the prefill
    instance's first tokens), so decode deltas continue after them.
    """

    params: SamplingParams
    cursors: dict[int, SequenceCursor] = field(default_factory=dict)

    def seed(self, index: int, sent_tokens: int, sent_text: str, done: bool = False) -> None:
        self.cursors[index] = SequenceCursor(index, sent_tokens, sent_text, done)

    def delta(
        self, out: CompletionOutput, *, force_finish: str | None = None
    ) -> common_pb2.SequenceDelta | None:
        """The new part of `out` since the last call; None when there is nothing to send.

        `force_finish` treats a running sequence as ended with that reason (the prefill
        instance's finish check on its first token, or an abort).
        """
        cursor = self.cursors.setdefault(out.index, SequenceCursor(out.index))
        if cursor.done:
            return None
        reason = force_finish or out.finish_reason
        finished = reason is not None
        text = settled_text(out.text, self.params.stop_strings, finished)
        new_text = text[len(cursor.sent_text):] if text.startswith(cursor.sent_text) else ""
        new_tokens = out.token_ids[cursor.sent_tokens:]
        if not new_tokens and not new_text and not finished:
            return None
        delta = common_pb2.SequenceDelta(index=out.index, token_ids=new_tokens, text=new_text)
        if self.params.logprobs is not None and out.logprobs is not None:
            k = self.params.logprobs
            start = cursor.sent_tokens
            for offset, token_id in enumerate(new_tokens):
                entry = out.logprobs[start + offset] if start + offset < len(out.logprobs) else {}
                delta.logprobs.append(logprob_to_proto(token_id, entry, k))
        if finished:
            delta.finish.CopyFrom(finish_to_proto(reason, out.stop_reason))  # type: ignore[arg-type]
            cursor.done = True
        cursor.sent_tokens += len(new_tokens)
        cursor.sent_text += new_text
        return delta

    @property
    def all_done(self) -> bool:
        return len(self.cursors) >= self.params.n and all(c.done for c in self.cursors.values())
