"""Reconciliation (anti-entropy): repair what the Change Lists never said, from the Resource List.

A Change List is a hint; the Resource List is the Source's statement of what exists (§10, §12). Sources
publish Change Lists that drop, reorder or repeat changes, or never list deletions (Hyrax). So a set
that follows a Change List is compared with its Resource List, streaming, on a schedule
(``harvest.reconcile_interval``, per source too), whenever a Resource List's ``at`` or ETag moves since
the last reconciliation, and again after one that could not repair everything. The comparison is the
audit's (``harvest/audit.py``: ``expected_entries`` + ``differences``), and the repairs go through the one
change pipeline (``harvest/pipeline.py``): a missed creation as ``created``, a differing or undecided
resource as ``updated`` (the pipeline fetches it only when digest, length and lastmod cannot decide, and
conditionally when it holds validators), a resource held but not listed as ``deleted``.

What was found and repaired is kept per set (``StateStore.put_reconciliation``) for status and metrics;
each repair is logged with its cause. A repair that fails stays a retry and keeps the source from "ok".
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from ..config import SourceConfig
from ..rs.model import CHANGELIST, CREATED, DELETED, RESOURCELIST, UPDATED, Entry
from ..rs.w3cdt import format_w3c, utcnow
from ..store.rows import Change, Reconciliation
from .access import for_source
from .audit import Difference, differences, expected_entries
from .baseline import with_archived_snapshots
from .context import HarvestContext
from .deviations import Deviations, collecting, skip
from .discovery import SetInfo, discover
from .fetch import FetchError
from .pipeline import Failure, Pipeline, PipelineStats, Work

log = logging.getLogger("rsagg.harvest")

#: The change a difference is repaired with (``audit.compare``'s kinds).
REPAIR = {
    "missing": CREATED,
    "hash": UPDATED,
    "length": UPDATED,
    "lastmod": UPDATED,
    "unverified": UPDATED,
    "not-deleted": DELETED,
    "extra": DELETED,
}

#: Causes of a reconciliation (``Reconciliation.cause``).
SCHEDULED, LIST_MOVED, NEVER, INCOMPLETE, BASELINE, REPAIR_COMMAND = (
    "scheduled", "list moved", "never reconciled", "last one incomplete", "baseline", "audit --repair",
)  # fmt: skip


@dataclass
class ReconcileResult:
    """What one reconciliation of a set found and did."""

    set_url: str
    cause: str
    differences: int = 0  # entries that differed or needed a fetch to tell
    checked: int = 0  # of those, found unchanged once fetched (or 304): nothing to repair
    repaired: dict[str, int] = field(default_factory=dict)  # change kind -> applied
    failures: list[Failure] = field(default_factory=list)
    #: Differences of URIs whose change already waits to be retried (``exclude``): left to the retry.
    deferred: int = 0
    #: Those of the ``watch`` URIs this reconciliation repaired or found unchanged once fetched.
    settled: set[str] = field(default_factory=set)
    complete: bool = True  # every list was read
    stats: PipelineStats | None = None

    @property
    def unrepaired(self) -> int:
        return len(self.failures) + self.deferred

    @property
    def result(self) -> str:
        """in_sync | repaired | unrepaired | incomplete (the metric's label)."""
        if not self.complete:
            return "incomplete"
        if self.unrepaired:
            return "unrepaired"
        return "repaired" if sum(self.repaired.values()) else "in_sync"


def _moved(before: dict[str, str | None] | None, now: dict[str, str | None]) -> bool:
    """A list moved: its ``at`` differs, or (both known) its ETag does."""
    if before is None:
        return True
    if before.get("at") != now.get("at"):
        return True
    return bool(before.get("etag") and now.get("etag") and before.get("etag") != now.get("etag"))


async def list_heads(
    ctx: HarvestContext, info: SetInfo, known: Reconciliation | None
) -> tuple[dict[str, dict[str, str | None]], bool]:
    """The ``at`` and ETag of each of the set's Resource Lists, and whether any moved since ``known``.

    Only the head is read (the stream is closed after it), conditionally on the ETag last seen: a 304
    has not moved. A list that cannot be read is named (the source is degraded) and counts as not moved.
    """
    heads: dict[str, dict[str, str | None]] = {}
    moved = False
    for url in info.urls(RESOURCELIST):
        before = known.lists.get(url) if known else None
        etag = before.get("etag") if before else None
        try:
            async with ctx.fetcher.document(url, etag=etag) as doc:
                if doc.not_modified and before is not None:
                    heads[url] = before
                    continue
                at = doc.head.md.at if doc.head and doc.head.md else None
                heads[url] = {"etag": doc.etag, "at": format_w3c(at) if at else None}
        except FetchError as exc:
            skip(url, f"Resource List not read for reconciliation: {exc}")
            if before is not None:
                heads[url] = before
            continue
        moved |= _moved(before, heads[url])
    return heads, moved


async def due(
    ctx: HarvestContext, info: SetInfo, set_id: int, interval: float
) -> tuple[str | None, dict[str, dict[str, str | None]]]:
    """Why the set must be reconciled now (None: not due), and its lists' heads as read.

    Only a set that follows a Change List and has a Resource List is reconciled: a set without Change
    List is re-read whole at every poll (harvest/baseline.py), which repairs the same things.
    """
    if CHANGELIST not in info.capabilities or RESOURCELIST not in info.capabilities:
        return None, {}
    known = await ctx.read(ctx.reader.reconciliation, set_id)
    heads, moved = await list_heads(ctx, info, known)
    if known is None:
        return NEVER, heads
    if not known.complete or known.unrepaired:
        return INCOMPLETE, heads
    if interval > 0 and (utcnow() - known.reconciled_at).total_seconds() >= interval:
        return SCHEDULED, heads
    if moved:
        return LIST_MOVED, heads
    if heads != known.lists and all(not _moved(known.lists.get(u), h) for u, h in heads.items()):
        # The same lists, now with their ETags (a baseline records none): asked conditionally next time.
        await ctx.write(
            ctx.writer.put_reconciliation, dataclasses.replace(known, lists={**known.lists, **heads})
        )
    return None, heads


async def record_baseline(ctx: HarvestContext, info: SetInfo, set_id: int) -> None:
    """A finished baseline made the set what its Resource List said at ``at``: record it as the set's
    reconciliation, so the next one is due by schedule or when the list moves past that ``at``."""
    cursor = await ctx.read(ctx.reader.cursor, set_id)
    at = format_w3c(cursor.baseline_at) if cursor and cursor.baseline_at else None
    lists: dict[str, dict[str, str | None]] = {u: {"etag": None, "at": at} for u in info.urls(RESOURCELIST)}
    rec = Reconciliation(set_id, utcnow(), BASELINE, lists, 0, {}, 0, True)
    await ctx.write(ctx.writer.put_reconciliation, rec)


@for_source
async def reconcile(
    ctx: HarvestContext,
    info: SetInfo,
    set_id: int,
    source: str,
    cause: str,
    heads: dict[str, dict[str, str | None]] | None = None,
    *,
    exclude: frozenset[str] | set[str] = frozenset(),
    watch: frozenset[str] | set[str] = frozenset(),
    on_difference: Callable[[Difference], None] | None = None,
) -> ReconcileResult:
    """Compare the set with what the Source lists now and repair every difference through the pipeline.

    ``heads``: the lists' ``at``/ETag as read by ``due`` (recorded as what was reconciled against).
    ``exclude``: URIs whose change failed and waits to be retried (earlier in this sync or before): their
    differences count as not repaired and are left to the retry, so one sync tries a URI once.
    ``watch``: URIs whose change failed earlier in this sync; those settled here are named in the result
    (``ReconcileResult.settled``: their earlier failure is superseded).
    ``on_difference``: told of each difference as found (``rsagg audit --repair`` prints them).
    Never deletes what is held while a list could not be read.
    """
    started = time.monotonic()
    result = ReconcileResult(info.capabilitylist_url, cause)
    unread: list[str] = []
    causes: dict[str, Difference] = {}  # in the pipeline, not yet committed (bounded by its in-flight)
    differing: set[str] = set()  # of the ``watch`` URIs

    def on_unread(url: str, reason: str) -> None:
        unread.append(url)
        skip(url, f"not reconciled: {reason}")

    async def works() -> AsyncGenerator[Work, None]:
        entries = expected_entries(ctx, info, source, on_unread=on_unread)
        found = differences(
            ctx, source, info.capabilitylist_url, set_id, entries, complete=lambda: not unread
        )
        async with aclosing(found):
            async for d in found:
                result.differences += 1
                if on_difference is not None:
                    on_difference(d)
                if d.uri in watch:
                    differing.add(d.uri)
                if d.uri in exclude:
                    result.deferred += 1
                    continue
                change = REPAIR[d.kind]
                entry = d.entry if d.entry is not None else Entry(d.uri)
                causes[d.uri] = d
                yield Work(entry, change)

    def on_batch(uris: list[str], applied: list[Change], failures: list[Failure]) -> None:
        done = {ch.uri: ch for ch in applied}
        failed = {f.uri for f in failures}
        for uri in uris:
            d = causes.pop(uri, None)
            if d is None:
                continue
            ch = done.get(uri)
            if uri in watch and uri not in failed:
                result.settled.add(uri)
            if ch is not None:
                result.repaired[ch.change] = result.repaired.get(ch.change, 0) + 1
                log.warning(
                    "source=%s set=%s reconcile repaired %s: %s (cause: %s%s)",
                    source, info.capabilitylist_url, uri, ch.change, d.kind,
                    f", {d.detail}" if d.detail else "",
                )  # fmt: skip
            elif uri not in failed:
                result.checked += 1

    pipeline = Pipeline(ctx, set_id, source, on_batch=on_batch)
    result.stats = await pipeline.run(works())
    result.failures = pipeline.stats.failures
    result.complete = not unread
    if result.complete:  # a watched URI that did not differ is as the Source lists it now
        result.settled |= set(watch) - differing
    for f in result.failures:
        log.warning("source=%s set=%s reconcile could not repair %s: %s: %s",
                    source, info.capabilitylist_url, f.uri, f.kind, f.message)  # fmt: skip
    rec = Reconciliation(
        set_id, utcnow(), cause, heads or {}, result.differences, dict(result.repaired),
        result.unrepaired, result.complete,
        None if result.complete else "not read: " + ", ".join(unread),
    )  # fmt: skip
    await ctx.write(ctx.writer.put_reconciliation, rec)
    ctx.metrics.reconciled(source, result.result, result.repaired)
    log.info(
        "source=%s set=%s reconciled (%s) in %.1fs: %d difference(s), repaired %s, %d unchanged once "
        "fetched, %d not repaired%s",
        source, info.capabilitylist_url, cause, time.monotonic() - started, result.differences,
        result.repaired or "nothing", result.checked, result.unrepaired,
        "" if result.complete else "; incomplete (a list was not read: nothing held was deleted)",
    )  # fmt: skip
    return result


@for_source
async def repair_source(
    ctx: HarvestContext, src: SourceConfig, *, on_difference: Callable[[Difference], None] | None = None
) -> list[ReconcileResult]:
    """``rsagg audit --repair``: reconcile every harvested set of a source now, whatever the schedule.

    Raises ReconcileError for what cannot be repaired this way (an OAI-PMH source, a set never
    harvested) and when a list could not be read (nothing held is deleted then).
    """
    if src.kind == "oai-pmh":
        raise ReconcileError("an OAI-PMH source is repaired by its full harvests (full_harvest_interval)")
    out: list[ReconcileResult] = []
    with collecting(Deviations(src.name, ctx.metrics.deviation)) as deviations:
        for info in await discover(ctx.fetcher, src.url):
            info = await with_archived_snapshots(ctx, info)
            sets = await ctx.read(ctx.reader.sets, src.name)
            set_id = next((s.id for s in sets if s.capabilitylist_url == info.capabilitylist_url), None)
            if set_id is None or await ctx.read(ctx.reader.cursor, set_id) is None:
                raise ReconcileError(f"{info.capabilitylist_url}: never harvested: run rsagg harvest first")
            known = await ctx.read(ctx.reader.reconciliation, set_id)
            heads, _ = await list_heads(ctx, info, known)
            out.append(
                await reconcile(
                    ctx, info, set_id, src.name, REPAIR_COMMAND, heads, on_difference=on_difference
                )
            )
    if deviations.skipped:
        raise ReconcileError(deviations.skipped_text() or "a list was not read")
    return out


class ReconcileError(Exception):
    """A source cannot be reconciled as asked (``rsagg audit --repair``)."""


__all__ = [
    "REPAIR",
    "ReconcileError",
    "ReconcileResult",
    "due",
    "list_heads",
    "reconcile",
    "record_baseline",
    "repair_source",
]
