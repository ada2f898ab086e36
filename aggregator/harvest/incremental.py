"""Incremental synchronization from Change Lists (§12.1) and Change List Indexes (§12.2).

Each change after the stored cursor enters the one pipeline together with the cursor that marks it
applied, so the position moves in the same transaction as the change (ARCHITECTURE invariant 2).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing

from ..rs.model import CHANGELIST
from ..store.state import Cursor
from .context import HarvestContext
from .discovery import SetInfo
from .lists import Validators, change_entries
from .pipeline import Pipeline, PipelineStats, Work

log = logging.getLogger("rsagg.harvest")


async def run_incremental(
    ctx: HarvestContext, info: SetInfo, set_id: int, source: str, cursor: Cursor
) -> PipelineStats:
    """Apply every change after ``cursor``; raises lists.GapError when the stream cannot continue."""
    url = info.capabilities[CHANGELIST].url
    validators = Validators(ctx.reader.document)

    async def items() -> AsyncGenerator[Work, None]:
        changes = change_entries(ctx.fetcher, url, cursor, source, validators)
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
