"""Identity of "the same host" for shared memory.

Two processes can share a segment only if they see the same shm directory: same kernel
(boot id) and the same mounted filesystem (device and inode of the directory). Containers on
one host with private /dev/shm mounts therefore get different keys and fall back to tcp.
"""

from __future__ import annotations

import os
import socket
from functools import cache


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


@cache
def pid_namespace() -> str:
    """Distinguishes pids of different containers sharing one shm directory."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"
