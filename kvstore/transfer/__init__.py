"""KV-cache transfer from prefill to decode: lease-held, pulled, verified, acknowledged.

Public API:

* `KVSender` / `KVSenderConfig` (prefill side): `publish(request_id, kv, num_tokens)` ->
  `KVHandle`; `on_release(request_id, ReleaseReason)` fires exactly once per publish.
* `KVReceiver` / `KVReceiverConfig` (decode side): `await fetch(handle, deadline)`.
* `KVHandle`, `KVLayout`: what crosses the router (`to_proto`/`from_proto`,
  `to_dict`/`from_dict`).
* `TransferState`, `ReleaseReason`, `Deadline`, and the `KVTransferError` family.

Data planes (`backends/`): shm (same host, default there), tcp, ucxx (optional package),
torch_dist (gloo/NCCL). Wire format: `wire.py`. Lease rules: `lease.py`.
"""

from pdmesh.kvstore.transfer.backends import available_backends
from pdmesh.kvstore.transfer.checksum import ChecksumAlgo
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import (
    KVBackendUnavailable,
    KVChecksumError,
    KVHandleError,
    KVSenderUnavailable,
    KVTransferCancelled,
    KVTransferDenied,
    KVTransferError,
    KVTransferExpired,
    KVTransferFailed,
    KVTransferNotFound,
    KVTransferRejected,
    KVTransferTimeout,
    KVWireError,
)
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.layout import KVLayout
from pdmesh.kvstore.transfer.receiver import KVReceiver, KVReceiverConfig
from pdmesh.kvstore.transfer.sender import KVSender, KVSenderConfig
from pdmesh.kvstore.transfer.state import ReleaseReason, TransferState

__all__ = [
    "ChecksumAlgo",
    "Deadline",
    "KVBackendUnavailable",
    "KVChecksumError",
    "KVHandle",
    "KVHandleError",
    "KVLayout",
    "KVReceiver",
    "KVReceiverConfig",
    "KVSender",
    "KVSenderConfig",
    "KVSenderUnavailable",
    "KVTransferCancelled",
    "KVTransferDenied",
    "KVTransferError",
    "KVTransferExpired",
    "KVTransferFailed",
    "KVTransferNotFound",
    "KVTransferRejected",
    "KVTransferTimeout",
    "KVWireError",
    "ReleaseReason",
    "TransferState",
    "available_backends",
]
