"""This node's KV transports checked end to end: the KV rows of `pdmesh selftest`.

The transfer code for GPUs (CUDA IPC, NCCL, UCX device buffers, the sending and receiving
streams, checksums on the device) can only be read where no GPU is lent, so an operator's
first run on a node moves real blocks through every transport the engines would use, as they
use them:

* here, a sender core's connector over a small random cache on the node's device (a shared
  file on CPU, CUDA IPC on a GPU), with its block server and ucxx listener, and its serving
  process's `KVSender` publishing each export (StartTransfer, one-time grants, the planes);
* in another process (`python -m pdmesh.kvstore.connector.selfcheck`), a receiving core: its
  serving process's `KVReceiver` begins each transfer, its connector pulls the blocks into
  its own cache on a connector thread (a device cache: on its receiving stream) and checks
  them against the export's checksums, as a decode core does. Where two GPUs are visible it
  runs on the second, so IPC and NCCL move bytes between devices.

The receiver then hashes every landed block with SHA-256 (independent of the transports' own
checksums, which are under test too) and checks that no other block of its cache was written.
Parent and child talk JSON over the child's stdin and stdout: nothing is pickled.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdmesh.engine.worker.cpu_threads import core_environment
from pdmesh.engine.worker.selfcheck_result import CheckResult
from pdmesh.kvstore.connector import cuda_driver
from pdmesh.kvstore.connector.cache_file import SharedCache, shared_zeros
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.connector import KVConnector
from pdmesh.kvstore.connector.cuda_ipc import mappable
from pdmesh.kvstore.connector.grant_mac import new_key
from pdmesh.kvstore.connector.source import WORKER_BACKENDS, KVSource
from pdmesh.kvstore.transfer.core_pull import CorePulls
from pdmesh.kvstore.transfer.deadline import Deadline
from pdmesh.kvstore.transfer.handle import KVHandle
from pdmesh.kvstore.transfer.layout import KVLayout
from pdmesh.kvstore.transfer.receiver import KVReceiver, KVReceiverConfig
from pdmesh.kvstore.transfer.sender import KVSender, KVSenderConfig
from pdmesh.kvstore.transfer.worker_planes import CoreCache

LAYERS, BLOCK, HEADS, HEAD_DIM, CACHE_BLOCKS = 4, 16, 2, 32, 32
EXPORTED = (3, 4, 5, 9, 17, 30)  # a run of three and singles: runs and scattered pieces
LANDED = (0, 1, 2, 20, 7, 31)    # where the receiver puts them (other runs than the sender's)
DEADLINE_S = 15.0  # one pull (a few hundred KiB); the receiving process gets CHILD_TIMEOUT_S
CHILD_TIMEOUT_S = 60.0  # starting, importing torch, a CUDA context, every transport


def kv_shape() -> tuple[int, ...]:
    return (LAYERS, 2, CACHE_BLOCKS, BLOCK, HEADS, HEAD_DIM)


def new_cache(device: torch.device, shm_dir: str) -> tuple[torch.Tensor, SharedCache | None]:
    """A zero KV cache as a core allocates it for peers: a shared file on the host, else a
    device tensor (shared over CUDA IPC by its connector)."""
    if device.type == "cpu":
        shared = shared_zeros(kv_shape(), torch.float32, shm_dir)
        return shared.tensor, shared
    return torch.zeros(kv_shape(), device=device), None


def block_digests(cache: torch.Tensor, block_ids: Sequence[int]) -> list[str]:
    """SHA-256 of each block's bytes, its (layer, K/V) pieces in order, read on the host."""
    out = []
    for b in block_ids:
        data = cache[:, :, b].contiguous().cpu().view(torch.uint8).numpy().tobytes()
        out.append(hashlib.sha256(data).hexdigest())
    return out


def receiver_device(device: torch.device) -> torch.device:
    """The receiving core's device: another GPU where there is one (IPC and NCCL then cross
    devices), else the sender's."""
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.device("cuda", (index + 1) % torch.cuda.device_count())
    return device


def not_checked(backend: str, offered: Sequence[str],
                device: torch.device, to: torch.device) -> str:
    """Why a transport is not checked on this node ("" when it is)."""
    if backend not in offered:
        if backend == "shm" and device.type == "cuda":
            return "the KV cache cannot be shared over CUDA IPC here (MIG, a driver " \
                   "without IPC, or expandable segments): peers use tcp"
        if backend == "ucxx":
            from pdmesh.kvstore.connector import ucx_blocks

            return ucx_blocks.unavailable_reason() or "no ucxx listener started"
        return "torch.distributed is not available" if backend == "torch_dist" else "off"
    return ""


def check_transports(device: torch.device, workdir: Path,
                     backends: Sequence[str] = WORKER_BACKENDS) -> list[CheckResult]:
    """One row per transport: its blocks pulled by a receiving core in another process."""
    return asyncio.run(_check(device, workdir, tuple(backends)))


