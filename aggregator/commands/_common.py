"""Arguments and start-up shared by the commands that read a configuration."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by start(), not at start-up (aggregator/cli.py)
    from ..config import Config

LOG_LEVELS = ("debug", "info", "warning", "error")


class OperatorError(Exception):
    """A mistake in how rsagg was started (busy port, store in use): ``rsagg`` prints it, exits 1."""


def add_global_arguments(p: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``-c``, ``--log-level``, ``--log-format``: on the main parser (``top``) and again on each command,
    where they default to "not given" so that a value given before the command name stands."""
    default = None if top else argparse.SUPPRESS
    p.add_argument("-c", "--config", default=default, metavar="FILE", help="configuration file (TOML)")
    p.add_argument("--log-level", default=default, choices=LOG_LEVELS, help="default: info")
    p.add_argument("--log-format", default=default, choices=["text", "json"], help="default: text")


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    add_global_arguments(p)


def start(args: argparse.Namespace, *, sources_needed: bool = True) -> Config | None:
    """Set up logging and load the config; None (after printing why) when it is broken or missing.

    A configuration without ``[[sources]]`` is refused by the commands that work on sources
    (``sources_needed``): doing nothing and exiting 0 would look like success."""
    from ..config import ConfigError
    from ..config_cache import load_config_cached
    from ..observe.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    if not args.config:
        print(f"rsagg {args.command}: -c/--config FILE is required (the configuration file)", file=sys.stderr)
        return None
    try:
        config = load_config_cached(args.config)  # without pydantic when the file was checked before
    except ConfigError as exc:
        print(f"rsagg {args.command}: config error: {exc}", file=sys.stderr)
        return None
    if sources_needed and not config.sources:
        print(
            f"rsagg {args.command}: config error: {config.file}: sources: no [[sources]] configured "
            "(add a [[sources]] table with name and url; see docs/configuration.md)",
            file=sys.stderr,
        )
        return None
    unknown = [n for n in getattr(args, "source", None) or [] if n not in {s.name for s in config.sources}]
    if unknown:  # --source NAME of harvest, audit, retries
        print(
            f"rsagg {args.command}: {config.file}: sources: no source named {', '.join(unknown)}",
            file=sys.stderr,
        )
        return None
    return config
