"""The one change pipeline (ARCHITECTURE invariant 1).

Every change — from a Resource List during a baseline, a Change List, a dump or a notification — goes
through ``Pipeline.run``: fetch and verify into an uncommitted blob, then, in the order the changes were
given, commit a batch of blobs (durable) and then one state transaction that writes the resources, the
changelog and the cursor together (invariant 2). Fetches run concurrently; commits happen strictly in input
order, so the cursor never moves past a change that is not applied, and a restart never applies one twice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import datetime

import trio

from ..rs.model import CREATED, DELETED, PATCH_REL, UPDATED, Entry
from ..store.blobs import BlobInfo, BlobWriter
from ..store.state import Change, Cursor, Resource
from .context import HarvestContext
from .fetch import Expected, FetchedResource, FetchError
from .patch import fetch_by_patch

log = logging.getLogger("rsagg.harvest")

#: Patched content is read whole into memory; bigger stored versions are fetched from ``loc`` instead.
MAX_PATCH_BASE_BYTES = 64 * 1024 * 1024


@dataclass
class Work:
    """One change to bring into the store, with the cursor that records it (and all before it) applied."""

    entry: Entry
    change: str = CREATED
    cursor_after: Cursor | None = None
    generation: int | None = None
    #: Content that already arrived (e.g. from a dump package): verified, finished, not committed.
    blob: BlobWriter | None = None
    info: BlobInfo | None = None


@dataclass
class Failure:
    uri: str
    kind: str
    message: str


@dataclass
class PipelineStats:
    seen: int = 0
    fetched: int = 0
    unchanged: int = 0
    applied: dict[str, int] = field(default_factory=dict)  # logged change kind -> count
    #: Failed changes by URI, decided in commit order: a later successful change of the same URI
    #: supersedes an earlier failure (an old Change List entry announces the hash of an old version).
    failed: dict[str, Failure] = field(default_factory=dict)
    bytes: int = 0
    last_datetime: datetime | None = None

    @property
    def failures(self) -> list[Failure]:
        return list(self.failed.values())


@dataclass
class _Result:
    work: Work
    change: Change | None
    blob: BlobWriter | None = None
    failure: Failure | None = None


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The error that stopped a nursery, for callers that handle DumpError, FetchError... by type.

    When one task fails, trio cancels its siblings; the group then holds that error (plus nothing, or
    Cancelled). A genuine multi-failure group is returned as is.
    """
    leaves: list[BaseException] = []

    def walk(g: BaseExceptionGroup) -> None:
        for e in g.exceptions:
            walk(e) if isinstance(e, BaseExceptionGroup) else leaves.append(e)

    walk(group)
    real = [e for e in leaves if not isinstance(e, trio.Cancelled)]
    return real[0] if len(real) == 1 else group


def expected_of(entry: Entry) -> Expected:
    md = entry.md
    return Expected(hashes=entry.hashes, length=md.length if md else None)


def candidate_urls(entry: Entry) -> list[str]:
    """Mirrors first in ``pri`` order, then ``loc`` itself (§14.2)."""
    urls = [ln.href for ln in entry.links_by_rel("duplicate")]
    return [*urls, entry.loc] if entry.loc not in urls else urls


def unchanged(existing: Resource | None, entry: Entry, blob_exists: Callable[[str], bool]) -> bool:
    """True when the stored version already has every digest (and the length) the upstream announces."""
    if existing is None or existing.deleted or not existing.sha256:
        return False
    announced = entry.hashes
    common = [a for a in announced if a in existing.hashes]
    if not common or any(existing.hashes[a] != announced[a] for a in common):
        return False
    length = entry.md.length if entry.md else None
    if length is not None and existing.length is not None and length != existing.length:
        return False
    return blob_exists(existing.sha256)


def change_from(work: Work, info: BlobInfo | None, content_type: str | None = None) -> Change:
    e, md = work.entry, work.entry.md
    return Change(
        uri=e.loc,
        change=work.change,
        sha256=info.sha256 if info else None,
        length=info.length if info else None,
        type=(md.type if md and md.type else content_type),
        encoding=md.encoding if md else None,
        hashes=dict(info.hashes) if info else {},
        lastmod=e.lastmod,
        upstream_datetime=md.datetime if md else None,
        links=list(e.links),
        md_extra=dict(md.extra) if md else {},
        entry_extra=list(e.extra),
        generation=work.generation,
    )


