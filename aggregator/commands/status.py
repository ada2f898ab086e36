"""Show each source (state, resources, lag, last success, progress, last error) and each published set.

The same rows as the home page and ``/status.json`` (``aggregator/observe/report.py``). An error is cut to one
line; ``--json`` has the whole text. Lag: for a set followed through its Change List, the time since the
last change applied; for a set read from its Resource List alone, the time since the last successful read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from ._common import add_config_arguments, start


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="print the status as JSON")


def run(args: argparse.Namespace) -> int:
    from ..observe.report import collect, table, unharvested
    from ..run.parts import check_store, state_exists, state_handle
    from ..store.lock import harvester_running

    config = start(args)
    if config is None:
        return 2
    check_store(config)  # a store path that cannot work is an error
    if not state_exists(config):  # a SQLite state not made yet (a server's is always there)
        status = unharvested(config)
    else:
        with contextlib.closing(state_handle(config)) as state:
            status = collect(state, config, running=harvester_running(config.store_path))
    if args.json:
        json.dump(status, sys.stdout, indent=2)
        print()
    else:
        print(table(status))
    return 0
