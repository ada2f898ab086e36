"""Show each source (state, resources held, lag, last success, progress, last error) and each published
set: the same rows as the home page and ``/status.json`` (``aggregator/status.py``)."""

from __future__ import annotations

import argparse
import json
import sys

from ..status import collect, table, unharvested
from ..store.state import State
from ._common import add_config_arguments, start


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="print the status as JSON")


def run(args: argparse.Namespace) -> int:
    config = start(args)
    if config is None:
        return 2
    db = config.store_path / "state.db"
    if not db.exists():
        status = unharvested(config)
    else:
        with State(db) as state:
            status = collect(state, config)
    if args.json:
        json.dump(status, sys.stdout, indent=2)
        print()
    else:
        print(table(status))
    return 0
