"""Lean keep-alive HTTP/1.1 GETs: h11 over trio streams, a small pool of connections per origin.

Why: a harvest is mostly resource GETs, one small body each, and at 0 ms latency the layers of
httpx + httpcore (request and URL models, the pool that polls every idle connection on every request,
traces, nested context managers) cost several times what the bytes do. This client keeps what a
resource GET needs and nothing else: HTTP parsing stays in h11 (the library httpcore uses too), the
connection is a ``trio.SocketStream`` (or ``trio.SSLStream`` for https, with the caller's
``ssl.SSLContext``: the same verification as the httpx pools, which are given the same context).

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
import ssl
from collections.abc import Iterable
from typing import Any

import h11
import httpcore
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


class Request:
    """One GET hop: ``url`` and ``headers`` (an ``httpx.Headers``, which the request hook may change:
    credentials, User-Agent) -- the part of ``httpx.Request`` the hop's hooks use."""

    __slots__ = ("headers", "url")
    method = "GET"

    def __init__(self, url: URL, headers: httpx.Headers) -> None:
        self.url = url
        self.headers = headers


class _Connection:
    """One keep-alive connection: a trio stream and the h11 state of the exchange on it."""

    __slots__ = ("eager", "fd", "h11", "idle_since", "key", "plain", "pool", "sock", "stream")

    def __init__(self, pool: LeanPool, key: tuple, stream: trio.abc.Stream, sock: Any) -> None:
        self.pool = pool
        self.key = key
        self.stream = stream
        self.sock = sock  # the socket under the stream (for the idle check and a synchronous close)
        # No TLS: the socket's descriptor is read and written directly (``_read``, ``_write``).
        self.plain = type(stream) is trio.SocketStream and _FD_IO
        self.fd = sock.fileno() if sock is not None else -1
        self.eager = 0  # reads in a row that did not wait (``_read``)
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.idle_since = 0.0

    def usable(self, now: float) -> bool:
        """An idle connection may carry another request: not expired, and nothing to read on it (the
        server closed it, or sent bytes nobody asked for). One non-blocking peek, on this socket only."""
        if now - self.idle_since > KEEPALIVE_EXPIRY:
            return False
        if not self.plain:
            return True  # TLS: the raw socket may hold a session ticket; a stale one is retried (send)
        # Readable while idle: closed by the server (EOF), or bytes nobody asked for. One poll() of
        # this socket only (httpcore polls every connection of its pool on every request).
        return not self.sock.is_readable()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()  # trio's socket: wakes anyone waiting on it; no await needed
            self.sock = None
            self.pool._closed(self)

    async def receive(self, timeout: float) -> bytes:
        """The next bytes of the answer (b"" at its end), waiting at most ``timeout`` for each."""
        try:
            if self.plain:
                return await self._read(timeout)
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

    async def _read(self, timeout: float) -> bytes:
        """Plain TCP: bytes from the socket, read at once when they are there, else once it is readable
        (within ``timeout``).

        Why not ``sock.recv`` (or ``SocketStream.receive_some``): trio's wrappers pass through the
        scheduler even when the bytes are already there, inside generator-based context managers, and
        a deadline scope was entered around every read. Here only a wait has a deadline, and a read
        that need not wait does not yield -- but never more than ``EAGER_READS`` in a row (a large
        body arriving as fast as it is read must not hold the event loop): then one checkpoint."""
        while True:
            if self.sock is None:  # closed by this task or another (close() is synchronous)
                raise trio.ClosedResourceError("the connection was closed")
            try:
                data = os.read(self.fd, READ_BYTES)
            except BlockingIOError:
                self.eager = 0
                with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
                    await trio.lowlevel.wait_readable(self.sock)  # a checkpoint: cancellation lands here
                if scope.cancelled_caught:
                    raise httpx.ReadTimeout(f"no data within {timeout}s") from None
                continue
            self.eager += 1
            if self.eager > EAGER_READS:
                self.eager = 0
                await trio.lowlevel.checkpoint()
            return data

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


_END = h11.EndOfMessage()  # immutable: one for every request


class _Head:
    """A request head: ``wire`` (the bytes sent) and ``event`` (the same fields as an h11 event)."""

    __slots__ = ("event", "wire")

    def __init__(self, wire: bytes, event: h11.Request) -> None:
        self.wire = wire
        self.event = event


class _Stale(Exception):
    """A reused connection closed before any byte of the answer: the GET is sent again on a new one."""


