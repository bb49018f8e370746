"""How every pdmesh process reads its configuration: one dataclass per component, filled from
defaults < PDMESH_<FIELD> env vars < CLI flags (`parse_config`), so all services behave alike.

A field whose type is itself a config dataclass is *embedded*: its settings are the outer
config's settings, under their own names (`EngineServiceConfig.engine: EngineConfig` gives
`pdmesh prefill` the flags `--block-size`, `--kv-cache-memory`, ...). So a setting is declared
once, where it belongs, and reaches every process whose config embeds it. An outer field of
the same name as an embedded one takes its flag (the outer config hands its value on).
`config_argv` turns a config back into flags: how `pdmesh serve` tells each child its settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

C = TypeVar("C")


def about(text: str, choices: Sequence[str] = (), *, cli: bool = True,
          aliases: Sequence[str] = ()) -> dict[str, Any]:
    """A config field's `metadata`: its --help text, the values it allows where its type does
    not say (shown in --help), `cli=False` for a field that is no flag (offline use only), and
    other option strings of its flag (`aliases`: vLLM's short ones, e.g. -tp)."""
    meta: dict[str, Any] = {"help": text}
    if choices:
        meta["choices"] = tuple(choices)
    if not cli:
        meta["cli"] = False
    if aliases:
        meta["aliases"] = tuple(aliases)
    return meta


def field_like(cls: type, name: str) -> Any:
    """A field with the default and help of `cls`'s field `name`: for a config that offers a
    setting of another (`pdmesh serve` offering the router's) without restating it."""
    source = {f.name: f for f in dataclasses.fields(cls)}[name]
    if source.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=source.default_factory,
                                 metadata=source.metadata)
    return dataclasses.field(default=source.default, metadata=source.metadata)


@dataclass(frozen=True)
class Setting:
    """One setting of a config class: a field of its own or of a config it embeds."""

    name: str  # the field's name
    path: tuple[str, ...]  # the embedded fields leading to it; () for the config's own
    field: dataclasses.Field[Any]
    hint: Any  # its resolved annotation
    default: Any  # dataclasses.MISSING when required

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "PDMESH_" + self.name.upper()


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _embedded(hint: Any) -> type | None:
    """The config class a field embeds, if its type is one."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _fields(cls: type) -> tuple[dict[str, Any], list[dataclasses.Field[Any]], set[str]]:
    """(type hints, the fields that are settings or embed some, the names of the former)."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("cli", True)]
    return hints, fields, {f.name for f in fields if not _embedded(hints[f.name])}


def settings(cls: type) -> dict[str, Setting]:
    """Every setting of `cls` by name, embedded configs' included, in declaration order."""
    return _settings(cls, (), set(), None)


def _settings(cls: type, path: tuple[str, ...], taken: set[str],
              defaults: Any) -> dict[str, Setting]:
    hints, fields, own = _fields(cls)
    own -= taken
    found: dict[str, Setting] = {}
    for f in fields:
        # An embedded config's defaults are those of the instance its field defaults to.
        default = _field_default(f) if defaults is None else getattr(defaults, f.name)
        inner = _embedded(hints[f.name])
        if inner is not None:
            found.update(_settings(inner, (*path, f.name), taken | own | set(found), default))
        elif f.name in own:
            found[f.name] = Setting(f.name, path, f, hints[f.name], default)
    return found


def values_of(config: Any) -> dict[str, Any]:
    """A config's settings by name, embedded configs' included: `settings`' view of it."""
    values = {}
    for name, s in settings(type(config)).items():
        holder = config
        for step in s.path:
            holder = getattr(holder, step)
        values[name] = getattr(holder, name)
    return values


def build_config(cls: type[C], values: Mapping[str, Any]) -> C:
    """`cls` from settings by name (as `settings` names them), the rest at their defaults.
    An embedded config's errors name their flag (`--block-size must be ...`)."""
    unknown = set(values) - set(settings(cls))
    if unknown:
        raise ValueError(f"{cls.__name__} has no setting {', '.join(sorted(unknown))}")
    return _build(cls, values, set(), None)


def _build(cls: type[C], values: Mapping[str, Any], taken: set[str], base: Any) -> C:
    hints, fields, own = _fields(cls)
    own -= taken
    kwargs = {name: values[name] for name in own if name in values}
    for f in fields:
        inner = _embedded(hints[f.name])
        if inner is None:
            continue
        default = _field_default(f) if base is None else getattr(base, f.name)
        try:
            kwargs[f.name] = _build(inner, values, taken | own, default)
        except ValueError as exc:
            raise ValueError(name_flag(str(exc), inner)) from None
    if base is None:
        return cls(**kwargs)
    return dataclasses.replace(base, **kwargs) if kwargs else base


def name_flag(message: str, cls: type) -> str:
    """`block_size must be ...` -> `--block-size must be ...`: an embedded config (also used
    from Python, where its field names are right) names its subject by field, a command-line
    user wants the flag."""
    subject = re.match(r"\w+", message)
    if subject and subject[0] in {f.name for f in dataclasses.fields(cls)}:
        return "--" + subject[0].replace("_", "-") + message[subject.end():]
    return message


