"""One visibility rule for every view, dumps included: a resource the publish filter hides after a restart
or a reload (SIGHUP) is in no dump package or manifest served afterwards, and no package built before
(the advertised run, the older runs still kept, closed Change Dump windows) can be downloaded.

Generated cases: publish filters (the example plugin's ``hide`` regex: one resource, several, all),
``keep`` values, both dump kinds; in process for the restart (the composition root, as ``rsagg run``
builds it), with a real ``rsagg run`` for SIGHUP.
"""

from __future__ import annotations

import io
import re
import signal
import socket
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from aggregator.config import Config, parse_config
from aggregator.publish.schedule import build_due
from aggregator.rs.parse import parse_bytes
from aggregator.run.compose import open_assembly
from aggregator.testing.upstream import Upstream

from .harvesting import harvest, start_daemon

# Reloads (SIGHUP) and restarts rsagg daemon processes.
pytestmark = pytest.mark.slow

GUARD = 60
N = 6
#: Publish filters (the example plugin's ``hide``, a regex on the upstream URI) and the resources each
#: hides.
FILTERS = [(r"/r1\.txt$", {1}), (r"/r[024]\.txt$", {0, 2, 4}), (r"\.txt$", set(range(N)))]


def body(i: int, version: int = 0) -> bytes:
    return f"resource {i} version {version}\n".encode()


def upstream() -> Upstream:
    up = Upstream(resource_dump=False, change_dump=False)
    for i in range(N):
        up.create(f"r{i}.txt", body(i), "text/plain")
    return up


def config_of(folder: Path, url: str, keep_hide: str | None, base: str = "http://rsagg.test") -> Config:
    tables: dict[str, Any] = {"example": {"hide": keep_hide}} if keep_hide else {}
    return parse_config(
        {
            "server": {"base_url": base},
            "store": {"path": str(folder)},
            "harvest": {"retries": 1, "backoff_base": 0.01, "backoff_max": 0.05, "timeout": 10},
            "publish": {"dump_interval": 3600, "changelist_size": 2},
            "plugins": tables,
            "sources": [{"name": "up", "url": url}],
        },
        str(folder.parent / "rsagg.toml"),
    )


class Served:
    """What a Destination can fetch of the dumps: every package and manifest listed, by URL."""

    def __init__(self, client: httpx.AsyncClient, base: str, set_name: str) -> None:
        self.client, self.base, self.set_name = client, base, set_name

    async def get(self, url: str) -> httpx.Response:
        return await self.client.get(url)

    async def listed(self) -> dict[str, bytes]:
        """URL -> bytes of every package and manifest the Capability List leads to."""
        out: dict[str, bytes] = {}
        cap = await self.get(f"{self.base}/{self.set_name}/capabilitylist.xml")
        assert cap.status_code == 200
        _, entries = parse_bytes(cap.content)
        for e in entries:
            if e.capability not in ("resourcedump", "changedump"):
                continue
            doc = await self.get(e.loc)
            assert doc.status_code == 200, (e.loc, doc.status_code)
            _, packages = parse_bytes(doc.content)
            for p in packages:
                urls = [p.loc, *(link.href for link in p.links if link.rel == "contents")]
                for url in urls:
                    r = await self.get(url)
                    assert r.status_code == 200, (url, r.status_code)
                    out[url] = r.content
        return out


def hidden_anywhere(served: dict[str, bytes], hidden: set[int]) -> list[str]:
    """The served packages/manifests that hold a hidden resource (its URI or its bytes)."""
    bad = []
    for url, data in served.items():
        names = [f"r{i}.txt".encode() for i in hidden]
        if url.endswith(".zip"):
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                members = [zf.read(n) for n in zf.namelist()]
            texts = members
        else:
            texts = [data]
        for text in texts:
            if any(n in text for n in names) or any(body(i) in text or body(i, 1) in text for i in hidden):
                bad.append(url)
    return bad


async def build_runs(parts, runs: int) -> None:
    """``runs`` Resource Dump runs (each after a change, so each is a new run) and the Change Dumps."""
    builder = parts.dumps
    for _ in range(runs):
        await trio.to_thread.run_sync(lambda: build_due(builder, resource_dumps=True))
        await trio.to_thread.run_sync(
            lambda: [
                builder.build_resource_dump(ps.name, ps.set_ids, force=True)
                for ps in builder.site.sets.values()
            ]
        )


