"""The engine core's torch threads: every CPU on CPU (with a short spin), one on CUDA, the
user's word first; a local mesh shares the CPUs among its engines."""

from __future__ import annotations

import pytest

from pdmesh.config import parse_config
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.worker.cpu_threads import (
    NCCL_ABORT_ONLY,
    SHORT_SPIN,
    core_environment,
    core_threads,
    usable_cpus,
)
from pdmesh.serve import LocalMesh, MeshConfig

pytestmark = pytest.mark.fast


def test_cpu_takes_every_usable_cpu() -> None:
    assert core_threads(None, "cpu", 16, environ={}) == 16
    assert core_threads(None, "cpu", 1, environ={}) == 1


def test_cuda_takes_one() -> None:
    assert core_threads(None, "cuda", 16, environ={}) == 1


def test_the_flag_then_omp_num_threads_win() -> None:
    assert core_threads(6, "cpu", 2, environ={"OMP_NUM_THREADS": "3"}) == 6
    assert core_threads(None, "cpu", 16, environ={"OMP_NUM_THREADS": "3"}) is None
    assert core_threads(None, "cpu", 16, environ={"OMP_NUM_THREADS": ""}) == 16


def test_the_core_spins_briefly_unless_the_user_chose() -> None:
    assert core_environment({"A": "1"}) == {"A": "1", "GOMP_SPINCOUNT": SHORT_SPIN,
                                            "TORCH_NCCL_ASYNC_ERROR_HANDLING": NCCL_ABORT_ONLY}
    assert core_environment({"GOMP_SPINCOUNT": "5"})["GOMP_SPINCOUNT"] == "5"
    assert "GOMP_SPINCOUNT" not in core_environment({"OMP_WAIT_POLICY": "active"})


def test_a_failed_nccl_group_keeps_the_core_unless_the_user_chose() -> None:
    """torch's default tears the process down on a failed NCCL group: a KV pull's sender
    dying would take the pulling core with it."""
    assert core_environment({})["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == NCCL_ABORT_ONLY == "2"
    chosen = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert core_environment(chosen)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_usable_cpus_is_the_affinity_mask() -> None:
    assert usable_cpus() >= 1


def test_engine_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(cpu_threads=0)
    with pytest.raises(SystemExit):
        parse_config(MeshConfig, ["--cpu-threads", "0"], prog="serve", env={})


def _threads_flag(mesh: LocalMesh) -> str | None:
    argv = mesh.engine_args("decode")
    return argv[argv.index("--cpu-threads") + 1] if "--cpu-threads" in argv else None


def test_local_mesh_shares_the_cpus_among_its_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pdmesh.serve.mesh.usable_cpus", lambda: 16)
    monkeypatch.setattr("pdmesh.devices.cuda_available", lambda: False)
    env: dict[str, str] = {}
    assert _threads_flag(LocalMesh(MeshConfig(num_prefill=1, num_decode=2), env=env)) == "5"
    assert _threads_flag(LocalMesh(MeshConfig(colocated=True, num_decode=1), env=env)) is None
    four = MeshConfig(num_prefill=1, num_decode=1, engine=EngineConfig(cpu_threads=4))
    assert _threads_flag(LocalMesh(four, env=env)) == "4"
    omp = {"OMP_NUM_THREADS": "2"}
    assert _threads_flag(LocalMesh(MeshConfig(num_prefill=1, num_decode=2), env=omp)) is None
    monkeypatch.setattr("pdmesh.devices.cuda_available", lambda: True)
    assert _threads_flag(LocalMesh(MeshConfig(num_prefill=1, num_decode=2), env=env)) is None
    cpu = MeshConfig(num_prefill=1, num_decode=2, engine=EngineConfig(device="cpu"))
    assert _threads_flag(LocalMesh(cpu, env=env)) == "5"  # engines told to stay on the CPU
