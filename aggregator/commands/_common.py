"""Arguments and start-up shared by the commands that read a configuration."""

from __future__ import annotations

import argparse
import sys

from ..config import Config, ConfigError, load_config
from ..logs import setup_logging


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", required=True, help="configuration file (TOML)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"])


def start(args: argparse.Namespace) -> Config | None:
    """Set up logging and load the config; None (after printing why) when it is broken."""
    setup_logging(args.log_level, args.log_format)
    try:
        return load_config(args.config)
    except ConfigError as exc:
        print(f"rsagg: config error: {exc}", file=sys.stderr)
        return None
