"""rsagg as a ResourceSync Source (aggregator/publish/): the real harvester fills a store from the demo
upstream, ``create_app`` serves it on 127.0.0.1, and httpx (and resync, the reference client) read it."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from aggregator.config import Config, PublishConfig, parse_config
from aggregator.harvest.context import open_blob_store
from aggregator.plugins.manager import Plugins
from aggregator.publish import documents
from aggregator.publish.app import Publisher
from aggregator.publish.uris import rsagg_uri
from aggregator.publish.versions import resource_link_header
from aggregator.rs.model import PATCH_REL, Entry, Head, Link
from aggregator.rs.parse import parse_bytes
from aggregator.rs.validate import validate_source
from aggregator.store.blobs import FileBlobStore
from aggregator.store.interface import StateStore
from aggregator.store.open import open_state, state_path
from aggregator.store.rows import Change
from aggregator.store.state import State
from aggregator.testing.upstream import Upstream

from .apps import create_app
from .harvesting import harvest, make_config
from .httpserver import answer_lifespan, serve_app

# Harvests the demo upstream, serves it, reads it back with httpx and the resync client (seconds per test).
pytestmark = pytest.mark.slow

# ---------------------------------------------------------------------------------------------------
# helpers


#: The §14.6 relations rsagg adds to every entry (publish/versions.py).
VERSION_RELS = {"memento", "timegate", "timemap"}


@asynccontextmanager
async def publishing(
    cfg: Config, *, blobs: Any = None, **kw: Any
) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    """Serve ``create_app`` over ``cfg``'s store; base_url is the bound address (known only once bound,
    so the app is created then; lifespan is answered here and the pool closed at the end)."""
    holder: dict[str, Any] = {}

    async def asgi(scope, receive, send):
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        await holder["app"](scope, receive, send)

    async def fast_lane(method: bytes, target: bytes) -> Any:  # the server's fast lane: the app's
        app = holder.get("app")
        return None if app is None else await app.state.fast_lane(method, target)

    asgi.state = SimpleNamespace(fast_lane=fast_lane)  # type: ignore[attr-defined]

    with open_blob_store(cfg, Plugins.from_config(cfg)) as store:  # the configured backend
        async with serve_app(asgi) as base:
            config = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, base_url=base))
            app = create_app(config, blobs=blobs or store, state_path=state_path(cfg), **kw)
            holder["app"] = app
            try:
                async with httpx.AsyncClient(timeout=30) as client:
                    yield base, client
            finally:
                app.state.publisher.pool.close()


def with_publish(cfg: Config, **publish: Any) -> Config:
    return dataclasses.replace(cfg, publish=PublishConfig(**publish))


def state_of(cfg: Config) -> State:
    return open_state(cfg)


def set_names(cfg: Config) -> dict[str, int]:
    """State set name -> id."""
    with state_of(cfg) as st:
        return {s.name: s.id for s in st.sets()}


async def get_doc(client: httpx.AsyncClient, url: str) -> tuple[Head, list[Entry]]:
    r = await client.get(url)
    assert r.status_code == 200, (url, r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/xml")
    issues = validate_source(r.content, url)
    # The only warning allowed: a Capability List without describedby when [[sets]] gives none (§9).
    assert all(i.rule == "describedby-missing" for i in issues), (url, issues)
    head, entries = parse_bytes(r.content, url)
    assert not issues or head.capability == "capabilitylist"
    return head, entries


async def walk(client: httpx.AsyncClient, base: str) -> dict[str, tuple[Head, list[Entry]]]:
    """Every document reachable from the well-known URI: Capability Lists, their Resource Lists and
    Change Lists, indexes and their parts; each must validate without errors."""
    docs: dict[str, tuple[Head, list[Entry]]] = {}
    queue = [f"{base}/.well-known/resourcesync"]
    while queue:
        url = queue.pop(0)
        if url in docs:
            continue
        head, entries = docs[url] = await get_doc(client, url)
        if head.capability in ("description", "capabilitylist") or head.is_index:
            queue += [e.loc for e in entries]
    return docs


def up_chain(docs: dict[str, tuple[Head, list[Entry]]], url: str, base: str) -> list[str]:
    chain = [url]
    while (up := docs[chain[-1]][0].link("up")) is not None:
        chain.append(up.href)
    assert chain[-1] == f"{base}/.well-known/resourcesync", chain
    return chain


def listed_resources(docs, base: str, set_name: str) -> list[Entry]:
    """The entries of a set's Resource List, through its index when there is one (in order)."""
    head, entries = docs[f"{base}/{set_name}/resourcelist.xml"]
    if not head.is_index:
        return entries
    return [e for part in entries for e in docs[part.loc][1]]


