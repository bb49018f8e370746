"""Transfer capabilities: the router's signed word that *this* decode instance may pull a KV.

A KV handle says where a prefill instance holds a request's KV; whoever calls StartTransfer
first would get the bytes. With a cluster token configured, the router binds each handle to
the decode instance it chose: it signs (transfer id, that instance's id, an expiry) with the
token and sends the capability along with the handle *only* to that instance, which presents
it in StartTransfer. The sender verifies it in constant time before anything moves, so a
process that learned a handle some other way (another decode instance, a log line) is refused
(PERMISSION_DENIED). Without a token, transfers are unbound, as before (docs/SECURITY.md).

The expiry is wall-clock time: hosts of one mesh need clocks within `MAX_CLOCK_SKEW_S`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdmesh.auth import ClusterToken
from pdmesh.v1 import kv_transfer_pb2 as pb

PURPOSE = "pdmesh/kv-transfer-capability/v1"
DEFAULT_TTL_S = 600.0
"""Longer than the longest lease (300 s) plus a queued decode's wait; the lease, not this,
bounds how long KV stays pinned."""
MAX_CLOCK_SKEW_S = 60.0
MAX_RECEIVER_ID_BYTES = 256


@dataclass(frozen=True)
class TransferCapability:
    receiver_id: str        # instance id of the decode instance the router chose
    expires_unix_ms: int
    mac: str = field(repr=False)

    @classmethod
    def mint(
        cls,
        token: ClusterToken,
        transfer_id: str,
        receiver_id: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> TransferCapability:
        expires = int((clock() + ttl_s) * 1000)
        return cls(receiver_id, expires, _mac(token, transfer_id, receiver_id, expires))

    def check(
        self, token: ClusterToken, transfer_id: str, *, clock: Callable[[], float] = time.time
    ) -> str | None:
        """None if the capability grants `transfer_id`, else why not (for the refusal)."""
        if not self.mac:
            return "no transfer capability"
        if len(self.receiver_id.encode()) > MAX_RECEIVER_ID_BYTES:
            return "malformed transfer capability"
        if not token.verify(self.mac, PURPOSE, transfer_id, self.receiver_id,
                            str(self.expires_unix_ms)):
            return "transfer capability does not match this transfer"
        if self.expires_unix_ms < (clock() - MAX_CLOCK_SKEW_S) * 1000:
            return "transfer capability expired"
        return None

    def to_proto(self) -> pb.TransferCapability:
        return pb.TransferCapability(
            receiver_id=self.receiver_id, expires_unix_ms=self.expires_unix_ms, mac=self.mac
        )

    @classmethod
    def from_proto(cls, msg: pb.TransferCapability) -> TransferCapability:
        return cls(msg.receiver_id, msg.expires_unix_ms, msg.mac)


def _mac(token: ClusterToken, transfer_id: str, receiver_id: str, expires_ms: int) -> str:
    return token.sign(PURPOSE, transfer_id, receiver_id, str(expires_ms))
