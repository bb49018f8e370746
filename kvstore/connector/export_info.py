"""`ExportInfo`, apart from the connector: the serving process reads it without torch."""

from __future__ import annotations

import msgspec


class ExportInfo(msgspec.Struct):
    """What the serving process publishes about an export beside the core's fixed facts."""

    block_checksums: list[int]
    checksum_algo: str