async def changes_in_order(client, base: str, set_name: str) -> tuple[list[Entry], list[Head], list[Entry]]:
    """(all change entries in window order, the window heads, the index entries or [])."""
    head, entries = await get_doc(client, f"{base}/{set_name}/changelist.xml")
    if not head.is_index:
        return entries, [head], []
    out, heads = [], []
    for s in entries:
        h, es = await get_doc(client, s.loc)
        heads.append(h)
        out += es
    return out, heads, entries


# ---------------------------------------------------------------------------------------------------
# the whole tree


async def test_every_document_validates_and_indexes_appear(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(documents, "MAX_ENTRIES", 7)
    up = Upstream(sets=("a", "b"), metadata=True, changes_per_list=5, resource_dump=False, change_dump=False)
    up.bulk_create(9, set_name="a")  # + 9 metadata records: 18 resources, an index of 3 parts
    up.bulk_create(2, set_name="b")
    async with up.serving() as ubase:
        cfg = with_publish(make_config(tmp_path / "data", {"up": ubase}), changelist_size=6)
        assert (await harvest(cfg))["up"].ok
        for i in range(3):
            up.update(f"r{i:06d}.txt", f"v2 {i}".encode(), set_name="a")
        up.delete("r000005.txt", set_name="a")
        up.create("late.txt", b"late", set_name="b")
        assert (await harvest(cfg))["up"].ok
        names = set_names(cfg)
        async with publishing(cfg) as (base, client):
            docs = await walk(client, base)
            sd_head, sd_entries = docs[f"{base}/.well-known/resourcesync"]
            assert sd_head.capability == "description"
            assert sorted(e.loc for e in sd_entries) == sorted(
                f"{base}/{n}/capabilitylist.xml" for n in names
            )
            for url in docs:
                up_chain(docs, url, base)  # every document leads up to the Source Description
                assert url.startswith(base)
            with state_of(cfg) as st:
                for name, sid in names.items():
                    live = {r.uri: r for r in st.iter_resources(sid)}
                    listed = listed_resources(docs, base, name)
                    assert [e.loc for e in listed] == [rsagg_uri(base, name, u) for u in live]  # by id, once
                    for e in listed:
                        r = live[next(u for u in live if rsagg_uri(base, name, u) == e.loc)]
                        assert e.lastmod == r.updated_at
                        assert e.hashes == r.hashes and e.md.length == r.length and e.md.type == r.type
            a = next(n for n, sid in names.items() if len(listed_resources(docs, base, n)) > 7)
            index, parts = docs[f"{base}/{a}/resourcelist.xml"]
            assert index.is_index and index.md.at is not None and len(parts) == 3
            assert [p.loc.rsplit("/", 1)[1].split("-")[1] for p in parts][-1] == "end.xml"
            for p in parts:
                head, entries = docs[p.loc]
                assert not head.is_index and 0 < len(entries) <= 7
                assert head.link("index").href == f"{base}/{a}/resourcelist.xml"
            assert docs[f"{base}/{a}/changelist.xml"][0].is_index  # 6 per window: several windows


# ---------------------------------------------------------------------------------------------------
# resources over HTTP


class NoLocalPath:
    """A blob store without local files (like a future S3 backend): the app streams from open()."""

    def __init__(self, inner: FileBlobStore) -> None:
        self.inner = inner

    def local_path(self, sha256: str) -> None:
        return None

    def read_inline(self, sha256: str) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("local", [True, False], ids=["file", "stream"])
async def test_resources_http(tmp_path: Path, local: bool):
    up = Upstream(resource_dump=False, change_dump=False)
    up.create("doc.txt", b"0123456789abcdefghij", "text/plain")
    up.create("data.bin", bytes(range(256)) * 4, "application/octet-stream")
    up.create("gone.txt", b"soon deleted")
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {"up": ubase})
        assert (await harvest(cfg))["up"].ok
        up.delete("gone.txt")
        assert (await harvest(cfg))["up"].ok
        blobs = None if local else NoLocalPath(FileBlobStore(cfg.store_path / "blobs"))
        async with publishing(cfg, blobs=blobs) as (base, client):
            link = f'<{base}/up/capabilitylist.xml>; rel="resourcesync"'

            def held(path: str) -> str:  # a held resource also names its TimeGate and TimeMap (§14.6)
                return resource_link_header(base, f"{base}/up/capabilitylist.xml", "up", up.url(path))

            with state_of(cfg) as st:
                rows = {r.uri: r for r in st.iter_resources(include_deleted=True)}
            for path, v in up.resources().items():
                url = rsagg_uri(base, "up", up.url(path))
                r = await client.get(url)
                assert r.status_code == 200 and r.content == v.data
                assert r.headers["etag"] == f'"{v.sha256}"'
                assert r.headers["content-type"] == v.type
                assert r.headers["content-length"] == str(len(v.data))
                assert r.headers["link"] == held(path)
                row = rows[up.url(path)]
                assert r.headers["last-modified"] == format_datetime(row.updated_at, usegmt=True)
            url = rsagg_uri(base, "up", up.url("doc.txt"))
            data = up.resources()["doc.txt"].data
            etag = f'"{hashlib.sha256(data).hexdigest()}"'
            lm = (await client.head(url)).headers["last-modified"]
            # conditional GET
            for headers in (
                {"if-none-match": etag},
                {"if-none-match": f'"x", W/{etag}'},
                {"if-modified-since": lm},
            ):
                r = await client.get(url, headers=headers)
                assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == etag, headers
                assert r.headers["link"] == held("doc.txt")
            earlier = format_datetime(rows[up.url("doc.txt")].updated_at - timedelta(hours=1), usegmt=True)
            assert (await client.get(url, headers={"if-modified-since": earlier})).status_code == 200
            r = await client.get(url, headers={"if-none-match": '"other"', "if-modified-since": lm})
            assert r.status_code == 200  # If-None-Match decides when present (RFC 9110 §13.2.2)
            # ranges
            r = await client.get(url, headers={"range": "bytes=2-5"})
            assert r.status_code == 206 and r.content == data[2:6]
            assert r.headers["content-range"] == f"bytes 2-5/{len(data)}"
            assert (await client.get(url, headers={"range": "bytes=-3"})).content == data[-3:]
            assert (await client.get(url, headers={"range": "bytes=15-"})).content == data[15:]
            r = await client.get(url, headers={"range": "bytes=2-5", "if-range": '"stale"'})
            assert r.status_code == 200 and r.content == data
            r = await client.get(url, headers={"range": "bytes=2-5", "if-range": etag})
            assert r.status_code == 206
            assert (await client.get(url, headers={"range": "bytes=100-"})).status_code == 416
            # HEAD
            r = await client.head(url)
            assert r.status_code == 200 and r.content == b"" and r.headers["content-length"] == str(len(data))
            assert r.headers["etag"] == etag and r.headers["link"] == held("doc.txt")
            # deleted upstream -> 410; never held -> 404; unknown set -> 404
            r = await client.get(rsagg_uri(base, "up", up.url("gone.txt")))
            assert r.status_code == 410 and r.headers["link"] == held("gone.txt")
            r = await client.get(rsagg_uri(base, "up", up.url("never.txt")))
            assert r.status_code == 404 and r.headers["link"] == link
            assert (await client.get(rsagg_uri(base, "nope", up.url("doc.txt")))).status_code == 404
            assert (await client.get(f"{base}/up/r/1bad/x")).status_code == 404
            assert (await client.get(f"{base}/up/r/http/%FF")).status_code == 404


