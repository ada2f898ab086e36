"""``server.base_url`` with a path (``http://host/rsagg/``): rsagg behind a reverse proxy that publishes it
under a prefix. A real nginx in front of a real ``rsagg run``, once passing the prefix on (rsagg takes
it off) and once stripping it; the host's ``/.well-known/resourcesync`` and ``/robots.txt`` are mapped
to rsagg's (§6.3.2, §6.3.4: they live at the host root, not under a prefix). Every link of the home
page, robots.txt and the documents answers through nginx, and resync, the reference Destination,
copies the prefixed Source."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import httpx
import pytest
import trio

from aggregator.publish.uris import base_path, strip_base_path
from aggregator.rs.parse import parse_bytes
from aggregator.testing.upstream import Upstream

from .harvesting import start_daemon
from .test_offload import free_port
from .test_publish import local_files, resync

# Runs a private nginx in front of rsagg.
pytestmark = pytest.mark.slow

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
GUARD = 60  # seconds: a hung step fails the test instead of hanging the suite
PREFIX = "/rsagg"


@pytest.mark.parametrize(
    ("path", "prefix", "routed"),
    [
        (b"/rsagg/up/resourcelist.xml", b"/rsagg", b"/up/resourcelist.xml"),
        (b"/rsagg/", b"/rsagg", b"/"),
        (b"/rsagg", b"/rsagg", b"/"),
        (b"/up/resourcelist.xml", b"/rsagg", b"/up/resourcelist.xml"),  # the proxy stripped it
        (b"/rsaggx/capabilitylist.xml", b"/rsagg", b"/rsaggx/capabilitylist.xml"),  # a set, not the prefix
        (b"/a/b/up/r/http/x", b"/a/b", b"/up/r/http/x"),
        (b"/up/r/http/x", b"", b"/up/r/http/x"),
    ],
)
def test_strip_base_path(path: bytes, prefix: bytes, routed: bytes) -> None:
    assert strip_base_path(path, prefix) == routed


def test_base_path() -> None:
    assert [base_path(u) for u in ("http://h", "http://h/", "http://h/rsagg/", "http://h/a/b")] == [
        "", "", "/rsagg", "/a/b",
    ]  # fmt: skip


def _nginx_conf(folder: Path, port: int, upstream: int, *, strip: bool) -> Path:
    """A private nginx publishing rsagg under PREFIX; ``strip``: the proxy takes the prefix off."""
    target = f"http://127.0.0.1:{upstream}" + ("/" if strip else "")
    root = f"http://127.0.0.1:{upstream}" + ("" if strip else PREFIX)
    conf = folder / "nginx.conf"
    conf.write_text(
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"""worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/error.log;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {folder}/body; proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi; uwsgi_temp_path {folder}/uwsgi; scgi_temp_path {folder}/scgi;
    server {{
        listen 127.0.0.1:{port};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $http_host;
        location {PREFIX}/ {{ proxy_pass {target}; }}
        # The host root's well-known URI and robots.txt are rsagg's (section 6.3.2, 6.3.4).
        location = /.well-known/resourcesync {{ proxy_pass {root}/.well-known/resourcesync; }}
        location = /robots.txt {{ proxy_pass {root}/robots.txt; }}
    }}
}}
"""
    )
    return conf


@pytest.mark.parametrize("strip", [False, True], ids=["prefix passed on", "prefix stripped"])
async def test_served_under_a_prefix_through_nginx(tmp_path: Path, strip: bool) -> None:
    assert os.path.exists(NGINX), "nginx is not installed: apt-get install nginx (.ci/run does)"
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(8)
    up.create("dir/a b?.txt", b"an awkward name\n")
    rport, nport = free_port(), free_port()
    host = f"http://127.0.0.1:{nport}"
    front = f"{host}{PREFIX}"
    ngx = tmp_path / "nginx"
    ngx.mkdir()
    async with up.serving() as ubase:
        config = tmp_path / "rsagg.toml"
        config.write_text(
            f'[server]\nlisten = "127.0.0.1:{rport}"\nbase_url = "{front}/"\n'
            f'[store]\npath = "{tmp_path / "data"}"\n'
            "[harvest]\njitter = 0\nretries = 2\nbackoff_base = 0.01\nbackoff_max = 0.05\ntimeout = 10\n"
            f'[[sources]]\nname = "up"\nurl = "{ubase}"\ninterval = 1\n'
        )
        log = (tmp_path / "daemon.log").open("ab")
        daemon = await start_daemon(config, log)
        conf = _nginx_conf(ngx, nport, rport, strip=strip)
        nginx = await trio.lowlevel.open_process(
            [NGINX, "-p", str(ngx), "-c", str(conf), "-g", "daemon off;"], stderr=(ngx / "stderr").open("wb")
        )
        try:
            async with httpx.AsyncClient(timeout=30) as client:

                async def get(url: str) -> httpx.Response:
                    assert url.startswith(front + "/") or url == front, url  # every link under the prefix
                    return await client.get(url)

                with trio.fail_after(GUARD):
                    while True:
                        try:
                            r = await client.get(f"{front}/up/resourcelist.xml")
                            if r.status_code == 200 and r.text.count("<url>") == 9:
                                break
                        except httpx.TransportError:
                            pass
                        await trio.sleep(0.1)

                # The home page, at the prefix with and without its slash; each of its links answers.
                for home_url in (f"{front}/", front):
                    home = await client.get(home_url, follow_redirects=True)  # nginx: 301 to the slash
                    assert home.status_code == 200 and "rsagg" in home.text, home_url
                links = sorted(set(re.findall(r'href="([^"]+)"', home.text)))
                ours = [u for u in links if u.startswith(host)]
                assert len(ours) >= 6, links  # Source Description, documents, status.json, metrics
                for url in ours:
                    assert (await get(url)).status_code == 200, url

                # robots.txt, at the host root (mapped) and under the prefix: its Sitemaps answer.
                for robots_url in (f"{host}/robots.txt", f"{front}/robots.txt"):
                    robots = await client.get(robots_url)
                    sitemaps = re.findall(r"^Sitemap: (\S+)$", robots.text, re.M)
                    assert robots.status_code == 200 and sitemaps, robots.text
                    for url in sitemaps:
                        assert (await get(url)).status_code == 200, url

                # The Source Description at the host root (mapped), then every document and resource.
                seen: set[str] = set()
                todo = [f"{host}/.well-known/resourcesync"]
                while todo:
                    url = todo.pop()
                    r = await (client.get(url) if url.startswith(f"{host}/.well-known") else get(url))
                    assert r.status_code == 200, url
                    seen.add(url)
                    # (a notification channel's topic answers with its latest payload, or nothing yet)
                    if r.headers["content-type"].startswith("application/xml") and r.content:
                        head, entries = parse_bytes(r.content)
                        for ln in head.links:
                            if ln.href.startswith(host) and ln.href not in seen and ln.rel != "via":
                                todo.append(ln.href)
                        todo += [e.loc for e in entries if e.loc not in seen and e.loc not in todo]
                resources = [u for u in seen if "/up/r/" in u]
                assert len(resources) == 9, sorted(seen)

                # resync, the reference Destination, copies the Source published under the prefix.
                dest, cwd = tmp_path / "dest", tmp_path / "cwd"
                cwd.mkdir()
                out = await resync("--baseline", "--delete", front, str(dest), cwd=cwd)
                assert "SYNCED" in out or "IN SYNC" in out, out
                assert sorted(local_files(dest).values()) == sorted(v.data for v in up.resources().values())
        finally:
            for proc in (nginx, daemon):
                proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(GUARD):
                await nginx.wait()
                await daemon.wait()
            log.close()
    text = (tmp_path / "daemon.log").read_text()
    assert "Traceback" not in text, text
