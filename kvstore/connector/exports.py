"""What an engine core lends: the pinned blocks of each exported request, by request id.

The core registers an export when a request finishes its prefill with `export_kv` and removes
it when the serving process releases it (the lease ended). A streamed export is registered
when its request is admitted and grows after each step by the blocks its prefill has filled
(`extend`); only those are served. The block server reads it from its
own threads, so every access takes the lock; a pull that races a release may stream blocks
being reused, which the receiving connector's per-block checksums catch (it then recomputes).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Export:
    request_id: str
    block_ids: tuple[int, ...]
    """The blocks ready to serve, in prompt order; a streamed export's only ever grows (the
    tuple is replaced whole, so a reader's snapshot is always a ready prefix)."""
    num_tokens: int


@dataclass
class ExportRegistry:
    _exports: dict[str, Export] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, export: Export) -> None:
        with self._lock:
            self._exports[export.request_id] = export

    def extend(self, request_id: str, block_ids: list[int]) -> None:
        """A streamed export's next ready blocks (no-op once it was removed)."""
        with self._lock:
            export = self._exports.get(request_id)
            if export is not None:
                export.block_ids = (*export.block_ids, *block_ids)

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._exports.pop(request_id, None)

    def get(self, request_id: str) -> Export | None:
        with self._lock:
            return self._exports.get(request_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._exports)
