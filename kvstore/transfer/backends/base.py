"""The data-plane contract: one sender half and one receiver half per backend.

The control plane (gRPC, `control.py`) decides *whether* bytes may move; a data plane only
moves them. The sequence for one transfer:

1. the receiver calls StartTransfer; the lease table moves the transfer to TRANSFERRING and
   mints a one-time token (`Grant`);
2. the sender's `DataPlaneServer.prepare(grant)` readies the bytes and returns string
   parameters (address, token, path) that travel back in the StartTransfer reply;
3. the receiver's `DataPlaneClient.receive(...)` pulls the wire header, checks it against the
   handle *before* writing any payload byte, and fills the destination tensor;
4. the receiver verifies the checksum and acks over the control plane.

Rules every backend follows: servers read the source tensor only inside
`LeaseTable.reading`, whose abort hook must stop the stream promptly; clients bound every
blocking step by the deadline and never return (or raise) while something may still write
into the destination.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

from pdmesh.grpc_common import TLSConfig
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.errors import KVTransferTimeout
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.lease import Grant, LeaseTable

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


@dataclass(frozen=True)
class DataPlaneConfig:
    host: str = "127.0.0.1"            # where data-plane listeners bind
    advertise_host: str = "127.0.0.1"  # what receivers connect to
    shm_dir: str = DEFAULT_SHM_DIR
    max_streams: int = 16              # concurrent outgoing streams per backend
    io_timeout_s: float = 30.0         # bound on any single blocking socket step
    grace_s: float = 2.0               # how long an aborted worker may take to stop
    shm_pool_bytes: int = 1 << 30      # free shm segments kept for reuse
    tls: TLSConfig | None = None       # socket data planes: TLS (mutual with a CA) when set


class DataPlaneServer(abc.ABC):
    """Sender half: serves the bytes of transfers the control plane started."""

    name: ClassVar[str]

    def __init__(self, table: LeaseTable, config: DataPlaneConfig) -> None:
        self.table = table
        self.config = config

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Bind listeners; called once from the sender's event loop."""

    def refusal(self, transfer_id: str, receiver_proof: str) -> str | None:
        """Why this data plane will not serve the caller of StartTransfer, or None to serve.

        Checked before the transfer starts, so a refused caller consumes nothing. `shm` uses
        it to demand proof that the receiver shares its shm directory.
        """
        return None

    @abc.abstractmethod
    async def prepare(self, grant: Grant) -> dict[str, str]:
        """Ready the transfer's bytes; return what the receiver needs to pull them."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Stop serving; in-flight streams have been aborted through the lease table."""


class DataPlaneClient(abc.ABC):
    """Receiver half: pulls one transfer's bytes into a destination tensor."""

    name: ClassVar[str]

    def __init__(self, config: DataPlaneConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor

    @abc.abstractmethod
    async def receive(
        self,
        handle: KVHandle,
        params: Mapping[str, str],
        out: torch.Tensor,
        deadline: Deadline,
    ) -> None:
        """Fill `out` (contiguous, of the handle's layout) with the payload.

        Raises a `KVTransferError` subclass; the header has been checked against `handle`, the
        checksum is checked by the caller.
        """

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release per-receiver resources."""


async def run_blocking(
    fn: Callable[[], T],
    *,
    abort: Callable[[], None],
    deadline: Deadline,
    grace_s: float,
    executor: Executor | None,
    what: str,
) -> T:
    """Run blocking I/O in a worker thread, bounded by `deadline`.

    On timeout or cancellation, `abort` makes the worker stop (e.g. closes its socket) and we
    wait up to `grace_s` for it, so the caller never reuses a buffer a worker still fills.
    """
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(executor, fn)
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout=deadline.remaining())
    except (TimeoutError, asyncio.CancelledError) as exc:
        abort()
        done, _ = await asyncio.wait({future}, timeout=grace_s)
        if not done:
            logger.error("%s: worker still running %.1fs after abort", what, grace_s)
        elif not future.cancelled():
            future.exception()  # consumed: the worker failed because we aborted it
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise KVTransferTimeout(f"{what}: deadline exceeded") from None


def format_host(host: str) -> str:
    """`host` as the host part of `host:port` (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
