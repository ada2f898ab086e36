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
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import cast

from ..rs.model import CHANGEDUMP, CHANGELIST, CHANGELIST_ARCHIVE, CHANGES
from ..store.rows import Cursor
from .access import for_source
from .context import HarvestContext
from .deviations import skip
from .discovery import SetInfo
from .dumps import DumpError, DumpLimits, fetch_package
from .fetch import FetchError
from .lists import (
    GapError,
    ListRef,
    Position,
    SyncError,
    Validators,
    change_entries,
    open_list,
    resolve,
    resolved,
    when,
)
from .pipeline import Pipeline, PipelineStats, Work

log = logging.getLogger("rsagg.harvest")


@for_source
async def run_incremental(
    ctx: HarvestContext, info: SetInfo, set_id: int, source: str, cursor: Cursor, *, use_dumps: bool = True
) -> PipelineStats:
    """Apply every change after ``cursor``; raises lists.GapError when the stream cannot continue."""
    urls = info.urls(CHANGELIST)
    if len(urls) > 1:
        return await _several_lists(ctx, info, set_id, source, cursor, urls)
    url = urls[0]
    archives = info.urls(CHANGELIST_ARCHIVE)
    validators = Validators(partial(ctx.read, ctx.reader.document))

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
        changes = change_entries(ctx.fetcher, url, last, source, validators, archives)
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


async def _several_lists(
    ctx: HarvestContext, info: SetInfo, set_id: int, source: str, cursor: Cursor, urls: list[str]
) -> PipelineStats:
    """A set whose Capability List names several Change Lists (WEKO3: one per repository index).

    Each list is read from the set's one cursor; no change moves it. Once every list was read and
    applied, the cursor moves to the newest datetime seen in any of them, with no tie count: changes at
    exactly that time are read again next time and, being applied by content, change nothing. A list
    that cannot be read is skipped and named (the source is degraded) and the cursor stays where it was,
    so nothing it holds is passed over.
    """
    newest: list = []
    skipped: list[str] = []

    async def items() -> AsyncGenerator[Work, None]:
        for url in urls:
            changes = change_entries(ctx.fetcher, url, cursor, source)
            try:
                async with aclosing(changes):
                    async for entry, after in changes:
                        if after.last_datetime is not None:
                            newest.append(after.last_datetime)
                        yield Work(entry, entry.change or "")
            except GapError:
                raise
            except (FetchError, SyncError) as exc:
                skipped.append(url)
                skip(url, str(exc))

    stats = await Pipeline(ctx, set_id, source).run(items())
    if not skipped and newest and (cursor.last_datetime is None or max(newest) > cursor.last_datetime):
        moved = Cursor(cursor.baseline_at, None, max(newest), 0, 0, None)
        await ctx.write(ctx.writer.apply, set_id, [], moved)
    return stats


async def _from_change_dump(
    ctx: HarvestContext, url: str, cursor: Cursor, source: str, folder: Path
) -> AsyncGenerator[Work, None]:
    """Changes after ``cursor`` from the closed packages of a Change Dump, when that is cheaper."""
    async with ctx.fetcher.document(url) as doc:
        head = doc.head
        if head is None or head.capability != CHANGEDUMP:
            return  # not a Change Dump: the Change Lists carry the same changes
        is_index, entries = await open_list(url, doc, CHANGEDUMP)
        found = [e async for e in entries]  # bounded: 50,000 entries per document (§7)
    packages = found if not is_index else []
    for part in found if is_index else []:  # a Change Dump Index (§13.1): its parts are Change Dumps
        async with ctx.fetcher.document(part.loc) as doc:
            if doc.head is None or doc.head.capability != CHANGEDUMP or doc.head.is_index:
                raise SyncError(f"{part.loc}: part of Change Dump Index {url} is not a Change Dump")
            packages += [e async for e in resolved(doc.entries, doc.url or part.loc)]
    pos = Position(cursor)
    start = pos.datetime
    closed = [
        (ListRef(e.loc, emd.from_, emd.until), e)
        for e in packages
        if (emd := e.md) is not None and emd.from_ is not None and emd.until is not None
        and (start is None or emd.until >= start)
    ]  # fmt: skip
    # Every ListRef of `closed` has both its times (the filter above): the casts say so to mypy.
    closed.sort(key=lambda pair: cast(datetime, pair[0].from_))
    if not closed:
        return
    first = closed[0][0]
    first_from, first_until = cast(datetime, first.from_), cast(datetime, first.until)
    if start is not None and first_from > start:
        return  # a gap: the Change Lists detect and report it
    if (
        start is not None
        and first_until > first_from
        and (first_until - start) < (first_until - first_from) / 2
    ):
        return  # most of the first package was applied already: cheaper per change
    limits = DumpLimits(max_package_bytes=ctx.config.harvest.max_resource_bytes)
    for ref, pkg in closed:
        index = 0
        items = fetch_package(ctx.fetcher, pkg, ctx.blobs, folder, limits=limits)
        async with aclosing(items):
            async for item in items:
                index += 1
                resolve(item.entry, pkg.loc)  # a manifest's relative <loc>: against its package
                t = when(item.entry)
                if pos.is_applied(t, ref.url, index) or item.entry.change not in CHANGES:
                    if item.blob is not None:
                        item.blob.abort()
                    continue
                yield Work(
                    item.entry, item.entry.change, pos.advance(t, ref, index), blob=item.blob, info=item.info
                )
        log.info("source=%s read change dump package %s (%d entries)", source, pkg.loc, index)
