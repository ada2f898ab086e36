"""The hot route: resource and memento GETs and HEADs answered from memory, before starlette's routing.

A crawler or Destination fetches the same resources again and again (audits, re-syncs, conditional
GETs). What a resource GET needs (the row, the plugins' verdict, the Capability List link, the bytes of
a small blob or where an offloading front end finds them, the ready-made headers of a plain GET) is
kept in an LRU by request path (``HotCache``) until the state changes: ``StateStore.version()`` of a
read-only state handle of our own tells that a writer (the harvester, ``rsagg gc``, another node)
committed since. Then the whole cache is dropped. On SQLite that read takes a few microseconds and no
worker thread; it was 15 % of a hit's cost when made per request, so it is made only when a handle of
this process committed since the last read (``state.local_commit_mark()``, pushed by every commit of the
process: a change by the harvester or ``rsagg gc`` beside the server shows at once, answers never come
from an older state than the request's) or when ``LOCAL_VERSION_AGE`` passed (another process's commit,
such as a ``harvest --once`` beside ``run --no-harvest``, shows within those 2 ms). On a
server backend (PostgreSQL) each read is a round trip, made in a worker thread (``store/calls.py``)
so the event loop never waits on the server, and at most once per ``REMOTE_VERSION_AGE``: requests
in between (and those arriving while a read is under way) use the last version read. So there an
answer may come from a state up to ``REMOTE_VERSION_AGE`` (plus the one round trip) older than the
request's: the staleness is bounded, and a cluster behind a load balancer has more than that between
its nodes anyway.

A hit costs no thread hop and no query (that one version read, or none); a miss one worker-thread call
(``Publisher.run``), as the route had before. Anything the memory cannot answer (a big blob, a Range only
starlette's FileResponse decides, a blob in a store without URLs) goes on to the ordinary route
(``app.resource``), which answers it as before: the bytes and headers are the same either way.

Mementos (``/SET/memento/STAMP/...``, ``versions.py``) take the same route: ``versions.find_memento``
decides (404, 410 beyond retention, the version), the version's row stands for the resource's, and the
answers add ``Memento-Datetime`` and ``Cache-Control: immutable`` as the app's memento route does.
Under a duration policy (``[publish] versions = "30d"``) a version leaves retention with no commit:
its cached answer expires then (``Hot.expires``). A memento's x-accel answer says no
``X-Accel-Expires``, so nginx asks again and hears of that 410.

``server.offload`` (see ``config/nginx.conf`` and docs/install.md):

- ``x-accel``: 200 with ``X-Accel-Redirect: <offload_location><ab/cd/sha256>`` and every header of
  the answer (ETag, Last-Modified, Content-Type, Content-Encoding, Link); nginx sends the bytes from
  the blob file (sendfile, Range); rsagg still answers 304, 404 and 410 itself. With
  ``server.offload_cache_seconds`` the answer says ``X-Accel-Expires``: nginx may keep it (the shipped
  ``config/nginx.conf`` does: its second, loopback server follows the redirect to the blob file and
  the front server caches the whole answer, headers and bytes) and answer plain GETs and HEADs of that
  resource alone for that long;
- ``redirect``: 307 to ``BlobStore.url`` (an S3 presigned URL, kept for half its lifetime, or a public
  bucket URL); 304/404/410 as above.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..rs.w3cdt import utcnow
from ..store.calls import limiter_of
from ..store.interface import StateStore
from ..store.open import local_commit_mark
from ..store.rows import Resource
from .resources import (
    SMALL_BLOB,
    LiteRequest,
    conditional_answer,
    gone,
    head_response,
    memory_response,
    resource_headers,
)
from .uris import RESOURCES, base_path, split_resource_path, strip_base_path
from .versions import (
    MEMENTO,
    beyond_retention,
    find_memento,
    memento_headers,
    parse_memento_path,
    resource_link_header,
)

if TYPE_CHECKING:
    from ..config import Config
    from ..store.blobs import BlobStore
    from .documents import Site

log = logging.getLogger("rsagg.publish")

_T = TypeVar("_T")


class ServedCounter(Protocol):
    """What the publisher reports of each request it serves (``observe.metrics.Metrics`` is one)."""

    def served(self, route: str, method: str, code: int, seconds: float) -> None: ...


class FastPathPublisher(Protocol):
    """What the fast path reads of the publisher (``app.Publisher`` is one)."""

    config: Config
    blobs: BlobStore
    metrics: ServedCounter
    open_watcher: Callable[[], StateStore]

    @property
    def base_url(self) -> str: ...

    def site(self, state: StateStore) -> Site: ...

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T: ...


#: Lookups kept (each a few hundred bytes plus the blob when small), and blob bytes kept in all.
HOT_ENTRIES = 20_000
HOT_BYTES = 32 * 1024 * 1024
#: Seconds a server backend's state version is used before it is read again (module docstring).
REMOTE_VERSION_AGE = 0.01
#: Seconds a SQLite state's version is used, when no handle of this process committed meanwhile, before
#: ``PRAGMA data_version`` is read again: how late another process's commit may show (module docstring).
LOCAL_VERSION_AGE = 0.002
_NEVER = float("inf")
_MARK = f"/{RESOURCES}/"
_MEMENTO_MARK = f"/{MEMENTO}/"
_WANTED = frozenset(
    (b"if-none-match", b"if-modified-since", b"range", b"if-range", b"if-match", b"if-unmodified-since")
)
_PRECONDITIONS = frozenset(("if-match", "if-unmodified-since"))


@dataclass(slots=True)
class Hot:
    """What answers one resource path (``/SET/r/...`` as requested) while the state is unchanged."""

    status: int  # 200 held and live, 404, 410
    link: str | None
    row: Resource | None = None
    headers: dict[str, str] | None = None  # the 200's headers (resources.resource_headers)
    body: bytes | None = None  # the whole blob, when small and local (offload "none")
    size: int | None = None  # the local blob's size (HEAD of a big one needs no bytes)
    target: str | None = None  # X-Accel-Redirect path or redirect URL
    expires: float = float("inf")  # monotonic time the target stops being usable
    #: The answer to a GET without Range or validators: status, raw headers, body (a HEAD's: no body);
    #: None: build it per request.
    plain: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None
    #: ``plain``'s status line and headers as the server's fast lane writes them (``serverguard.Lane``).
    lane_head: bytes | None = None
    #: A memento (``/SET/memento/...``, versions.py): its row is that version; its answers say
    #: Memento-Datetime and Cache-Control immutable, its 410 is "beyond retention".
    memento: bool = False

    @property
    def cost(self) -> int:
        return len(self.body) if self.body is not None else 0


class HotCache:
    """An LRU of ``Hot`` answers bounded by count and by blob bytes, dropped when the state changes."""

    def __init__(
        self,
        open_reader: Callable[[], StateStore],
        entries: int = HOT_ENTRIES,
        max_bytes: int = HOT_BYTES,
        remote_age: float = REMOTE_VERSION_AGE,
        local_age: float = LOCAL_VERSION_AGE,
    ) -> None:
        """``open_reader``: opens the read-only state handle whose ``version()`` is watched;
        ``remote_age``: how long a server backend's version is used before it is read again;
        ``local_age``: the same for SQLite, while no handle of this process commits."""
        self.open_reader = open_reader
        self.entries, self.max_bytes, self.remote_age = entries, max_bytes, remote_age
        self.local_age = local_age
        self._mark = -1  # local_commit_mark() at the last SQLite version read
        self._lru: OrderedDict[bytes, Hot] = OrderedDict()
        self._bytes = 0
        self._version: int | None = None
        self._reader: StateStore | None = None
        self._limiter: trio.CapacityLimiter | None = None
        self._opening: trio.Event | None = None  # the reader is being opened (in a worker thread)
        self._seen: int | None = None  # a server backend's last version read ...
        self._seen_at = float("-inf")  # ... and when that read started (monotonic)
        self._reading: trio.Event | None = None  # a read of it under way: others wait for that one

    async def _data_version(self) -> int | None:
        """The state's change counter; None when it cannot be read (then nothing is cached)."""
        if self._reader is None:
            if self._opening is not None:
                await self._opening.wait()
                return None if self._reader is None else await self._data_version()
            self._opening = trio.Event()
            try:  # opening a server backend's reader connects: not in the event loop
                self._reader = await trio.to_thread.run_sync(self.open_reader)
                self._limiter = limiter_of(self._reader)
            except Exception as exc:
                log.debug("hot cache: state unreadable: %s", exc)
                return None
            finally:
                self._opening.set()
                self._opening = None
        reader = self._reader
        started = time.monotonic()
        if self._limiter is None:  # local (SQLite): microseconds, when this process committed or now and then
            mark = local_commit_mark()  # before the read: a commit after it moves the mark again
            if mark == self._mark and started - self._seen_at <= self.local_age:
                return self._seen
            try:
                self._seen = reader.version()
            except Exception as exc:  # a backend's own error type: the hot cache just stays off meanwhile
                self._mark, self._seen, self._seen_at = -1, None, float("-inf")
                self._unreadable(exc)
                return None
            self._mark, self._seen_at = mark, started
            return self._seen
        if started - self._seen_at <= self.remote_age:
            return self._seen
        if self._reading is not None:
            await self._reading.wait()
            return self._seen
        self._reading = trio.Event()
        try:
            self._seen = await trio.to_thread.run_sync(reader.version, limiter=self._limiter)
            self._seen_at = started
        except Exception as exc:
            log.debug("hot cache: state version unreadable: %s", exc)
            self._seen, self._seen_at = None, float("-inf")
            if self._reader is reader:  # closing a pool joins its threads: not in the event loop either
                self._reader, self._limiter = None, None
                await trio.to_thread.run_sync(reader.close)
            return None
        finally:
            self._reading.set()
            self._reading = None
        return self._seen

    def _unreadable(self, exc: Exception) -> None:
        log.debug("hot cache: state version unreadable: %s", exc)
        self.close()

    def settled(self) -> bool:
        """True when the cache is known to be fresh without a read: the last version read is the cached
        one, within its age, and (SQLite) no handle of this process committed since. The common case:
        then ``fresh`` need not be awaited (nanoseconds instead of a coroutine and a clock read)."""
        if self._seen is None or self._seen != self._version:
            return False
        if self._limiter is None:
            if local_commit_mark() != self._mark:
                return False
            return time.monotonic() - self._seen_at <= self.local_age
        return time.monotonic() - self._seen_at <= self.remote_age

    async def fresh(self) -> bool:
        """Drop everything when the state changed since the last call; False: do not cache now."""
        version = await self._data_version()
        if version is None or version != self._version:
            self._lru.clear()
            self._bytes = 0
            self._version = version
        return version is not None

    def get(self, key: bytes) -> Hot | None:
        hot = self._lru.get(key)
        if hot is None:
            return None
        if hot.expires != _NEVER and hot.expires <= time.monotonic():  # most never expire: no clock read
            self._drop(key)
            return None
        self._lru.move_to_end(key)
        return hot

    def put(self, key: bytes, hot: Hot) -> None:
        self._drop(key)
        self._lru[key] = hot
        self._bytes += hot.cost
        while len(self._lru) > self.entries or self._bytes > self.max_bytes:
            self._drop(next(iter(self._lru)))

    def _drop(self, key: bytes) -> None:
        old = self._lru.pop(key, None)
        if old is not None:
            self._bytes -= old.cost

    def close(self) -> None:
        if self._reader is not None:
            reader, self._reader = self._reader, None
            self._limiter, self._seen, self._seen_at = None, None, float("-inf")
            reader.close()


