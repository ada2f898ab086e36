"""Bounds on what one HTTP client can cost the server: header size and time, body size and time, how long
a response may wait for a client that does not read, and connections per client address.

Why: rsagg serves anyone who can reach it (the republished Source, the hub, WebSub callbacks). One client
that opens many connections, drips its headers or body a byte at a time, or never reads its response
must cost bounded memory and file descriptors, and must not keep others from being served.

What bounds what (docs/security.md has the table):

- request head (request line + headers): at most ``max_header_bytes`` (hypercorn's
  ``h11_max_incomplete_size`` while it arrives, 431 once complete), complete within ``header_timeout``
  of the connection's start or of the end of the previous response (hypercorn's idle timer,
  ``keep_alive_timeout``, runs until a request head is complete: a slowloris client is closed);
- request body: a Content-Length over ``max_body_bytes`` is answered 413 before the app runs (the
  endpoints that read bodies cap them again while reading: the hub, the WebSub callbacks); the whole
  body must arrive within ``body_timeout`` (408);
- response: each write may wait ``send_timeout`` for the client to read, then the connection is closed
  (hypercorn shields its writes from cancellation, so the bound sits on the stream itself);
- connections: at most ``max_connections_per_client`` open at once per client address; one more is
  answered 429 with Retry-After and closed, without being read.

hypercorn's trio worker has no hook for accepted connections, so ``serve_guarded`` runs hypercorn's own
``TCPServer`` per connection (as ``hypercorn.trio.run.worker_serve`` does), behind the per-address cap and
the send deadline, changed in one respect: a connection its client closed is closed at once
(``_GuardedTCPServer``), not when the keep-alive timer runs out. No TLS here: TLS ends at the reverse
proxy (docs/deployment).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, LifespanState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app

log = logging.getLogger("rsagg.server")

#: Why a client was cut off (the ``reason`` label of ``rsagg_server_refused_total``).
REASONS = ("connections", "head_size", "head_time", "body_size", "body_time", "slow_reader")


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost (see the module docstring); production values by default."""

    max_header_bytes: int = 16 * 1024
    header_timeout: float = 10.0
    max_body_bytes: int = 16 * 1024 * 1024
    body_timeout: float = 60.0
    send_timeout: float = 60.0
    max_connections_per_client: int = 256  # 0: no cap (behind a proxy every client is the proxy)
    retry_after: int = 5  # seconds, in the 429 of a connection over the cap
    #: Called with the reason of every refusal (``REASONS``; the metrics counter).
    on_refused: Callable[[str], None] | None = field(default=None, compare=False, repr=False)

    def refused(self, reason: str) -> None:
        if self.on_refused is not None:
            try:
                self.on_refused(reason)
            except Exception:
                log.exception("server: refusal hook failed")

    def apply(self, config: Config) -> None:
        """The bounds hypercorn enforces itself."""
        config.h11_max_incomplete_size = self.max_header_bytes
        config.h2_max_header_list_size = self.max_header_bytes
        config.keep_alive_timeout = self.header_timeout


_OVER_CAP = (
    b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: %d\r\nContent-Type: text/plain\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
)


