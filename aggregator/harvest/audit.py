"""Audit (§5.2): compare the store with what each upstream currently publishes, by URI, length and hash.

The expected state of a set is its current Resource List, overlaid with the changes its Change Lists
report since the list's ``at`` (a list may lag behind the changes). Everything streams: URIs seen upstream
are kept in a temporary SQLite table, not in memory.

``compare`` and ``differences`` are the one comparison: ``rsagg audit`` reports what they decide, and
reconciliation (``harvest/reconcile.py``, ``rsagg audit --repair``) applies it.
"""

from __future__ import annotations

import hashlib
import itertools
import sqlite3
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ..config import SourceConfig
from ..rs.model import (
    CHANGELIST,
    CHANGELIST_ARCHIVE,
    DELETED,
    RESOURCEDUMP,
    RESOURCEDUMP_MANIFEST,
    RESOURCELIST,
    Entry,
    Md,
)
from ..store.rows import Cursor, Resource
from .access import for_source
from .baseline import dump_packages, with_archived_snapshots
from .context import HarvestContext
from .deviations import Deviations, collecting, current, skip
from .discovery import SetInfo, discover
from .dumps import DumpError, DumpLimits, read_manifest
from .fetch import Expected, FetchError
from .lists import Snapshot, SyncError, change_entries, resolve, resolved, resource_list_entries, when
from .oaipmh import OaiHarvest, set_key

#: What ``compare`` decides from the entry alone. "lastmod" (a lastmod other than the held one, no
#: digest to decide) and "unverified" (neither digest nor lastmod announced) can be told only by a fetch:
#: reconciliation fetches them (conditionally), audit does not count them.
DECIDED = frozenset({"missing", "extra", "length", "hash", "not-deleted"})


@dataclass
class Difference:
    source: str
    set_url: str
    uri: str
    kind: str  # missing | extra | length | hash | not-deleted (DECIDED) | lastmod | unverified
    detail: str = ""
    #: The upstream entry it was found with (None for "extra"): what a repair applies.
    entry: Entry | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return f"{self.source}: {self.kind}: {self.uri}" + (f" ({self.detail})" if self.detail else "")

    def as_dict(self) -> dict[str, str]:
        return {"source": self.source, "set_url": self.set_url, "uri": self.uri, "kind": self.kind,
                "detail": self.detail}  # fmt: skip


def compare(entry: Entry, held: Resource | None) -> tuple[str, str] | None:
    """How a stored resource differs from an upstream entry, or None when it matches.

    Decided in the order of trust: a digest both sides have, then ``length``, then ``lastmod`` (§7);
    a ``lastmod`` or ``unverified`` answer means only a fetch can tell (see DECIDED).
    """
    if entry.change == DELETED:
        if held is not None and not held.deleted:
            return "not-deleted", "deleted upstream, still held"
        return None
    if held is None or held.deleted:
        return "missing", ""
    compared = False
    for algo, digest in entry.hashes.items():
        have = held.hashes.get(algo)
        if have is not None:
            if have != digest:
                return "hash", f"{algo} upstream {digest}, held {have}"
            compared = True
    length = entry.md.length if entry.md else None
    if length is not None and held.length != length:
        return "length", f"upstream {length}, held {held.length}"
    if compared:
        return None
    if entry.lastmod is not None:
        if held.lastmod != entry.lastmod:
            return "lastmod", f"upstream {entry.lastmod.isoformat()}, held {_iso(held.lastmod)}"
        return None
    return "unverified", "no digest and no lastmod announced"


def _iso(dt: object) -> str:
    return dt.isoformat() if dt is not None else "none"  # type: ignore[attr-defined]


class _SeenSet:
    """A disk-backed set of URIs (a baseline of millions must not be held in memory)."""

    def __init__(self, folder: Path) -> None:
        self._db = sqlite3.connect(folder / "seen.db")
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("CREATE TABLE seen (uri TEXT PRIMARY KEY)")

    def add(self, uri: str) -> None:
        self._db.execute("INSERT OR IGNORE INTO seen VALUES (?)", (uri,))

    def add_many(self, uris: list[str]) -> None:
        self._db.executemany("INSERT OR IGNORE INTO seen VALUES (?)", ((u,) for u in uris))

    def __contains__(self, uri: str) -> bool:
        return self._db.execute("SELECT 1 FROM seen WHERE uri = ?", (uri,)).fetchone() is not None

    def close(self) -> None:
        self._db.close()


class AuditError(Exception):
    """Some list the Source advertises could not be compared: the source is not known to be in sync."""


def _raise(url: str, reason: str) -> None:
    raise SyncError(f"{url}: {reason}")


