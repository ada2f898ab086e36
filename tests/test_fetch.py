"""Fetcher against a real HTTP server (hypercorn + starlette on 127.0.0.1, see tests/httpserver.py)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from functools import partial

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from aggregator.harvest.fetch import Expected, Fetcher, FetchError
from aggregator.net.retry import retry_after_seconds
from aggregator.store.blobs import FileBlobStore
from tests.blobtesting import temp_files
from tests.httpserver import serve_app

HEAD = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" '
    b'xmlns:rs="http://www.openarchives.org/rs/terms/">\n'
    b'  <rs:md capability="resourcelist" at="2013-01-03T09:00:00Z"/>\n'
)


def entry(n: int) -> bytes:
    return f"  <url><loc>http://example.com/res{n}</loc></url>\n".encode()


def resource_list(n: int) -> bytes:
    return HEAD + b"".join(entry(i) for i in range(n)) + b"</urlset>\n"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


class Recorder:
    """Server-side bookkeeping shared by the handlers of one test."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.headers: dict[str, list[httpx.Headers | dict]] = {}

    def saw(self, request: Request) -> int:
        path = request.url.path
        self.hits[path] += 1
        self.headers.setdefault(path, []).append(dict(request.headers))
        return self.hits[path]


def app_of(routes: dict[str, Callable]) -> Starlette:
    return Starlette(routes=[Route(path, fn) for path, fn in routes.items()])


async def no_sleep_recorder(fetcher: Fetcher) -> list[float]:
    """Replace the fetcher's backoff sleep: record the delays it chose and do not wait."""
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        await trio.lowlevel.checkpoint()

    fetcher._sleep = sleep  # type: ignore[method-assign]
    return delays


# -- documents -----------------------------------------------------------------------------------


