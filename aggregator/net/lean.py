"""Lean keep-alive HTTP/1.1 GETs over trio streams, a small pool of connections per origin.

Why: a harvest is mostly resource GETs, one small body each, and at 0 ms latency the layers of
httpx + httpcore (request and URL models, the pool that polls every idle connection on every request,
traces, nested context managers) cost several times what the bytes do. This client keeps what a
resource GET needs and nothing else. HTTP parsing stays in well-kept libraries: answers are parsed by
llhttp through httptools (``ResponseParser``: h11's framing rules kept around it), request heads are
validated by h11 (the library httpcore uses) once per origin and set of fields. The connection is a
``trio.SocketStream`` (or ``trio.SSLStream`` for https, with the caller's ``ssl.SSLContext``: the
same verification as the httpx pools, which are given the same context).

Safety is the same as the httpx path's, by the same code: every request passes
``AddressPolicy.check_request`` (rsagg's own URLs), every new connection resolves and checks the
address it connects to with ``outbound.checked_addresses`` (what ``PolicedBackend`` uses), and a
connection opened under a pin is pooled apart (the pool key holds the pinned networks), so it never
serves another requester. Failures are raised as the httpx exceptions the httpx path raises for them
(``httpx.ConnectError``, ``ReadTimeout``, ``RemoteProtocolError``...), so one mapping
(``harvest/fetch.py``'s ``_transport_error``) and one retry policy (``net/retry.py``) judge both.

What it does not do (the caller keeps httpx for it, per request): URLs that are not already in the
form httpx would send them (``parse_url`` answers None: userinfo, fragments, IPv6 literals,
international names, characters httpx would percent-encode, dot segments, an explicit default port),
proxies, HTTP/2, content decoding (bodies are handed over as served), anything but GET.
"""

from __future__ import annotations

import os
import re
import select
import ssl
from collections.abc import Iterable
from typing import Any

import h11
import httpcore
import httptools
import httpx
import trio

from . import outbound

#: Bytes asked of the socket per read (httpcore's figure).
READ_BYTES = 64 * 1024
#: The largest status line + header block accepted (httpcore's figure for h11).
MAX_HEAD_BYTES = 100 * 1024
#: Reads in a row that found their bytes already there before one pass through the scheduler.
EAGER_READS = 4
#: Plain sockets are read and written through their descriptor (``os.read``/``os.write``), POSIX only.
_FD_IO = os.name == "posix"
#: A read that waits longer than the pool's timeout fails within this share of the timeout after it: the
#: watchdog's period (``LeanPool._watchdog``).
LATE_SHARE = 0.125
#: An idle connection older than this is closed rather than reused (httpx's default keep-alive expiry).
KEEPALIVE_EXPIRY = 5.0
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORT = {"http": 80, "https": 443}

_PCHAR = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})"
#: The URLs this client sends as they are written: the subset that httpx leaves unchanged, so that the
#: URL requested, the Host header and the final URL reported are the same on both paths
#: (tests/test_lean.py compares ``parse_url`` with ``httpx.URL`` on generated URLs).
_URL = re.compile(
    r"(https?)://([a-z0-9](?:[a-z0-9\-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9\-]*[a-z0-9])?)*)"
    r"(?::([1-9][0-9]{0,4}))?"
    rf"((?:/{_PCHAR}*)+)"
    rf"(\?(?:{_PCHAR}|[/?])+)?"
)


class URL:
    """An http(s) URL in the form it is sent: what the request hook and the metrics see of it.

    The attributes the request hook reads (``scheme``, ``host``, ``port`` -- None for the scheme's
    default, like ``httpx.URL.port`` -- and ``str()``) mean what they mean on ``httpx.URL``."""

    __slots__ = ("_text", "authority", "host", "port", "scheme", "target")

    def __init__(self, text: str, scheme: str, host: str, port: int | None, target: str) -> None:
        self._text = text
        self.scheme = scheme
        self.host = host
        self.port = port
        self.target = target  # path and query: the request target (RFC 9112 §3.2.1, origin-form)
        self.authority = host if port is None else f"{host}:{port}"

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"URL({self._text!r})"

    @property
    def effective_port(self) -> int:
        return self.port if self.port is not None else _DEFAULT_PORT[self.scheme]


