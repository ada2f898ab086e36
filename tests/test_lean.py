"""The lean path (aggregator/net/lean.py) gives the outcome the httpx path gives, case for case: resources
and Capability documents.

One raw loopback server answers scripted bytes (so the framing is exactly what a case says: Content-Length,
chunked, close-delimited, truncated, garbage); the same Fetcher settings fetch every case once with the lean
path and once with it switched off (``_lean = None``: the httpx path), and the outcomes must be equal.
"""

from __future__ import annotations

import gzip
import hashlib
import math
import random
import shutil
import ssl
import string
import subprocess
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from aggregator.harvest.fetch import Expected, Fetcher, FetchError, ResourceNotModified
from aggregator.net import lean, outbound
from aggregator.store.blobs import FileBlobStore

# -- a scripted HTTP/1.1 server ------------------------------------------------------------------------


class Script:
    """path -> raw response bytes, and whether the server closes the connection after it."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[bytes, bool]] = {}
        self.connections = 0
        self.requests: list[tuple[str, dict[str, str]]] = []
        #: path -> seconds the server waits before it answers (math.inf: it never does)
        self.delays: dict[str, float] = {}
        #: path -> the answers that replace its answer, one after each request of it
        self.then: dict[str, list[tuple[bytes, bool]]] = {}

    def add(self, path: str, raw: bytes, *, close: bool = False) -> str:
        self.answers[path] = (raw, close)
        return path


async def _serve_one(tcp: trio.SocketStream, script: Script, tls: ssl.SSLContext | None = None) -> None:
    script.connections += 1
    stream: trio.abc.Stream = tcp if tls is None else trio.SSLStream(tcp, tls, server_side=True)
    buf = b""
    try:
        while True:
            while b"\r\n\r\n" not in buf:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1]
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
            }
            script.requests.append((path, headers))
            raw, close = script.answers.get(
                path, (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", False)
            )
            if script.then.get(path):
                script.answers[path] = script.then[path].pop(0)
            delay = script.delays.get(path, 0.0)
            if delay == math.inf:
                await trio.sleep_forever()
            elif delay:
                await trio.sleep(delay)
            await stream.send_all(raw)
            if close:
                return
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return
    finally:
        await stream.aclose()


@asynccontextmanager
async def scripted(script: Script, tls: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, lambda s: _serve_one(s, script, tls), 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        try:
            yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        finally:
            nursery.cancel_scope.cancel()


def response(
    status: int,
    body: bytes = b"",
    *,
    framing: str = "length",
    headers: dict[str, str] | None = None,
    reason: str = "X",
    truncate: int = 0,
) -> bytes:
    """A raw HTTP/1.1 response: ``framing`` "length", "chunked" or "close" (no length: ends at close)."""
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if framing == "length":
        lines.append(f"Content-Length: {len(body)}")
        payload = body
    elif framing == "chunked":
        lines.append("Transfer-Encoding: chunked")
        payload = b"".join(
            b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7]) for i in range(0, len(body), 7)
        )
        payload += b"0\r\n\r\n"
    else:
        lines.append("Connection: close")
        payload = body
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload
    return raw[: len(raw) - truncate] if truncate else raw


# -- outcomes --------------------------------------------------------------------------------------------


async def outcome(f: Fetcher, store: FileBlobStore, url: str, expected: Expected, **kw: Any) -> tuple:
    """What a caller of ``Fetcher.resource`` can see, in a comparable form."""
    try:
        got = await f.resource([url], expected, store, **kw)
    except ResourceNotModified as exc:
        return ("not modified", exc.url)
    except FetchError as exc:
        # The message too where it is rsagg's own words (a status, a size, a hash), not the client's.
        words = str(exc) if exc.kind in ("http", "fixity", "size") else ""
        return ("error", exc.kind, exc.status, exc.transient, exc.retry_after, exc.url, words)
    try:  # the bytes as stored are named by their hash and length
        return ("ok", got.url, got.info.sha256, got.info.length, got.content_type, got.encoding, got.etag,
                got.last_modified)  # fmt: skip
    finally:
        got.blob.abort()


def fetcher(**kw: Any) -> Fetcher:
    f = Fetcher(retries=kw.pop("retries", 0), backoff_base=0.001, backoff_max=0.01, timeout=5, **kw)

    async def no_sleep(seconds: float) -> None:
        await trio.lowlevel.checkpoint()

    f._sleep = no_sleep  # type: ignore[method-assign]
    return f


async def both(url: str, expected: Expected, tmp: Path, **kw: Any) -> tuple[tuple, tuple, Fetcher]:
    """The outcome on the lean path and on the httpx path (same settings)."""
    fetch_kw = {k: kw.pop(k) for k in ("max_resource_bytes", "policy", "retries") if k in kw}
    store = FileBlobStore(tmp)
    async with fetcher(**fetch_kw) as lean_f, fetcher(**fetch_kw) as httpx_f:
        assert lean_f._lean is not None
        httpx_f._lean = None
        a = await outcome(lean_f, store, url, expected, **kw)
        b = await outcome(httpx_f, store, url, expected, **kw)
    return a, b, lean_f


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


# -- the table -------------------------------------------------------------------------------------------

BODY = b"resource body, some bytes " * 20


def _cases() -> list[tuple[str, bytes, bool, dict]]:
    """(name, raw response, server closes after it, fetch kwargs): fixed cases, then generated ones."""
    ok = {"expected": Expected({"md5": md5(BODY)}, len(BODY))}
    cases: list[tuple[str, bytes, bool, dict]] = []
    for framing in ("length", "chunked", "close"):
        for close in (False, True):
            hdrs = {
                "Content-Type": "text/plain",
                "ETag": '"v1"',
                "Last-Modified": "Sat, 01 Jan 2000 00:00:00 GMT",
            }
            cases.append((f"200 {framing} close={close}", response(200, BODY, framing=framing, headers=hdrs),
                          close or framing == "close", ok))  # fmt: skip
    cases += [
        ("coded body kept as served",
         response(200, b"\x1f\x8bnotreally", headers={"Content-Encoding": "gzip"}),
         False, {"expected": Expected({})}),
        ("304 on a conditional GET", response(304, headers={"ETag": '"v1"'}), False,
         {"expected": Expected({}), "etag": '"v1"'}),
        ("404", response(404, b"gone"), False, ok),
        ("404 without a reason phrase", response(404, b"gone", reason=""), False, ok),
        ("410", response(410), False, ok),
        ("429 Retry-After", response(429, headers={"Retry-After": "0"}), False, ok),
        ("503 Retry-After", response(503, b"busy", headers={"Retry-After": "0"}), False, ok),
        ("500", response(500), True, ok),
        ("wrong hash", response(200, BODY[:-1] + b"!"), False, ok),
        ("wrong length", response(200, BODY + b"more"), False, ok),
        ("truncated Content-Length body", response(200, BODY, truncate=10), True, ok),
        ("truncated chunked body", response(200, BODY, framing="chunked", truncate=9), True, ok),
        ("oversize by Content-Length", response(200, BODY), False,
         {"expected": Expected({}), "max_resource_bytes": 100}),
        ("oversize chunked", response(200, BODY, framing="chunked"), False,
         {"expected": Expected({}), "max_resource_bytes": 100}),
        ("oversize close-delimited", response(200, BODY, framing="close"), True,
         {"expected": Expected({}), "max_resource_bytes": 100}),
        ("1xx before the answer",
         b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + response(200, BODY), False, ok),
        ("garbage", b"this is not http\r\n\r\n", True, ok),
        ("nothing", b"", True, ok),
        ("repeated header", response(200, BODY, headers={"Content-Type": "text/plain", "ETag": '"a"'})
         .replace(b"ETag", b"X-A: 1\r\nX-A: 2\r\nETag"), False, ok),
    ]  # fmt: skip
    rng = random.Random(28)  # generated: statuses x framings x connection handling x body sizes
    for i in range(24):
        status = rng.choice([200, 200, 200, 203, 404, 429, 500, 503])
        framing = rng.choice(["length", "chunked", "close"])
        body = rng.randbytes(rng.choice([0, 1, 7, 100, 5000, 70000]))
        hdrs = {"Retry-After": str(rng.choice([0, 1]))} if status in (429, 503) else {}
        close = framing == "close" or rng.random() < 0.3
        truncate = rng.choice([0, 0, 0, 3]) if body else 0
        exp = Expected({"md5": md5(body)} if rng.random() < 0.8 else {"md5": md5(b"other")}, None)
        cases.append((f"generated {i}: {status} {framing} {len(body)}B close={close} cut={truncate}",
                      response(status, body, framing=framing, headers=hdrs, truncate=truncate),
                      close or truncate > 0, {"expected": exp}))  # fmt: skip
    return cases


CASES = _cases()


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
async def test_lean_and_httpx_paths_agree(case: int, tmp_path: Path) -> None:
    name, raw, close, kw = CASES[case]
    kw = dict(kw)
    expected = kw.pop("expected")
    script = Script()
    async with scripted(script) as base:
        path = script.add("/r", raw, close=close)
        a, b, lean_f = await both(base + path, expected, tmp_path, **kw)
    assert a == b, name
    assert lean_f._lean is not None and lean_f._lean.connections_opened >= 1  # the lean path ran


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_redirects_agree_and_stay_lean(status: int, tmp_path: Path) -> None:
    script = Script()
    async with scripted(script) as base:
        script.add("/a", response(status, headers={"Location": "/b"}))
        script.add("/b", response(200, BODY, headers={"Location": "/c"}))
        a, b, lean_f = await both(f"{base}/a", Expected({"md5": md5(BODY)}), tmp_path)
    assert a == b and a[0] == "ok" and a[1] == f"{base}/b"
    assert lean_f._lean is not None and lean_f._lean.connections_opened == 1  # both hops, one connection


async def test_a_redirect_the_lean_path_cannot_send_goes_to_httpx(tmp_path: Path) -> None:
    """A Location httpx would rewrite (a space, an upper-case host): that hop takes httpx, same outcome."""
    script = Script()
    async with scripted(script) as base:
        port = base.rsplit(":", 1)[1]
        script.add("/a", response(302, headers={"Location": f"http://LOCALHOST:{port}/b c"}))
        script.add("/b%20c", response(200, BODY))
        a, b, _ = await both(f"{base}/a", Expected({"md5": md5(BODY)}), tmp_path)
    assert a == b and a[0] == "ok" and a[1] == f"http://localhost:{port}/b%20c"


async def test_redirect_loops_agree(tmp_path: Path) -> None:
    script = Script()
    async with scripted(script) as base:
        script.add("/loop", response(302, headers={"Location": "/loop"}))
        a, b, _ = await both(f"{base}/loop", Expected({}), tmp_path)
    assert a == b and a[:2] == ("error", "http")


async def test_retries_agree(tmp_path: Path) -> None:
    """A 503 then a 200 (the server answers by request count): both paths retry once and succeed."""
    outcomes = []
    for use_lean in (True, False):
        script = Script()
        async with scripted(script) as base:
            script.add("/r", response(503, headers={"Retry-After": "0"}), close=True)
            script.then["/r"] = [(response(200, BODY), False)]  # the second request's answer
            store = FileBlobStore(tmp_path / str(use_lean))
            async with fetcher(retries=2) as f:
                if not use_lean:
                    f._lean = None
                outcomes.append(await outcome(f, store, f"{base}/r", Expected({"md5": md5(BODY)})))
        assert len(script.requests) == 2
    assert outcomes[0][2:] == outcomes[1][2:] and outcomes[0][0] == "ok", outcomes  # two servers: two URLs


async def test_refused_addresses_agree(tmp_path: Path) -> None:
    """Loopback is refused by default: both paths refuse, before any byte is sent, counted once each."""
    script = Script()
    refused: list[str] = []
    policy = outbound.AddressPolicy(on_refused=refused.append)
    async with scripted(script) as base:
        script.add("/r", response(200, BODY))
        a, b, _ = await both(f"{base}/r", Expected({}), tmp_path, policy=policy, retries=2)
    assert a == b and a[:4] == ("error", "refused", None, False)
    assert refused == ["loopback", "loopback"] and script.requests == []


async def test_own_urls_refused_on_both_paths(tmp_path: Path) -> None:
    script = Script()
    async with scripted(script) as base:
        policy = outbound.AddressPolicy(allow=outbound.LOOPBACK, own_urls=(base + "/own",))
        script.add("/own/metrics", response(200, BODY))
        a, b, _ = await both(f"{base}/own/metrics", Expected({}), tmp_path, policy=policy)
    assert a == b and a[1] == "refused" and script.requests == []


async def test_a_pinned_connection_serves_its_requester_only(tmp_path: Path) -> None:
    """An origin pinned for source "a": a's request connects; b's is refused although a's keep-alive
    connection to the same origin is idle in the pool (pooled apart, checked on connecting)."""
    script = Script()
    store = FileBlobStore(tmp_path)
    async with scripted(script) as base:
        script.add("/r", response(200, BODY))
        origin = outbound.origin(base)
        assert origin is not None
        policy = outbound.AddressPolicy(pins={origin: {"a": outbound.LOOPBACK}})
        async with fetcher(policy=policy) as f:
            with outbound.acting_for("a"):
                assert (await outcome(f, store, f"{base}/r", Expected({})))[0] == "ok"
            with outbound.acting_for("b"):
                got = await outcome(f, store, f"{base}/r", Expected({}))
            with outbound.acting_for("a"):
                assert (await outcome(f, store, f"{base}/r", Expected({})))[0] == "ok"
    assert got[:2] == ("error", "refused")
    assert script.connections == 1 and len(script.requests) == 2  # a's connection was reused by a only


async def test_keep_alive_reuse_and_a_server_closing_idle_connections(tmp_path: Path) -> None:
    """Sequential GETs reuse one connection; when the server closes it while idle, the next GET opens a new
    one (no error)."""
    script = Script()
    store = FileBlobStore(tmp_path)
    async with scripted(script) as base, fetcher() as f:
        script.add("/k", response(200, BODY))
        script.add("/c", response(200, BODY), close=True)
        for _ in range(3):
            assert (await outcome(f, store, f"{base}/k", Expected({})))[0] == "ok"
        assert script.connections == 1
        assert (await outcome(f, store, f"{base}/c", Expected({})))[0] == "ok"  # Connection closed after it
        for _ in range(2):
            assert (await outcome(f, store, f"{base}/k", Expected({})))[0] == "ok"
        assert script.connections == 2
        assert f._lean is not None and f._lean.connections_opened == 2


@pytest.mark.parametrize("reused", [False, True], ids=["new connection", "reused connection"])
async def test_a_read_waiting_past_the_timeout_fails_alike_on_both_paths(
    reused: bool, tmp_path: Path
) -> None:
    """A server that takes the request and never answers: both paths fail the GET as a timeout
    (transient), never before the timeout has passed; on the lean path a stalled reused connection is
    not taken for a stale one (no second request on a new connection)."""
    timeout = 0.5
    outcomes = []
    for use_lean in (True, False):
        script = Script()
        script.add("/ok", response(200, BODY))
        script.add("/stall", response(200, BODY))
        script.delays["/stall"] = math.inf
        store = FileBlobStore(tmp_path / str(use_lean))
        async with scripted(script) as base, Fetcher(retries=0, timeout=timeout) as f:
            if not use_lean:
                f._lean = None
            if reused:
                assert (await outcome(f, store, f"{base}/ok", Expected({})))[0] == "ok"
            start = trio.current_time()
            with trio.fail_after(30):  # a timeout that never fires fails here, not by hanging
                outcomes.append(await outcome(f, store, f"{base}/stall", Expected({})))
            assert trio.current_time() - start >= timeout
        assert [p for p, _ in script.requests] == ["/ok", "/stall"][1 - reused :]
        assert script.connections == 1
    assert outcomes[0][:5] == outcomes[1][:5] == ("error", "timeout", None, True, None), outcomes


@pytest.mark.slow  # about 2 s: waits out its read timeouts
async def test_reads_at_once_time_out_each_on_its_own(tmp_path: Path) -> None:
    """Generated: GETs at once on one pool, each answered at once, a little later or never. Those never
    answered fail as timeouts; every other one succeeds, its connection untouched by the others'."""
    rng = random.Random(7)
    timeout = 2.0
    script = Script()
    kinds: dict[str, str] = {}
    for i in range(24):
        path = script.add(f"/r{i}", response(200, BODY))
        kinds[path] = rng.choice(["now", "later", "never"])
        script.delays[path] = {"now": 0.0, "later": rng.uniform(0.01, 0.1), "never": math.inf}[kinds[path]]
    results: dict[str, tuple] = {}
    store = FileBlobStore(tmp_path)
    async with scripted(script) as base, Fetcher(retries=0, timeout=timeout, per_host=len(kinds)) as f:

        async def one(path: str) -> None:
            results[path] = await outcome(f, store, base + path, Expected({"md5": md5(BODY)}))

        with trio.fail_after(60):  # timeouts that never fire fail here, not by hanging
            async with trio.open_nursery() as nursery:
                for path in kinds:
                    nursery.start_soon(one, path)
    assert {p: r[:2] if r[0] == "error" else r[:1] for p, r in results.items()} == {
        p: ("error", "timeout") if k == "never" else ("ok",) for p, k in kinds.items()
    }
    assert "never" in kinds.values() and "later" in kinds.values()


