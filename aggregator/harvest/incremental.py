"""Incremental synchronization from Change Lists (§12.1/§12.2) and Change Dumps (§13).

Each change after the stored cursor enters the one pipeline together with the cursor that marks it
applied, so the position moves in the same transaction as the change (docs/architecture.md invariant 2).

Change Dumps are used to catch up when they are cheaper: one ZIP per closed interval instead of one GET
per change. The rule: when the first closed package still needed covers at least half of its interval
after our position (so most of its bitstreams are wanted), every closed package from there on is read
from the dump; the rest (the open interval) comes from the Change Lists, from the same position. Entries
already applied are skipped the same way in both.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path

from ..rs.model import CHANGEDUMP, CHANGELIST, CHANGES
from ..store.state import Cursor
from .context import HarvestContext
from .discovery import SetInfo
from .dumps import DumpError, DumpLimits, fetch_package
from .fetch import FetchError
from .lists import ListRef, Position, SyncError, Validators, change_entries, when
from .pipeline import Pipeline, PipelineStats, Work

log = logging.getLogger("rsagg.harvest")


async def run_incremental(
    ctx: HarvestContext, info: SetInfo, set_id: int, source: str, cursor: Cursor, *, use_dumps: bool = True
) -> PipelineStats:
    """Apply every change after ``cursor``; raises lists.GapError when the stream cannot continue."""
    url = info.capabilities[CHANGELIST].url
    validators = Validators(ctx.reader.document)

    async def items() -> AsyncGenerator[Work, None]:
        last = cursor
        if use_dumps and CHANGEDUMP in info.capabilities:
            with tempfile.TemporaryDirectory(dir=ctx.scratch_dir()) as tmp:
                dumped = _from_change_dump(ctx, info.capabilities[CHANGEDUMP].url, cursor, source, Path(tmp))
                try:
                    async with aclosing(dumped):
                        async for work in dumped:
                            last = work.cursor_after or last
                            yield work
                except (DumpError, FetchError, SyncError) as exc:
                    log.warning("source=%s change dump unusable, continuing from the Change Lists: %s",
                                source, exc)  # fmt: skip
        changes = change_entries(ctx.fetcher, url, last, source, validators)
        async with aclosing(changes):
            async for entry, after in changes:
                yield Work(entry, entry.change or "", after)

    stats = await Pipeline(ctx, set_id, source).run(items())
    # Every change read is committed now: only from here may a 304 stand for them.
    for doc_url, (etag, last_modified) in validators.pending.items():
        await ctx.write(ctx.writer.put_document, doc_url, source, CHANGELIST, etag=etag,
                        last_modified=last_modified, sha256=None)  # fmt: skip
    if stats.seen or stats.failures:
        log.info(
            "source=%s set=%s incremental: %d changes, %d fetched, applied %s, %d failed",
            source, info.capabilitylist_url, stats.seen, stats.fetched, stats.applied, len(stats.failures),
        )  # fmt: skip
    return stats


async def _from_change_dump(
    ctx: HarvestContext, url: str, cursor: Cursor, source: str, folder: Path
) -> AsyncGenerator[Work, None]:
    """Changes after ``cursor`` from the closed packages of a Change Dump, when that is cheaper."""
    async with ctx.fetcher.document(url) as doc:
        head = doc.head
        if head is None or head.capability != CHANGEDUMP or head.is_index:
            return  # a Change Dump Index is not read (yet): the Change Lists carry the same changes
        packages = [e async for e in doc.entries]
    pos = Position(cursor)
    start = pos.datetime
    closed = [
        (ListRef(e.loc, e.md.from_, e.md.until), e)
        for e in packages
        if e.md is not None and e.md.from_ is not None and e.md.until is not None
        and (start is None or e.md.until >= start)
    ]  # fmt: skip
    closed.sort(key=lambda pair: pair[0].from_)
    if not closed:
        return
    first = closed[0][0]
    if start is not None and first.from_ > start:
        return  # a gap: the Change Lists detect and report it
    if (
        start is not None
        and first.until > first.from_
        and (first.until - start) < (first.until - first.from_) / 2
    ):
        return  # most of the first package was applied already: cheaper per change
    limits = DumpLimits(max_package_bytes=ctx.config.harvest.max_resource_bytes)
    for ref, pkg in closed:
        index = 0
        items = fetch_package(ctx.fetcher, pkg, ctx.blobs, folder, limits=limits)
        async with aclosing(items):
            async for item in items:
                index += 1
                t = when(item.entry)
                if pos.is_applied(t, ref.url, index) or item.entry.change not in CHANGES:
                    if item.blob is not None:
                        item.blob.abort()
                    continue
                yield Work(
                    item.entry, item.entry.change, pos.advance(t, ref, index), blob=item.blob, info=item.info
                )
        log.info("source=%s read change dump package %s (%d entries)", source, pkg.loc, index)
