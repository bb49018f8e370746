"""vLLM's `vllm serve` flags that `pdmesh serve` knows of and does not support yet.

A vLLM user changes only the command name: a flag of theirs that pdmesh lacks is refused in one
line saying so ("--enable-lora is not supported yet: ..."), exit code 2, rather than argparse's
"unrecognized arguments" under a usage dump of every flag. The vLLM flags pdmesh does take are
`MeshConfig`'s own (serve/config.py) and its engines' (`EngineConfig`): among them the model as
a Hugging Face Hub id with `--revision`, `--download-dir` and a separate `--tokenizer`
(engine/model_store.py; HF_HUB_OFFLINE=1 reads the cache only). `--trust-remote-code` is
`MeshConfig`'s too, refused when true.
"""

from __future__ import annotations

_LORA = "LoRA adapters"

UNSUPPORTED_VLLM_FLAGS: dict[str, str] = {
    "--enable-lora": _LORA,
    "--lora-modules": _LORA,
    "--max-loras": _LORA,
    "--max-lora-rank": _LORA,
    "--quantization": "pdmesh runs checkpoints unquantized, in --dtype",
    "-q": "(--quantization) pdmesh runs checkpoints unquantized, in --dtype",
    "--tokenizer-revision": "a separate --tokenizer is read at its default revision (main); "
                            "without --tokenizer the model's tokenizer follows --revision",
    "--code-revision": "pdmesh runs its own model code, never a repo's",
    "--tokenizer-mode": "every process uses the tokenizer's own (fast) class",
}
"""Flag → why (or what pdmesh does instead), for the error line."""
