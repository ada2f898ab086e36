"""Run the daemon: harvest every source on its interval and serve the republished Source.

SIGHUP re-reads the configuration file (sources added, removed, changed); SIGTERM/SIGINT stop cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from ._common import add_config_arguments, start


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--no-harvest", action="store_true", help="serve only (no polling of the upstreams)")


def run(args: argparse.Namespace) -> int:
    # Imported here, not at start-up (aggregator/cli.py).
    import trio

    from ..config import ConfigError
    from ..harvest.context import prepare_store
    from ..run.daemon import ListenError, run_daemon
    from ..store.lock import store_lock
    from ..store.open import check_writable

    config = start(args)
    if config is None:
        return 2
    root = prepare_store(config)
    # Serving alone may run beside a harvesting process (e.g. ``harvest --once`` from a timer).
    # The nodes of a cluster share the store (cluster.py); a plain harvester has it to itself.
    shared = config.cluster.enabled
    lock = contextlib.nullcontext() if args.no_harvest else store_lock(root, "rsagg run", shared=shared)
    try:
        with lock:
            # Serving alone only reads: a read-only state.db serves (docs/troubleshooting.md).
            if not args.no_harvest:
                check_writable(config)
            trio.run(
                lambda: run_daemon(
                    config, config_path=args.config, harvest=not args.no_harvest, on_ready=_settle
                )
            )
    except ListenError as exc:
        print(f"rsagg run: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # e.g. a source's secret file or variable is missing
        print(f"rsagg: config error: {exc}", file=sys.stderr)
        return 2
    return 0


async def _settle(parts: object, url: str) -> None:
    """The daemon serves: set this process's garbage collector once (run/heap.py)."""
    from ..run.heap import settle

    settle()
