"""Baseline synchronization (§5.2, §10, §11): bring a set up to a snapshot of the Source.

From a Resource Dump when one is advertised (and allowed), else from the Resource List or its index. Each
resource enters through the one pipeline with the baseline's generation number; ``finish_baseline``
then tombstones what the snapshot no longer lists and records the snapshot's ``at`` as the point where
incremental sync starts, both in one transaction. A baseline that fails half-way finishes nothing: the
next attempt starts a new generation, and what was already stored is skipped by hash.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from pathlib import Path

import trio

from ..rs.model import CREATED, RESOURCEDUMP, RESOURCELIST
from ..store.state import Cursor
from .context import HarvestContext
from .discovery import SetInfo
from .dumps import DumpError, DumpLimits, fetch_package
from .fetch import FetchError
from .lists import NotModified, Snapshot, SyncError, Validators, resource_list_entries
from .pipeline import Pipeline, PipelineStats, Work

log = logging.getLogger("rsagg.harvest")


async def _resource_list_items(
    ctx: HarvestContext,
    url: str,
    generation: int,
    snap: Snapshot,
    total: Callable[[int], None],
    validators: Validators | None,
) -> AsyncGenerator[Work, None]:
    # Progress: an index of P parts first counts as P full parts (§10.2: 50,000 entries per list), then
    # as the average part read so far times P; a plain list is counted when it has been read.
    entries = resource_list_entries(
        ctx.fetcher, url, snap, lambda parts: total(parts * 50_000), validators, on_count=total
    )
    async with aclosing(entries):
        async for entry in entries:
            yield Work(entry, CREATED, None, generation)


async def _dump_items(
    ctx: HarvestContext, url: str, generation: int, snap: Snapshot, tmpdir: Path
) -> AsyncGenerator[Work, None]:
    """Packages of a Resource Dump (§11.1), each verified against its manifest (§11.2) by dumps.py."""
    packages = []
    async with ctx.fetcher.document(url) as doc:
        head = doc.head
        assert head is not None
        if head.capability != RESOURCEDUMP:
            raise SyncError(f"{url}: expected a Resource Dump, got capability {head.capability!r}")
        snap.at = head.md.at if head.md else None
        if head.is_index:
            raise SyncError(f"{url}: Resource Dump Index not supported yet; use the Resource List")
        packages = [e async for e in doc.entries]
    limits = DumpLimits(max_package_bytes=ctx.config.harvest.max_resource_bytes)
    for pkg in packages:
        items = fetch_package(ctx.fetcher, pkg, ctx.blobs, tmpdir, limits=limits)
        async with aclosing(items):
            async for item in items:
                yield Work(item.entry, CREATED, None, generation, blob=item.blob, info=item.info)


async def run_baseline(
    ctx: HarvestContext,
    info: SetInfo,
    set_id: int,
    source: str,
    *,
    use_dumps: bool = True,
    progress: Callable[[int], None] | None = None,
    total: Callable[[int], None] | None = None,
    validators: Validators | None = None,
) -> PipelineStats | None:
    """Synchronize one set from a snapshot; returns the pipeline's figures.

    With ``validators`` (a set already baselined and without Change List, re-read on every poll) an
    unchanged Resource List returns None without touching the store.
    """
    caps = info.capabilities
    if RESOURCELIST not in caps and RESOURCEDUMP not in caps:
        raise SyncError(f"{info.capabilitylist_url}: advertises neither a Resource List nor a Resource Dump")
    set_total = total or (lambda n: None)
    if use_dumps and RESOURCEDUMP in caps:
        try:
            return await _baseline_from(ctx, info, set_id, source, "dump", progress, set_total, None)
        except (DumpError, FetchError, SyncError) as exc:
            if RESOURCELIST not in caps:
                raise
            log.warning("source=%s url=%s resource dump unusable, using the resource list: %s",
                        source, caps[RESOURCEDUMP].url, exc)  # fmt: skip
    try:
        return await _baseline_from(ctx, info, set_id, source, "list", progress, set_total, validators)
    except NotModified:
        log.debug("source=%s set=%s resource list not modified", source, info.capabilitylist_url)
        return None


async def _baseline_from(
    ctx: HarvestContext,
    info: SetInfo,
    set_id: int,
    source: str,
    how: str,
    progress: Callable[[int], None] | None,
    total: Callable[[int], None],
    validators: Validators | None,
) -> PipelineStats:
    generation = await ctx.write(ctx.writer.begin_baseline, set_id)
    snap = Snapshot()
    pipeline = Pipeline(ctx, set_id, source, progress=progress)
    if how == "dump":
        with tempfile.TemporaryDirectory(dir=ctx.scratch_dir()) as d:
            url = info.capabilities[RESOURCEDUMP].url
            async with aclosing(_dump_items(ctx, url, generation, snap, Path(d))) as items:
                stats = await pipeline.run(items)
    else:
        url = info.capabilities[RESOURCELIST].url
        async with aclosing(_resource_list_items(ctx, url, generation, snap, total, validators)) as items:
            stats = await pipeline.run(items)
    cursor = Cursor(
        baseline_at=snap.at,
        changelist_url=None,
        last_datetime=snap.at,
        same_datetime_count=0,
        list_index=0,
        list_until=None,
    )
    swept = await ctx.write(
        ctx.writer.finish_baseline, set_id, generation, cursor, pipeline.unlisted_retries()
    )
    pipeline.announce(swept)
    ctx.metrics.committed(source, swept, ())
    for doc_url, (etag, last_modified) in (validators.pending if validators else {}).items():
        await ctx.write(ctx.writer.put_document, doc_url, source, RESOURCELIST, etag=etag,
                        last_modified=last_modified, sha256=None)  # fmt: skip
    for ch in swept:
        stats.applied[ch.change] = stats.applied.get(ch.change, 0) + 1
    await trio.lowlevel.checkpoint()
    log.info(
        "source=%s set=%s baseline from %s done: %d seen, %d fetched, %d unchanged, applied %s, %d failed",
        source, info.capabilitylist_url, how, stats.seen, stats.fetched, stats.unchanged,
        stats.applied, len(stats.failures),
    )  # fmt: skip
    return stats
