"""Compare the store with every upstream's current lists; exit 0 only when in sync.

``--repair`` first applies what the comparison finds (``harvest/reconcile.py``: the reconciliation the
harvest runs on its schedule), then audits again: the exit code is that second audit's.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from ._common import add_config_arguments, start

if TYPE_CHECKING:  # imported when the command runs, not at start-up (aggregator/cli.py)
    from ..harvest.audit import Difference


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument(
        "--source", action="append", default=[], metavar="NAME", help="only this source (repeatable)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object with every difference")
    p.add_argument(
        "--max-lines", type=int, default=1000, help="differences printed per source (all are counted)"
    )
    p.add_argument(
        "--repair",
        action="store_true",
        help="apply the differences found (missed creations, updates, deletions) through the change "
        "pipeline, then audit again",
    )


async def _repair(config, names: list[str], max_lines: int) -> dict[str, str]:
    """Reconcile every set of the chosen sources now; print each difference and what came of it.
    Returns the sources that could not be repaired, with why."""
    import trio

    from ..harvest.reconcile import repair_source
    from ..run.compose import open_context

    errors: dict[str, str] = {}
    chosen = [s.name for s in config.sources if not names or s.name in names]
    async with open_context(config, chosen) as ctx:  # only their secrets are needed
        for src in config.sources:
            if names and src.name not in names:
                continue
            shown = 0

            def told(d: Difference, _name: str = src.name) -> None:
                nonlocal shown
                shown += 1
                if shown <= max_lines:
                    print(f"repairing {d}")

            try:
                results = await repair_source(ctx, src, on_difference=told)
            except trio.Cancelled:
                raise
            except Exception as exc:
                errors[src.name] = f"{type(exc).__name__}: {exc}"
                print(f"{src.name}: repair failed: {errors[src.name]}")
                continue
            for r in results:
                kinds = ", ".join(f"{n} {k}" for k, n in sorted(r.repaired.items())) or "nothing"
                left = f", {r.unrepaired} NOT repaired" if r.unrepaired else ""
                more = "" if r.complete else " (incomplete: a list was not read, nothing held was deleted)"
                print(f"{src.name}: {r.set_url}: {r.differences} difference(s): repaired {kinds}, "
                      f"{r.checked} unchanged once fetched{left}{more}")  # fmt: skip
    return errors


async def _audit(
    config, names: list[str]
) -> tuple[dict[str, list[Difference]], dict[str, int], dict[str, str]]:
    import trio

    from ..harvest.audit import audit_source
    from ..run.compose import open_context

    shown: dict[str, list[Difference]] = {}
    counts: dict[str, int] = {}
    errors: dict[str, str] = {}
    chosen = [s.name for s in config.sources if not names or s.name in names]
    async with open_context(config, chosen) as ctx:  # only their secrets are needed
        for src in config.sources:
            if names and src.name not in names:
                continue
            shown[src.name], counts[src.name] = [], 0
            try:
                async for diff in audit_source(ctx, src):
                    counts[src.name] += 1
                    if len(shown[src.name]) < 100_000:
                        shown[src.name].append(diff)
            except trio.Cancelled:
                raise
            except Exception as exc:
                errors[src.name] = f"{type(exc).__name__}: {exc}"
    return shown, counts, errors


def run(args: argparse.Namespace) -> int:
    import trio

    config = start(args)
    if config is None:
        return 2
    if args.repair:
        failed = trio.run(_repair, config, args.source, args.max_lines)
        if failed:
            print(f"rsagg: repair failed for: {', '.join(sorted(failed))}", file=sys.stderr)
    shown, counts, errors = trio.run(_audit, config, args.source)
    in_sync = not errors and not any(counts.values())
    if args.json:
        out = {
            "in_sync": in_sync,
            "sources": {
                name: {
                    "differences": counts[name],
                    "error": errors.get(name),
                    "items": [d.as_dict() for d in shown[name][: args.max_lines]],
                }
                for name in shown
            },
        }
        print(json.dumps(out, indent=2))
    else:
        for name in shown:
            for d in shown[name][: args.max_lines]:
                print(d)
            if name in errors:
                print(f"{name}: audit failed: {errors[name]}")
            else:
                verdict = "in sync" if not counts[name] else f"{counts[name]} difference(s): NOT IN SYNC"
                print(f"{name}: {verdict}")
    if errors:
        print(f"rsagg: audit failed for: {', '.join(sorted(errors))}", file=sys.stderr)
    return 0 if in_sync else 1
