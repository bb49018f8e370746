"""Files that dead processes left behind: found by the owner's pid in their name, removed.

A SIGKILLed process cannot remove what it created (its engine core's socket directory, its KV
shared-memory segments), so whoever comes next does: `pdmesh serve` after its child, every
service at start-up. Names carry the creator's pid namespace and pid (`<prefix><ns>-<pid>-…`)
because a /tmp or /dev/shm shared between containers holds pids of several namespaces, and a
pid is only meaningful in its own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection
from functools import cache


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
