"""Audit (§5.2): compare the store with what each upstream currently publishes, by URI, length and hash.

The expected state of a set is its current Resource List, overlaid with the changes its Change Lists
report since the list's ``at`` (a list may lag behind the changes). Everything streams: URIs seen upstream
are kept in a temporary SQLite table, not in memory.
"""

from __future__ import annotations

import hashlib
import sqlite3
import tempfile
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

from ..config import SourceConfig
from ..rs.model import CHANGELIST, DELETED, RESOURCELIST, Entry, Md
from ..store.state import Cursor, Resource
from .context import HarvestContext
from .discovery import discover
from .lists import Snapshot, change_entries, resource_list_entries
from .oaipmh import OaiHarvest, set_key


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


async def audit_source(ctx: HarvestContext, src: SourceConfig) -> AsyncGenerator[Difference, None]:
    """Yield every difference between the store and the upstream, set by set."""
    if src.kind == "oai-pmh":
        async with aclosing(_audit_oaipmh(ctx, src)) as diffs:
            async for d in diffs:
                yield d
        return
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
                rl_url = info.capabilities[RESOURCELIST].url
                async with ctx.fetcher.document(rl_url) as doc:  # the head only: the snapshot's `at`
                    at = doc.head.md.at if doc.head and doc.head.md else None
                # Changes since the list's snapshot win over the list's own entries (bounded: one
                # entry per URI changed since `at`).
                overlay: dict[str, Entry] = {}
                if CHANGELIST in info.capabilities:
                    since = Cursor(at, None, at, 0, 0, None)
                    changes = change_entries(ctx.fetcher, info.capabilities[CHANGELIST].url, since, src.name)
                    async with aclosing(changes):
                        async for entry, _ in changes:
                            overlay[entry.loc] = entry
                batch: list[Entry] = list(overlay.values())
                entries = resource_list_entries(ctx.fetcher, rl_url, Snapshot())
                async with aclosing(entries):
                    async for entry in entries:
                        seen.add(entry.loc)
                        if entry.loc not in overlay:
                            batch.append(entry)
                        if len(batch) >= 1000:
                            for d in _check(ctx, src.name, set_url, set_id, batch):
                                yield d
                for uri in overlay:
                    seen.add(uri)
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


async def _audit_oaipmh(ctx: HarvestContext, src: SourceConfig) -> AsyncGenerator[Difference, None]:
    """An OAI-PMH source: a full ListRecords walk against the store, record by record (the sha-256 of
    the canonical metadata, as ``harvest/oaipmh.py`` stores it; a deleted record must not be held)."""
    set_url = set_key(src)
    set_id = next((s["id"] for s in ctx.reader.sets(src.name) if s["capabilitylist_url"] == set_url), None)
    with tempfile.TemporaryDirectory() as tmp:
        seen = _SeenSet(Path(tmp))
        try:
            batch: list[Entry] = []
            records = OaiHarvest(ctx, src, set_id or 0).records()
            async with aclosing(records):
                async for rec in records:
                    seen.add(rec.identifier)
                    if rec.content is None:
                        md = Md(change=DELETED)
                    else:
                        md = Md(
                            hash=f"sha-256:{hashlib.sha256(rec.content).hexdigest()}", length=len(rec.content)
                        )
                    batch.append(Entry(rec.identifier, md=md))
                    if len(batch) >= 1000:
                        for d in _check(ctx, src.name, set_url, set_id, batch):
                            yield d
            for d in _check(ctx, src.name, set_url, set_id, batch):
                yield d
            if set_id is not None:
                for held in ctx.reader.iter_resources(set_id):
                    if held.uri not in seen:
                        yield Difference(src.name, set_url, held.uri, "extra", "held but not listed upstream")
        finally:
            seen.close()
