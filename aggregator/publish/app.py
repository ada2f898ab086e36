"""rsagg as a ResourceSync Source: the ASGI app (starlette, served by hypercorn's trio worker).

URL layout (SET = published set name, see ``aggregator/store/sets.py``; ``publish/documents.py`` builds the
documents, ``publish/resources.py`` serves the resources, ``publish/uris.py`` maps the URIs)::

    /, /status.json, /metrics           the operator's routes the composition hands in (``status_routes``)
    /robots.txt                         a Sitemap: line per set's Resource List (§6.3.4)
    /.well-known/resourcesync           Source Description (§6.3.2, §8)
    /SET/capabilitylist.xml             Capability List (§9)
    /SET/resourcelist.xml               Resource List, or Resource List Index above MAX_ENTRIES (§10)
    /SET/resourcelist/LO-HI.xml         its parts (LO-end for the last)
    /SET/changelist.xml                 Change List Index, or the open Change List when it is alone (§12)
    /SET/changelist/K.xml               Change List window K
    /SET/r/<scheme>/<netloc><path>...   the resources (§14.8; ``uris.py``)
    /SET/memento/STAMP/<mapped>         a prior version (§14.6, RFC 7089; ``versions.py``)
    /SET/timegate/<mapped>              its TimeGate (Accept-Datetime -> 302)
    /SET/timemap/[AFTER/]<mapped>       its TimeMap (application/link-format), paged

Database access: SQLite reads run in worker threads (``trio.to_thread``) on read-only connections from a
small pool, one connection per request while it needs it (a document keeps its connection while it
streams; a resource returns it before its bytes go out). The harvester writes through its own
connection; WAL lets both proceed.

Extension hook for the dump helper (``publish/dumps.py``): ``extra_routes`` are matched before the
routes above, and ``request.app.state.publisher`` (a ``Publisher``) gives their handlers the config,
the blob store, the reader pool (``await publisher.run(fn, ...)``) and the published sets.
``dumps_available(set_name) -> {capability: url}`` decides the ``resourcedump``/``changedump`` entries
of a Capability List; it is called in a worker thread, so it may block briefly but must be thread-safe.
``extra_capabilities(set_name) -> [Entry]`` adds Capability List entries the same way (the notification
channels of ``websub/notifier.py``: topic + ``rel="hub"``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import anyio.lowlevel
import trio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from ..config import Config
from ..plugins.manager import Plugins
from ..rs.w3cdt import utcnow
from ..rs.write import iter_document_bytes
from ..store.blobs import BlobStore
from ..store.interface import StateStore, StateUnavailable
from ..store.rows import Resource
from ..store.sets import PublishedSet
from . import documents, versions
from .doccache import DocumentCache, fingerprint
from .documents import (
    CACHE_CLOSED,
    CACHE_OPEN,
    Doc,
    DumpsAvailable,
    ExtraCapabilities,
    Site,
    Validity,
    no_dumps,
    no_extra_capabilities,
)
from .fastpath import ResourceFastPath, ServedCounter
from .resources import LiteRequest, gone, http_date, remote_response, resource_answer, validators_match
from .site import build_site, link_policy, publish_filter
from .streaming import DOC_CHUNK, XML, DocumentResponse
from .uris import BasePath, base_path, number, split_resource_path

log = logging.getLogger("rsagg.publish")
#: Bump when a change of the code changes what a document renders to: cached renderings are dropped.
RENDERING = 2  # 2: §14.6 memento/timegate/timemap links in list entries
T = TypeVar("T")

#: Idle read connections kept for reuse.
POOL_IDLE = 8
#: Seconds a request waits for a database connection when all ``server.max_readers`` are in use.
READER_WAIT = 10.0

Build = Callable[[Site, StateStore, PublishedSet, datetime], "Doc | None"]
Validate = Callable[[Site, StateStore, PublishedSet], "Validity | None"]
FILE_CHUNK = 256 * 1024


class ServerBusy(Exception):
    """Every database connection for serving is in use and none came free in time: answered with 503."""


class ReaderPool:
    """Read-only state connections (opened by ``open_reader``, which the composition hands in), reused
    across requests, at most ``max_open`` at once.

    A connection is used by one request at a time (sqlite3 connections must not be shared
    concurrently). Each may hold a 16 MiB page cache and a document stream keeps its connection while it
    streams, so without a bound a crawler fetching many documents at once grows the server without limit;
    past the bound a request waits up to ``wait`` seconds, then ``ServerBusy``. Lent connections are held
    weakly: one whose borrower vanished without giving it back (a response never sent) frees its slot
    when it is collected, so a slot can never leak for good.
    """

    def __init__(
        self,
        open_reader: Callable[[], StateStore],
        *,
        max_idle: int = POOL_IDLE,
        max_open: int = 32,
        wait: float | None = None,
    ) -> None:
        self.open_reader = open_reader
        self.max_idle = max_idle
        self.max_open = max_open
        self.wait = READER_WAIT if wait is None else wait
        self._idle: list[StateStore] = []
        self._lent: weakref.WeakSet[StateStore] = weakref.WeakSet()
        self._opening = 0  # connections being opened in a worker thread: their slots are taken
        self._closed = False

    @property
    def in_use(self) -> int:
        return len(self._lent) + self._opening

    async def acquire(self) -> StateStore:
        if self.in_use >= self.max_open:
            # Saturated (rare): look again every 20 ms; a release never has to wake anyone up, which
            # also lets a collected, never-released connection free its slot.
            with trio.move_on_after(self.wait):
                while self.in_use >= self.max_open:
                    await trio.sleep(0.02)
            if self.in_use >= self.max_open:
                raise ServerBusy(f"all {self.max_open} database connections busy for {self.wait:.0f} s")
        state = self._idle.pop() if self._idle else None
        if state is None:
            self._opening += 1
            try:
                state = await trio.to_thread.run_sync(self.open_reader)
            finally:
                self._opening -= 1
        self._lent.add(state)
        return state

    def release(self, state: StateStore) -> None:
        if state not in self._lent:
            return  # given back already
        self._lent.discard(state)
        if self._closed or len(self._idle) >= self.max_idle:
            state.close()
        else:
            self._idle.append(state)

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[StateStore]:
        state = await self.acquire()
        try:
            yield state
        finally:
            self.release(state)

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()


_busy_logged = [0.0]  # monotonic time of the last "busy" log line: one a minute, not one per request


async def busy(request: Request, exc: Exception) -> Response:
    """503 for ``ServerBusy`` (and ``StateUnavailable``): a crawler should come back a little later (RFC
    9110 §15.6.4)."""
    if time.monotonic() - _busy_logged[0] >= 60:
        _busy_logged[0] = time.monotonic()
        log.warning("%s %s: %s (503; said once a minute, see rsagg_http_requests_total)", request.method,
                    request.url.path, exc)  # fmt: skip
    return PlainTextResponse("busy: try again shortly\n", status_code=503, headers={"retry-after": "5"})


class Publisher:
    """What every handler shares (``request.app.state.publisher``); its parts are built by the composition
    (``run/compose.py``) and handed in."""

    def __init__(
        self,
        config: Config,
        blobs: BlobStore,
        *,
        pool: ReaderPool,
        open_watcher: Callable[[], StateStore],
        cache_folder: Path,
        plugins: Plugins,
        metrics: ServedCounter,
        dumps_available: DumpsAvailable = no_dumps,
        extra_capabilities: ExtraCapabilities = no_extra_capabilities,
    ) -> None:
        """``pool``: the read connections of the requests; ``open_watcher``: opens the read-only handle
        whose ``version()`` the hot route watches (``fastpath.py``); ``cache_folder``: where renderings
        are cached."""
        self.config = config
        self.metrics = metrics
        self.blobs = blobs
        self.open_watcher = open_watcher
        #: When this configuration took effect: Last-Modified of the documents built from it alone.
        self.started = utcnow()
        #: Everything but the state that decides a document's bytes: names its rendering cache.
        self.fingerprint = fingerprint(
            config.server.base_url, config.sets, config.publish, config.plugins,
            [s.plugins for s in config.sources], documents.MAX_ENTRIES, RENDERING,
        )  # fmt: skip
        self.documents = DocumentCache(cache_folder / "cache" / "documents", self.fingerprint)
        self.pool = pool
        #: Short calls (``run``) in flight: no more than the pool keeps idle, since more meant a connection
        #: opened and closed per call under load (~0.3 ms each); document streams are not counted here.
        self._short_calls = trio.CapacityLimiter(POOL_IDLE)
        self.plugins = plugins
        self.policy = link_policy(config, self.plugins)
        #: ``visible(set name, resource)``: the plugins' publish filter, for every view.
        self.visible = publish_filter(self.plugins)
        self.dumps_available: DumpsAvailable = dumps_available
        self.extra_capabilities: ExtraCapabilities = extra_capabilities

    @property
    def base_url(self) -> str:
        return self.config.server.base_url

    def site(self, state: StateStore) -> Site:
        """The published sets as the state has them now, and how to write their URLs (blocking)."""
        return build_site(
            self.config,
            state,
            policy=self.policy,
            visible=self.visible,
            dumps_available=self.dumps_available,
            extra_capabilities=self.extra_capabilities,
        )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(reader_state, *args)`` in a worker thread with a pooled read connection."""
        async with self._short_calls, self.pool.reader() as state:
            return await trio.to_thread.run_sync(lambda: fn(state, *args))


