"""`vllm serve`'s flags on a `pdmesh serve` command line: a vLLM user changes only the command name.

Every flag of vLLM's is one of four kinds here, decided before argparse sees the command line
(`take_vllm_flags`):

- **pdmesh's own**: the same name and meaning (`MeshConfig`'s flags and its engines',
  serve/config.py; a few under a vLLM alias such as `--device-memory-utilization`), where
  vLLM takes several values the rest going to a flag of pdmesh's (`SEVERAL_VALUES`).
- **what pdmesh does anyway** (`SAME_AS_PDMESH`): at the listed values the flag asks for what
  pdmesh does without it (`--kv-cache-dtype auto`, `--pipeline-parallel-size 1`,
  `--disable-log-stats`), so it is taken and dropped; any other value is refused naming the
  values that are.
- **refused with a reason** (`UNSUPPORTED_VLLM_FLAGS`): what pdmesh lacks, or does instead.
- **any other flag of vLLM's** (`VLLM_SERVE_FLAGS`, vLLM 0.32.0's, listed in
  vllm_serve_flags.txt): refused as "a vLLM flag pdmesh does not support yet".

`--config FILE` (vLLM's YAML file of these flags) is read first, into flags placed before the
command line's (serve/config_file.py), so the file's flags are sorted the same way.

Each refusal is one line and exit code 2 ("--enable-lora is not supported yet: LoRA
adapters"), not argparse's "unrecognized arguments" under a usage dump; a flag nobody knows
still gets argparse's line.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources

from pdmesh.serve.config_file import with_config_file

_LORA = "LoRA adapters"

UNSUPPORTED_VLLM_FLAGS: dict[str, str] = {
    "--enable-lora": _LORA,
    "--lora-modules": _LORA,
    "--max-loras": _LORA,
    "--max-lora-rank": _LORA,
    "--max-cpu-loras": _LORA,
    "--enable-expert-parallel": "experts are split over --tensor-parallel-size ranks by "
                                "their columns; placing whole experts on ranks is not built",
    "--code-revision": "pdmesh runs its own model code, never a repo's",
    "--speculative-config": "no speculative decoding yet",
    "--kv-transfer-config": "pdmesh moves KV between its own prefill and decode engines "
                            "(--num-prefill, --num-decode, --kv-backend)",
    "--enable-sleep-mode": "engines do not sleep; --drain-timeout-s stops them gracefully",
    "--headless": "pdmesh serve always runs the API server; start services alone with "
                  "pdmesh prefill / decode / router / gateway",
}
"""Flag → why (or what pdmesh does instead), for the error line."""


@dataclass(frozen=True)
class SameAsPdmesh:
    """A vLLM flag that, given one of `values` (a switch: `values` empty), asks for what pdmesh
    does anyway (`does`)."""

    does: str
    values: tuple[str, ...] = ()
    any_value: bool = False  # a value is taken, whatever it is (it changes nothing here)

    @property
    def takes_value(self) -> bool:
        return bool(self.values) or self.any_value


SAME_AS_PDMESH: dict[str, SameAsPdmesh] = {
    "--disable-log-requests": SameAsPdmesh("requests are logged only with "
                                           "--enable-log-requests"),
    "--disable-log-stats": SameAsPdmesh("pdmesh logs no periodic stats (/metrics serves them)"),
    "--disable-uvicorn-access-log": SameAsPdmesh("the API server keeps no access log"),
    "--disable-access-log-for-endpoints": SameAsPdmesh("the API server keeps no access log",
                                                       any_value=True),
    "--disable-cascade-attn": SameAsPdmesh("attention has no cascade path to turn off"),
    "--enable-server-load-tracking": SameAsPdmesh(
        "/load always reports the generation requests in flight"),
    "--enable-prompt-tokens-details": SameAsPdmesh(
        "usage always carries prompt_tokens_details.cached_tokens"),
    "--enable-request-id-headers": SameAsPdmesh(
        "every answer carries its X-Request-Id (the client's, or one made for it)"),
    "--disable-custom-all-reduce": SameAsPdmesh(
        "tensor-parallel ranks all-reduce through torch.distributed"),
    "--kv-cache-dtype": SameAsPdmesh("the KV cache is kept in the model's --dtype", ("auto",)),
    "--tokenizer-mode": SameAsPdmesh("every process uses the tokenizer's own fast class",
                                     ("auto", "hf")),
    "--pipeline-parallel-size": SameAsPdmesh(
        "a model is split by tensor parallelism only (--tensor-parallel-size)", ("1",)),
    "--data-parallel-size": SameAsPdmesh(
        "more engines are --num-prefill and --num-decode", ("1",)),
    "--api-server-count": SameAsPdmesh("one API server process serves the mesh", ("1",)),
    "--decode-context-parallel-size": SameAsPdmesh("no context parallelism", ("1",)),
    "--prefill-context-parallel-size": SameAsPdmesh("no context parallelism", ("1",)),
    "--nnodes": SameAsPdmesh("pdmesh serve runs one host's mesh (across hosts, start its "
                             "services on each)", ("1",)),
    "--node-rank": SameAsPdmesh("pdmesh serve runs one host's mesh", ("0",)),
    "--distributed-executor-backend": SameAsPdmesh(
        "tensor-parallel ranks are local processes", ("mp",)),
    "--runner": SameAsPdmesh("pdmesh serves text generation", ("auto", "generate")),
    "--convert": SameAsPdmesh("pdmesh serves the model as it is", ("auto", "none")),
    "--model-impl": SameAsPdmesh("pdmesh runs its own model implementation", ("auto",)),
    "--chat-template-content-format": SameAsPdmesh(
        "a message's content reaches the template as a string (text parts joined)",
        ("auto", "string")),
    "--response-role": SameAsPdmesh("chat answers come from the assistant role",
                                    ("assistant",)),
    "--logprobs-mode": SameAsPdmesh("logprobs are the model's, before any logit processing",
                                    ("raw_logprobs",)),
    "--cpu-offload-gb": SameAsPdmesh("weights stay on the engine's device", ("0",)),
}

SHORT_FORMS: dict[str, str] = {"-pp": "--pipeline-parallel-size", "-ep": "--enable-expert-parallel",
                               "-dp": "--data-parallel-size", "-asc": "--api-server-count",
                               "-dcp": "--decode-context-parallel-size",
                               "-pcp": "--prefill-context-parallel-size"}
"""vLLM's short option strings of the flags above: each means what its long one does here."""
for _short, _long in SHORT_FORMS.items():
    for _table in (UNSUPPORTED_VLLM_FLAGS, SAME_AS_PDMESH):
        if _long in _table:
            _table[_short] = _table[_long]  # type: ignore[index]


