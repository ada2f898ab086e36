"""Server bounds (aggregator/run/serverguard.py): a misbehaving client (slow headers, slow or huge body, a
response it never reads, a connection flood, a subscription flood) is cut off or answered 413/408/429,
and a well-behaved client keeps being served meanwhile.

Every loop is bounded in count and time; the waits are hang guards far above any real need.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from aggregator.net.outbound import AddressPolicy
from aggregator.run.serverguard import ServerLimits
from aggregator.run.serving import serving
from aggregator.store.open import connect
from aggregator.websub.hub import Hub, HubLimits, delivery_client, topics_under

LIMITS = ServerLimits(
    max_header_bytes=8 * 1024,
    header_timeout=1.0,
    max_body_bytes=1000,
    body_timeout=1.0,
    send_timeout=1.0,
    max_connections_per_client=5,
)
BIG = 32 * 1024 * 1024  # far more than loopback socket buffers hold


def counting() -> tuple[ServerLimits, Counter[str]]:
    """LIMITS, counting every refusal by reason (what the daemon's metrics get)."""
    refused: Counter[str] = Counter()
    return replace(LIMITS, on_refused=lambda reason: refused.update([reason])), refused


class App:
    def __init__(self) -> None:
        self.big_ended = trio.Event()
        self.posted: list[int] = []

    def starlette(self, *routes: Any) -> Starlette:
        async def ok(request: Request) -> Response:
            return PlainTextResponse("ok")

        async def post(request: Request) -> Response:
            body = await request.body()
            self.posted.append(len(body))
            return PlainTextResponse(f"{len(body)}")

        async def big(request: Request) -> Response:
            async def chunks() -> AsyncIterator[bytes]:
                try:
                    for _ in range(BIG // 65536):
                        yield b"x" * 65536
                finally:
                    self.big_ended.set()

            return StreamingResponse(chunks())

        return Starlette(
            routes=[Route("/ok", ok), Route("/post", post, methods=["POST"]), Route("/big", big), *routes]
        )


async def _well_behaved(base: str, n: int = 5) -> None:
    """A client that asks politely keeps getting answers (fresh connections, from 127.0.0.1)."""
    for _ in range(n):
        async with httpx.AsyncClient(timeout=20) as client:
            r = await client.get(f"{base}/ok")
            assert r.status_code == 200 and r.text == "ok"


async def _raw(base: str, local: str = "127.0.0.1") -> trio.SocketStream:
    url = httpx.URL(base)
    return await trio.open_tcp_stream(url.host, url.port or 80, local_address=local)


async def _read_all(stream: trio.SocketStream, limit: float = 30.0) -> bytes:
    """Everything the server sends until it closes (hang guard ``limit``)."""
    out = b""
    with trio.fail_after(limit):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not data:
                break
            out += data
    return out


async def test_slow_headers_are_cut_off_while_others_are_served() -> None:
    app = App()
    limits, refused = counting()
    async with serving(app.starlette(), limits=limits) as base:
        slow = await _raw(base)
        await slow.send_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n")
        closed = trio.Event()

        async def drip() -> None:
            try:
                for i in range(200):  # would take 40 s: the server closes it long before
                    await slow.send_all(b"X-Drip-%d: y\r\n" % i)
                    await trio.sleep(0.2)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async def watch() -> None:
            await _read_all(slow)
            closed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drip)
            nursery.start_soon(watch)
            await _well_behaved(base)
            with trio.fail_after(30):
                await closed.wait()
            nursery.cancel_scope.cancel()
        await slow.aclose()
        with trio.fail_after(30):
            while not refused["head_time"]:
                await trio.sleep(0.02)
    assert refused == {"head_time": 1}


async def test_headers_over_the_limit_are_refused() -> None:
    limits, refused = counting()
    async with serving(App().starlette(), limits=limits) as base:
        s = await _raw(base)
        await s.send_all(b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 16 * 1024 + b"\r\n\r\n")
        answer = await _read_all(s)
        await s.aclose()
        assert answer.split(b" ", 2)[1] in (b"431", b"400"), answer[:100]
        await _well_behaved(base, 1)
    assert refused == {"head_size": 1}


async def test_body_size_and_time_limits() -> None:
    app = App()
    limits, refused = counting()
    async with serving(app.starlette(), limits=limits) as base:
        async with httpx.AsyncClient(timeout=20) as client:
            r = await client.post(f"{base}/post", content=b"x" * 2000)
            assert r.status_code == 413
            assert (await client.post(f"{base}/post", content=b"x" * 500)).text == "500"
        s = await _raw(base)
        await s.send_all(b"POST /post HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")  # then nothing
        answer = await _read_all(s)
        await s.aclose()
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
        assert app.posted == [500]  # the stalled body never reached the app as a request
        await _well_behaved(base, 1)
    assert refused == {"body_size": 1, "body_time": 1}


async def test_a_client_that_never_reads_is_closed() -> None:
    app = App()
    limits, refused = counting()
    async with serving(app.starlette(), limits=limits) as base:
        s = await _raw(base)
        await s.send_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        await _well_behaved(base, 2)
        with trio.fail_after(30):
            await app.big_ended.wait()  # the server gave up on it (32 MB were never sent)
        await s.aclose()
    assert refused == {"slow_reader": 1}


async def test_connection_cap_per_client_address() -> None:
    limits, refused = counting()
    async with serving(App().starlette(), limits=limits) as base:
        held = [await _raw(base, "127.0.0.2") for _ in range(LIMITS.max_connections_per_client)]
        for s in held:  # each one is busy sending a request head slowly
            await s.send_all(b"GET /ok HTTP/1.1\r\n")
        extra = await _raw(base, "127.0.0.2")
        answer = await _read_all(extra)
        await extra.aclose()
        assert answer.startswith(b"HTTP/1.1 429 ") and b"Retry-After: " in answer
        assert refused["connections"] == 1
        await _well_behaved(base, 3)  # another address is not affected
        for s in held:
            await s.aclose()
        with trio.fail_after(30):  # the slots are freed once the server notices
            while True:
                s = await _raw(base, "127.0.0.2")
                await s.send_all(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answer = await _read_all(s)
                await s.aclose()
                if answer.startswith(b"HTTP/1.1 200 "):
                    break
                await trio.sleep(0.05)


async def test_subscription_flood_gets_429_and_the_server_stays_responsive(tmp_path: Path) -> None:
    app = App()
    limits = HubLimits(
        host_requests_burst=5, host_requests_per_second=0.5, requests_burst=20, requests_per_second=1.0,
        max_subscriptions_per_host=3, poll_interval=0.2, request_timeout=2.0,
    )  # fmt: skip
    holder: dict[str, Any] = {}

    async def hub_endpoint(request: Request) -> Response:
        return await holder["hub"].endpoint(request)

    starlette = app.starlette(Route("/hub", hub_endpoint, methods=["POST"]))
    async with serving(starlette, limits=LIMITS) as base:
        # No worker: requests stay waiting for verification (the counts include them).
        hub = holder["hub"] = Hub(
            connect(tmp_path / "hub.db"), hub_url=f"{base}/hub", allowed_topic=topics_under(base),
            policy=AddressPolicy(), limits=limits, client=delivery_client(AddressPolicy(), limits),
        )  # fmt: skip
        statuses: list[int] = []
        retry_after: set[str] = set()

        async def flood(worker: int) -> None:
            transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")  # the flood's own address
            async with httpx.AsyncClient(timeout=20, transport=transport) as client:
                for i in range(40):
                    host = "cb.example" if worker < 2 else f"h{worker}-{i}.example"
                    form = {
                        "hub.mode": "subscribe",
                        "hub.topic": f"{base}/t",
                        "hub.callback": f"http://{host}/{worker}/{i}",
                    }
                    r = await client.post(f"{base}/hub", data=form)
                    statuses.append(r.status_code)
                    if r.status_code == 429:
                        retry_after.add(r.headers["retry-after"])

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for w in range(4):  # 160 requests from 4 clients at once
                    nursery.start_soon(flood, w)
                await _well_behaved(base, 5)
        assert len(statuses) == 160
        accepted = statuses.count(202)
        assert 0 < accepted <= 3 + limits.requests_burst + 5  # per host: 3 stored; in total: the burst
        assert statuses.count(429) == 160 - accepted
        assert retry_after and all(v.isdigit() and int(v) >= 1 for v in retry_after)
        pending = (await trio.to_thread.run_sync(hub.pending))["verifications"]
        assert pending == accepted
        with sqlite3.connect(tmp_path / "hub.db") as c:
            rows = c.execute(
                "SELECT COUNT(*) FROM hub_verifications WHERE callback LIKE 'http://cb.example/%'"
            ).fetchone()[0]
        assert rows <= 3  # the per-host limit
        assert len(hub._host_rate._buckets) <= hub._host_rate.max_keys  # memory bounded
        await hub.aclose()
        await _well_behaved(base, 1)


def test_rate_limit_table_stays_bounded() -> None:
    """A flood of distinct callback hosts cannot grow the hub's per-host table past its bound."""
    from aggregator.websub.hub import _Buckets

    buckets = _Buckets(rate=1.0, burst=2, max_keys=100)
    waits = [buckets.take(f"h{i}.example", now=0.0) for i in range(1000)]
    assert len(buckets._buckets) == 100
    assert waits[:100] == [0.0] * 100 and all(w > 0 for w in waits[100:])
    assert buckets.take("h0.example", now=0.0) == 0.0  # a known key keeps its bucket
    assert buckets.take("late.example", now=10.0) == 0.0  # idle buckets are forgotten once refilled
    assert len(buckets._buckets) == 1


async def test_hub_count_and_length_limits(tmp_path: Path) -> None:
    limits = HubLimits(max_subscriptions=2, max_callback_chars=100)
    holder: dict[str, Any] = {}

    async def hub_endpoint(request: Request) -> Response:
        return await holder["hub"].endpoint(request)

    async with serving(Starlette(routes=[Route("/hub", hub_endpoint, methods=["POST"])])) as base:
        hub = holder["hub"] = Hub(
            connect(tmp_path / "hub.db"), hub_url=f"{base}/hub", allowed_topic=topics_under(base),
            policy=AddressPolicy(), limits=limits, client=delivery_client(AddressPolicy(), limits),
        )  # fmt: skip
        async with httpx.AsyncClient(timeout=20) as client:

            async def subscribe(callback: str) -> httpx.Response:
                form = {"hub.mode": "subscribe", "hub.topic": f"{base}/t", "hub.callback": callback}
                return await client.post(f"{base}/hub", data=form)

            assert (await subscribe("http://a.example/1")).status_code == 202
            assert (await subscribe("http://b.example/2")).status_code == 202
            r = await subscribe("http://c.example/3")
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert "maximum of 2 subscriptions" in r.text
            assert (await subscribe("http://a.example/1")).status_code == 202  # the same request again
            r = await subscribe("http://a.example/" + "x" * 100)
            assert r.status_code == 400 and "longer than 100 characters" in r.text
        assert (await trio.to_thread.run_sync(hub.pending))["verifications"] == 2
        await hub.aclose()


# -- a connection its client closed is let go at once -------------------------------------------------


def _lane_app(app: App) -> Starlette:
    """``app`` with a fast lane (``serverguard._FastLane``) that answers ``/lane`` itself and hands
    everything else to hypercorn."""
    starlette = app.starlette()

    async def lane(method: bytes, target: bytes) -> tuple[bytes, bytes] | None:
        if target != b"/lane":
            return None
        return b"HTTP/1.1 200 \r\ncontent-length: 2\r\n", b"" if method == b"HEAD" else b"ok"

    starlette.state.fast_lane = lane
    return starlette


async def _let_go(fds: int) -> None:
    """Wait until this process (the server runs in it) holds no more file descriptors than ``fds``: the
    server closed its side of every connection its client closed. (Its socket would show in CLOSE_WAIT,
    or in no state at all when the client's close reset it, so the descriptors are what to count.)"""
    with trio.fail_after(20):  # a hang guard, far below the idle timer (60 s here)
        while psutil.Process().num_fds() > fds:
            await trio.sleep(0.01)


async def _response_head(s: trio.SocketStream) -> bytes:
    buf = b""
    with trio.fail_after(30):
        while b"\r\n\r\n" not in buf:
            data = await s.receive_some(65536)
            assert data, "closed before a response"
            buf += data
    return buf


async def _after_response(s: trio.SocketStream, path: str) -> None:  # keep-alive, idle, then closed
    await s.send_all(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert (await _response_head(s)).startswith(b"HTTP/1.1 200 ")


async def _two_requests(s: trio.SocketStream, path: str) -> None:  # a second response not read
    await s.send_all(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\nGET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await _response_head(s)


async def _mid_head(s: trio.SocketStream, path: str) -> None:
    await s.send_all(f"GET {path} HTTP/1.1\r\nHo".encode())


async def _mid_response(s: trio.SocketStream, path: str) -> None:  # /big: 32 MB, closed after the head
    await s.send_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    await _response_head(s)


async def _nothing(s: trio.SocketStream, path: str) -> None:
    pass


async def test_connections_closed_by_the_client_are_let_go_at_once() -> None:
    """Every way a client may close (before a request, mid-head, after a keep-alive response, with a
    response unread, mid-response), on every path (hypercorn's, the fast lane's, a request the lane
    hands to hypercorn): the server closes its side at once (no CLOSE_WAIT left; without this it waited
    for its idle timer, here 60 s) and the slot is free: a client churning many more connections than
    ``max_connections_per_client`` is never answered 429."""
    app = App()
    limits, refused = counting()
    limits = replace(limits, header_timeout=60.0, max_connections_per_client=3)  # the idle timer far off
    behaviours = (_nothing, _mid_head, _after_response, _two_requests, _mid_response)
    async with serving(_lane_app(app), limits=limits) as base:
        fds = psutil.Process().num_fds()
        for path in ("/ok", "/lane"):  # hypercorn's path; the fast lane's (and /ok: its handing over)
            for behave in behaviours:
                for _ in range(2 * limits.max_connections_per_client):  # more than the cap, one by one
                    s = await _raw(base, "127.0.0.3")
                    await behave(s, path)
                    await s.aclose()
                    await _let_go(fds)
                # the slots are free: as many connections as the cap, at once, are all served
                held = [await _raw(base, "127.0.0.3") for _ in range(limits.max_connections_per_client)]
                for s in held:
                    await _after_response(s, path)
                for s in held:
                    await s.aclose()
                await _let_go(fds)
    assert refused["connections"] == 0


async def test_the_fast_lane_closes_connections_without_a_request_head_in_time() -> None:
    """The fast lane's head deadline (``_FastLane.reap``): a connection that sends nothing, one idle
    after a keep-alive response, and one dripping a head are all closed by the server (header_timeout
    1 s here; the waits are hang guards), while a client that asks is served meanwhile."""
    app = App()
    limits, refused = counting()
    async with serving(_lane_app(app), limits=limits) as base:
        silent, idle, drip = await _raw(base), await _raw(base), await _raw(base)
        await _after_response(idle, "/lane")
        closed: list[str] = []

        async def dripping() -> None:
            await drip.send_all(b"GET /lane HTTP/1.1\r\n")
            try:
                for i in range(300):  # would take 60 s: the server closes it long before
                    await drip.send_all(b"X-Drip-%d: y\r\n" % i)
                    await trio.sleep(0.2)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                closed.append("drip")

        async def until_closed(name: str, s: trio.SocketStream) -> None:
            rest = await _read_all(s)
            assert b"HTTP/1.1" not in rest  # closed without an answer
            closed.append(name)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(until_closed, "silent", silent)
                nursery.start_soon(until_closed, "idle", idle)
                nursery.start_soon(dripping)
                s = await _raw(base)
                await _after_response(s, "/lane")  # served meanwhile
                await s.aclose()
        for s in (silent, idle, drip):
            await s.aclose()
    assert sorted(closed) == ["drip", "idle", "silent"]
    assert refused["head_time"] >= 1  # the silent one never sent a head
