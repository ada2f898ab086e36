"""Harvest every configured source (once, or polling until signalled)."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
from functools import partial
from typing import TYPE_CHECKING, TextIO

from ._common import add_config_arguments, start

if TYPE_CHECKING:  # imported when the command runs, not at start-up (aggregator/cli.py)
    from ..harvest.source import SourceResult


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--once", action="store_true", help="bring every source up to date, then exit")
    p.add_argument(
        "--source", action="append", default=[], metavar="NAME", help="only this source (repeatable)"
    )


async def harvest_once(
    config, names: list[str], *, progress_to: TextIO | None = None, settle: bool = False
) -> list[SourceResult]:
    """Sync the sources once; ``progress_to``: a terminal to draw the baselines' progress line on;
    ``settle``: this is the command's own process, set its garbage collector once started (run/heap.py)."""
    import trio

    from ..harvest.progress import ProgressLine
    from ..harvest.source import sync_source
    from ..run.compose import open_context

    results: list[SourceResult] = []
    async with open_context(config, _selected(config, names)) as ctx:
        if settle:
            from ..run.heap import settle as settle_heap

            settle_heap()
        line = ProgressLine(progress_to or sys.stderr, ctx.progress, width=shutil.get_terminal_size().columns)
        with line.while_shown() if progress_to else contextlib.nullcontext():
            async with trio.open_nursery() as nursery:
                if progress_to:
                    nursery.start_soon(line.run)
                async with trio.open_nursery() as syncs:
                    for src in config.sources:
                        if src.enabled and (not names or src.name in names):

                            async def one(src=src) -> None:
                                results.append(await sync_source(ctx, src))

                            syncs.start_soon(one)
                nursery.cancel_scope.cancel()  # the syncs are done: stop drawing
    return results


def _selected(config, names: list[str]) -> list[str]:
    """The sources a harvest runs: enabled, and named by ``--source`` when it is given (only their
    secrets are needed)."""
    return [s.name for s in config.sources if s.enabled and (not names or s.name in names)]


async def _poll_forever(config, names: list[str]) -> None:
    import trio

    from ..harvest.source import poll_source
    from ..run.compose import open_context
    from ..run.heap import settle

    async with open_context(config, _selected(config, names)) as ctx, trio.open_nursery() as nursery:
        settle()  # the command's own process (run/heap.py)
        for src in config.sources:
            if src.enabled and (not names or src.name in names):
                nursery.start_soon(poll_source, ctx, src)


def run(args: argparse.Namespace) -> int:
    import trio

    from ..config import ConfigError
    from ..harvest.context import prepare_store
    from ..store.lock import store_lock
    from ..store.open import check_writable

    config = start(args)
    if config is None:
        return 2
    if not any(s.enabled and (not args.source or s.name in args.source) for s in config.sources):
        print(
            f"rsagg harvest: {config.file}: sources: every source is disabled (enabled = false)",
            file=sys.stderr,
        )
        return 2
    tty = sys.stderr if sys.stderr.isatty() else None  # a progress line only where someone watches
    try:
        with store_lock(prepare_store(config), "rsagg harvest"):
            check_writable(config)  # a read-only state.db: one line now, not at the first write
            if not args.once:
                trio.run(_poll_forever, config, args.source)
                return 0
            results = trio.run(partial(harvest_once, config, args.source, progress_to=tty, settle=True))
    except ConfigError as exc:  # e.g. a source's secret file or variable is missing
        print(f"rsagg harvest: config error: {exc}", file=sys.stderr)
        return 2
    failed = [r for r in results if not r.ok]
    for r in sorted(results, key=lambda r: r.name):
        if r.store_failure:  # said once, last (below): no counts, the sync did not get to report them
            print(f"{r.name}: FAILED: stopped by the store (the last line says why)")
            continue
        applied: dict[str, int] = {}
        for s in r.stats:
            for k, v in s.applied.items():
                applied[k] = applied.get(k, 0) + v
        seen = sum(s.seen for s in r.stats)
        fetched = sum(s.fetched for s in r.stats)
        verdict = "ok" if r.ok else "DEGRADED" if r.degraded else "FAILED"
        line = f"{r.name}: {verdict}: {r.sets} set(s), {seen} entries, {fetched} fetched"
        line += ", " + (", ".join(f"{v} {k}" for k, v in sorted(applied.items())) or "no changes")
        if r.baselines:
            line += f", {r.baselines} baseline(s)"
        if r.gaps:
            line += f", {r.gaps} gap(s) recovered by baseline"
        for rec in r.reconciled:  # harvest/reconcile.py: what the Change Lists never said
            line += f", reconciled ({rec.cause}): {sum(rec.repaired.values())} repaired"
            line += f", {rec.unrepaired} NOT repaired" if rec.unrepaired else ""
        if r.deviations:
            line += ", tolerated " + ", ".join(f"{d['rule']} x{d['count']}" for d in r.deviations)
        if r.error:
            line += f" — {r.error}"
        print(line)
    if failed:
        print(f"rsagg: failed sources: {', '.join(sorted(r.name for r in failed))}", file=sys.stderr)
    # The store's failure is the machine's, the same for every source: said once, last (errors.py).
    store = next((r.store_failure for r in results if r.store_failure), None)
    if store:
        print(f"rsagg harvest: {store}", file=sys.stderr)
    if failed:
        return 1
    return 0
