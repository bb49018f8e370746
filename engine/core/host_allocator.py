"""Keep a CPU engine's large temporaries on the heap, where freed memory is reused.

Every step allocates tensors of megabytes and frees them again: the logits (16 rows of a 49k
vocabulary are 3 MiB), the sampler's probabilities and running sums, a prefill chunk's
activations. glibc serves allocations above its mmap threshold (128 KiB at start, raised
dynamically as large blocks are freed) with fresh mappings, and gives heap memory above its
trim threshold back to the system on free. Which of the two happens to a given tensor then
depends on the allocation history, and when it goes wrong every step touches its temporaries'
pages anew: 1,700-3,700 page faults per sampling call, measured on a 2-CPU VM, which made a
batch-16 top-p draw take 8.3 ms instead of 4.0 (bench/README.md, "The sampler's cost per
step").

So an engine on a CPU device fixes both thresholds (`mallopt`): blocks up to 32 MiB (glibc's
largest mmap threshold) come from the heap, and up to 256 MiB of free heap is kept for the
next step rather than returned. vLLM's CPU backend asks for tcmalloc through LD_PRELOAD for
the same reason; this needs nothing installed. The cost is resident memory: the heap keeps
its high-water mark (at most 256 MiB above what is in use), small beside a KV cache.

Left alone when the user chose: MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ or a
glibc.malloc tunable set, or PDMESH_HOST_ALLOCATOR=default. Where there is no glibc mallopt
(macOS) it does nothing; musl's accepts and ignores it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20



def wants_tuning(environ: Mapping[str, str]) -> bool:
    """Whether to set the thresholds: not when the user set glibc's own malloc knobs or
    opted out."""
    if environ.get("PDMESH_HOST_ALLOCATOR", "").lower() == "default":
        return False
    if environ.get("MALLOC_MMAP_THRESHOLD_") or environ.get("MALLOC_TRIM_THRESHOLD_"):
        return False
    return "glibc.malloc." not in environ.get("GLIBC_TUNABLES", "")


def keep_temporaries_on_heap(environ: Mapping[str, str] | None = None) -> bool:
    """Fix glibc's mmap and trim thresholds for this process; True when they were set."""
    if not wants_tuning(os.environ if environ is None else environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not ok:
        logger.debug("host allocator: mallopt refused the thresholds; left as they were")
    return ok
