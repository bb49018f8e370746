"""`pdmesh serve` takes a `vllm serve` command line: vLLM's flags that pdmesh lacks are refused
in one line naming them (exit code 2), and the cheap ones map onto what pdmesh has."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdmesh.config import parse_config
from pdmesh.gateway.config import GatewayConfig
from pdmesh.serve import MeshConfig
from pdmesh.serve.child_config import child_config, gateway_placement
from pdmesh.serve.command import main as serve_main
from pdmesh.serve.vllm_flags import UNSUPPORTED_VLLM_FLAGS

pytestmark = pytest.mark.fast


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line `pdmesh serve argv` exits 2 with (before anything starts)."""
    with pytest.raises(SystemExit) as info:
        serve_main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err, err
    return err.strip()


@pytest.mark.parametrize("argv", [
    ["--enable-lora"], ["--quantization", "awq"], ["-q", "gptq"], ["--code-revision", "main"],
    ["--tokenizer-revision=v1"], ["--tokenizer-mode", "slow"], ["--lora-modules", "a=b"],
])
def test_an_unsupported_vllm_flag_is_named_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str],
) -> None:
    line = refusal(capsys, "smollm2", "--port", "0", *argv)
    flag = argv[0].partition("=")[0]
    assert line.startswith(f"pdmesh serve: error: {flag} is not supported yet"), line
    assert flag in UNSUPPORTED_VLLM_FLAGS


def test_trust_remote_code_is_refused_only_when_true(capsys: pytest.CaptureFixture[str]) -> None:
    line = refusal(capsys, "smollm2", "--trust-remote-code")
    assert "--trust-remote-code is not supported yet" in line, line
    config = parse_config(MeshConfig, ["--no-trust-remote-code"], prog="serve", env={})
    assert not config.trust_remote_code


def test_other_errors_are_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert refusal(capsys, "--bogus", "1") == (
        "pdmesh serve: error: unrecognized arguments: --bogus 1")
    assert refusal(capsys, "--max-logprobs", "30").startswith(
        "pdmesh serve: error: --max-logprobs must be in [0, 20]")


def gateway_of(mesh: MeshConfig) -> GatewayConfig:
    return child_config(GatewayConfig, mesh, gateway_placement(
        mesh, router_address="127.0.0.1:1", port=0))


def test_gateway_flags_reach_the_gateway(tmp_path: Path) -> None:
    cert, key, other = (tmp_path / n for n in ("cert.pem", "key.pem", "other.pem"))
    for path in (cert, key, other):
        path.write_text("-")
    mesh = parse_config(MeshConfig, [
        "--model", "smollm2", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
        "--uvicorn-log-level", "debug", "--max-logprobs", "5"], prog="serve", env={})
    gateway = gateway_of(mesh)
    assert (gateway.ssl_certfile, gateway.ssl_keyfile) == (str(cert), str(key))
    assert (gateway.uvicorn_log_level, gateway.max_logprobs) == ("debug", 5)
    assert gateway.model_root == "smollm2"
    # --ssl-* win over the mesh's own TLS certificate, which the gateway serves otherwise.
    tls = MeshConfig(tls_cert=str(other), tls_key=str(key), ssl_certfile=str(cert),
                     ssl_keyfile=str(key))
    assert gateway_of(tls).ssl_certfile == str(cert)
    assert gateway_of(MeshConfig(tls_cert=str(other), tls_key=str(key))).ssl_certfile == str(
        other)
