"""Metadata records of harvested resources (§14.5: ``rs:ln rel="describedby"``), for filter plugins.

A filter may ask for an entry's record; rsagg fetches it once and keeps it: records are blobs like any
content, indexed by URL in the ``documents`` table. A record that is itself a resource of the set (the
usual case: a Source lists its metadata records too) is read from the store without any request. A cached
record is refetched once per sync run (records change: a Source need not announce their hash) and when
the link announces a hash that differs from the one held. A record that cannot be fetched raises, so a
filter has no say on that entry this time rather than dropping it over a network error.
"""

from __future__ import annotations

import logging

import trio

from ..rs.model import Entry
from ..store.calls import limiter_of
from .access import for_source
from .context import HarvestContext
from .fetch import FetchError

log = logging.getLogger("rsagg.harvest")

#: Metadata records are small documents; a bigger one is not a record a filter should parse.
MAX_RECORD_BYTES = 4 * 1024 * 1024


class MetadataRecords:
    """``await records(entry)`` → the bytes of the entry's describedby record, or None."""

    def __init__(self, ctx: HarvestContext, set_id: int, source: str) -> None:
        self.ctx, self.set_id, self.source = ctx, set_id, source
        self._inflight: dict[str, trio.Event] = {}
        self._fresh: set[str] = set()  # cached records fetched again in this run

    @for_source
    async def __call__(self, entry: Entry) -> bytes | None:
        links = entry.links_by_rel("describedby")
        if not links:
            return None
        link = links[0]
        url = link.href
        while url in self._inflight:  # one fetch per record, however many workers ask at once
            await self._inflight[url].wait()
        wanted = link.hashes.get("sha-256")
        # a state read and blob lookups (an S3 request): in a worker thread, never in the event loop
        sha = await trio.to_thread.run_sync(self._held, url, link.hashes, limiter=limiter_of(self.ctx.reader))
        if sha is None or (wanted is not None and wanted != sha):
            done = self._inflight[url] = trio.Event()
            try:
                sha = await self._fetch(url)
            finally:
                del self._inflight[url]
                done.set()
        return await trio.to_thread.run_sync(self._read, sha)

    def _held(self, url: str, announced: dict[str, str]) -> str | None:
        """sha256 of a copy we hold: the record as a harvested resource, else a cached document."""
        row = self.ctx.reader.resource(self.set_id, url)
        if row is not None and not row.deleted and row.sha256 and self.ctx.blobs.exists(row.sha256):
            if all(row.hashes.get(a, d) == d for a, d in announced.items()):
                return row.sha256
        doc = self.ctx.reader.document(url)
        if url in self._fresh and doc and doc.sha256 and self.ctx.blobs.exists(doc.sha256):
            return doc.sha256
        return None

    async def _fetch(self, url: str) -> str:
        try:
            got = await self.ctx.fetcher.get_bytes(url, max_bytes=MAX_RECORD_BYTES)
        except FetchError as exc:
            log.warning("source=%s url=%s metadata record unavailable: %s", self.source, url, exc)
            raise
        info = await trio.to_thread.run_sync(self.ctx.blobs.put_bytes, got.content)
        etag = got.headers.get("etag") if got.headers else None
        await self.ctx.write(
            self.ctx.writer.put_document, url, self.source, "metadata", etag=etag, last_modified=None,
            sha256=info.sha256,
        )  # fmt: skip
        self._fresh.add(url)
        return info.sha256

    def _read(self, sha: str) -> bytes:
        with self.ctx.blobs.open(sha) as f:
            return f.read(MAX_RECORD_BYTES + 1)[:MAX_RECORD_BYTES]
