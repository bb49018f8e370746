"""`ExportInfo`, apart from the connector: the serving process reads it without torch."""

from __future__ import annotations

import msgspec


class ExportInfo(msgspec.Struct):
    """What the serving process publishes about an export beside the core's fixed facts."""

    block_checksums: list[int]
    checksum_algo: str


class ExportProgress(msgspec.Struct, gc=False, omit_defaults=True):
    """A streamed export grew (prefill role, after a step): blocks `first_index...` of the
    export are now full, computed and pullable, with their checksums; `sealed` when the
    prefill ended (every block, the partial last one included, has been reported);
    `failed` names why the export will serve no more (the request was preempted or
    aborted). The receiving core takes the same struct (`EngineCore.kv_stream`)."""

    first_index: int = 0
    block_ids: list[int] = []
    block_checksums: list[int] = []
    checksum_algo: str = ""
    sealed: bool = False
    failed: str = ""


class PrefixLoan(msgspec.Struct):
    """Cached prefix blocks an engine core lends a peer (`EngineCore.lend_prefix`): the
    leading blocks of a prompt it holds, pinned until released, with their checksums. No
    blocks: it held none (or fewer than asked for)."""

    block_ids: list[int]
    block_checksums: list[int]
    checksum_algo: str
