"""`ucxx` as an engine core's own transport: the control-plane half (torch-free).

The sender core runs a ucxx listener (`connector/ucx_blocks.py`) whose address it reports in
`CoreInfo`; this plane answers StartTransfer with that address and a pull signed with the key
the serving process shares with its core (`connector/grant_mac.py`), bound to the one-time
grant, exactly as the TCP block server's plane does. The receiver's core then pulls the blocks
straight into its cache over UCX, host or device memory, and this process touches no KV byte.
"""

from __future__ import annotations

from pdmesh.kvstore.connector import grant_mac
from pdmesh.kvstore.transfer.lease import Grant
from pdmesh.kvstore.transfer.worker_planes import BlockServerPlane, CoreCache, Exports


class UcxPlane(BlockServerPlane):
    """Admitted like a block-server pull (a `BlockServerPlane`, so exports offer it); the
    bytes go over the core's ucxx listener. UCX has no TLS: `--tls` rules ucxx out."""

    name = "ucxx"

    def __init__(self, core: CoreCache, exports: Exports) -> None:
        super().__init__(core, exports, tls=False)

    async def prepare(self, grant: Grant) -> dict[str, str]:
        self.exports.get(grant.transfer_id)  # published here, not only known to the table
        mac = grant_mac.sign(self.core.grant_key, grant.request_id, grant.transfer_id,
                             grant.token)
        return {"address": self.core.ucx_server, "request": grant.request_id,
                "transfer": grant.transfer_id, "grant": grant.token, "mac": mac}
