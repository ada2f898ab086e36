"""Resource GETs (aggregator/publish/resources.py): small local blobs are answered from memory exactly as
starlette's FileResponse answers them, big ones and the Range headers only FileResponse decides go
through FileResponse, non-local stores are streamed; a small GET costs one worker-thread call."""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from aggregator.config import Config
from aggregator.publish import resources
from aggregator.publish.app import POOL_IDLE
from aggregator.publish.resources import SMALL_BLOB
from aggregator.publish.uris import rsagg_uri
from aggregator.store.blobs import FileBlobStore
from aggregator.store.rows import Change
from aggregator.store.state import State

from .harvesting import make_config
from .test_publish import NoLocalPath, publishing

# Each test serves and compares every answer form (a second or more per test).
pytestmark = pytest.mark.slow

UP = "http://upstream.example/"
BLOBS: dict[str, tuple[bytes, str | None, str | None]] = {  # name: (bytes, type, encoding)
    "small.txt": (b"0123456789abcdefghij" * 15, "text/plain", None),
    "enc.json": (bytes(range(256)) * 4, "application/json", "compress"),  # httpx leaves it be
    "empty": (b"", None, None),
    "edge.bin": (bytes(range(256)) * (SMALL_BLOB // 256), "application/octet-stream", None),
    "edge1.bin": (bytes(range(256)) * (SMALL_BLOB // 256) + b"!", "application/octet-stream", None),
    "big.bin": (b"big" * SMALL_BLOB + b"1234567", "application/octet-stream", None),
    "gone.txt": (b"soon deleted", "text/plain", None),
    "missing.txt": (b"removed from the store by hand", "text/plain", None),
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def filled(tmp_path: Path, inline_bytes: int = 0) -> Config:
    """A store holding BLOBS in set "up" ("gone.txt" deleted, "missing.txt" without its blob): files,
    or rows of small.db up to ``inline_bytes``."""
    cfg = make_config(tmp_path / "data", {"up": UP + ".well-known/resourcesync"})
    cfg.store_path.mkdir(parents=True, exist_ok=True)
    blobs = FileBlobStore(cfg.store_path / "blobs", inline_bytes=inline_bytes)
    try:
        for data, _, _ in BLOBS.values():
            blobs.put_bytes(data)
        blobs.delete(sha(BLOBS["missing.txt"][0]))
    finally:
        blobs.close()
    with State(cfg.store_path / "state.db") as st:
        st.upsert_source("up", UP + ".well-known/resourcesync")
        sid = st.ensure_set("up", UP + "capabilitylist.xml")
        st.apply(sid, [Change(UP + n, "created", sha(d), len(d), t, e) for n, (d, t, e) in BLOBS.items()])
        st.apply(sid, [Change(UP + "gone.txt", "deleted")])
        assert [s.name for s in st.sets()] == ["up"]
    return cfg


@asynccontextmanager
async def served(
    tmp_path: Path, *, local: bool = True, inline_bytes: int = 0
) -> AsyncIterator[tuple[Callable[[str], str], httpx.AsyncClient]]:
    """(url of an upstream name, client) over the filled store, local files or not."""
    cfg = filled(tmp_path, inline_bytes)
    blobs = None if local else NoLocalPath(FileBlobStore(cfg.store_path / "blobs"))
    async with publishing(cfg, blobs=blobs) as (base, client):
        yield (lambda name: rsagg_uri(base, "up", UP + name)), client


@pytest.fixture
def file_responses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths of the FileResponses made, in order."""
    made: list[str] = []

    class Counted(resources._FileAnswer):
        def __init__(self, path: Any, *args: Any, **kw: Any) -> None:
            made.append(str(path))
            super().__init__(path, *args, **kw)

    monkeypatch.setattr(resources, "_FileAnswer", Counted)
    return made


def answer(r: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers in order (less the server's date/server) and body; multipart boundary fixed."""
    headers = [(k, v) for k, v in r.headers.multi_items() if k not in ("date", "server")]
    body = r.content
    m = re.search(r"boundary=(\w+)", r.headers.get("content-type", ""))
    if m:
        body = body.replace(m.group(1).encode(), b"B")
        headers = [(k, v.replace(m.group(1), "B")) for k, v in headers]
    return r.status_code, headers, body


# ---------------------------------------------------------------------------------------------------


async def test_small_blob_from_memory(tmp_path: Path, file_responses: list[str]):
    data = BLOBS["small.txt"][0]
    async with served(tmp_path) as (url, client):
        u = url("small.txt")
        r = await client.get(u)
        assert r.status_code == 200 and r.content == data
        etag, lm = r.headers["etag"], r.headers["last-modified"]
        assert etag == f'"{sha(data)}"'
        assert [k for k, _ in answer(r)[1]] == [
            "etag", "last-modified", "link", "content-type", "accept-ranges", "content-length"
        ]  # fmt: skip
        assert r.headers["content-type"] == "text/plain" and r.headers["content-length"] == str(len(data))
        assert r.headers["link"].startswith(f"<{url('')[: url('').index('/up/') + 4]}capabilitylist.xml>")
        assert 'rel="resourcesync", <' in r.headers["link"] and 'rel="timegate"' in r.headers["link"]
        r = await client.get(u, headers={"range": "bytes=2-5"})
        assert r.status_code == 206 and r.content == data[2:6]
        assert r.headers["content-range"] == f"bytes 2-5/{len(data)}" and r.headers["content-length"] == "4"
        assert (await client.get(u, headers={"range": "bytes=-3"})).content == data[-3:]
        assert (await client.get(u, headers={"range": "bytes=290-"})).content == data[290:]
        assert (await client.get(u, headers={"range": "bytes=295-1000"})).content == data[295:]
        for if_range in (etag, lm):
            r = await client.get(u, headers={"range": "bytes=2-5", "if-range": if_range})
            assert r.status_code == 206 and r.content == data[2:6]
        for if_range in ('"stale"', f"W/{etag}"):
            r = await client.get(u, headers={"range": "bytes=2-5", "if-range": if_range})
            assert r.status_code == 200 and r.content == data
        r = await client.head(u)
        assert r.status_code == 200 and r.content == b"" and r.headers["content-length"] == str(len(data))
        r = await client.head(u, headers={"range": "bytes=2-5"})
        assert r.status_code == 206 and r.content == b"" and r.headers["content-range"] == "bytes 2-5/300"
        for headers in ({"if-none-match": etag}, {"if-modified-since": lm}, {"if-none-match": "*"}):
            r = await client.get(u, headers=headers)
            assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == etag
        r = await client.get(u, headers={"if-none-match": '"x"', "if-modified-since": lm})
        assert r.status_code == 200  # If-None-Match decides when present
        r = await client.get(url("enc.json"))
        assert r.headers["content-encoding"] == "compress" and r.headers["content-type"] == "application/json"
        assert r.content == BLOBS["enc.json"][0]
        r = await client.get(url("empty"))
        assert r.status_code == 200 and r.content == b"" and r.headers["content-length"] == "0"
        assert r.headers["content-type"] == "application/octet-stream"
        assert (await client.get(url("edge.bin"))).content == BLOBS["edge.bin"][0]
    assert file_responses == []


async def test_inline_blobs_from_memory(tmp_path: Path, file_responses: list[str], monkeypatch):
    """Blobs kept as rows of small.db answer as files do: from memory, hot, and through a file written
    then for the Range forms only FileResponse decides (several ranges, 416, 400)."""
    calls: list[Any] = []
    run_sync = trio.to_thread.run_sync

    async def counted(fn: Any, *args: Any, **kw: Any) -> Any:
        calls.append(fn)
        return await run_sync(fn, *args, **kw)

    async with (
        served(tmp_path / "files") as (file_url, client),
        served(tmp_path / "rows", inline_bytes=SMALL_BLOB) as (url, _),
    ):
        for name in ("small.txt", "enc.json", "empty", "edge.bin"):
            data = BLOBS[name][0]
            u = url(name)
            r = await client.head(u)
            etag, lm = r.headers["etag"], r.headers["last-modified"]
            for method, headers in [
                ("GET", {}), ("HEAD", {}), ("GET", {"range": "bytes=2-5"}), ("GET", {"range": "bytes=-3"}),
                ("HEAD", {"range": "bytes=2-5"}), ("GET", {"range": "bytes=2-5", "if-range": etag}),
                ("GET", {"range": "bytes=2-5", "if-range": '"stale"'}), ("GET", {"if-none-match": etag}),
                ("GET", {"if-modified-since": lm}), ("GET", {"if-match": '"x"'}),
                # the forms FileResponse decides: from a file written for it (as for nginx)
                ("GET", {"range": "bytes=0-0,2-3"}), ("GET", {"range": f"bytes={len(data)}-"}),
                ("GET", {"range": "bytes=5-2"}),
            ]:  # fmt: skip
                mine = answer(await client.request(method, u, headers=headers))
                theirs = answer(await client.request(method, file_url(name), headers=headers))
                assert mine[0] == theirs[0] and mine[2] == theirs[2], (name, method, headers)
                # the same headers in the same order; Link (another server) and Last-Modified aside
                assert [(k, v if k not in ("link", "last-modified") else k) for k, v in mine[1]] == [
                    (k, v if k not in ("link", "last-modified") else k) for k, v in theirs[1]
                ], (name, method, headers)
        monkeypatch.setattr(trio.to_thread, "run_sync", counted)
        for _ in range(3):  # hot: answered without a thread call
            assert (await client.get(url("small.txt"))).content == BLOBS["small.txt"][0]
    assert calls == []
    # FileResponse where it decides (the same requests for both stores), never for the other forms
    rows = [f for f in file_responses if "/rows/" in f]
    assert 0 < len(rows) == len(file_responses) - len(rows)


async def test_big_blobs_and_odd_ranges_go_through_file_response(tmp_path: Path, file_responses: list[str]):
    async with served(tmp_path) as (url, client):
        for name in ("edge1.bin", "big.bin"):
            data = BLOBS[name][0]
            n = len(file_responses)
            r = await client.get(url(name))
            assert r.status_code == 200 and r.content == data and len(file_responses) == n + 1
            r = await client.get(url(name), headers={"range": "bytes=10-20"})
            assert r.status_code == 206 and r.content == data[10:21] and len(file_responses) == n + 2
            r = await client.head(url(name))  # no bytes needed: answered here
            assert r.headers["content-length"] == str(len(data)) and len(file_responses) == n + 2
        n = len(file_responses)
        data = BLOBS["small.txt"][0]
        r = await client.get(url("small.txt"), headers={"range": "bytes=0-1,5-6"})
        assert r.status_code == 206 and r.headers["content-type"].startswith("multipart/byteranges")
        assert b"Content-Range: bytes 5-6/300" in r.content and data[5:7] in r.content
        r = await client.get(url("small.txt"), headers={"range": "bytes=300-"})
        assert r.status_code == 416 and r.headers["content-range"] == "bytes */300"
        assert (await client.get(url("small.txt"), headers={"range": "bytes=5-2"})).status_code == 400
        assert len(file_responses) == n + 3


@pytest.mark.parametrize("name", ["small.txt", "enc.json", "empty", "edge.bin"])
async def test_memory_answers_equal_file_response_answers(tmp_path: Path, monkeypatch, name: str):
    """Every Range / If-Range / conditional combination, from memory and with FileResponse forced."""
    size = len(BLOBS[name][0])
    async with served(tmp_path) as (url, client):
        u = url(name)
        r = await client.head(u)
        etag, lm = r.headers["etag"], r.headers["last-modified"]
        ranges = [
            "bytes=0-0", "bytes=2-5", "bytes=-3", "bytes=-0", "bytes=15-", "bytes=0-", "bytes=5-2",
            "bytes=3-3", "bytes=abc", "bytes=-", "bytes=", "items=0-5", "Bytes=0-5", "bytes=0-5,",
            "bytes=0-1,3-4", "bytes=0-5,3-8", "bytes=2 - 5", "bytes=+3-5", "bytes=0_0-5", "bytes=00-05",
            "bytes=1000000000-", "bytes=0-1000000000", "bytes=-1000000000", f"bytes={size - 1}-",
            f"bytes={size}-", f"bytes=-{size}", f"bytes=0-{size - 1}", f"bytes=0-{size}",
            f"bytes={max(0, size - 70000)}-",
        ]  # fmt: skip
        cases: list[tuple[str, dict[str, str]]] = []
        for method in ("GET", "HEAD"):
            for rng in ranges:
                for if_range in (None, etag, lm, '"stale"', f"W/{etag}"):
                    cases.append((method, {"range": rng} | ({"if-range": if_range} if if_range else {})))
            for cond in ({"if-none-match": etag}, {"if-none-match": '"x"'}, {"if-modified-since": lm}):
                cases.append((method, cond))
                cases.append((method, cond | {"range": "bytes=2-5"}))
        fast = [answer(await client.request(m, u, headers=h)) for m, h in cases]
        monkeypatch.setattr(resources, "_file_span", lambda *args: None)
        slow = [answer(await client.request(m, u, headers=h)) for m, h in cases]
    for case, a, b in zip(cases, fast, slow, strict=True):
        assert a == b, case


async def test_missing_tombstone_never_held(tmp_path: Path):
    for local in (True, False):
        async with served(tmp_path / str(local), local=local) as (url, client):
            r = await client.get(url("missing.txt"))
            assert r.status_code == 500 and "missing from the store" in r.text
            assert (await client.head(url("missing.txt"))).status_code == 500
            etag = f'"{sha(BLOBS["missing.txt"][0])}"'
            assert (await client.get(url("missing.txt"), headers={"if-none-match": etag})).status_code == 304
            r = await client.get(url("gone.txt"))
            assert r.status_code == 410 and 'rel="resourcesync"' in r.headers["link"]
            r = await client.get(url("never.txt"))
            assert r.status_code == 404 and r.headers["link"].endswith('rel="resourcesync"')
            assert (await client.get(url("small.txt").replace("/up/", "/nope/"))).status_code == 404


async def test_non_local_store_is_streamed(tmp_path: Path, file_responses: list[str], monkeypatch):
    streamed: list[str] = []
    stream_blob = resources._stream_blob

    def counted(request: Any, r: Any, *args: Any) -> Any:
        streamed.append(r.uri)
        return stream_blob(request, r, *args)

    monkeypatch.setattr(resources, "_stream_blob", counted)
    async with served(tmp_path, local=False) as (url, client):
        for name in ("small.txt", "big.bin"):
            data = BLOBS[name][0]
            assert (await client.get(url(name))).content == data
            r = await client.get(url(name), headers={"range": "bytes=2-5"})
            assert r.status_code == 206 and r.content == data[2:6]
            r = await client.get(url(name), headers={"range": "bytes=0-1,5-6"})
            assert r.status_code == 200 and r.content == data  # several ranges: all of it
            r = await client.get(url(name), headers={"range": f"bytes={len(data)}-"})
            assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{len(data)}"
            assert 'rel="resourcesync"' in r.headers["link"]
    assert file_responses == [] and len(streamed) == 8


async def test_hot_gets_make_no_thread_call(tmp_path: Path, monkeypatch):
    """The first GET looks the resource up (one worker-thread call); later ones, whatever their Range or
    validators, are answered from the hot cache; a HEAD of a big blob needs one lookup, no read."""
    calls: list[Any] = []
    run_sync = trio.to_thread.run_sync

    async def counted(fn: Any, *args: Any, **kw: Any) -> Any:
        calls.append(fn)
        return await run_sync(fn, *args, **kw)

    async with served(tmp_path) as (url, client):
        assert (await client.get(url("small.txt"))).status_code == 200  # opens the pool's connection
        monkeypatch.setattr(trio.to_thread, "run_sync", counted)
        for headers in ({}, {"range": "bytes=2-5"}, {"if-none-match": '"x"'}):
            r = await client.get(url("small.txt"), headers=headers)
            assert r.status_code in (200, 206)
        assert (await client.head(url("big.bin"))).status_code == 200
    assert len(calls) == 1


async def test_concurrent_gets_stay_within_the_idle_pool(tmp_path: Path, monkeypatch):
    """More requests in flight than the pool keeps idle must not open a connection per request."""
    opened: list[Path] = []

    import aggregator.store.open as state_module

    connect = state_module.connect  # the composition opens every state connection through it (run/parts.py)

    def counted(path: Path, **kw: Any) -> Any:
        opened.append(Path(path))
        return connect(path, **kw)

    monkeypatch.setattr(state_module, "connect", counted)
    names = ["small.txt", "enc.json", "empty", "edge.bin"] * 16
    got: dict[int, bytes] = {}
    async with served(tmp_path) as (url, client):

        async def get(i: int, name: str) -> None:
            got[i] = (await client.get(url(name))).content

        async with trio.open_nursery() as nursery:
            for i, name in enumerate(names):
                nursery.start_soon(get, i, name)
    assert [got[i] for i in range(len(names))] == [BLOBS[n][0] for n in names]
    assert 1 <= len(opened) <= POOL_IDLE + 2  # + the schema check, + the hot route's version watcher
