"""Prebuilt native CPU kernels (kernels/cpu_native.py) for machines without a compiler: the
level picked from the CPU's flags, a library of other sources never loaded, and a prebuilt
library that really computes what the reference does."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch

from pdmesh.kernels import cpu_native
from pdmesh.kernels.layer_ops import TorchLayerOps

V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
V3 = V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.fast
def test_levels_follow_the_cpu_flags() -> None:
    assert cpu_native.fitting_levels(frozenset(V4)) == ["x86-64-v4", "x86-64-v3", "x86-64-v2"]
    assert cpu_native.fitting_levels(frozenset(V3)) == ["x86-64-v3", "x86-64-v2"]
    # AVX-512 without the v3 base (no such CPU, but no level may skip its prerequisites)
    assert cpu_native.fitting_levels(frozenset(V4 - {"fma"})) == ["x86-64-v2"]
    assert cpu_native.fitting_levels(frozenset()) == []


@pytest.mark.fast
def test_prebuild_refuses_an_unknown_level(tmp_path: Path) -> None:
    if cpu_native._compiler() is None:
        pytest.skip("no C compiler")
    with pytest.raises(ValueError, match="unknown level"):
        cpu_native.prebuild(tmp_path, ("x86-64-v9",))


@pytest.mark.processes
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 ISA levels")
def test_without_a_compiler_the_prebuilt_library_for_this_cpu_is_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu_native._compiler() is None:
        pytest.skip("no C compiler to prebuild with")
    levels = cpu_native.fitting_levels(cpu_native._cpu_flags())
    if "x86-64-v3" not in levels:
        pytest.skip("this CPU lacks x86-64-v3")
    (built,) = cpu_native.prebuild(tmp_path, ("x86-64-v3",))
    assert built.name == cpu_native.prebuilt_name("x86-64-v3")
    # A library of other sources (a stale image layer) sits beside it and must be ignored.
    shutil.copy(built, tmp_path / "pdmesh_cpu_kernels-x86-64-v4-0000000000000000.so")
    monkeypatch.setattr(cpu_native, "PREBUILT_DIR", tmp_path)
    monkeypatch.setenv(cpu_native.DISABLE_ENV, "prebuilt")  # as if there were no compiler
    cpu_native.library.cache_clear()
    try:
        lib = cpu_native.library()
        assert lib is not None and lib._name == str(built)
        x = torch.randn(5, 96)
        weight = torch.randn(96)
        torch.testing.assert_close(cpu_native.rms_norm(x, weight, 1e-6),
                                   TorchLayerOps().rms_norm(x, weight, 1e-6))
        monkeypatch.setattr(cpu_native, "PREBUILT_DIR", tmp_path / "empty")
        cpu_native.library.cache_clear()
        assert cpu_native.library() is None  # no fitting library: the torch path
    finally:
        monkeypatch.undo()
        cpu_native.library.cache_clear()


@pytest.mark.fast
def test_the_sources_build_where_there_is_a_compiler() -> None:
    """The kernel tests skip where `library()` is None (no compiler, no prebuilt library), so a
    source that stopped compiling would only skip them; where a compiler exists, it must build
    (the compiler's error is the failure)."""
    compiler = cpu_native._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    assert cpu_native._build(compiler).is_file()