async def test_tricky_upstream_uris_are_served(tmp_path: Path):
    up = Upstream(resource_dump=False, change_dump=False)
    paths = ["a b?.txt", "caf\u00e9/\u6587.txt", "100%.txt", "x#y.txt"]
    for i, p in enumerate(paths):
        up.create(p, f"content {i}".encode())
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {"up": ubase})
        assert (await harvest(cfg))["up"].ok
        async with publishing(cfg) as (base, client):
            _, entries = await get_doc(client, f"{base}/up/resourcelist.xml")
            assert len(entries) == len(paths)
            for p in paths:
                loc = rsagg_uri(base, "up", up.url(p))
                assert loc in [e.loc for e in entries]
                r = await client.get(httpx.URL(loc))
                assert r.status_code == 200 and r.content == up.resources()[p].data, p


# ---------------------------------------------------------------------------------------------------
# change lists


async def test_change_list_windows_give_the_changelog_exactly(tmp_path: Path):
    up = Upstream(sets=("a", "b"), changes_per_list=None, resource_dump=False, change_dump=False)
    up.bulk_create(5, set_name="a")
    up.bulk_create(3, set_name="b")
    async with up.serving() as ubase:
        cfg = with_publish(make_config(tmp_path / "data", {"up": ubase}), changelist_size=3)
        assert (await harvest(cfg))["up"].ok
        for rnd in range(3):
            up.update(f"r{rnd:06d}.txt", f"round {rnd}".encode(), set_name="a")
            up.create(f"n{rnd}.txt", f"new {rnd}".encode(), set_name="b")
            if rnd == 1:
                up.delete("r000004.txt", set_name="a")
                up.delete("r000000.txt", set_name="b")
            assert (await harvest(cfg))["up"].ok
        names = set_names(cfg)
        async with publishing(cfg) as (base, client):
            with state_of(cfg) as st:
                last = st.last_seq()
                for name, sid in names.items():
                    log = list(st.iter_changelog(set_id=sid))
                    entries, heads, index = await changes_in_order(client, base, name)
                    # exactly the changelog of the set, in order: no gap, no repeat
                    assert [(e.loc, e.change, e.md.datetime) for e in entries] == [
                        (rsagg_uri(base, name, r.uri), r.change, r.datetime) for r in log
                    ]
                    for e, r in zip(entries, log, strict=True):
                        assert e.lastmod == r.datetime
                        if r.change != "deleted":
                            assert e.hashes["sha-256"] == r.sha256 and e.md.length == r.length
                    assert len(heads) > 1 and index, "windows of 3 over ~20 records: an index"
                    # windows: closed ones have until, the open one is last, back to back
                    assert all(h.md.until is not None for h in heads[:-1]) and heads[-1].md.until is None
                    for prev, nxt in itertools.pairwise(heads):
                        assert nxt.md.from_ == prev.md.until
                    for h, s in zip(heads, index, strict=True):
                        assert (s.md.from_, s.md.until) == (h.md.from_, h.md.until)
                        assert h.link("index").href == f"{base}/{name}/changelist.xml"
                    # only windows holding a record of the set are listed (plus the open one)
                    ks = [int(s.loc.rsplit("/", 1)[1][:-4]) for s in index]
                    with_records = {(r.seq - 1) // 3 + 1 for r in log}
                    assert set(ks[:-1]) <= with_records and ks[-1] == last // 3 + 1
                    assert with_records <= set(ks)
                    # a window not listed still answers; beyond the open one: 404
                    assert (await client.get(f"{base}/{name}/changelist/{ks[-1] + 1}.xml")).status_code == 404
            # a set whose records are in windows 1..n and another window is missing in between is
            # still back to back: checked above for both sets, which interleave in the global log.


async def test_single_window_is_the_open_change_list(tmp_path: Path):
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(4)
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {"up": ubase})
        assert (await harvest(cfg))["up"].ok
        async with publishing(cfg) as (base, client):
            head, entries = await get_doc(client, f"{base}/up/changelist.xml")
            assert not head.is_index and head.md.until is None and head.link("index") is None
            assert [e.change for e in entries] == ["created"] * 4
            assert all(head.md.from_ <= e.md.datetime for e in entries)
            same = await client.get(f"{base}/up/changelist/1.xml")
            assert same.status_code == 200 and parse_bytes(same.content)[1] == entries
            r = await client.head(f"{base}/up/changelist.xml")
            assert r.status_code == 200 and r.content == b""
            for bad in (
                "/up/changelist/0.xml",
                "/up/changelist/2.xml",
                "/zz/changelist.xml",
                "/zz/resourcelist.xml",
            ):
                assert (await client.get(base + bad)).status_code == 404, bad


