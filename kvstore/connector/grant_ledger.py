"""Which blocks each granted pull has been served: one-time per grant and block.

A core serves its exports over more than one transport (the TCP block server, the UCX
listener), and a grant the serving process signed is valid on every one of them. So the core
keeps one ledger for all its block servers: a grant spent on a range over TCP cannot fetch
the same blocks again over UCX. Each server first checks the grant's signature
(`grant_mac.verify`) and the layout, then asks the ledger for the blocks.
"""

from __future__ import annotations

import threading

from pdmesh.kvstore.connector import grant_mac
from pdmesh.kvstore.connector.exports import Export, ExportRegistry


def signed(secret: str, request_id: str, transfer_id: str, grant: str, mac: str) -> bool:
    """Whether the serving process signed this pull (a malformed mac or key is not)."""
    try:  # verify() raises on a non-ASCII mac or a malformed key
        return grant_mac.verify(secret, request_id, transfer_id, grant, mac)
    except (TypeError, ValueError):
        return False


class GrantRefused(Exception):
    """A pull the ledger does not admit (no such export, a range outside it, a block already
    served under this grant); the block server answers it as denied."""


class GrantLedger:
    def __init__(self, exports: ExportRegistry) -> None:
        self._exports = exports
        # (request id, grant) -> the export it was for and the export indices already served
        self._served: dict[tuple[str, str], tuple[Export, set[int]]] = {}
        self._prune_at = 64
        self._lock = threading.Lock()

    def admit(self, request_id: str, grant: str, first: int, count: int) -> tuple[int, ...]:
        """The export's block ids [first, first + count), marked served; `GrantRefused` if
        there is no such export, the range leaves it (a streamed export: the blocks ready so
        far), or a block was already served under this grant."""
        export = self._exports.get(request_id)
        if export is None:
            raise GrantRefused(f"no export for request {request_id!r}")
        end = first + count
        if end > len(export.block_ids):
            raise GrantRefused(f"blocks [{first}, {end}) are outside the export's "
                               f"{len(export.block_ids)}")
        with self._lock:
            if len(self._served) >= self._prune_at:  # forget released exports (amortized)
                for key, (exp, _) in list(self._served.items()):
                    if self._exports.get(key[0]) is not exp:
                        del self._served[key]
                self._prune_at = max(64, 2 * len(self._served))
            entry = self._served.get((request_id, grant))
            if entry is None or entry[0] is not export:
                entry = self._served[(request_id, grant)] = (export, set())
            wanted = range(first, end)
            if not entry[1].isdisjoint(wanted):
                raise GrantRefused("these blocks were already served under this grant")
            entry[1].update(wanted)
        return export.block_ids[first:end]