class Pipeline:
    """Bring an ordered stream of ``Work`` into one set of the store."""

    def __init__(
        self, ctx: HarvestContext, set_id: int, source: str, *, progress: Callable[[int], None] | None = None
    ):
        self.ctx = ctx
        self.set_id = set_id
        self.source = source
        self.stats = PipelineStats()
        self._progress = progress
        hc = ctx.config.harvest
        self._workers = hc.workers
        self._batch_size = hc.batch_size
        # Bounds everything issued but not yet committed (ARCHITECTURE invariant 4: bounded queues).
        self._inflight = trio.Semaphore(hc.workers * 4 + hc.batch_size)

    async def run(self, items: AsyncGenerator[Work, None]) -> PipelineStats:
        work_send, work_recv = trio.open_memory_channel[tuple[int, Work]](self._workers * 2)
        result_send, result_recv = trio.open_memory_channel[tuple[int, _Result]](math.inf)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._produce, items, work_send)
                async with result_send:
                    for _ in range(self._workers):
                        nursery.start_soon(self._work, work_recv.clone(), result_send.clone())
                await work_recv.aclose()
                nursery.start_soon(self._commit, result_recv)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        return self.stats

    async def _produce(self, items: AsyncGenerator[Work, None], send: trio.MemorySendChannel) -> None:
        # Close the generator in the task that iterates it: its context managers (HTTP streams, cancel
        # scopes) must exit in the task that entered them.
        async with send, aclosing(items):
            seq = 0
            async for work in items:
                await self._inflight.acquire()
                await send.send((seq, work))
                seq += 1
                self.stats.seen += 1

    async def _work(self, recv: trio.MemoryReceiveChannel, send: trio.MemorySendChannel) -> None:
        async with recv, send:
            async for seq, work in recv:
                await send.send((seq, await self._prepare(work)))

    async def _prepare(self, work: Work) -> _Result:
        """Fetch and verify what a change needs; never touches the state."""
        entry = work.entry
        if work.change == DELETED:
            return _Result(work, change_from(work, None))
        if work.blob is not None:
            return _Result(work, change_from(work, work.info), work.blob)
        existing = self.ctx.reader.resource(self.set_id, entry.loc)
        if unchanged(existing, entry, self.ctx.blobs.exists):
            self.stats.unchanged += 1
            assert existing is not None
            info = BlobInfo(existing.sha256, existing.length or 0, dict(existing.hashes))
            return _Result(work, change_from(work, info, existing.type))
        try:
            fetched = await self._fetch(entry, existing)
        except FetchError as exc:
            log.warning("source=%s url=%s fetch failed (%s): %s", self.source, entry.loc, exc.kind, exc)
            failure = Failure(entry.loc, exc.kind, str(exc))
            if (
                existing is not None
                and not existing.deleted
                and existing.sha256
                and work.generation is not None
            ):
                # Keep the stored version in this baseline generation rather than tombstone it for a
                # failure that may be transient; the failure is reported and retried on the next run.
                info = BlobInfo(existing.sha256, existing.length or 0, dict(existing.hashes))
                keep = Work(entry, work.change, work.cursor_after, work.generation)
                return _Result(keep, change_from(keep, info, existing.type), failure=failure)
            return _Result(work, None, failure=failure)
        self.stats.fetched += 1
        self.stats.bytes += fetched.info.length
        return _Result(work, change_from(work, fetched.info, fetched.content_type), fetched.blob)

    async def _fetch(self, entry: Entry, existing: Resource | None) -> FetchedResource:
        expected = expected_of(entry)
        patches = entry.links_by_rel(PATCH_REL)
        if patches and existing is not None and not existing.deleted and existing.sha256:
            if (existing.length or 0) <= MAX_PATCH_BASE_BYTES and (expected.hashes or expected.length):
                with self.ctx.blobs.open(existing.sha256) as f:
                    current = f.read()
                for link in patches:
                    got = await fetch_by_patch(
                        self.ctx.fetcher, link, current, expected, self.ctx.blobs, self.ctx.patch_formats
                    )
                    if got is not None:
                        return got
        return await self.ctx.fetcher.resource(candidate_urls(entry), expected, self.ctx.blobs)

    async def _commit(self, recv: trio.MemoryReceiveChannel) -> None:
        """Release results in input order, in batches: blobs durable first, then one state transaction."""
        pending: dict[int, _Result] = {}
        next_seq = 0
        batch: list[_Result] = []
        async with recv:
            async for seq, result in recv:
                pending[seq] = result
                while next_seq in pending:
                    batch.append(pending.pop(next_seq))
                    next_seq += 1
                    if len(batch) >= self._batch_size:
                        await self._flush(batch)
                        batch = []
            await self._flush(batch)

    async def _flush(self, batch: list[_Result]) -> None:
        if not batch:
            return
        writers = [r.blob for r in batch if r.blob is not None and r.change is not None]
        await self.ctx.commit_blobs(writers)
        changes = [r.change for r in batch if r.change is not None]
        cursor = next((r.work.cursor_after for r in reversed(batch) if r.work.cursor_after), None)
        applied = await self.ctx.write(self.ctx.writer.apply, self.set_id, changes, cursor)
        for ch in applied:
            self.stats.applied[ch.change] = self.stats.applied.get(ch.change, 0) + 1
        for r in batch:
            uri = r.work.entry.loc
            if r.failure is not None:
                self.stats.failed[uri] = r.failure
            else:
                self.stats.failed.pop(uri, None)
            dt = r.work.entry.md.datetime if r.work.entry.md else None
            if dt is not None:
                self.stats.last_datetime = dt
        for _ in batch:
            self._inflight.release()
        if self._progress:
            self._progress(len(batch))


__all__ = ["CREATED", "DELETED", "UPDATED", "Pipeline", "PipelineStats", "Work"]