# ---------------------------------------------------------------------------------------------------
# link policy end to end


KEEPABLE = (("collection", "http://up.example/coll/1"), ("canonical", "http://up.example/generic/r1"))


async def test_link_policy_end_to_end(tmp_path: Path):
    up = Upstream(mirror="ok", resource_dump=False, change_dump=False)
    origin_data = b"aggregated elsewhere first"
    up.create("meta1.xml", b"<meta/>", "application/xml")
    up.create(
        "r1.txt",
        b"resource one",
        extra_links=[
            Link("collection", "http://up.example/coll/1"),
            Link("canonical", "http://up.example/generic/r1"),
            Link(PATCH_REL, "http://up.example/r1.patch", type="application/json-patch+json"),
            Link("describedby", "/default/res/meta1.xml", type="application/xml"),
            Link("describes", "http://elsewhere.example/thing"),
            Link("alternate", "http://up.example/r1.html", type="text/html"),
            Link("license", "https://creativecommons.org/licenses/by/4.0/"),
        ],
    )
    origin_via = Link(
        "via",
        "http://origin.example/r2",
        modified=datetime(2020, 5, 6, 7, 8, 9, tzinfo=UTC),
        hash=f"md5:{hashlib.md5(origin_data).hexdigest()}",
        length=len(origin_data),
        type="text/plain",
    )
    up.create("r2.txt", origin_data, extra_links=[origin_via])
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {"up": ubase})
        assert (await harvest(cfg))["up"].ok
        v1 = up.resources()["r1.txt"]
        with state_of(cfg) as st:  # what the harvester stored: everything upstream wrote
            stored = {ln.rel for ln in st.resource(1, up.url("r1.txt")).links}
        assert {"duplicate", PATCH_REL, "collection", "canonical", "describedby"} <= stored
        for keep, kept_rels in ((False, set()), (True, {"collection", "canonical"})):
            pcfg = with_publish(cfg, keep_collection_links=keep, keep_canonical_links=keep)
            async with publishing(pcfg) as (base, client):
                _, rl = await get_doc(client, f"{base}/up/resourcelist.xml")
                _, cl = await get_doc(client, f"{base}/up/changelist.xml")
                for entries in (rl, cl):
                    by_loc = {e.loc: e for e in entries}
                    e1 = by_loc[rsagg_uri(base, "up", up.url("r1.txt"))]
                    rels = {(ln.rel, ln.href) for ln in e1.links if ln.rel not in VERSION_RELS}
                    assert rels == {
                        ("via", up.url("r1.txt")),
                        ("describedby", rsagg_uri(base, "up", up.url("meta1.xml"))),  # harvested: our copy
                        ("describes", "http://elsewhere.example/thing"),
                        ("alternate", "http://up.example/r1.html"),
                        ("license", "https://creativecommons.org/licenses/by/4.0/"),
                    } | {(r, h) for r, h in KEEPABLE if r in kept_rels}
                    (via,) = e1.links_by_rel("via")
                    assert via.modified == v1.lastmod and via.length == v1.length and via.type == v1.type
                    assert via.hashes == {"sha-256": v1.sha256, "md5": v1.md5}
                    e2 = by_loc[rsagg_uri(base, "up", up.url("r2.txt"))]
                    assert e2.links_by_rel("via") == [origin_via]  # chained: kept unchanged, alone
                    assert not any(ln.rel == "duplicate" for e in entries for ln in e.links)