class Response:
    """An answer whose body is read as it arrives (``aiter_raw``: the bytes as served, never decoded).

    The attributes ``harvest/fetch.py`` reads mean what they mean on ``httpx.Response``. The
    connection goes back to its pool once the body has been read to its end; ``aclose`` before that
    closes it (an unread body is not drained)."""

    def __init__(self, url: URL, event: h11.Response, conn: _Connection, timeout: float) -> None:
        self.url = url
        self.status_code: int = event.status_code
        self.reason_phrase = event.reason.decode("ascii", errors="ignore")  # as httpx decodes it
        self.headers = Headers(event.headers.raw_items())
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
        state = conn.h11
        try:
            while True:
                try:
                    event = state.next_event()
                except h11.RemoteProtocolError as exc:  # e.g. the body ended before its Content-Length
                    raise httpx.RemoteProtocolError(str(exc)) from exc
                if event is h11.NEED_DATA:
                    state.receive_data(await conn.receive(self._timeout))
                    continue
                kind = type(event)
                if kind is h11.Data:
                    return bytes(event.data)  # type: ignore[union-attr,return-value]
                if kind is h11.EndOfMessage:
                    self._conn = None
                    self.pool_back(conn)
                    raise StopAsyncIteration
                raise httpx.RemoteProtocolError(f"unexpected {kind.__name__} in a response body")
        except StopAsyncIteration:
            raise
        except BaseException:
            # Broken, timed out or cancelled mid-body: the connection is in no state to carry more.
            self._conn = None
            conn.close()
            raise

    @staticmethod
    def pool_back(conn: _Connection) -> None:
        state = conn.h11
        if state.our_state is h11.DONE and state.their_state is h11.DONE:
            state.start_next_cycle()
            conn.pool._release(conn)
        else:  # Connection: close, HTTP/1.0, or a close-delimited body
            conn.close()

    async def aclose(self) -> None:
        """Done with the answer. A body not read to its end closes the connection, unless what is left
        of it is already received (a redirect's, a 304's or an error page's few bytes): then the
        connection is kept. Never waits for more bytes."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        state = conn.h11
        try:
            while True:
                event = state.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    break
                if type(event) is h11.EndOfMessage:
                    self.pool_back(conn)
                    return
        except h11.RemoteProtocolError:
            pass
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
        #: (authority, header fields) -> (the validated h11 event, the fields as sent): ``_head``.
        self._fields: dict[tuple, tuple[h11.Request, bytes]] = {}
        self._slots = trio.Semaphore(max_connections)
        self._open: set[_Connection] = set()
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

    def _head(self, request: Request) -> _Head:
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
            fields = (event, wire[wire.index(b"\r\n") + 2 :])  # the fields and the blank line after
            if len(self._fields) >= 256:  # conditional GETs carry per-resource validators: bounded
                self._fields.clear()
            self._fields[key] = fields
        return _Head(b"GET " + url.target.encode("ascii") + b" HTTP/1.1\r\n" + fields[1], fields[0])

    async def _exchange(self, conn: _Connection, url: URL, head: _Head, *, reused: bool) -> Response:
        state = conn.h11
        timeout = self.timeout
        try:
            try:
                # h11 follows the exchange (its states, the method the answer's framing depends on)
                # from the cached event; the bytes sent are ``head.wire``: the same fields, this target.
                state.send(head.event)
                state.send(_END)
            except h11.LocalProtocolError as exc:
                raise httpx.LocalProtocolError(str(exc)) from exc
            try:
                await conn.send(head.wire, timeout)
            except httpx.WriteError:
                if reused:
                    raise _Stale() from None
                raise
            received = False
            while True:
                try:
                    event = state.next_event()
                except h11.RemoteProtocolError as exc:
                    raise httpx.RemoteProtocolError(str(exc)) from exc
                if event is h11.NEED_DATA:
                    try:
                        chunk = await conn.receive(timeout)
                    except httpx.ReadError:
                        if reused and not received:
                            raise _Stale() from None
                        raise
                    if not chunk and reused and not received:
                        raise _Stale()
                    received = True
                    state.receive_data(chunk)
                    continue
                kind = type(event)
                if kind is h11.Response:
                    return Response(url, event, conn, timeout)  # type: ignore[arg-type]
                if kind is h11.InformationalResponse:
                    continue  # 1xx (RFC 9110 §15.2): the answer follows
                raise httpx.RemoteProtocolError(f"unexpected {kind.__name__} before the response")
        except BaseException:
            conn.close()
            raise

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


__all__ = ["URL", "Headers", "LeanPool", "Request", "Response", "parse_url"]