class _SendBounded(trio.abc.HalfCloseableStream):
    """A socket stream whose writes give up after ``timeout`` (a client that never reads its response).

    ``on_close`` is called once, when the socket is closed (its slot of ``max_connections_per_client``
    is free then, even while an app told of the disconnect still finishes)."""

    def __init__(
        self, stream: trio.SocketStream, limits: ServerLimits, on_close: Callable[[], None] | None = None
    ) -> None:
        self._stream = stream
        self._limits = limits
        self._timeout = limits.send_timeout
        self._on_close = on_close
        self.sent = False  # anything sent to the client (else it never completed a request head)
        self.socket = stream.socket  # hypercorn reads peer and local addresses from it

    def _closed(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sent = True
        with trio.move_on_after(self._timeout) as scope:
            await self._stream.send_all(data)
        if scope.cancelled_caught:
            log.info("closing a connection whose client did not read for %.0f s", self._timeout)
            self._limits.refused("slow_reader")
            try:
                await trio.aclose_forcefully(self._stream)
            finally:
                self._closed()
            raise trio.BrokenResourceError(f"client did not read for {self._timeout} s")

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._stream.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        try:
            self._stream.socket.close()  # at once: the slot is free no later than the descriptor
        finally:
            self._closed()
        await self._stream.aclose()


class _GuardedTCPServer(TCPServer):
    """hypercorn's ``TCPServer``, which lets a connection go as soon as its client closed it.

    hypercorn's own ends its read loop at the client's EOF, but closes the socket only once every task
    of the connection's task group has ended, its keep-alive timer among them: a connection its client
    closed after a response (a harvester's keep-alive client letting go of a connection) stayed in
    CLOSE_WAIT, holding its file descriptor and its slot of ``max_connections_per_client``, until that
    timer ran out (``header_timeout``), and a client that churns connections got 429. Here the end of
    the read loop (EOF, a broken or closed stream) stops the timer and closes the socket at once. An
    app still answering was told (``http.disconnect``, by hypercorn); what it still sends is dropped,
    as for a client that went away mid-response (nginx's 499). The connection's task ends with the app.
    """

    async def _read_data(self) -> None:
        try:
            await super()._read_data()
        finally:
            with trio.CancelScope(shield=True):
                await self.idle_task.stop()
                # not ``_close``: its send_eof would collide with an app's write under way; closing
                # wakes that write (ClosedResourceError, which hypercorn takes for a closed client)
                await self.stream.aclose()


class _Prefixed(trio.abc.HalfCloseableStream):
    """A stream whose first ``receive_some`` gives back bytes read already (by the fast lane)."""

    def __init__(self, stream: _SendBounded, pending: bytes) -> None:
        self._stream = stream
        self._pending = pending
        self.socket = stream.socket

    @property
    def sent(self) -> bool:
        return self._stream.sent

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        return await self._stream.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()


#: ``lane(method, target) -> (head, body) | None``: a request answered without hypercorn (the
#: publisher's hot resource route, ``publish/fastpath.py``); ``head``: the status line and the headers,
#: each ending in CRLF, without the blank line and without the server's own headers (Date, Server: the
#: lane adds them as hypercorn does); None: hypercorn answers it.
Lane = Callable[[bytes, bytes], Awaitable[tuple[bytes, bytes] | None]]
#: Request headers the fast lane leaves to hypercorn (bodies, upgrades, connection handling) or to the
#: app's ordinary route (validators and ranges decide per request).
_LANE_HANDS_OVER = frozenset(
    (b"content-length", b"transfer-encoding", b"expect", b"upgrade", b"te", b"range", b"if-range",
     b"if-match", b"if-none-match", b"if-modified-since", b"if-unmodified-since", b"http2-settings")
)  # fmt: skip
_RECV = 65536


class _FastLane:
    """Plain ``GET``/``HEAD`` requests of a keep-alive HTTP/1.1 connection answered by ``lane`` without
    hypercorn's and starlette's layers (h11 events, ASGI messages, a task per request): they cost far
    more than the answer of a resource the publisher holds in memory. The first request it does not
    take (anything but an origin-form GET/HEAD with a Host and plain headers, or one ``lane`` declines)
    and the rest of the connection go to hypercorn, with the bytes read so far: whatever the lane
    cannot answer exactly as hypercorn would is hypercorn's to answer. Same bounds: the head within
    ``header_timeout`` and ``max_header_bytes``; writes bounded by the stream (``send_timeout``).

    Per request it costs one wait for the socket to be readable, one read and (almost always) one
    write of the whole answer: the socket's descriptor is read and written directly, not through
    trio's stream methods (a try that fails, a cancel scope and a schedule point each); the head
    deadline is kept by ``reap`` (one task for all connections: a connection waiting for a head longer
    than ``header_timeout`` is cancelled, at most a tenth of it late), not by a deadline per request.
    The Date and Server headers are made once a second."""

    def __init__(self, lane: Lane, limits: ServerLimits, config: Config, context: WorkerContext) -> None:
        self.lane, self.limits, self.config, self.context = lane, limits, config, context
        self._second = -1
        self._own = b""  # the server's own headers (Date, Server) of ``_second``
        self._open: set[_Waiting] = set()  # the lane's connections

    async def reap(self) -> None:
        """Close the connections that wait for a request head longer than ``header_timeout`` (runs
        for as long as the server)."""
        timeout = self.limits.header_timeout
        while True:
            await trio.sleep(max(timeout / 10, 0.01))
            late = time.monotonic() - timeout
            for conn in self._open:
                if conn.waiting and conn.since < late:
                    conn.scope.cancel()

    def _own_headers(self) -> bytes:
        """``Config.response_headers`` as bytes, made again when the second changes (Date's precision)."""
        now = int(time.time())
        if now != self._second:
            own = self.config.response_headers("h11")
            self._second, self._own = now, b"".join(b"%s: %s\r\n" % h for h in own)
        return self._own

    async def serve(self, stream: _SendBounded) -> bytes | None:
        """Answer requests while the lane can; the bytes read but not answered (hypercorn's to answer),
        or None when the connection is done (closed by the client, idle too long, shutting down)."""
        fd = stream.socket.fileno()
        with trio.CancelScope() as scope:  # cancelled by ``reap``: no head within header_timeout
            conn = _Waiting(scope)
            self._open.add(conn)
            try:
                return await self._serve(stream, fd, conn)
            finally:
                self._open.discard(conn)
        return None  # idle, or dripping a head, past the deadline: closed

    async def _serve(self, stream: _SendBounded, fd: int, conn: _Waiting) -> bytes | None:
        limits, lane, terminated = self.limits, self.lane, self.context.terminated
        buf = b""
        while True:
            if terminated.is_set():
                return None
            conn.since, conn.waiting = time.monotonic(), True
            end = buf.find(b"\r\n\r\n")
            if end >= 0:  # pipelined: already here; still a schedule point for the others
                await trio.lowlevel.checkpoint()
            while end < 0:
                if len(buf) > limits.max_header_bytes:
                    return buf
                await trio.lowlevel.wait_readable(fd)
                try:
                    data = os.read(fd, _RECV)
                except BlockingIOError:
                    continue
                except OSError:  # reset by the client
                    return None
                if not data:
                    return buf or None
                buf += data
                end = buf.find(b"\r\n\r\n")
            conn.waiting = False
            if conn.scope.cancel_called:  # too late: ``reap`` cancelled it as the head came in
                return None
            request = _plain_request(buf[:end]) if end <= limits.max_header_bytes else None
            if request is None:
                return buf
            answer = await lane(*request)
            if answer is None:
                return buf
            await self._send(stream, fd, b"".join((answer[0], self._own_headers(), b"\r\n", answer[1])))
            buf = buf[end + 4 :]

    @staticmethod
    async def _send(stream: _SendBounded, fd: int, data: bytes) -> None:
        """Write ``data``: at once when the socket buffer takes it all (the common case), else the rest
        through the stream (which waits at most ``send_timeout`` for the client to read)."""
        stream.sent = True
        try:
            sent = os.write(fd, data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:  # the client is gone
            raise trio.BrokenResourceError(str(exc)) from exc
        if sent < len(data):
            await stream.send_all(memoryview(data)[sent:])


#: A byte a plain header line has not: a control character but tab, or one beyond ASCII.
_NOT_PLAIN = re.compile(rb"[\x00-\x08\x0a-\x1f\x80-\xff]")


class _Waiting:
    """One connection of the fast lane: ``waiting`` for a request head ``since`` (monotonic)."""

    __slots__ = ("scope", "since", "waiting")

    def __init__(self, scope: trio.CancelScope) -> None:
        self.scope, self.since, self.waiting = scope, 0.0, False


def _plain_request(head: bytes) -> tuple[bytes, bytes] | None:
    """(method, target) of a request head the fast lane may answer, else None."""
    line, _, fields = head.partition(b"\r\n")
    parts = line.split(b" ")
    if len(parts) != 3 or parts[2] != b"HTTP/1.1" or parts[0] not in (b"GET", b"HEAD"):
        return None
    target = parts[1]
    if target[:1] != b"/" or not target.isascii() or b"#" in target:
        return None
    plain = _PLAIN_FIELDS.get(fields)
    if plain is None:
        plain = _plain_fields(fields)
        if len(fields) <= _REMEMBERED_FIELDS_BYTES:
            if len(_PLAIN_FIELDS) >= _REMEMBERED_FIELDS:
                _PLAIN_FIELDS.clear()
            _PLAIN_FIELDS[fields] = plain
    return (parts[0], target) if plain else None


#: The verdicts of ``_plain_fields`` on the header blocks seen last: a client sends the same headers
#: with every request (its Host, its User-Agent...), so most requests skip the per-line checks. Bounded
#: in count and in the size of what is kept.
_PLAIN_FIELDS: dict[bytes, bool] = {}
_REMEMBERED_FIELDS = 1024
_REMEMBERED_FIELDS_BYTES = 512


def _plain_fields(fields: bytes) -> bool:
    """Whether a request's header lines are plain: well-formed, one Host, nothing the lane hands over."""
    hosts = 0
    for line in fields.split(b"\r\n") if fields else ():
        name, sep, value = line.partition(b":")
        if not sep or not name or name[-1:] in (b" ", b"\t") or _NOT_PLAIN.search(line):
            return False
        name = name.lower()
        if name in _LANE_HANDS_OVER:
            return False
        if name == b"host":
            hosts += 1
        elif name == b"connection" and value.strip().lower() != b"keep-alive":
            return False
    return hosts == 1


class _Connections:
    """Open connections per client address, and the handler that enforces the cap."""

    def __init__(
        self,
        limits: ServerLimits,
        server: Callable[[trio.abc.Stream], Awaitable[None]],
        lane: _FastLane | None = None,
    ) -> None:
        self.limits = limits
        self.server = server
        self.lane = lane
        self.open: Counter[str] = Counter()
        self.refused = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            peer = str(stream.socket.getpeername()[0])
        except OSError:  # gone already
            await trio.aclose_forcefully(stream)
            return
        cap = self.limits.max_connections_per_client
        if cap and self.open[peer] >= cap:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning("client %s holds %d connections (the cap): refusing more (%d so far)",
                            peer, cap, self.refused)  # fmt: skip
            self.limits.refused("connections")
            await self._refuse(stream)
            return
        self.open[peer] += 1
        released = False

        def release() -> None:  # once: when the socket is closed, or at the latest when this ends
            nonlocal released
            if not released:
                released = True
                self.open[peer] -= 1
                if not self.open[peer]:
                    del self.open[peer]

        bounded = _SendBounded(stream, self.limits, release)
        start = trio.current_time()
        try:
            if self.lane is None:
                await self.server(bounded)
            else:
                try:
                    pending = await self.lane.serve(bounded)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pending = None
                if pending is None:
                    await trio.aclose_forcefully(bounded)
                else:
                    await self.server(_Prefixed(bounded, pending))
            if not bounded.sent and trio.current_time() - start >= self.limits.header_timeout:
                self.limits.refused("head_time")  # closed by hypercorn's timer before a request head
        finally:
            release()

    async def _refuse(self, stream: trio.SocketStream) -> None:
        text = b"too many connections from your address; try again later\n"
        with trio.move_on_after(1.0):
            try:
                await stream.send_all(_OVER_CAP % (self.limits.retry_after, len(text), text))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await trio.aclose_forcefully(stream)


class RequestGuard:
    """ASGI middleware: a request head over ``max_header_bytes`` gets 431; a body over ``max_body_bytes``
    (by Content-Length) gets 413 before the app runs; a body not complete within ``body_timeout`` gets
    408 (the app then sees a disconnect)."""

    def __init__(self, app: Any, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lim = self.limits
        head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        head += sum(len(n) + len(v) + 4 for n, v in scope.get("headers", ()))
        if head > lim.max_header_bytes:  # hypercorn bounds a head arriving in pieces; this, one in one read
            lim.refused("head_size")
            await _plain(send, 431, f"request head over {lim.max_header_bytes} bytes\n")
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.isdigit() or int(value) > lim.max_body_bytes:
                    lim.refused("body_size")
                    await _plain(send, 413, f"request body over {lim.max_body_bytes} bytes\n")
                    return
        deadline = trio.current_time() + lim.body_timeout
        state = {"body_done": False, "started": False, "answered": False}

        async def guarded_receive() -> dict[str, Any]:
            if state["body_done"]:
                return await receive()
            with trio.move_on_at(deadline):
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    state["body_done"] = True
                return message
            state["body_done"] = True
            lim.refused("body_time")
            if not state["started"]:
                state["answered"] = True
                await _plain(send, 408, f"request body not received within {lim.body_timeout:.0f} s\n")
            return {"type": "http.disconnect"}

        async def guarded_send(message: dict[str, Any]) -> None:
            if state["answered"]:
                return  # we answered 408 already
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if not state["answered"]:
                raise
            # the app failed on the disconnect we gave it: answered already


async def _plain(send: Any, status: int, text: str) -> None:
    body = text.encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def serve_guarded(
    app: Any,
    config: Config,
    limits: ServerLimits,
    *,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
    sockets: Sockets | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Like ``hypercorn.trio.run.worker_serve`` (plain HTTP), with the bounds of ``limits``.

    ``sockets``: already bound (e.g. shared by several worker processes); by default ``config.bind``.
    ``app.state.fast_lane`` (a ``Lane``), when the app has one, answers the plain requests it can
    without hypercorn (``_FastLane``).
    """
    limits.apply(config)
    wrapped = wrap_app(RequestGuard(app, limits), config.wsgi_max_body_size, "asgi")
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            if sockets is None:
                sockets = config.create_sockets()
            listeners, binds = [], []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            server = partial(
                _GuardedTCPServer, wrapped, config, context, ConnectionState(lifespan_state.copy())
            )
            lane = getattr(getattr(app, "state", None), "fast_lane", None)
            fast = _FastLane(lane, limits, config, context) if lane is not None else None
            connections = _Connections(limits, server, fast)  # type: ignore[arg-type]
            task_status.started(binds)
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    if shutdown_trigger is not None:
                        nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(raise_shutdown, context.terminate.wait)
                    if fast is not None:
                        nursery.start_soon(fast.reap)
                    nursery.start_soon(
                        partial(
                            trio.serve_listeners,
                            connections.handle,
                            listeners,
                            handler_nursery=server_nursery,
                        )
                    )
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, other = error.split((ShutdownError, KeyboardInterrupt))
                if other is not None:
                    raise other from None
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


__all__ = ["RequestGuard", "ServerLimits", "serve_guarded"]