async def test_document_head_first_then_entries_stream() -> None:
    release = trio.Event()
    released_by_client: list[bool] = []
    body = resource_list(3)

    async def doc(request: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            # The parser hands out a child of the root once the next one has started: stop mid-entry.
            second = entry(1)
            yield HEAD + entry(0) + second[:10]
            with trio.move_on_after(5):  # a fetcher that waits for the whole body gets it only late
                await release.wait()
            released_by_client.append(release.is_set())
            yield second[10:] + entry(2) + b"</urlset>\n"

        return StreamingResponse(gen(), media_type="application/xml", headers={"ETag": '"v1"'})

    with trio.fail_after(20):
        async with serve_app(app_of({"/rl.xml": doc})) as base, Fetcher() as f:
            async with f.document(f"{base}/rl.xml") as stream:
                # The server is still holding back the rest of the body: the head came first.
                assert not release.is_set()
                assert stream.head is not None and stream.head.capability == "resourcelist"
                assert stream.head.md is not None and stream.head.md.at == datetime(2013, 1, 3, 9, tzinfo=UTC)
                assert not stream.not_modified
                assert stream.etag == '"v1"'
                assert stream.content_type == "application/xml"
                assert stream.url == f"{base}/rl.xml"
                assert stream.sha256 is None  # not before the end
                first = await stream.entries.__anext__()
                assert first.loc == "http://example.com/res0"
                release.set()
                rest = [e.loc async for e in stream.entries]
            assert rest == ["http://example.com/res1", "http://example.com/res2"]
            assert stream.sha256 == sha256(body)
    assert released_by_client == [True]  # the client had the head while the server held the rest back


async def test_conditional_get_304() -> None:
    rec = Recorder()
    lastmod = "Wed, 21 Oct 2015 07:28:00 GMT"

    async def doc(request: Request) -> Response:
        rec.saw(request)
        if request.headers.get("if-none-match") == '"v1"':
            return Response(status_code=304, headers={"ETag": '"v1"'})
        return Response(
            resource_list(2), media_type="application/xml", headers={"ETag": '"v1"', "Last-Modified": lastmod}
        )

    async with serve_app(app_of({"/rl.xml": doc})) as base, Fetcher() as f:
        async with f.document(f"{base}/rl.xml") as first:
            assert [e.loc async for e in first.entries] == [
                "http://example.com/res0",
                "http://example.com/res1",
            ]
        assert (first.etag, first.last_modified) == ('"v1"', lastmod)
        async with f.document(f"{base}/rl.xml", etag=first.etag, last_modified=first.last_modified) as again:
            assert again.not_modified
            assert again.head is None
            assert [e async for e in again.entries] == []
            assert again.etag == '"v1"'
            assert again.last_modified == lastmod
    sent = rec.headers["/rl.xml"][1]
    assert sent["if-none-match"] == '"v1"'
    assert sent["if-modified-since"] == lastmod
    assert "if-none-match" not in rec.headers["/rl.xml"][0]


async def test_parse_error_surfaces_as_kind_parse_with_line() -> None:
    rec = Recorder()
    broken = HEAD + entry(0) + b"  <url><loc>http://example.com/x</loc></urll>\n</urlset>\n"  # line 5

    async def doc(request: Request) -> Response:
        rec.saw(request)
        return Response(broken, media_type="application/xml")

    async with serve_app(app_of({"/bad.xml": doc})) as base, Fetcher() as f:
        with pytest.raises(FetchError) as ei:
            async with f.document(f"{base}/bad.xml") as stream:
                async for _ in stream.entries:
                    pass
    err = ei.value
    assert err.kind == "parse"
    assert err.line == 5
    assert ":5:" in str(err) and f"{base}/bad.xml" in str(err)
    assert rec.hits["/bad.xml"] == 1  # a broken document is not retried


async def test_document_size_cap() -> None:
    body = resource_list(200)

    async def doc(request: Request) -> Response:
        return Response(body, media_type="application/xml")

    async with serve_app(app_of({"/big.xml": doc})) as base, Fetcher() as f:
        with pytest.raises(FetchError) as ei:
            async with f.document(f"{base}/big.xml", max_bytes=2000) as stream:
                assert stream.head is not None
                async for _ in stream.entries:
                    pass
    assert ei.value.kind == "size"


async def test_document_gzip_coding_and_gzip_file() -> None:
    body = resource_list(3)

    async def coded(request: Request) -> Response:
        return Response(
            gzip.compress(body), media_type="application/xml", headers={"Content-Encoding": "gzip"}
        )

    async def gz_file(request: Request) -> Response:  # sitemap.xml.gz served as a file
        return Response(gzip.compress(body), media_type="application/gzip")

    async with serve_app(app_of({"/coded.xml": coded, "/rl.xml.gz": gz_file})) as base, Fetcher() as f:
        for path in ("/coded.xml", "/rl.xml.gz"):
            async with f.document(f"{base}{path}") as stream:
                locs = [e.loc async for e in stream.entries]
            assert locs == [f"http://example.com/res{i}" for i in range(3)]
            assert stream.sha256 == sha256(body)  # of the decoded document


async def test_document_deadline_on_a_dripping_server() -> None:
    done = trio.Event()

    async def drip(request: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            yield HEAD + entry(0) + entry(1)[:10]  # enough for the head: the deadline hits mid-body
            with trio.move_on_after(10):
                await done.wait()
            yield entry(1)[10:] + b"</urlset>\n"

        return StreamingResponse(gen(), media_type="application/xml")

    with trio.fail_after(20):
        async with serve_app(app_of({"/slow.xml": drip})) as base, Fetcher(document_deadline=0.5) as f:
            with pytest.raises(FetchError) as ei:
                async with f.document(f"{base}/slow.xml") as stream:
                    assert stream.head is not None
                    async for _ in stream.entries:
                        pass
            done.set()
    assert ei.value.kind == "timeout"


async def test_caller_exceptions_pass_through_unwrapped() -> None:
    async def doc(request: Request) -> Response:
        return Response(resource_list(3), media_type="application/xml")

    async with serve_app(app_of({"/rl.xml": doc})) as base, Fetcher() as f:
        with pytest.raises(KeyError):
            async with f.document(f"{base}/rl.xml") as stream:
                await stream.entries.__anext__()
                raise KeyError("the caller's own error")
        # Leaving early without reading everything is fine too.
        async with f.document(f"{base}/rl.xml") as stream:
            assert stream.head is not None


async def test_redirects_followed_and_reported() -> None:
    calls: list[tuple[str, int | None]] = []

    async def r1(request: Request) -> Response:
        return RedirectResponse("/r2", status_code=302)

    async def r2(request: Request) -> Response:
        return RedirectResponse("/rl.xml", status_code=307)

    async def doc(request: Request) -> Response:
        return Response(resource_list(1), media_type="application/xml")

    async def loop(request: Request) -> Response:
        return RedirectResponse("/loop", status_code=302)

    def hook(host: str, status: int | None, seconds: float, nbytes: int) -> None:
        calls.append((host, status))

    app = app_of({"/r1": r1, "/r2": r2, "/rl.xml": doc, "/loop": loop})
    async with serve_app(app) as base, Fetcher(metrics_hook=hook) as f:
        async with f.document(f"{base}/r1") as stream:
            assert stream.url == f"{base}/rl.xml"
            assert [e.loc async for e in stream.entries] == ["http://example.com/res0"]
        assert calls == [("127.0.0.1", 302), ("127.0.0.1", 307), ("127.0.0.1", 200)]
        with pytest.raises(FetchError) as ei:
            await f.get_bytes(f"{base}/loop", max_bytes=100)
    assert ei.value.kind == "http" and "redirects" in str(ei.value)


# -- retries -------------------------------------------------------------------------------------


async def test_retry_on_503_honours_retry_after() -> None:
    rec = Recorder()
    statuses: list[int | None] = []

    async def busy(request: Request) -> Response:
        if rec.saw(request) <= 2:
            return PlainTextResponse("busy", status_code=503, headers={"Retry-After": "1"})
        return PlainTextResponse("ok")

    app = app_of({"/busy": busy})
    async with (
        serve_app(app) as base,
        Fetcher(
            retries=3,
            backoff_base=0.001,
            backoff_max=0.02,
            metrics_hook=lambda h, s, t, n: statuses.append(s),
        ) as f,
    ):
        delays = await no_sleep_recorder(f)
        got = await f.get_bytes(f"{base}/busy", max_bytes=100)
    assert got.content == b"ok" and got.status == 200
    assert rec.hits["/busy"] == 3
    assert delays == [0.02, 0.02]  # Retry-After: 1 s, capped by backoff_max
    assert statuses == [503, 503, 200]  # one metrics call per response


async def test_retries_exhausted_and_jittered_backoff() -> None:
    rec = Recorder()

    async def down(request: Request) -> Response:
        rec.saw(request)
        return PlainTextResponse("down", status_code=502)

    async with (
        serve_app(app_of({"/down": down})) as base,
        Fetcher(retries=2, backoff_base=0.5, backoff_max=60) as f,
    ):
        delays = await no_sleep_recorder(f)
        with pytest.raises(FetchError) as ei:
            await f.get_bytes(f"{base}/down", max_bytes=100)
    assert (ei.value.kind, ei.value.status) == ("http", 502)
    assert rec.hits["/down"] == 3
    assert len(delays) == 2
    assert 0 <= delays[0] <= 0.5 and 0 <= delays[1] <= 1.0  # full jitter within base * 2**n


async def test_no_retry_on_404_and_410() -> None:
    rec = Recorder()

    async def gone(request: Request) -> Response:
        rec.saw(request)
        return PlainTextResponse("no", status_code=404 if request.url.path == "/missing" else 410)

    async with serve_app(app_of({"/missing": gone, "/gone": gone})) as base, Fetcher(retries=4) as f:
        delays = await no_sleep_recorder(f)
        for path, status in (("/missing", 404), ("/gone", 410)):
            with pytest.raises(FetchError) as ei:
                await f.get_bytes(f"{base}{path}", max_bytes=100)
            assert (ei.value.kind, ei.value.status) == ("http", status)
    assert rec.hits == Counter({"/missing": 1, "/gone": 1})
    assert delays == []


async def test_network_failure_is_retried_and_reported() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    statuses: list[int | None] = []
    async with Fetcher(retries=1, metrics_hook=lambda h, st, t, n: statuses.append(st)) as f:
        delays = await no_sleep_recorder(f)
        with pytest.raises(FetchError) as ei:
            await f.get_bytes(f"http://127.0.0.1:{port}/x", max_bytes=10)
    assert ei.value.kind == "network"
    assert statuses == [None, None] and len(delays) == 1


def test_retry_after_values() -> None:
    now = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
    assert retry_after_seconds("120") == 120.0
    assert retry_after_seconds(format_datetime(now + timedelta(seconds=90), usegmt=True), now) == 90.0
    assert retry_after_seconds(format_datetime(now - timedelta(seconds=5), usegmt=True), now) == 0.0
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds(None) is None


async def test_retry_after_http_date_on_429() -> None:
    """The transport is a MockTransport here: the date must be relative to the client's clock."""
    attempts = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
            return httpx.Response(429, headers={"Retry-After": when})
        return httpx.Response(200, content=b"fine")

    async with Fetcher(transport=httpx.MockTransport(handler), backoff_max=100) as f:
        delays = await no_sleep_recorder(f)
        got = await f.get_bytes("http://upstream.test/x", max_bytes=10)
    assert got.content == b"fine" and attempts == 2
    assert len(delays) == 1 and 25 <= delays[0] <= 30


# -- per-host limit ------------------------------------------------------------------------------


async def test_per_host_limit_respected() -> None:
    active = 0
    max_active = 0
    release = trio.Event()

    async def slow(request: Request) -> Response:
        nonlocal active, max_active
        active += 1
        max_active = max(max_active, active)
        try:
            with trio.move_on_after(10):
                await release.wait()
        finally:
            active -= 1
        return PlainTextResponse("x")

    with trio.fail_after(20):
        async with serve_app(app_of({"/slow": slow})) as base, Fetcher(per_host=2) as f:
            async with trio.open_nursery() as nursery:
                for _ in range(6):
                    nursery.start_soon(partial(f.get_bytes, f"{base}/slow", max_bytes=10))
                while active < 2:
                    await trio.sleep(0.01)
                await trio.sleep(0.2)  # room for a third request to (wrongly) arrive
                assert active == 2
                release.set()
    assert max_active == 2


# -- resources -----------------------------------------------------------------------------------

GOOD = b"the good content\n"
EVIL = b"something else!!\n"  # same length, different bytes


def resource_app(rec: Recorder) -> Starlette:
    async def good(request: Request) -> Response:
        rec.saw(request)
        return Response(GOOD, media_type="text/plain")

    async def evil(request: Request) -> Response:
        rec.saw(request)
        return Response(EVIL, media_type="text/plain")

    async def long(request: Request) -> Response:
        rec.saw(request)
        return Response(GOOD + b"more", media_type="text/plain")

    async def streamed(request: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            for _ in range(10):
                yield GOOD

        return StreamingResponse(gen(), media_type="text/plain")

    async def coded(request: Request) -> Response:
        rec.saw(request)
        return Response(
            gzip.compress(GOOD, mtime=0), media_type="text/plain", headers={"Content-Encoding": "gzip"}
        )

    return app_of({"/good": good, "/evil": evil, "/long": long, "/streamed": streamed, "/coded": coded})


async def test_resource_mirror_after_hash_mismatch(store: FileBlobStore) -> None:
    rec = Recorder()
    expected = Expected({"sha-256": sha256(GOOD), "md5": md5(GOOD)}, len(GOOD))
    async with serve_app(resource_app(rec)) as base, Fetcher() as f:
        got = await f.resource([f"{base}/evil", f"{base}/good"], expected, store)
    assert got.url == f"{base}/good"
    assert got.info.sha256 == sha256(GOOD) and got.info.hashes["md5"] == md5(GOOD)
    assert got.info.length == len(GOOD)
    assert got.content_type == "text/plain; charset=utf-8"
    assert rec.hits == Counter({"/evil": 2, "/good": 1})  # one more try on a mismatch, then the next URL
    assert rec.headers["/good"][0]["accept-encoding"] == "identity"
    # Finished, not committed: the caller batches commits.
    assert got.blob.state == "finished" and not store.exists(got.info.sha256)
    store.commit([got.blob])
    with store.open(got.info.sha256) as fh:
        assert fh.read() == GOOD
    assert temp_files(store) == []  # the rejected copies were dropped


async def test_resource_all_mirrors_wrong(store: FileBlobStore) -> None:
    rec = Recorder()
    expected = Expected({"sha-256": sha256(GOOD)}, None)
    async with serve_app(resource_app(rec)) as base, Fetcher() as f:
        with pytest.raises(FetchError) as ei:
            await f.resource([f"{base}/evil", f"{base}/evil?m=2"], expected, store)
    err = ei.value
    assert err.kind == "fixity"
    assert sha256(GOOD) in str(err) and sha256(EVIL) in str(err)
    assert rec.hits["/evil"] == 4
    assert temp_files(store) == []


async def test_resource_length_mismatch(store: FileBlobStore) -> None:
    rec = Recorder()
    async with serve_app(resource_app(rec)) as base, Fetcher() as f:
        with pytest.raises(FetchError) as ei:
            await f.resource([f"{base}/long"], Expected({}, len(GOOD)), store)
    assert ei.value.kind == "fixity" and "length" in str(ei.value)
    assert temp_files(store) == []


async def test_resource_size_cap(store: FileBlobStore) -> None:
    rec = Recorder()
    async with serve_app(resource_app(rec)) as base, Fetcher(max_resource_bytes=len(GOOD) * 3) as f:
        # Chunked, no Content-Length: the cap is enforced while streaming.
        with pytest.raises(FetchError) as ei:
            await f.resource([f"{base}/streamed"], Expected({}, None), store)
        assert ei.value.kind == "size"
        within = await f.resource([f"{base}/good"], Expected({}, None), store)
    assert within.info.length == len(GOOD)
    within.blob.abort()
    assert temp_files(store) == []


async def test_resource_with_content_coding_is_stored_as_served(store: FileBlobStore) -> None:
    rec = Recorder()
    encoded = gzip.compress(GOOD, mtime=0)
    async with serve_app(resource_app(rec)) as base, Fetcher() as f:
        got = await f.resource([f"{base}/coded"], Expected({"sha-256": sha256(encoded)}, len(encoded)), store)
    assert got.encoding == "gzip"
    assert got.info.sha256 == sha256(encoded)  # §7: hash and length of the representation as served


async def test_resource_skips_non_http_mirror(store: FileBlobStore) -> None:
    rec = Recorder()
    async with serve_app(resource_app(rec)) as base, Fetcher() as f:
        got = await f.resource(["gsiftp://grid.example.com/res1", f"{base}/good"], Expected({}, None), store)
        assert got.url == f"{base}/good"
        with pytest.raises(FetchError) as ei:
            await f.resource(["gsiftp://grid.example.com/res1"], Expected({}, None), store)
    assert ei.value.kind == "network" and "scheme" in str(ei.value)
    got.blob.abort()


# -- download ------------------------------------------------------------------------------------


async def test_download_restarts_cleanly_after_a_broken_body() -> None:
    rec = Recorder()
    payload = bytes(range(256)) * 1000

    async def package(request: Request) -> Response:
        n = rec.saw(request)

        async def gen() -> AsyncIterator[bytes]:
            yield payload[:100_000]
            if n == 1:
                raise RuntimeError("connection drops half-way")
            yield payload[100_000:]

        return StreamingResponse(gen(), media_type="application/zip")

    dest = io.BytesIO()
    async with serve_app(app_of({"/pkg.zip": package})) as base, Fetcher() as f:
        await no_sleep_recorder(f)
        info = await f.download(
            f"{base}/pkg.zip", dest, max_bytes=10**7, expected=Expected({"md5": md5(payload)}, None)
        )
    assert rec.hits["/pkg.zip"] == 2
    assert dest.getvalue() == payload
    assert (info.sha256, info.length, info.hashes["md5"]) == (sha256(payload), len(payload), md5(payload))


async def test_download_fixity_and_cap() -> None:
    rec = Recorder()
    async with serve_app(resource_app(rec)) as base, Fetcher() as f:
        with pytest.raises(FetchError) as ei:
            await f.download(
                f"{base}/evil", io.BytesIO(), max_bytes=1000, expected=Expected({"sha-256": sha256(GOOD)})
            )
        assert ei.value.kind == "fixity"
        with pytest.raises(FetchError) as ei:
            await f.download(f"{base}/good", io.BytesIO(), max_bytes=5)
        assert ei.value.kind == "size"


# -- small bodies --------------------------------------------------------------------------------


async def test_get_bytes_decodes_and_caps() -> None:
    text = json.dumps({"hello": "world" * 100}).encode()

    async def coded(request: Request) -> Response:
        return Response(
            gzip.compress(text),
            media_type="application/json",
            headers={"Content-Encoding": "gzip", "Link": '<http://x/>; rel="resourcesync"'},
        )

    async with serve_app(app_of({"/meta": coded})) as base, Fetcher() as f:
        got = await f.get_bytes(f"{base}/meta", max_bytes=10_000)
        assert got.content == text
        assert got.content_type == "application/json"
        assert got.link_header == '<http://x/>; rel="resourcesync"'
        with pytest.raises(FetchError) as ei:
            await f.get_bytes(f"{base}/meta", max_bytes=100)  # the decoded size counts
        assert ei.value.kind == "size"


async def test_invalid_url_is_a_clean_error() -> None:
    async with Fetcher() as f:
        with pytest.raises(FetchError) as ei:
            await f.get_bytes("http://127.0.0.1:abc/x", max_bytes=10)  # never leaves the process
    assert ei.value.kind == "network" and not ei.value.transient


async def test_document_retried_until_the_head_is_in() -> None:
    rec = Recorder()
    body = resource_list(2)

    async def flaky(request: Request) -> Response:
        n = rec.saw(request)
        if n == 1:
            return PlainTextResponse("busy", status_code=503)

        async def gen() -> AsyncIterator[bytes]:
            yield body[:60]  # not even the whole head
            if n == 2:
                raise RuntimeError("connection drops")
            yield body[60:]

        return StreamingResponse(gen(), media_type="application/xml")

    async with serve_app(app_of({"/rl.xml": flaky})) as base, Fetcher(retries=3) as f:
        delays = await no_sleep_recorder(f)
        async with f.document(f"{base}/rl.xml") as stream:
            locs = [e.loc async for e in stream.entries]
    assert locs == ["http://example.com/res0", "http://example.com/res1"]
    assert rec.hits["/rl.xml"] == 3 and len(delays) == 2
    assert stream.sha256 == sha256(body)


async def test_document_inside_an_async_generator() -> None:
    """Callers yield entries from inside ``document()`` (harvest/lists.py): no cancel scope may span that.

    The generator is advanced in a child task and closed from the parent after an early stop, as
    ``aclosing(...)`` + a pipeline's feeder task do.
    """

    async def doc(request: Request) -> Response:
        return Response(resource_list(50), media_type="application/xml")

    async def locs(f: Fetcher, url: str) -> AsyncIterator[str]:
        async with f.document(url) as stream:
            async for e in stream.entries:
                yield e.loc

    got: list[str] = []
    async with serve_app(app_of({"/rl.xml": doc})) as base, Fetcher() as f:
        async with aclosing(locs(f, f"{base}/rl.xml")) as agen:

            async def feed() -> None:
                async for loc in agen:
                    with trio.move_on_after(5):  # the consumer's own scopes, opened and closed per item
                        got.append(loc)
                    if len(got) == 3:
                        return

            async with trio.open_nursery() as nursery:
                nursery.start_soon(feed)
        # And to the end, in the same task.
        async with aclosing(locs(f, f"{base}/rl.xml")) as agen:
            assert len([x async for x in agen]) == 50
    assert got == [f"http://example.com/res{i}" for i in range(3)]


@pytest.mark.parametrize("seed", range(5))
def test_a_spool_hands_its_bytes_to_a_reader_at_any_pace(seed: int) -> None:
    """A document's spool (``fetch._Spool``): a download appending at random moments and a reader at its
    own pace; the reader gets every byte once, in order, then b"" (or the download's error); a download
    task that starts after the spool was closed finds its scope cancelled already."""
    import random

    from aggregator.harvest import fetch as fetch_mod

    rng = random.Random(seed)
    parts = [rng.randbytes(rng.randrange(1, 300)) for _ in range(rng.randrange(0, 12))]
    fails = rng.random() < 0.3

    async def main() -> bytes:
        spool = fetch_mod._Spool()
        got = bytearray()

        async def download() -> None:
            for part in parts:
                for _ in range(rng.randrange(3)):
                    await trio.lowlevel.checkpoint()
                spool.append(part)
            spool.finish(sha256="x", error=FetchError("u", "network", "gone") if fails else None)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(download)
            while True:
                try:
                    data = await spool.read(len(got), rng.randrange(1, 500))
                except FetchError:
                    assert fails
                    break
                if not data:
                    assert not fails
                    break
                got += data
        spool.close()
        assert spool.scope.cancel_called  # made after close: cancelled already
        return bytes(got)

    assert trio.run(main) == b"".join(parts)
