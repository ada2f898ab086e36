"""Fetcher internals that exist for speed: small pools behind one client, requests sent to the transport
directly (redirects followed by hand), small bodies spooled in memory until the blob commit."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aggregator.harvest import fetch
from aggregator.harvest.fetch import Expected, Fetcher, _redirect, _ShardedTransport
from aggregator.store.blobs import FileBlobStore
from tests.httpserver import serve_app


def redirect(location: str, url: str = "http://a.example/dir/page?q=1", **headers: str) -> httpx.Request:
    request = httpx.Request("GET", url, headers={"Accept": "*/*", **headers}, extensions={"timeout": {}})
    response = httpx.Response(302, headers={"Location": location}, request=request)
    return _redirect(request, response)


def test_redirect_targets() -> None:
    assert str(redirect("other").url) == "http://a.example/dir/other"
    assert str(redirect("/top").url) == "http://a.example/top"
    assert str(redirect("//b.example/x").url) == "http://b.example/x"
    assert str(redirect("https://c.example/y").url) == "https://c.example/y"
    assert str(redirect("http:/nohost").url) == "http://a.example/nohost"
    assert str(redirect("next", url="http://a.example/p#frag").url) == "http://a.example/next#frag"
    assert str(redirect("next#own", url="http://a.example/p#frag").url) == "http://a.example/next#own"


def test_redirect_headers() -> None:
    hop = redirect(
        "https://b.example/", Authorization="Basic eDp5", Cookie="a=b", **{"Accept-Encoding": "identity"}
    )
    assert hop.method == "GET" and hop.extensions == {"timeout": {}}
    assert hop.headers["host"] == "b.example"  # follows the URL
    assert hop.headers["accept-encoding"] == "identity" and hop.headers["accept"] == "*/*"
    assert "authorization" not in hop.headers and "cookie" not in hop.headers


def test_bad_redirect_location_is_a_fetch_error() -> None:
    with pytest.raises(fetch.FetchError) as ei:
        redirect("http://[::1")
    assert ei.value.kind == "http" and "Location" in str(ei.value)


def test_pool_sizes() -> None:
    t = _ShardedTransport(10, per_pool=4)
    assert t._capacity == [4, 4, 2] and len(t._pools) == 3
    assert _ShardedTransport(3, per_pool=4)._capacity == [3]


class Server:
    """Counts requests in flight and the client ports (connections) it saw; can hold requests."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.most = 0
        self.ports: set[int] = set()
        self.release = trio.Event()
        self.hold = False

    def app(self) -> Starlette:
        async def res(request: Request) -> Response:
            assert request.client is not None
            self.ports.add(request.client.port)
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            try:
                if self.hold:
                    await self.release.wait()
                return Response(
                    b"x" * int(request.query_params.get("n", "10")), headers={"Set-Cookie": "s=1"}
                )
            finally:
                self.in_flight -= 1

        async def cookie(request: Request) -> Response:
            return Response(request.headers.get("cookie", "none").encode())

        return Starlette(routes=[Route("/res", res), Route("/cookie", cookie)])


async def test_concurrency_spreads_over_pools_and_connections_are_reused(tmp_path: Path) -> None:
    srv = Server()
    async with serve_app(srv.app()) as base, Fetcher(per_host=8, max_connections=8) as f:
        transport = f._direct
        assert isinstance(transport, _ShardedTransport) and len(transport._pools) == 2
        # Sequential requests: one keep-alive connection, reused.
        for _ in range(5):
            body = await f.get_bytes(f"{base}/res", max_bytes=100)
            assert body.content == b"x" * 10
        assert len(srv.ports) == 1
        # Eight at once: both pools are used, eight connections.
        srv.hold = True
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(lambda: f.get_bytes(f"{base}/res", max_bytes=100))
            with trio.fail_after(10):
                while srv.in_flight < 8:
                    await trio.sleep(0.01)
            assert transport._busy == [4, 4]
            srv.release.set()
        assert transport._busy == [0, 0] and srv.most == 8 and len(srv.ports) == 8
        # No cookie jar: a cookie set by the server is not sent back (rsagg keeps no cookies).
        assert (await f.get_bytes(f"{base}/cookie", max_bytes=100)).content == b"none"


async def test_small_bodies_wait_in_memory_for_the_commit(tmp_path: Path) -> None:
    srv = Server()
    store = FileBlobStore(tmp_path / "blobs")
    try:
        async with serve_app(srv.app()) as base, Fetcher() as f:
            small = await f.resource([f"{base}/res?n=100"], Expected({}), store)
            big_n = fetch.SMALL_BODY + 1
            big = await f.resource([f"{base}/res?n={big_n}"], Expected({}, big_n), store)
        assert small.blob.tmp_path is None  # no file yet
        assert big.blob.tmp_path is not None and big.blob.tmp_path.exists()
        store.commit([small.blob, big.blob])
        assert store.open(small.info.sha256).read() == b"x" * 100
        assert small.info.sha256 == hashlib.sha256(b"x" * 100).hexdigest()
        assert store.size(big.info.sha256) == big_n
    finally:
        store.close()


def test_proxies_in_the_environment_use_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    assert Fetcher()._direct is None
    monkeypatch.delenv("http_proxy")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert Fetcher()._direct is not None