# ---------------------------------------------------------------------------------------------------
# robots.txt, home page, grouping, the dump hook


async def test_robots_home_and_configured_grouping(tmp_path: Path):
    museum, gallery, library = Upstream(), Upstream(), Upstream()
    museum.bulk_create(2)
    gallery.bulk_create(3, prefix="g")
    library.bulk_create(1, prefix="l")
    async with museum.serving() as m, gallery.serving() as g, library.serving() as li:
        data = {
            "store": {"path": str(tmp_path / "data")},
            "harvest": {"retries": 1, "backoff_base": 0.01, "backoff_max": 0.05},
            "sources": [
                {"name": "museum", "url": m},
                {"name": "gallery", "url": g},
                {"name": "library", "url": li},
            ],
            "sets": [
                {"name": "art", "sources": ["museum", "gallery"], "describedby": "https://example.org/art"}
            ],
        }
        cfg = parse_config(data, str(tmp_path / "rsagg.toml"))
        results = await harvest(cfg)
        assert all(r.ok for r in results.values())
        async with publishing(cfg) as (base, client):
            docs = await walk(client, base)
            sd = docs[f"{base}/.well-known/resourcesync"][1]
            assert [e.loc for e in sd] == [
                f"{base}/art/capabilitylist.xml",
                f"{base}/library/capabilitylist.xml",
            ]
            assert [ln.href for ln in sd[0].links_by_rel("describedby")] == ["https://example.org/art"]
            cap_head, _ = docs[f"{base}/art/capabilitylist.xml"]
            assert cap_head.link("describedby").href == "https://example.org/art"
            art = listed_resources(docs, base, "art")
            expected = [museum.url(p) for p in museum.resources()] + [
                gallery.url(p) for p in gallery.resources()
            ]
            assert sorted(e.loc for e in art) == sorted(rsagg_uri(base, "art", u) for u in expected)
            entries, _, _ = await changes_in_order(client, base, "art")
            assert len(entries) == 5
            r = await client.get(rsagg_uri(base, "art", gallery.url("g000001.txt")))
            assert r.status_code == 200 and r.content == gallery.resources()["g000001.txt"].data
            assert r.headers["link"].startswith(f'<{base}/art/capabilitylist.xml>; rel="resourcesync", ')
            # robots.txt: a Sitemap line per set's Resource List (§6.3.4)
            r = await client.get(f"{base}/robots.txt")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            sitemaps = [ln.split(": ", 1)[1] for ln in r.text.splitlines() if ln.startswith("Sitemap:")]
            assert sitemaps == [f"{base}/art/resourcelist.xml", f"{base}/library/resourcelist.xml"]
            assert "User-agent: *" in r.text
            # home page: the sets, their counts, their documents
            r = await client.get(f"{base}/")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            for name, count in (("art", 5), ("library", 1)):
                assert f"<strong>{name}</strong>: {count} resources" in r.text
                for doc in ("capabilitylist", "resourcelist", "changelist"):
                    assert f'href="{base}/{name}/{doc}.xml"' in r.text
            assert f'href="{base}/.well-known/resourcesync"' in r.text