class ResourceFastPath:
    """ASGI middleware in front of starlette's router for ``GET|HEAD /SET/r/...`` (module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        publisher: FastPathPublisher,
        route: Any,
        busy: tuple[
            type[Exception] | tuple[type[Exception], ...], Callable[[Request, Exception], Awaitable[Response]]
        ],
        memento_route: Any = None,
    ) -> None:
        """``memento_route``: the app's memento Route; None: mementos are left to the app."""
        self.app = app
        self.pub = publisher
        self.route = route  # the resource Route: ServedMetrics labels the request by its path
        self.memento_route = memento_route
        #: (ServerBusy, its handler): this middleware is outside starlette's exception handlers
        self.busy = busy
        # A handle of its own, not one of the pool's: read in the event loop, between requests.
        self.cache = HotCache(publisher.open_watcher)
        self.offload = publisher.config.server.offload
        self.location = publisher.config.server.offload_location
        self.lifetime = publisher.config.server.redirect_lifetime
        self.cache_seconds = publisher.config.server.offload_cache_seconds
        self._no_url_logged = False
        self.prefix = base_path(publisher.config.server.base_url).encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"  # lifespan and websocket scopes have no method, nor a path
            or scope["method"] not in ("GET", "HEAD")
            or (_MARK not in (path := scope["path"]) and _MEMENTO_MARK not in path)
        ):
            await self.app(scope, receive, send)
            return
        raw = scope.get("raw_path") or path.encode("utf-8")
        cacheable = self.cache.settled() or await self.cache.fresh()
        hot = self.cache.get(raw) if cacheable else None
        if hot is None:
            lookup = self._parse(raw.partition(b"?")[0])
            if lookup is None:
                await self.app(scope, receive, send)
                return
            scope["route"] = self._route(lookup[0] == self._lookup_memento)  # bound: equal, not same
            try:
                found: Hot = await self.pub.run(*lookup)
            except self.busy[0] as exc:
                await (await self.busy[1](Request(scope), exc))(scope, receive, send)
                return
            if cacheable:
                self.cache.put(raw, found)
            hot = found
        scope["route"] = self._route(hot.memento)
        wanted = [(k, v) for k, v in scope["headers"] if k in _WANTED]
        if not wanted and hot.plain is not None:  # the common case: headers and bytes ready to send
            status, headers, body = hot.plain
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})
            return
        request = LiteRequest(scope["method"], {k.decode("latin-1"): v.decode("latin-1") for k, v in wanted})
        response = self._answer(request, hot)
        if response is None:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)

    async def lane(self, method: bytes, target: bytes) -> tuple[bytes, bytes] | None:
        """The answer to a plain GET/HEAD (no validators, no Range) of ``target`` (the raw request
        target) for the server's fast lane (``serverguard._FastLane``): the status line and headers
        (made once per cached answer) and the body, as ``__call__`` sends them, or None for anything
        else (the ordinary path answers it)."""
        start = time.perf_counter()
        raw = strip_base_path(target.partition(b"?")[0], self.prefix)  # uris.BasePath, for this lane
        if b"/r/" not in raw and b"/memento/" not in raw:
            return None
        cacheable = self.cache.settled() or await self.cache.fresh()
        hot = self.cache.get(raw) if cacheable else None
        if hot is None:
            lookup = self._parse(raw)
            if lookup is None:
                return None
            try:
                found: Hot = await self.pub.run(*lookup)
            except self.busy[0]:
                return None  # the ordinary path answers 503
            if cacheable:
                self.cache.put(raw, found)
            hot = found
        if hot.plain is None or hot.lane_head is None:
            return None
        head = method == b"HEAD"
        self.pub.metrics.served(
            self._route(hot.memento).path, "HEAD" if head else "GET", hot.status, time.perf_counter() - start
        )
        return hot.lane_head, b"" if head else hot.plain[2]

    def _parse(self, raw: bytes) -> tuple[Any, ...] | None:
        """(lookup, its arguments) for a raw request path (no query): a resource or a memento; None
        for anything else (the ordinary route answers it)."""
        try:
            path = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
        parsed = split_resource_path(path)
        if parsed is not None:
            return (self._lookup, *parsed)
        memento = parse_memento_path(path) if self.memento_route is not None else None
        if memento is not None:
            return (self._lookup_memento, *memento)
        return None

    def _route(self, memento: bool) -> Any:
        """The route a request is counted under (``ServedMetrics``), as starlette's router would say."""
        return self.memento_route if memento and self.memento_route is not None else self.route

    def _answer(self, request: LiteRequest, hot: Hot) -> Response | None:
        response = self._respond(request, hot)
        if response is not None and hot.memento and hot.row is not None:
            memento_headers(response, hot.row)  # versions.memento adds them so, after the answer
        return response

    def _respond(self, request: LiteRequest, hot: Hot) -> Response | None:
        if hot.status != 200 or hot.row is None or hot.headers is None:
            if hot.memento and hot.status == 410:
                return beyond_retention(hot.link)
            return gone(hot.link, hot.status)
        early = conditional_answer(request, hot.row, hot.headers)
        if early is not None:
            return early
        if hot.target is not None and _PRECONDITIONS & request.headers.keys():
            # nginx would judge If-Match / If-Unmodified-Since by the blob file, not by the resource,
            # and S3 by the object: rsagg sends these (rare) ones itself (the ordinary route)
            return None
        if hot.target is not None and self.offload == "x-accel":
            # nginx says Accept-Ranges itself on a 200 (it would repeat ours), and not on a 206
            headers = {k: v for k, v in hot.headers.items() if k != "accept-ranges"}
            headers["x-accel-redirect"] = hot.target
            # How long nginx may reuse this answer (it never passes it on); not for a memento, which
            # a duration policy may retire (410) with no change nginx would hear of.
            if self.cache_seconds and not hot.memento:
                headers["x-accel-expires"] = str(_expires(self.cache_seconds, hot.row.uri))
            return Response(headers=headers)
        if hot.target is not None:
            return Response(status_code=307, headers={"location": hot.target, "link": hot.headers["link"]})
        if hot.body is not None:
            return memory_response(request, dict(hot.headers), hot.body)
        if request.method == "HEAD" and hot.size is not None:
            return head_response(request, dict(hot.headers), hot.size)
        return None

    def _lookup(self, state: StateStore, set_name: str, uri: str) -> Hot:
        """The answer for (set, URI) as the state has it now (worker thread, blocking)."""
        pub = self.pub
        site = pub.site(state)
        ps = site.sets.get(set_name)
        if ps is None:
            return self._with_plain(Hot(404, None))
        link = f'<{site.capabilitylist(ps.name)}>; rel="resourcesync"'
        row = state.resource_in(ps.set_ids, uri)
        if row is None or not site.visible(ps.name, row):
            return self._with_plain(Hot(404, link))
        link = resource_link_header(pub.base_url, site.capabilitylist(ps.name), ps.name, uri)
        if row.deleted or not row.sha256:
            return self._with_plain(Hot(410, link))
        return self._with_blob(Hot(200, link, row, resource_headers(row, link)))

    def _lookup_memento(self, state: StateStore, set_name: str, uri: str, when: datetime) -> Hot:
        """The answer for the memento of (set, URI) dated ``when`` (worker thread, blocking): the
        decision of ``versions.find_memento``, the bytes as for a current resource."""
        found = find_memento(self.pub, state, set_name, uri, when)
        if found.status != 200 or found.version is None:
            return self._with_plain(Hot(found.status, found.link, memento=True))
        version, link = found.version, found.link or ""
        hot = Hot(200, link, version, resource_headers(version, link), memento=True)
        if found.until is not None:  # a duration policy: 410 from then on, without a state change
            left = (found.until - utcnow()).total_seconds()
            hot.expires = time.monotonic() + max(left, 0.0)
        return self._with_blob(hot)

    def _with_blob(self, hot: Hot) -> Hot:
        """``hot`` (a live 200) with its bytes or where the offloading front end finds them."""
        pub, row = self.pub, hot.row
        assert row is not None and row.sha256 is not None and hot.headers is not None
        # Small blobs kept inline are answered from memory, but under x-accel: nginx reads a file then
        # (``blob_name`` writes it) and keeps rsagg's decision, so it never asks rsagg again meanwhile.
        inline = pub.blobs.read_inline(row.sha256) if self.offload != "x-accel" else None
        if inline is not None:
            hot.size, hot.body = len(inline), inline
            return self._with_plain(hot)
        if self.offload == "x-accel":
            hot.target = self.location + pub.blobs.blob_name(row.sha256)
        elif self.offload == "redirect":
            url = pub.blobs.url(row.sha256, self.lifetime, hot.headers["content-type"])
            if url is not None:
                hot.target = url
                hot.expires = min(hot.expires, time.monotonic() + self.lifetime / 2)
            elif not self._no_url_logged:
                self._no_url_logged = True
                log.warning("server.offload = redirect: the blob store has no URLs; rsagg serves the bytes")
        if hot.target is None:
            hot.size, hot.body = _local_blob(pub.blobs.local_path(row.sha256))
        return self._with_plain(hot)

    def _with_plain(self, hot: Hot) -> Hot:
        """``hot`` with its ready answer to a plain GET when there is one (not a big local blob)."""
        plain = self._answer(LiteRequest("GET", {}), hot)
        if plain is not None and (hot.status != 200 or hot.target is not None or hot.body is not None):
            hot.plain = plain.status_code, plain.raw_headers, bytes(plain.body)
            hot.lane_head = b"HTTP/1.1 %d \r\n%s" % (
                plain.status_code,
                b"".join(b"%s: %s\r\n" % h for h in plain.raw_headers),
            )
        return hot

    def close(self) -> None:
        self.cache.close()


def _expires(seconds: int, uri: str) -> int:
    """``seconds`` less up to a fifth, the same for a resource every time: answers nginx kept together
    (a crawl) do not all expire in the same second, and none is kept longer than ``seconds``."""
    return seconds - zlib.crc32(uri.encode("utf-8", "surrogatepass")) % (seconds // 5 + 1)


def _local_blob(path: Path | None) -> tuple[int | None, bytes | None]:
    """A local blob's size, and its bytes when it is small (None, None: not local or missing; the
    ordinary route streams it, or answers 500 and says so)."""
    if path is None:
        return None, None
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return size, (f.read() if size <= SMALL_BLOB else None)
    except OSError:
        return None, None


__all__ = [
    "HOT_BYTES",
    "HOT_ENTRIES",
    "FastPathPublisher",
    "Hot",
    "HotCache",
    "ResourceFastPath",
    "ServedCounter",
]
