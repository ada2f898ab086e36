"""Walking an upstream's Resource Lists (§10) and Change Lists (§12) as streams of entries.

Shared by baseline, incremental sync and audit, so the three read the Source the same way.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from datetime import datetime

from ..rs.model import CHANGELIST, CHANGES, RESOURCELIST, Entry, Head
from ..store.state import Cursor
from .fetch import Fetcher

log = logging.getLogger("rsagg.harvest")


class SyncError(Exception):
    """A set cannot be synchronized (nothing usable advertised, or a document of the wrong kind)."""


class NotModified(Exception):
    """The document is as we last read it (HTTP 304): there is nothing to synchronize."""


class GapError(SyncError):
    """The upstream no longer offers the changes between our position and its oldest Change List."""


class Validators:
    """ETag / Last-Modified of documents for conditional GET, remembered only once their changes apply.

    A 304 means "nothing new since you last read this", so validators must not be stored before the
    changes read with them are committed: otherwise a crash in between would skip those changes forever.
    The caller stores ``pending`` after its pipeline succeeded.
    """

    def __init__(self, known: Callable[[str], dict | None], *, conditional: bool = True) -> None:
        self._known = known
        self._conditional = conditional  # False: only record (a first read must not be skipped)
        self.pending: dict[str, tuple[str | None, str | None]] = {}

    def of(self, url: str) -> dict[str, str | None]:
        row = self._known(url) if self._conditional else None
        if not row:
            return {}
        return {"etag": row.get("etag"), "last_modified": row.get("last_modified")}

    def read(self, url: str, etag: str | None, last_modified: str | None) -> None:
        if etag or last_modified:
            self.pending[url] = (etag, last_modified)


class Snapshot:
    """The ``at`` of the snapshot being read, learnt from the first document head (§10.1, Appendix A)."""

    at: datetime | None = None


def _expect(url: str, head: Head | None, capability: str, index_ok: bool = True) -> Head:
    if head is None or head.capability != capability:
        got = head.capability if head else None
        raise SyncError(f"{url}: expected capability {capability!r}, got {got!r}")
    if head.is_index and not index_ok:
        raise SyncError(f"{url}: an index where a {capability} part was expected")
    return head


#: Entries between two estimates of a plain list's size (progress displays).
ESTIMATE_EVERY = 256


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
    count = 0
    async with fetcher.document(url, **(validators.of(url) if validators else {})) as doc:
        if doc.not_modified:
            raise NotModified(url)
        head = _expect(url, doc.head, RESOURCELIST)
        if validators and not head.is_index:
            # Only a plain list: §10.2 does not promise that an index changes when one of its parts
            # does, so an index is always read again (its parts come unconditionally too).
            validators.read(url, doc.etag, doc.last_modified)
        snap.at = head.md.at if head.md else None
        if not head.is_index:
            estimate = getattr(doc.entries, "estimate", None) if on_count else None
            async for entry in doc.entries:
                count += 1
                if estimate is not None and count % ESTIMATE_EVERY == 1:
                    expected = estimate(count)  # known once the list has arrived (from its bytes)
                    if expected is not None:
                        on_count(expected)
                yield entry
            if on_count:
                on_count(count)
            return
        # §10.2: an index lists at most 50,000 parts; holding their URLs is bounded.
        parts = [e.loc async for e in doc.entries]
    if on_parts:
        on_parts(len(parts))
    for i, part in enumerate(parts, 1):
        async with fetcher.document(part) as doc:
            _expect(part, doc.head, RESOURCELIST, index_ok=False)
            async for entry in doc.entries:
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
    """The time of a change: ``rs:md datetime`` (§12.1), else ``lastmod``."""
    md = entry.md
    return (md.datetime if md else None) or entry.lastmod


class Position:
    """The cursor as it moves through the lists (ties counted across list boundaries).

    The cursor stores the datetime of the last applied change and how many changes with exactly that
    datetime were applied; lists whose entries carry no time at all fall back to list URL + count.
    """

    def __init__(self, cursor: Cursor) -> None:
        self.start = cursor
        self.last = cursor.last_datetime
        self.same = cursor.same_datetime_count
        self.to_skip = cursor.same_datetime_count

    @property
    def datetime(self) -> datetime | None:
        return self.start.last_datetime or self.start.baseline_at

    def is_applied(self, t: datetime | None, list_url: str, index: int) -> bool:
        """True for changes at or before the position: they were applied before."""
        start = self.start
        if t is not None and start.last_datetime is not None:
            if t < start.last_datetime:
                return True
            if t == start.last_datetime and self.to_skip > 0:
                self.to_skip -= 1
                return True
            return False
        return t is None and list_url == start.changelist_url and index <= start.list_index

    def advance(self, t: datetime | None, ref: ListRef, index: int) -> Cursor:
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


async def change_entries(
    fetcher: Fetcher, url: str, cursor: Cursor, source: str, validators: Validators | None = None
) -> AsyncGenerator[tuple[Entry, Cursor], None]:
    """Every change after ``cursor``, in order, each with the cursor that records it as applied.

    Closed lists (with ``until``) are walked in ``from`` order, then the open one (§12.2); lists that
    closed before the position are not fetched. Raises GapError when the stream cannot continue.
    """
    pos = Position(cursor)
    conditional = validators.of(url) if validators else {}
    async with fetcher.document(url, **conditional) as doc:
        if doc.not_modified:
            return  # the open list is as we last read it: nothing new
        head = _expect(url, doc.head, CHANGELIST)
        md = head.md
        if not head.is_index:
            ref = ListRef(doc.url, md.from_ if md else None, md.until if md else None)
            check_gap(url, [ref], pos.datetime)
            async for item in _list_changes(ref, doc.entries, pos, source):
                yield item
            if validators and ref.until is None:
                validators.read(url, doc.etag, doc.last_modified)
            return
        refs = [
            ListRef(e.loc, e.md.from_ if e.md else None, e.md.until if e.md else None)
            async for e in doc.entries
        ]
    refs.sort(key=lambda r: (r.from_ is None, r.from_ or datetime.max, r.until is None))
    check_gap(url, refs, pos.datetime)
    for ref in refs:
        if ref.until is not None and pos.datetime is not None and ref.until < pos.datetime:
            continue
        # Only the open list is fetched conditionally: a closed one is read once and then skipped.
        conditional = validators.of(ref.url) if validators and ref.until is None else {}
        async with fetcher.document(ref.url, **conditional) as doc:
            if doc.not_modified:
                continue
            _expect(ref.url, doc.head, CHANGELIST, index_ok=False)
            async for item in _list_changes(ref, doc.entries, pos, source):
                yield item
            if validators and ref.until is None:
                validators.read(ref.url, doc.etag, doc.last_modified)


async def _list_changes(
    ref: ListRef, entries, pos: Position, source: str
) -> AsyncGenerator[tuple[Entry, Cursor]]:
    index = 0
    async for entry in entries:
        index += 1
        t = when(entry)
        if pos.is_applied(t, ref.url, index):
            continue
        if entry.change not in CHANGES:
            log.warning("source=%s url=%s line %s: change %r is not created/updated/deleted; skipped",
                        source, ref.url, entry.line, entry.change)  # fmt: skip
            continue
        yield entry, pos.advance(t, ref, index)
