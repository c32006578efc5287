"""`dpscale check equivalence|unused`: the checks' flags (their configs' fields) and what they print."""

from __future__ import annotations

import argparse
import json

from dpscale.flags import add_dataclass_arguments, dataclass_kwargs
from dpscale.lab.check import equivalence, unused


def _add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON on the last line")


def add_equivalence_arguments(p: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(p, equivalence.EquivalenceCheckConfig)
    _add_json_flag(p)


def run_equivalence(args: argparse.Namespace) -> int:
    """Exit 0 when the three ways agree, 1 when they do not."""
    c = equivalence.EquivalenceCheckConfig(**dataclass_kwargs(args, equivalence.EquivalenceCheckConfig))
    r = equivalence.run(c.model, c.world_size, c.accumulation_steps, c.global_batch, c.steps)
    print(equivalence.format_result(r))
    if args.json:
        print(json.dumps(r.to_dict()))
    return 0 if r.ok else 1


def add_unused_arguments(p: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(p, unused.UnusedCheckConfig)
    _add_json_flag(p)


def run_unused(args: argparse.Namespace) -> int:
    c = unused.UnusedCheckConfig(**dataclass_kwargs(args, unused.UnusedCheckConfig))
    r = unused.run(c.model, c.steps, c.batch)
    print(unused.format_result(r))
    if args.json:
        print(json.dumps(r.to_dict()))
    return 0


def register(sub) -> None:
    p = sub.add_parser("check", help="checks: data-parallel equivalence of your loss, unused parameters")
    csub = p.add_subparsers(dest="check", required=True, metavar="{equivalence,unused}")
    for name, module, add_arguments, run in (
        ("equivalence", equivalence, add_equivalence_arguments, run_equivalence),
        ("unused", unused, add_unused_arguments, run_unused),
    ):
        text = (module.__doc__ or name).splitlines()[0]
        c = csub.add_parser(name, help=text, description=text)
        add_arguments(c)
        c.set_defaults(func=run)
