"""`pytest -p tests.cuda_selection`: run only the tests that need CUDA (bench/gpu_check.sh).

A CUDA test is one that is skipped where no CUDA device is: it carries a `skipif` whose reason
names CUDA (the modules' `needs_cuda` mark, `reason="needs a CUDA device"`). Every other test
is deselected, so a lent GPU machine spends its minutes on the CUDA set alone, whatever the
modules' tier markers say (their CPU tests may need SmolLM2's weights, which do not travel).
"""

from __future__ import annotations

import pytest


def is_cuda_test(item: pytest.Item) -> bool:
    return any("cuda" in str(mark.kwargs.get("reason", "")).lower()
               for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep = [item for item in items if is_cuda_test(item)]
    dropped = [item for item in items if not is_cuda_test(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
