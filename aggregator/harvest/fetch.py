"""Every HTTP GET rsagg makes goes through one ``Fetcher``: one ``httpx.AsyncClient`` for the process.

Why one place: politeness (a per-host concurrency limit, retries with backoff that honour
``Retry-After``), safety (size caps enforced while streaming, total deadlines on documents) and fixity
(§7 ``hash``/``length`` checked on every resource, mirrors tried in order, §14.2) must hold for every
fetch, not only for the ones that remembered to ask.

Content codings and fixity (decision, §7): the ``hash`` and ``length`` attributes describe "a resource
representation returned when the URI in <loc> is dereferenced"; ``length`` "should be equal to the value of
the Content-Length header" and ``encoding`` "should be equal to the value of the content-encoding header".
Content-Length counts the body *as sent*, after content coding (RFC 2616 §4.4, §14.13), so the announced
hash and length are those of the encoded bytes. Resources are therefore fetched with
``Accept-Encoding: identity`` (so that no server applies a coding the Source did not announce), streamed
with ``aiter_raw`` (never decoded), verified and stored exactly as served, and the Content-Encoding
is handed back (``FetchedResource.encoding``) so that republishing serves the same representation with
the same hash. Capability documents, on the other hand, are only parsed: for them gzip/deflate codings
(and a gzip file served as is, like ``sitemap.xml.gz``) are undone here, with bounded output per step,
and ``DocumentStream.sha256`` is the hash of the decoded XML (stable for change detection even when a
server re-compresses).

Documents are downloaded as fast as the network allows into a spool file (memory, then a temp file),
and parsed at the caller's pace. Why: callers iterate a Resource List while fetching every resource it
names, which may take hours; holding the document's connection (and its per-host slot) open at that pace
would both starve the per-host limit and let real servers time the connection out mid-document.
"""

from __future__ import annotations

import collections
import contextvars
import logging
import tempfile
import urllib.request
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, BinaryIO, TypeVar

import httpx
import trio

from .. import __version__
from ..errors import CountedError
from ..net import lean, outbound
from ..net.retry import backoff, retry_after, retryable_status
from ..rs import parse
from ..rs.fixity import Hasher, mismatches
from ..rs.model import Entry, Head
from ..store.blobs import SPOOL_BYTES, BlobInfo, BlobStore, BlobWriter, begin_spooled
from .deviations import deviation

log = logging.getLogger("rsagg.fetch")

T = TypeVar("T")

MAX_REDIRECTS = 10
#: Bytes read from the spool (and handed to the parser) per step; also the bound on decoded output per step.
CHUNK = 64 * 1024
#: Document bodies up to this size stay in memory while spooled; bigger ones go to a temp file.
SPOOL_MEMORY = 1024 * 1024
#: A document whose answer declares at most this many bytes (Content-Length) is read whole by the task
#: that asked for it, then parsed; a larger one, or one of unknown length, by a task of its own while
#: the caller parses it (``Fetcher._start_document``).
INLINE_DOCUMENT = 256 * 1024
#: Resource bodies up to this size stay in memory until their batch is committed (``begin_spooled``).
SMALL_BODY = SPOOL_BYTES
DOCUMENT_ACCEPT = "application/xml, text/xml;q=0.9, */*;q=0.1"

MetricsHook = Callable[[str, int | None, float, int], None]
#: Called before each hop of a request is sent (``harvest/access.py``: credentials, rate); may wait.
#: It gets the hop's request: an ``httpx.Request``, or on the lean path a ``lean.Request``, whose
#: ``url`` (``scheme``, ``host``, ``port``, ``str()``) and ``headers`` (an ``httpx.Headers``, to change
#: in place) mean the same.
RequestHook = Callable[[Any], Awaitable[None]]
#: A response on either path: ``lean.Response`` reads like the part of ``httpx.Response`` used here.
AnyResponse = httpx.Response | lean.Response


class FetchError(CountedError):
    """A fetch that failed for good (after retries); ``str()`` names the URL and the problem.

    ``kind`` is one of "http", "timeout", "network", "fixity", "size", "parse", "patch", "refused"
    (the outbound address policy refused the connection, ``outbound.py``).
    ``transient`` says another try may succeed (used by the retry loop); ``retry_after`` is the
    server's ``Retry-After`` in seconds, if it sent one.
    """

    def __init__(
        self,
        url: str,
        kind: str,
        message: str,
        *,
        status: int | None = None,
        line: int | None = None,
        transient: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(url, kind, message)
        self.url = url
        self.kind = kind
        self.message = message
        self.status = status
        self.line = line
        self.transient = transient
        self.retry_after = retry_after

    def __str__(self) -> str:
        # The parser's messages already start with the URL ("url:line: reason").
        return self.message if self.message.startswith(self.url) else f"{self.url}: {self.message}"


@dataclass
class Expected:
    """What the upstream announced for a resource (§7 ``rs:md``): checked on every fetch."""

    hashes: dict[str, str]  # fixity.parse_hash(...) tokens
    length: int | None = None

    def problems(self, info: BlobInfo) -> list[str]:
        """What differs between the announcement and what arrived (empty when it matches)."""
        out = []
        if self.length is not None and info.length != self.length:
            out.append(f"length: expected {self.length}, got {info.length}")
        for algo in mismatches(self.hashes, info.hashes):
            out.append(f"{algo}: expected {self.hashes[algo]}, got {info.hashes[algo]}")
        return out


@dataclass
class DocumentStream:
    """A capability document being read: the head is there, entries arrive as the body is parsed."""

    url: str  # final URL after redirects
    not_modified: bool  # 304: head/entries unavailable
    etag: str | None
    last_modified: str | None
    content_type: str | None
    link_header: str | None
    head: Head | None
    entries: AsyncIterator[Entry]
    sha256: str | None = None  # of the decoded body, set once entries are exhausted


@dataclass
class FetchedResource:
    """A verified resource in a finished, *uncommitted* blob (the caller commits in batches)."""

    url: str  # which URL served it
    blob: BlobWriter
    info: BlobInfo
    content_type: str | None
    encoding: str | None  # Content-Encoding as served (the bytes are stored encoded, see module doc)
    #: Validators as served (sent back when the held version is re-checked: ``resource(validators=)``).
    etag: str | None = None
    last_modified: str | None = None


class ResourceNotModified(Exception):
    """A conditional fetch of a resource answered 304: the upstream still serves the held version."""

    def __init__(self, url: str) -> None:
        super().__init__(f"{url}: not modified (304)")
        self.url = url


@dataclass
class FetchedBytes:
    """A small body, decoded (robots.txt, HTML pages, metadata records)."""

    url: str  # final URL after redirects
    status: int
    content: bytes
    content_type: str | None
    headers: httpx.Headers | lean.Headers = field(repr=False)

    @property
    def link_header(self) -> str | None:
        return self.headers.get("link")


# -- helpers -------------------------------------------------------------------------------------


def _transport_error(url: str, exc: Exception) -> FetchError:
    """Map an httpx failure to a FetchError; only what may heal by itself is transient."""
    detail = str(exc) or type(exc).__name__
    refusal = outbound.refusal_of(exc)
    if refusal is not None:  # never transient: the same address is refused on every try
        return FetchError(url, "refused", f"{refusal} (rule {refusal.rule})")
    if isinstance(exc, httpx.TimeoutException):
        return FetchError(url, "timeout", f"timed out ({type(exc).__name__}): {detail}", transient=True)
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL | httpx.LocalProtocolError):
        return FetchError(url, "network", detail)
    return FetchError(url, "network", f"{type(exc).__name__}: {detail}", transient=True)


