"""vLLM's `--config FILE`: `vllm serve`'s flags from a YAML file, under the command line's.

Deployments keep their server settings in one file (`port: 8000`, `served-model-name: [chat,
gpt-4o]`, `enable-auto-tool-choice: true`, `override-generation-config: {temperature: 0.5}`)
and start `vllm serve --config server.yaml`; the command line wins where both set a flag. The
file here becomes flags placed before the command line's (argparse keeps a flag's last value),
so it is sorted exactly as a command line is (serve/vllm_flags.py): pdmesh's flags, vLLM's that
ask for what pdmesh does anyway, and refusals, one line each.

A key is a flag's long name without its dashes (`_` or `-` between words); a value becomes
the flag's text: `true` the flag itself, `false` its `--no-` form where it has one (else
nothing: a switch left off), a list the values of a flag that takes several (else one
comma-separated value, as pdmesh's list flags take them), a mapping its JSON, `null` nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import yaml

FLAG = "--config"
MAX_FILE_BYTES = 1 << 20  # a server's settings, not data
KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def with_config_file(argv: Sequence[str], own: Collection[str],
                     several_values: Collection[str] = ()) -> list[str]:
    """`argv` with `--config FILE` replaced by the file's flags, placed first (the command
    line's own flags, after them, win); ValueError (one line) for a file that cannot be read
    as flags. `own`: the command's option strings (which switches have a `--no-` form);
    `several_values`: flags that take several values (`SEVERAL_VALUES`)."""
    args = list(argv)
    end = args.index("--") if "--" in args else len(args)
    found = [i for i, a in enumerate(args[:end]) if a == FLAG or a.startswith(FLAG + "=")]
    if not found:
        return args
    if len(found) > 1:
        raise ValueError(f"{FLAG} is given {len(found)} times; give one file")
    at = found[0]
    if args[at] == FLAG:
        if at + 1 >= end or args[at + 1].startswith("-"):
            raise ValueError(f"{FLAG} needs the path of a YAML file")
        path, rest = args[at + 1], args[:at] + args[at + 2:]
    else:
        path, rest = args[at].partition("=")[2], args[:at] + args[at + 1:]
    return [*file_flags(read_settings(path), own, several_values), *rest]


def read_settings(path: str) -> dict[str, Any]:
    """The YAML mapping in `path`; ValueError naming the file and the problem."""
    file = Path(path).expanduser()
    try:
        with file.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{FLAG} {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{FLAG} {path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        settings = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ValueError(f"{FLAG} {path}: not valid YAML{line}") from None
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise ValueError(f"{FLAG} {path}: expected a mapping of flag names to values, got "
                         f"{type(settings).__name__}")
    return settings


def file_flags(settings: dict[Any, Any], own: Collection[str],
               several_values: Collection[str] = ()) -> list[str]:
    """The command-line flags a parsed settings mapping stands for (see the module doc)."""
    out: list[str] = []
    for key, value in settings.items():
        if not isinstance(key, str) or not KEY.fullmatch(key):
            raise ValueError(f"{FLAG}: {key!r} is not a flag name (e.g. port, "
                             f"served-model-name)")
        flag = "--" + key.replace("_", "-")
        if flag == FLAG:
            raise ValueError(f"{FLAG}: a config file cannot name another one")
        out += _flag_text(flag, value, own, several_values)
    return out


def _flag_text(flag: str, value: Any, own: Collection[str],
               several_values: Collection[str]) -> list[str]:
    if value is None:
        return []
    if isinstance(value, bool):
        negative = "--no-" + flag[2:]
        if value:
            return [flag]
        return [negative] if negative in own else []
    if isinstance(value, dict):
        return [f"{flag}={json.dumps(value)}"]
    if isinstance(value, list):
        if not all(isinstance(v, str | int | float) and not isinstance(v, bool)
                   for v in value):
            raise ValueError(f"{FLAG}: {flag[2:]} must list plain values")
        if not value:
            return []
        items = [str(v) for v in value]
        return [flag, *items] if flag in several_values else [flag, ",".join(items)]
    if isinstance(value, str | int | float):
        return [f"{flag}={value}"]  # `=`: a value that starts with "-" stays the value
    raise ValueError(f"{FLAG}: {flag[2:]} has a value of type {type(value).__name__}")