def parse_url(text: str) -> URL | None:
    """``text`` as a lean ``URL``, or None when it is not in the form httpx would send it unchanged
    (then the caller uses httpx for the request)."""
    m = _URL.fullmatch(text)
    if m is None:
        return None
    scheme, host, port_text, path, query = m.groups()
    if "/." in path and any(seg in (".", "..") for seg in path.split("/")):
        return None  # dot segments: httpx removes them (RFC 3986 §5.2.4)
    port = None
    if port_text is not None:
        port = int(port_text)
        if port > 65535 or port == _DEFAULT_PORT[scheme]:
            return None  # httpx drops an explicit default port from the URL
    return URL(text, scheme, host, port, path + (query or ""))


class Headers(dict[str, str]):
    """Response headers by lower-case name, repeated fields joined with ", " (RFC 9110 §5.3), as
    ``httpx.Headers.get`` answers them; ``get`` and ``[]`` take any case. Built once per response from
    h11's validated fields in one pass, at a fraction of ``httpx.Headers``' cost."""

    def __init__(self, fields: Iterable[tuple[bytes, bytes]]) -> None:
        """``fields``: (name, value) as received (h11's ``raw_items()``: validated, names as sent)."""
        fields = list(fields)
        super().__init__((n.decode("latin-1").lower(), v.decode("latin-1")) for n, v in fields)
        if len(self) == len(fields):
            return  # no field repeated: the common answer, built in one pass
        self.clear()
        for raw_name, raw_value in fields:
            name = raw_name.decode("latin-1").lower()
            value = raw_value.decode("latin-1")
            if name in self:
                value = f"{dict.__getitem__(self, name)}, {value}"
            dict.__setitem__(self, name, value)

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())


class HeadRefused(httpx.RemoteProtocolError):
    """llhttp refused an answer's head. It is stricter than h11, the httpx path's parser (an obs-fold,
    a DEL in a value, a version other than 1.x): the caller asks again over httpx, which reads what
    h11 reads (RFC 9112 §5.2: a user agent reads an obs-fold as a space) and refuses the rest."""


class Request:
    """One GET hop: ``url`` and ``headers`` (an ``httpx.Headers``, which the request hook may change:
    credentials, User-Agent) -- the part of ``httpx.Request`` the hop's hooks use."""

    __slots__ = ("headers", "url")
    method = "GET"

    def __init__(self, url: URL, headers: httpx.Headers) -> None:
        self.url = url
        self.headers = headers


