"""Command-line flags generated from a config dataclass, so each flag maps to exactly one field.

The help text of each flag is the docstring under its field in the dataclass source. A field may
say more through `flag_spec(...)` metadata: another flag name (`--sizes` for `sizes_bytes`), a parser
from the flag's text (comma-separated lists, sizes like 16M), or help text of its own. A parser's
ValueError names the flag, so bad input reaches the user as one line, like the config's own checks.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import math
import sys
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

_KEY = "dpscale.flag"
_Config = TypeVar("_Config")


def flag_spec(
    *,
    name: str | None = None,
    aliases: tuple[str, ...] = (),
    parse: Callable[[str], object] | None = None,
    help: str | None = None,
    group: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    deprecated: tuple[str, ...] = (),
) -> dict:
    """Field metadata for `add_dataclass_arguments`: `field(default=..., metadata=flag_spec(parse=...))`.

    `group` is the title of the argument group the flag is listed under in --help; `metavar` the
    value's name there (default: the field's name in capitals); `choices` the only values argparse
    accepts (--help lists them; the config's own check still guards the API); `deprecated` old
    spellings of the flag, still accepted, each use said once on stderr."""
    spec = {"name": name, "aliases": aliases, "parse": parse, "help": help, "deprecated": deprecated}
    return {_KEY: {**spec, "group": group, "metavar": metavar, "choices": choices}}


class _StoreFlag(argparse.Action):
    """argparse's plain store, saying once per command line on stderr that an old spelling
    (`deprecated`) was used, naming the one to use."""

    def __init__(self, *args, deprecated: tuple[str, ...] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.deprecated = deprecated

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string in self.deprecated:
            said = namespace.__dict__.setdefault("_deprecated_said", set())
            if option_string not in said:
                said.add(option_string)
                new = self.option_strings[0]
                print(f"{parser.prog}: {option_string} is deprecated; use {new}", file=sys.stderr, flush=True)
        setattr(namespace, self.dest, values)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring, also those of fields inherited from dataclass bases."""
    return dict(_field_docs(cls))


# Cached: reading a class's source costs ~10 ms, and every parse of the command line (main() in
# process, as the tests and an embedding program call it) builds every command's parser again.
@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs |= _field_docs(base)
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    assert isinstance(tree.body[0], ast.ClassDef)
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def flag_fields(cls: type) -> list[tuple[str, dataclasses.Field, type]]:
    """(name, field, the dataclass declaring it) for each flag of `cls`, in --help's order.

    A config made of sections (TrainConfig) lists its sections' fields itself, flat, through a
    `flat_fields()` classmethod; the name is then the flag's in snake case (`checkpoint_dir` for
    `CheckpointConfig.dir`), which is also the argparse dest and the TOML key. Any other dataclass:
    its own fields under their own names."""
    flat = getattr(cls, "flat_fields", None)
    if flat is not None:
        return flat()
    return [(f.name, f, cls) for f in dataclasses.fields(cls)]


def _base_type(annotation) -> type:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0]
    return annotation


