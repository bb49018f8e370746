"""The commands a serving process sends its engine core, and what comes back.

Both ways of running a core use these structs: in a thread they are handed over as objects;
across the process boundary they travel as msgpack (`msgspec`, tagged unions, never pickle),
with a tensor (KV going in or out) as a separate raw frame described by a `TensorHeader`.
torch is imported only where a frame carries a tensor: a serving process whose core moves KV
itself never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from pdmesh.engine.core_types import CoreInfo, CoreOutput, EngineLoadSnapshot
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.kv_events import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.connector.source import KVSource

if TYPE_CHECKING:
    import torch

# -- commands (serving process -> core) ------------------------------------------------------


class Add(msgspec.Struct, tag=True):
    """An `EngineRequest` on the wire; its imported KV, if any, is the call's tensor frame."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    export_kv: bool = False
    given_tokens: list[list[int]] | None = None
    num_cached_tokens: int = 0
    kv_source: KVSource | None = None
    stream_kv: bool = False
    prefix_source: KVSource | None = None

    @classmethod
    def of(cls, request: EngineRequest) -> Add:
        """The request without its KV (which goes as the call's tensor)."""
        return cls(**{name: getattr(request, name) for name in cls.__struct_fields__})

    def request(self, kv: torch.Tensor | None) -> EngineRequest:
        return EngineRequest(**msgspec.structs.asdict(self), kv=kv)


class Abort(msgspec.Struct, tag=True):
    request_id: str


class StopSequences(msgspec.Struct, tag=True):
    """The output processor found stop strings in these samples."""

    request_id: str
    indices: list[int]


class ReadKV(msgspec.Struct, tag=True):
    request_id: str


class ExportKV(msgspec.Struct, tag=True):
    """Lend an exported request's blocks to the core's KV connector; the answer is its
    per-block checksums (`kvstore.connector.connector.ExportInfo`)."""

    request_id: str


class ReleaseKV(msgspec.Struct, tag=True):
    request_id: str


class LendPrefix(msgspec.Struct, tag=True):
    """Lend the leading blocks of a peer's prompt this core holds in its prefix cache; the
    answer is a `kvstore.connector.export_info.PrefixLoan` (no blocks: none lent)."""

    lend_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    min_blocks: int = 1
    max_blocks: int = 0  # 0: every block held


class KVStream(msgspec.Struct, tag=True):
    """A streamed source grew (the sender core's progress, relayed by the serving
    processes); the answer says whether the request still waits for it."""

    request_id: str
    progress: ExportProgress


class KVStreamFirstTokens(msgspec.Struct, tag=True):
    """A streamed request's first token of each sample (its prefill ended elsewhere)."""

    request_id: str
    given_tokens: list[list[int]]


class KVSnapshot(msgspec.Struct, tag=True):
    pass


class SetGrammarVocabulary(msgspec.Struct, tag=True):
    """The vocabulary grammars compile against (xgrammar's TokenizerInfo JSON), sent once
    before the first structured request: the core has no tokenizer of its own."""

    vocabulary: str


class Shutdown(msgspec.Struct, tag=True):
    pass


Command = (Add | Abort | StopSequences | ReadKV | ExportKV | ReleaseKV | LendPrefix | KVStream
           | KVStreamFirstTokens | KVSnapshot | SetGrammarVocabulary | Shutdown)


class Call(msgspec.Struct):
    """A command; `call_id` 0 means nobody waits for its result."""

    call_id: int
    command: Command
    tensor: TensorHeader | None = None


# -- replies (core -> serving process) ------------------------------------------------------


class TensorHeader(msgspec.Struct, array_like=True):
    shape: list[int]
    dtype: str


class WireKVEvent(msgspec.Struct, array_like=True):
    kind: str  # "stored" | "removed" | "cleared"
    block_hashes: list[bytes] = []
    parent_hash: bytes | None = None
    medium: str = "paged"  # engine/kv_events.py: Medium, checked by `events_from_wire`


class Ready(msgspec.Struct, tag=True):
    info: CoreInfo


class Batch(msgspec.Struct, tag=True):
    """What one step produced, with the load after it and the KV cache events since."""

    outputs: list[CoreOutput]
    load: EngineLoadSnapshot
    events: list[WireKVEvent] = []


class Result(msgspec.Struct, tag=True):
    call_id: int
    load: EngineLoadSnapshot
    value: Any = None
    error_kind: str | None = None  # "value" | "kv_full" | "key" | "engine"
    error: str | None = None
    tensor: TensorHeader | None = None
    events: list[WireKVEvent] | None = None


class Failed(msgspec.Struct, tag=True):
    """A step failed: every request in flight was aborted."""

    request_ids: list[str]
    message: str
    load: EngineLoadSnapshot


Reply = Ready | Batch | Result | Failed


# -- conversions -----------------------------------------------------------------------------
def events_to_wire(events: list[KVEvent]) -> list[WireKVEvent]:
    wire = []
    for event in events:
        if isinstance(event, BlockStored):
            wire.append(WireKVEvent("stored", list(event.block_hashes), event.parent_hash,
                                    event.medium))
        elif isinstance(event, BlockRemoved):
            wire.append(WireKVEvent("removed", list(event.block_hashes), None, event.medium))
        else:
            wire.append(WireKVEvent("cleared"))
    return wire


def events_from_wire(wire: list[WireKVEvent]) -> list[KVEvent]:
    events: list[KVEvent] = []
    for w in wire:
        if w.kind in ("stored", "removed") and w.medium not in MEDIA:
            raise ValueError(f"unknown KV event medium {w.medium!r}")
        if w.kind == "stored":
            events.append(BlockStored(tuple(w.block_hashes), w.parent_hash,  # type: ignore[arg-type]
                                      w.medium))  # type: ignore[arg-type]
        elif w.kind == "removed":
            events.append(BlockRemoved(tuple(w.block_hashes), w.medium))  # type: ignore[arg-type]
        elif w.kind == "cleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event kind {w.kind!r}")
    return events


_ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""The dtypes a tensor frame may carry, by name, and their sizes in bytes."""


def tensor_to_frame(tensor: torch.Tensor) -> tuple[TensorHeader, memoryview]:
    """A tensor's bytes as one frame (a host copy when it lives on a device)."""
    import torch

    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _ITEMSIZES:
        raise ValueError(f"tensor dtype {dtype} cannot cross the core boundary")
    host = tensor.detach().to("cpu").contiguous()
    return TensorHeader(list(host.shape), dtype), memoryview(host.view(torch.uint8).numpy())


def tensor_from_frame(header: TensorHeader, data: bytes | memoryview) -> torch.Tensor:
    """Validated: the dtype is one of ours and the byte count matches the shape."""
    itemsize = _ITEMSIZES.get(header.dtype)
    if itemsize is None:
        raise ValueError(f"tensor dtype {header.dtype!r} is not one of {sorted(_ITEMSIZES)}")
    if any(d < 0 for d in header.shape):
        raise ValueError(f"tensor shape {header.shape} has a negative dimension")
    count = 1
    for d in header.shape:
        count *= d
    if len(data) != count * itemsize:
        raise ValueError(f"tensor frame holds {len(data)} bytes, shape {header.shape} "
                         f"{header.dtype} needs {count * itemsize}")
    import torch

    dtype = getattr(torch, header.dtype)
    if count == 0:
        return torch.empty(header.shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).reshape(header.shape)


ENCODER = msgspec.msgpack.Encoder()
CALL_DECODER = msgspec.msgpack.Decoder(Call)
REPLY_DECODER = msgspec.msgpack.Decoder(Reply)
