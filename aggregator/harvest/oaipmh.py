"""OAI-PMH 2.0 Sources: every record becomes a resource, through the one change pipeline.

A record's resource is identified by its OAI identifier; its content is the record's metadata element in
exclusive XML canonical form (``application/xml``; the same record gives the same bytes whatever the
response around it, so sha-256 decides "unchanged"); its lastmod is the record's datestamp; a ``via``
link points at the record's GetRecord URL. A record with ``status="deleted"`` is a deletion (OAI-PMH
§2.5.1: both the "persistent" and the "transient" policy report them; "no" never does).

Walks. The first harvest is a full ListRecords walk, run as a baseline (a generation, and the sweep of
rows it did not see, as for a Resource List); so is one every ``full_harvest_interval`` seconds if set,
for repositories that do not keep deletions. Every later one asks ``from=`` the ``responseDate`` of the
previous walk's first response, at the repository's granularity (Identify). ``from`` is inclusive and a
record changed during a walk may be listed again: both overlaps are idempotent, because the store logs a
change only when a record's bytes differ from what it holds (``State.apply``).

Position (the set's ``Cursor``, moved in the transaction of the records it covers, docs/architecture.md
invariant 2): ``last_datetime`` is the ``from`` of the walk in progress or the next one (None: no full
walk finished yet); ``changelist_url`` holds the resumption token that continues the walk in progress
(set after the last record of a page commits); ``list_until`` the responseDate of the walk's first
response (the next ``from`` once the walk is complete); ``list_index`` the records committed in it;
``baseline_at`` when the last full walk began. A killed harvest resumes at the stored token: the page
of a half-committed batch is read again and its committed records are no-ops, so there is no gap and no
duplicate. Resumption tokens are idempotent (OAI-PMH §3.5) but may expire: ``badResumptionToken``
restarts the walk from ``last_datetime``, once per sync.

A walk is a pipeline of pages. Requests run ahead of the walk, up to PREFETCH pages: each next one is
asked for as soon as a page has arrived, with the token read from its last bytes (``peek_token``); the
parsed page confirms that guess, or the requests ahead are cancelled and the walk goes on from the token
it read. Every request of a walk takes the Fetcher's lean keep-alive path (``net/lean.py``, the resource
GETs' client: same address policy, credentials, retries, redirects; the body decoded by ``get_bytes``):
a walk is a chain of GETs to one origin, where httpx's layers cost the event loop more than the bytes
(``python benchmarks/bench_oaipmh.py``). Each page is parsed and its records' content made durable blobs
in one call (``store_page``), in a worker process (``harvest.processes``, ``harvest/offload.py``: the
parse, the canonical form and the hashes are the walk's CPU-bound part, and the event loop keeps
fetching and committing meanwhile), while the pages before it commit their state transactions in walk
order (``Pipeline.run_batches``; pages already stored join one transaction, up to ``harvest.batch_size``
records). The event loop is the walk's busiest part (fetches, the state writer's thread, the pipeline):
per record it only makes the state change from what the worker sent back (``_RecordWork``: the record's
GetRecord URL is made in the worker, its entry only if something asks for it). A page up to TREE_BYTES
is parsed whole, a bigger one incrementally, each record cleared once read. A page that cannot be
fetched, parsed or stored stops the walk after the pages before it have committed. Memory is bounded by
a few times PREFETCH pages, whatever the repository's size.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import trio

from ..config import SourceConfig
from ..rs.model import CREATED, DELETED, UPDATED, Entry, Link, Md
from ..rs.w3cdt import utcnow
from ..store.blobs import BlobInfo
from ..store.interface import EmptySnapshot
from ..store.rows import Change, Cursor
from .access import for_source
from .context import HarvestContext
from .deviations import skip
from .fetch import FetchError
from .oaipage import OaiError, Page, Record, StoredRecord, parse_page, peek_token, store_page
from .offload import OffloadError
from .pipeline import Pipeline, PipelineStats, Work
from .progress import Progress

log = logging.getLogger("rsagg.harvest")

CONTENT_TYPE = "application/xml"
DAY = "YYYY-MM-DD"
SECONDS = "YYYY-MM-DDThh:mm:ssZ"
#: Pages requested ahead of the walk, and pages stored waiting for their state transaction: the network,
#: the workers and the disk keep going while a batch commits (memory: a few times this many pages).
PREFETCH = 3


@dataclass(eq=False)
class _Stored:
    """A page of a walk, parsed, its records made works with durable blobs (``store_page``); or the
    error that stopped storing them, raised in walk order after the pages before it commit."""

    page: Page
    started: datetime | None  # the responseDate of the walk's first response
    works: list[Work] = field(default_factory=list)
    error: Exception | None = None


@dataclass
class _Position:
    """Where a walk is: the token that continues it, the responseDate of its first response, whether
    it was restarted after a refused token (once per sync)."""

    token: str | None
    started: datetime | None
    restarted: bool = False


class _Request:
    """One page of a walk: fetched, then parsed with its blobs stored (``store_page``). A request sent
    ahead of its turn (``peek_token``) is used only if the walk asks for that very URL; otherwise it is
    cancelled with the requests after it and nothing of it is used (a blob it stored is named by
    nothing: ``rsagg gc`` removes it). A FetchError, the OaiError of a page that is not XML, or the
    OffloadError of a worker process that died is raised where the walk takes the page."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url, self.token = url, token  # the token it continues the walk from (None: the first page)
        self._fetched = trio.Event()
        self._done = trio.Event()
        self._data: bytes | None = None
        self._stored: tuple[Page, list[StoredRecord], Exception | None] | None = None
        self._error: FetchError | OaiError | OffloadError | None = None

    async def run(
        self,
        fetch: Callable[[str], Awaitable[bytes]],
        store: Callable[[bytes, str], Awaitable[tuple[Page, list[StoredRecord], Exception | None]]],
    ) -> None:
        try:
            self._data = await fetch(self.url)
            self._fetched.set()
            self._stored = await store(self._data, self.url)
        except (FetchError, OaiError, OffloadError) as exc:  # raised where the walk takes the page
            self._error = exc
        self._fetched.set()
        self._done.set()

    async def fetched(self) -> bytes:
        """The page's bytes, as soon as they have arrived (the token ahead is read from them)."""
        await self._fetched.wait()
        if self._data is None:
            assert self._error is not None
            raise self._error
        return self._data

    async def stored(self) -> tuple[Page, list[StoredRecord], Exception | None]:
        """``store_page``'s answer: the parsed page, its records stored, the error that stopped that."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._stored is not None
        return self._stored


def format_from(dt: datetime, granularity: str) -> str:
    """``from``/``until`` at the repository's granularity (§3.3.2), in UTC."""
    dt = dt.astimezone(UTC) if dt.tzinfo else dt.replace(tzinfo=UTC)
    return dt.strftime("%Y-%m-%d") if granularity == DAY else dt.strftime("%Y-%m-%dT%H:%M:%SZ")


