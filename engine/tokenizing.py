"""The serving side's tokenizer helpers, torch-free.

An engine service whose core runs in its own process needs its tokenizer (to tokenize prompts
and to detokenize the core's tokens) but not torch, which would cost it ~240 MiB of RSS for as
long as it serves (bench/README.md, "RSS"). transformers' auto classes import torch, so a
checkpoint that names the generic fast tokenizer class is loaded through that class directly:
the same class `AutoTokenizer` would build (`PreTrainedTokenizerFast` is `TokenizersBackend`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdmesh.engine.model_store import tokenizer_dir_for

if TYPE_CHECKING:
    from pdmesh.engine.config import EngineConfig

GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""`tokenizer_class` values naming the generic fast tokenizer: nothing model-specific to build,
so it is loaded without the auto classes (and without torch)."""


def load_tokenizer(config: EngineConfig) -> Any:
    """The model's tokenizer, as `AutoTokenizer` loads it; without torch for a generic one."""
    return load_tokenizer_from(Path(tokenizer_dir_for(config)))


def load_tokenizer_from(directory: Path) -> Any:
    """The tokenizer in `directory` (the engines' and the router's one loader)."""
    config_file = directory / "tokenizer_config.json"
    settings = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if settings.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def tokenize_prompt(tokenizer: Any, prompt: str | dict) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt: a string, or a dict with `prompt_token_ids`."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise ValueError("prompt: a dict prompt needs 'prompt_token_ids'")
        ids = [int(t) for t in prompt["prompt_token_ids"]]
        return prompt.get("prompt"), ids
    if not isinstance(prompt, str):
        raise ValueError(f"prompt: expected a string or a dict, got {type(prompt).__name__}")
    return prompt, tokenizer(prompt, add_special_tokens=True)["input_ids"]


def check_given_logprobs(given: list[list[int]], logprobs: list[list[Any]], n: int) -> None:
    """Logprobs given with resumed tokens: one list per sample, one entry per token."""
    if len(logprobs) != n:
        raise ValueError(f"output_logprobs: expected {n} lists, got {len(logprobs)}")
    for i, (tokens, lps) in enumerate(zip(given, logprobs, strict=False)):
        if len(lps) != len(tokens):
            raise ValueError(f"output_logprobs: sample {i} has {len(lps)} entries for "
                             f"{len(tokens)} tokens")


def eos_token_ids(tokenizer: Any, model_dir: Path) -> set[int]:
    """The ids that end a sequence: the tokenizer's EOS plus generation_config.json's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids
