"""Keeping the garbage collector off the objects a process holds for good.

A serving process starts by creating most of the objects it will ever hold: torch and
transformers modules, the model, the tokenizer, the gRPC server. CPython's oldest-generation
collection scans every tracked object, so each one, triggered by the garbage that steps and
requests leave behind, paused the step loop for ~0.2 s on a 2-CPU machine (bench/README.md,
"Garbage-collector pauses"). `gc.freeze()` moves everything alive into a permanent generation
that collections skip; what is created later is collected as before. vLLM freezes its engine
core's and API server's start-up heaps the same way.

Two uses:

- `freeze_startup_heap`: a process we own (an engine core, an engine service, the router, the
  gateway), once start-up is done. What it froze is never collected, which is right for
  objects the process keeps until it exits.
- `frozen_heap`: the offline `LLM.generate`, which runs in the user's process: the heap is
  frozen only while it generates and unfrozen after, so an engine the user drops later (it
  holds reference cycles) is still collected.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze the rest for good; returns how many
    objects are frozen now."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("froze the start-up heap objects=%d", frozen)
    return frozen


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze what is alive now for the duration of the block, then unfreeze it. Where the
    heap is frozen already (a service's start-up, or the user's own `gc.freeze()`), it is
    left as it is: unfreezing would undo that too."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
