"""The self-check's results and how they are judged: a check's outcome (pass, fail, skip), the
report of all of them, and the comparison every check uses (engine/worker/selfcheck.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdmesh.engine.core_types import SELFCHECK_FEATURES

TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
"""Largest allowed |got - ref|, relative to the reference's largest magnitude (at least 1):
float32 kernels differ from the reference by summation order only; half-precision ones also
by rounding each output to 8 (bf16) or 11 (fp16) bits."""


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome: "pass", "fail" or "skip" (not applicable here, or no memory)."""

    name: str
    device: str
    outcome: str
    detail: str = ""
    seconds: float = 0.0
    fallbacks: tuple[str, ...] = ()
    """The features its failure turns off (`SELFCHECK_FEATURES`)."""

    @property
    def failed(self) -> bool:
        return self.outcome == "fail"


@dataclass(frozen=True)
class SelfCheckReport:
    results: tuple[CheckResult, ...] = ()
    not_run: str = ""
    """Why no check ran (e.g. a CPU device), empty when they did."""

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if r.failed)

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """What the failures turn off, in `SELFCHECK_FEATURES` order."""
        off = {f for r in self.failures for f in r.fallbacks}
        return tuple(f for f in SELFCHECK_FEATURES if f in off)

    def summary(self) -> str:
        """One line for the log, `CoreInfo.selfcheck` and GetInfo."""
        if self.not_run:
            return f"not run: {self.not_run}"
        seconds = sum(r.seconds for r in self.results)
        passed = sum(r.outcome == "pass" for r in self.results)
        skipped = sum(r.outcome == "skip" for r in self.results)
        counts = f"{passed} passed, {len(self.failures)} failed, {skipped} skipped"
        if not self.failures:
            return f"ok: {counts} in {seconds:.1f} s"
        failed = "; ".join(f"{r.name}: {r.detail}" for r in self.failures)
        return (f"FAILED: {counts} in {seconds:.1f} s; {failed}; "
                f"fell back: {', '.join(self.fallbacks) or 'nothing'}")


class Skip(Exception):
    """A check's way of saying "not applicable here"."""


def run_check(name: str, device: torch.device, fallbacks: tuple[str, ...],
              body: Callable[[], str | None]) -> CheckResult:
    """Time `body`, which returns what is wrong or None. An exception is a failure (a kernel
    that raises is as broken as one that is wrong), except running out of memory: that says
    nothing about the kernels, so the check is skipped and nothing falls back."""
    started = time.perf_counter()
    outcome, detail = "pass", ""
    try:
        problem = body()
        if problem is not None:
            outcome, detail = "fail", problem
    except Skip as why:
        outcome, detail = "skip", str(why)
    except torch.cuda.OutOfMemoryError as exc:
        outcome, detail = "skip", f"out of memory: {str(exc).splitlines()[0]}"
    except Exception as exc:
        outcome, detail = "fail", f"raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
    return CheckResult(name, str(device), outcome, detail, time.perf_counter() - started,
                       fallbacks)


def mismatch(what: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> str | None:
    """What is wrong with `got` against `ref`, or None: shape, NaN/Inf, or an error above
    the dtype's tolerance."""
    if got.shape != ref.shape:
        return f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    g, r = got.detach().float(), ref.detach().float()
    if not bool(torch.isfinite(g).all()):
        return f"{what}: NaN or Inf"
    if g.numel() == 0:
        return None
    err = float((g - r).abs().max())
    tol = TOLERANCE.get(dtype, 5e-2) * max(1.0, float(r.abs().max()))
    return f"{what}: max error {err:.3g} > {tol:.3g}" if err > tol else None


def first_problem(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)


def randn(*shape: int, device: torch.device, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic on every device: drawn on the host, then moved."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