class _Connection:
    """One keep-alive connection: a trio stream and the parser of the answers on it."""

    __slots__ = ("deadline", "eager", "fd", "idle_poll", "idle_since", "key", "parser", "plain", "pool",
                 "sock", "stream", "timed_out")  # fmt: skip

    def __init__(self, pool: LeanPool, key: tuple, stream: trio.abc.Stream, sock: Any) -> None:
        self.pool = pool
        self.key = key
        self.stream = stream
        self.sock = sock  # the socket under the stream (for the idle check and a synchronous close)
        # No TLS: the socket's descriptor is read and written directly (``_read``, ``_write``).
        self.plain = type(stream) is trio.SocketStream and _FD_IO
        self.fd = sock.fileno() if sock is not None else -1
        self.eager = 0  # reads in a row that did not wait (``_read``)
        # ``usable``'s poll of this socket alone, made once (trio's ``is_readable`` makes one per call)
        self.idle_poll: Any = None
        if self.plain and self.fd >= 0:
            self.idle_poll = select.poll()
            self.idle_poll.register(self.fd, select.POLLIN)
        self.parser = ResponseParser()
        self.idle_since = 0.0
        self.deadline = 0.0  # of the read waiting now (``LeanPool._wait_readable``)
        self.timed_out = False  # closed by the watchdog: a read waited past its deadline

    def usable(self, now: float) -> bool:
        """An idle connection may carry another request: not expired, and nothing to read on it (the
        server closed it, or sent bytes nobody asked for). One non-blocking peek, on this socket only."""
        if now - self.idle_since > KEEPALIVE_EXPIRY:
            return False
        if self.idle_poll is None:
            return True  # TLS: the raw socket may hold a session ticket; a stale one is retried (send)
        # Readable while idle: closed by the server (EOF), or bytes nobody asked for. One poll() of
        # this socket only (httpcore polls every connection of its pool on every request).
        return not self.idle_poll.poll(0)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()  # trio's socket: wakes anyone waiting on it; no await needed
            self.sock = None
            self.pool._closed(self)

    async def receive(self, timeout: float, *, wait: bool = False) -> bytes:
        """The next bytes of the answer (b"" at its end), waiting at most ``timeout`` for each.
        ``wait``: the bytes are not there yet (the request was just sent): wait before reading."""
        try:
            if self.plain:
                return await self._read(timeout, wait)
            # A bare CancelScope rather than trio.fail_after: the same deadline without a
            # generator-based context manager around every read.
            with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
                return await self.stream.receive_some(READ_BYTES)  # type: ignore[return-value]
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__) from exc
        assert scope.cancelled_caught
        raise httpx.ReadTimeout(f"no data within {timeout}s")

    async def send(self, data: bytes, timeout: float) -> None:
        try:
            if self.plain:
                await self._write(data, timeout)
                return
            with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
                await self.stream.send_all(data)
                return
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise httpx.WriteError(str(exc) or type(exc).__name__) from exc
        assert scope.cancelled_caught
        raise httpx.WriteTimeout(f"could not send within {timeout}s")

    async def _read(self, timeout: float, wait: bool = False) -> bytes:
        """Plain TCP: bytes from the socket, read at once when they are there, else once it is readable
        (within ``timeout``).

        Why not ``sock.recv`` (or ``SocketStream.receive_some``): trio's wrappers pass through the
        scheduler even when the bytes are already there, inside generator-based context managers, and
        a deadline scope was entered around every read. Here only a wait has a deadline (the pool's
        watchdog's, ``LeanPool._wait_readable``), and a read that need not wait does not yield -- but
        never more than ``EAGER_READS`` in a row (a large body arriving as fast as it is read must not
        hold the event loop): then one checkpoint.

        ``wait``: the first read of an answer to a request just sent would all but always find nothing
        (the server has yet to run): wait for the socket first rather than fail a read."""
        while True:
            if self.sock is None:  # closed by this task or another (close() is synchronous)
                if self.timed_out:  # by the watchdog, as the bytes came: too late all the same
                    raise httpx.ReadTimeout(f"no data within {timeout}s")
                raise trio.ClosedResourceError("the connection was closed")
            if not wait:
                try:
                    data = os.read(self.fd, READ_BYTES)
                except BlockingIOError:
                    pass
                else:
                    self.eager += 1
                    if self.eager > EAGER_READS:
                        self.eager = 0
                        await trio.lowlevel.checkpoint()
                    return data
            wait = False
            self.eager = 0
            await self.pool._wait_readable(self, timeout)  # a checkpoint: cancellation lands here

    async def _write(self, data: bytes, timeout: float) -> None:
        """Plain TCP: all of ``data``, waiting (within ``timeout`` each time) only when the socket's
        buffer is full (``_read``'s reasons)."""
        view = memoryview(data)
        while view:
            if self.sock is None:
                raise trio.ClosedResourceError("the connection was closed")
            try:
                view = view[os.write(self.fd, view) :]
            except BlockingIOError:
                with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
                    await trio.lowlevel.wait_writable(self.sock)
                if scope.cancelled_caught:
                    raise httpx.WriteTimeout(f"could not send within {timeout}s") from None


class _AfterEnd(Exception):
    """Bytes after the answer that nobody asked for: raised inside the parser to stop it there."""


