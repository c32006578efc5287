"""Command-line flags generated from a config dataclass, so each flag maps to exactly one field.

The help text of each flag is the docstring under its field in the dataclass source.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import textwrap
import types
import typing


def field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = str(nxt.value.value)
    return docs


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


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add `--field-name` for each field; unset flags stay None so the dataclass default applies."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = docs.get(f.name, "") + (f" (default: {default})" if default not in (None, False) else "")
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action="store_true", default=None, help=help_text)
        else:
            parser.add_argument(
                flag,
                dest=f.name,
                type=finite_float if kind is float else kind,
                default=None,
                metavar=f.name.upper(),
                help=help_text,
            )


def dataclass_kwargs(args: argparse.Namespace, cls: type) -> dict:
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if getattr(args, f.name, None) is not None
    }