def request_url(base: str, **args: str) -> str:
    return f"{base}{'&' if '?' in base else '?'}{urlencode(args)}"


def set_key(src: SourceConfig) -> str:
    """The state set of an OAI-PMH source: its ListRecords request (another prefix or set is another set)."""
    args = {"verb": "ListRecords", "metadataPrefix": src.metadata_prefix}
    if src.set:
        args["set"] = src.set
    return request_url(src.url, **args)


class OaiHarvest:
    """One sync of one OAI-PMH source."""

    def __init__(
        self, ctx: HarvestContext, src: SourceConfig, set_id: int, progress: Progress | None = None
    ) -> None:
        self.ctx, self.src, self.set_id, self.progress = ctx, src, set_id, progress
        self.granularity = SECONDS
        self.deleted_policy = "unknown"
        self.skipped = 0
        # GetRecord URL of a record (its ``via``): this + the quoted identifier.
        self._get_record = request_url(src.url, verb="GetRecord", metadataPrefix=src.metadata_prefix)
        self._get_record += "&identifier="

    async def _get(self, url: str) -> Page:
        return await self._parse(await self._fetch(url), url)

    async def _fetch(self, url: str) -> bytes:
        fetcher, cap = self.ctx.fetcher, self.ctx.config.harvest.max_document_bytes
        return (await fetcher.get_bytes(url, max_bytes=cap, lean_ok=True)).content

    async def _parse(self, data: bytes, url: str) -> Page:
        return self._noted(await trio.to_thread.run_sync(parse_page, data, url), url)

    def _noted(self, page: Page, url: str) -> Page:
        for problem in page.problems:  # lenient in, truthful out: logged and counted, never silent
            log.warning("source=%s url=%s %s", self.src.name, url, problem)
            self.ctx.metrics.error(self.src.name, "parse")
        self.skipped += len(page.problems)
        return page

    @for_source
    async def identify(self) -> None:
        url = request_url(self.src.url, verb="Identify")
        page = await self._get(url)
        if page.errors:
            code, message = page.errors[0]
            raise OaiError(url, code, message)
        if not page.identify:
            raise OaiError(url, "parse", "not an OAI-PMH Identify response")
        granularity = page.identify.get("granularity", DAY)
        self.granularity = SECONDS if granularity.startswith(SECONDS[:13]) else DAY
        self.deleted_policy = page.identify.get("deletedRecord", "unknown")

    def _list_url(self, token: str | None, walk_from: datetime | None) -> str:
        if token:
            return request_url(self.src.url, verb="ListRecords", resumptionToken=token)
        args = {"verb": "ListRecords", "metadataPrefix": self.src.metadata_prefix}
        if self.src.set:
            args["set"] = self.src.set
        if walk_from is not None:
            args["from"] = format_from(walk_from, self.granularity)
        return request_url(self.src.url, **args)

    async def _store_page(self, data: bytes, url: str) -> tuple[Page, list[StoredRecord], Exception | None]:
        offload = self.ctx.offload
        return await offload.run(store_page, data, url, self._get_record)

    def _check(self, page: Page, url: str) -> None:
        """Raise the page's OAI-PMH error (§3.6), but noRecordsMatch: an empty list, not a failure."""
        errors = [(c, m) for c, m in page.errors if c != "noRecordsMatch"]
        if not errors:
            return
        code, message = errors[0]
        if code == "cannotDisseminateFormat":
            message = (f"metadata_prefix {self.src.metadata_prefix!r} is not disseminated by this "
                       f"repository (see ListMetadataFormats): {message}")  # fmt: skip
        raise OaiError(url, code, message)

    @staticmethod
    def _check_progress(page: Page, token: str | None, url: str) -> None:
        """A page that hands back the token that fetched it would loop forever."""
        if token and page.token == token:
            raise OaiError(url, "badResumptionToken", "the response repeats its own resumption token")

    async def _pages(
        self, send: trio.MemorySendChannel, walk_from: datetime | None, token: str | None,
        started: datetime | None, generation: int | None,
    ) -> None:  # fmt: skip
        """The walk's pages, parsed and their blobs stored, in walk order, ahead of their state
        transactions; errors travel in the channel, in walk order.

        Requests follow the tokens ``peek_token`` guesses (``_ahead``); each page parsed confirms the
        next request, or the requests after it are cancelled and the walk goes on from its token.
        """
        at = _Position(token, started)
        async with send:
            while True:
                failed: Exception | None = None
                async with trio.open_nursery() as nursery:
                    ahead, requests = trio.open_memory_channel[_Request](PREFETCH)
                    nursery.start_soon(self._ahead, ahead, at.token, walk_from, nursery)
                    try:
                        done = await self._follow(requests, send, walk_from, at, generation)
                    except (OaiError, FetchError, OffloadError) as exc:
                        failed, done = exc, True
                    nursery.cancel_scope.cancel()  # requests ahead: nothing more of them is used
                if failed is not None:
                    await send.send(("error", failed))
                if done:
                    return

    async def _follow(
        self, requests: trio.MemoryReceiveChannel, send: trio.MemorySendChannel,
        walk_from: datetime | None, at: _Position, generation: int | None,
    ) -> bool:  # fmt: skip
        """Take the requested pages while they are the walk's next ones; True once the walk is complete,
        False when it goes on from ``at.token`` (a wrong guess, a token refused, no guess ahead)."""
        async with requests:
            async for this in requests:
                if this.token != at.token:  # the URL follows from the token (walk_from is the walk's)
                    return False
                page, stored, error = await this.stored()
                page = self._noted(page, this.url)
                refused = any(code == "badResumptionToken" for code, _ in page.errors)
                if refused and at.token and not at.restarted:
                    # Expired or unknown (e.g. the repository restarted): the walk again, from its start.
                    log.warning("source=%s resumption token refused (%s); restarting the walk from %s",
                                self.src.name, page.errors[0][1], walk_from)  # fmt: skip
                    at.token, at.started, at.restarted = None, None, True
                    await send.send(("restart", None))
                    return False
                self._check(page, this.url)
                self._check_progress(page, at.token, this.url)
                if at.started is None:
                    at.started = page.response_date
                job = _Stored(page, at.started, error=error)
                if error is None:
                    work = self._work
                    job.works = [work(rec, generation) for rec in stored]
                await send.send(("page", job))
                at.token = page.token
                if not at.token:
                    return True
        return False

    async def _ahead(
        self, send: trio.MemorySendChannel, token: str | None, walk_from: datetime | None,
        nursery: trio.Nursery,
    ) -> None:  # fmt: skip
        """Request the page of ``token``, then the page of the token read from its end (``peek_token``),
        and so on: up to PREFETCH pages fetched, parsed and stored ahead of the walk (which judges each
        guess). Stops at a page without a token to read, or one whose request failed."""
        async with send:
            while True:
                request = _Request(self._list_url(token, walk_from), token)
                nursery.start_soon(request.run, self._fetch, self._store_page)
                await send.send(request)
                try:
                    data = await request.fetched()
                except (FetchError, OaiError, OffloadError):
                    return  # raised by the walk when it takes that page
                guess = peek_token(data)
                if not guess or guess == token:
                    return
                token = guess

    @for_source
    async def records(self) -> AsyncGenerator[Record, None]:
        """Every record of a full walk, in list order (``rsagg audit``); nothing is stored."""
        await self.identify()
        token: str | None = None
        while True:
            url = self._list_url(token, None)
            page = await self._get(url)
            self._check(page, url)
            self._check_progress(page, token, url)
            for record in page.records:
                yield record
            token = page.token
            if not token:
                return

    @for_source
    async def run(self) -> PipelineStats:
        ctx, src = self.ctx, self.src
        await self.identify()
        own_start = utcnow()
        cursor = await ctx.read(ctx.reader.cursor, self.set_id)
        walk_from = cursor.last_datetime if cursor else None
        token = cursor.changelist_url if cursor else None
        started = cursor.list_until if cursor and token else None
        committed = cursor.list_index if cursor and token else 0
        baseline_at = cursor.baseline_at if cursor else None
        every = src.full_harvest_interval
        if every and not token and walk_from is not None:
            # A repository that forgets deletions ("no", "transient"): a full walk now and then sweeps
            # the records it no longer lists.
            if baseline_at is None or own_start - baseline_at >= timedelta(seconds=every):
                walk_from = None
        full = walk_from is None
        generation = None
        if full:
            sets = await ctx.read(ctx.reader.sets, src.name)
            open_gen = next(s.baseline_generation for s in sets if s.id == self.set_id)
            # A full walk resumed by its token keeps its generation: rows it already saw must not be swept.
            generation = (
                open_gen if token and open_gen else await ctx.write(ctx.writer.begin_baseline, self.set_id)
            )
        log.info(
            "source=%s OAI-PMH %s walk %s (granularity %s, deletedRecord %s)", src.name,
            "full" if walk_from is None else f"incremental from {format_from(walk_from, self.granularity)}",
            "resumed at its last token" if token else "started", self.granularity, self.deleted_policy,
        )  # fmt: skip
        send, recv = trio.open_memory_channel[tuple[str, object]](PREFETCH)
        failure: list[BaseException] = []
        # "started": the page's responseDate (a datetime or None); "committed", "offset": counts.
        state: dict[str, Any] = {"started": started, "committed": committed}

        def works(job: _Stored) -> list[Work]:
            """The page's works, the last one carrying the cursor that continues the walk after it."""
            page, page_started = job.page, job.started
            state["started"] = page_started
            if self.progress is not None and page.complete_size is not None:
                # records of this walk still to come: the list's size less where this walk began
                state.setdefault("offset", (page.cursor or 0) - self.progress.done)
                self.progress.set_total(max(0, page.complete_size - state["offset"]))
            state["committed"] += len(job.works)
            if job.works and page.token:
                cursor = Cursor(baseline_at, page.token, walk_from, 0, state["committed"], page_started)
                job.works[-1].cursor_after = cursor
            return job.works

        async def batches() -> AsyncGenerator[list[Work], None]:
            """Pages in walk order once stored; those stored already join the batch, up to ``batch_size``
            records (a busy state store commits fewer, bigger transactions; an idle one each page)."""
            held: tuple[str, object] | None = None
            while True:
                try:
                    what, value = held or await recv.receive()
                except trio.EndOfChannel:
                    return
                held = None
                if what == "page":
                    assert isinstance(value, _Stored)
                    if value.error is not None:
                        what, value = "error", value.error
                if what == "error":
                    assert isinstance(value, BaseException)
                    failure.append(value)
                    return
                if what == "restart":
                    state["started"], state["committed"] = None, 0
                    continue
                assert isinstance(value, _Stored)
                batch = [*works(value)]
                while len(batch) < ctx.config.harvest.batch_size:
                    try:
                        held = recv.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    job = held[1]
                    if not (isinstance(job, _Stored) and job.error is None):
                        break
                    batch += works(job)
                    held = None
                yield batch

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pages, send, walk_from, token, started, generation)
            add = self.progress.add if self.progress is not None else None
            pipeline = Pipeline(ctx, self.set_id, src.name, progress=add)
            stats = await pipeline.run_batches(batches())
            await recv.aclose()
            nursery.cancel_scope.cancel()  # pages fetched or stored after a failure: not needed
        if failure:
            raise failure[0]
        # The walk is complete and every record committed: the next walk starts where this one began
        # (the repository's clock). Without a responseDate (§3.2 requires one): our clock at the start,
        # less a day for skew; an early ``from`` only lists records again, as no-ops.
        new_from = state["started"] or own_start - timedelta(days=1)
        if state["started"] is None:
            log.warning("source=%s no responseDate in the walk's first response; next from %s (our clock)",
                        src.name, format_from(new_from, self.granularity))  # fmt: skip
        done = Cursor(new_from if full else baseline_at, None, new_from, 0, 0, None)
        if full:
            assert generation is not None
            try:
                swept = await ctx.write(ctx.writer.finish_baseline, self.set_id, generation, done)
            except EmptySnapshot as exc:  # a walk that listed nothing never deletes everything held
                log.warning("source=%s OAI-PMH walk not finished: %s", src.name, exc)
                skip(src.url, f"the full walk listed no record: {exc}")
                return stats
            ctx.metrics.committed(src.name, swept, ())
            for ch in swept:
                stats.applied[ch.change] = stats.applied.get(ch.change, 0) + 1
        else:
            await ctx.write(ctx.writer.apply, self.set_id, [], done)
        log.info(
            "source=%s OAI-PMH walk done: %d records, applied %s, %d skipped, next from %s",
            src.name, stats.seen, stats.applied, self.skipped,
            format_from(new_from, self.granularity),
        )  # fmt: skip
        return stats

    @staticmethod
    def _work(rec: StoredRecord, generation: int | None) -> Work:
        """The record's work, its state change made (``Work.ready``: what ``change_from`` would make of
        it, tests/test_oaipmh.py). Positional, in the dataclass's field order: this runs per record, on
        the event loop, the walk's busiest part."""
        identifier, stamp, deleted, sha256, length, md5, via = rec
        links = [Link("via", via, None, stamp)]
        if deleted:
            ready = Change(
                identifier, DELETED, None, None, None, None, {}, stamp, stamp, links, {}, [], generation
            )
        else:
            assert sha256 is not None and md5 is not None
            change = CREATED if generation is not None else UPDATED
            hashes = {"sha-256": sha256, "md5": md5}
            ready = Change(
                identifier, change, sha256, length, CONTENT_TYPE, None, hashes, stamp, stamp, links, {}, [],
                generation,
            )  # fmt: skip
        return _RecordWork(ready)