async def _check(device: torch.device, workdir: Path,
                 backends: tuple[str, ...]) -> list[CheckResult]:
    async with SendingCore.started(device, workdir, backends) as core:
        transfers = [core.publish(b) for b in core.checked]
        replies = await receive(transfers, core.receiver, core.shm_dir) if transfers else {}
        return core.rows(replies)


@dataclass
class SendingCore:
    """The sender's side: its core's connector over a random cache and its serving
    process's KVSender, publishing one export per transport checked."""

    device: torch.device
    shm_dir: str
    backends: tuple[str, ...]
    connector: KVConnector
    sender: KVSender
    skipped: dict[str, str]

    @classmethod
    @contextlib.asynccontextmanager
    async def started(cls, device: torch.device, workdir: Path,
                      backends: tuple[str, ...]) -> AsyncIterator[SendingCore]:
        shm_dir = str(workdir)
        cache, cache_file = new_cache(device, shm_dir)
        cache.copy_(torch.randn(kv_shape(), generator=torch.Generator().manual_seed(0)))
        key = new_key()
        connector = KVConnector(KVConnectorConfig(shm_dir=shm_dir, tcp=True, grant_secret=key,
                                                  ucx="ucxx" in backends), cache, cache_file)
        try:
            connector.start()
            info = CoreCache(connector.cache_file_name, CACHE_BLOCKS,
                             connector.block_server_address, key,
                             cache_ipc=connector.cache_ipc, ucx_server=connector.ucx_address)
            to = receiver_device(device)
            skipped = {b: not_checked(b, info.backends(), device, to) for b in backends}
            offered = tuple(b for b in backends if not skipped[b]) or ("tcp",)
            sender = KVSender(KVSenderConfig(backends=offered, shm_dir=shm_dir),
                              lambda rid, why: connector.release(rid), core=info)
            await sender.start()
            try:
                yield cls(device, shm_dir, backends, connector, sender, skipped)
            finally:
                await sender.stop()
        finally:
            connector.close()  # stops the servers, unlinks the cache file

    @property
    def checked(self) -> list[str]:
        return [b for b in self.backends if not self.skipped[b]]

    @property
    def receiver(self) -> torch.device:
        return receiver_device(self.device)

    def publish(self, backend: str) -> dict[str, Any]:
        """Export `EXPORTED` for one pull over `backend`: what the receiver is told."""
        rid = f"selfcheck-{backend}"
        tokens = len(EXPORTED) * BLOCK
        info = self.connector.export(rid, list(EXPORTED), tokens)
        layout = KVLayout(LAYERS, len(EXPORTED), BLOCK, HEADS, HEAD_DIM, "float32", tokens)
        handle = self.sender.publish_export(rid, layout, list(EXPORTED), info.block_checksums,
                                            self.connector.algo)
        return {"backend": backend, "handle": handle.to_dict()}

    def rows(self, replies: dict[str, dict[str, Any]]) -> list[CheckResult]:
        want = block_digests(self.connector.cache, EXPORTED)
        peers = peer_access(self.device, self.receiver)
        return [judge(b, self.skipped[b], replies.get(b), want, self.device, self.receiver,
                      peers) for b in self.backends]


def peer_access(device: torch.device, to: torch.device) -> bool:
    """Whether the receiving GPU reaches the sender's memory directly (NVLink, PCIe P2P)."""
    if device.type != "cuda" or to.type != "cuda":
        return False
    src, dst = (d.index if d.index is not None else torch.cuda.current_device()
                for d in (device, to))
    return src != dst and bool(torch.cuda.can_device_access_peer(dst, src))


