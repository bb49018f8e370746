"""Files that dead processes left behind: found by the owner's pid in their name, removed.

A SIGKILLed process cannot remove what it created (its engine core's socket directory, its KV
shared-memory segments), so whoever comes next does: `pdmesh serve` after its child, every
service at start-up. Names carry the creator's pid namespace and pid (`<prefix><ns>-<pid>-…`)
because a /tmp or /dev/shm shared between containers holds pids of several namespaces, and a
pid is only meaningful in its own.

The names and their sweeps live here, not beside the code that makes them (the engine core
client, the shm data plane), because `pdmesh serve` sweeps after its children and must not
import torch to do it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Collection
from functools import cache

from pdmesh.kvstore.connector.config import DEFAULT_SHM_DIR

CORE_DIR_PREFIX = "pdmesh-core-"
CORE_DIR = re.compile(rf"{CORE_DIR_PREFIX}(\d+)-(\d+)-\w+")
"""An engine core's socket directory, named after the serving process that owns it: its pid
namespace and pid (a /tmp shared between containers holds pids of several namespaces)."""
KV_SEGMENT_PREFIX = "pdmesh-kv-"
KV_SEGMENT = re.compile(rf"{KV_SEGMENT_PREFIX}(\d+)-(\d+)-([0-9a-f]{{32}})")
"""A KV shm segment or shared cache file: creator's pid namespace, pid, a random id."""


@cache
def pid_namespace() -> str:
    """This process's pid namespace (an inode number; "0" where /proc does not tell)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep(directory: str, pattern: re.Pattern[str], remove: Callable[[str], None],
          pids: Collection[int] | None = None) -> int:
    """Remove (`remove(path)`) the entries of `directory` whose name matches `pattern` (groups:
    pid namespace, pid) and whose creator, in our pid namespace, is gone: any dead one, or
    only those of `pids`. Returns how many."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    removed, namespace = 0, pid_namespace()
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or match.group(1) != namespace:
            continue
        pid = int(match.group(2))
        if (pids is not None and pid not in pids) or alive(pid):
            continue
        remove(os.path.join(directory, name))
        removed += 1
    return removed


def sweep_core_dirs(pids: Collection[int] | None = None, root: str | None = None) -> int:
    """Remove the engine core socket directories of serving processes that are gone: those of
    `pids`, or of every dead pid (of our pid namespace). Returns how many."""
    return sweep(root or tempfile.gettempdir(), CORE_DIR,
                 lambda path: shutil.rmtree(path, ignore_errors=True), pids)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def sweep_kv_segments(directory: str = DEFAULT_SHM_DIR,
                      pids: Collection[int] | None = None) -> int:
    """Remove the KV segments and shared cache files whose creating process (in our pid
    namespace) is gone; `pids` restricts it to those processes (a supervisor such as `pdmesh
    serve` cleans up after its own children, even SIGKILLed ones). Returns how many."""
    return sweep(directory, KV_SEGMENT, _unlink, pids)
