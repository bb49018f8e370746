"""The Triton layer ops address rows in int64 (kernels/triton_layer_ops.py, `_row_offset`).

A program id is int32, and a row index times a row stride passes 2^31 within one step (75k
tokens of 28,672-wide gate/up rows); int32 arithmetic would wrap to a negative address. No CPU
holds tensors that large, so a probe kernel stores what the helper computes, in Triton's
interpreter (whose int32 arithmetic wraps as a GPU's does), and compiled on a CUDA device where
there is one.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

from tests.triton_interpreter import outcomes_of, run_cases

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
triton_layer_ops = pytest.importorskip("pdmesh.kernels.triton_layer_ops")

STRIDE = 2**30 + 7  # an int32 itself, as a row stride is; rows 2 and 3 pass 2^31 with it
ROWS = 4


@triton.jit
def _row_offsets_kernel(out_ptr, stride):
    row = tl.program_id(0)
    tl.store(out_ptr + row, triton_layer_ops._row_offset(row, stride))


def _row_offsets_past_int32(device: str) -> None:
    out = torch.zeros(ROWS, dtype=torch.int64, device=device)
    _row_offsets_kernel[(ROWS,)](out, STRIDE)
    assert out.tolist() == [row * STRIDE for row in range(ROWS)]


CASES: dict[str, Callable[[str], None]] = {"row-offsets-past-int32": _row_offsets_past_int32}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str | None]:
    return outcomes_of(__file__)


@pytest.mark.processes
@pytest.mark.parametrize("name", list(CASES))
def test_row_offsets_interpreted(interpreted: dict[str, str | None], name: str) -> None:
    assert name in interpreted
    assert interpreted[name] is None, interpreted[name]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_row_offsets_compiled_on_cuda() -> None:
    _row_offsets_past_int32("cuda")


if __name__ == "__main__":
    print(json.dumps(run_cases(CASES, "cpu")))
