"""The garbage collector kept off long-lived objects (pdmesh/gc_heap.py), without leaks."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from pdmesh.gc_heap import freeze_startup_heap, frozen_heap


class Node:
    """Tracked by the collector; `ring` makes a reference cycle only it can free."""

    def __init__(self) -> None:
        self.ring: list[object] = [self]


def tracked(obj: object) -> bool:
    """Whether a collection would scan `obj` (frozen objects are not in any generation)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """A heap with nothing frozen, as in a fresh process; restored after."""
    was = gc.get_freeze_count()
    gc.unfreeze()
    yield
    gc.unfreeze()
    if was:
        gc.freeze()


@pytest.mark.fast
def test_frozen_heap_freezes_what_exists_only_while_it_runs(unfrozen: None) -> None:
    before = Node()
    with frozen_heap():
        during = Node()
        assert not tracked(before) and tracked(during)
    assert gc.get_freeze_count() == 0 and tracked(before)
    ref = weakref.ref(before)
    del before
    gc.collect()
    assert ref() is None  # a cycle from before the block is still collected after it


@pytest.mark.fast
def test_frozen_heap_leaves_a_frozen_heap_frozen(unfrozen: None) -> None:
    kept = Node()
    freeze_startup_heap()
    with frozen_heap():
        pass
    assert gc.get_freeze_count() > 0 and not tracked(kept)


@pytest.mark.weights
def test_generate_leaves_nothing_frozen_and_a_dropped_engine_collectable(unfrozen: None) -> None:
    from pdmesh import LLM, SamplingParams

    llm = LLM("smollm2", kv_cache_memory="16MiB", max_model_len=256)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    assert gc.get_freeze_count() == 0
    ref = weakref.ref(llm.engine.core)
    del llm, out
    gc.collect()
    assert ref() is None  # the engine holds cycles: frozen for good, it would leak
