"""Remove blobs that no resource or changelog record references."""

from __future__ import annotations

import argparse
import heapq

from ..harvest.context import open_blob_store, prepare_store
from ..plugins import Plugins
from ..publish import dumps
from ..store.blobs import BlobStore
from ..store.lock import store_lock
from ..store.state import State, open_state
from ._common import add_config_arguments, start


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="count, delete nothing")


def collect_garbage(state: State, blobs: BlobStore, *, dry_run: bool = False) -> tuple[int, int]:
    """Delete blobs that no resource, changelog record or published dump names; returns (blobs removed,
    bytes freed).

    Run it while no harvest is writing: a harvest commits blobs before the state rows that name them
    (invariant 2), so a concurrent gc could remove a blob in that window.
    """
    removed = freed = 0
    # Both streams come sorted ascending: a merge needs neither a set in memory nor a sha256 index.
    refs = heapq.merge(state.referenced_hashes(), dumps.referenced_hashes(state))
    ref = next(refs, None)
    for sha in blobs.iter_hashes():
        while ref is not None and ref < sha:
            ref = next(refs, None)
        if sha != ref:
            freed += blobs.size(sha)
            removed += 1
            if not dry_run:
                blobs.delete(sha)
    return removed, freed


def run(args: argparse.Namespace) -> int:
    config = start(args, sources_needed=False)  # a store outlives its sources: gc works without any
    if config is None:
        return 2
    root = prepare_store(config)
    with store_lock(root, "rsagg gc"):  # never beside a harvest (see collect_garbage)
        blobs = open_blob_store(config, Plugins.from_config(config))
        state = open_state(config)
        try:
            removed, freed = collect_garbage(state, blobs, dry_run=args.dry_run)
        finally:
            state.close()
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {removed} unreferenced blob(s), {freed} bytes")
    return 0