async def test_dump_hook(tmp_path: Path):
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(2)
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {"up": ubase})
        assert (await harvest(cfg))["up"].ok
        seen: list[str] = []

        async def resourcedump(request: Request) -> PlainTextResponse:
            pub: Publisher = request.app.state.publisher
            count = await pub.run(lambda st: st.count_live([1]))
            return PlainTextResponse(f"{request.path_params.get('set', 'up')}: {count}")

        def dumps_available(name: str) -> dict[str, str]:
            seen.append(name)
            base = holder["base"]
            return {
                "resourcedump": f"{base}/{name}/resourcedump.xml",
                "changedump": f"{base}/{name}/changedump.xml",
            }

        holder: dict[str, str] = {}
        routes = [Route("/{set}/resourcedump.xml", resourcedump), Route("/up/resourcelist.xml", resourcedump)]
        async with publishing(cfg, extra_routes=routes, dumps_available=dumps_available) as (base, client):
            holder["base"] = base
            _, caps = await get_doc(client, f"{base}/up/capabilitylist.xml")
            assert [(e.capability, e.loc) for e in caps] == [
                ("resourcelist", f"{base}/up/resourcelist.xml"),
                ("resourcedump", f"{base}/up/resourcedump.xml"),
                ("changelist", f"{base}/up/changelist.xml"),
                ("changedump", f"{base}/up/changedump.xml"),
            ]
            assert seen == ["up"]
            r = await client.get(f"{base}/up/resourcedump.xml")
            assert r.text == "up: 2"
            assert (await client.get(f"{base}/up/resourcelist.xml")).text == "up: 2"  # extra routes first
        async with publishing(cfg) as (base, client):  # default: no dump capabilities
            _, caps = await get_doc(client, f"{base}/up/capabilitylist.xml")
            assert [e.capability for e in caps] == ["resourcelist", "changelist"]


