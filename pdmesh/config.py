"""How every pdmesh process reads its configuration: one dataclass per component, filled from
defaults < PDMESH_<FIELD> env vars < CLI flags (`parse_config`), so all services behave alike."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

C = TypeVar("C")


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a dataclass field annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        return _base_type(args[0])[0], optional
    if origin is typing.Literal:
        return type(typing.get_args(tp)[0]), False
    return tp, False


def _convert(name: str, raw: str, tp: type, optional: bool) -> Any:
    if optional and raw.strip().lower() in ("", "none"):
        return None
    if tp is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {raw!r}")
    if tp in (int, float):
        try:
            return tp(raw)
        except ValueError:
            raise ValueError(f"{name}: expected {tp.__name__}, got {raw!r}") from None
    if tp in (tuple, list) or typing.get_origin(tp) in (tuple, list):
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    return raw


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ",".join(map(str, value)) or "none"
    return str(value) if value != "" else "empty"


def _help_text(f: dataclasses.Field[Any], hint: Any, env_name: str) -> str:
    """The field's help, then its default and allowed values (metadata["choices"], or a
    Literal annotation's values), then its env var: `--help` answers "what if I leave it?"."""
    if f.default is not dataclasses.MISSING:
        default = _show(f.default)
    elif f.default_factory is not dataclasses.MISSING:
        default = _show(f.default_factory())
    else:
        default = "required"
    choices = f.metadata.get("choices")
    if not choices:
        literal = [a for a in (typing.get_args(hint) or (hint,))
                   if typing.get_origin(a) is typing.Literal]
        if typing.get_origin(hint) is typing.Literal:
            literal = [hint]
        choices = typing.get_args(literal[0]) if literal else ()
    parts = [f"default: {default}"]
    if choices:
        parts.append("choices: " + "|".join(map(str, choices)))
    text = f.metadata.get("help", "")
    # argparse %-formats help strings; a literal % in a help text must be doubled.
    return f"{text} [{'; '.join(parts)}] (env {env_name})".strip().replace("%", "%%")


def parse_config(
    cls: type[C], argv: Sequence[str] | None, *, prog: str, description: str = "",
    env: Mapping[str, str] | None = None,
) -> C:
    """Build `cls` (a dataclass) from defaults, then PDMESH_<FIELD> env vars, then CLI flags.

    Field `kv_backend` becomes flag `--kv-backend` and env var `PDMESH_KV_BACKEND`; the field's
    `metadata["help"]` is its help text. Booleans take `--flag/--no-flag`. Validation is the
    dataclass's `__post_init__`; its ValueError becomes an argparse error (exit code 2).
    """
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    specs: dict[str, tuple[type, bool]] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        tp, optional = _base_type(hints[f.name])
        specs[f.name] = (tp, optional)
        flag = "--" + f.name.replace("_", "-")
        env_name = "PDMESH_" + f.name.upper()
        help_text = _help_text(f, hints[f.name], env_name)
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    try:
        for name, (tp, optional) in specs.items():
            cli = getattr(args, name)
            env_value = env.get("PDMESH_" + name.upper())
            if isinstance(cli, bool):
                values[name] = cli
            elif cli is not None:
                values[name] = _convert("--" + name.replace("_", "-"), cli, tp, optional)
            elif env_value is not None:
                values[name] = _convert("PDMESH_" + name.upper(), env_value, tp, optional)
        return cls(**values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def split_address(address: str) -> tuple[str, int]:
    """`host:port` -> (host, port); raises ValueError naming the address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)
