"""`pdmesh serve` takes a `vllm serve` command line: vLLM's flags that pdmesh lacks are refused
in one line naming them (exit code 2), and the cheap ones map onto what pdmesh has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdmesh.auth import TOKEN_ENV
from pdmesh.config import config_argv, parse_config, values_of
from pdmesh.gateway.config import GatewayConfig
from pdmesh.router.config import RouterConfig
from pdmesh.serve import MeshConfig
from pdmesh.serve.child_config import (
    ENGINE_CONFIGS,
    child_config,
    engine_placement,
    gateway_placement,
    router_placement,
)
from pdmesh.serve.command import children_env
from pdmesh.serve.command import main as serve_main
from pdmesh.serve.vllm_flags import UNSUPPORTED_VLLM_FLAGS, take_vllm_flags, vllm_serve_flags

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
    ["--enable-lora"], ["--enable-expert-parallel"], ["--code-revision", "main"],
    ["--enable-sleep-mode"], ["--lora-modules", "a=b"], ["--speculative-config", "{}"],
])
def test_an_unsupported_vllm_flag_is_named_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str],
) -> None:
    line = refusal(capsys, "smollm2", "--port", "0", *argv)
    flag = argv[0].partition("=")[0]
    assert line.startswith(f"pdmesh serve: error: {flag} is not supported yet"), line
    assert flag in UNSUPPORTED_VLLM_FLAGS


def test_vllm_flags_that_ask_for_what_pdmesh_does_are_taken() -> None:
    """A vLLM command line's flags that change nothing here leave the config as without them."""
    plain = parse_config(MeshConfig, ["--model", "smollm2", "--port", "0"], prog="serve",
                         env={}, foreign=take_vllm_flags)
    vllm_style = parse_config(MeshConfig, [
        "--model", "smollm2", "--port", "0", "--disable-log-stats", "--disable-log-requests",
        "--kv-cache-dtype", "auto", "--pipeline-parallel-size", "1", "-dp", "1",
        "--tokenizer-mode=auto", "--distributed-executor-backend", "mp",
        "--disable-uvicorn-access-log", "--enable-prompt-tokens-details", "--runner", "generate",
        "--chat-template-content-format", "string", "--response-role", "assistant",
        "--disable-access-log-for-endpoints", "/health,/metrics", "--disable-cascade-attn",
    ], prog="serve", env={}, foreign=take_vllm_flags)
    assert values_of(vllm_style) == values_of(plain)


@pytest.mark.parametrize(("argv", "line"), [
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 is not supported yet: the KV cache is "
                                  "kept in the model's --dtype (--kv-cache-dtype auto)"),
    (["--pipeline-parallel-size=2"], "--pipeline-parallel-size 2 is not supported yet"),
    (["--tokenizer-mode", "slow"], "--tokenizer-mode slow is not supported yet"),
    (["--disable-log-stats=1"], "--disable-log-stats takes no value"),
    (["--kv-cache-dtype"], "--kv-cache-dtype needs a value"),
    (["--speculative-config", "{}"], "--speculative-config is not supported yet"),
    (["--uds", "/tmp/pdmesh.sock"], "--uds is a vLLM flag pdmesh does not support yet"),
    (["--override-generation-config", "[1]"],
     "--override-generation-config must be a JSON object"),
    (["--default-chat-template-kwargs", "{\"tools\": 1}"],
     "--default-chat-template-kwargs: tools cannot be set here"),
    (["-ep"], "-ep is not supported yet: experts are split over --tensor-parallel-size ranks"),
    (["--hf-overrides", '{"model_type": "gemma"}'], "--hf-overrides cannot set model_type"),
])
def test_what_pdmesh_does_otherwise_is_one_line(capsys: pytest.CaptureFixture[str],
                                               argv: list[str], line: str) -> None:
    refused = refusal(capsys, "smollm2", "--port", "0", *argv)
    assert refused.startswith(f"pdmesh serve: error: {line}"), refused


def test_vllm_flags_are_known_by_name_and_ours_pass() -> None:
    names = vllm_serve_flags()
    assert {"--enable-lora", "--max-model-len", "-tp", "--no-enable-prefix-caching"} <= names
    ours = ["--max-model-len", "512", "-tp", "1", "--no-enable-prefix-caching"]
    assert take_vllm_flags(ours, {"--max-model-len", "-tp", "--no-enable-prefix-caching"}) == ours
    # After "--" nothing is read; a flag nobody knows is left for argparse to name.
    assert take_vllm_flags(["--bogus", "--", "--enable-lora"], set()) == [
        "--bogus", "--", "--enable-lora"]


