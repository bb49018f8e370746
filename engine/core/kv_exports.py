"""The prefill role's exported KV: blocks a finished request keeps pinned for a decode instance.

A request run with `export_kv` stops after its first token with its blocks pinned (its state
stays in the core's `requests`). From there the serving process either reads the KV out
(`read`: a staged transport) or lends the blocks to the core's KV connector (`lend`: peers
pull them straight from the cache); a lent export leaves `requests`, so its id is free again
(a colocated instance decodes it next). `release` frees the blocks either way, once.
"""

from __future__ import annotations

import torch

from pdmesh.engine.core.request_state import CoreRequest
from pdmesh.engine.scheduling.kv_cache_manager import KVCacheManager
from pdmesh.kvstore.connector.connector import ExportInfo, KVConnector


class KVExports:
    def __init__(self, requests: dict[str, CoreRequest], kv_manager: KVCacheManager,
                 kv_cache: torch.Tensor, connector: KVConnector | None) -> None:
        self.requests = requests  # the core's own dict
        self.kv_manager = kv_manager
        self.kv_cache = kv_cache
        self.connector = connector
        self.lent: dict[str, CoreRequest] = {}

    def _exported(self, request_id: str) -> CoreRequest:
        state = self.requests.get(request_id)
        if state is None or state.kv_export is None:
            raise KeyError(f"request {request_id!r} has no exported KV")
        return state

    def read(self, request_id: str) -> torch.Tensor:
        """KV of an exported request: `[layers, 2, n_blocks, block_size, kv_heads, head_dim]`."""
        state = self._exported(request_id)
        assert state.kv_export is not None
        ids = torch.tensor(state.kv_export.block_ids, device=self.kv_cache.device)
        return self.kv_cache.index_select(2, ids)

    def lend(self, request_id: str) -> ExportInfo:
        """Lend an exported request's blocks to the KV connector: peers pull them straight
        from the cache until `release`. The answer carries one checksum per block."""
        state = self._exported(request_id)
        assert state.kv_export is not None
        if self.connector is None:
            raise ValueError("export_kv: this engine has no KV connector")
        self.lent[request_id] = self.requests.pop(request_id)
        return self.connector.export(request_id, list(state.kv_export.block_ids),
                                     state.kv_export.num_tokens)

    def release(self, request_id: str) -> bool:
        """Free an exported request's pinned blocks (they stay in the prefix cache)."""
        state = self.lent.pop(request_id, None)
        if state is None:
            state = self.requests.get(request_id)
            if state is None or state.kv_export is None:
                return False
            self.requests.pop(request_id)
        if self.connector is not None:
            self.connector.release(request_id)
        self.kv_manager.free(state.seqs[0].seq_id)
        return True

    def any_pinned(self) -> bool:
        return bool(self.lent) or any(s.kv_export is not None for s in self.requests.values())

    def pinned_blocks(self) -> int:
        return sum(len(s.kv_export.block_ids) for s in (*self.requests.values(),
                                                        *self.lent.values())
                   if s.kv_export is not None)