def config_argv(config: Any, always: Collection[str] = ()) -> list[str]:
    """The flags that make a process parse `config` again: each setting that differs from its
    class's default, and those named in `always` whatever their value. A setting left at its
    default is left to the process (its own default, or its environment's PDMESH_<FIELD>)."""
    specs = settings(type(config))
    argv: list[str] = []
    for name, value in values_of(config).items():
        s = specs[name]
        if name not in always and s.default is not dataclasses.MISSING and value == s.default:
            continue
        if isinstance(value, bool):
            argv.append(s.flag if value else "--no-" + s.flag[2:])
        elif value is None:
            argv += [s.flag, "none"]
        elif isinstance(value, tuple | list):
            argv += [s.flag, ",".join(map(str, value))]
        else:
            argv += [s.flag, str(value)]
    return argv


def _members(hint: Any) -> tuple[list[Any], bool]:
    """(the scalar types a field annotation allows, optional?)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        members = [m for a in args if a is not type(None) for m in _members(a)[0]]
        return members, type(None) in args
    if origin is typing.Literal:
        return [type(typing.get_args(hint)[0])], False
    return [hint], False


def _convert(name: str, raw: str, hint: Any) -> Any:
    members, optional = _members(hint)
    if optional and raw.strip().lower() in ("", "none"):
        return None
    for tp in members[:-1]:  # int | float | str: the first type that reads it
        try:
            return _convert_one(name, raw, tp)
        except ValueError:
            continue
    return _convert_one(name, raw, members[-1])


def _convert_one(name: str, raw: str, tp: Any) -> Any:
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


def _help_text(s: Setting) -> str:
    """The setting's help, then its default and allowed values (metadata["choices"], or a
    Literal annotation's values), then its env var: `--help` answers "what if I leave it?"."""
    default = "required" if s.default is dataclasses.MISSING else _show(s.default)
    choices = s.field.metadata.get("choices")
    if not choices:
        literal = [a for a in (typing.get_args(s.hint) or (s.hint,))
                   if typing.get_origin(a) is typing.Literal]
        if typing.get_origin(s.hint) is typing.Literal:
            literal = [s.hint]
        choices = typing.get_args(literal[0]) if literal else ()
    parts = [f"default: {default}"]
    if choices:
        parts.append("choices: " + "|".join(map(str, choices)))
    text = s.field.metadata.get("help", "")
    # argparse %-formats help strings; a literal % in a help text must be doubled.
    return f"{text} [{'; '.join(parts)}] (env {s.env})".strip().replace("%", "%%")


class _OneLineErrors(argparse.ArgumentParser):
    """Errors as one line naming the problem (exit code 2), not argparse's usage dump: with
    a hundred flags the usage buried the one line that says what is wrong."""

    def error(self, message: str) -> typing.NoReturn:
        command = re.sub(r"\s*\[.*?\]", "", self.prog)  # "pdmesh serve [MODEL]": the command
        self.exit(2, f"{command}: error: {message}\n")


ForeignFlags = Callable[[Sequence[str], Collection[str]], list[str]]
"""Another server's flags on a command line (serve/vllm_flags.py `vllm_command_line`): given the
argv and the command's own option strings, the argv without the foreign flags it took;
ValueError for one it refuses."""


def parse_config(
    cls: type[C], argv: Sequence[str] | None, *, prog: str, description: str = "",
    env: Mapping[str, str] | None = None, foreign: ForeignFlags | None = None,
) -> C:
    """Build `cls` (a dataclass) from defaults, then PDMESH_<FIELD> env vars, then CLI flags.

    Field `kv_backend` becomes flag `--kv-backend` and env var `PDMESH_KV_BACKEND`, an
    embedded config's fields likewise; the field's `metadata["help"]` is its help text.
    Booleans take `--flag/--no-flag`. Validation is the dataclasses' `__post_init__`; its
    ValueError becomes a one-line error (exit code 2), as does one from `foreign`.
    """
    env = os.environ if env is None else env
    parser = _OneLineErrors(prog=prog, description=description)
    specs = settings(cls)
    own = {"-h", "--help"}
    for s in specs.values():
        names = (s.flag, *s.field.metadata.get("aliases", ()))
        if _members(s.hint)[0] == [bool]:
            action = parser.add_argument(*names, dest=s.name, default=None, help=_help_text(s),
                                         action=argparse.BooleanOptionalAction)
        else:
            action = parser.add_argument(*names, dest=s.name, default=None, help=_help_text(s))
        own.update(action.option_strings)  # --no-<flag> among them
    argv = list(sys.argv[1:] if argv is None else argv)
    if foreign is not None:
        try:
            argv = foreign(argv, own)
        except ValueError as exc:
            parser.error(str(exc))
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    try:
        for name, s in specs.items():
            cli = getattr(args, name)
            if isinstance(cli, bool):
                values[name] = cli
            elif cli is not None:
                values[name] = _convert(s.flag, cli, s.hint)
            elif (env_value := env.get(s.env)) is not None:
                values[name] = _convert(s.env, env_value, s.hint)
        return build_config(cls, values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def json_object_flag(flag: str, value: str | Mapping[str, Any] | None, *,
                     example: str, what: str = "") -> dict[str, Any]:
    """A flag whose value is a JSON object (or, from the offline `LLM`, a mapping) as a dict:
    {} when unset or blank; ValueError naming the flag when it is no JSON object."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag}: not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{flag} must be a JSON object{what}, e.g. '{example}'")
    return dict(value)


def split_address(address: str) -> tuple[str, int]:
    """`host:port` -> (host, port); raises ValueError naming the address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)
