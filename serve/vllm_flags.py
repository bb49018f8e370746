"""vLLM's `vllm serve` flags that `pdmesh serve` knows of and does not support yet.

A vLLM user changes only the command name: a flag of theirs that pdmesh lacks is refused in one
line saying so ("--enable-lora is not supported yet: ..."), exit code 2, rather than argparse's
"unrecognized arguments" under a usage dump of every flag. The vLLM flags pdmesh does take are
`MeshConfig`'s own (serve/config.py); `--trust-remote-code` is one of them, refused when true.
"""

from __future__ import annotations

_LOCAL_MODELS = "pdmesh downloads nothing: give an alias or a local HF-format directory"
_LORA = "LoRA adapters"

UNSUPPORTED_VLLM_FLAGS: dict[str, str] = {
    "--enable-lora": _LORA,
    "--lora-modules": _LORA,
    "--max-loras": _LORA,
    "--max-lora-rank": _LORA,
    "--quantization": "pdmesh runs checkpoints unquantized, in --dtype",
    "-q": "(--quantization) pdmesh runs checkpoints unquantized, in --dtype",
    "--revision": _LOCAL_MODELS,
    "--tokenizer-revision": _LOCAL_MODELS,
    "--code-revision": _LOCAL_MODELS,
    "--download-dir": _LOCAL_MODELS,
    "--tokenizer": "every process uses the model's own tokenizer",
    "--tokenizer-mode": "every process uses the model's own (fast) tokenizer",
}
"""Flag → why (or what pdmesh does instead), for the error line."""
