"""The ``rsagg`` command line: one sub-command per module in ``aggregator/commands/``."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

#: Sub-command -> module in aggregator.commands with ``add_arguments(parser)`` and ``run(args) -> int``.
COMMANDS = {
    "validate": "validate",
    "harvest": "harvest",
    "audit": "audit",
    "status": "status",
    "gc": "gc",
    "run": "run",
    "demo": "demo",
    "plugins": "plugins",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rsagg", description="ResourceSync aggregator")
    from .rs.parse import SPEEDUPS

    version = f"rsagg {__version__} (document parser: {'compiled fast path' if SPEEDUPS else 'pure Python'})"
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"aggregator.commands.{module_name}")
        p = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