def _redirect(
    request: httpx.Request | lean.Request, response: AnyResponse, extensions: dict[str, Any] | None = None
) -> httpx.Request | lean.Request:
    """The GET a redirect asks for: ``Location`` resolved against the request URL (RFC 9110 §10.2.2,
    §15.4; a fragment carries over when Location has none). Headers are kept but Host (it follows the
    URL) and credentials or cookies (``harvest/access.py`` sets a source's own again on its origin only).
    A lean hop's redirect stays on the lean path when the new URL is one it sends (``lean.parse_url``),
    else it goes to httpx."""
    base = request.url if isinstance(request, httpx.Request) else httpx.URL(str(request.url))
    try:
        url = httpx.URL(response.headers["location"])
        if url.scheme and not url.host:  # "http:/path": absolute form without a host
            url = url.copy_with(host=base.host)
        if url.is_relative_url:
            url = base.join(url)
        if base.fragment and not url.fragment:
            url = url.copy_with(fragment=base.fragment)
    except (httpx.InvalidURL, ValueError) as exc:
        raise FetchError(str(request.url), "http", f"bad redirect Location: {exc}") from exc
    drop = {"host", "authorization", "cookie"}
    headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in drop]
    if isinstance(request, lean.Request):
        lean_url = lean.parse_url(str(url))
        if lean_url is not None:
            return lean.Request(lean_url, httpx.Headers(headers))
    if isinstance(request, httpx.Request):
        extensions = request.extensions
    return httpx.Request("GET", url, headers=headers, extensions=extensions or {})


def _check_url(url: str) -> None:
    scheme = url.partition(":")[0].lower()
    if scheme not in ("http", "https"):
        # e.g. a gsiftp:// mirror (§14.2 Example 24): not for us, never worth a retry.
        raise FetchError(url, "network", f"unsupported URL scheme {scheme!r}")