async def test_request_hook_sees_every_hop_on_the_lean_path(tmp_path: Path) -> None:
    """Credentials and User-Agent come from the request hook, per hop, like on the httpx path."""
    seen: list[tuple[str, str | None]] = []

    async def hook(request: Any) -> None:
        seen.append((str(request.url), request.headers.get("x-token")))
        request.headers["X-Token"] = "secret" if request.url.port is not None else "none"
        request.headers["User-Agent"] = "ua-test"

    script = Script()
    store = FileBlobStore(tmp_path)
    async with scripted(script) as base, fetcher(request_hook=hook) as f:
        script.add("/a", response(302, headers={"Location": "/b"}))
        script.add("/b", response(200, BODY))
        assert (await outcome(f, store, f"{base}/a", Expected({})))[0] == "ok"
        assert f._lean is not None and f._lean.connections_opened == 1
    # The redirect hop keeps the headers but Host, Authorization and Cookie (``_redirect``), as on httpx.
    assert seen == [(f"{base}/a", None), (f"{base}/b", "secret")]
    assert [h["x-token"] for _, h in script.requests] == ["secret", "secret"]
    assert {h["user-agent"] for _, h in script.requests} == {"ua-test"}
    assert all(h["accept-encoding"] == "identity" for _, h in script.requests)