# ---------------------------------------------------------------------------------------------------
# State reads for publishing


def _chg(uri: str, data: bytes, change: str = "created") -> Change:
    return Change(uri, change, hashlib.sha256(data).hexdigest(), len(data), "text/plain")


def test_state_reads_for_publishing(tmp_path: Path):
    check_state_reads_for_publishing(lambda **kw: State(tmp_path / "state.db", **kw))


def check_state_reads_for_publishing(open_store: Callable[..., StateStore]) -> None:
    """The reads a published set is made of; ``open_store(readonly=...)`` opens the state under test
    (tests/test_state_postgres.py passes a PostgreSQL one)."""
    with open_store() as st:
        st.upsert_source("s", "http://s/")
        a = st.ensure_set("s", "http://s/a.xml")
        b = st.ensure_set("s", "http://s/b.xml")
        st.apply(a, [_chg(f"http://s/a{i}", b"a%d" % i) for i in range(5)])  # seq 1-5
        st.apply(b, [_chg(f"http://s/b{i}", b"b%d" % i) for i in range(3)])  # seq 6-8
        st.apply(a, [_chg("http://s/a1", b"", "deleted"), _chg("http://s/a2", b"new")])  # 9, 10
        st.apply(b, [_chg("http://s/a2", b"same uri, other set")])  # 11
        assert st.last_seq() == 11
        assert st.count_live([a]) == 4 and st.count_live([a, b]) == 8
        ids = [r.id for r in st.iter_live([a, b])]
        assert ids == sorted(ids) and len(ids) == 8
        assert st.live_part_boundaries([a, b], 3) == [ids[2], ids[5]]
        live_a = [r.id for r in st.iter_live([a])]  # one set, one part at a time: the same boundaries
        assert (
            st.live_part_boundaries([a], 2)
            == live_a[1::2]
            == [st.live_part_boundary(a, 0, 2), st.live_part_boundary(a, live_a[1], 2)]
        )
        assert st.live_part_boundary(a, live_a[3], 2) is None and st.live_part_boundary(a, 0, 4) == live_a[3]
        assert [r.uri for r in st.iter_live([a], after_id=ids[0], until_id=ids[3])] == [
            r.uri for r in st.iter_live([a]) if ids[0] < r.id <= ids[3]
        ]
        assert st.log_windows([a], 4) == [1, 2, 3] and st.log_windows([b], 4) == [2, 3]
        assert st.log_windows([b], 5) == [2, 3] and st.log_windows([a], 100) == [1]
        recs = list(st.iter_log_range([a, b], 4, 10))
        assert [r.seq for r, _ in recs] == [5, 6, 7, 8, 9, 10]
        assert [row.uri for _, row in recs] == [r.uri for r, _ in recs]
        assert recs[4][1].deleted and recs[4][0].change == "deleted"
        assert st.log_datetime(7) == next(r.datetime for r in st.iter_changelog() if r.seq == 7)
        assert st.log_datetime(0) is None
        assert st.history_start([a, b]) <= next(st.iter_changelog()).datetime
        both = st.resource_in([a, b], "http://s/a2")
        assert both.set_id == b  # the most recently changed live row
        assert st.resource_in([a], "http://s/a1").deleted and st.resource_in([a, b], "http://nope") is None
    with open_store(readonly=True) as ro:
        assert ro.count_live([a]) == 4
        with pytest.raises(Exception, match=r"readonly|read-only"):
            ro.upsert_source("t", "http://t/")


