"""Remove blobs that no resource or changelog record references, once they are older than a grace period.

A harvest (and a dump build) stores a blob before the state rows that name it (docs/architecture.md,
invariant 2), so a blob nothing names yet may be named a moment later. gc therefore removes only
unreferenced blobs last stored more than --grace seconds ago (default 3600: longer than any harvest
batch or dump build takes between storing its blobs and naming them; a blob stored again by a harvest,
deduplicated, counts as stored then). So gc runs beside `rsagg run`, and beside every node of a
cluster, without stopping them. --grace 0 removes every unreferenced blob, as gc did before: it takes
the store's lock, so it is refused while a harvester runs on this host; the lock does not reach other
machines, so in a cluster --grace 0 is safe only with every node stopped.

``[publish] versions`` (store/retention.py, docs/versions.md) decides which prior versions count as
referenced: the current version of every resource always does, and so does every changelog record not
yet in a Change Dump package while dumps are built (``dump_interval`` > 0).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._common import add_config_arguments, start

if TYPE_CHECKING:  # imported when the command runs, not at start-up (aggregator/cli.py)
    from ..config import Config
    from ..store.blobs import BlobStore
    from ..store.interface import StateStore
    from ..store.retention import Retention

log = logging.getLogger(__name__)

#: Default grace period (seconds): far longer than a batch (or a dump build) takes from storing its
#: blobs to committing the state rows that name them, which is seconds to minutes.
GRACE_SECONDS = 3600.0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, not {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    p.add_argument(
        "--grace",
        type=_seconds,
        default=GRACE_SECONDS,
        metavar="SECONDS",
        help=(
            f"remove only unreferenced blobs last stored more than SECONDS ago (default {GRACE_SECONDS:g}: "
            "longer than any harvest batch or dump build takes between storing blobs and naming them, so "
            "gc is safe beside running harvesters); 0 removes them all, and is refused while a harvester "
            "runs on this host (unsafe in a cluster unless every node is stopped)"
        ),
    )


@dataclass(frozen=True)
class Garbage:
    """What a gc did: blobs removed and their bytes, and unreferenced blobs kept as too recent."""

    removed: int = 0
    freed: int = 0
    kept_recent: int = 0


def collect_garbage(
    state: StateStore,
    blobs: BlobStore,
    *,
    grace: float,
    dry_run: bool = False,
    now: float | None = None,
    retention: Retention | None = None,
) -> Garbage:
    """Delete blobs that no resource, changelog record or published dump names and that were last stored
    more than ``grace`` seconds before ``now`` (default: the clock).

    ``grace`` 0 deletes every unreferenced blob: only while no harvest writes (a harvest commits blobs
    before the state rows that name them, invariant 2, so a concurrent gc could remove a blob in that
    window). With a grace period each delete is conditional (``BlobStore.delete(stored_before=)``): a
    blob a harvest stores again while gc runs stays, and counts as kept.

    ``retention``: the prior versions to keep (``retention_for``); None keeps every version.
    """
    # The cutoff is taken before the references are read (their snapshot is taken at the first next()):
    # a blob older than it that a harvest names after the snapshot was stored more than ``grace`` before.
    from ..publish import dumps

    cutoff = None if grace <= 0 else (time.time() if now is None else now) - grace
    removed = freed = kept = 0
    # Both streams come sorted ascending: a merge needs neither a set in memory nor a sha256 index.
    refs = heapq.merge(state.referenced_hashes(retention), dumps.referenced_hashes(state))
    ref = next(refs, None)
    for sha, stored_at in blobs.iter_stored():
        while ref is not None and ref < sha:
            ref = next(refs, None)
        if sha == ref:
            continue
        if cutoff is not None and stored_at >= cutoff:
            kept += 1
            continue
        try:
            size = blobs.size(sha)
        except FileNotFoundError:  # removed meanwhile (another gc)
            continue
        if dry_run or blobs.delete(sha, stored_before=cutoff):
            removed += 1
            freed += size
        else:
            kept += 1  # stored again since it was listed (or removed by another gc)
    return Garbage(removed, freed, kept)


def retention_for(config: Config, state: StateStore) -> Retention:
    """``[publish] versions``, with the seq after which every record is kept: the lowest, over the
    published sets, of the last seq their Change Dump packages hold (0: a set without any yet), while
    dumps are built; the changelog records after it still go into packages to come."""
    from ..store.retention import parse_retention
    from ..store.sets import published_sets

    retention = parse_retention(config.publish.versions)
    if retention.keeps_all or config.publish.dump_interval <= 0:
        return retention
    done = state.change_dump_seqs()
    names = published_sets(config, state.sets())
    return retention.with_floor(min((done.get(name, 0) for name in names), default=0))


def run(args: argparse.Namespace) -> int:
    from ..harvest.context import prepare_store
    from ..run.parts import blob_store, load_plugins, state_handle
    from ..store.lock import store_lock

    config = start(args, sources_needed=False)  # a store outlives its sources: gc works without any
    if config is None:
        return 2
    root = prepare_store(config)
    grace: float = args.grace
    with contextlib.ExitStack() as stack:
        if grace == 0:
            # Every unreferenced blob, however new: never beside a harvest (see collect_garbage).
            stack.enter_context(store_lock(root, "rsagg gc --grace 0"))
            if config.cluster.enabled:
                log.warning(
                    "gc --grace 0 with [cluster] enabled: the store lock covers this host only; "
                    "a node running on another machine may lose blobs it is about to name"
                )
        # With a grace period no lock: harvesters keep running, and two gcs at once are harmless (each
        # delete is conditional, and deleting a blob already gone is not an error).
        blobs = blob_store(config, load_plugins(config))
        state = state_handle(config)
        try:
            retention = retention_for(config, state)
            result = collect_garbage(state, blobs, grace=grace, dry_run=args.dry_run, retention=retention)
        finally:
            state.close()
    verb = "would remove" if args.dry_run else "removed"
    kept = f"; kept {result.kept_recent} unreferenced blob(s) stored less than {grace:g} s ago"
    print(f"{verb} {result.removed} unreferenced blob(s), {result.freed} bytes{kept if grace else ''}")
    if not retention.keeps_all:
        print(f"prior versions kept: {retention.describe()} ([publish] versions)")
    return 0
