"""The ``rsagg`` command line: one sub-command per module in ``aggregator/commands/``.

The options every command shares (``-c/--config``, ``--log-level``, ``--log-format``) are accepted both
before and after the command name (``rsagg --log-level debug status -c rsagg.toml``). A mistake an
operator can make (configuration, store path, busy port, store lock) ends with one line naming the
configuration key or URL and exit status 2 (configuration) or 1 (environment), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .commands._common import LOG_LEVELS, OperatorError, add_global_arguments

# Start-up: this module, ``commands/_common.py`` and each command module import at their top only what
# building the parser needs (argparse and the standard library); what a command uses is imported when
# it runs, so one-shot commands (``status``, ``validate``, ``--version``, ``--help``) do not pay for the
# HTTP client, the server, trio or pydantic they do not use. tests/test_startup.py holds them to it.

#: Sub-command -> module in aggregator.commands with ``add_arguments(parser)`` and ``run(args) -> int``.
COMMANDS = {
    "validate": "validate",
    "harvest": "harvest",
    "audit": "audit",
    "status": "status",
    "retries": "retries",
    "gc": "gc",
    "run": "run",
    "demo": "demo",
    "plugins": "plugins",
}


def summary(doc: str | None) -> str:
    """The first paragraph of a module docstring as one line (``--help`` lists it whole)."""
    first = (doc or "").strip().split("\n\n")[0]
    return " ".join(first.split())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rsagg",
        description="ResourceSync aggregator. The options below may also follow the command name.",
        epilog="Commands that read a configuration need -c FILE; see 'rsagg COMMAND --help'.",
    )
    parser.add_argument("--version", action=_Version, help="show the version and the document parser, exit")
    add_global_arguments(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"aggregator.commands.{module_name}")
        p = sub.add_parser(
            name,
            help=summary(module.__doc__),
            description=(module.__doc__ or "").strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _default_log_level=getattr(module, "DEFAULT_LOG_LEVEL", "info"))
    return parser


class _Version(argparse.Action):
    """``--version``: names the document parser too, which is looked up only when asked (it imports lxml)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        from .rs.parse import SPEEDUPS

        fast = "compiled fast path" if SPEEDUPS else "pure Python"
        print(f"rsagg {__version__} (document parser: {fast})")  # on stdout, as argparse's "version" does
        parser.exit()


def _expected(exc: BaseException) -> BaseException | None:
    """The operator's mistake an exception (or a group, from trio's nurseries) is about, else None: a
    mistake rsagg names itself, else the machine's failure (disk full, read-only or vanished store, the
    state's database away: errors.environmental_leaf), which ``errors.operator_line`` says in one line."""
    found = _named(exc)
    from .errors import environmental_leaf

    return found if found is not None else environmental_leaf(exc)


def _named(exc: BaseException) -> BaseException | None:
    # Imported here, on the way out with an error, not at start-up (see the note at the top).
    from .config import ConfigError
    from .run.daemon import ListenError
    from .store.interface import StateUnavailable
    from .store.lock import StoreLocked

    if isinstance(exc, ConfigError | OperatorError | StoreLocked | ListenError | StateUnavailable):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _named(inner)
            if found is not None:
                return found
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.log_level is None:
        args.log_level = args._default_log_level
    if args.log_format is None:
        args.log_format = "text"
    assert args.log_level in LOG_LEVELS
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except BaseException as exc:
        found = _expected(exc)
        if found is None:
            raise
        from .config import ConfigError
        from .errors import is_environmental, operator_line

        if isinstance(found, ConfigError):
            print(f"rsagg {args.command}: config error: {found}", file=sys.stderr)
            return 2
        text = operator_line(found) if is_environmental(found) else " ".join(str(found).split())
        print(f"rsagg {args.command}: {text}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
