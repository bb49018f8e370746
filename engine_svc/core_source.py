"""Starting a transfer whose blocks this process's engine core pulls itself: the transport
the pair shares among the core's own, the transfer started on the sender's control plane, and
the `KVSource` the core is handed. One way for every pull an engine makes: a remote prefill's
KV (decode_svc/remote_kv.py, whole or streamed) and a peer's lent prefix
(engine_svc/kv_peer.py)."""

from __future__ import annotations

from pdmesh.engine.core_types import CoreInfo
from pdmesh.kvstore.connector.source import KVSource
from pdmesh.kvstore.transfer.capability import TransferCapability
from pdmesh.kvstore.transfer.core_pull import CorePulls, Pull
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.worker_planes import core_backends


async def start_core_pull(
    pulls: CorePulls, info: CoreInfo, handle: KVHandle, deadline: Deadline, *,
    traceparent: str, capability: TransferCapability | None,
    source_deadline_s: float | None = None, start_deadline: Deadline | None = None,
    streamed: bool = False,
) -> tuple[KVSource, Pull]:
    """The source for the core and the started pull (its lease kept alive until finished);
    raises a `KVTransferError` when no transport is shared or StartTransfer fails.
    `source_deadline_s` bounds the core's load (a streamed pull: each batch's); by default
    what is left of `deadline` once the transfer started."""
    backend = pulls.receiver.choose_backend(
        handle, among=core_backends(info.kv_cache_file, info.kv_block_server,
                                    info.kv_cache_ipc, info.kv_ucx_server))
    pull = await pulls.begin(handle, deadline, backend=backend, traceparent=traceparent,
                             capability=capability, start_deadline=start_deadline)
    source = KVSource(backend, pull.params, list(handle.block_checksums),
                      str(handle.checksum_algo), handle.layout.num_tokens, info.kv_shape,
                      info.kv_dtype,
                      deadline_s=deadline.remaining() if source_deadline_s is None
                      else source_deadline_s, streamed=streamed)
    return source, pull