class _Inflate:
    """One gzip/deflate layer with bounded output per step (a small bomb cannot balloon in memory)."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._wbits: int | None = 31 if coding in ("gzip", "x-gzip") else None
        self._z: Any = None if self._wbits is None else zlib.decompressobj(self._wbits)

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self._z is None:  # deflate: zlib-wrapped as the RFC says, or raw as some servers send it
            self._wbits = 15 if data and data[0] & 0x0F == 8 else -15
            self._z = zlib.decompressobj(self._wbits)
        while data:
            out = self._z.decompress(data, CHUNK)
            if out:
                yield out
            if self._z.eof:
                data = self._z.unused_data
                if data:  # concatenated gzip members are one stream (RFC 1952 §2.2)
                    assert self._wbits is not None  # set with self._z
                    self._z = zlib.decompressobj(self._wbits)
            else:
                data = self._z.unconsumed_tail

    def finish(self) -> Iterator[bytes]:
        if self._z is None:
            return
        out = self._z.flush()
        if out:
            yield out
        if not self._z.eof:
            raise zlib.error(f"{self.coding} stream truncated")


class _Sniff:
    """Undoes gzip when the body itself is a gzip file (``sitemap.xml.gz`` served without a coding)."""

    def __init__(self) -> None:
        self._buf = b""
        self._inner: _Inflate | None = None
        self._decided = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        if not self._decided:
            self._buf += data
            if len(self._buf) < 2:
                return
            data, self._buf, self._decided = self._buf, b"", True
            if data[:2] == b"\x1f\x8b":
                self._inner = _Inflate("gzip")
        yield from (self._inner.feed(data) if self._inner else (data,))

    def finish(self) -> Iterator[bytes]:
        if not self._decided and self._buf:
            yield self._buf
        if self._inner is not None:
            yield from self._inner.finish()


class _Decoder:
    """Undo the content codings of a body, last applied first; bounded output pieces."""

    def __init__(self, url: str, content_encoding: str | None, *, sniff_gzip: bool = False) -> None:
        self.url = url
        codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
        codings = [c for c in codings if c and c != "identity"]
        for c in codings:
            if c not in ("gzip", "x-gzip", "deflate"):
                raise FetchError(url, "http", f"unsupported Content-Encoding {c!r}")
        self._layers: list[_Inflate | _Sniff] = [_Inflate(c) for c in reversed(codings)]
        if sniff_gzip:
            self._layers.append(_Sniff())

    def feed(self, data: bytes) -> Iterator[bytes]:
        try:
            yield from self._run(0, data)
        except zlib.error as exc:
            raise FetchError(self.url, "parse", f"bad content coding: {exc}") from exc

    def finish(self) -> Iterator[bytes]:
        try:
            for i, layer in enumerate(self._layers):
                for out in layer.finish():
                    yield from self._run(i + 1, out)
        except zlib.error as exc:
            raise FetchError(self.url, "parse", f"bad content coding: {exc}") from exc

    def _run(self, i: int, data: bytes) -> Iterator[bytes]:
        if i == len(self._layers):
            if data:
                yield data
            return
        for out in self._layers[i].feed(data):
            yield from self._run(i + 1, out)


class _Body:
    """An open response; ``chunks()`` streams the raw body and turns httpx failures into FetchErrors;
    ``close`` ends it (``Fetcher._open``: the response, its report and its request slot)."""

    __slots__ = ("_fetcher", "_host", "_slot", "_start", "received", "response", "url")

    def __init__(
        self, url: str, response: AnyResponse, fetcher: Fetcher, host: str, start: float, slot: _HostSlot
    ) -> None:
        self.url = url
        self.response: AnyResponse = response
        self.received = 0
        self._fetcher, self._host, self._start, self._slot = fetcher, host, start, slot

    async def close(self, ok: bool) -> None:
        """Close the response and give its request slot back (``ok``: it was read as its reader wanted;
        a slot may then be kept for the task's next GET, ``SlotKeeper``)."""
        try:
            await self.response.aclose()
        finally:
            self._fetcher._report(self._host, self.response.status_code, self._start, self.received)
            self._slot.give(ok)

    @property
    def final_url(self) -> str:
        return str(self.response.url)

    async def chunks(self) -> AsyncIterator[bytes]:
        response = self.response
        if isinstance(response, httpx.Response) and response.is_stream_consumed:
            # read up front by the transport (httpx.MockTransport)
            self.received += len(response.content)
            yield response.content
            return
        try:
            async for chunk in self.response.aiter_raw():
                self.received += len(chunk)
                yield chunk
        except httpx.HTTPError as exc:
            raise _transport_error(self.final_url, exc) from exc


async def _pour(body: _Body, decoder: _Decoder, put: Callable[[bytes], None]) -> None:
    """``body``, decoded, piece by piece into ``put``."""
    async for raw in body.chunks():
        for piece in decoder.feed(raw):
            put(piece)
    for piece in decoder.finish():
        put(piece)


class _Spool:
    """A document body, written by its download (``Fetcher._download_document``: a task of its own, or
    the caller before it parses) and read by the parser, each at its own pace."""

    def __init__(self) -> None:
        #: Made at the first bytes (closed by close()): a document read whole (``_Whole``) needs none.
        self.file: Any = None
        self.written = 0
        self.done = False
        self.error: BaseException | None = None
        self.sha256: str | None = None
        self.closed = False
        # Made when first needed, like the file: a document read whole never waits or downloads here.
        self._scope: trio.CancelScope | None = None
        self._more: trio.Event | None = None

    @property
    def scope(self) -> trio.CancelScope:
        """Entered by the download task; cancelled by close() (already, when made after it)."""
        if self._scope is None:
            self._scope = trio.CancelScope()
            if self.closed:
                self._scope.cancel()
        return self._scope

    def append(self, data: bytes) -> None:
        if self.closed:  # a download finishing its last step after being cancelled
            return
        if self.file is None:
            self.file = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY)
        self.file.seek(0, 2)
        self.file.write(data)
        self.written += len(data)
        self._wake()

    def finish(self, sha256: str | None = None, error: BaseException | None = None) -> None:
        if not self.done:
            self.done, self.sha256, self.error = True, sha256, error
            self._wake()

    def _wake(self) -> None:
        if self._more is not None:  # the reader waits
            self._more.set()
            self._more = None

    async def read(self, pos: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``pos``; b"" at the clean end; the download's error at a broken end."""
        if self.written <= pos and not self.done:
            while self.written <= pos and not self.done:
                if self._more is None:
                    self._more = trio.Event()
                await self._more.wait()
        else:
            await trio.lowlevel.checkpoint()  # the caller's loop must yield even when data is ready
        if self.written > pos:
            self.file.seek(pos)
            return self.file.read(min(n, self.written - pos))
        if self.error is not None:
            raise self.error
        return b""

    def close(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
        self.closed = True
        if self.file is not None:
            self.file.close()


class _Whole:
    """A document body read whole by the task that asked for it (``INLINE_DOCUMENT``), in memory: parsed
    at once (``_Entries.parse_whole``), with no spool between the download and the parser. Why: the
    spool's file, its reads and their passes through the scheduler cost more than the parse of a small
    document (a small Source's two documents: benchmarks/bench_many_sources.py). ``_download`` fills it
    as it would a spool."""

    __slots__ = ("done", "error", "parts", "sha256")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.done = False
        self.error: BaseException | None = None
        self.sha256: str | None = None

    def append(self, data: bytes) -> None:
        self.parts.append(data)

    def finish(self, sha256: str | None = None, error: BaseException | None = None) -> None:
        if not self.done:
            self.done, self.sha256, self.error = True, sha256, error

    def into(self, spool: _Spool, error: BaseException | None) -> None:
        """What arrived, then ``error``, handed to ``spool``: a body that did not arrive whole is read
        from there as any other (the parser meets the error where the bytes end)."""
        for part in self.parts:
            spool.append(part)
        spool.finish(error=error)


def _no_end(sha256: str | None) -> None:
    pass


class _Entries:
    """The entries of a document, parsed from the spool as the caller asks for them."""

    def __init__(self, spool: _Spool, reader: parse.DocumentReader, url: str) -> None:
        self._spool = spool
        self._reader = reader
        self._url = url
        self._pos = 0
        self._items: collections.deque[Head | Entry] = collections.deque()
        self._end = False
        self._error: FetchError | None = None
        #: The body's SHA-256, once parsed to its end.
        self.sha256: str | None = None
        #: Told the SHA-256 once the document is parsed to its end (``Fetcher._start_document``).
        self.on_end: Callable[[str | None], None] = _no_end

    def parse_whole(self, whole: _Whole) -> None:
        """Parse a body that arrived whole, now: every item ready, or the error met after the items
        before it, exactly as the spool's reads would have handed them (``CHUNK`` bytes a feed)."""
        data = b"".join(whole.parts)
        try:
            for i in range(0, len(data), CHUNK):
                self._pos = min(len(data), i + CHUNK)
                self._items.extend(self._reader.feed(data[i : i + CHUNK]))
            self._items.extend(self._reader.close())
        except parse.DocumentError as exc:
            self._error = self._refused(exc)
            return
        self._end = True
        self.sha256 = whole.sha256

    def _refused(self, exc: parse.DocumentError) -> FetchError:
        """The parser's refusal as the fetch's error (its message names the URL and the line: the
        contract of parse.py)."""
        return FetchError(self._url, "parse", str(exc), line=getattr(exc, "line", None))

    def __aiter__(self) -> _Entries:
        return self

    async def __anext__(self) -> Entry:
        item = await self._next()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, Head):  # the parser promises one Head, first; anything else is a bug there
            raise FetchError(self._url, "parse", "a second document head")
        return item

    @property
    def ended(self) -> bool:
        """The document was parsed to its end."""
        return self._end

    def estimate(self, count: int) -> int | None:
        """Entries in the whole document, from the ``count`` handed out and the share of its bytes parsed;
        None while it is still arriving (its size is not known yet)."""
        parsed = count + len(self._items)
        if self._end:
            return parsed
        if not self._spool.done or not self._pos:
            return None
        return max(parsed, round(parsed * self._spool.written / self._pos))

    async def head(self) -> Head:
        item = await self._next()
        if not isinstance(item, Head):
            raise FetchError(self._url, "parse", "the document has no head")
        return item

    async def _next(self) -> Head | Entry | None:
        while not self._items:
            if self._error is not None:
                raise self._error
            if self._end:
                return None
            data = await self._spool.read(self._pos, CHUNK)
            try:
                if data:
                    self._pos += len(data)
                    self._items.extend(self._reader.feed(data))
                else:
                    self._items.extend(self._reader.close())
                    self._end = True
                    self.sha256 = self._spool.sha256
                    self.on_end(self.sha256)
            except parse.DocumentError as exc:
                self._error = self._refused(exc)
                raise self._error from exc
        return self._items.popleft()


class _NoEntries:
    def __aiter__(self) -> _NoEntries:
        return self

    async def __anext__(self) -> Entry:
        raise StopAsyncIteration


# -- connection pools ----------------------------------------------------------------------------

#: Connections per httpcore pool behind the one client (see ``_ShardedTransport``).
CONNECTIONS_PER_POOL = 4


class _CountedStream(httpx.AsyncByteStream):
    """A response body that tells its pool when the response is closed (the request is over)."""

    def __init__(self, stream: httpx.AsyncByteStream, done: Callable[[], None]) -> None:
        self._stream = stream
        self._done: Callable[[], None] | None = done

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            done, self._done = self._done, None
            if done is not None:
                done()


class _ShardedTransport(httpx.AsyncBaseTransport):
    """Several small httpcore pools behind one client; each request goes to the least busy pool.

    Why: httpcore 1.0's pool re-examines every connection on every request start and end (a
    ``poll()`` per idle socket, and a quadratic keep-alive count; encode/httpcore PR #1035), so one
    pool of 64 connections cost ~3 ms of event-loop time per request here, against ~0.6 ms for
    pools of a few connections. Keep-alive reuse is unchanged: least busy = lowest index among
    equals, so a light load keeps reusing the first pools' connections.
    """

    def __init__(
        self,
        max_connections: int,
        per_pool: int = CONNECTIONS_PER_POOL,
        policy: outbound.AddressPolicy | None = None,
        ssl_context: Any = None,
    ) -> None:
        per_pool = max(1, min(per_pool, max_connections))
        sizes = [per_pool] * (max_connections // per_pool)
        if max_connections % per_pool:
            sizes.append(max_connections % per_pool)
        # One for all: each loads the CA bundle (~0.7 MB); the lean pool verifies with the same one.
        ssl_context = ssl_context or httpx.create_ssl_context()
        self._pools = [
            outbound.transport(
                policy,
                verify=ssl_context,
                limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
            )
            for n in sizes
        ]
        self._capacity = sizes
        self._busy = [0] * len(sizes)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        busy, capacity = self._busy, self._capacity
        i = min(range(len(busy)), key=lambda k: busy[k] / capacity[k])
        busy[i] += 1

        def done() -> None:
            busy[i] -= 1

        try:
            response = await self._pools[i].handle_async_request(request)
        except BaseException:
            done()
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _CountedStream(response.stream, done)
        return response

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()


#: GETs in a row that a task keeping its request slots (``Fetcher.keeping_slots``) makes on one slot of
#: a host before it hands the slot on to whoever waits for it.
KEEP_MOST = 8


class SlotKeeper:
    """A task's request slot kept from one GET to its next (``Fetcher.keeping_slots``).

    Why: when more tasks want a host than it has slots (many small Sources of one host, each pipeline
    with its fetch task), every GET of a task that hands its slot back at once then waits for the next
    free one: a park and a wake-up per resource, a third of a small Source's passes through the
    scheduler (benchmarks/bench_many_sources.py). Kept for up to ``KEEP_MOST`` GETs in a row while the
    task has more to fetch, the slot changes hands once per ``KEEP_MOST`` GETs instead. Never more
    requests at once than the host's slots: a kept slot stays borrowed."""

    __slots__ = ("limiter", "more", "uses")

    def __init__(self, more: Callable[[], bool]) -> None:
        #: Whether the task has another GET coming at once (a fetch waiting for it).
        self.more = more
        #: The limiter of the slot kept now (None: none kept).
        self.limiter: trio.CapacityLimiter | None = None
        self.uses = 0

    def hand_back(self) -> None:
        """Give the kept slot back (before the task waits for anything but its next GET)."""
        limiter, self.limiter = self.limiter, None
        self.uses = 0
        if limiter is not None:
            limiter.release()


class _HostSlot:
    """One slot of a host's limiter: ``take`` it at once when one is free (``acquire_nowait`` queues
    behind waiters as ``acquire`` does), else wait for it; or the slot the task kept from its last GET
    (``SlotKeeper``). Why not ``async with limiter``: that always passes through the scheduler once
    more, a cost on every request; the request's own I/O follows at once and is where it may be
    cancelled. ``borrower``: whom the slot is borrowed for when not the task that takes it (a document
    whose body another task may finish reading: ``Fetcher._start_document``)."""

    __slots__ = ("_borrower", "_keeper", "_limiter")

    def __init__(
        self, limiter: trio.CapacityLimiter, keeper: SlotKeeper | None = None, borrower: object = None
    ) -> None:
        self._limiter = limiter
        self._keeper = keeper
        self._borrower = borrower

    async def take(self) -> None:
        keeper, limiter = self._keeper, self._limiter
        if keeper is not None and keeper.limiter is not None:
            if keeper.limiter is limiter:
                keeper.limiter = None  # in use again
                return
            keeper.hand_back()  # another host's
        borrower = self._borrower
        try:
            if borrower is None:
                limiter.acquire_nowait()
            else:
                limiter.acquire_on_behalf_of_nowait(borrower)
        except trio.WouldBlock:
            await (limiter.acquire() if borrower is None else limiter.acquire_on_behalf_of(borrower))

    def give(self, ok: bool) -> None:
        keeper = self._keeper
        if keeper is not None:
            if ok and keeper.uses < KEEP_MOST - 1 and keeper.more():
                keeper.uses += 1
                keeper.limiter = self._limiter
                return
            keeper.uses = 0
        if self._borrower is None:
            self._limiter.release()
        else:
            self._limiter.release_on_behalf_of(self._borrower)


# -- the fetcher ---------------------------------------------------------------------------------


def _tolerated(url: str, rule: str, line: int | None, message: str) -> None:
    """A deviation the document parser read past on purpose, under its own rule."""
    deviation(rule, url, line, message)


def _problem_logger(url: str) -> Callable[[int | None, str], None]:
    def problem(line: int | None, message: str) -> None:
        deviation("value", url, line, f"{message} (value ignored)")  # logged once, counted, shown

    return problem


class Fetcher:
    """The one HTTP client of the process (see the module docstring for why)."""

    def __init__(
        self,
        *,
        per_host: int = 8,
        max_connections: int = 64,
        timeout: float = 30.0,
        retries: int = 4,
        backoff_base: float = 0.5,
        backoff_max: float = 60.0,
        max_document_bytes: int = parse.DEFAULT_MAX_BYTES,
        max_resource_bytes: int = 2**34,
        user_agent: str = f"rsagg/{__version__}",
        transport: httpx.AsyncBaseTransport | None = None,
        metrics_hook: MetricsHook | None = None,
        document_deadline: float = 900.0,
        policy: outbound.AddressPolicy | None = None,
        request_hook: RequestHook | None = None,
    ) -> None:
        """``policy``: the outbound address policy every connection obeys (``outbound.py``; the daemon
        always passes one); None connects anywhere (a library user's own choice)."""
        self.per_host = per_host
        self.policy = policy
        self.retries = retries
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.max_document_bytes = max_document_bytes
        self.max_resource_bytes = max_resource_bytes
        #: Total time for downloading one document (or one ``get_bytes`` body), retries excluded:
        #: a server dripping a byte just often enough to beat the read timeout cannot hold us forever.
        self.document_deadline = document_deadline
        self.metrics_hook = metrics_hook
        self.request_hook = request_hook
        self._limiters: dict[str, trio.CapacityLimiter] = {}
        #: The tasks that keep their request slots between GETs (``keeping_slots``).
        self._keepers: dict[trio.lowlevel.Task, SlotKeeper] = {}
        #: Cluster nodes sharing each host (``set_host_shares``): a host's ``per_host`` is split among them.
        self._sharers: dict[str, int] = {}
        self._default_sharers = 1
        # pool=None: waiting for a free connection is not a failure; our own limiters bound the waits.
        timeouts = httpx.Timeout(timeout, pool=None)
        own_transport = transport is None
        ssl_context = httpx.create_ssl_context() if own_transport else None
        transport = transport or _ShardedTransport(max_connections, policy=policy, ssl_context=ssl_context)
        self._client = httpx.AsyncClient(
            timeout=timeouts,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            headers={"User-Agent": user_agent},
            transport=transport,
            follow_redirects=False,  # followed by hand: each hop takes its own host's slot
        )
        # Requests are built here and handed to the client's transport directly, skipping the client
        # layer (auth flow, cookie jar, event hooks, URL/header merging: ~150 us of the event loop per
        # request, a quarter of all httpx costs; measured). rsagg uses none of it: no auth flow (a source's
        # credentials are headers ``request_hook`` sets per hop), no cookies (like resync). With proxies
        # in the environment, requests go through the client, which routes them (``trust_env``);
        # redirects are followed by ``_redirect`` either way.
        self._direct: httpx.AsyncBaseTransport | None = None if urllib.request.getproxies() else transport
        self._base_headers = {"User-Agent": user_agent, "Accept": "*/*", "Connection": "keep-alive"}
        self._lean_fields: dict[tuple[tuple[str, str], ...], httpx.Headers] = {}  # ``_lean_headers``
        self._extensions = {"timeout": timeouts.as_dict()}
        # The lean path (``net/lean.py``): resource and package GETs whose URL it can send as is, over
        # its own keep-alive connections, same policy, same TLS context and timeout as the httpx pools.
        # Not with a transport given (a test's MockTransport answers for the network) or with proxies in
        # the environment (the client routes those): then every request takes the httpx path.
        self._lean: lean.LeanPool | None = None
        if own_transport and self._direct is not None:
            self._lean = lean.LeanPool(
                policy, timeout=timeout, ssl_context=ssl_context, max_connections=max_connections
            )

    async def aclose(self) -> None:
        if self._lean is not None:
            await self._lean.aclose()
        await self._client.aclose()

    async def __aenter__(self) -> Fetcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- plumbing ---------------------------------------------------------------------------------

    @contextmanager
    def keeping_slots(self, more: Callable[[], bool]) -> Iterator[SlotKeeper | None]:
        """Inside, the current task keeps its request slot from one GET to the next (``SlotKeeper``)
        while ``more()`` says another GET comes at once; the caller calls ``hand_back()`` on what this
        yields before it waits for anything else (its next item). Yields None, keeping nothing, for a
        Source whose requests keep a pace (``max_rate``): a slot kept through the pause would stand idle
        while others wait."""
        paces = getattr(self.request_hook, "paces", None)
        if paces is not None and paces():
            yield None
            return
        task = trio.lowlevel.current_task()
        keeper = self._keepers[task] = SlotKeeper(more)
        try:
            yield keeper
        finally:
            del self._keepers[task]
            keeper.hand_back()

    def _keeper(self) -> SlotKeeper | None:
        """The current task's ``SlotKeeper``, if it keeps its slots (``keeping_slots``)."""
        return self._keepers.get(trio.lowlevel.current_task()) if self._keepers else None

    def _limiter(self, host: str) -> trio.CapacityLimiter:
        lim = self._limiters.get(host)
        if lim is None:
            lim = self._limiters[host] = trio.CapacityLimiter(self.host_limit(host))
        return lim

    def host_busy(self, host: str, coming: int = 0) -> bool:
        """Every request slot of ``host`` is taken now, or will be by ``coming`` requests about to be
        made: one more request to it would only wait (a caller need not start a task for it:
        ``pipeline._Workers``)."""
        lim = self._limiters.get(host)
        if lim is None:
            return coming >= self.host_limit(host)
        return lim.borrowed_tokens + coming >= lim.total_tokens

    def host_limit(self, host: str) -> int:
        """Requests this process may have open to ``host`` at once: its share of ``per_host``."""
        sharers = self._sharers.get(host.lower(), self._default_sharers)
        return max(1, self.per_host // max(1, sharers))

    def set_host_shares(self, sharers: dict[str, int], default: int) -> None:
        """Split each host's ``per_host`` among the cluster nodes harvesting it (``cluster.py``):
        ``sharers`` maps a host to how many nodes hold a source on it, ``default`` is used for other
        hosts (every live node may reach them). Applies at once to requests not yet started."""
        self._sharers = {h.lower(): n for h, n in sharers.items()}
        self._default_sharers = default
        for host, lim in self._limiters.items():
            lim.total_tokens = self.host_limit(host)

    def _report(self, host: str, status: int | None, start: float, nbytes: int) -> None:
        if self.metrics_hook is None:
            return
        try:
            self.metrics_hook(host, status, trio.current_time() - start, nbytes)
        except Exception:  # a broken metrics hook must not break harvesting
            log.exception("metrics hook failed")

    async def _sleep(self, seconds: float) -> None:
        keeper = self._keeper()
        if keeper is not None:  # nobody waits on a slot kept through a backoff
            keeper.hand_back()
        await trio.sleep(seconds)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        """rsagg's one backoff (``retry.py``) within this fetcher's bounds."""
        return backoff(attempt, base=self.backoff_base, cap=self.backoff_max, retry_after=retry_after)

    async def _with_retries(self, url: str, attempt: Callable[[], Awaitable[T]]) -> T:
        for n in range(self.retries + 1):
            try:
                return await attempt()
            except FetchError as exc:
                if not exc.transient or n == self.retries:
                    raise
                delay = self._backoff(n, exc.retry_after)
                log.info("retry %d/%d of %s in %.2fs: %s", n + 1, self.retries, url, delay, exc)
                await self._sleep(delay)
        raise AssertionError("unreachable")

    def _lean_headers(self, headers: dict[str, str]) -> httpx.Headers:
        """The base headers and ``headers``, a fresh ``httpx.Headers`` (the request hook changes it),
        copied from one built once per set of fields: building it anew was a twentieth of a lean GET's
        CPU. Conditional GETs (per-resource validators) are built each time, the cache kept small."""
        key = tuple(headers.items())
        built = self._lean_fields.get(key)
        if built is None:
            built = httpx.Headers({**self._base_headers, **headers})
            if len(self._lean_fields) >= 64:
                self._lean_fields.clear()
            self._lean_fields[key] = built
        return built.copy()

    @asynccontextmanager
    async def _get(self, url: str, headers: dict[str, str], *, lean_ok: bool = False) -> AsyncIterator[_Body]:
        """``async with``: one GET (``_open``), its body inside, closed after."""
        body = await self._open(url, headers, lean_ok=lean_ok)
        try:
            yield body
        except BaseException:
            await body.close(False)
            raise
        await body.close(True)

    async def _open(
        self, url: str, headers: dict[str, str], *, lean_ok: bool = False, borrower: object = None
    ) -> _Body:
        """One GET, redirects followed (max 10), its answer open with the per-host slot held until
        ``_Body.close`` (``borrower``: see ``_HostSlot``).

        ``lean_ok``: the caller reads the body as served (no decoding): the GET takes the lean path
        when there is one and it can send the URL as written (``lean.parse_url``), else httpx."""
        _check_url(url)
        request: httpx.Request | lean.Request
        lean_url = lean.parse_url(url) if lean_ok and self._lean is not None else None
        try:
            if lean_url is not None:
                request = lean.Request(lean_url, self._lean_headers(headers))
            else:  # the httpx path: documents, small bodies, URLs or set-ups the lean path does not take
                request = httpx.Request("GET", url, headers={**self._base_headers, **headers},
                                        extensions=self._extensions)  # fmt: skip
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise _transport_error(url, exc) from exc
        keeper = self._keeper() if borrower is None else None
        for _hop in range(MAX_REDIRECTS + 1):
            host = request.url.host
            if self.request_hook is not None:
                await self.request_hook(request)
            slot = _HostSlot(self._limiter(host), keeper, borrower)
            await slot.take()
            start = trio.current_time()
            response: AnyResponse
            try:
                if isinstance(request, lean.Request):
                    assert self._lean is not None
                    try:
                        response = await self._lean.send(request)
                    except lean.HeadRefused:  # the httpx path's reading decides (``HeadRefused``)
                        request = httpx.Request("GET", str(request.url), headers=request.headers,
                                                extensions=self._extensions)  # fmt: skip
                        response = await self._send_httpx(request)
                else:
                    response = await self._send_httpx(request)
            except BaseException as exc:
                slot.give(False)
                if isinstance(exc, httpx.HTTPError | httpx.InvalidURL):
                    self._report(host, None, start, 0)
                    raise _transport_error(str(request.url), exc) from exc
                raise
            body = _Body(url, response, self, host, start, slot)
            if not response.has_redirect_location:  # 301, 302, 303, 307, 308 with a Location
                return body
            try:
                request = _redirect(request, response, self._extensions)
                _check_url(str(request.url))
            except BaseException:
                await body.close(False)
                raise
            await body.close(True)
        raise FetchError(url, "http", f"more than {MAX_REDIRECTS} redirects")

    async def _send_httpx(self, request: httpx.Request) -> httpx.Response:
        if self._direct is not None:
            response = await self._direct.handle_async_request(request)
            response.request = request
            return response
        return await self._client.send(request, stream=True, follow_redirects=False)

    @staticmethod
    def _check_status(body: _Body, *, allow: tuple[int, ...] = ()) -> None:
        status = body.response.status_code
        if 200 <= status < 300 or status in allow:
            return
        reason = body.response.reason_phrase or ""
        raise FetchError(
            body.final_url,
            "http",
            f"HTTP {status} {reason}".rstrip(),
            status=status,
            transient=retryable_status(status),
            retry_after=retry_after(status, body.response.headers),
        )

    # -- documents --------------------------------------------------------------------------------

    @asynccontextmanager
    async def document(
        self,
        url: str,
        *,
        etag: str | None = None,
        last_modified: str | None = None,
        max_bytes: int | None = None,
    ) -> AsyncIterator[DocumentStream]:
        """Fetch a capability document (conditional GET); the head is parsed before this yields.

        ``entries`` then streams the rest. Failures up to the head are retried; a body that breaks
        later surfaces from ``entries`` as a FetchError (the caller retries the document later).
        """
        cap = self.max_document_bytes if max_bytes is None else max_bytes
        headers = {"Accept": DOCUMENT_ACCEPT, "Accept-Encoding": "gzip, deflate"}
        if etag:
            headers["If-None-Match"] = etag
        if last_modified:
            headers["If-Modified-Since"] = last_modified
        spools: list[_Spool] = []
        stream: DocumentStream | None = None
        try:
            stream = await self._with_retries(url, partial(self._start_document, url, headers, cap, spools))
            yield stream
        finally:
            for spool in spools:  # the caller is done: stop a download it no longer wants
                spool.close()
            if stream is not None and isinstance(stream.entries, _Entries):  # no cycle left behind:
                stream.entries.on_end = _no_end  # stream -> entries -> on_end -> stream

    async def _start_document(
        self, url: str, headers: dict[str, str], cap: int, spools: list[_Spool]
    ) -> DocumentStream:
        spool = _Spool()
        spools.append(spool)
        deadline = trio.current_time() + self.document_deadline
        body: _Body | None = None
        inline = False
        whole: _Whole | None = None
        with trio.move_on_at(deadline) as timer:
            # The slot is borrowed for the spool: a download task may finish the body (below).
            body = await self._open(url, headers, lean_ok=True, borrower=spool)
            try:
                self._check_status(body, allow=(304,))
            except BaseException:
                await body.close(False)
                raise
            declared = body.response.headers.get("content-length")
            if body.response.status_code == 304:
                await body.close(True)
                spool.finish()
            elif declared is not None and declared.isdigit() and int(declared) <= INLINE_DOCUMENT:
                # Read whole here, under the same deadline: a task, its start and the parser's waits
                # for it cost more than the transfer of a small document (a small Source's two
                # documents: benchmarks/bench_many_sources.py).
                inline, whole = True, _Whole()
                await self._download(body, cap, whole)
        if timer.cancelled_caught and body is None:  # no answer yet
            raise self._late(url)
        failed = self._late(url) if timer.cancelled_caught else whole.error if whole is not None else None
        if failed is not None:  # the parser meets it where the bytes end, as it would a download task's
            if whole is not None:  # what arrived goes through the spool, as any body not read whole
                whole.into(spool, failed)
                whole = None
            else:
                spool.finish(error=failed)
        assert body is not None
        h = body.response.headers
        common: dict[str, Any] = {
            "url": body.final_url,
            "content_type": h.get("content-type"),
            "link_header": h.get("link"),
            "last_modified": h.get("last-modified"),
        }
        if body.response.status_code == 304:
            common["last_modified"] = common["last_modified"] or headers.get("If-Modified-Since")
            etag = h.get("etag") or headers.get("If-None-Match")
            return DocumentStream(not_modified=True, etag=etag, head=None, entries=_NoEntries(), **common)
        if not inline:
            # The rest by a task of its own, into the spool, while the caller parses. A system task, not
            # a nursery: callers iterate documents inside async generators (harvest/lists.py), and a
            # nursery's cancel scope must never stay open across a generator's ``yield``. It never
            # raises; it is stopped through ``spool.scope`` and ends with the run at the latest.
            trio.lowlevel.spawn_system_task(
                self._download_document, body, cap, spool, deadline, name=f"rsagg.fetch {url}",
                context=contextvars.copy_context(),  # the caller's: metrics label requests by source
            )  # fmt: skip
        # Lenient on values (an unknown attribute or one bad date must not cost the whole document):
        # each problem is logged with its line; structural problems still raise DocumentError.
        reader = parse.DocumentReader(
            body.final_url, max_bytes=cap, on_problem=_problem_logger(body.final_url), require=True,
            on_tolerated=partial(_tolerated, body.final_url),
        )  # fmt: skip
        entries = _Entries(spool, reader, body.final_url)
        if whole is not None:
            entries.parse_whole(whole)
        try:
            head = await entries.head()
        except BaseException:
            spool.close()  # stop this attempt's download; a transient failure is retried afresh
            raise
        stream = DocumentStream(not_modified=False, etag=h.get("etag"), head=head, entries=entries, **common)

        def _ended(sha256: str | None) -> None:
            stream.sha256 = sha256

        entries.on_end = _ended
        if entries.ended:  # read whole, or a document without entries: its head came with its end
            _ended(entries.sha256)
        return stream

    async def _download_document(self, body: _Body, cap: int, spool: _Spool, deadline: float) -> None:
        """The download task of a document not read whole at once: ``_download`` by ``deadline``.

        Runs as a system task: it must not raise anything but Cancelled."""
        timer = trio.move_on_at(deadline)
        try:
            with spool.scope, timer:
                await self._download(body, cap, spool)
        finally:  # cancelled: by the deadline, or the caller left (or the run ends)
            if not spool.done:
                spool.finish(error=self._late(body.url) if timer.cancelled_caught else
                             FetchError(body.url, "network", "download cancelled"))  # fmt: skip

    def _late(self, url: str) -> FetchError:
        return FetchError(
            url, "timeout", f"document not read within {self.document_deadline}s", transient=True
        )

    async def _download(self, body: _Body, cap: int, spool: _Spool | _Whole) -> None:
        """Read the body into the spool (or whole into memory), decoded, and close it. Errors go to the
        spool (the parser raises them where it reaches them); nothing but Cancelled leaves."""
        url, ok = body.final_url, False
        try:
            decoder = _Decoder(url, body.response.headers.get("content-encoding"), sniff_gzip=True)
            hasher = Hasher()

            def put(piece: bytes) -> None:
                hasher.update(piece)
                if hasher.length > cap:
                    raise FetchError(url, "size", f"document larger than {cap} bytes")
                spool.append(piece)

            await _pour(body, decoder, put)
            spool.finish(sha256=hasher.sha256)
            ok = True
        except Exception as exc:
            if not isinstance(exc, FetchError):
                log.exception("downloading %s failed", url)
            spool.finish(error=exc)
        finally:  # cancelled: the spool is left to the caller, who knows why
            await body.close(ok)

    # -- small bodies, resources, packages ------------------------------------------------------

    async def get_bytes(self, url: str, *, max_bytes: int, lean_ok: bool = False) -> FetchedBytes:
        """A small body, decoded and held in memory (robots.txt, HTML, metadata records).

        ``lean_ok``: the GET may take the lean path (``_get``; the body is decoded here either way), for
        a caller that makes many of them in a row to one origin (OAI-PMH pages)."""

        async def attempt() -> FetchedBytes:
            with trio.move_on_after(self.document_deadline):
                headers = {"Accept-Encoding": "gzip, deflate"}
                async with self._get(url, headers, lean_ok=lean_ok) as body:
                    self._check_status(body)
                    resp = body.response
                    decoder = _Decoder(body.final_url, resp.headers.get("content-encoding"))
                    parts: list[bytes] = []
                    size = 0

                    def put(piece: bytes) -> None:
                        nonlocal size
                        size += len(piece)
                        if size > max_bytes:
                            raise FetchError(body.final_url, "size", f"body larger than {max_bytes} bytes")
                        parts.append(piece)

                    await _pour(body, decoder, put)
                    ctype = resp.headers.get("content-type")
                    return FetchedBytes(
                        body.final_url, resp.status_code, b"".join(parts), ctype, resp.headers
                    )
            raise FetchError(url, "timeout", f"not read within {self.document_deadline}s", transient=True)

        return await self._with_retries(url, attempt)

    async def _raw(
        self,
        url: str,
        max_bytes: int,
        expected: Expected | None,
        sink: Callable[[bytes], None],
        conditional: dict[str, str] | None = None,
    ) -> _Body:
        """Stream a body as served (no decoding) into ``sink``, enforcing size caps on the way. With
        ``conditional`` headers, a 304 raises ResourceNotModified."""
        headers = {"Accept-Encoding": "identity", **(conditional or {})}
        limit = expected.length if expected is not None else None
        async with self._get(url, headers, lean_ok=True) as body:
            if conditional and body.response.status_code == 304:
                raise ResourceNotModified(body.final_url)
            self._check_status(body)
            final = body.final_url
            declared = body.response.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > max_bytes:
                raise FetchError(
                    final, "size", f"Content-Length {declared} exceeds the cap of {max_bytes} bytes"
                )
            n = 0
            async for chunk in body.chunks():
                n += len(chunk)
                if limit is not None and n > limit:
                    raise FetchError(
                        final, "fixity", f"length: expected {limit}, got more than {limit} bytes"
                    )
                if n > max_bytes:
                    raise FetchError(final, "size", f"larger than the cap of {max_bytes} bytes")
                sink(chunk)
            return body

    async def _resource_once(
        self, url: str, expected: Expected, store: BlobStore, conditional: dict[str, str] | None = None
    ) -> FetchedResource:
        # md5 always: republished lists carry it for destinations that check md5 (resync's --hash md5).
        writer = begin_spooled(store, frozenset(expected.hashes) | {"md5"})
        try:
            body = await self._raw(url, self.max_resource_bytes, expected, writer.write, conditional)
            info = writer.finish()
            problems = expected.problems(info)
            if problems:
                raise FetchError(body.final_url, "fixity", "; ".join(problems))
        except BaseException:
            writer.abort()
            raise
        headers = body.response.headers
        return FetchedResource(
            body.final_url, writer, info, headers.get("content-type"), headers.get("content-encoding"),
            headers.get("etag"), headers.get("last-modified"),
        )  # fmt: skip

    async def resource(
        self,
        urls: Sequence[str],
        expected: Expected,
        store: BlobStore,
        *,
        etag: str | None = None,
        last_modified: str | None = None,
    ) -> FetchedResource:
        """Fetch and verify one resource, trying each URL in order (mirrors by ``pri``, then loc, §14.2).

        A fixity mismatch is tried once more at the same URL (a write may have been in progress), then
        the next URL is tried. The blob is finished but not committed. ``etag`` / ``last_modified``: what
        the upstream answered with the held version; sent as ``If-None-Match`` / ``If-Modified-Since``
        (RFC 9110 §13.1), and a 304 raises ResourceNotModified (keep what is held).
        """
        if not urls:
            raise ValueError("resource() needs at least one URL")
        conditional = {}
        if etag:
            conditional["If-None-Match"] = etag
        if last_modified:
            conditional["If-Modified-Since"] = last_modified
        failures: list[FetchError] = []
        for url in urls:
            for fixity_try in range(2):
                try:
                    once = partial(self._resource_once, url, expected, store, conditional or None)
                    return await self._with_retries(url, once)
                except FetchError as exc:
                    failures.append(exc)
                    if exc.kind == "fixity" and fixity_try == 0:
                        log.info("fixity mismatch at %s, trying once more: %s", url, exc)
                        continue
                    log.info("giving up on %s: %s", url, exc)
                    break
        fixity = [f for f in failures if f.kind == "fixity"]
        last = fixity[-1] if fixity else failures[-1]
        reasons = list(dict.fromkeys(str(f) for f in failures))  # a second try may fail the same way
        if len(urls) == 1 and len(reasons) == 1:
            raise last
        summary = "; ".join(reasons)
        raise FetchError(
            last.url, last.kind, f"no location served a good copy: {summary}", status=last.status
        ) from last

    async def download(
        self, url: str, dest: BinaryIO, *, max_bytes: int, expected: Expected | None = None
    ) -> BlobInfo:
        """Stream a body as served into ``dest`` (a dump package), verifying ``expected`` if given.

        ``dest`` is truncated and rewritten on a retry, so it must be seekable.
        """
        algos = frozenset(expected.hashes) if expected else frozenset()
        start = dest.tell()

        async def attempt() -> BlobInfo:
            dest.seek(start)
            dest.truncate()
            hasher = Hasher(algos)

            def sink(chunk: bytes) -> None:
                hasher.update(chunk)
                dest.write(chunk)

            body = await self._raw(url, max_bytes, expected, sink)
            info = BlobInfo(hasher.sha256, hasher.length, hasher.hexdigests())
            problems = expected.problems(info) if expected else []
            if problems:
                raise FetchError(body.final_url, "fixity", "; ".join(problems))
            return info

        return await self._with_retries(url, attempt)


__all__ = [
    "DocumentStream",
    "Expected",
    "FetchError",
    "FetchedBytes",
    "FetchedResource",
    "Fetcher",
    "ResourceNotModified",
    "SlotKeeper",
]