async def receive(transfers: list[dict[str, Any]], device: torch.device,
                   shm_dir: str) -> dict[str, dict[str, Any]]:
    """Run the receiving core and return its reply per transport (a missing reply: it died)."""
    request = json.dumps({"device": str(device), "shm_dir": shm_dir, "transfers": transfers})
    safe_path = ("-P",) if sys.flags.safe_path else ()  # as this process was started
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *safe_path, "-m", "pdmesh.kvstore.connector.selfcheck",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=core_environment(os.environ))
    try:
        out, err = await asyncio.wait_for(proc.communicate(request.encode()), CHILD_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return {t["backend"]: {"error": f"the receiving process did not finish in "
                                        f"{CHILD_TIMEOUT_S:.0f} s"} for t in transfers}
    try:
        replies = json.loads(out.decode() or "{}").get("results", [])
        return {r["backend"]: r for r in replies}
    except (ValueError, AttributeError, KeyError, TypeError):
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {t["backend"]: {"error": f"the receiving process failed (exit "
                                        f"{proc.returncode}): {tail[0]}"} for t in transfers}


def judge(backend: str, skipped: str, reply: dict[str, Any] | None, want: list[str],
          device: torch.device, to: torch.device, peers: bool = False) -> CheckResult:
    """A transport's row. A same-host pull across GPUs that reach each other must map the
    sender's cache into the receiver's own context: a context of its own on the sender's GPU
    would take memory that engine budgeted (`cuda_ipc.py`)."""
    name = f"kv transfer {backend}"
    where = str(device) if to == device else f"{device} -> {to}"
    if skipped:
        return CheckResult(name, where, "skip", skipped)
    if reply is None:
        return CheckResult(name, where, "fail", "the receiving process gave no answer")
    seconds = float(reply.get("seconds", 0.0))
    if reply.get("error"):
        return CheckResult(name, where, "fail", str(reply["error"]), seconds)
    if reply.get("digests") != want:
        return CheckResult(name, where, "fail", "landed blocks differ from the exported ones",
                           seconds)
    if reply.get("others_written"):
        return CheckResult(name, where, "fail", "blocks outside the pull were written",
                           seconds)
    detail = f"{len(want)} blocks, {reply.get('bytes', 0)} bytes"
    created = ", ".join(f"cuda:{i}" for i in reply.get("new_contexts") or ())  # shm only
    if created and peers and reply.get("mappable"):
        return CheckResult(name, where, "fail", f"the pull created a CUDA context on {created} "
                           "in the receiving process instead of mapping the sender's cache "
                           "into its own", seconds)
    if created:
        why = ("torch's opener (a handle the driver cannot map here, e.g. an expandable "
               "segment's)" if peers else "no peer access between the GPUs")
        detail += f"; {why}: a CUDA context on {created}"
    return CheckResult(name, where, "pass", detail, seconds)


# -- the receiving core (its own process) -----------------------------------------------------
async def receive_all(request: dict[str, Any]) -> list[dict[str, Any]]:
    from pdmesh.engine.core.startup import make_device_current

    device = torch.device(request["device"])
    make_device_current(device)  # as an engine core's start-up does
    shm_dir = str(request["shm_dir"])
    cache, cache_file = new_cache(device, shm_dir)
    connector = KVConnector(KVConnectorConfig(shm_dir=shm_dir, tcp=False), cache, cache_file)
    results = []
    try:
        async with KVReceiver(KVReceiverConfig(shm_dir=shm_dir)) as rx:
            pulls = CorePulls(rx)
            for transfer in request["transfers"]:
                cache.zero_()
                results.append(await _pull_one(pulls, connector, transfer))
    finally:
        connector.close()
    return results


async def _pull_one(pulls: CorePulls, connector: KVConnector,
                    transfer: dict[str, Any]) -> dict[str, Any]:
    backend = str(transfer["backend"])
    handle = KVHandle.from_dict(transfer["handle"])
    contexts = devices_with_context() if backend == "shm" else []  # what CUDA IPC may add
    started = time.perf_counter()
    try:
        deadline = Deadline.after(DEADLINE_S)
        pull = await pulls.begin(handle, deadline, backend=backend)
    except Exception as exc:
        return {"backend": backend, "error": f"StartTransfer: {type(exc).__name__}: {exc}"}
    try:
        source = KVSource(backend, pull.params, list(handle.block_checksums),
                          str(handle.checksum_algo), handle.layout.num_tokens,
                          (LAYERS, BLOCK, HEADS, HEAD_DIM), "float32",
                          deadline_s=deadline.remaining())
        connector.check_source(source)
        load = connector.start_load(source, 0, list(LANDED))
        nbytes = await asyncio.wrap_future(load)
    except Exception as exc:
        await pulls.finish(pull, error=f"{type(exc).__name__}: {exc}")
        return {"backend": backend, "error": f"{type(exc).__name__}: {exc}",
                "seconds": time.perf_counter() - started}
    seconds = time.perf_counter() - started
    await pulls.finish(pull, nbytes=nbytes)
    cache = connector.cache
    others = [b for b in range(CACHE_BLOCKS) if b not in LANDED]
    return {"backend": backend, "seconds": seconds, "bytes": nbytes,
            "digests": block_digests(cache, LANDED),
            "others_written": bool(cache[:, :, others].count_nonzero().item()),
            **({"new_contexts": sorted(set(devices_with_context()) - set(contexts)),
                "mappable": mappable(pull.params.get("cuda_ipc", ""))}
               if backend == "shm" else {})}


def devices_with_context() -> list[int]:
    """The GPUs this process holds a CUDA context on ([] on a CPU host)."""
    driver = cuda_driver.driver() if torch.cuda.is_available() else None
    if driver is None:
        return []
    return [i for i in range(torch.cuda.device_count()) if driver.has_context(i)]


def main() -> int:
    """The receiving core: a JSON request on stdin, a JSON reply on stdout. Anything else
    written to stdout meanwhile (UCX's or NCCL's own messages, from C) goes to stderr."""
    request = json.loads(sys.stdin.read())
    sys.stdout.flush()
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    results = asyncio.run(receive_all(request))
    reply.write(json.dumps({"results": results}))
    reply.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
