"""The router is a CPU service: it neither imports torch nor loads it to tokenize.

Importing its server module and building its tokenizer leave `torch` out of `sys.modules`
(checked in a fresh interpreter: this test process has torch already), and the tokenizer it
loads without transformers' auto classes encodes exactly as the engines' `AutoTokenizer`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdmesh.engine.chat_template import apply_chat_template

# a fresh interpreter, and the model's tokenizer files
pytestmark = [pytest.mark.slow, pytest.mark.weights, pytest.mark.processes]

NO_TORCH = """
import sys
import pdmesh.router.process
from pdmesh.router.prompt_tokenizer import PromptTokenizer
PromptTokenizer("smollm2", pool_size=1)
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, loaded
"""


def test_the_router_runs_without_torch() -> None:
    done = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_its_tokenizer_encodes_as_the_engines_do(model_dir) -> None:
    from transformers import AutoTokenizer

    from pdmesh.engine.tokenizing import load_tokenizer_from as load_tokenizer

    ours, engines = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    for text in ("The capital of France is", " leading space", "emoji 🎉 and CJK 漢字",
                 "<|im_start|>user\nspecial tokens<|im_end|>"):
        assert ours(text)["input_ids"] == engines(text)["input_ids"], text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert apply_chat_template(ours, chat) == apply_chat_template(engines, chat)
