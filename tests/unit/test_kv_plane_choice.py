"""Which KV planes an engine service offers under `--kv-backend auto`: ucxx only where UCX has
more than TCP to use (CUDA buffers, or transports the operator chose with UCX_TLS). On a
CPU-only host UCX would run over TCP, slower than the core's own tcp plane, while its
listener's progress thread wakes ~900 times a second and takes CPUs from the engine core
(bench/README.md, "An idle UCX listener")."""

from __future__ import annotations

import pytest

import pdmesh.engine_svc.process as process
from pdmesh.config import parse_config
from pdmesh.decode_svc.config import DecodeConfig
from pdmesh.kvstore.transfer.backends.availability import ucx_tcp_only
from pdmesh.prefill_svc.config import PrefillConfig

pytestmark = pytest.mark.fast


@pytest.fixture(autouse=True)
def every_plane_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice, not this machine's installs: every plane importable, no UCX_TLS."""
    monkeypatch.setattr(process, "unavailable_reason", lambda name: None)
    monkeypatch.delenv("UCX_TLS", raising=False)


def _backends(args: list[str], role: str = "decode") -> tuple[str, ...]:
    config_type = PrefillConfig if role == "prefill" else DecodeConfig
    config = parse_config(config_type, ["--model", "smollm2", *args], prog="pdmesh")
    return process._kv_backends(config, role)  # type: ignore[arg-type]


def test_cpu_host_auto_leaves_ucx_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "engines_use_cuda", lambda device: False)
    assert _backends([]) == ("shm", "tcp", "torch_dist")
    assert process.connector_config(
        parse_config(DecodeConfig, ["--model", "smollm2"], prog="pdmesh"),
        _backends([])).ucx is False  # so the core starts no ucxx listener


def test_cuda_engine_or_chosen_transports_keep_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "engines_use_cuda", lambda device: device != "cpu")
    assert _backends([]) == ("shm", "ucxx", "tcp", "torch_dist")
    assert "ucxx" not in _backends(["--device", "cpu"])
    monkeypatch.setenv("UCX_TLS", "rc,sm,self")
    assert _backends(["--device", "cpu"]) == ("shm", "ucxx", "tcp", "torch_dist")


def test_asked_for_by_name_it_is_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "engines_use_cuda", lambda device: False)
    assert _backends(["--kv-backend", "ucxx"]) == ("ucxx",)


def test_prefill_offers_what_it_did() -> None:
    assert _backends(["--device", "cpu"], role="prefill") == ("shm", "tcp")


def test_the_rule() -> None:
    assert ucx_tcp_only(False) is True
    assert ucx_tcp_only(True) is False