@pytest.mark.parametrize("keep", [1, 2, 3])
@pytest.mark.parametrize("hide,hidden", FILTERS)
async def test_a_hide_rule_added_by_restart_reaches_every_dump(
    tmp_path: Path, hide: str, hidden: set[int], keep: int
):
    up = upstream()
    async with up.serving() as ubase:
        before = config_of(tmp_path / "data", ubase, None)
        assert (await harvest(before))["up"].ok
        for i in range(N):  # a second version of each: Change Dump windows close with both
            up.update(f"r{i}.txt", body(i, 1), "text/plain")
        assert (await harvest(before))["up"].ok
    old: dict[str, bytes] = {}
    async with open_assembly(before, harvest=False) as parts:
        parts.dumps.keep = keep
        await build_runs(parts, keep + 1)
        app = parts.app(before)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            (set_name,) = parts.dumps.site.sets
            served = Served(client, before.server.base_url, set_name)
            old = await served.listed()
            # the older runs still kept are downloadable too (keep > 1)
            runs = [r[0] for r in parts.dumps.state.conn.execute("SELECT id FROM publish_dumps")]
            for pkg in runs:
                url = f"{before.server.base_url}/{set_name}/resourcedump/{pkg}.zip"
                r = await client.get(url)
                if r.status_code == 200:
                    old[url] = r.content
        app.state.publisher.pool.close()
    assert old and not hidden_anywhere(old, set()), "the run before the rule serves every resource"
    assert sum(u.endswith(".zip") and "/resourcedump/" in u for u in old) >= min(keep, 2) or keep == 1
    assert any("/changedump/" in u for u in old)

    after = config_of(tmp_path / "data", "http://127.0.0.1:9/", hide)  # restart with the hide rule
    async with open_assembly(after, harvest=False) as parts:
        parts.dumps.keep = keep
        app = parts.app(after)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            served = Served(client, after.server.base_url, set_name)
            # at once, before any rebuild: nothing built under the old filter is listed or downloadable
            assert await served.listed() == {}
            for url in old:
                assert (await client.get(url)).status_code == 404, url
            # rebuilt under the new filter: no hidden resource in any package or manifest
            await build_runs(parts, keep + 1)
            now = await served.listed()
            assert any("/resourcedump/" in u for u in now) == (len(hidden) < N)  # an empty run: no package
            assert any("/changedump/" in u for u in now)
            assert not hidden_anywhere(now, hidden), hidden_anywhere(now, hidden)
            if len(hidden) < N:
                assert any(f"r{min(set(range(N)) - hidden)}.txt".encode() in d for d in now.values())
            for url in old:  # a rebuilt Change Dump window may reuse its number, never its bytes
                r = await client.get(url)
                assert r.status_code == 404 or hidden_anywhere({url: r.content}, hidden) == [], url
        app.state.publisher.pool.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("hide,hidden", [FILTERS[0], FILTERS[2]])
async def test_a_hide_rule_added_by_sighup_reaches_every_dump(tmp_path: Path, hide: str, hidden: set[int]):
    """A real ``rsagg run``: dumps built, then SIGHUP with the rule; from the reload on, the dumps of
    before are gone (404) and the rebuilt ones hold no hidden resource."""
    up = upstream()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with up.serving() as ubase:
        config = tmp_path / "rsagg.toml"

        def write(rule: str | None) -> None:
            example = f"[plugins.example]\nhide = '{rule}'\n" if rule else ""
            config.write_text(
                f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "{base}"\n'
                f'[store]\npath = "{tmp_path / "data"}"\n'
                "[publish]\nchangelist_size = 2\ndump_interval = 3600\n"
                "[harvest]\njitter = 0\nretries = 1\nbackoff_base = 0.01\nbackoff_max = 0.05\ntimeout = 10\n"
                f"{example}"
                f'[[sources]]\nname = "up"\nurl = "{ubase}"\ninterval = 3600\n'
            )

        write(None)
        log = (tmp_path / "daemon.log").open("ab")
        daemon = await start_daemon(config, log)
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                with trio.fail_after(GUARD):  # serving and harvested
                    while True:
                        try:
                            r = await client.get(f"{base}/.well-known/resourcesync")
                            found = re.search(rb"/([^/<]+)/capabilitylist\.xml</loc>", r.content)
                            if found:
                                listed = await client.get(
                                    f"{base}/{found.group(1).decode()}/resourcelist.xml"
                                )
                                if listed.content.count(b"<url>") == N:
                                    break
                        except httpx.TransportError:
                            pass
                        await trio.sleep(0.2)
                served = Served(client, base, found.group(1).decode())
                daemon.send_signal(signal.SIGHUP)  # same rules: a reload starts a dump round at once
                with trio.fail_after(GUARD):
                    old = await served.listed()
                    while not any("/resourcedump/" in u for u in old):
                        await trio.sleep(0.2)
                        old = await served.listed()
                assert not hidden_anywhere(old, set()) and hidden_anywhere(old, hidden)

                write(hide)
                daemon.send_signal(signal.SIGHUP)
                resourcelist = f"{served.base}/{served.set_name}/resourcelist.xml"
                with trio.fail_after(GUARD):  # the reload applied: the Resource List hides them
                    while True:
                        text = (await client.get(resourcelist)).content
                        if not any(f"r{i}.txt".encode() in text for i in hidden):
                            break
                        await trio.sleep(0.1)
                for url in old:  # withdrawn: not downloadable any more
                    r = await client.get(url)
                    assert r.status_code == 404 or not hidden_anywhere({url: r.content}, hidden), url

                # rebuilt under the new rule (the reads ask for it only); a round commits the Change Dump
                # packages before the Resource Dump (a niced worker process: maybe much later): both
                def rebuilt(urls: dict) -> bool:
                    dumped = any("/resourcedump/" in u for u in urls) or len(hidden) == N
                    return dumped and any("/changedump/" in u for u in urls)

                with trio.fail_after(GUARD):
                    now = await served.listed()
                    while not rebuilt(now):
                        await trio.sleep(0.2)
                        now = await served.listed()
                assert not hidden_anywhere(now, hidden), hidden_anywhere(now, hidden)
                assert any("/resourcedump/" in u for u in now) == (len(hidden) < N)  # all hidden: empty run
                assert not set(now) & {u for u in old if "/resourcedump/" in u}
        finally:
            daemon.send_signal(signal.SIGTERM)
            with trio.move_on_after(GUARD):
                await daemon.wait()
            log.close()
        text = (tmp_path / "daemon.log").read_text()
        assert "Traceback" not in text, text[-3000:]
        assert "withdrawn" in text
