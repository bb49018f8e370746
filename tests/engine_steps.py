"""Driving an `LLMEngine` by hand in engine-level tests."""

from __future__ import annotations

from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import RequestOutput


def run_to_finish(engine: LLMEngine, max_steps: int = 400) -> RequestOutput:
    """Step until the last request finishes; its final output. The engine must then hold no
    blocks (every test that drives it checks nothing leaks)."""
    final: RequestOutput | None = None
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                final = out
        if final is not None and not engine.has_unfinished_requests():
            assert engine.num_free_blocks == engine.num_total_blocks
            return final
    raise AssertionError(f"engine still busy after {max_steps} steps")
