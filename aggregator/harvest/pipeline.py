"""The one change pipeline (docs/architecture.md invariant 1).

Every change — from a Resource List during a baseline, a Change List, a dump or a notification — goes
through ``Pipeline.run``: fetch and verify into an uncommitted blob, then, in the order the changes were
given, commit a batch of blobs (durable) and then one state transaction that writes the resources, the
changelog and the cursor together (invariant 2). Fetches run concurrently; commits happen strictly in input
order, so the cursor never moves past a change that is not applied, and a restart never applies one twice.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import AbstractContextManager, aclosing, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import trio

from ..rs.model import CREATED, DELETED, PATCH_REL, RS_NS, UPDATED, Entry
from ..store.blobs import BlobInfo, BlobWriter
from ..store.calls import limiter_of
from ..store.interface import StateStore
from ..store.rows import Change, Cursor, FailedChange, Resource, ResourceValidators, RetryChanges
from .access import for_source
from .context import HarvestContext
from .deviations import deviation
from .fetch import Expected, FetchedResource, FetchError, ResourceNotModified, SlotKeeper
from .metadata import MetadataRecords
from .patch import fetch_by_patch
from .versions import (
    RecentVersions,
    fetch_version,
    memento_links,
    note_deletion,
    older_than_held,
    version_time,
)

log = logging.getLogger("rsagg.harvest")

#: Patched content is read whole into memory; bigger stored versions are fetched from ``loc`` instead.
MAX_PATCH_BASE_BYTES = 64 * 1024 * 1024
#: Most changes whose stored rows are looked up together, in one worker-thread hop.
LOOKUP_BATCH = 64
#: Up to this many changes are looked up directly on a local state (SQLite): a thread hop costs more
#: than their few indexed reads (``store/calls.py``), and a small set's changes come a few at a time.
#: Not more: an unchanged change asks the blob store whether it holds the content (``unchanged``), a
#: request each on a remote store (S3), which must not stall the event loop.
DIRECT_LOOKUP = 4


@dataclass
class Work:
    """One change to bring into the store, with the cursor that records it (and all before it) applied."""

    entry: Entry
    change: str = CREATED
    cursor_after: Cursor | None = None
    generation: int | None = None
    #: Content that already arrived (e.g. from a dump package): verified, finished, not committed.
    blob: BlobWriter | None = None
    #: What ``blob`` holds; or, without a writer, content already durable in the store (an OAI-PMH
    #: record stored by a worker process: ``harvest/offload.py``).
    info: BlobInfo | None = None
    #: The state change already made, exactly what ``change_from(self, self.info)`` makes (an OAI-PMH
    #: record: ``OaiHarvest._work``); ``run_batches`` takes it as it is, for a work no plugin replaced.
    ready: Change | None = None


@dataclass
class Failure:
    uri: str
    kind: str
    message: str
    #: The memento URI of a version that could not be had (``harvest/versions.py``): a lost version is
    #: its own failure, which a later change of the same URI does not supersede.
    version: str | None = None

    @property
    def key(self) -> str:
        return self.uri if self.version is None else f"{self.uri} {self.version}"


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
    #: What the upstream answered with the version fetched (kept for a conditional re-check).
    validators: ResourceValidators | None = None
    #: The content came from a memento (§14.6): its order against the versions ahead is checked.
    memento: bool = False


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


#: The start of a ResourceSync document (§7): a <urlset>/<sitemapindex> root, the rs namespace, a capability.
_RS_ROOT = re.compile(
    rb"^(?:\xef\xbb\xbf)?\s*(?:<\?xml[^>]*\?>\s*)?(?:<!--.*?-->\s*)*<(?:[\w.-]+:)?(?:urlset|sitemapindex)\b",
    re.S,
)
_RS_CAPABILITY = re.compile(rb"""<(?:[\w.-]+:)?md\b[^>]*\bcapability\s*=\s*["']([^"']+)""")
_SNIFF = 4096


def list_document(blob: BlobWriter) -> str | None:
    """The capability of a fetched body that is itself a ResourceSync document, else None.

    A list that names another list as one of its resources (POD's 2020 Resource List "index" did, with a
    <urlset> of Resource Lists) would otherwise be stored as a resource while what it lists is never
    read: such a body is refused (a named failure, never "ok"). The harvester follows the entries that
    say they are documents (``lists._as_lists``); this catches the ones that do not. Read from the first
    bytes of the finished blob (``BlobWriter.peek``).
    """
    peek = getattr(blob, "peek", None)  # a plugin's writer may not have it: then not checked
    head = peek(_SNIFF) if peek is not None else None
    if not head:
        return None
    head = bytes(head[:_SNIFF])
    if RS_NS.encode() not in head or not _RS_ROOT.match(head):
        return None
    m = _RS_CAPABILITY.search(head)
    return m.group(1).decode("ascii", "replace") if m else None


def expected_of(entry: Entry) -> Expected:
    md = entry.md
    return Expected(hashes=entry.hashes, length=md.length if md else None)


def candidate_urls(entry: Entry) -> list[str]:
    """Mirrors first in ``pri`` order, then ``loc`` itself (§14.2)."""
    urls = [ln.href for ln in entry.links_by_rel("duplicate")]
    return [*urls, entry.loc] if entry.loc not in urls else urls


def unchanged(
    existing: Resource | None,
    entry: Entry,
    blob_exists: Callable[[str], bool],
    confirmed: datetime | None = None,
) -> bool:
    """True when the stored version is what the upstream announces, so nothing need be fetched.

    In the order of trust: a digest both sides have decides; else a ``length`` that differs says
    changed; else a ``lastmod`` equal to the held one (§7: the resource's last modification), or to the
    one under which the held version was last confirmed (``confirmed``: a fetch or a 304 found the same
    content), says unchanged. An entry that announces none of them cannot be decided without a fetch.
    """
    if existing is None or existing.deleted or not existing.sha256:
        return False
    announced = entry.hashes
    common = [a for a in announced if a in existing.hashes]
    if common and any(existing.hashes[a] != announced[a] for a in common):
        return False
    length = entry.md.length if entry.md else None
    if length is not None and existing.length is not None and length != existing.length:
        return False
    if not common and (entry.lastmod is None or entry.lastmod not in (existing.lastmod, confirmed)):
        return False
    return blob_exists(existing.sha256)


def told_apart(existing: Resource, entry: Entry) -> bool:
    """The entry says by itself that the held version is not the one it announces (a digest both sides
    have differs, or the length does): a 304 could not overrule that, so such a fetch is unconditional."""
    announced = entry.hashes
    if any(a in existing.hashes and existing.hashes[a] != announced[a] for a in announced):
        return True
    length = entry.md.length if entry.md else None
    return length is not None and existing.length is not None and length != existing.length


def change_from(work: Work, info: BlobInfo | None, content_type: str | None = None) -> Change:
    e, md = work.entry, work.entry.md
    # Positional, in Change's field order, and no copies of empty containers: this runs per record.
    return Change(
        e.loc,
        work.change,
        info.sha256 if info else None,
        info.length if info else None,
        md.type if md and md.type else content_type,
        md.encoding if md else None,
        dict(info.hashes) if info else {},
        e.lastmod,
        md.datetime if md else None,
        list(e.links),
        dict(md.extra) if md and md.extra else {},
        list(e.extra) if e.extra else [],
        work.generation,
    )


def _arrived(w: Work) -> _Result | None:
    """The result of a change whose content is already here (a dump's): nothing to look up or fetch."""
    return _Result(w, change_from(w, w.info), w.blob) if w.blob is not None and w.change != DELETED else None


def _hand(send: trio.MemorySendChannel | _InOrder, item: Any) -> Awaitable[None] | None:
    """Hand ``item`` on at once when ``send`` has room (None), else the send to await.

    Why: ``await send.send(item)`` passes through trio's scheduler even when the channel has room, and
    a resource crossed four channels on its way (filter, lookup, fetch, commit): at 0 ms latency those
    passes were a tenth of a harvest's CPU. Skipping them starves no one: every caller awaits again
    (a receive, a request, a semaphore) before it hands on more than a channel's buffer."""
    try:
        send.send_nowait(item)
    except trio.WouldBlock:
        return send.send(item)
    return None


async def _receive(recv: trio.MemoryReceiveChannel) -> Any:
    """The next item of ``recv``, without a pass through the scheduler when one is already there: the
    receiving side of ``_hand``. Raises EndOfChannel when ``recv`` is closed and empty."""
    try:
        return recv.receive_nowait()
    except trio.WouldBlock:
        return await recv.receive()


class _InOrder:
    """The sending side of the results channel: ``(seq, result)`` items come from many tasks in any
    order; the commit task receives them in ``seq`` order, a full batch (``batch_size``) at a time,
    and what is left at the end from ``rest()``. Used like a ``MemorySendChannel`` (``send_nowait``,
    ``send``, ``clone``, ``close``, ``with``); clones share the order.

    Why: the commit task took one result at a time, each one a wake-up and a pass through the
    scheduler per resource; it only ever acted on a full batch (or the end), so the batches are
    formed where the results are handed over, synchronously, exactly as it formed them."""

    __slots__ = ("_order", "_send")

    def __init__(self, send: trio.MemorySendChannel, order: _Order) -> None:
        self._send = send  # unbounded: a batch never waits to be handed over
        self._order = order

    def send_nowait(self, item: tuple[int, _Result]) -> None:
        order = self._order
        seq, result = item
        pending = order.pending
        pending[seq] = result
        while order.next_seq in pending:
            order.batch.append(pending.pop(order.next_seq))
            order.next_seq += 1
            if len(order.batch) >= order.size:
                batch, order.batch = order.batch, []
                self._send.send_nowait(batch)

    async def send(self, item: tuple[int, _Result]) -> None:
        self.send_nowait(item)
        await trio.lowlevel.checkpoint()

    def clone(self) -> _InOrder:
        return _InOrder(self._send.clone(), self._order)

    def close(self) -> None:
        self._send.close()

    def __enter__(self) -> _InOrder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Order:
    """What ``_InOrder``'s clones share: results waiting for those before them, the batch forming."""

    size: int
    pending: dict[int, _Result] = field(default_factory=dict)
    next_seq: int = 0
    batch: list[_Result] = field(default_factory=list)

    def rest(self) -> list[_Result]:
        """The last batch, short of ``size``: what the end of the results releases."""
        batch, self.batch = self.batch, []
        return batch


class _Workers:
    """Up to ``most`` tasks taking the items sent here, each handing one at a time to ``handle(item,
    *outs)`` (``outs``: channels every task gets a clone of). A task is started when an item comes and
    no task is free, so a set of a few changes starts a few tasks, not ``harvest.workers`` of them (all
    started and ended per pipeline, they were part of the per-source cost of many small sources:
    benchmarks/bench_many_sources.py). Used like a send channel: ``send``, and ``with`` to close.

    ``ready(item)``: whether one more task would get to work on ``item`` now; when it says no (e.g. every
    request slot of the item's host is taken, ``Fetcher.host_busy``) no task is started for it and the
    item waits for a running one, which starts more once the item it finished says yes again. The first
    task is always started, so every pipeline moves. Why: many small sources on one host each started
    their tasks at once, thousands of them parked on that host's few slots, each holding its coroutine
    frames, a blob writer and a request (the GC and the scheduler walked them all).
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        handle: Callable[..., Awaitable[None]],
        most: int,
        buffer: int,
        *outs: trio.MemorySendChannel | _InOrder,
        ready: Callable[[object], bool] | None = None,
        keeping: Callable[[Callable[[], bool]], AbstractContextManager[SlotKeeper | None]] | None = None,
    ) -> None:
        self._nursery, self._handle, self._most, self._outs = nursery, handle, most, outs
        self._ready = ready
        self._keeping = keeping
        self._send, self._recv = trio.open_memory_channel[object](buffer)
        self._started = self._free = self._queued = 0
        self._closed = False

    def _grow(self, item: object) -> None:
        """Start one more task when items would wait for one and ``item`` says it could work now."""
        if (
            not self._closed
            and self._queued >= self._free
            and self._started < self._most
            and (self._started == 0 or self._ready is None or self._ready(item))
        ):
            self._started += 1
            self._free += 1
            self._nursery.start_soon(self._run, self._recv.clone(), [o.clone() for o in self._outs])

    async def send(self, item: object) -> None:
        self._grow(item)
        self._queued += 1
        pending = _hand(self._send, item)
        if pending is not None:
            await pending

    async def _run(
        self, recv: trio.MemoryReceiveChannel, outs: list[trio.MemorySendChannel | _InOrder]
    ) -> None:
        try:
            with recv, self._keeping(self._waiting) if self._keeping else nullcontext() as keeper:
                while True:
                    try:
                        try:
                            item = recv.receive_nowait()
                        except trio.WouldBlock:
                            if keeper is not None:  # a slot is kept for the next GET only
                                keeper.hand_back()
                            item = await recv.receive()
                    except trio.EndOfChannel:
                        break
                    self._queued -= 1
                    self._free -= 1
                    await self._handle(item, *outs)
                    self._free += 1
                    if self._queued > self._free and self._ready is not None:
                        self._grow(item)  # items wait that were not given a task: one may start now
        finally:
            for out in outs:
                out.close()

    def _waiting(self) -> bool:
        """An item waits for a task (``keeping``: a task's next GET comes at once)."""
        return self._queued > 0

    @property
    def started(self) -> int:
        """Tasks started so far."""
        return self._started

    @property
    def idle(self) -> int:
        """Tasks started that hold no item (just started, or between two): each takes the next one."""
        return self._free

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True  # the items sent are with the running tasks; none is started any more
        self._send.close()
        self._recv.close()
        for out in self._outs:
            out.close()


class _Unlooked:
    """The producer's side of a pipeline with nothing to look up (``Pipeline.run``: a set that held no
    row): each change goes to the fetch tasks, or, its content already here (a dump's), to the commit,
    as ``Pipeline._look_up`` would send a change it found no row for."""

    __slots__ = ("_done", "_work")

    def __init__(self, work: _Workers, done: _InOrder) -> None:
        self._work, self._done = work, done

    async def send(self, item: tuple[int, Work]) -> None:
        seq, w = item
        here = _arrived(w)
        if here is None:
            await self._work.send((seq, w, None, None))
        elif (pending := _hand(self._done, (seq, here))) is not None:
            await pending

    def __enter__(self) -> _Unlooked:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._work, self._done:
            pass


class Pipeline:
    """Bring an ordered stream of ``Work`` into one set of the store."""

    def __init__(
        self,
        ctx: HarvestContext,
        set_id: int,
        source: str,
        *,
        progress: Callable[[int], None] | None = None,
        on_batch: Callable[[list[str], list[Change], list[Failure]], None] | None = None,
        empty: bool = False,
    ):
        """``on_batch(uris, applied, failures)``: told after each batch committed, with the URIs it
        carried, the changes that changed state and the changes that failed (reconciliation logs each
        repair with its cause from it). ``empty``: the caller knows the set holds nothing (no row, no
        retry: ``StateStore.holds_nothing``), so nothing is read or looked up; a set seen for the first
        time, whose reads were a good part of a small new Source's cost
        (benchmarks/bench_many_sources.py)."""
        self.ctx = ctx
        self._on_batch = on_batch
        self.set_id = set_id
        self.source = source
        self.stats = PipelineStats()
        self._progress = progress
        hc = ctx.config.harvest
        self._workers = hc.workers
        self._batch_size = hc.batch_size
        # Bounds everything issued but not yet committed (docs/architecture.md invariant 4: bounded queues).
        self._inflight = trio.Semaphore(hc.workers * 4 + hc.batch_size)
        # Memento versions committed lately, to keep the changelog going forward (harvest/versions.py).
        self._recent = RecentVersions(hc.workers * 4 + hc.batch_size * 2)
        plugins = ctx.plugins
        self._filtering = bool(plugins.pm.hook.rsagg_filter_harvest.get_hookimpls())
        self._events = any(
            getattr(plugins.pm.hook, h).get_hookimpls()
            for h in ("rsagg_resource_stored", "rsagg_resource_deleted", "rsagg_change_published")
        )
        self._metadata = MetadataRecords(ctx, set_id, source)
        self._set_name = str(set_id)
        # URIs with a failed change waiting to be retried (the state's retries): cleared once one applies.
        self._retrying: set[str] = set()
        #: Those still to be tried (not ended), which a snapshot may supersede.
        self._waiting: frozenset[str] = frozenset()
        self._listed: set[str] = set()  # the waiting URIs this run's items listed
        # Records appended after this point are announced (rsagg_change_published).
        self._last_seq = 0
        self._primed = False
        #: The set held no row when the run started (``empty``, or a local state's read: ``run``):
        #: nothing to look up.
        self._empty = empty
        self._hosts: dict[str, str] = {}  # scheme://authority -> host (``_host_free``)
        self._fetch_tasks: _Workers | None = None  # ``run``'s fetch tasks (``_host_free``)
        #: ``run``'s ``last``, and what its write returned once made in the last batch's transaction.
        self._last: Callable[[], Callable[[], Any] | None] | None = None
        self.last_written: tuple[Any] | None = None

    async def _prime(self) -> None:
        """What the run starts from, read from the state once (``HarvestContext.read``: not in the event
        loop on a server backend)."""
        if self._primed:
            return
        ctx, set_id = self.ctx, self.set_id
        if self._events:  # the set's name is for the event hooks only (``announce``)
            # The source's own sets only: reading every set of every source made a harvest of N
            # sources cost N^2 rows (benchmarks/bench_many_sources.py).
            sets = await ctx.read(ctx.reader.sets, self.source)
            self._set_name = next((s.name for s in sets if s.id == set_id), str(set_id))
        if not self._empty:  # else no retry to read
            self._retrying = await ctx.read(ctx.reader.retry_uris, set_id)
            self._waiting = frozenset(e.loc for e, _, _ in await ctx.read(ctx.reader.pending_retries, set_id))
        self._last_seq = await ctx.read(ctx.reader.last_seq) if self._events else 0
        self._primed = True

    @for_source  # the tasks started below make their requests for the source
    async def run(
        self, items: AsyncGenerator[Work, None], *, last: Callable[[], Callable[[], Any] | None] | None = None
    ) -> PipelineStats:
        """``last``: asked, once every item is in (``stats.failed`` holding every failure of the run),
        for a state write to make in the transaction of the last batch, after its changes
        (``last_written`` then holds its result); it answers None when there is none. Why: a
        baseline's end (``finish_baseline``) right after the last batch was a thread hop and a
        transaction of its own, a good part of a small Source's cost (benchmarks/bench_many_sources.py).
        Not asked when the last batch is empty."""
        self._last = last
        await self._prime()
        reader = self.ctx.reader
        if limiter_of(reader) is None and not self._empty:
            # A set that holds no row yet (a new Source's first baseline) has nothing to look up: its
            # changes skip the lookup, a thread hop per batch of a small set (one indexed read here,
            # direct on a local state). Rows this run commits meanwhile are not looked up (a URI listed
            # twice is fetched twice), as when the second lookup came before the first one's commit.
            self._empty = not list(reader.iter_resources(self.set_id, include_deleted=True, limit=1))
        new_send, new_recv = trio.open_memory_channel[tuple[int, Work]](LOOKUP_BATCH)
        batches, result_recv = trio.open_memory_channel[list[_Result]](math.inf)
        order = _Order(self._batch_size)
        result_send = _InOrder(batches, order)
        send: trio.MemorySendChannel | _Workers | _Unlooked = new_send
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._commit, result_recv, order)
                with result_send:
                    if self._filtering:  # plugins decide per entry, concurrently (metadata fetches)
                        send = _Workers(nursery, self._filter_one, self._workers, self._workers,
                                        new_send.clone(), result_send.clone())  # fmt: skip
                        new_send.close()
                    workers = _Workers(nursery, self._work_one, self._workers, self._workers * 2,
                                       result_send.clone(), ready=self._host_free,
                                       keeping=self.ctx.fetcher.keeping_slots)  # fmt: skip
                    self._fetch_tasks = workers
                    if self._empty and not self._filtering:
                        # Nothing to look up: the producer hands each change to the fetch tasks
                        # itself, without the lookup task and its channel between (a task and a
                        # channel per pipeline, a good part of a small new Source's cost).
                        new_send.close()
                        new_recv.close()
                        send = _Unlooked(workers, result_send.clone())
                    else:
                        nursery.start_soon(self._look_up, new_recv, workers, result_send.clone())
                # The changes are produced here, in the task that opened their generator (no task of
                # their own), while the others fetch and commit them.
                await self._produce(items, send)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        finally:  # they hold this pipeline (its methods, the caller's ``last``): freed with it, not
            self._fetch_tasks = self._last = None  # left in a cycle for the collector
        return self.stats

    @for_source
    async def run_batches(self, batches: AsyncGenerator[list[Work], None]) -> PipelineStats:
        """Like ``run``, for changes that need neither a fetch nor a lookup: each carries its content,
        finished (``Work.blob``, committed already or not), or is a deletion; a producer that has them
        a batch at a time (an OAI-PMH page) hands the batch over whole.

        Why: ``run`` moves every change through three tasks and channels, which for content already in
        memory cost more of the event loop's time than the rest of the work; here a batch goes straight
        to its commit (blobs durable, then one state transaction), in the order given, exactly as
        ``run`` commits it. ``rsagg_filter_harvest`` plugins decide per entry, as in ``run`` (one entry
        after the other here).
        """
        async with aclosing(batches):
            async for works in batches:
                results: list[_Result] = []
                waiting = self._waiting
                for listed in works:
                    if waiting and listed.entry.loc in waiting:
                        self._listed.add(listed.entry.loc)
                    work = await self._filtered(listed) if self._filtering else listed
                    if work is None:
                        results.append(_Result(listed, None))
                    elif work.ready is not None and not self._filtering:  # a plugin saw the entry
                        results.append(_Result(work, work.ready, work.blob))
                    elif work.change == DELETED:
                        results.append(_Result(work, change_from(work, None)))
                    elif work.blob is not None or work.info is not None:
                        results.append(_Result(work, change_from(work, work.info), work.blob))
                    else:
                        raise ValueError(f"{work.entry.loc}: run_batches takes content that arrived")
                self.stats.seen += len(results)
                await self._flush(results, release=False)
        return self.stats

    async def _produce(
        self, items: AsyncGenerator[Work, None], send: trio.MemorySendChannel | _Workers | _Unlooked
    ) -> None:
        # Close the generator in the task that iterates it: its context managers (HTTP streams, cancel
        # scopes) must exit in the task that entered them.
        with send:
            async with aclosing(items):
                seq = 0
                async for work in items:
                    if work.entry.loc in self._waiting:
                        self._listed.add(work.entry.loc)
                    try:  # as ``_hand``: no pass through the scheduler while there is room
                        self._inflight.acquire_nowait()
                    except trio.WouldBlock:
                        await self._inflight.acquire()
                    pending = (
                        send.send((seq, work))
                        if not isinstance(send, trio.MemorySendChannel)
                        else _hand(send, (seq, work))
                    )
                    if pending is not None:
                        await pending
                    seq += 1
                    self.stats.seen += 1

    async def _filter_one(self, item: tuple[int, Work], send: trio.MemorySendChannel, done: _InOrder) -> None:
        """``rsagg_filter_harvest``: an entry any plugin refuses is not harvested. In a baseline it is not
        marked seen, so a copy we hold is tombstoned when the baseline finishes; in incremental sync a
        refused created/updated becomes a deletion of what we hold. Runs before the lookup, so narrowing a
        filter also drops copies that are unchanged upstream."""
        seq, work = item
        kept = await self._filtered(work)
        pending = _hand(done, (seq, _Result(work, None))) if kept is None else _hand(send, (seq, kept))
        if pending is not None:
            await pending

    async def _filtered(self, work: Work) -> Work | None:
        """The change as ``rsagg_filter_harvest`` leaves it: itself, a deletion (refused in incremental
        sync), or None (refused in a baseline: not marked seen)."""
        if work.change == DELETED:
            return work
        answers = await self.ctx.plugins.acall(
            "rsagg_filter_harvest", source=self.source, entry=work.entry, metadata=self._metadata
        )
        if not any(answer is False for answer in answers):
            return work
        if work.blob is not None:
            work.blob.abort()
        if work.generation is not None:
            return None
        return Work(work.entry, DELETED, work.cursor_after)

    async def _look_up(self, recv: trio.MemoryReceiveChannel, work: _Workers, done: _InOrder) -> None:
        """Find the stored row of each change, in batches off the event loop; unchanged ones are done.

        Why: one indexed query per change on the trio thread cost ~35 us each of the loop's time (and a
        re-baseline of unchanged resources is nothing but such lookups). Changes that arrive together
        (a Resource List parses much faster than resources download) share one thread hop; a change
        arriving alone is looked up alone, so nothing waits for a batch to fill. A few changes on a
        local state are looked up directly (``DIRECT_LOOKUP``): cheaper than the hop.
        """
        with recv, work, done:
            async for first in recv:
                batch = [first]
                while len(batch) < LOOKUP_BATCH:
                    try:
                        batch.append(recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                works = [w for _, w in batch]
                if not self._empty and any(w.change != DELETED and w.blob is None for w in works):
                    limiter = limiter_of(self.ctx.reader)
                    if limiter is None and len(works) <= DIRECT_LOOKUP:
                        found = self._stored(works)
                    else:
                        found = await trio.to_thread.run_sync(self._stored, works, limiter=limiter)
                else:  # deletions and content from dumps: nothing to look up
                    found = [(None, False, None)] * len(works)
                for (seq, w), (existing, same, validators) in zip(batch, found, strict=True):
                    if (here := _arrived(w)) is not None:
                        pending = _hand(done, (seq, here))
                    elif same:
                        self.stats.unchanged += 1
                        assert existing is not None and existing.sha256 is not None
                        info = BlobInfo(existing.sha256, existing.length or 0, dict(existing.hashes))
                        pending = _hand(done, (seq, _Result(w, change_from(w, info, existing.type))))
                    else:
                        await work.send((seq, w, existing, validators))
                        continue
                    if pending is not None:
                        await pending

    def _stored(self, batch: list[Work]) -> list[tuple[Resource | None, bool, ResourceValidators | None]]:
        """(stored row, True when it already is what the entry announces, the upstream's validators of
        the held version when it must be fetched) per change; in a thread."""
        out: list[tuple[Resource | None, bool, ResourceValidators | None]] = []
        reader = self.ctx.reader
        wanted = [w.entry.loc for w in batch if w.change != DELETED and w.blob is None]
        stored = reader.resources(self.set_id, wanted) if wanted else {}  # one read for all
        for w in batch:
            if w.change == DELETED or w.blob is not None:
                out.append((None, False, None))
                continue
            existing = stored.get(w.entry.loc)
            out.append((existing, unchanged(existing, w.entry, self.ctx.blobs.exists), None))
        # Those to fetch whose held version may be re-checked conditionally (a second read, only then):
        # nothing the entry announces tells it from the held one (only a lastmod, or nothing).
        held = [w.entry.loc for w, (r, same, _) in zip(batch, out, strict=True)
                if not same and r is not None and not r.deleted and r.sha256
                and not told_apart(r, w.entry)]  # fmt: skip
        if held:
            known = reader.resource_validators(self.set_id, held)
            exists = self.ctx.blobs.exists
            for i, (w, (r, same, _)) in enumerate(zip(batch, out, strict=True)):
                v = known.get(w.entry.loc) if not same and r is not None else None  # only those of `held`
                if v is not None and v.sha256 == r.sha256:  # type: ignore[union-attr]
                    out[i] = (r, unchanged(r, w.entry, exists, v.lastmod), v)
        return out

    def _host_free(self, item: object) -> bool:
        """A fetch of this change (``_work_one``'s item) would get a request slot of its host now."""
        entry = item[1].entry  # type: ignore[index]
        duplicates = entry.links_by_rel("duplicate") if entry.links else ()
        url = duplicates[0].href if duplicates else entry.loc
        origin = url[: url.find("/", url.find("//") + 2) % (len(url) + 1)]  # scheme://authority
        host = self._hosts.get(origin)
        if host is None:
            host = self._hosts[origin] = urlsplit(origin).hostname or ""
        if not host:
            return True
        tasks = self._fetch_tasks
        fetcher = self.ctx.fetcher
        # Tasks started and not yet at their request count as taking a slot: else a burst of changes
        # (the first ones of a list) starts ``harvest.workers`` tasks for a host of fewer slots, and
        # the extra tasks then wait for a slot on every request (a park and a wake-up per resource).
        if fetcher.host_busy(host, tasks.idle if tasks is not None else 0):
            return False
        if tasks is None:
            return True
        # Only a sync's share of the host's slots when several syncs of the host run (``admission.py``):
        # its task keeps a slot busy from one GET to the next (``Fetcher.keeping_slots``), so more
        # tasks would only take slots the others' tasks are about to use, each started, parked and
        # ended (many small Sources of one host: benchmarks/bench_many_sources.py).
        syncs = self.ctx.admissions.syncs_of(host)
        return syncs < 2 or tasks.started < fetcher.host_limit(host) // syncs

    async def _work_one(
        self, item: tuple[int, Work, Resource | None, ResourceValidators | None], send: _InOrder
    ) -> None:
        seq, work, existing, validators = item
        pending = _hand(send, (seq, await self._prepare(work, existing, validators)))
        if pending is not None:
            await pending

    async def _prepare(
        self, work: Work, existing: Resource | None, validators: ResourceValidators | None = None
    ) -> _Result:
        """Fetch and verify what a change needs (``existing``: its stored row; ``validators``: what the
        upstream answered with it, for a conditional fetch); never touches the state."""
        entry = work.entry
        if work.change == DELETED:
            note_deletion(entry)
            return _Result(work, change_from(work, None))
        if work.blob is not None:
            return _Result(work, change_from(work, work.info), work.blob)
        mementos = memento_links(entry)
        if mementos and older_than_held(entry, existing):
            _out_of_order(entry)
            # What is held stays: a no-op in the state, and in a baseline the row is seen (not tombstoned).
            assert existing is not None
            if existing.deleted or not existing.sha256:
                return _Result(work, None)
            info = BlobInfo(existing.sha256, existing.length or 0, dict(existing.hashes))
            return _Result(work, change_from(work, info, existing.type))
        try:
            fetched = await self._fetch(entry, existing, validators)
        except ResourceNotModified:  # 304: the upstream still serves the version held
            assert existing is not None and existing.sha256 is not None and validators is not None
            self.stats.unchanged += 1
            held: BlobInfo | None = BlobInfo(existing.sha256, existing.length or 0, dict(existing.hashes))
            confirmed = ResourceValidators(
                entry.loc, existing.sha256, validators.etag, validators.last_modified, entry.lastmod
            )
            return _Result(work, change_from(work, held, existing.type), validators=confirmed)
        except FetchError as exc:
            held = await self._superseded(work, existing, exc)
            if held is not None:
                return _Result(work, change_from(work, held, existing.type if existing else None))
            log.warning("source=%s url=%s fetch failed (%s): %s", self.source, entry.loc, exc.kind, exc)
            failure = Failure(entry.loc, exc.kind, str(exc), mementos[0].href if mementos else None)
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
        capability = list_document(fetched.blob) if fetched.encoding is None else None
        if capability is not None:
            fetched.blob.abort()
            message = (f"{entry.loc} is a ResourceSync document (capability {capability!r}), not a resource: "
                       "not stored, and what it lists is not read")  # fmt: skip
            log.warning("source=%s url=%s %s", self.source, entry.loc, message)
            return _Result(work, None, failure=Failure(entry.loc, "list-document", message))
        self.stats.fetched += 1
        self.stats.bytes += fetched.info.length
        kept = None  # a memento's validators are its own URL's, not <loc>'s: never kept for <loc>
        if not mementos and (fetched.etag or fetched.last_modified or entry.lastmod):
            kept = ResourceValidators(
                entry.loc, fetched.info.sha256, fetched.etag, fetched.last_modified, entry.lastmod
            )
        change = change_from(work, fetched.info, fetched.content_type)
        return _Result(work, change, fetched.blob, validators=kept, memento=bool(mementos))

    async def _superseded(self, work: Work, existing: Resource | None, exc: FetchError) -> BlobInfo | None:
        """A change without datetime whose announced hash the resource no longer has, while it serves
        exactly what we hold: a stale entry replayed (applied by content, README "Change Lists"), not a
        failure. One more fetch decides; nothing unverified is stored (that blob is dropped). Returns the
        held version then, else None."""
        md = work.entry.md
        if (
            exc.kind != "fixity"
            or (md is not None and md.datetime is not None)
            or work.generation is not None
            or existing is None
            or existing.deleted
            or not existing.sha256
        ):
            return None
        urls = candidate_urls(work.entry)
        try:
            fetched = await self.ctx.fetcher.resource(urls, Expected({}), self.ctx.blobs)
        except FetchError:
            return None
        fetched.blob.abort()
        if fetched.info.sha256 != existing.sha256:
            return None
        self.stats.unchanged += 1
        log.info(
            "source=%s url=%s a change without datetime announces another version than the one served, "
            "which is the one held: superseded, nothing to do", self.source, work.entry.loc,
        )  # fmt: skip
        return BlobInfo(existing.sha256, existing.length or 0, dict(existing.hashes))

    async def _fetch(
        self, entry: Entry, existing: Resource | None, validators: ResourceValidators | None = None
    ) -> FetchedResource:
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
        if memento_links(entry):  # the version this entry describes, not whatever <loc> serves now
            return await fetch_version(self.ctx.fetcher, entry, candidate_urls(entry), self.ctx.blobs)
        if validators is not None and self.ctx.blobs.exists(validators.sha256):
            return await self.ctx.fetcher.resource(
                candidate_urls(entry), expected, self.ctx.blobs,
                etag=validators.etag, last_modified=validators.last_modified,
            )  # fmt: skip
        return await self.ctx.fetcher.resource(candidate_urls(entry), expected, self.ctx.blobs)

    def _retry_bookkeeping(self, batch: list[_Result]) -> RetryChanges | None:
        """What the state must record and clear for this batch, in the transaction that applies it.
        Within a batch the last change of a URI decides (a stale entry followed by a good one)."""
        if not self._retrying and all(r.failure is None for r in batch):
            return None  # nothing failed and nothing waits for a retry: the common batch
        last: dict[str, _Result] = {r.work.entry.loc: r for r in batch}
        failed = [
            FailedChange(r.work.entry, r.work.change, r.failure.kind, r.failure.message)
            for r in last.values()
            if r.failure
        ]
        cleared = [u for u, r in last.items() if r.failure is None and u in self._retrying]
        if not failed and not cleared:
            return None
        self._retrying.update(f.entry.loc for f in failed)
        self._retrying.difference_update(cleared)
        return RetryChanges(failed, cleared)

    def unlisted_retries(self) -> RetryChanges | None:
        """After a complete snapshot (a baseline): forget the failed changes of URIs it did not list.
        The snapshot says they are gone; retrying them would fail at every sync from then on. (Those it
        listed were tried again by the run: cleared when they applied, recorded again when not.)"""
        gone = sorted(self._waiting - self._listed)
        if not gone:
            return None
        self._retrying.difference_update(gone)
        return RetryChanges(cleared=gone)

    @for_source
    async def announce(self, applied: list[Change]) -> None:
        """Event hooks, after the transaction committed: what was stored or deleted, and each record
        that entered rsagg's change log (and so its Change Lists)."""
        if not self._events or not applied:
            return
        plugins = self.ctx.plugins
        for ch in applied:
            if ch.change == DELETED:
                plugins.call(
                    "rsagg_resource_deleted", source=self.source, set_name=self._set_name, uri=ch.uri
                )
            else:
                plugins.call(
                    "rsagg_resource_stored", source=self.source, set_name=self._set_name, uri=ch.uri,
                    change=ch.change, sha256=ch.sha256,
                )  # fmt: skip
        records = await self.ctx.read(
            lambda: list(self.ctx.reader.iter_changelog(self._last_seq, set_id=self.set_id))
        )
        for rec in records:
            plugins.call(
                "rsagg_change_published", set_name=self._set_name, seq=rec.seq, uri=rec.uri,
                change=rec.change, datetime=rec.datetime,
            )  # fmt: skip
            self._last_seq = rec.seq

    async def _commit(self, recv: trio.MemoryReceiveChannel, order: _Order) -> None:
        """Release results in input order, in batches (``_InOrder`` forms them): blobs durable first,
        then one state transaction."""
        with recv:
            while True:
                try:
                    batch = await _receive(recv)
                except trio.EndOfChannel:
                    break
                await self._flush(batch)
            await self._flush(order.rest(), last=True)

    async def _flush(self, batch: list[_Result], release: bool = True, last: bool = False) -> None:
        """``release``: the changes hold the in-flight bound (``run``'s, not ``run_batches``')."""
        if not batch:
            return
        for r in batch:  # in commit order: a memento version never goes behind a newer one (§14.6)
            if (
                r.memento
                and r.change is not None
                and not self._recent.admit(r.change.uri, version_time(r.work.entry))
            ):
                _out_of_order(r.work.entry)
                if r.blob is not None:
                    r.blob.abort()
                r.change, r.blob = None, None
        parts = _one_version_each(batch)
        for i, part in enumerate(parts, 1):
            await self._flush_part(part, last=last and i == len(parts))
        if release:
            for _ in batch:
                self._inflight.release()

    async def _flush_part(self, batch: list[_Result], last: bool = False) -> None:
        """Blobs durable, then one state transaction for the changes and the cursor of ``batch`` (and,
        ``last``, ``run``'s last write)."""
        writers = [r.blob for r in batch if r.blob is not None and r.change is not None]
        changes = [r.change for r in batch if r.change is not None]
        cursor = next((r.work.cursor_after for r in reversed(batch) if r.work.cursor_after), None)
        retries = self._retry_bookkeeping(batch)
        if self._progress:  # before the write, so that the progress it saves counts this batch too
            self._progress(len(batch))
        # With the changes, in their transaction: validators name the version then held.
        kept = [r.validators for r in batch if r.validators is not None and r.change is not None]
        # The failures decided in commit order, before the write: ``last`` sees every one of the run.
        if self.stats.failed or any(r.failure is not None for r in batch):
            for r in batch:
                uri = r.work.entry.loc
                if r.failure is not None:
                    self.stats.failed[r.failure.key] = r.failure
                else:
                    self.stats.failed.pop(uri, None)
        # The blobs durable first (invariant 2), in the same thread hop when the store can (small ones).
        then = self._last() if last and self._last is not None else None
        applied, after = await self.ctx.write_after_blobs(writers, _apply_batch, self.ctx.writer, self.set_id,
                                                          changes, cursor, retries, kept, then)  # fmt: skip
        if then is not None:
            self.last_written = (after,)
        if self._on_batch is not None:
            self._on_batch(
                [r.work.entry.loc for r in batch], applied, [r.failure for r in batch if r.failure]
            )
        await self.announce(applied)
        if applied:
            self.ctx.committed()  # e.g. rsagg's own change notifications go out now
        for ch in applied:
            self.stats.applied[ch.change] = self.stats.applied.get(ch.change, 0) + 1
        self.ctx.metrics.committed(self.source, applied, [r.failure for r in batch if r.failure])
        for r in reversed(batch):
            dt = r.work.entry.md.datetime if r.work.entry.md else None
            if dt is not None:
                self.stats.last_datetime = dt
                break


def _apply_batch(
    writer: StateStore,
    set_id: int,
    changes: list[Change],
    cursor: Cursor | None,
    retries: RetryChanges | None,
    kept: list[ResourceValidators],
    then: Callable[[], Any] | None = None,
) -> tuple[list[Change], Any]:
    """One batch's state writes in one call (one thread hop) and one transaction: the changes, the
    cursor, the retries and the upstream's validators of what was fetched (on the rows, schema step 18);
    then ``then`` (``Pipeline.run``'s ``last``), in the same transaction where the state can join them
    (``together``): both, or neither. Returns what changed state and what ``then`` returned."""
    if then is None:
        return writer.apply(set_id, changes, cursor, retries, kept), None
    together = getattr(writer, "together", None)
    with together() if together is not None else nullcontext():
        return writer.apply(set_id, changes, cursor, retries, kept), then()


def _one_version_each(batch: list[_Result]) -> list[list[_Result]]:
    """The batch cut so that no part holds two changes of one URI when one of them is a memento
    version (§14.6): each version is then its own transaction, with its own changelog datetime
    (rsagg's clock at that commit), so the versions of a resource are told apart by time, not only by
    their order. A batch without such a repeat (every batch of a Source without mementos) stays whole.
    """
    if not any(r.memento for r in batch):
        return [batch]
    parts: list[list[_Result]] = [[]]
    seen: set[str] = set()
    for r in batch:
        if r.change is not None:
            if r.memento and r.change.uri in seen:
                parts.append([])
                seen = set()
            seen.add(r.change.uri)
        parts[-1].append(r)
    return parts


def _out_of_order(entry: Entry) -> None:
    deviation(
        "version-out-of-order", entry.loc, None,
        f"{entry.loc}: the version of {version_time(entry)} is older than one rsagg holds; not made "
        "current (the changelog only goes forward)",
    )  # fmt: skip


__all__ = ["CREATED", "DELETED", "UPDATED", "Pipeline", "PipelineStats", "Work"]