@for_source
async def expected_entries(
    ctx: HarvestContext, info: SetInfo, source: str, on_unread: Callable[[str, str], None] = _raise
) -> AsyncGenerator[Entry, None]:
    """What a set holds upstream now, each URI once (a deleted one as a ``deleted`` change).

    Every list the set advertises is read: all its Resource Lists (several when its Capability List
    names several), or the manifests of its Resource Dumps when it offers no list, overlaid with the
    changes of all its Change Lists since the oldest snapshot's ``at``. ``on_unread(url, reason)`` is
    told of a list that cannot be read (by default that raises SyncError).
    """
    snapshot_urls = info.urls(RESOURCELIST)
    from_dumps = not snapshot_urls
    if from_dumps:
        snapshot_urls = info.urls(RESOURCEDUMP)
    if not snapshot_urls:
        on_unread(info.capabilitylist_url, "no Resource List or Resource Dump to compare the store with")
        return
    # The heads first: the oldest snapshot's `at` (changes after it overlay the lists).
    ats = []
    for url in snapshot_urls:
        try:
            async with ctx.fetcher.document(url) as doc:
                ats.append(doc.head.md.at if doc.head and doc.head.md else None)
        except FetchError as exc:
            on_unread(url, str(exc))
    at = None if not ats or any(a is None for a in ats) else min(ats)  # type: ignore[type-var]
    # Changes since the snapshot win over the lists' own entries (bounded: one entry per URI changed
    # since `at`; changes without datetime are all taken, in list order, and weighed by lastmod below).
    overlay: dict[str, Entry] = {}
    undated: set[str] = set()  # URIs whose last change read has no datetime
    for url in info.urls(CHANGELIST):
        since = Cursor(at, None, at, 0, 0, None)
        changes = change_entries(ctx.fetcher, url, since, source, None, info.urls(CHANGELIST_ARCHIVE))
        try:
            async with aclosing(changes):
                async for entry, _ in changes:
                    overlay[entry.loc] = entry
                    if when(entry) is None:
                        undated.add(entry.loc)
                    else:
                        undated.discard(entry.loc)
        except (FetchError, SyncError) as exc:
            on_unread(url, str(exc))
    for url in snapshot_urls:
        entries = (
            _dump_entries(ctx, url) if from_dumps else resource_list_entries(ctx.fetcher, url, Snapshot())
        )
        try:
            async with aclosing(entries):
                async for entry in entries:
                    change = overlay.pop(entry.loc, None)
                    if change is None or (entry.loc in undated and _older(change, entry)):
                        yield entry
                    else:
                        yield change
        except (FetchError, SyncError) as exc:
            on_unread(url, str(exc))
    for loc, change in overlay.items():  # changes of URIs no list names
        if loc in undated and change.change != DELETED and _older(change, at):
            continue
        yield change


def _older(change: Entry, than: Entry | datetime | None) -> bool:
    """A change without datetime (§12.1 makes it optional) is placed by its ``lastmod`` (§7: the
    resource's last modification; a deletion carries the deleted version's): it is older than a listed
    entry with a later lastmod, or than a list ``at`` it precedes while that list does not name the
    resource. Then the list wins: a stale or replayed entry must not undo what the Source lists now."""
    limit = than.lastmod if isinstance(than, Entry) else than
    if change.lastmod is None or limit is None:
        return False
    return change.lastmod < limit if isinstance(than, Entry) else change.lastmod <= limit


@for_source
async def still_listed(ctx: HarvestContext, info: SetInfo, source: str, uris: set[str]) -> set[str]:
    """Which of ``uris`` the set still lists upstream (not as deleted). Streams the lists; holds only
    ``uris``; raises SyncError or FetchError when a list cannot be read (then nothing can be told)."""
    listed: set[str] = set()
    entries = expected_entries(ctx, info, source)
    async with aclosing(entries):
        async for entry in entries:
            if entry.loc in uris and entry.change != DELETED:
                listed.add(entry.loc)
    return listed


@for_source
async def audit_source(ctx: HarvestContext, src: SourceConfig) -> AsyncGenerator[Difference, None]:
    """Yield every difference between the store and the upstream, set by set.

    A list that cannot be read raises AuditError naming it once the readable ones are compared: never
    "in sync" with a list unread.
    """
    if src.kind == "oai-pmh":
        set_url = set_key(src)
        async with aclosing(_compare(ctx, src.name, set_url, _oai_entries(ctx, src, set_url))) as diffs:
            async for d in diffs:
                yield d
        return
    deviations = Deviations(src.name)
    with collecting(deviations):
        for info in await discover(ctx.fetcher, src.url):
            info = await with_archived_snapshots(ctx, info)
            entries = expected_entries(ctx, info, src.name, on_unread=skip)
            async with aclosing(_compare(ctx, src.name, info.capabilitylist_url, entries)) as diffs:
                async for d in diffs:
                    if d.kind in DECIDED:
                        yield d
    if deviations.skipped:
        raise AuditError(deviations.skipped_text())


async def _set_id(ctx: HarvestContext, source: str, set_url: str) -> int | None:
    sets = await ctx.read(ctx.reader.sets, source)
    return next((s.id for s in sets if s.capabilitylist_url == set_url), None)


async def _compare(
    ctx: HarvestContext, source: str, set_url: str, entries: AsyncIterator[Entry]
) -> AsyncGenerator[Difference, None]:
    set_id = await _set_id(ctx, source, set_url)
    async with aclosing(differences(ctx, source, set_url, set_id, entries)) as diffs:
        async for d in diffs:
            yield d