def test_vllm_aliases_and_the_environment_flags(tmp_path: Path) -> None:
    config = parse_config(MeshConfig, [
        "--model", "smollm2", "--device-memory-utilization", "0.5",
        "--kv-cache-memory-bytes", str(2**30), "--otlp-traces-endpoint", "http://127.0.0.1:4317",
        "--hf-token", "hf_secret", "--disable-fastapi-docs", "--root-path", "/llm",
        "--exclude-tools-when-tool-choice-none", "--num-gpu-blocks-override", "64",
        "--long-prefill-token-threshold", "128",
        "--hf-overrides", '{"max_position_embeddings": 4096}',
    ], prog="serve", env={}, foreign=take_vllm_flags)
    assert config.engine.gpu_memory_utilization == 0.5
    assert config.engine.kv_cache_memory == 2**30
    engine = child_config(ENGINE_CONFIGS["decode"], config, engine_placement(
        "decode", config, redis_url="redis://127.0.0.1:1/0")).engine
    assert (engine.num_gpu_blocks_override, engine.long_prefill_token_threshold) == (64, 128)
    assert json.loads(engine.hf_overrides) == {"max_position_embeddings": 4096}
    env = children_env(config, {})
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://127.0.0.1:4317"
    assert env["HF_TOKEN"] == "hf_secret" and env[TOKEN_ENV]
    gateway = gateway_of(config)
    assert (gateway.disable_fastapi_docs, gateway.root_path) == (True, "/llm")
    assert gateway.exclude_tools_when_tool_choice_none
    assert not any("hf_secret" in arg for arg in config_argv(gateway))  # never on a command line


def test_several_served_model_names_as_vllm_takes_them() -> None:
    """`--served-model-name a b c`: the name a everywhere, b and c also answered by the router;
    `--api-key k1 k2`: either key."""
    mesh = parse_config(MeshConfig, ["--model", "smollm2", "--served-model-name", "chat",
                                     "gpt-4o", "gpt-3.5-turbo", "--port", "0"],
                        prog="serve", env={}, foreign=take_vllm_flags)
    redis = "redis://127.0.0.1:1/0"
    router = child_config(RouterConfig, mesh, router_placement(
        mesh, redis_url=redis, port=0, metrics_port=0, prefill=[], decode=["127.0.0.1:1"]))
    assert router.model_names == ("chat", "gpt-4o", "gpt-3.5-turbo")
    engine = child_config(ENGINE_CONFIGS["decode"], mesh,
                          engine_placement("decode", mesh, redis_url=redis))
    assert engine.model_name == "chat"  # the registry's namespace: one name
    keys = parse_config(MeshConfig, ["--model", "smollm2", "--api-key", "k1", "k2"],
                        prog="serve", env={}, foreign=take_vllm_flags)
    assert keys.api_key == "k1,k2"  # reaches the gateway in its environment, as one key did
    gateway = parse_config(GatewayConfig, [], prog="gateway",
                           env={"PDMESH_API_KEY": keys.api_key})
    assert gateway.api_keys == ("k1", "k2")
    one = parse_config(MeshConfig, ["--model", "smollm2", "--served-model-name=chat"],
                       prog="serve", env={}, foreign=take_vllm_flags)
    assert (one.served_model_name, one.served_model_aliases) == ("chat", ())


def test_fastapi_docs_are_served_unless_disabled() -> None:
    from fastapi.testclient import TestClient

    from pdmesh.gateway.app import create_app

    for disabled, status in ((False, 200), (True, 404)):
        config = GatewayConfig(disable_fastapi_docs=disabled)
        with TestClient(create_app(config, client=object())) as http:  # type: ignore[arg-type]
            assert [http.get(path).status_code for path in ("/docs", "/openapi.json")] == [
                status, status]


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
        "--uvicorn-log-level", "debug", "--max-logprobs", "5",
        "--ssl-ciphers", "ECDHE+AESGCM", "--shutdown-timeout", "45"], prog="serve", env={})
    assert mesh.drain_timeout_s == 45  # vLLM's --shutdown-timeout: the drain on SIGTERM
    gateway = gateway_of(mesh)
    assert (gateway.ssl_certfile, gateway.ssl_keyfile) == (str(cert), str(key))
    assert (gateway.ssl_ciphers, gateway.drain_timeout_s) == ("ECDHE+AESGCM", 45)
    with pytest.raises(ValueError, match="--ssl-ciphers 'NO-SUCH-CIPHER': OpenSSL selects"):
        GatewayConfig(ssl_certfile=str(cert), ssl_keyfile=str(key),
                      ssl_ciphers="NO-SUCH-CIPHER")
    with pytest.raises(ValueError, match="--ssl-ciphers needs --ssl-certfile"):
        GatewayConfig(ssl_ciphers="ECDHE+AESGCM")
    assert (gateway.uvicorn_log_level, gateway.max_logprobs) == ("debug", 5)
    assert gateway.model_root == "smollm2"
    # --ssl-* win over the mesh's own TLS certificate, which the gateway serves otherwise.
    tls = MeshConfig(tls_cert=str(other), tls_key=str(key), ssl_certfile=str(cert),
                     ssl_keyfile=str(key))
    assert gateway_of(tls).ssl_certfile == str(cert)
    assert gateway_of(MeshConfig(tls_cert=str(other), tls_key=str(key))).ssl_certfile == str(
        other)