# ---------------------------------------------------------------------------------------------------
# interop: resync 2.0.1, the reference client, syncs from rsagg


RESYNC = str(Path(sys.executable).parent / "resync-sync")


async def resync(*args: str, cwd: Path) -> str:
    done = await trio.run_process(
        [RESYNC, *args], cwd=cwd, capture_stdout=True, capture_stderr=True, check=False
    )
    out = (done.stdout + done.stderr).decode()
    assert done.returncode == 0 and "Error" not in out, out  # resync exits 0 even after FatalError
    return out


def local_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def expected_files(up: Upstream, base: str) -> dict[str, bytes]:
    """How resync maps our URIs under BASE to files under DIR: DIR + the rest of the URI, verbatim."""
    return {rsagg_uri(base, "up", up.url(p))[len(base) + 1 :]: v.data for p, v in up.resources().items()}


async def test_resync_baseline_incremental_audit(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(documents, "MAX_ENTRIES", 7)  # resync reads a Resource List Index (one level)
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(12)
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {"up": ubase})
        assert (await harvest(cfg))["up"].ok
        # resync quirk: --incremental keeps the changes at or after its baseline's newest lastmod (>=)
        # and then drops a "created ... deleted" pair of a URI as a no-op. The creation records of the
        # newest batch before its baseline carry exactly that datetime (truthfully: it is when they
        # changed), so deleting one of THOSE later would leave it behind. A later batch before the
        # baseline moves its timestamp past the creations deleted below.
        up.update("r000011.txt", b"touched before the baseline\n")
        assert (await harvest(cfg))["up"].ok
        async with publishing(cfg) as (base, client):
            assert (await get_doc(client, f"{base}/up/resourcelist.xml"))[0].is_index
            dest, cwd = tmp_path / "dest", tmp_path / "cwd"
            cwd.mkdir()
            out = await resync("--baseline", "--delete", base, str(dest), cwd=cwd)
            assert "SYNCED" in out or "IN SYNC" in out, out
            assert local_files(dest) == expected_files(up, base)

            for i in range(3):
                up.update(f"r{i:06d}.txt", f"changed {i}\n".encode())
            up.delete("r000005.txt")
            up.delete("r000006.txt")
            up.create("fresh.txt", b"fresh\n")
            up.update("r000000.txt", b"changed twice\n")
            assert (await harvest(cfg))["up"].ok

            head, entries = await get_doc(client, f"{base}/up/changelist.xml")
            open_list = f"{base}/up/changelist.xml" if not head.is_index else entries[-1].loc
            out = await resync(
                "--incremental", "--delete", "--changelist-uri", open_list, base, str(dest), cwd=cwd
            )
            assert "CHANGES APPLIED" in out, out
            assert local_files(dest) == expected_files(up, base)

            out = await resync("--audit", "--hash", "md5", base, str(dest), cwd=cwd)
            assert "IN SYNC" in out and "NOT IN SYNC" not in out, out
