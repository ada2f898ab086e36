"""List the changes whose fetch failed and that wait to be tried again, or that ended; --clear forgets them.

A failed change is retried at the start of its set's next sync until a change of the same URI applies.
A retry ends by itself when the upstream no longer lists its URI: it then stays listed here as "ended"
(and counted by ``rsagg status``) until cleared. ``--clear`` gives up on the retries shown (all, those of
``--source``, or only the ended ones with ``--ended``); the next change of such a URI is applied as usual.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from ._common import add_config_arguments, start


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument(
        "--source", action="append", default=[], metavar="NAME", help="only this source (repeatable)"
    )
    p.add_argument("--ended", action="store_true", help="only the retries that ended")
    p.add_argument("--clear", action="store_true", help="forget the retries shown")
    p.add_argument("--json", action="store_true", help="print them as JSON")


def run(args: argparse.Namespace) -> int:
    from ..observe.report import one_line
    from ..run.parts import check_store, state_exists, state_handle

    config = start(args)
    if config is None:
        return 2
    check_store(config)  # a store path that cannot work is an error
    if not state_exists(config):  # a SQLite state not made yet (a server's is always there)
        rows: list[dict] = []
        cleared = 0
    else:
        with contextlib.closing(state_handle(config)) as state:
            rows = [r for r in state.retry_rows(args.source) if not args.ended or r["state"] == "ended"]
            cleared = state.clear_retries(args.source, ended_only=args.ended) if args.clear else 0
    if args.json:
        json.dump({"retries": rows, "cleared": cleared}, sys.stdout, indent=2)
        print()
        return 0
    for r in rows:
        why = r["message"] if r["state"] == "ended" else f"{r['kind']}: {r['message']}"
        print(
            f"{r['source']}: {r['state']}: {r['change']} {r['uri']}: {r['attempts']} attempt(s) since "
            f"{r['first_at']}: {one_line(why)}"
        )
    waiting = sum(r["state"] == "waiting" for r in rows)
    print(f"{waiting} waiting, {len(rows) - waiting} ended" + (f"; {cleared} cleared" if args.clear else ""))
    return 0
