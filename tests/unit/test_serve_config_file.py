"""vLLM's `--config FILE` on `pdmesh serve`: a YAML file of `vllm serve` flags, sorted as a
command line's are (pdmesh's own, what pdmesh does anyway, refusals in one line), under the
command line's own flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdmesh.config import parse_config, values_of
from pdmesh.serve import MeshConfig
from pdmesh.serve.command import main as serve_main
from pdmesh.serve.config_file import file_flags, with_config_file
from pdmesh.serve.vllm_flags import vllm_command_line

pytestmark = pytest.mark.fast

SERVER_YAML = """\
# as a vLLM deployment keeps it
model: smollm2
port: 8001
served-model-name: [chat, gpt-4o]
max_model_len: 1024
enable-prefix-caching: false
enable-auto-tool-choice: true
tool-call-parser: hermes
override-generation-config: {temperature: 0.5, max_new_tokens: 64}
default-chat-template-kwargs:
  enable_thinking: false
api-key: [k1, k2]
disable-log-stats: true
kv-cache-dtype: auto
uvicorn-log-level: null
"""


def parse(argv: list[str]) -> MeshConfig:
    return parse_config(MeshConfig, argv, prog="serve", env={}, foreign=vllm_command_line)


def test_a_vllm_config_file_gives_the_flags_it_names(tmp_path: Path) -> None:
    (tmp_path / "server.yaml").write_text(SERVER_YAML)
    config = parse(["--config", str(tmp_path / "server.yaml")])
    plain = parse(["--model", "smollm2", "--port", "8001", "--served-model-name", "chat",
                   "--served-model-aliases", "gpt-4o", "--max-model-len", "1024",
                   "--no-enable-prefix-caching", "--enable-auto-tool-choice",
                   "--tool-call-parser", "hermes", "--override-generation-config",
                   '{"temperature": 0.5, "max_new_tokens": 64}',
                   "--default-chat-template-kwargs", '{"enable_thinking": false}',
                   "--api-key", "k1,k2"])
    assert values_of(config) == values_of(plain)
    assert config.engine.enable_prefix_caching is False
    assert json.loads(config.override_generation_config) == {"temperature": 0.5,
                                                             "max_new_tokens": 64}


def test_the_command_line_wins_over_the_file(tmp_path: Path) -> None:
    (tmp_path / "server.yaml").write_text(SERVER_YAML)
    config = parse(["--model", "other-model", "--port", "9000",
                    f"--config={tmp_path / 'server.yaml'}", "--enable-prefix-caching"])
    assert (config.model, config.http_port) == ("other-model", 9000)
    assert config.engine.enable_prefix_caching is True
    assert config.served_model_name == "chat"  # the file's, where the line says nothing


def test_values_become_flag_text() -> None:
    own = {"--enable-prefix-caching", "--no-enable-prefix-caching", "--api-key"}
    assert file_flags({"enable_prefix_caching": False, "trust-remote-code": False,
                       "api-key": ["a", "b"], "allowed-origins": ["x", "y"],
                       "seed": -1, "gpu-memory-utilization": 0.5, "tokenizer": None},
                      own, {"--api-key"}) == [
        "--no-enable-prefix-caching", "--api-key", "a", "b", "--allowed-origins", "x,y",
        "--seed=-1", "--gpu-memory-utilization=0.5"]
    assert with_config_file(["--port", "1"], own) == ["--port", "1"]  # no file: unchanged


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        serve_main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "usage:" not in err, err
    return err.removeprefix("pdmesh serve: error: ")


@pytest.mark.parametrize(("text", "problem"), [
    ("enable-lora: true\n", "--enable-lora is not supported yet: LoRA adapters"),
    ("kv-cache-dtype: fp8\n", "--kv-cache-dtype fp8 is not supported yet"),
    ("- port\n- 8000\n", "expected a mapping of flag names to values, got list"),
    ("port: [8000\n", "not valid YAML (line 2)"),
    ("config: other.yaml\n", "a config file cannot name another one"),
    ("--port: 8000\n", "'--port' is not a flag name"),
    ("served-model-name: [{a: 1}]\n", "served-model-name must list plain values"),
    ("bogus-flag: 1\n", "unrecognized arguments: --bogus-flag=1"),
])
def test_what_a_file_cannot_say_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                           text: str, problem: str) -> None:
    (tmp_path / "server.yaml").write_text(text)
    line = refusal(capsys, "smollm2", "--config", str(tmp_path / "server.yaml"))
    assert problem in line, line


def test_a_missing_or_repeated_file_is_one_line(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere.yaml")
    assert refusal(capsys, "--config", missing).startswith(f"--config {missing}: No such file")
    assert refusal(capsys, "--config").startswith("--config needs the path of a YAML file")
    (tmp_path / "a.yaml").write_text("port: 1\n")
    a = str(tmp_path / "a.yaml")
    assert refusal(capsys, "--config", a, "--config", a).startswith("--config is given 2 times")
