"""Baseline synchronization (§5.2, §10, §11): bring a set up to a snapshot of the Source.

From a Resource Dump when one is advertised (and allowed), else from the Resource List or its index. Each
resource enters through the one pipeline with the baseline's generation number; ``finish_baseline``
then tombstones what the snapshot no longer lists and records the snapshot's ``at`` as the point where
incremental sync starts, both in one transaction. A baseline that fails half-way finishes nothing: the
next attempt starts a new generation, and what was already stored is skipped by hash.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing, nullcontext
from datetime import datetime
from functools import partial
from pathlib import Path

import trio

from ..rs.model import (
    CREATED,
    RESOURCEDUMP,
    RESOURCEDUMP_ARCHIVE,
    RESOURCELIST,
    RESOURCELIST_ARCHIVE,
    Entry,
)
from ..store.interface import EmptySnapshot, StateStore
from ..store.rows import Change, Cursor, RetryChanges
from . import deviations as _deviations
from .access import for_source
from .context import HarvestContext
from .deviations import skip
from .discovery import Capability, SetInfo
from .dumps import DumpError, DumpLimits, fetch_package
from .fetch import FetchError
from .lists import (
    NotModified,
    Snapshot,
    SyncError,
    Validators,
    open_list,
    peek,
    resolve,
    resolved,
    resource_list_entries,
)
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


async def with_archived_snapshots(ctx: HarvestContext, info: SetInfo) -> SetInfo:
    """A set that offers no current Resource List (or Resource Dump) but an archive of them (Archives
    draft: ``resourcelist-archive``, ``resourcedump-archive``) is read from the newest archived one:
    a snapshot at its ``at``, which the Change Lists then bring up to date."""
    lists = dict(info.lists)
    for current, archive in ((RESOURCELIST, RESOURCELIST_ARCHIVE), (RESOURCEDUMP, RESOURCEDUMP_ARCHIVE)):
        if current in lists or archive not in lists:
            continue
        newest: tuple[datetime, Entry] | None = None
        for url in info.urls(archive):
            async with ctx.fetcher.document(url) as doc:
                if doc.head is None or doc.head.capability != archive:
                    raise SyncError(
                        f"{url}: expected a {archive}, got {doc.head.capability if doc.head else None!r}"
                    )
                async for e in resolved(doc.entries, doc.url or url):
                    when = (e.md.at if e.md else None) or e.lastmod
                    if when is not None and (newest is None or when > newest[0]):
                        newest = (when, e)
        if newest is not None:
            log.info("set=%s no current %s: reading the newest archived one, %s", info.capabilitylist_url,
                     current, newest[1].loc)  # fmt: skip
            lists[current] = [Capability(newest[1].loc, current, newest[1])]
    if lists == info.lists:
        return info
    caps = {**info.capabilities, **{c: v[0] for c, v in lists.items() if c not in info.capabilities}}
    return dataclasses.replace(info, capabilities=caps, lists=lists)


async def dump_packages(
    ctx: HarvestContext, url: str, snap: Snapshot, validators: Validators | None = None
) -> list[Entry]:
    """The packages of a Resource Dump, or of every part of a Resource Dump Index (§11.1), resolved
    against their documents' URLs. Bounded: §7 caps a document at 50,000 entries, an index at 50,000
    parts; only the package entries are held, never their contents. With ``validators``, an unchanged
    Resource Dump (304) raises NotModified before any package is named."""
    async with ctx.fetcher.document(url, **(await validators.of(url) if validators else {})) as doc:
        if doc.not_modified:
            raise NotModified(url)
        head = doc.head
        if head is None or head.capability != RESOURCEDUMP:
            got = head.capability if head else None
            raise SyncError(f"{url}: expected a Resource Dump, got capability {got!r}")
        snap.at = head.md.at if head.md else None
        is_index, entries = await open_list(url, doc, RESOURCEDUMP)
        found = [e async for e in entries]
        if validators and not is_index:  # as for a Resource List: an index is always read again
            validators.read(url, doc.etag, doc.last_modified)
    if not is_index:
        return found
    packages: list[Entry] = []
    for part in found:
        async with ctx.fetcher.document(part.loc) as doc:
            if doc.head is None or doc.head.capability != RESOURCEDUMP or doc.head.is_index:
                raise SyncError(f"{part.loc}: part of Resource Dump Index {url} is not a Resource Dump")
            packages += [e async for e in resolved(doc.entries, doc.url or part.loc)]
    return packages


async def _dump_items(
    ctx: HarvestContext,
    url: str,
    generation: int,
    snap: Snapshot,
    tmpdir: Path,
    validators: Validators | None = None,
    total: Callable[[int], None] = lambda n: None,
) -> AsyncGenerator[Work, None]:
    """Packages of a Resource Dump (§11.1), each verified against its manifest (§11.2) by dumps.py.

    Progress: a package's manifest says how many entries it holds once read (its first pass), so the
    expected total is the manifests read so far plus, for each package not read yet, their average."""
    packages = await dump_packages(ctx, url, snap, validators)
    limits = DumpLimits(max_package_bytes=ctx.config.harvest.max_resource_bytes)
    counted: list[int] = []

    def manifest_read(n: int) -> None:
        counted.append(n)
        left = len(packages) - len(counted)
        total(sum(counted) + round(left * sum(counted) / len(counted)))

    for pkg in packages:
        items = fetch_package(ctx.fetcher, pkg, ctx.blobs, tmpdir, limits=limits, on_count=manifest_read)
        async with aclosing(items):
            async for item in items:
                entry = resolve(item.entry, pkg.loc)  # a manifest's relative <loc>: against its package
                yield Work(entry, CREATED, None, generation, blob=item.blob, info=item.info)


def _finish(
    writer: StateStore,
    set_id: int,
    generation: int,
    cursor: Cursor,
    retries: RetryChanges | None,
    documents: list[tuple[str, str, str, str | None, str | None]],
    after: Callable[[], None] | None = None,
) -> list[Change] | EmptySnapshot:
    """``finish_baseline``, then the validators of the snapshot's ``documents`` (url, source, kind,
    etag, last_modified): the next poll asks for them conditionally; then ``after`` (``closing``'s
    write). An empty snapshot's refusal is returned rather than raised: nothing is written then, and
    what the transaction holds besides (the last batch) stands."""
    try:
        swept = writer.finish_baseline(set_id, generation, cursor, retries)
    except EmptySnapshot as exc:
        return exc
    for url, source, kind, etag, last_modified in documents:
        writer.put_document(url, source, kind, etag=etag, last_modified=last_modified, sha256=None)
    if after is not None:
        after()
    return swept


def _no_total(n: int) -> None:
    """Several dumps of one set: each one's count is not the set's (the total stays unknown)."""


@for_source
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
    opened: int | None = None,
    empty: bool = False,
    closing: Callable[[PipelineStats], Callable[[], None] | None] | None = None,
) -> PipelineStats | None:
    """Synchronize one set from a snapshot; returns the pipeline's figures.

    ``opened``: a baseline generation the caller began for it already (``begin_baseline``, in the thread
    hop that found the set: ``source._open_set``); the first snapshot read takes it, any other (a dump
    that failed, then the list) begins its own. ``empty``: the caller found the set holding nothing
    (``StateStore.holds_nothing``), true for the first snapshot read only (a dump that failed may have
    stored some of it).

    ``closing``: the caller's last write, when nothing it does after this baseline can change it (its
    sync's final status): asked with the pipeline's figures once the snapshot is in, it answers a write
    to make after the baseline's end, in the same transaction, or None.

    With ``validators`` (a set already baselined and without Change List, re-read on every poll) an
    unchanged Resource List (or Resource Dump) returns None without touching the store.

    ``use_dumps`` False prefers the Resource List; a set that offers only a Resource Dump (§11.1 does
    not require a list beside it) is read from its dump whatever ``use_dumps`` says, on every poll.
    """
    info = await with_archived_snapshots(ctx, info)
    caps = info.capabilities
    if RESOURCELIST not in caps and RESOURCEDUMP not in caps:
        raise SyncError(f"{info.capabilitylist_url}: advertises neither a Resource List nor a Resource Dump")
    set_total = total or (lambda n: None)
    generations = [(opened, empty)] if opened is not None else []
    if RESOURCELIST not in caps:  # the dump is the only snapshot
        try:
            return await _baseline_from(
                ctx, info, set_id, source, "dump", progress, set_total, validators, generations, closing
            )
        except NotModified:
            log.debug("source=%s set=%s resource dump not modified", source, info.capabilitylist_url)
            return None
    # With several lists per capability, the dumps must be as many as the lists: fewer may cover only
    # some of them, and a baseline sweeps what it did not see.
    dumps_cover = RESOURCELIST not in caps or len(info.urls(RESOURCEDUMP)) >= len(info.urls(RESOURCELIST))
    if use_dumps and RESOURCEDUMP in caps and dumps_cover:
        try:
            return await _baseline_from(
                ctx, info, set_id, source, "dump", progress, set_total, None, generations, closing
            )
        except (DumpError, FetchError, SyncError) as exc:
            if RESOURCELIST not in caps:
                raise
            log.warning("source=%s url=%s resource dump unusable, using the resource list: %s",
                        source, caps[RESOURCEDUMP].url, exc)  # fmt: skip
    try:
        return await _baseline_from(
            ctx, info, set_id, source, "list", progress, set_total, validators, generations, closing
        )
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
    opened: list[tuple[int, bool]],
    closing: Callable[[PipelineStats], Callable[[], None] | None] | None = None,
) -> PipelineStats:
    """``opened``: a generation begun already and not used yet, and whether the set held nothing then
    (taken from the list), else none."""
    urls = info.urls(RESOURCEDUMP if how == "dump" else RESOURCELIST)
    if not urls:  # never a generation without a snapshot to fill it: its sweep would empty the set
        raise SyncError(
            f"{info.capabilitylist_url}: no Resource {'Dump' if how == 'dump' else 'List'} to read"
        )
    generation, empty = (
        opened.pop() if opened else (await ctx.write(ctx.writer.begin_baseline, set_id), False)
    )
    pipeline = Pipeline(ctx, set_id, source, progress=progress, empty=empty)
    snaps = [Snapshot() for _ in urls]
    skipped: list[str] = []
    if len(urls) > 1:
        validators = None  # the lists are one snapshot: all are read whenever one is

    async def items(tmp: Path) -> AsyncGenerator[Work, None]:
        # Several lists of one capability (WEKO3: one per repository index) are one snapshot of the
        # set. One that cannot be read is skipped and named (the source is then degraded); the others
        # are harvested, but the baseline is not finished, so nothing the skipped list holds is swept.
        for url, snap in zip(urls, snaps, strict=True):
            if how == "dump":
                one = _dump_items(
                    ctx, url, generation, snap, tmp, validators, total if len(urls) == 1 else _no_total
                )
            else:
                one = _resource_list_items(ctx, url, generation, snap, total, validators)
            try:
                async with aclosing(one):
                    async for work in one:
                        yield work
            except (DumpError, FetchError, SyncError) as exc:
                if len(urls) == 1 or how == "dump":  # a dump that fails falls back to the lists whole
                    raise
                skipped.append(url)
                skip(url, str(exc))

    notes = _deviations.current()
    before = dict(notes.skipped) if notes is not None else {}

    def finishing() -> Callable[[], list[Change] | EmptySnapshot] | None:
        """Once the whole snapshot is in: the write that finishes the baseline, or None when it must
        not finish (below). Made in the transaction of the pipeline's last batch, else after it."""
        if skipped or (notes is not None and notes.skipped != before):
            return None
        ats = [s.at for s in snaps]
        # The oldest snapshot of the set: changes after it are read again and applied by content.
        at = None if any(a is None for a in ats) else min(ats)  # type: ignore[type-var]
        cursor = Cursor(
            baseline_at=at,
            changelist_url=None,
            last_datetime=at,
            same_datetime_count=0,
            list_index=0,
            list_until=None,
        )
        # The lists' validators (a set re-read on every poll) are kept with it, in its transaction.
        kind = RESOURCEDUMP if how == "dump" else RESOURCELIST
        pending = validators.pending if validators else {}
        documents = [(url, source, kind, etag, modified) for url, (etag, modified) in pending.items()]
        retries = pipeline.unlisted_retries()
        after = closing(pipeline.stats) if closing is not None else None
        return partial(_finish, ctx.writer, set_id, generation, cursor, retries, documents, after)

    # A scratch folder only for dump packages: making and removing one per list-read set was a
    # good part of the per-source cost of a harvest of many small sources.
    with tempfile.TemporaryDirectory(dir=ctx.scratch_dir()) if how == "dump" else nullcontext() as d:
        async with aclosing(items(Path(d) if d else Path())) as stream:
            # The first change is read before the pipeline's tasks start: a list answered 304 (an
            # unchanged poll) raises NotModified here, and starts and cancels no task for nothing (a
            # cancelled nursery's error is a reference cycle holding the whole run, until collected).
            _, changes = await peek(stream)
            stats = await pipeline.run(changes, last=finishing)
    if skipped:
        log.warning("source=%s set=%s baseline from %s not finished: %d of %d lists unreadable",
                    source, info.capabilitylist_url, how, len(skipped), len(urls))  # fmt: skip
        return stats
    if notes is not None and notes.skipped != before:
        # Something of the snapshot was not read (a page, a linked list, an entry): what it holds must
        # not be swept, so the baseline is not finished (docs/truth.md).
        log.warning("source=%s set=%s baseline from %s not finished: not read: %s",
                    source, info.capabilitylist_url, how, notes.skipped_text())  # fmt: skip
        return stats
    if pipeline.last_written is not None:
        swept = pipeline.last_written[0]
    else:
        write = finishing()
        assert write is not None  # the same answer as above: nothing was skipped
        swept = await ctx.write(write)
    if isinstance(swept, EmptySnapshot):  # lenient in, truthful out: the source is degraded, nothing deleted
        log.warning("source=%s set=%s baseline from %s not finished: %s", source, info.capabilitylist_url,
                    how, swept)  # fmt: skip
        for url in urls:
            skip(url, f"the snapshot lists no resource: {swept}")
        return stats
    await pipeline.announce(swept)
    ctx.metrics.committed(source, swept, ())
    for ch in swept:
        stats.applied[ch.change] = stats.applied.get(ch.change, 0) + 1
    await trio.lowlevel.checkpoint()
    log.info(
        "source=%s set=%s baseline from %s done: %d seen, %d fetched, %d unchanged, applied %s, %d failed",
        source, info.capabilitylist_url, how, stats.seen, stats.fetched, stats.unchanged,
        stats.applied, len(stats.failures),
    )  # fmt: skip
    return stats