SEVERAL_VALUES: dict[str, str] = {"--served-model-name": "--served-model-aliases",
                                  "--api-key": "--api-key"}
"""vLLM flags that take several values where pdmesh's takes one: the values past the first go
to this flag of pdmesh's, comma-separated (`--served-model-name a b c`: the name a, the
aliases b and c); a flag mapped to itself takes them all (`--api-key k1 k2`: `--api-key
k1,k2`)."""


@cache
def vllm_serve_flags() -> frozenset[str]:
    """Every option string of vLLM 0.32.0's `vllm serve` (vllm_serve_flags.txt)."""
    text = resources.files("pdmesh.serve").joinpath("vllm_serve_flags.txt").read_text()
    return frozenset(line for line in text.splitlines() if line and not line.startswith("#"))


def vllm_command_line(argv: Sequence[str], own: Collection[str]) -> list[str]:
    """`take_vllm_flags` of `argv` with its `--config FILE` read in first."""
    return take_vllm_flags(with_config_file(argv, own, SEVERAL_VALUES), own)


def take_vllm_flags(argv: Sequence[str], own: Collection[str]) -> list[str]:
    """`argv` without the vLLM flags that ask for what pdmesh does anyway; ValueError (one
    line) for a vLLM flag pdmesh does not support, or a value of one it supports only in
    part. `own`: pdmesh's option strings, which always pass (a flag both servers have means
    the same in both)."""
    kept: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            kept += args[i - 1:]
            break
        flag, eq, inline = arg.partition("=")
        if flag in SEVERAL_VALUES and not eq and SEVERAL_VALUES[flag] in own:
            values = []
            while i < len(args) and not args[i].startswith("-"):
                values.append(args[i])
                i += 1
            if SEVERAL_VALUES[flag] == flag:
                kept += [flag, ",".join(values)]
                continue
            kept += [flag, *values[:1]]
            if len(values) > 1:
                kept += [SEVERAL_VALUES[flag], ",".join(values[1:])]
            continue
        if flag in own or not flag.startswith("-"):
            kept.append(arg)
            continue
        if flag in UNSUPPORTED_VLLM_FLAGS:
            raise ValueError(f"{flag} is not supported yet: {UNSUPPORTED_VLLM_FLAGS[flag]}")
        same = SAME_AS_PDMESH.get(flag)
        if same is None:
            if flag in vllm_serve_flags():
                raise ValueError(f"{flag} is a vLLM flag pdmesh does not support yet")
            kept.append(arg)  # argparse names it as unrecognized
            continue
        if not same.takes_value:
            if eq:
                raise ValueError(f"{flag} takes no value")
            continue
        if eq:
            value = inline
        elif i < len(args):
            value, i = args[i], i + 1
        else:
            raise ValueError(f"{flag} needs a value")
        if not same.any_value and value not in same.values:
            raise ValueError(f"{flag} {value} is not supported yet: {same.does} "
                             f"({flag} {' or '.join(same.values)})")
    return kept
