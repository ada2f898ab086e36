"""Audit (§5.2): compare the store with what each upstream currently publishes, by URI, length and hash.

The expected state of a set is its current Resource List, overlaid with the changes its Change Lists
report since the list's ``at`` (a list may lag behind the changes). Everything streams: URIs seen upstream
are kept in a temporary SQLite table, not in memory.
"""

from __future__ import annotations

import sqlite3
import tempfile
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

from ..config import SourceConfig
from ..rs.model import CHANGELIST, DELETED, RESOURCELIST, Entry
from ..store.state import Cursor, Resource
from .context import HarvestContext
from .discovery import SetInfo, discover
from .lists import Snapshot, change_entries, resource_list_entries


@dataclass
class Difference:
    source: str
    set_url: str
    uri: str
    kind: str  # missing | extra | length | hash | not-deleted
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.source}: {self.kind}: {self.uri}" + (f" ({self.detail})" if self.detail else "")


def compare(entry: Entry, held: Resource | None) -> tuple[str, str] | None:
    """How a stored resource differs from an upstream entry, or None when it matches."""
    if entry.change == DELETED:
        if held is not None and not held.deleted:
            return "not-deleted", "deleted upstream, still held"
        return None
    if held is None or held.deleted:
        return "missing", ""
    length = entry.md.length if entry.md else None
    if length is not None and held.length != length:
        return "length", f"upstream {length}, held {held.length}"
    for algo, digest in entry.hashes.items():
        have = held.hashes.get(algo)
        if have is not None and have != digest:
            return "hash", f"{algo} upstream {digest}, held {have}"
    return None


class _SeenSet:
    """A disk-backed set of URIs (a baseline of millions must not be held in memory)."""

    def __init__(self, folder: Path) -> None:
        self._db = sqlite3.connect(folder / "seen.db")
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("CREATE TABLE seen (uri TEXT PRIMARY KEY)")

    def add(self, uri: str) -> None:
        self._db.execute("INSERT OR IGNORE INTO seen VALUES (?)", (uri,))

    def __contains__(self, uri: str) -> bool:
        return self._db.execute("SELECT 1 FROM seen WHERE uri = ?", (uri,)).fetchone() is not None

    def close(self) -> None:
        self._db.close()


async def expected_entries(ctx: HarvestContext, info: SetInfo, source: str) -> AsyncGenerator[Entry, None]:
    """What a set holds upstream now: its Resource List overlaid with the changes its Change Lists report
    since the list's ``at``; each URI once (a deleted one as a ``deleted`` change). Needs a Resource List.
    """
    rl_url = info.capabilities[RESOURCELIST].url
    async with ctx.fetcher.document(rl_url) as doc:  # the head only: the snapshot's `at`
        at = doc.head.md.at if doc.head and doc.head.md else None
    # Changes since the list's snapshot win over the list's own entries (bounded: one entry per URI
    # changed since `at`).
    overlay: dict[str, Entry] = {}
    if CHANGELIST in info.capabilities:
        since = Cursor(at, None, at, 0, 0, None)
        changes = change_entries(ctx.fetcher, info.capabilities[CHANGELIST].url, since, source)
        async with aclosing(changes):
            async for entry, _ in changes:
                overlay[entry.loc] = entry
    for entry in overlay.values():
        yield entry
    entries = resource_list_entries(ctx.fetcher, rl_url, Snapshot())
    async with aclosing(entries):
        async for entry in entries:
            if entry.loc not in overlay:
                yield entry


async def still_listed(ctx: HarvestContext, info: SetInfo, source: str, uris: set[str]) -> set[str] | None:
    """Which of ``uris`` the set still lists upstream (not as deleted); None when that cannot be told
    (no Resource List). Streams the lists; holds only ``uris``."""
    if RESOURCELIST not in info.capabilities:
        return None
    listed: set[str] = set()
    entries = expected_entries(ctx, info, source)
    async with aclosing(entries):
        async for entry in entries:
            if entry.loc in uris and entry.change != DELETED:
                listed.add(entry.loc)
    return listed


async def audit_source(ctx: HarvestContext, src: SourceConfig) -> AsyncGenerator[Difference, None]:
    """Yield every difference between the store and the upstream, set by set."""
    for info in await discover(ctx.fetcher, src.url):
        set_url = info.capabilitylist_url
        set_id = next(
            (s["id"] for s in ctx.reader.sets(src.name) if s["capabilitylist_url"] == set_url), None
        )
        if RESOURCELIST not in info.capabilities:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            seen = _SeenSet(Path(tmp))
            try:
                batch: list[Entry] = []
                entries = expected_entries(ctx, info, src.name)
                async with aclosing(entries):
                    async for entry in entries:
                        seen.add(entry.loc)
                        batch.append(entry)
                        if len(batch) >= 1000:
                            for d in _check(ctx, src.name, set_url, set_id, batch):
                                yield d
                for d in _check(ctx, src.name, set_url, set_id, batch):
                    yield d
                if set_id is not None:
                    for held in ctx.reader.iter_resources(set_id):
                        if held.uri not in seen:
                            yield Difference(
                                src.name, set_url, held.uri, "extra", "held but not listed upstream"
                            )
            finally:
                seen.close()


def _check(ctx: HarvestContext, source: str, set_url: str, set_id: int | None, batch: list[Entry]):
    for entry in batch:
        held = ctx.reader.resource(set_id, entry.loc) if set_id is not None else None
        found = compare(entry, held)
        if found:
            yield Difference(source, set_url, entry.loc, *found)
    batch.clear()