@for_source
async def differences(
    ctx: HarvestContext,
    source: str,
    set_url: str,
    set_id: int | None,
    entries: AsyncIterator[Entry],
    complete: Callable[[], bool] | None = None,
) -> AsyncGenerator[Difference, None]:
    """The differences between what a set holds upstream (``entries``, each URI once) and the store:
    entries compared in batches, then what the store holds beyond them ("extra": only when every list
    was read, since an unread list may hold what we hold: ``complete()`` says so, by default no list of
    the running sync was skipped). Each carries the entry it was found with."""
    with tempfile.TemporaryDirectory(dir=ctx.scratch_dir()) as tmp:
        seen = _SeenSet(Path(tmp))
        try:
            batch: list[Entry] = []
            async with aclosing(entries):  # type: ignore[type-var]
                async for entry in entries:
                    batch.append(entry)
                    if len(batch) >= 1000:
                        seen.add_many([e.loc for e in batch])
                        for d in await ctx.read(_check, ctx, source, set_url, set_id, batch):
                            yield d
            seen.add_many([e.loc for e in batch])
            for d in await ctx.read(_check, ctx, source, set_url, set_id, batch):
                yield d
            read_all = complete() if complete is not None else not ((dev := current()) and dev.skipped)
            if set_id is not None and read_all:
                held = ctx.reader.iter_resources(set_id)
                while chunk := await ctx.read(lambda: [r.uri for r in itertools.islice(held, 1000)]):
                    for uri in chunk:
                        if uri not in seen:
                            yield Difference(source, set_url, uri, "extra", "held but not listed upstream")
        finally:
            seen.close()


async def _oai_entries(ctx: HarvestContext, src: SourceConfig, set_url: str) -> AsyncGenerator[Entry, None]:
    """An OAI-PMH source's records from a full ListRecords walk, as entries: the sha-256 of the canonical
    metadata, as ``harvest/oaipmh.py`` stores it; a deleted record as a deletion (it must not be held)."""
    records = OaiHarvest(ctx, src, await _set_id(ctx, src.name, set_url) or 0).records()
    async with aclosing(records):
        async for rec in records:
            if rec.content is None:
                md = Md(change=DELETED)
            else:
                md = Md(hash=f"sha-256:{hashlib.sha256(rec.content).hexdigest()}", length=len(rec.content))
            yield Entry(rec.identifier, md=md)


async def _dump_entries(ctx: HarvestContext, url: str) -> AsyncGenerator[Entry, None]:
    """The resources of a Resource Dump (or its index) as its packages' manifests list them (§11.2):
    read through each package's ``rel="contents"`` link, or, since §11.1 makes that link optional, out
    of the package itself (downloaded, verified against the dump's hash/length for it, its manifest
    read; nothing stored)."""
    limits = DumpLimits(max_package_bytes=ctx.config.harvest.max_resource_bytes)
    for pkg in await dump_packages(ctx, url, Snapshot()):
        links = pkg.links_by_rel("contents")
        if not links:
            async with aclosing(_packaged_manifest(ctx, pkg, limits)) as entries:
                async for entry in entries:
                    yield entry
            continue
        async with ctx.fetcher.document(links[0].href) as doc:
            if doc.head is None or doc.head.capability != RESOURCEDUMP_MANIFEST:
                raise SyncError(f"{links[0].href}: not a Resource Dump Manifest")
            async for entry in resolved(doc.entries, doc.url or links[0].href):
                yield entry


async def _packaged_manifest(
    ctx: HarvestContext, pkg: Entry, limits: DumpLimits
) -> AsyncGenerator[Entry, None]:
    """The manifest inside a Resource Dump package, its ``loc``s resolved against the package's URL (as
    the baseline reads them)."""
    with tempfile.TemporaryDirectory(dir=ctx.scratch_dir()) as tmp:
        path = Path(tmp) / "package.zip"
        with path.open("wb") as f:
            await ctx.fetcher.download(
                pkg.loc, f, max_bytes=limits.max_package_bytes,
                expected=Expected(pkg.hashes, pkg.md.length if pkg.md else None),
            )  # fmt: skip
        try:
            async with aclosing(read_manifest(path, pkg.loc, limits=limits)) as entries:
                async for head, entry in entries:
                    if head.capability != RESOURCEDUMP_MANIFEST:
                        raise SyncError(f"{pkg.loc}: its manifest is not a Resource Dump Manifest")
                    yield resolve(entry, pkg.loc)
        except DumpError as exc:
            raise SyncError(str(exc)) from None


def _check(
    ctx: HarvestContext, source: str, set_url: str, set_id: int | None, batch: list[Entry]
) -> list[Difference]:
    """The differences of a batch of entries (state reads: called through ``HarvestContext.read``)."""
    out = []
    stored = ctx.reader.resources(set_id, [e.loc for e in batch]) if set_id is not None else {}
    for entry in batch:
        found = compare(entry, stored.get(entry.loc))
        if found:
            out.append(Difference(source, set_url, entry.loc, *found, entry=entry))
    batch.clear()
    return out
