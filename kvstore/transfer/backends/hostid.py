"""Identity of "the same host" for shared memory, and the proof a receiver gives of it.

Two processes can share a segment only if they see the same shm directory: same kernel
(boot id) and the same mounted filesystem (device and inode of the directory). Containers on
one host with private /dev/shm mounts therefore get different keys and fall back to tcp.

The key alone is only a claim: anybody can copy it. So a sender that serves shm also keeps a
*nonce file* (random bytes, mode 0600) in its shm directory and names it in the handle's host
key; a receiver proves that it reads the same directory by sending HMAC(nonce, transfer id),
which only a process that can open that file can compute (`HostChallenge.verify`,
`host_proof`). The file follows the shm segment naming, so the sweeps that remove segments of
dead processes remove it too.

A GPU engine's `shm` plane is a CUDA IPC handle, not a file, and CUDA opens such a handle only
in the PID namespace that made it: two containers started with the host's IPC namespace
(`docker run --ipc=host`, as vLLM's images are run) share /dev/shm but not their PIDs, and
every pull between them would fail and recompute. So such a sender's key also names its PID
namespace, and a receiver in another one does not claim the same host (it picks tcp).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import socket
import uuid
from functools import cache

from pdmesh.leftovers import pid_namespace

NONCE_BYTES = 32
_NONCE_NAME = re.compile(r"pdmesh-kv-\d+-\d+-[0-9a-f]{32}")


@cache
def host_key(shm_dir: str) -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        st = os.stat(shm_dir)
    except OSError:
        return f"{boot}/no-shm"
    return f"{boot}/{st.st_dev}:{st.st_ino}"




def _proof(nonce: bytes, transfer_id: str) -> str:
    return hmac.new(nonce, transfer_id.encode(), hashlib.sha256).hexdigest()


_PID_NS = "+pidns:"


class HostChallenge:
    """The sender's nonce file; `key` goes into every handle it publishes (with this
    process's PID namespace where `same_pid_namespace`: a CUDA IPC plane)."""

    def __init__(self, shm_dir: str, same_pid_namespace: bool = False) -> None:
        self._dir = os.path.realpath(shm_dir)
        name = f"pdmesh-kv-{pid_namespace()}-{os.getpid()}-{uuid.uuid4().hex}"
        self._path = os.path.join(self._dir, name)
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, self._nonce)
        finally:
            os.close(fd)
        base = host_key(self._dir)
        if same_pid_namespace:
            base += f"{_PID_NS}{pid_namespace()}"
        self.key = f"{base}/{name}"

    def verify(self, transfer_id: str, proof: str) -> bool:
        """Constant-time check of a receiver's `host_proof` for `transfer_id`."""
        expected = _proof(self._nonce, transfer_id).encode()
        return hmac.compare_digest(expected, proof.encode("ascii", "replace"))

    def refusal(self, transfer_id: str, proof: str) -> str | None:
        """Why a StartTransfer caller may not have a same-host data plane, or None."""
        if self.verify(transfer_id, proof):
            return None
        return ("shm is served only to receivers that prove they share this host's shm "
                "directory")

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)


def host_proof(shm_dir: str, sender_key: str, transfer_id: str) -> str | None:
    """The proof that we read the sender's shm directory, or None if we cannot."""
    base, _, name = sender_key.rpartition("/")
    base, has_pid_ns, pid_ns = base.partition(_PID_NS)
    directory = os.path.realpath(shm_dir)
    if base != host_key(directory) or not _NONCE_NAME.fullmatch(name):
        return None  # another host or another shm mount: do not even look
    if has_pid_ns and pid_ns != pid_namespace():
        return None  # a CUDA IPC handle from another PID namespace cannot be opened here
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        nonce = os.read(fd, NONCE_BYTES + 1)
    finally:
        os.close(fd)
    if len(nonce) != NONCE_BYTES:
        return None
    return _proof(nonce, transfer_id)
