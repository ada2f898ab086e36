"""Run the daemon: harvest every source on its interval and serve the republished Source."""

from __future__ import annotations

import argparse

import trio

from ..daemon import run_daemon
from ._common import add_config_arguments, start


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--no-harvest", action="store_true", help="serve only (no polling of the upstreams)")


def run(args: argparse.Namespace) -> int:
    config = start(args)
    if config is None:
        return 2
    trio.run(lambda: run_daemon(config, harvest=not args.no_harvest))
    return 0
