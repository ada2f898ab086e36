"""Walking an upstream's Resource Lists (§10) and Change Lists (§12) as streams of entries.

Shared by baseline, incremental sync and audit, so the three read the Source the same way.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from datetime import datetime
from typing import TypedDict, TypeVar
from urllib.parse import urljoin

from ..rs.model import (
    CHANGELIST,
    CHANGELIST_ARCHIVE,
    CHANGES,
    DELETED,
    RESOURCELIST,
    Entry,
    Head,
    kind_name,
)
from ..store.rows import Cursor, DocumentRow
from .deviations import deviation, skip
from .fetch import DocumentStream, Fetcher, FetchError

#: An absolute URI has a scheme (RFC 3986 §3.1); anything else is resolved against the document.
_ABSOLUTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")

log = logging.getLogger("rsagg.harvest")
T = TypeVar("T")


class Conditional(TypedDict, total=False):
    """The validators of a conditional GET (RFC 9110 §13.1), as keyword arguments of ``Fetcher.document``."""

    etag: str | None
    last_modified: str | None


class SyncError(Exception):
    """A set cannot be synchronized (nothing usable advertised, or a document of the wrong kind)."""


class NotModified(Exception):
    """The document is as we last read it (HTTP 304): there is nothing to synchronize."""


class GapError(SyncError):
    """The upstream no longer offers the changes between our position and its oldest Change List."""


class Unfollowed(SyncError):
    """Part of a list rsagg could not read to its end (a page loop, too many pages...): what was read
    before it is used, the list is named as skipped (docs/truth.md), and nothing is swept for it."""


#: Pages of one paged list (``rel="next"``) read at most, beside "a page seen twice": the guard against
#: a Source whose pages never end. At up to 50,000 entries a page (§7) it is far beyond any real list.
MAX_PAGES = 10_000

#: Relation types on a list document that rsagg follows itself: paging (RFC 8288 registered types).
PAGING_RELS = frozenset({"next", "prev", "previous", "first", "last"})

#: Relation types on a list document that describe it and lead to nothing rsagg must read to hold the
#: right set (§7 Table 3, §9, §10.2, §12.2, Archives draft, RFC 8288 registered types). Any other
#: ``rs:ln`` on a list is structure rsagg would read past: the source is degraded, naming it.
DESCRIBING_RELS = frozenset(
    {"up", "index", "describedby", "describes", "self", "resourcesync", "hub", "license", "author",
     "collection", "via", "canonical", "alternate", "archives", "memento", "original", "timegate",
     "timemap", "help", "related", "profile"}
)  # fmt: skip


def unfollowed_links(url: str, head: Head) -> None:
    """Name (``skip``: the source is degraded) every ``rs:ln`` of a list that rsagg neither follows nor
    knows to only describe it: what it links might hold resources rsagg would then never read."""
    for ln in head.links:
        rels = (ln.rel or "").lower().split()
        if any(r in PAGING_RELS or r in DESCRIBING_RELS for r in rels):
            continue
        skip(
            url,
            f'<rs:ln rel="{ln.rel}" href="{ln.href}"> on the list is not followed: what it links is not read',
        )


class Pages:
    """Following one list's ``rel="next"`` pages to the end, with a loop guard (a page seen twice, or more
    than ``MAX_PAGES``). Heratio pages its Resource List and Change List this way."""

    def __init__(self, url: str, head: Head | None) -> None:
        self.url = url
        self.seen = {url}
        if head is not None and (head.link("prev") or head.link("previous")):
            skip(url, 'rel="prev" on the page a Capability List names: the pages before it are not read')

    @property
    def paged(self) -> bool:
        return len(self.seen) > 1

    def after(self, page: str, head: Head | None, base: str) -> str | None:
        """The page after ``page`` (read, ``head`` its head, links complete), or None at the end. Raises
        Unfollowed naming a loop or the cap; names any link of the page it does not follow."""
        if head is None:
            return None
        unfollowed_links(page, head)
        link = head.link("next")
        if link is None or not link.href:
            return None
        href = urljoin(base, link.href)
        if href in self.seen:
            raise Unfollowed(
                f'{self.url}: rel="next" of page {page} leads back to {href}, a page already read '
                f"(a loop after {len(self.seen)} pages): the pages after it are not read"
            )
        if len(self.seen) >= MAX_PAGES:
            raise Unfollowed(f'{self.url}: more than {MAX_PAGES} pages (rel="next"): the rest is not read')
        self.seen.add(href)
        return href


class Validators:
    """ETag / Last-Modified of documents for conditional GET, remembered only once their changes apply.

    A 304 means "nothing new since you last read this", so validators must not be stored before the
    changes read with them are committed: otherwise a crash in between would skip those changes forever.
    The caller stores ``pending`` after its pipeline succeeded.
    """

    def __init__(
        self, known: Callable[[str], Awaitable[DocumentRow | None]], *, conditional: bool = True
    ) -> None:
        """``known``: the stored validators of a document URL (a state read, ``HarvestContext.read``)."""
        self._known = known
        self._conditional = conditional  # False: only record (a first read must not be skipped)
        self.pending: dict[str, tuple[str | None, str | None]] = {}

    async def of(self, url: str) -> Conditional:
        row = await self._known(url) if self._conditional else None
        if not row:
            return {}
        return {"etag": row.etag, "last_modified": row.last_modified}

    def read(self, url: str, etag: str | None, last_modified: str | None) -> None:
        if etag or last_modified:
            self.pending[url] = (etag, last_modified)


class Snapshot:
    """The ``at`` of the snapshot being read, learnt from the first document head (§10.1, Appendix A)."""

    at: datetime | None = None


def resolve(entry: Entry, base: str) -> Entry:
    """Make ``loc`` and link hrefs absolute against the document's URL (§7 wants them absolute; legacy
    Sources write them relative), noting each such deviation; note relation types not in lower case."""
    loc = entry.loc
    if loc and not _ABSOLUTE.match(loc):
        entry.loc = urljoin(base, loc)
        deviation("relative-loc", base, entry.line, f"relative <loc> {loc!r} resolved to {entry.loc!r}")
    for ln in entry.links:
        if ln.href and not _ABSOLUTE.match(ln.href):
            href, ln.href = ln.href, urljoin(base, ln.href)
            deviation("relative-loc", base, entry.line, f"relative href {href!r} resolved to {ln.href!r}")
        if ln.rel and ":" not in ln.rel and ln.rel != ln.rel.lower():
            deviation("rel-case", base, entry.line, f"relation type {ln.rel!r} read as {ln.rel.lower()!r}")
    return entry


async def resolved(entries: AsyncIterator[Entry], base: str) -> AsyncGenerator[Entry, None]:
    async for entry in entries:
        yield resolve(entry, base)


def _looks_like_index(first: Entry | None, capability: str, is_index: bool) -> bool:
    """What the entries say the document is (§10.2, §12.2), whatever its root element says.

    WEKO3 writes a Change List Index as ``<urlset>`` whose entries carry ``capability="changelist"``;
    the reverse (a ``<sitemapindex>`` whose entries are changes) was seen too. Only ``change`` tells a
    change from a part: an index's parts may carry ``hash``/``length`` of their own (resync-build's do).
    """
    if first is None or first.md is None:
        return is_index
    md = first.md
    if not is_index and md.capability == capability and md.change is None:
        return True
    if is_index and md.capability is None and md.change is not None:
        return False
    return is_index


async def open_list(url: str, doc: DocumentStream, capability: str) -> tuple[bool, AsyncIterator[Entry]]:
    """(is it an index, its entries resolved against its URL) of a fetched list document."""
    head = _expect(url, doc.head, capability)
    first, entries = await peek(resolved(doc.entries, doc.url or url))
    is_index = _looks_like_index(first, capability, head.is_index)
    if is_index != head.is_index:
        rule, what = ("index-as-urlset", "an index") if is_index else ("list-as-sitemapindex", "a list")
        deviation(rule, doc.url or url, first.line if first else None,
                  f"<{head.root}> whose entries make it {what}; read as {what}")  # fmt: skip
    return is_index, entries


async def peek(entries: AsyncIterator[T]) -> tuple[T | None, AsyncGenerator[T, None]]:
    """The first item, and all the items (that one included) still to be read."""
    first = await anext(entries, None)

    async def chain() -> AsyncGenerator[T, None]:
        if first is not None:
            yield first
        async for e in entries:
            yield e

    return first, chain()


def _expect(url: str, head: Head | None, capability: str, index_ok: bool = True) -> Head:
    if head is None or head.capability != capability:
        got = head.capability if head else None
        raise SyncError(f"{url}: expected capability {capability!r}, got {got!r}")
    if head.is_index and not index_ok:
        raise SyncError(f"{url}: an index where a {capability} part was expected")
    return head


#: Entries between two estimates of a plain list's size (progress displays).
ESTIMATE_EVERY = 256


def _note_at(url: str, head: Head) -> None:
    if head.md is None or head.md.at is None:
        deviation("at-missing", url, head.line, "Resource List without rs:md at (§10.1: mandatory); "
                  "changes are read from the start of every Change List")  # fmt: skip


def _may_be_list(entry: Entry) -> bool:
    """An entry whose metadata is a document's, not a resource's: ``at``, ``completed``, ``from``,
    ``until`` or ``capability`` without ``change`` (§7 Table 3). POD's 2020 Resource List "index" is a
    <urlset> of such entries (``<rs:md at=...>`` only). Only fetching it tells what it is."""
    md = entry.md
    return (
        md is not None
        and md.change is None
        and (md.at or md.completed or md.from_ or md.until or md.capability) is not None
    )


async def _as_lists(fetcher: Fetcher, url: str, entries: AsyncIterator[Entry]) -> AsyncGenerator[Entry, None]:
    """The entries of a Resource List, where an entry that turns out to be a Resource List itself (by its
    content: a ResourceSync document of capability resourcelist) is followed as a part of the list and
    not yielded as a resource. An entry that is another kind of ResourceSync document is named as not
    read (the source is degraded); one that is no ResourceSync document is a resource."""
    async for entry in entries:
        if entry.change == DELETED:
            # A Resource List lists what exists (§10.1): an entry it calls deleted is neither a resource
            # to hold nor one to drop on its word. Not read, and named.
            skip(
                url,
                f"line {entry.line}: {entry.loc} is listed as deleted in a Resource List (§10.1): not read",
            )
            continue
        if not _may_be_list(entry):
            yield entry
            continue
        opened = False
        try:
            async with fetcher.document(entry.loc) as doc:
                opened = True
                head = doc.head
                if head is None or head.capability != RESOURCELIST or head.is_index:
                    what = kind_name(head) if head is not None else "document"
                    skip(entry.loc, f"listed in Resource List {url} but is a {what}: not read")
                    continue
                deviation("list-in-urlset", url, entry.line,
                          f"entry {entry.loc} is a Resource List: followed as a part of {url}")  # fmt: skip
                _note_at(entry.loc, head)
                part = doc.url or entry.loc
                pages = Pages(part, head)
                async for e in resolved(doc.entries, part):
                    yield e
                nxt = pages.after(part, head, part)
        except FetchError as exc:
            if opened:
                raise  # a Resource List that broke off while read: the list is not read to its end
            if exc.kind == "parse":
                yield entry  # not a ResourceSync document: a resource (its fetch decides the rest)
            else:  # it may be a list: nothing is swept for it (docs/truth.md)
                skip(entry.loc, f"listed in Resource List {url} with a document's metadata, could not be "
                     f"read: {exc}")  # fmt: skip
            continue
        while nxt is not None:
            async with fetcher.document(nxt) as doc:
                h = _expect(nxt, doc.head, RESOURCELIST, index_ok=False)
                async for e in resolved(doc.entries, doc.url or nxt):
                    yield e
                nxt = pages.after(nxt, h, doc.url or nxt)


async def _page_chain(fetcher: Fetcher, url: str, capability: str) -> AsyncGenerator[Entry, None]:
    """The entries of a part of an index and of the pages it links with ``rel="next"``."""
    nxt: str | None = url
    pages: Pages | None = None
    while nxt is not None:
        async with fetcher.document(nxt) as doc:
            head = _expect(nxt, doc.head, capability, index_ok=False)
            if pages is None and capability == RESOURCELIST:
                _note_at(url, head)
            pages = pages or Pages(url, head)
            async for entry in resolved(doc.entries, doc.url or nxt):
                yield entry
            nxt = pages.after(nxt, head, doc.url or nxt)


async def resource_list_entries(
    fetcher: Fetcher,
    url: str,
    snap: Snapshot,
    on_parts: Callable[[int], None] | None = None,
    validators: Validators | None = None,
    on_count: Callable[[int], None] | None = None,
) -> AsyncGenerator[Entry, None]:
    """Every entry of a Resource List, or of all parts of a Resource List Index (§10.2).

    With ``validators``, an unchanged list (304) raises NotModified before any entry is yielded.
    ``on_count`` (progress displays): the number of entries expected, estimated after each part of an
    index (the average part so far times the parts), for a plain list from the share of its bytes read
    once it has arrived, exact once everything has been read.
    """
    try:
        async for entry in _resource_list(fetcher, url, snap, on_parts, validators, on_count):
            yield entry
    except Unfollowed as exc:  # what was read is used; the list is named, nothing is swept for it
        skip(url, str(exc))


async def _resource_list(
    fetcher: Fetcher,
    url: str,
    snap: Snapshot,
    on_parts: Callable[[int], None] | None,
    validators: Validators | None,
    on_count: Callable[[int], None] | None,
) -> AsyncGenerator[Entry, None]:
    count = 0
    nxt: str | None = None
    async with fetcher.document(url, **(await validators.of(url) if validators else {})) as doc:
        if doc.not_modified:
            raise NotModified(url)
        head = _expect(url, doc.head, RESOURCELIST)
        is_index, entries = await open_list(url, doc, RESOURCELIST)
        snap.at = head.md.at if head.md else None
        _note_at(url, head)
        if not is_index:
            pages = Pages(url, head)
            estimate = getattr(doc.entries, "estimate", None) if on_count else None
            async for entry in _as_lists(fetcher, url, entries):
                count += 1
                if estimate is not None and on_count is not None and count % ESTIMATE_EVERY == 1:
                    expected = estimate(count)  # known once the list has arrived (from its bytes)
                    if expected is not None:
                        on_count(expected)
                yield entry
            nxt = pages.after(url, head, doc.url or url)
            if validators and not pages.paged and nxt is None:
                # Only a plain list of one page: a 304 of its first page says nothing of the others.
                validators.read(url, doc.etag, doc.last_modified)
        else:
            unfollowed_links(url, head)
            # §10.2: an index lists at most 50,000 parts; holding their URLs is bounded.
            parts = [e.loc async for e in entries]
    if not is_index:
        while nxt is not None:
            async with fetcher.document(nxt) as doc:
                page_head = _expect(nxt, doc.head, RESOURCELIST, index_ok=False)
                async for entry in _as_lists(fetcher, nxt, resolved(doc.entries, doc.url or nxt)):
                    count += 1
                    yield entry
                nxt = pages.after(nxt, page_head, doc.url or nxt)
        if on_count:
            on_count(count)
        return
    if on_parts:
        on_parts(len(parts))
    for i, part in enumerate(parts, 1):
        async for entry in _page_chain(fetcher, part, RESOURCELIST):
            count += 1
            yield entry
        if on_count:
            on_count(count * len(parts) // i)


@dataclass
class ListRef:
    url: str
    from_: datetime | None
    until: datetime | None


def when(entry: Entry) -> datetime | None:
    """The time of a change: ``rs:md datetime`` (§12.1), or None.

    Never ``lastmod``: it is the resource's last modification (§7), not the time of the change. A
    deletion carries the old lastmod, and a created resource may be older than the list's ``from``
    (§12.1, Example 19); filtering them by lastmod would drop them. Changes without a datetime are
    applied by content instead (``Position.is_applied``).
    """
    md = entry.md
    return md.datetime if md else None


class Position:
    """The cursor as it moves through the lists (ties counted across list boundaries).

    The cursor stores the datetime of the last applied change and how many changes with exactly that
    datetime were applied. A change without a datetime is never taken as applied: it goes through the
    pipeline every time it is read, and the pipeline compares it with what is held (the announced hash
    and length, else the fetched content), so applying it again changes nothing (README, "Change Lists:
    the cursor, ties, and changes without datetimes"). A list position (URL + index) is not used for
    them: resync-build rewrites its change list in place, so the n-th entry of one reading is not the
    n-th of the next.
    """

    def __init__(self, cursor: Cursor) -> None:
        self.start = cursor
        self.last = cursor.last_datetime
        self.same = cursor.same_datetime_count
        self.to_skip = cursor.same_datetime_count

    @property
    def datetime(self) -> datetime | None:
        # The methods below spell the type `dt.datetime`: in the class body `datetime` is this property.
        return self.start.last_datetime or self.start.baseline_at

    def is_applied(self, t: dt.datetime | None, list_url: str, index: int) -> bool:
        """True for changes at or before the position: they were applied before."""
        start = self.start
        if t is not None and start.last_datetime is not None:
            if t < start.last_datetime:
                return True
            if t == start.last_datetime and self.to_skip > 0:
                self.to_skip -= 1
                return True
            return False
        return False

    def advance(self, t: dt.datetime | None, ref: ListRef, index: int) -> Cursor:
        if t is not None:
            if t == self.last:
                self.same += 1
            else:
                self.last, self.same = t, 1
        return Cursor(
            baseline_at=self.start.baseline_at,
            changelist_url=ref.url,
            last_datetime=self.last,
            same_datetime_count=self.same,
            list_index=index,
            list_until=ref.until,
        )


def check_gap(url: str, refs: list[ListRef], position: datetime | None) -> None:
    """§12: a Destination whose position precedes every available ``from`` has missed changes."""
    starts = [r.from_ for r in refs if r.from_ is not None]
    if position is not None and starts and len(starts) == len(refs) and min(starts) > position:
        raise GapError(
            f"{url}: oldest change available is from {min(starts).isoformat()}, "
            f"after our position {position.isoformat()}: changes in between are lost"
        )


async def archived_refs(fetcher: Fetcher, url: str, capability: str) -> list[ListRef]:
    """The documents a ResourceSync Archive lists (``changelist-archive``...: a ``<urlset>`` of past
    documents with ``from``/``until`` or ``at``), resolved against its URL. Bounded: §7 caps a document
    at 50,000 entries."""
    async with fetcher.document(url) as doc:
        _expect(url, doc.head, capability)
        # DSpace (ResourceSyncJava) gives archived lists only a <lastmod>: the time the list was closed.
        return [
            ListRef(e.loc, e.md.from_ if e.md else None, (e.md.until if e.md else None) or e.lastmod)
            async for e in resolved(doc.entries, doc.url or url)
        ]


async def change_entries(
    fetcher: Fetcher,
    url: str,
    cursor: Cursor,
    source: str,
    validators: Validators | None = None,
    archives: Sequence[str] = (),
) -> AsyncGenerator[tuple[Entry, Cursor], None]:
    """Every change after ``cursor``, in order, each with the cursor that records it as applied.

    Closed lists (with ``until``) are walked in ``from`` order, then the open one (§12.2); lists that
    closed before the position are not fetched. ``archives``: Change List Archives whose closed lists
    come before the ones the Change List (Index) names. Raises GapError when the stream cannot continue.
    """
    pos = Position(cursor)
    archived: list[ListRef] = []
    for a in archives:
        archived += await archived_refs(fetcher, a, CHANGELIST_ARCHIVE)
    conditional = await validators.of(url) if validators else {}
    async with fetcher.document(url, **conditional) as doc:
        if doc.not_modified:
            refs: list[ListRef] = []  # the open list is as we last read it: nothing new there
        else:
            is_index, entries = await open_list(url, doc, CHANGELIST)
            md = doc.head.md if doc.head else None
            link = doc.head.link("archives") if doc.head else None
            if not archives and link is not None and link.href:
                # Archives draft: a core document may name its archive with a top-level rel="archives".
                # Only a pointer: unreadable, it costs nothing unless it was needed (then a gap is found).
                href = urljoin(doc.url or url, link.href)
                try:
                    archived = await archived_refs(fetcher, href, CHANGELIST_ARCHIVE)
                except (FetchError, SyncError) as exc:
                    log.warning("source=%s url=%s archive of %s not read: %s", source, href, url, exc)
            if not is_index:
                ref = ListRef(doc.url, md.from_ if md else None, md.until if md else None)
                if ref.from_ is None:
                    first, entries = await peek(entries)
                    ref = _without_from(ref, first)
                older = _closed_before(archived, ref, pos)
                check_gap(url, [*older, ref], pos.datetime)
                for old in older:
                    async for item in _closed_list_changes(fetcher, old, pos, source):
                        yield item
                pages = Pages(url, doc.head)
                if doc.head is not None and doc.head.link("next") is not None:
                    paged = _paged_changes(fetcher, url, doc.head, ref, entries, pos, source, pages)
                    async with aclosing(paged):
                        async for item in paged:
                            yield item
                    return
                async for item in _list_changes(ref, entries, pos, source):
                    yield item
                try:
                    nxt = pages.after(url, doc.head, doc.url or url)
                except Unfollowed as exc:
                    skip(url, str(exc))
                    return
                if nxt is not None:  # a rel="next" written after the entries (late-head-link)
                    skip(url, f'rel="next" after the entries of {url}: pages after the first are not read')
                    return
                if validators and ref.until is None:
                    validators.read(url, doc.etag, doc.last_modified)
                return
            assert doc.head is not None  # not a 304: the head was parsed (as before, None would raise)
            unfollowed_links(url, doc.head)
            refs = [
                ListRef(e.loc, e.md.from_ if e.md else None, e.md.until if e.md else None)
                async for e in entries
            ]
    known = {r.url for r in refs}
    refs += [r for r in archived if r.url not in known]
    if not refs:
        return
    refs.sort(key=lambda r: (r.from_ is None, r.from_ or datetime.max, r.until is None))
    check_gap(url, refs, pos.datetime)
    for ref in refs:
        if ref.until is not None and pos.datetime is not None and ref.until < pos.datetime:
            continue
        if ref.until is not None:  # a closed list is read once and then skipped
            async for item in _closed_list_changes(fetcher, ref, pos, source):
                yield item
            continue
        conditional = await validators.of(ref.url) if validators else {}
        async with fetcher.document(ref.url, **conditional) as doc:
            if doc.not_modified:
                continue
            head = _expect(ref.url, doc.head, CHANGELIST, index_ok=False)
            async for item in _list_changes(ref, resolved(doc.entries, doc.url or ref.url), pos, source):
                yield item
            if head.link("next") is not None:
                skip(ref.url, 'a part of a Change List Index paged with rel="next": its pages are not read')
            else:
                unfollowed_links(ref.url, head)
            if validators:
                validators.read(ref.url, doc.etag, doc.last_modified)


async def _paged_changes(
    fetcher: Fetcher,
    url: str,
    head: Head,
    ref: ListRef,
    entries: AsyncIterator[Entry],
    pos: Position,
    source: str,
    pages: Pages,
) -> AsyncGenerator[tuple[Entry, Cursor]]:
    """The changes of a Change List paged with ``rel="next"`` (Heratio: offset pages of a sliding window
    whose ``until`` is the time of each request), read to the end.

    Offset pages of a list that changes while they are read can tear: an entry that leaves the window
    (or moves to its end when updated) shifts the later pages, so one change may be on no page read.
    The position therefore moves only with the last change of a read that cannot have torn: no change
    newer than the first page's ``until`` appeared on a later page, and no change already read fell
    before a later page's ``from``. Until then every change goes with the position the read started
    from, so a torn or interrupted read is read again from there (applied by content, idempotently).
    The changes at the position's own datetime are always read again (see below).
    """
    # Ties at the position are read again (applied by content): offset pages order the changes of one
    # second by another key (Heratio: the record's id), so a change made since may come before the ones
    # of that second already applied, and skipping "the first N" of them would skip it.
    pos.to_skip = 0
    start = pos.start
    first_until = ref.until
    oldest: datetime | None = None
    torn: str | None = None
    held: tuple[Entry, Cursor] | None = None

    async def page_changes(page_entries: AsyncIterator[Entry]) -> AsyncGenerator[tuple[Entry, Cursor]]:
        nonlocal oldest, torn, held
        async for entry, after in _list_changes(ref, page_entries, pos, source):
            t = when(entry)
            if t is not None:
                oldest = t if oldest is None or t < oldest else oldest
                if torn is None and first_until is not None and t > first_until:
                    torn = f"a change of {t.isoformat()} appeared after the first page's until"
            if held is not None:
                yield held[0], start
            held = (entry, after)

    async for item in page_changes(entries):
        yield item
    page, page_head, base = url, head, url
    while True:
        try:
            nxt = pages.after(page, page_head, base)
        except Unfollowed as exc:
            skip(url, str(exc))
            torn = torn or "not read to its end"
            break
        if nxt is None:
            break
        async with fetcher.document(nxt) as doc:
            page, page_head, base = nxt, _expect(nxt, doc.head, CHANGELIST, index_ok=False), doc.url or nxt
            md = page_head.md
            if torn is None and md is not None and md.from_ is not None and oldest is not None:
                if oldest < md.from_:
                    torn = f"the window moved past {oldest.isoformat()} while its pages were read"
            async for item in page_changes(resolved(doc.entries, base)):
                yield item
    if held is not None:
        if torn is not None:
            log.info("source=%s url=%s paged Change List read again from the same position next time: %s",
                     source, url, torn)  # fmt: skip
        yield held[0], (start if torn is not None else held[1])


def _without_from(ref: ListRef, first: Entry | None) -> ListRef:
    """§12.1 makes ``from`` mandatory: without it, a list vouches for no change before its first one. A
    position before that change may have missed changes the list no longer holds (a gap, so a new
    baseline), never assumed otherwise. A list whose changes have no datetime cannot tell: its changes are
    applied by content (see ``Position``)."""
    deviation("from-missing", ref.url, None, "Change List without rs:md from (§12.1): it covers changes "
              "from its first entry's datetime on")  # fmt: skip
    t = when(first) if first is not None else None
    return ListRef(ref.url, t, ref.until) if t is not None else ref


def _closed_before(archived: list[ListRef], ref: ListRef, pos: Position) -> list[ListRef]:
    """Archived lists still needed before the list ``ref`` (they end where it begins or earlier)."""
    out = [
        r for r in archived
        if r.url != ref.url and r.until is not None
        and (ref.from_ is None or r.until <= ref.from_)
        and (pos.datetime is None or r.until >= pos.datetime)
    ]  # fmt: skip
    return sorted(out, key=lambda r: r.from_ or datetime.min)


async def _closed_list_changes(
    fetcher: Fetcher, ref: ListRef, pos: Position, source: str
) -> AsyncGenerator[tuple[Entry, Cursor]]:
    async with fetcher.document(ref.url) as doc:
        _expect(ref.url, doc.head, CHANGELIST, index_ok=False)
        async for item in _list_changes(ref, resolved(doc.entries, doc.url or ref.url), pos, source):
            yield item


async def _list_changes(
    ref: ListRef, entries, pos: Position, source: str
) -> AsyncGenerator[tuple[Entry, Cursor]]:
    index = 0
    async for entry in entries:
        index += 1
        # A change without rs:md datetime is no deviation (§7, §12.1: it *may* be given): it is applied
        # by content, whatever its lastmod (``Position``).
        t = when(entry)
        if pos.is_applied(t, ref.url, index):
            continue
        if entry.change not in CHANGES:
            # An entry rsagg cannot classify: what it says is not applied, so the source is not in sync.
            skip(ref.url, f"line {entry.line}: change {entry.change!r} of {entry.loc} is not "
                 "created/updated/deleted (§12.1): not applied")  # fmt: skip
            continue
        yield entry, pos.advance(t, ref, index)
