"""The README's Python examples, run as written, print sensible answers.

The library example runs as is, and with the model's Hugging Face Hub id offline (the README
says a Hub id works); the OpenAI-client example runs against `pdmesh serve smollm2`
started as the README says, on a free port instead of 8000 (the only change made to it). Both
rely on the server sampling defaults from the model's generation config (temperature 0.2,
top_p 0.9 for SmolLM2), which is what makes a 135M model answer on topic. The answer is a
sample: "1. Red 2. Blue 3. Green", "The most obvious color is black, ...", or (a first token
of ~17 % under those defaults) "There are no colors that ...". Whichever the random stream
gives, a reply to the question talks about colors; a broken chat template or tokenizer makes
the model continue the prompt or emit noise instead.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdmesh.serve import Child, pdmesh_command
from tests.hub_cache import SMOLLM2_ID, commit_of, model_files, put_snapshot

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

README = Path(__file__).resolve().parents[2] / "README.md"
COLORS = {"red", "blue", "green", "yellow", "orange", "purple", "black", "white", "pink",
          "brown", "gray", "grey", "violet", "cyan", "magenta"}


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def block_with(marker: str) -> str:
    return next(b for b in python_blocks() if marker in b)


def run(code: str, env: dict[str, str] | None = None) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if line.strip()]


def colors_in(text: str) -> set[str]:
    return COLORS & set(re.findall(r"[a-z]+", text.lower()))


def on_colors(text: str) -> bool:
    """Names a color, or talks about colors (any of the model's likely answers does)."""
    return bool(colors_in(text)) or "color" in text.lower()


def test_library_example() -> None:
    lines = run(block_with("from pdmesh import LLM"))
    assert "Paris" in lines[0], lines
    assert on_colors(" ".join(lines[1:])), lines


def test_library_example_with_a_hub_id_offline(tmp_path: Path, model_dir: Path) -> None:
    """The library example with the model's Hub id in place of the alias, offline: the Hub
    cache (HF_HOME) holds SmolLM2 under its id (the converted files, linked), HF_HUB_OFFLINE=1,
    and the Hub's endpoint a dead local port, so any network use would fail the run."""
    put_snapshot(tmp_path / "hf" / "hub", SMOLLM2_ID, commit_of("smollm2"),
                 model_files(model_dir))
    code = block_with("from pdmesh import LLM")
    assert 'LLM(model="smollm2")' in code
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    lines = run(code.replace('LLM(model="smollm2")', f'LLM(model="{SMOLLM2_ID}")'), env=env)
    assert "Paris" in lines[0], lines
    assert on_colors(" ".join(lines[1:])), lines


def test_openai_example() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = Child("serve", pdmesh_command("serve", "smollm2", "--port", str(port),
                                          "--kv-cache-memory", "96MiB"))
    try:
        serve.wait_ready(timeout_s=240)
        code = block_with("from openai import OpenAI").replace("127.0.0.1:8000",
                                                              f"127.0.0.1:{port}")
        lines = run(code)
    finally:
        serve.terminate(grace_s=30)
    assert on_colors(" ".join(lines)), lines


def test_tool_calling_example() -> None:
    """The tool example against the server started as the README's tool command says (its
    shipped `--chat-template hermes`), on a free port and a small KV budget."""
    command = next(b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), re.DOTALL)
                   if "--chat-template" in b)
    flags = command.replace("\\\n", " ").split()
    assert flags[:3] == [".venv/bin/pdmesh", "serve", "smollm2"], flags
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = Child("serve-tools", pdmesh_command(*flags[1:], "--port", str(port),
                                                "--kv-cache-memory", "96MiB"))
    client = ('from openai import OpenAI\n'
              f'client = OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="unused")\n')
    try:
        serve.wait_ready(timeout_s=240)
        lines = run(client + block_with("tools=[weather]"))
    finally:
        serve.terminate(grace_s=30)
    assert list(json.loads(lines[-1])) == ["city"], lines
