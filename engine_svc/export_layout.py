"""The layout of a prefill's KV export, from its engine core's fixed facts (a published
export, or a streamed one before its prompt runs)."""

from __future__ import annotations

from pdmesh.engine.core_types import CoreInfo
from pdmesh.kvstore.transfer.layout import KVLayout


def export_layout(info: CoreInfo, num_blocks: int, num_tokens: int) -> KVLayout:
    """The layout of an export of `num_blocks` from a core with these fixed facts."""
    layers, block_size, heads, head_dim = info.kv_shape
    return KVLayout(layers, num_blocks, block_size, heads, head_dim,
                    info.kv_dtype, num_tokens)
