"""The server's fast lane (``serverguard._FastLane`` + ``ResourceFastPath.lane``): plain resource GETs and
HEADs answered without hypercorn's and starlette's layers, exactly as the ordinary path answers them;
everything else on the connection handed to hypercorn with the bytes read so far."""

from __future__ import annotations

import re
from pathlib import Path

import trio

from aggregator.publish.fastpath import ResourceFastPath
from aggregator.publish.uris import rsagg_uri

from .test_resource_get import BLOBS, UP, served

DATE = re.compile(rb"\r\ndate: [^\r]+")


async def exchange(stream: trio.SocketStream, data: bytes) -> list[bytes]:
    """Send ``data`` (one request or several pipelined) and read one whole response per request."""
    await stream.send_all(data)
    methods = [line.split(b" ")[0] for line in data.split(b"\r\n\r\n")[:-1]]
    buf, out = b"", []
    with trio.fail_after(30):
        while len(out) < len(methods):
            head_end = buf.find(b"\r\n\r\n")
            if head_end >= 0:
                m = re.search(rb"\r\ncontent-length: (\d+)", buf[:head_end], re.IGNORECASE)
                length = 0 if m is None or methods[len(out)] == b"HEAD" else int(m.group(1))
                end = head_end + 4 + length
                if len(buf) >= end:
                    out.append(buf[:end])
                    buf = buf[end:]
                    continue
            chunk = await stream.receive_some(65536)
            assert chunk, "connection closed early"
            buf += chunk
    return out


def request(method: str, path: str, *extra: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def same_but_date(a: bytes, b: bytes) -> bool:
    return DATE.sub(b"", a) == DATE.sub(b"", b)


async def test_lane_answers_as_the_ordinary_path(tmp_path: Path, monkeypatch):
    asgi: list[str] = []  # resource requests that reached the ASGI app
    real = ResourceFastPath.__call__

    async def counted(self, scope, receive, send):
        if scope["type"] == "http" and "/r/" in scope["path"]:
            asgi.append(scope["method"])
        await real(self, scope, receive, send)

    monkeypatch.setattr(ResourceFastPath, "__call__", counted)
    async with served(tmp_path) as (url, client):
        base = url("x").split("/up/r/")[0]
        host, port = base.split("//")[1].split(":")
        path = {n: rsagg_uri("", "up", UP + n) for n in ("small.txt", "enc.json", "empty", "gone.txt")}
        path["never"] = rsagg_uri("", "up", UP + "never-held")
        lane = await trio.open_tcp_stream(host, int(port))
        ordinary = await trio.open_tcp_stream(host, int(port))
        try:

            async def resource_requests() -> float:
                text = (await client.get(base + "/metrics")).text
                return sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("rsagg_http_requests_total{") and "/r/{rest:path}" in line
                )

            before = await resource_requests()
            for name, p in path.items():
                for method in ("GET", "HEAD"):
                    [fast] = await exchange(lane, request(method, p))
                    assert asgi == [], "answered by the lane, not the app"
                    # "Connection: close" is hypercorn's: the ordinary path, same answer
                    slow_conn = await trio.open_tcp_stream(host, int(port))
                    [slow] = await exchange(slow_conn, request(method, p, "Connection: close"))
                    await slow_conn.aclose()
                    assert asgi == [method]
                    asgi.clear()
                    slow = re.sub(rb"\r\nconnection: close", b"", slow, flags=re.IGNORECASE)
                    assert same_but_date(fast, slow), (name, method)
                    assert b"server: hypercorn-h11" in fast
                    if method == "GET" and name in BLOBS and name != "gone.txt":
                        assert fast.endswith(b"\r\n\r\n" + BLOBS[name][0])
            assert await resource_requests() == before + 4 * len(path)  # each path: 2 fast, 2 ordinary

            # pipelined, then a document (hypercorn's from there on), then a resource again, one connection
            small = path["small.txt"]
            two = await exchange(lane, request("GET", small) + request("HEAD", small))
            assert two[0].startswith(b"HTTP/1.1 200 ") and two[0].endswith(BLOBS["small.txt"][0])
            assert two[1].startswith(b"HTTP/1.1 200 ") and b"content-length: 300" in two[1]
            [doc] = await exchange(lane, request("GET", "/robots.txt"))
            assert doc.startswith(b"HTTP/1.1 200 ") and b"Sitemap:" in doc
            [again] = await exchange(lane, request("GET", small))
            assert again.endswith(BLOBS["small.txt"][0])
            # validators are the ordinary path's (304), on a fresh connection
            [etag] = re.findall(rb"etag: ([^\r]+)", two[0])
            [cond] = await exchange(ordinary, request("GET", small, f"If-None-Match: {etag.decode()}"))
            assert cond.startswith(b"HTTP/1.1 304 ")
            # a malformed head is hypercorn's to refuse
            bad = await trio.open_tcp_stream(host, int(port))
            [refused] = await exchange(bad, b"GET " + small.encode() + b" HTTP/1.1\r\nno colon here\r\n\r\n")
            assert refused.startswith(b"HTTP/1.1 400 ")
            await bad.aclose()
            # so is a head over the size bound, even when it arrives whole
            big = await trio.open_tcp_stream(host, int(port))
            [over] = await exchange(big, request("GET", small, "X-Big: " + "a" * 20_000))
            assert over.startswith(b"HTTP/1.1 431 ")
            await big.aclose()

            metrics = (await client.get(base + "/metrics")).text
            served_lines = [ln for ln in metrics.splitlines() if ln.startswith("rsagg_http_requests_total{")]
            assert any('route="/{set}/r/{rest:path}"' in ln and 'code="200"' in ln for ln in served_lines)
            assert any('route="/{set}/r/{rest:path}"' in ln and 'code="410"' in ln for ln in served_lines)
        finally:
            await lane.aclose()
            await ordinary.aclose()


#: Header lines and whether each leaves a head plain (None: only counts as a Host).
_LINES = [
    (b"Host: test", None),
    (b"User-Agent: rsagg", True),
    (b"Connection: keep-alive", True),
    (b"Connection: close", False),
    (b"Range: bytes=0-1", False),
    (b'If-None-Match: "x"', False),
    (b"Content-Length: 0", False),
    (b"X-Bad\x01: y", False),
    (b"X-Latin: \xe9", False),
    (b" folded", False),
    (b"Name : spaced", False),
    (b"no-colon", False),
]


def test_plain_request_verdicts_are_the_same_from_its_memory() -> None:
    """Every combination of up to three header lines: the verdict of ``_plain_request`` (one Host, no
    line the lane hands over or that is not plain) is the same computed afresh and remembered."""
    import itertools

    from aggregator.run import serverguard

    serverguard._PLAIN_FIELDS.clear()
    heads = []
    for n in range(4):
        for combo in itertools.product(_LINES, repeat=n):
            hosts = sum(1 for _, ok in combo if ok is None)
            plain = hosts == 1 and all(ok is not False for _, ok in combo)
            head = b"\r\n".join([b"GET /s/r/x HTTP/1.1", *(line for line, _ in combo)])
            heads.append((head, plain))
    for _ in range(2):  # the first pass computes (and remembers), the second finds it remembered
        for head, plain in heads:
            got = serverguard._plain_request(head)
            assert (got == (b"GET", b"/s/r/x")) if plain else got is None, head
    assert len(serverguard._PLAIN_FIELDS) <= serverguard._REMEMBERED_FIELDS
