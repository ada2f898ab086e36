"""``server.offload = "x-accel"`` with a real nginx (Debian's) in front of a real ``rsagg run``.

nginx runs the shipped ``config/nginx.conf`` (only its marked lines changed: ports and the blob
folder) as a private instance in the test's folder. Every resource must answer the same through nginx
(which sends the bytes from the blob file) as from rsagg serving them itself: status, bytes and every
header a client reads, with Range, conditional requests, a resource hidden by a publish filter (404) and
one deleted upstream (410); resync, the reference Destination, syncs through nginx and audits in sync.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
from pathlib import Path

import httpx
import pytest
import trio

from aggregator.config import load_config
from aggregator.publish.uris import rsagg_uri
from aggregator.store.blobs import FileBlobStore
from aggregator.testing.upstream import Upstream

from .apps import create_app
from .harvesting import start_daemon
from .httpserver import serve_app
from .test_publish import local_files, resync

# Runs a private nginx in front of rsagg.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
#: Headers a client reads of a resource answer (Date, Server, Connection are each server's own).
COMPARED = ("etag", "last-modified", "content-type", "content-length", "content-range",
            "content-encoding", "link", "accept-ranges", "location")  # fmt: skip
GUARD = 60  # seconds: a hung step fails the test instead of hanging the suite

FILES = {
    "a.txt": (b"plain text, small\n", "text/plain"),
    "b.bin": (bytes(range(256)) * 3, "application/octet-stream"),
    "same-as-a.json": (b"plain text, small\n", "application/json"),  # same blob, another type
    "big.bin": (os.urandom(300 * 1024), "application/octet-stream"),  # above SMALL_BLOB
    "drafts/secret.txt": (b"not for publishing\n", "text/plain"),  # hidden by the publish filter
    "gone.txt": (b"deleted later\n", "text/plain"),
    # rsagg's headers name the URI thrice (Link): beyond the page nginx reads a cached answer with
    "/".join(["long"] + ["d" * 120] * 16) + ".txt": (b"a long name\n", "text/plain"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nginx_conf(folder: Path, port: int, upstream_port: int, blobs: Path) -> Path:
    """The shipped example with its marked lines set for this test (and root's workers)."""
    text = (REPO / "config" / "nginx.conf").read_text()
    files = free_port()  # nginx's own second server (the answer cache's source)
    for old, new in (
        ("server 127.0.0.1:8080;", f"server 127.0.0.1:{upstream_port};"),
        ("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{port};"),
        ("server 127.0.0.1:8001;", f"server 127.0.0.1:{files};"),
        ("listen 127.0.0.1:8001;", f"listen 127.0.0.1:{files};"),
        ("alias /var/lib/rsagg/blobs/;", f"alias {blobs}/;"),
        ("worker_processes auto;", "worker_processes 1;"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    # The workers as root, who can enter the test's folders (www-data cannot); a non-root nginx keeps its
    # own user (the directive would only be warned about).
    assert "\nuser www-data;\n" in text
    text = text.replace("\nuser www-data;\n", "\nuser root;\n" if os.geteuid() == 0 else "\n")
    conf = folder / "nginx.conf"
    conf.write_text(text)
    return conf


async def wait_for(check, what: str) -> None:
    with trio.move_on_after(GUARD) as cs:
        while not await check():
            await trio.sleep(0.1)
    assert not cs.cancelled_caught, f"timed out waiting for {what}"


async def test_nginx_offload_answers_as_rsagg_alone(tmp_path: Path):
    assert os.path.exists(NGINX), "nginx is not installed: apt-get install nginx (.ci/run does)"
    up = Upstream(resource_dump=False, change_dump=False)
    for path, (data, type_) in FILES.items():
        up.create(path, data, type_)
    rport, nport = free_port(), free_port()
    front = f"http://127.0.0.1:{nport}"
    store = tmp_path / "data"
    ngx = tmp_path / "nginx"
    ngx.mkdir()
    async with up.serving() as ubase, trio.open_nursery() as nursery:
        config = tmp_path / "rsagg.toml"
        config.write_text(
            f'[server]\nlisten = "127.0.0.1:{rport}"\nbase_url = "{front}"\noffload = "x-accel"\n'
            f'[store]\npath = "{store}"\n'
            "[harvest]\njitter = 0\nretries = 2\nbackoff_base = 0.01\nbackoff_max = 0.05\ntimeout = 10\n"
            "[plugins.example]\nhide = '/drafts/'\n"
            f'[[sources]]\nname = "up"\nurl = "{ubase}"\ninterval = 1\n'
        )
        log = (tmp_path / "daemon.log").open("ab")
        daemon = await start_daemon(config, log)
        (store / "blobs").mkdir(parents=True, exist_ok=True)
        conf = nginx_conf(ngx, nport, rport, store / "blobs")
        nginx = await trio.lowlevel.open_process(
            [NGINX, "-p", str(ngx), "-c", str(conf), "-g", "daemon off;"], stderr=(ngx / "stderr").open("wb")
        )
        try:
            cfg = load_config(config)
            alone_cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, offload="none"))
            with FileBlobStore(store / "blobs") as blobs:
                app = create_app(alone_cfg, blobs=blobs, state_path=store / "state.db")
                async with serve_app(app) as alone, httpx.AsyncClient(timeout=30) as client:

                    def path(name: str) -> str:
                        return rsagg_uri(front, "up", up.url(name))[len(front) :]

                    async def harvested() -> bool:
                        try:
                            r = await client.get(front + path("gone.txt"))
                        except httpx.TransportError:
                            return False
                        return r.status_code == 200

                    await wait_for(harvested, "the daemon's first harvest, through nginx")

                    async def same(name: str, method: str = "GET", **kw: str) -> httpx.Response:
                        headers = {k.replace("_", "-"): v for k, v in kw.items()}
                        a = await client.request(method, alone + path(name), headers=headers)
                        b = await client.request(method, front + path(name), headers=headers)
                        what = (name, method, headers)
                        assert (a.status_code, a.content) == (b.status_code, b.content), what
                        assert {k: a.headers.get(k) for k in COMPARED} == {
                            k: b.headers.get(k) for k in COMPARED
                        }, what
                        assert "x-accel-redirect" not in b.headers and "x-accel-expires" not in b.headers
                        return a

                    # the daemon itself hands the bytes to nginx, and says how long nginx may keep that
                    direct = await client.get(f"http://127.0.0.1:{rport}" + path("a.txt"))
                    assert direct.status_code == 200 and direct.content == b""
                    assert direct.headers["x-accel-redirect"].startswith("/_rsagg_blobs/")
                    seconds = cfg.server.offload_cache_seconds  # at most, a fifth less for some
                    assert seconds - seconds // 5 <= int(direct.headers["x-accel-expires"]) <= seconds

                    # nginx answers plain GETs and HEADs of a resource from its cached answer
                    async def resource_requests() -> float:
                        text = (await client.get(f"http://127.0.0.1:{rport}/metrics")).text
                        return sum(
                            float(line.rsplit(" ", 1)[1])
                            for line in text.splitlines()
                            if line.startswith("rsagg_http_requests_total{") and "/r/{rest:path}" in line
                        )

                    first = await client.get(front + path("b.bin"))
                    before = await resource_requests()
                    for method in ("GET", "HEAD", "GET"):
                        again = await client.request(method, front + path("b.bin"))
                        assert again.status_code == 200 and again.headers["etag"] == first.headers["etag"]
                    # (at most one: the answer may expire once while the three go out, not twice)
                    assert await resource_requests() <= before + 1
                    assert any(p.is_file() for p in (ngx / "answers").rglob("*"))  # nginx's answer cache
                    # every header line of a kept answer is parsed again on each hit: none that nginx
                    # says itself anyway (Accept-Ranges: the front's own, proxy_force_ranges)
                    kept = [p.read_bytes() for p in (ngx / "answers").rglob("*") if p.is_file()]
                    heads = [k.split(b"\r\n\r\n", 1)[0].lower() for k in kept]
                    assert heads and all(b"\netag: " in h for h in heads)
                    assert not any(b"\naccept-ranges:" in h for h in heads)
                    after = await resource_requests()
                    assert (
                        await client.get(front + path("b.bin"), headers={"if-none-match": "*"})
                    ).status_code == 304

                    async def judged_by_rsagg() -> bool:  # validators: rsagg judges them, not the cache
                        return await resource_requests() > after

                    await wait_for(judged_by_rsagg, "the conditional request to reach rsagg")

                    # the first request of a resource (nginx keeps no answer yet) with a Range, a HEAD
                    data = FILES["same-as-a.json"][0]
                    assert (await same("same-as-a.json", range="bytes=2-5")).content == data[2:6]
                    assert (await same("big.bin", "HEAD")).headers["content-length"] == str(300 * 1024)

                    for name, (data, type_) in FILES.items():
                        if name.startswith("drafts/"):
                            continue
                        r = await same(name)
                        assert r.status_code == 200 and r.content == data
                        assert r.headers["content-type"].startswith(type_)
                        etag = r.headers["etag"]
                        old = "Mon, 01 Jan 2001 00:00:00 GMT"
                        assert (await same(name, "HEAD")).headers["content-length"] == str(len(data))
                        assert (await same(name, range="bytes=2-5")).content == data[2:6]
                        assert (await same(name, range="bytes=-3")).content == data[-3:]
                        assert (await same(name, range="bytes=7-")).status_code == 206
                        assert (await same(name, range="bytes=2-5", if_range=etag)).status_code == 206
                        assert (await same(name, range="bytes=2-5", if_range='"other"')).status_code == 200
                        assert (await same(name, if_none_match=etag)).status_code == 304
                        # preconditions (RFC 9110 §13.1.1, §13.1.4) judged by the resource, not the file
                        assert (await same(name, if_match=etag)).content == data
                        assert (
                            await same(name, if_match=f'"x", {etag}', range="bytes=1-2")
                        ).status_code == 206
                        assert (await same(name, if_match='"x"')).status_code == 412
                        assert (await same(name, if_match=f"W/{etag}")).status_code == 412  # strong only
                        assert (await same(name, if_unmodified_since=old)).status_code == 412
                        assert (await same(name, if_none_match='"other"')).status_code == 200
                        since = r.headers["last-modified"]
                        assert (await same(name, range="bytes=2-5", if_range=since)).status_code == 206
                        assert (await same(name, if_modified_since=since)).status_code == 304
                        assert (await same(name, if_unmodified_since=since)).content == data
                        assert (await same(name, if_modified_since=old)).status_code == 200
                    assert (await same("drafts/secret.txt")).status_code == 404
                    assert (await same("never-held.txt")).status_code == 404

                    # resync, the reference Destination, through nginx
                    dest, cwd = tmp_path / "dest", tmp_path / "cwd"
                    cwd.mkdir()
                    out = await resync("--baseline", "--delete", front, str(dest), cwd=cwd)
                    assert "SYNCED" in out or "IN SYNC" in out, out
                    want = {path(n)[1:]: d for n, (d, _) in FILES.items() if not n.startswith("drafts/")}
                    assert local_files(dest) == want
                    out = await resync("--audit", "--hash", "md5", front, str(dest), cwd=cwd)
                    assert "IN SYNC" in out and "NOT IN SYNC" not in out, out

                    up.delete("gone.txt")

                    async def deleted() -> bool:
                        return (await client.get(alone + path("gone.txt"))).status_code == 410

                    await wait_for(deleted, "the daemon to harvest the deletion")

                    async def deleted_behind_nginx() -> bool:  # within server.offload_cache_seconds
                        return (await client.get(front + path("gone.txt"))).status_code == 410

                    await wait_for(deleted_behind_nginx, "nginx's cached answer to expire")
                    assert (await same("gone.txt")).status_code == 410
                    assert (await same("gone.txt", "HEAD")).status_code == 410
        finally:
            for proc in (nginx, daemon):
                proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(GUARD):
                await nginx.wait()
                await daemon.wait()
            log.close()
            nursery.cancel_scope.cancel()