# ---------------------------------------------------------------------------------------------------
# Documents


def _file_chunks(f: BinaryIO) -> Iterator[bytes]:
    with f:
        yield from iter(lambda: f.read(FILE_CHUNK), b"")


@dataclass
class Prepared:
    """What a document request gets: 304, headers only (HEAD), a cached rendering, or one to make."""

    status: int
    headers: dict[str, str]
    doc: Iterator[bytes] | None = None  # the rendering, its head already written
    cached: BinaryIO | None = None
    validity: Validity | None = None


def _prepare(
    pub: Publisher,
    state: StateStore,
    name: str | None,
    build: Build,
    validate: Validate,
    now: datetime,
    request: LiteRequest,
) -> Prepared | None:
    """The validators first (cheap), then a cached rendering, then the document (worker thread)."""
    site = pub.site(state)
    ps = site.sets.get(name) if name is not None else None
    if ps is None:
        return None
    v = validate(site, state, ps)
    if v is None:
        return None
    tag = hashlib.sha256(f"{pub.fingerprint}/{v.name}@{v.version}".encode()).hexdigest()[:32]
    # Weak: two renderings of one version differ in rs:md at (RFC 9110 §8.8.1).
    headers = {"etag": f'W/"{tag}"', "cache-control": CACHE_CLOSED if v.closed else CACHE_OPEN}
    if v.last_modified is not None:
        headers["last-modified"] = http_date(v.last_modified)
    if validators_match(request, headers["etag"], v.last_modified):
        return Prepared(304, headers)
    if request.method == "HEAD":
        return Prepared(200, headers)
    cached = pub.documents.open(v.name, v.version)
    if cached is not None:
        headers["content-length"] = str(os.fstat(cached.fileno()).st_size)
        return Prepared(200, headers, cached=cached)
    doc = build(site, state, ps, now)
    if doc is None:
        return None
    # The head is written here, in this worker-thread call: one thread hop less before the first byte.
    chunks = iter_document_bytes(*doc, chunk_size=DOC_CHUNK, flush_head=True)
    return Prepared(200, headers, doc=_started(next(chunks), chunks), validity=v)