class ResponseParser:
    """The answers on one connection, parsed by httptools (llhttp, in C): what a GET needs of them.

    Why not h11: it parses in Python, and was about a fifth of a harvest's event-loop CPU at 0 ms;
    llhttp is the parser Node.js ships, bound by httptools (MagicStack, the parser under uvicorn).
    What h11 did besides parsing is done here, per answer: the head is bounded (``MAX_HEAD_BYTES``),
    1xx answers are skipped (RFC 9110 §15.2), a Transfer-Encoding other than ``chunked`` alone is
    refused (as h11 refuses it), a close-delimited body ends at EOF and any other body ending there
    is an error (RFC 9112 §6.3, §8), HTTP/1.0 connections are not reused, trailer fields are not
    headers, and bytes after the answer make the connection unfit for reuse. Every failure is an
    ``httpx.RemoteProtocolError`` with one line saying what was wrong, never a parser exception.

    Use: ``start()`` before each request, ``feed(bytes)`` as they arrive, ``eof()`` when the socket
    says end; read ``head_done``, ``status``, ``reason``, ``headers``, ``take_body()``, ``complete``
    and ``reusable``."""

    __slots__ = ("_fields", "_head_bytes", "_parser", "body", "complete", "head_done", "headers",
                 "keep_alive", "reason", "status")  # fmt: skip

    _fields: Headers

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        # Read as h11 (the httpx path) reads them: a line ended by LF alone (RFC 9112 §2.2: a recipient
        # MAY take it as a line's end), and a chunked answer that also has a Content-Length (§6.3 item
        # 3: Transfer-Encoding wins). Neither is a smuggling risk for a client reading its own answers.
        self._parser.set_dangerous_leniencies(lenient_optional_cr_before_lf=True, lenient_chunked_length=True)
        self._fields = Headers(())
        self.reason = b""
        self.status = 0
        self.headers: Headers | None = None
        self.body: list[bytes] = []
        self.head_done = self.complete = self.keep_alive = False
        self._head_bytes = 0

    def start(self) -> None:
        """A new request was sent: its answer is the next message."""
        self.reason = b""
        self.status = 0
        self.headers = None
        self.body = []
        self.head_done = self.complete = self.keep_alive = False
        self._head_bytes = 0

    @property
    def reusable(self) -> bool:
        """The answer ended where its framing said, and the server keeps the connection open."""
        return self.complete and self.keep_alive

    def feed(self, data: bytes) -> None:
        """Parse ``data``, the next bytes received (never empty: the end is ``eof``)."""
        if not self.head_done:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if not self.complete:
                raise httpx.RemoteProtocolError("the server switched protocols unasked (101)") from None
            self.keep_alive = False
        except httptools.HttpParserError as exc:
            if self.complete:  # bytes after the answer (or after its Connection: close): never reused
                self.keep_alive = False
                return
            cause = exc.__context__
            if isinstance(cause, httpx.RemoteProtocolError):
                raise cause from None
            detail = str(exc) or type(exc).__name__
            refused = httpx.RemoteProtocolError if self.head_done else HeadRefused
            raise refused(f"malformed response: {detail}") from None
        if not self.head_done and self._head_bytes > MAX_HEAD_BYTES:
            raise httpx.RemoteProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")

    def eof(self) -> None:
        """The server closed the connection: the end of a close-delimited body, else an error."""
        if self.complete:
            return
        if not self.head_done:
            if self._head_bytes:
                raise httpx.RemoteProtocolError("server disconnected in the middle of the response head")
            raise httpx.RemoteProtocolError("server disconnected without sending a response")
        headers = self.headers
        assert headers is not None
        if (
            "content-length" not in headers
            and "transfer-encoding" not in headers
            and self.status not in (204, 304)
        ):  # close-delimited (RFC 9112 §6.3 item 8): EOF is its end
            self.complete, self.keep_alive = True, False
            return
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    def take_body(self) -> bytes:
        """The body bytes parsed so far and not yet taken (b"" when none)."""
        body = self.body
        if not body:
            return b""
        self.body = []
        return body[0] if len(body) == 1 else b"".join(body)

    # -- llhttp's callbacks (httptools calls those that exist) ----------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            raise _AfterEnd()
        self._fields = Headers(())  # after a 1xx: the final answer's own
        self.reason = b""

    def on_status(self, data: bytes) -> None:
        self.reason += data  # in parts when it is split across reads

    def on_header(self, name: bytes, value: bytes) -> None:
        """One field into the answer's ``Headers`` as ``Headers(fields)`` would put it (repeated fields
        joined), without a list of fields first. A chunked body's trailer fields are not headers
        (RFC 9112 §7.1.2; neither h11 nor httpx merges them): left out."""
        if self.head_done:
            return
        key = name.decode("latin-1").lower()
        # llhttp drops the whitespace before a value, not the whitespace after it (RFC 9112 §5.1: OWS on
        # both sides is not part of the value; h11 drops both).
        text = value.rstrip(b" \t").decode("latin-1")
        fields = self._fields
        if dict.__contains__(fields, key):
            text = f"{dict.__getitem__(fields, key)}, {text}"
        dict.__setitem__(fields, key, text)

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            if status == 101:
                raise httpx.RemoteProtocolError("the server switched protocols unasked (101)")
            return  # 1xx (RFC 9110 §15.2): the answer follows
        headers = self._fields
        coding = dict.get(headers, "transfer-encoding")
        if coding is not None and [c.strip().lower() for c in coding.split(",")] != ["chunked"]:
            raise httpx.RemoteProtocolError(f"unsupported Transfer-Encoding {coding!r} (only chunked)")
        self.status = status
        self.headers = headers
        # HTTP/1.0's keep-alive is not reused (as h11 and httpx do not): HTTP/1.1 without close only
        parser = self._parser
        self.keep_alive = parser.should_keep_alive() and parser.get_http_version() == "1.1"
        self.head_done = True

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True