class _RecordWork(Work):
    """An OAI-PMH record's work: its change made (``ready``), its entry and blob info made only when
    something asks for them (a filter plugin, the bookkeeping of retries, the last record of a batch).

    Why: the commit needs only the change; making an Entry, an Md, a BlobInfo per record on the event
    loop, for nothing, was a tenth of the walk's time there. The entry made is the one the record
    describes (tests/test_oaipmh.py compares both ways)."""

    # Per record only what differs from these class-level defaults is set (``cursor_after`` and ``blob``
    # are Work's class-level None): three attributes, on the event loop, per record.
    _entry: Entry | None = None
    _info: BlobInfo | None = None

    def __init__(self, ready: Change) -> None:  # not Work's: no entry, no info made yet
        self.change, self.generation, self.ready = ready.change, ready.generation, ready

    @property  # type: ignore[override]
    def entry(self) -> Entry:
        if self._entry is None:
            ch = self.ready
            assert ch is not None
            if ch.change == DELETED:
                md = Md(None, DELETED, ch.upstream_datetime)
            else:
                md = Md(None, UPDATED, ch.upstream_datetime, None, None, None, None, None, None, ch.type)
            self._entry = Entry(ch.uri, ch.lastmod, None, md, ch.links)
        return self._entry

    @entry.setter
    def entry(self, value: Entry) -> None:
        self._entry = value

    @property  # type: ignore[override]
    def info(self) -> BlobInfo | None:
        ch = self.ready
        if self._info is None and ch is not None and ch.sha256 is not None:
            self._info = BlobInfo(ch.sha256, ch.length or 0, ch.hashes)
        return self._info

    @info.setter
    def info(self, value: BlobInfo | None) -> None:
        self._info = value


@for_source
async def sync_oaipmh(
    ctx: HarvestContext, src: SourceConfig, progress: Progress | None = None
) -> PipelineStats:
    """Bring an OAI-PMH source's one set up to date (``harvest/source.py`` calls it per sync)."""
    set_id = await ctx.write(ctx.writer.ensure_set, src.name, set_key(src))
    return await OaiHarvest(ctx, src, set_id, progress).run()


__all__ = ["OaiHarvest", "format_from", "request_url", "set_key", "sync_oaipmh"]