def finite_float(text: str) -> float:
    """argparse type for a float flag: nan and inf are refused while parsing (exit 2)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def flag_name(f: dataclasses.Field) -> str:
    return (f.metadata.get(_KEY) or {}).get("name") or "--" + f.name.replace("_", "-")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if value in (None, False):
        return ""
    if isinstance(value, list | tuple):
        value = ",".join(map(str, value))
    return f" (default: {value})"


def add_dataclass_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    skip: tuple[str, ...] = (),
    aliases: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """Add a flag for each field; unset flags stay None so the dataclass default applies.

    A field without a default is a required flag (argparse refuses the command without it); a
    field with `flag_spec(group=...)` is listed under that argument group. `aliases` gives a
    field more spellings in this command only (`dpscale run` takes torchrun's)."""
    docs: dict[type, dict[str, str]] = {}
    hints: dict[type, dict[str, Any]] = {}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, f, owner in flag_fields(cls):
        if key in skip:
            continue
        if owner not in docs:
            docs[owner], hints[owner] = field_docs(owner), typing.get_type_hints(owner)
        meta = f.metadata.get(_KEY) or {}
        title = meta.get("group")
        if title and title not in groups:
            groups[title] = parser.add_argument_group(title)
        add = groups[title].add_argument if title else parser.add_argument
        kind = _base_type(hints[owner][f.name])
        help_text = meta.get("help") or docs[owner].get(f.name, "")
        if "default" not in help_text:  # a text that names its default knows it better than the field
            help_text += _default_text(f)
        help_text = help_text.replace("%", "%%")  # argparse %-formats help
        deprecated = meta.get("deprecated", ())
        names = (flag_name(f), *meta.get("aliases", ()), *(aliases or {}).get(key, ()), *deprecated)
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if kind is bool:
            action = add(*names, dest=key, action="store_true", default=None, help=help_text)
        else:
            action = add(
                *names,
                action=_StoreFlag,
                deprecated=deprecated,
                dest=key,
                type=str if meta.get("parse") else kind,  # float flags: the CLI refuses nan/inf (cli/main.py)
                default=None,
                metavar=meta.get("metavar") or (None if meta.get("choices") else key.upper()),
                choices=meta.get("choices"),
                required=required,
                help=help_text,
            )
        # which field the flag sets: tests/test_flags.py finds hand-written flags by its absence
        action.config_field = f"{owner.__name__}.{f.name}"  # type: ignore[attr-defined]


def dataclass_kwargs(args: argparse.Namespace, cls: type) -> dict:
    """The fields whose flags were given, each through its parser when it has one."""
    kwargs = {}
    for key, f, _ in flag_fields(cls):
        value = getattr(args, key, None)
        if value is None:
            continue
        parse = (f.metadata.get(_KEY) or {}).get("parse")
        kwargs[key] = parse(value) if parse else value
    return kwargs


def config_kwargs(args: argparse.Namespace, cls: type) -> dict:
    """The config's fields from --config FILE.toml (when the command has that flag), then from the
    flags given (a flag wins)."""
    path = getattr(args, "config", None)
    return (config_file_kwargs(path, cls) if path else {}) | dataclass_kwargs(args, cls)


def config_argv(config: object, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that rebuild `config` (the inverse of `dataclass_kwargs`), for a report's command line.

    Every field that has a value is written, defaults included, so the command means the same
    run after a default changes; None and False fields are left out (their flag unset). Lists are
    written comma-separated, as the list flags parse them. A field missing from `config` (a config
    rebuilt by hand without `unchecked_config`) counts as its default.
    """
    argv: list[str] = []
    for f in dataclasses.fields(config):  # type: ignore[arg-type]  # any config dataclass
        if f.name in skip:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        value = getattr(config, f.name, default)
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag_name(f))
        elif isinstance(value, list | tuple):
            argv += [flag_name(f), ",".join(map(str, value))]
        else:
            argv += [flag_name(f), str(value)]
    return argv


def unchecked_config(cls: type[_Config], values: dict) -> _Config:
    """The config a report recorded (`asdict` of it), rebuilt without running its checks: an old
    report need not fit today's rules (its data set rebuilt, its user model importable, its
    transport registered). Fields it lacks take their defaults; a list becomes a tuple where the
    field's default is one, as `config_file_kwargs` reads them."""
    config: Any = object.__new__(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # any config dataclass
        if f.default is not dataclasses.MISSING:
            config.__dict__[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            config.__dict__[f.name] = f.default_factory()
        if f.name in values:
            value = values[f.name]
            if isinstance(value, list) and isinstance(config.__dict__.get(f.name), tuple):
                value = tuple(value)
            config.__dict__[f.name] = value
    return config


def config_file_kwargs(path: str, cls: type, *, flag: str = "--config") -> dict:
    """The fields of `cls` a TOML file sets, as `dataclass_kwargs` gives a command line's.

    Keys are the fields' flag names without the dashes (`world-sizes`) or the field names
    (`world_sizes`). A string goes through the field's parser as the flag's text would
    ("1,2", "16M"); other TOML values (numbers, booleans, arrays) are taken as they are, an array
    as a tuple where the field's default is one. A key that is no field: ConfigError naming it.
    """
    import tomllib

    from dpscale.errors import ConfigError

    try:
        with open(path, "rb") as file:
            raw = tomllib.load(file)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{flag}: {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{flag}: {path} is not a TOML file (not UTF-8 text)") from None
    by_key: dict[str, tuple[str, dataclasses.Field, type]] = {}
    for name, f, owner in flag_fields(cls):
        by_key[name] = by_key[flag_name(f).removeprefix("--")] = (name, f, owner)
    out = {}
    for key, value in raw.items():
        name, found, owner = by_key.get(key) or by_key.get(key.replace("-", "_")) or ("", None, cls)
        if found is None:
            # in --help's order: ungrouped fields first (inherited ones may be grouped)
            listed = sorted(
                (f for _, f, _ in flag_fields(cls)),
                key=lambda f: bool((f.metadata.get(_KEY) or {}).get("group")),
            )
            known = ", ".join(flag_name(f).removeprefix("--") for f in listed)
            raise ConfigError(f"{flag}: {path} sets {key!r}, which is not one of its keys: {known}")
        out[name] = _file_value(
            found, _base_type(typing.get_type_hints(owner)[found.name]), value, f"{flag}: {path} sets {key!r}"
        )
    return out


def _file_value(f: dataclasses.Field, kind: type, value: Any, where: str) -> Any:
    """A TOML value for field `f`: a string through the flag's parser (or its type, as the flag's
    text would be), other values checked against the field's type; ConfigError naming the key."""
    from dpscale.errors import ConfigError

    parse = (f.metadata.get(_KEY) or {}).get("parse")
    try:
        if isinstance(value, str) and parse:
            return parse(value)
        if isinstance(value, str) and kind in (int, float):
            return kind(value)
    except ConfigError:
        raise
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        raise ConfigError(f"{where} to {value!r}: {e}") from None
    if isinstance(value, list) and isinstance(f.default, tuple):
        return tuple(value)
    expected = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(kind)
    if expected and (not isinstance(value, expected) or (kind is not bool and isinstance(value, bool))):
        raise ConfigError(f"{where} to {value!r}, a {type(value).__name__}; it takes a {kind.__name__}")
    return value
