"""Settings declared once (pdmesh/config.py): an embedded config's fields are the outer config's
flags and env vars under their own names, a config renders back into the flags that rebuild
it, and `pdmesh serve` hands each child the settings its config declares, by name."""

from __future__ import annotations

import pytest

from pdmesh.config import config_argv, parse_config, settings
from pdmesh.decode_svc.config import DecodeConfig
from pdmesh.engine.config import EngineConfig
from pdmesh.prefill_svc.config import PrefillConfig
from pdmesh.router.config import RouterConfig
from pdmesh.serve import LocalMesh, MeshConfig

pytestmark = pytest.mark.fast

REDIS = "redis://127.0.0.1:1/0"


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_an_embedded_config_gives_its_flags_and_env_vars_their_own_names() -> None:
    config = parse_config(PrefillConfig, ["--block-size", "32", "--no-enable-prefix-caching",
                                          "--kv-cache-memory", "0.5", "--lease-s", "9"],
                          prog="prefill", env={"PDMESH_STREAM_INTERVAL": "4"})
    engine = config.engine
    assert (engine.block_size, engine.enable_prefix_caching, engine.stream_interval) == (
        32, False, 4)
    assert engine.kv_cache_memory == 0.5  # a fraction, not a string
    assert config.lease_s == 9
    names = settings(DecodeConfig)
    assert {"block_size", "kv_fetch_timeout_s", "redis_url"} <= set(names)
    assert "engine" not in names and "generation_config" not in names  # offline only
    assert names["block_size"].env == "PDMESH_BLOCK_SIZE"


def test_an_embedded_configs_error_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(DecodeConfig, ["--block-size", "7"], prog="decode", env={})
    assert "--block-size must be one of 8/16/32/64/128, got 7" in capsys.readouterr().err


def test_a_config_renders_into_the_flags_that_rebuild_it() -> None:
    config = DecodeConfig(engine=EngineConfig(max_model_len=512, async_scheduling=False),
                          role="colocated", redis_url=REDIS, tls_cert=None)
    argv = config_argv(config)
    assert parse_config(DecodeConfig, argv, prog="decode", env={}) == config
    assert "--block-size" not in argv  # defaults are left to the child (and its env)
    assert "--block-size" in config_argv(config, always={"block_size"})


def test_serve_hands_each_child_the_settings_it_declares() -> None:
    mesh = LocalMesh(parse_config(MeshConfig, [
        "--redis-url", REDIS, "--max-queue-delay-s", "5", "--max-num-seqs", "8",
        "--structured-output-compile-timeout-s", "2.5", "--api-key", "sk-x"],
        prog="serve", env={}), env={})
    router = parse_config(RouterConfig, mesh._router_argv(), prog="router", env={})
    assert (router.max_queue_delay_s, router.structured_output_compile_timeout_s) == (5, 2.5)
    decode = parse_config(DecodeConfig, mesh.engine_args("decode"), prog="decode", env={})
    assert decode.engine.max_num_seqs == 8
    assert decode.engine.structured_output_compile_timeout_s == 2.5
    assert decode.port == 0 and decode.redis_url == REDIS
    assert "--max-queue-delay-s" not in mesh.engine_args("decode")  # not an engine's setting
    assert flag(mesh.engine_args("colocated"), "--role") == "colocated"


def test_a_setting_some_child_refuses_stops_serve_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="--max-queue-delay-s must be >= 0"):
        MeshConfig(max_queue_delay_s=-1)
    with pytest.raises(ValueError, match="--routing-policy must be one of"):
        MeshConfig(routing_policy="nope")


def test_a_flag_takes_its_vllm_short_alias_and_renders_back_as_the_long_flag() -> None:
    config = parse_config(DecodeConfig, ["-tp", "2", "--role", "colocated"], prog="decode",
                          env={})
    assert config.engine.tensor_parallel_size == 2
    argv = config_argv(config.engine)
    assert flag(argv, "--tensor-parallel-size") == "2" and "-tp" not in argv


@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig])
def test_a_disaggregated_role_takes_tensor_parallelism(cls: type) -> None:
    config = parse_config(cls, ["--tensor-parallel-size", "2"], prog="engine", env={})
    assert config.engine.tensor_parallel_size == 2


def test_serve_gives_prefill_and_decode_engines_their_own_tensor_parallel_sizes() -> None:
    mesh = MeshConfig(prefill_tensor_parallel_size=2, num_decode=2)
    assert (mesh.tensor_parallel_size("prefill"), mesh.tensor_parallel_size("decode")) == (2, 1)
    with pytest.raises(ValueError, match="--decode-tensor-parallel-size"):
        MeshConfig(decode_tensor_parallel_size=-1)