def _started(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    """``first``, then ``rest`` (closed with this iterator, however it ends)."""
    try:
        yield first
        yield from rest
    finally:
        close = getattr(rest, "close", None)
        if close is not None:
            close()


async def _document(request: Request, build: Build, validate: Validate) -> Response:
    pub: Publisher = request.app.state.publisher
    now = utcnow()
    lite = LiteRequest(request.method, request.headers)  # type: ignore[arg-type]
    state = await pub.pool.acquire()
    try:
        set_name = request.path_params.get("set")
        prep = await trio.to_thread.run_sync(_prepare, pub, state, set_name, build, validate, now, lite)
    except BaseException:
        pub.pool.release(state)
        raise
    if prep is None or prep.doc is None:
        pub.pool.release(state)
    if prep is None:
        return PlainTextResponse("not found\n", status_code=404)
    if prep.status == 304:
        return Response(status_code=304, headers=prep.headers)
    if prep.cached is not None:
        return DocumentResponse(_file_chunks(prep.cached), lambda: None, headers=prep.headers)
    if prep.doc is None:  # HEAD
        response = Response(headers={**prep.headers, "content-type": XML})
        del response.headers["content-length"]  # unknown until streamed
        return response
    v = prep.validity
    tee = pub.documents.writer(v.name, v.version) if v is not None else None
    return DocumentResponse(prep.doc, lambda: pub.pool.release(state), headers=prep.headers, tee=tee)


async def _small_document(request: Request, make: Callable[[Site], Doc | None]) -> Response:
    """A document built whole (Source Description, Capability List): strong ETag of its bytes."""
    pub: Publisher = request.app.state.publisher
    doc = await pub.run(lambda state: make(pub.site(state)))
    if doc is None:
        return PlainTextResponse("not found\n", status_code=404)
    body = b"".join(iter_document_bytes(*doc))
    headers = {
        "etag": f'"{hashlib.sha256(body).hexdigest()[:32]}"',
        "last-modified": http_date(pub.started),
        "cache-control": CACHE_OPEN,
    }
    if validators_match(request, headers["etag"], pub.started):
        return Response(status_code=304, headers=headers)
    if request.method == "HEAD":  # the GET's length, no bytes
        return Response(b"", headers={**headers, "content-length": str(len(body))}, media_type=XML)
    return Response(body, headers=headers, media_type=XML)


async def well_known(request: Request) -> Response:
    return await _small_document(request, documents.source_description)


async def capabilitylist(request: Request) -> Response:
    name = request.path_params["set"]

    def make(site: Site) -> Doc | None:
        ps = site.sets.get(name)
        return None if ps is None else documents.capability_list(site, ps)

    return await _small_document(request, make)


def _resource_list(site: Site, state: StateStore, ps: PublishedSet, now: datetime) -> Doc:
    return documents.resource_list(site, state, ps, now, lines=True)


async def resourcelist(request: Request) -> Response:
    return await _document(request, _resource_list, documents.resource_list_validity)


async def resourcelist_part(request: Request) -> Response:
    lo: int = request.path_params["lo"]
    hi: int | None = request.path_params["hi"]  # None: "end"
    if hi is not None and hi <= lo:
        return PlainTextResponse("not found\n", status_code=404)
    return await _document(
        request,
        lambda site, st, ps, now: documents.resource_list_part(site, st, ps, lo, hi, now, lines=True),
        lambda site, st, ps: documents.resource_list_part_validity(site, st, ps, lo, hi),
    )


async def changelist(request: Request) -> Response:
    return await _document(request, documents.change_list, documents.change_list_validity)


async def changelist_window(request: Request) -> Response:
    k: int = request.path_params["k"]
    return await _document(
        request,
        lambda site, st, ps, now: documents.change_list_window(site, st, ps, k, now),
        lambda site, st, ps: documents.change_list_window_validity(site, st, ps, k),
    )


# ---------------------------------------------------------------------------------------------------
# Resources, robots.txt, home page


async def resource(request: Request) -> Response:
    """``/SET/r/...``: decoded from the raw path, since the decoded one has lost ``%2F`` vs ``/``.

    The lookup, the plugins' filter and, for a local blob, its stat and read (small blobs) run in one
    worker-thread call: thread hops, not the work, dominated the cost of a resource GET."""
    pub: Publisher = request.app.state.publisher
    raw = request.scope.get("raw_path") or request.scope["path"].encode("utf-8")
    try:
        raw_path = raw.decode("utf-8").partition("?")[0]
    except UnicodeDecodeError:
        return gone(None, 404)
    parsed = split_resource_path(raw_path)
    if parsed is None:
        return gone(None, 404)
    set_name, uri = parsed

    def answer(state: StateStore) -> tuple[Response | None, Resource | None, str]:
        site = pub.site(state)
        ps = site.sets.get(set_name)
        if ps is None:
            return gone(None, 404), None, ""
        link = f'<{site.capabilitylist(ps.name)}>; rel="resourcesync"'
        row = state.resource_in(ps.set_ids, uri)
        if row is None or not site.visible(ps.name, row):
            return gone(link, 404), None, link
        link = versions.resource_link_header(pub.base_url, site.capabilitylist(ps.name), ps.name, uri)
        return resource_answer(request, row, pub.blobs, link), row, link

    response, row, link = await pub.run(answer)
    if response is None:  # a non-local blob store, called once the connection is back in the pool
        assert row is not None
        response = await remote_response(request, row, pub.blobs, link)
    return response


async def robots(request: Request) -> Response:
    pub: Publisher = request.app.state.publisher
    site = await pub.run(pub.site)
    lines = ["User-agent: *", "Disallow:", ""]
    lines += [f"Sitemap: {site.resourcelist(name)}" for name in site.sets]
    return PlainTextResponse("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------------


def create_app(
    publisher: Publisher,
    *,
    status_routes: Sequence[BaseRoute],
    extra_routes: Sequence[BaseRoute] = (),
    middleware: Sequence[Middleware] = (),
) -> Starlette:
    """The publishing app of ``publisher`` (see the module docstring), built by the composition.

    ``status_routes``: the operator's views (``/``, ``/status.json``, ``/metrics``: observe/page.py);
    ``extra_routes``: matched first (notifications, dumps); ``middleware``: inside the base path's, around
    the routes (the served-request metrics).
    """
    config = publisher.config
    fast: list[ResourceFastPath] = []  # the hot route's middleware, once starlette has built it

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        publisher.pool.release(await publisher.pool.acquire())  # a connection ready for the first request
        # Starlette streams through anyio, which loads its trio backend on first use (~80 ms): now,
        # rather than in the first document's time to first byte.
        await anyio.lowlevel.checkpoint()
        try:
            yield
        finally:
            publisher.pool.close()
            for f in fast:
                f.close()

    get = ["GET", "HEAD"]
    resource_route = Route("/{set}/r/{rest:path}", resource, methods=get)
    memento_route = Route("/{set}/memento/{rest:path}", versions.memento, methods=get)
    routes: list[BaseRoute] = [
        *extra_routes,
        *status_routes,
        Route("/robots.txt", robots, methods=get),
        Route("/.well-known/resourcesync", well_known, methods=get),
        Route("/{set}/capabilitylist.xml", capabilitylist, methods=get),
        Route("/{set}/resourcelist.xml", resourcelist, methods=get),
        Route(
            f"/{{set}}/resourcelist/{number('lo')}-{number('hi', or_end=True)}.xml",
            resourcelist_part,
            methods=get,
        ),
        Route("/{set}/changelist.xml", changelist, methods=get),
        Route(f"/{{set}}/changelist/{number('k')}.xml", changelist_window, methods=get),
        resource_route,
        # Prior versions (§14.6, RFC 7089; publish/versions.py)
        memento_route,
        Route("/{set}/timegate/{rest:path}", versions.timegate, methods=get),
        Route("/{set}/timemap/{rest:path}", versions.timemap, methods=get),
    ]

    def hot(inner: Any) -> ResourceFastPath:
        fast.append(
            ResourceFastPath(
                inner, publisher, resource_route, ((ServerBusy, StateUnavailable), busy), memento_route
            )
        )
        return fast[-1]

    # Outermost: a request under base_url's path is routed without it (a proxy that passes it on).
    prefix = Middleware(BasePath, prefix=base_path(config.server.base_url))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[prefix, *middleware, Middleware(hot)],
        exception_handlers={ServerBusy: busy, StateUnavailable: busy},  # the state's server away: 503 too
    )
    app.state.publisher = publisher
    # Built now rather than at the first request, so that the server finds the hot route's fast lane
    # (``serverguard._FastLane``: plain resource GETs answered without the ASGI layers) at start-up.
    app.middleware_stack = app.build_middleware_stack()
    app.state.fast_lane = fast[0].lane
    return app


__all__ = ["Publisher", "ReaderPool", "ServedCounter", "ServerBusy", "create_app"]