class _Stale(Exception):
    """A reused connection closed before any byte of the answer: the GET is sent again on a new one."""


class Response:
    """An answer whose body is read as it arrives (``aiter_raw``: the bytes as served, never decoded).

    The attributes ``harvest/fetch.py`` reads mean what they mean on ``httpx.Response``. The
    connection goes back to its pool once the body has been read to its end; ``aclose`` before that
    closes it (an unread body is not drained)."""

    def __init__(self, url: URL, parser: ResponseParser, conn: _Connection, timeout: float) -> None:
        """``parser``: the connection's, its head parsed (``head_done``)."""
        assert parser.headers is not None
        self.url = url
        self.status_code: int = parser.status
        self.reason_phrase = parser.reason.decode("ascii", errors="ignore")  # as httpx decodes it
        self.headers: Headers = parser.headers
        self._conn: _Connection | None = conn
        self._timeout = timeout

    @property
    def has_redirect_location(self) -> bool:
        return self.status_code in REDIRECT_STATUSES and "location" in self.headers

    def aiter_raw(self) -> Response:
        return self

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        if conn is None:
            raise StopAsyncIteration
        parser = conn.parser
        try:
            while True:
                if parser.body:
                    return parser.take_body()
                if parser.complete:
                    self._conn = None
                    self.pool_back(conn)
                    raise StopAsyncIteration
                data = await conn.receive(self._timeout)
                if data:
                    parser.feed(data)
                else:
                    parser.eof()
        except StopAsyncIteration:
            raise
        except BaseException:
            # Broken, timed out or cancelled mid-body: the connection is in no state to carry more.
            self._conn = None
            conn.close()
            raise

    @staticmethod
    def pool_back(conn: _Connection) -> None:
        if conn.parser.reusable:
            conn.pool._release(conn)
        else:  # Connection: close, HTTP/1.0, a close-delimited body, bytes after the answer
            conn.close()

    async def aclose(self) -> None:
        """Done with the answer. A body not read to its end closes the connection, unless what is left
        of it is already received (a redirect's, a 304's or an error page's few bytes): then the
        connection is kept. Never waits for more bytes."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.parser.complete:
            self.pool_back(conn)
        else:
            conn.close()


class LeanPool:
    """Keep-alive connections by origin (scheme, host, port, pinned networks), reused last-in first-out.

    No limit on concurrent requests per host of its own: the caller's per-host limiter (the Fetcher's)
    bounds them, and a request holds one connection. ``max_connections`` bounds the connections open
    at once (idle ones are closed first to make room)."""

    def __init__(
        self,
        policy: outbound.AddressPolicy | None,
        *,
        timeout: float,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = 64,
    ) -> None:
        self.policy = policy
        self.timeout = timeout
        self._ssl_context = ssl_context
        self._idle: dict[tuple, list[_Connection]] = {}
        #: (authority, header fields) -> the fields as sent, validated by h11 once: ``_head``.
        self._fields: dict[tuple, bytes] = {}
        self._slots = trio.Semaphore(max_connections)
        self._open: set[_Connection] = set()
        #: Connections whose read waits now, each with its deadline (``_wait_readable``).
        self._waiting: set[_Connection] = set()
        #: The trio run the watchdog runs in (a pool may outlive one run: a new one starts its own).
        self._watched: trio.lowlevel.TrioToken | None = None
        self._ended = False  # aclose(): the watchdog ends
        #: Connections opened so far (tests and benchmarks read it: reuse is visible).
        self.connections_opened = 0

    async def send(self, request: Request) -> Response:
        """Send the GET and read the answer's head; the body follows through the Response."""
        url = request.url
        port = url.effective_port
        extra: tuple = ()
        policy = self.policy
        if policy is not None:
            if policy.own_origin(url.host, port):  # else no URL of this origin is rsagg's own
                policy.check_request(str(url))  # raises OutboundRefused (an httpx.ConnectError)
            if policy.pins:
                extra = policy.pinned(url.host, port)
        key = (url.scheme, url.host, port, extra)
        head = self._head(request)
        conn = self._take(key)
        if conn is not None:
            try:
                return await self._exchange(conn, url, head, reused=True)
            except _Stale:
                pass  # the server closed the idle connection meanwhile: one new connection, below
        conn = await self._connect(url, port, extra, key)
        try:
            return await self._exchange(conn, url, head, reused=False)
        except _Stale as exc:  # not on a new connection
            raise httpx.RemoteProtocolError("server disconnected without sending a response") from exc

    def _head(self, request: Request) -> bytes:
        """The request head: its header fields validated by h11 once per origin and set of fields (a
        header value with a line break never reaches the wire), the request line written per request.

        Why: building and validating an ``h11.Request`` was a tenth of a GET's CPU, for fields that
        are the same on every request of a harvest. The target needs no validation of its own: it is
        the path and query that ``parse_url`` accepted (only RFC 3986 pchar, "/" and "?")."""
        url = request.url
        raw = request.headers.raw
        key = (url.authority, *raw)
        fields = self._fields.get(key)
        if fields is None:
            headers: list[tuple[bytes, bytes]] = [(b"Host", url.authority.encode("ascii"))]
            headers += [(k, v) for k, v in raw if k.lower() != b"host"]
            try:
                event = h11.Request(method=b"GET", target=b"/", headers=headers)
            except h11.LocalProtocolError as exc:
                raise httpx.LocalProtocolError(str(exc)) from exc
            wire = h11.Connection(h11.CLIENT).send(event)
            assert wire is not None
            fields = wire[wire.index(b"\r\n") + 2 :]  # the fields and the blank line after
            if len(self._fields) >= 256:  # conditional GETs carry per-resource validators: bounded
                self._fields.clear()
            self._fields[key] = fields
        return b"GET " + url.target.encode("ascii") + b" HTTP/1.1\r\n" + fields

    async def _exchange(self, conn: _Connection, url: URL, head: bytes, *, reused: bool) -> Response:
        parser = conn.parser
        parser.start()
        timeout = self.timeout
        try:
            try:
                await conn.send(head, timeout)
            except httpx.WriteError:
                if reused:
                    raise _Stale() from None
                raise
            received = False
            while not parser.head_done:
                try:
                    chunk = await conn.receive(timeout, wait=not received)
                except httpx.ReadError:
                    if reused and not received:
                        raise _Stale() from None
                    raise
                if not chunk:
                    if reused and not received:
                        raise _Stale()
                    parser.eof()  # raises: no head
                received = True
                parser.feed(chunk)
            return Response(url, parser, conn, timeout)
        except BaseException:
            conn.close()
            raise

    async def _wait_readable(self, conn: _Connection, timeout: float) -> None:
        """Wait until ``conn`` has bytes, or fail with ``httpx.ReadTimeout`` once ``timeout`` has passed.

        Why not a deadline scope around the wait: a resource GET waits once for its answer, and entering
        and leaving a trio ``CancelScope`` with a deadline (its registration in the run's deadlines)
        was about 3 % of a harvest's instructions at 0 ms (benchmarks/bench_harvest.py). Here the wait
        is written down with its deadline, and one watchdog task per pool and run closes a connection
        whose wait is past its deadline (``_watchdog``), which wakes it: the same failure, at most
        ``LATE_SHARE`` of the timeout later."""
        conn.deadline = trio.current_time() + timeout
        conn.timed_out = False
        if self._watched is not (token := trio.lowlevel.current_trio_token()):
            self._watched = token
            trio.lowlevel.spawn_system_task(self._watchdog, name="rsagg lean read timeouts")
        waiting = self._waiting
        waiting.add(conn)
        try:
            await trio.lowlevel.wait_readable(conn.sock)
        except trio.ClosedResourceError:
            if conn.timed_out:
                raise httpx.ReadTimeout(f"no data within {timeout}s") from None
            raise
        finally:
            waiting.discard(conn)

    async def _watchdog(self) -> None:
        """Close each connection whose read waits past its deadline (``_wait_readable``), every
        ``LATE_SHARE`` of the timeout, until the pool is closed (or the run ends: a system task)."""
        period = max(self.timeout * LATE_SHARE, 0.001)
        while not self._ended:
            await trio.sleep(period)
            now = trio.current_time()
            for conn in [c for c in self._waiting if c.deadline <= now]:
                conn.timed_out = True
                conn.close()  # its waiter wakes with ClosedResourceError: ReadTimeout there

    def _take(self, key: tuple) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = trio.current_time()
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                return conn
            conn.close()
        return None

    def _release(self, conn: _Connection) -> None:
        if conn.sock is None:
            return
        conn.idle_since = trio.current_time()
        self._idle.setdefault(conn.key, []).append(conn)

    def _closed(self, conn: _Connection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            self._slots.release()
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def _evict_idle(self) -> bool:
        """Close the longest-idle connection of any origin; False when none is idle."""
        oldest: _Connection | None = None
        for idle in self._idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest.idle_since):
                oldest = idle[0]
        if oldest is None:
            return False
        oldest.close()
        return True

    async def _connect(self, url: URL, port: int, extra: tuple, key: tuple) -> _Connection:
        """A new connection to an address the policy allows (resolved and checked here, for this
        connection: ``outbound.checked_addresses``), TLS for https."""
        while True:
            try:
                self._slots.acquire_nowait()
                break
            except trio.WouldBlock:
                if not self._evict_idle():
                    await self._slots.acquire()
                    break
        try:
            stream, sock = await self._open_stream(url, port, extra)
        except BaseException:
            self._slots.release()
            raise
        conn = _Connection(self, key, stream, sock)
        self._open.add(conn)
        self.connections_opened += 1
        return conn

    async def _open_stream(self, url: URL, port: int, extra: tuple) -> tuple[trio.abc.Stream, Any]:
        timeout = self.timeout
        try:
            if self.policy is not None:
                addresses = await outbound.checked_addresses(self.policy, url.host, port, extra, timeout)
            else:
                addresses = [url.host]
        except httpcore.ConnectTimeout as exc:
            raise httpx.ConnectTimeout(str(exc)) from exc
        except httpcore.ConnectError as exc:
            if isinstance(exc, httpx.ConnectError):
                raise
            raise httpx.ConnectError(str(exc)) from exc
        tcp = await _connect_any(addresses, port, timeout)
        if url.scheme != "https":
            return tcp, tcp.socket
        assert self._ssl_context is not None, "https needs an ssl_context"
        tls = trio.SSLStream(tcp, self._ssl_context, server_hostname=url.host, https_compatible=True)
        try:
            with trio.fail_after(timeout):
                await tls.do_handshake()
        except trio.TooSlowError:
            tcp.socket.close()
            raise httpx.ConnectTimeout(f"TLS handshake with {url.host} timed out") from None
        except (trio.BrokenResourceError, ssl.SSLError, OSError) as exc:
            tcp.socket.close()
            cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) and exc.__cause__ else exc
            raise httpx.ConnectError(str(cause) or type(cause).__name__) from exc
        return tls, tcp.socket

    async def aclose(self) -> None:
        self._ended = True
        for conn in list(self._open):
            conn.close()
        self._idle.clear()


async def _connect_any(addresses: Iterable[str], port: int, timeout: float) -> trio.SocketStream:
    """A TCP connection to the first of ``addresses`` (each already checked) that answers."""
    error: Exception | None = None
    for address in addresses:
        try:
            with trio.fail_after(timeout):
                return await trio.open_tcp_stream(address, port)
        except trio.TooSlowError:
            error = httpx.ConnectTimeout(f"connecting to {address}:{port} timed out")
        except OSError as exc:
            error = httpx.ConnectError(str(exc) or type(exc).__name__)
    assert error is not None
    raise error


__all__ = ["URL", "HeadRefused", "Headers", "LeanPool", "Request", "Response", "parse_url"]