def _self_signed(tmp: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (openssl on the command line)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = str(tmp / "cert.pem"), str(tmp / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", key, "-out", cert],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_https_verified_like_httpx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """https on the lean path: refused like httpx when the certificate is not trusted (the default context:
    certifi's bundle), fetched like httpx over the same context when it is; one connection reused."""
    cert, key = _self_signed(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    script = Script()
    async with scripted(script, tls=server_tls) as base:
        script.add("/r", response(200, BODY))
        a, b, _ = await both(f"{base}/r", Expected({}), tmp_path)
        assert a == b and a[:2] == ("error", "network") and script.requests == []
        trusting = ssl.create_default_context(cafile=cert)
        monkeypatch.setattr(httpx, "create_ssl_context", lambda *args, **kw: trusting)
        a, b, lean_f = await both(f"{base}/r", Expected({"md5": md5(BODY)}), tmp_path)
        assert a == b and a[0] == "ok"
        assert lean_f._lean is not None and lean_f._lean.connections_opened == 1
        store = FileBlobStore(tmp_path / "again")
        async with fetcher() as f:
            for _ in range(3):
                assert (await outcome(f, store, f"{base}/r", Expected({})))[0] == "ok"
            assert f._lean is not None and f._lean.connections_opened == 1


async def test_a_header_that_would_split_the_request_is_refused_on_both_paths(tmp_path: Path) -> None:
    """A request hook's value with a line break: no request is sent on either path, the same error."""

    async def hook(request: Any) -> None:
        request.headers["X-Bad"] = "a\r\nInjected: yes"

    script = Script()
    outcomes = []
    async with scripted(script) as base:
        script.add("/r", response(200, BODY))
        store = FileBlobStore(tmp_path)
        for use_lean in (True, False):
            async with fetcher(request_hook=hook) as f:
                if not use_lean:
                    f._lean = None
                outcomes.append(await outcome(f, store, f"{base}/r", Expected({})))
    assert outcomes[0] == outcomes[1] and outcomes[0][:4] == ("error", "network", None, False), outcomes
    assert script.requests == []


# -- URLs: the lean path sends exactly what httpx would ---------------------------------------------------

_ALPHABET = string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@/%?#[] \"<>`{}|\\^ä"


def test_parse_url_agrees_with_httpx_on_generated_urls() -> None:
    """Whatever ``parse_url`` accepts, httpx leaves unchanged: the same URL text, request target, host and
    port (so the Host header, the final URL and the metrics are the same on both paths)."""
    rng = random.Random(1)
    accepted = 0
    for _ in range(4000):
        host = rng.choice(
            ["example.org", "a-b.example", "127.0.0.1", "EXAMPLE.org", "x..y", "-x.org", "h_st"]
        )
        port = rng.choice(["", ":8080", ":80", ":443", ":0", ":99999", ":08"])
        scheme = rng.choice(["http", "https", "HTTP"])
        chars = _ALPHABET if rng.random() < 0.5 else string.ascii_lowercase + "/-._~%?=&"
        path = "/" * (rng.random() < 0.9) + "".join(rng.choice(chars) for _ in range(rng.randrange(0, 16)))
        if rng.random() < 0.2:
            path = rng.choice(["/a/./b", "/a/../b", "/.", "/..", "/a/.b", "/%2e", "/%zz", "/%41"]) + path
        text = f"{scheme}://{host}{port}{path}"
        got = lean.parse_url(text)
        if got is None:
            continue
        accepted += 1
        ref = httpx.URL(text)
        assert str(ref) == text, text
        assert ref.raw_path.decode("ascii") == got.target, text
        assert (ref.scheme, ref.host, ref.port) == (got.scheme, got.host, got.port), text
    assert accepted > 200  # the generator reaches the accepted subset, not only the rejects
    for text in (
        "http://example.org/a/b?x=1&y=%20",
        "https://example.org:8443/x",
        "http://127.0.0.1:3/res/1.txt",
    ):
        assert lean.parse_url(text) is not None, text


def test_response_headers_read_like_httpx() -> None:
    fields = [(b"content-type", b"text/plain"), (b"x-a", b"1"), (b"x-a", b"2"), (b"etag", b'"\xe9"')]
    ours, theirs = lean.Headers(fields), httpx.Headers(fields)
    for name in ("Content-Type", "x-a", "X-A", "etag", "missing"):
        assert ours.get(name) == theirs.get(name), name
        assert (name in ours) == (name in theirs), name


def test_the_lean_path_is_off_where_httpx_must_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """Proxies in the environment (the client routes through them) or a transport given (a test double
    answers for the network): every request takes httpx."""
    assert Fetcher()._lean is not None
    assert Fetcher(transport=httpx.MockTransport(lambda r: httpx.Response(200)))._lean is None
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    assert Fetcher()._lean is None


def test_own_origin_is_true_wherever_own_url_is() -> None:
    """The lean path asks ``own_url`` only where ``own_origin`` says an own URL may be: on generated
    URLs and bases, every URL ``own_url`` refuses has ``own_origin`` true (no own URL slips past). One
    policy throughout, its ``own_urls`` assigned anew now and then as a reload does: its remembered
    answers are always those of a fresh policy."""
    rng = random.Random(2)
    hosts = ["agg.example", "other.example", "127.0.0.1", "AGG.example"]
    hits = 0
    policy = outbound.AddressPolicy()
    for _ in range(3000):
        base = f"{rng.choice(['http', 'https'])}://{rng.choice(hosts)}{rng.choice(['', ':8080', ':443'])}"
        base += rng.choice(["", "/", "/rs", "/rs/"])
        if rng.random() < 0.3 or not policy.own_urls:
            policy.own_urls = (base,)  # what update_policy does on a reload
        fresh = outbound.AddressPolicy(own_urls=policy.own_urls)
        text = f"{rng.choice(['http', 'https'])}://{rng.choice(hosts).lower()}"
        text += rng.choice(["", ":8080", ":80"]) + rng.choice(["/", "/rs", "/rs/x", "/rsx", "/a"])
        url = lean.parse_url(text)
        if url is None:
            continue
        assert policy.own_origin(url.host, url.effective_port) == fresh.own_origin(
            url.host, url.effective_port
        )
        if policy.own_url(text):
            hits += 1
            assert policy.own_origin(url.host, url.effective_port), (base, text)
    assert hits > 100
    assert not outbound.AddressPolicy().own_origin("agg.example", 80)


def test_the_request_head_is_what_h11_writes() -> None:
    """``LeanPool._head`` writes the fields h11 validated once and the target per request: byte for
    byte what h11 writes for the whole request, for generated targets and header sets."""
    import h11

    rng = random.Random(3)
    pool = lean.LeanPool(None, timeout=5)
    for _ in range(300):
        url = lean.parse_url(f"http://example.org{rng.choice(['', ':8080'])}/{rng.randrange(10**6)}?q=1")
        assert url is not None
        fields = {"User-Agent": "rsagg", "Accept": "*/*"}
        if rng.random() < 0.5:
            fields["If-None-Match"] = f'"{rng.randrange(100)}"'
        head = pool._head(lean.Request(url, httpx.Headers(fields)))
        raw = [(b"Host", url.authority.encode())] + [(k.encode(), v.encode()) for k, v in fields.items()]
        ref = h11.Connection(h11.CLIENT).send(h11.Request(method="GET", target=url.target, headers=raw))
        assert head == ref, url


# -- documents: the same table for Capability documents ---------------------------------------------------

RL_HEAD = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" '
    b'xmlns:rs="http://www.openarchives.org/rs/terms/">\n'
    b'<rs:md capability="resourcelist" at="2024-01-01T00:00:00Z"/>\n'
)


def resource_list_doc(n: int) -> bytes:
    entries = b"".join(b"<url><loc>http://example.com/r%d</loc></url>\n" % i for i in range(n))
    return RL_HEAD + entries + b"</urlset>\n"


def _coded(body: bytes, coding: str) -> tuple[bytes, dict[str, str]]:
    """``body`` as served with ``coding``: a Content-Encoding, or a gzip file served as such."""
    if coding == "gzip":
        return gzip.compress(body, mtime=0), {"Content-Encoding": "gzip"}
    if coding == "deflate":
        return zlib.compress(body), {"Content-Encoding": "deflate"}
    if coding == "gzip file":  # sitemap.xml.gz: no coding, the bytes are a gzip file (sniffed)
        return gzip.compress(body, mtime=0), {"Content-Type": "application/gzip"}
    if coding == "bogus":
        return body, {"Content-Encoding": "br-unknown"}
    return body, {"Content-Type": "application/xml"}


def _document_cases() -> list[tuple[str, bytes, bool, dict[str, str]]]:
    """(name, raw response, server closes after it, request validators): generated answers to a document
    GET -- statuses x framings x content codings x sizes x cuts -- and a few fixed ones."""
    cases: list[tuple[str, bytes, bool, dict[str, str]]] = [
        ("304 to a conditional GET", response(304, headers={"ETag": '"v1"'}), False, {"etag": '"v1"'}),
        ("not XML", response(200, b"<html>no</html>"), False, {}),
        ("truncated gzip", response(200, gzip.compress(resource_list_doc(50))[:-20],
                                    headers={"Content-Encoding": "gzip"}), False, {}),
        ("links and validators", response(200, resource_list_doc(2), headers={
            "Link": '<http://x/cl.xml>; rel="up"', "ETag": '"e"',
            "Last-Modified": "Sat, 01 Jan 2000 00:00:00 GMT", "Content-Type": "application/xml"}), False, {}),
    ]  # fmt: skip
    rng = random.Random(2017)
    for i in range(30):
        status = rng.choice([200, 200, 200, 200, 404, 410, 429, 500, 503])
        framing = rng.choice(["length", "chunked", "close"])
        coding = rng.choice(["identity", "identity", "gzip", "deflate", "gzip file", "bogus"])
        body, hdrs = _coded(resource_list_doc(rng.choice([0, 1, 3, 40, 400])), coding)
        if status != 200:
            body = b"no"
        if status in (429, 503):
            hdrs["Retry-After"] = "0"
        close = framing == "close" or rng.random() < 0.3
        truncate = rng.choice([0, 0, 0, 5]) if status == 200 else 0
        cases.append((f"generated {i}: {status} {framing} {coding} {len(body)}B close={close} cut={truncate}",
                      response(status, body, framing=framing, headers=hdrs, truncate=truncate),
                      close or truncate > 0, {}))  # fmt: skip
    return cases


DOCUMENT_CASES = _document_cases()


async def document_outcome(f: Fetcher, url: str, validators: dict[str, str]) -> tuple:
    """What a caller of ``Fetcher.document`` can see, in a comparable form."""
    try:
        async with f.document(url, **validators) as stream:
            locs = [e.loc async for e in stream.entries]
            head = stream.head.capability if stream.head is not None else None
            return ("ok", stream.not_modified, stream.url, stream.etag, stream.content_type,
                    stream.link_header, stream.last_modified, head, locs, stream.sha256)  # fmt: skip
    except FetchError as exc:
        words = str(exc) if exc.kind in ("http", "size", "parse") else ""
        return ("error", exc.kind, exc.status, exc.transient, exc.retry_after, exc.url, words)


@pytest.mark.parametrize("case", range(len(DOCUMENT_CASES)), ids=[c[0] for c in DOCUMENT_CASES])
async def test_documents_on_the_lean_and_httpx_paths_agree(case: int) -> None:
    """Capability documents take the lean path as resources do; whatever the framing, content coding
    or failure, the caller sees what the httpx path would give it."""
    name, raw, close, validators = DOCUMENT_CASES[case]
    script = Script()
    async with scripted(script) as base:
        path = script.add("/doc.xml", raw, close=close)
        async with fetcher() as lean_f, fetcher() as httpx_f:
            assert lean_f._lean is not None
            httpx_f._lean = None
            a = await document_outcome(lean_f, base + path, validators)
            b = await document_outcome(httpx_f, base + path, validators)
            assert lean_f._lean.connections_opened >= 1  # the lean path ran
    assert a == b, name
