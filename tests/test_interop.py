"""Sources shaped like the ResourceSync other implementations publish (docs/interop.md), and the rule
that keeps rsagg truthful about them: lenient in what it reads, never "ok"/"in sync" when a list was
skipped.

The shapes are built here from the implementations' public code and documentation (not from rsagg's
own writer): WEKO3 (invenio-resourcesyncserver), CORE (its publisher connector, as read by
go-resourcesync), DSpace ResourceSync (ResourceSyncJava). Each scenario ends with an audit in sync and
the source's status ``ok``; the deviations rsagg tolerated are listed in the status.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aggregator.config import Config
from aggregator.harvest.deviations import Deviations, collecting
from aggregator.harvest.fetch import Fetcher
from aggregator.harvest.lists import Snapshot, resource_list_entries
from aggregator.observe.report import collect, table
from aggregator.rs.model import Entry, Head, Link
from aggregator.store.state import State
from tests.harvesting import audit, changelog, harvest, held, make_config
from tests.httpserver import serve_app

NS = 'xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" xmlns:rs="http://www.openarchives.org/rs/terms/"'
XML = "application/xml"


def doc(md: str, body: str = "", *, links: str = "", root: str = "urlset") -> str:
    return f'<?xml version="1.0" encoding="UTF-8"?>\n<{root} {NS}>\n{links}<rs:md {md}/>\n{body}</{root}>\n'


def url(loc: str, md: str = "", *, lastmod: str | None = None, links: str = "", tag: str = "url") -> str:
    lm = f"<lastmod>{lastmod}</lastmod>" if lastmod else ""
    return f"<{tag}><loc>{loc}</loc>{lm}{f'<rs:md {md}/>' if md else ''}{links}</{tag}>\n"


def ln(rel: str, href: str) -> str:
    return f'<rs:ln rel="{rel}" href="{href}"/>'


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def package(manifest: str, members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("manifest.xml", manifest)
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


class Site:
    """An upstream: path -> body (``BASE`` in a text body becomes the server's URL) or bytes."""

    def __init__(self) -> None:
        self.pages: dict[str, str | bytes] = {}
        self.hits: list[str] = []
        self.base = ""
        self.app = Starlette(routes=[Route("/{path:path}", self.serve)])

    async def serve(self, request: Request) -> Response:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        self.hits.append(path)
        body = self.pages.get(path)
        if body is None:
            return Response("not found", status_code=404, media_type="text/plain")
        if isinstance(body, bytes):
            return Response(body, media_type="application/octet-stream")
        return Response(body.replace("BASE", self.base), media_type=XML)

    def url(self, path: str) -> str:
        return self.base + path


def status_of(config: Config, name: str) -> dict:
    with State(config.store_path / "state.db") as state:
        status = collect(state, config)
    (row,) = [r for r in status["sources"] if r["name"] == name]
    row["_table"] = table(status)
    return row


async def assert_ok_and_in_sync(config: Config, name: str) -> dict:
    result = (await harvest(config))[name]
    assert result.ok, result.error
    assert await audit(config) == []
    row = status_of(config, name)
    assert row["state"] == "ok" and row["last_error"] is None and row["skipped"] == [], row
    return row


def rules(row: dict) -> set[str]:
    return {d["rule"] for d in row["deviations"]}


# -- WEKO3 ------------------------------------------------------------------------------------------
# invenio-resourcesyncserver: one Capability List for the repository naming a Resource List, a Resource
# Dump and a Change List *per repository index*; lists built with the resync library without `at`;
# times with microseconds and "+00:00"; a Change List Index written as <urlset> whose entries carry
# capability="changelist" with from/until; changes with lastmod and an `at` but no datetime; one dump
# package per record whose manifest paths are "recid_N/file" (no leading '/').

WEKO_T0 = "2024-01-05T07:21:51.592519+00:00"
WEKO_T1 = "2024-02-01T00:00:00+00:00"


def weko_record(n: int, version: int = 1) -> bytes:
    return f'{{"recid": {n}, "title": "record {n}", "version": {version}}}'.encode()


def weko_site(site: Site, records: dict[int, dict[int, bytes]], changes: dict[int, str]) -> None:
    """records: index -> {recid: content}; changes: index -> <url> entries of its open Change List."""
    caps = ""
    for index, recs in records.items():
        path = f"/resync/{index}"
        caps += url(f"BASE{path}/resourcelist.xml", 'capability="resourcelist"')
        caps += url(f"BASE{path}/resourcedump.xml", 'capability="resourcedump"')
        caps += url(f"BASE{path}/changelist.xml", 'capability="changelist"')
        up = ln("up", "BASE/resync/capability.xml")
        site.pages[f"{path}/resourcelist.xml"] = doc(
            'capability="resourcelist"',
            "".join(url(f"BASE/records/{n}", lastmod=WEKO_T0) for n in recs),
            links=up,
        )
        dumps = ""
        for n, data in recs.items():
            manifest = doc(
                'capability="resourcedump-manifest"',
                url(
                    site.url(f"/records/{n}"),
                    f'hash="sha-256:{sha256(data)}" length="{len(data)}" path="recid_{n}/record.json"',
                    lastmod=WEKO_T0,
                ),
                links=ln("up", f"BASE{path}/resourcedump.xml"),
            ).replace("BASE", site.base)
            site.pages[f"{path}/{n}/file_content.zip"] = package(manifest, {f"recid_{n}/record.json": data})
            site.pages[f"{path}/{n}/resourcedump_manifest.xml"] = manifest
            dumps += url(
                f"BASE{path}/{n}/file_content.zip",
                lastmod=WEKO_T0,
                links=f'<rs:ln rel="contents" href="BASE{path}/{n}/resourcedump_manifest.xml" '
                'type="application/xml"/>',
            )
        site.pages[f"{path}/resourcedump.xml"] = doc('capability="resourcedump"', dumps, links=up)
        # The Change List "index": a <urlset>, entries are change lists by period (from/until).
        site.pages[f"{path}/changelist.xml"] = doc(
            'capability="changelist"',
            url(
                f"BASE{path}/20240101/changelist.xml",
                'capability="changelist" from="2024-01-01T00:00:00+00:00" until="2024-02-01T00:00:00+00:00"',
            )
            + url(
                f"BASE{path}/20240201/changelist.xml",
                'capability="changelist" from="2024-02-01T00:00:00+00:00" until="2099-01-01T00:00:00+00:00"',
            ),
            links=up,
        )
        site.pages[f"{path}/20240101/changelist.xml"] = doc('capability="changelist"', "", links=up)
        site.pages[f"{path}/20240201/changelist.xml"] = doc(
            'capability="changelist"', changes.get(index, ""), links=up
        )
        for n, data in recs.items():
            site.pages[f"/records/{n}"] = data
    site.pages["/resync/capability.xml"] = doc('capability="capabilitylist"', caps)


async def test_weko3_shaped_source(tmp_path: Path) -> None:
    site = Site()
    records = {1001: {1: weko_record(1), 2: weko_record(2)}, 1002: {3: weko_record(3), 4: weko_record(4)}}
    async with serve_app(site.app) as base:
        site.base = base
        weko_site(site, records, {})
        cfg = make_config(tmp_path / "data", {"weko": site.url("/resync/capability.xml")})
        row = await assert_ok_and_in_sync(cfg, "weko")
        # Both indexes' lists harvested into one set, from their dumps (no record fetched on its own).
        assert held(cfg) == {site.url(f"/records/{n}"): sha256(weko_record(n)) for n in (1, 2, 3, 4)}
        assert not [h for h in site.hits if h.startswith("/records/")]
        assert rules(row) >= {"capability-repeated", "dump-path-no-slash"}, row["deviations"]
        assert len(row["sets"]) == 1
        assert "capability-repeated" in row["_table"]

        # Index 1001: record 1 updated, record 2 deleted (its lastmod is the old one, before the list's
        # from), record 5 created with a lastmod before the list's from (§12.1, Example 19). No datetime.
        records[1001] = {1: weko_record(1, 2), 5: weko_record(5)}
        changes = {
            1001: url(
                "BASE/records/1", 'change="updated" at="2024-02-03T10:00:00.000001+00:00"', lastmod=WEKO_T1
            )
            + url("BASE/records/2", 'change="deleted" at="2024-02-03T10:00:01+00:00"', lastmod=WEKO_T0)
            + url("BASE/records/5", 'change="created" at="2024-02-03T10:00:02+00:00"', lastmod=WEKO_T0)
        }
        weko_site(site, records, changes)
        site.hits.clear()
        row = await assert_ok_and_in_sync(cfg, "weko")
        want = {1: weko_record(1, 2), 3: weko_record(3), 4: weko_record(4), 5: weko_record(5)}
        assert held(cfg) == {site.url(f"/records/{n}"): sha256(d) for n, d in want.items()}
        kinds = [(u.rsplit("/", 1)[1], c) for u, c, _ in changelog(cfg)[4:]]
        assert sorted(kinds) == [("1", "updated"), ("2", "deleted"), ("5", "created")]
        assert rules(row) >= {"capability-repeated", "index-as-urlset"}
        assert "change-without-datetime" not in rules(row)  # §7, §12.1: datetime *may* be given

        # Read again: applied by content (no hash announced: fetched and compared), nothing changes.
        before = changelog(cfg)
        await assert_ok_and_in_sync(cfg, "weko")
        assert changelog(cfg) == before


# -- CORE ------------------------------------------------------------------------------------------
# The publisher connector: /resourcesync/.well-known/resourcesync (under a path, not the site root),
# a Capability List whose Resource List is a <sitemapindex> of parts with at/completed, parts linking
# `up` and `index`, <loc> padded with newlines and tabs, md5 hashes, and rel="describedBy" links to a
# JSON metadata record; dump packages with manifest paths without the leading '/'.


def core_site(site: Site, pdfs: dict[str, bytes]) -> None:
    root = "/resourcesync/sitemaps/Frontiers/pdf"
    site.pages["/resourcesync/.well-known/resourcesync"] = doc(
        'capability="description"', url(f"BASE{root}/capabilitylist.xml", 'capability="capabilitylist"')
    )
    site.pages[f"{root}/capabilitylist.xml"] = doc(
        'capability="capabilitylist"',
        url(f"\n\tBASE{root}/resourcelist-index.xml\n\t", 'capability="resourcelist"')
        + url(f"\n\tBASE{root}/resourcedump.xml\n\t", 'capability="resourcedump"'),
        links=ln("UP", "BASE/resourcesync/.well-known/resourcesync"),
    )
    names = sorted(pdfs)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    site.pages[f"{root}/resourcelist-index.xml"] = doc(
        'at="2017-05-16T13:55:36Z" capability="resourcelist" completed="2017-05-16T13:56:17Z"',
        "".join(
            url(f"\n\tBASE{root}/resourcelist_000{i}.xml\n\t", 'at="2017-05-16T13:55:38Z"', tag="sitemap")
            for i in range(2)
        ),
        links=ln("up", f"BASE{root}/capabilitylist.xml"),
        root="sitemapindex",
    )
    manifest_entries = ""
    for i, half in enumerate(halves):
        entries = ""
        for name in half:
            data = pdfs[name]
            loc = f"BASE/resourcesync/data/Frontiers/pdf/000/{name}.pdf"
            meta = f"BASE/resourcesync/data/Frontiers/metadata/000/{name}.json"
            md = f'hash="md5:{md5(data)}" length="{len(data)}" type="application/pdf"'
            entries += url(
                f"\n\t{loc}\n\t", md, lastmod="2017-04-12T19:45:43Z", links=ln("describedBy", meta)
            )
            manifest_entries += url(loc, md + f' path="pdf/000/{name}.pdf"', lastmod="2017-04-12T19:45:43Z")
            site.pages[f"/resourcesync/data/Frontiers/pdf/000/{name}.pdf"] = data
            site.pages[f"/resourcesync/data/Frontiers/metadata/000/{name}.json"] = (
                b'{"title": "%s"}' % name.encode()
            )
        site.pages[f"{root}/resourcelist_000{i}.xml"] = doc(
            'at="2017-05-16T13:56:11Z" capability="resourcelist" completed="2017-05-16T13:56:16Z"',
            entries,
            links=ln("up", f"BASE{root}/capabilitylist.xml")
            + ln("index", f"BASE{root}/resourcelist-index.xml"),
        )
    manifest = doc('capability="resourcedump-manifest" at="2017-05-16T13:55:36Z"', manifest_entries)
    members = {f"pdf/000/{n}.pdf": pdfs[n] for n in names}
    zipped = package(manifest.replace("BASE", site.base), members)
    site.pages[f"{root}/dump/part0.zip"] = zipped
    site.pages[f"{root}/resourcedump.xml"] = doc(
        'capability="resourcedump" at="2017-05-16T13:55:36Z"',
        url(f"BASE{root}/dump/part0.zip", f'type="application/zip" length="{len(zipped)}"'),
    )


async def test_core_shaped_source(tmp_path: Path) -> None:
    site = Site()
    pdfs = {f"aHR0cDovL2pvdXJuYWwu{i}": (b"%%PDF-1.4 paper %d " % i) * 50 for i in range(6)}
    async with serve_app(site.app) as base:
        site.base = base
        core_site(site, pdfs)
        cfg = make_config(tmp_path / "data", {"core": site.url("/resourcesync/.well-known/resourcesync")})
        row = await assert_ok_and_in_sync(cfg, "core")
        assert len(held(cfg)) == 6
        assert not [h for h in site.hits if h.endswith(".pdf")]  # from the dump
        assert "dump-path-no-slash" in rules(row)
        # describedBy reaches what reads metadata links (filters, the publisher's link policy).
        async with Fetcher(retries=0) as fetcher:
            index = site.url("/resourcesync/sitemaps/Frontiers/pdf/resourcelist-index.xml")
            with collecting(Deviations("core")) as noted:
                entries = [e async for e in resource_list_entries(fetcher, index, Snapshot())]
        assert len(entries) == 6 and all(e.loc.startswith(base) for e in entries)  # padded locs stripped
        assert all(e.links_by_rel("describedby") for e in entries)
        assert noted.notes["rel-case"].count == 6


# -- DSpace ResourceSync ------------------------------------------------------------------------------
# ResourceSyncJava as DSpace uses it: a Capability List with resourcelist, changelist-archive and the
# latest changelist; bitstreams without lastmod (length and type only) with describedby links to the
# metadata URL and `collection` links; metadata entries with lastmod and rs:ln rel="describedby"
# href="oai_dc" (a format name: relative); a Change List Archive as <sitemapindex> whose entries carry
# only lastmod; changes without datetime where a new item is "updated" (DSpace cannot tell created).


def dspace_site(site: Site, items: dict[str, bytes], changes: str) -> None:
    entries = ""
    for handle, data in items.items():
        meta = f"BASE/rs/{handle}?format=oai_dc"
        entries += url(
            f"BASE/bitstream/{handle}/1/file.pdf",
            f'type="application/pdf" length="{len(data)}"',
            links=ln("describedby", meta) + ln("collection", "BASE/123456789/1"),
        )
        entries += url(
            meta,
            'type="application/xml"',
            lastmod="2015-03-01T10:00:00Z",
            links=ln("describedby", "oai_dc") + ln("describes", f"BASE/bitstream/{handle}/1/file.pdf"),
        )
        site.pages[f"/bitstream/{handle}/1/file.pdf"] = data
        site.pages[f"/rs/{handle}?format=oai_dc"] = b"<oai_dc:dc>%s</oai_dc:dc>" % handle.encode()
    up = ln("up", "BASE/rs/capabilitylist.xml")
    site.pages["/rs/resourcelist.xml"] = doc(
        'capability="resourcelist" at="2015-03-01T12:00:00Z"', entries, links=up
    )
    site.pages["/rs/changelist-archive.xml"] = doc(
        'capability="changelist-archive" from="2015-03-01T00:00:00Z" until="2015-03-01T12:00:00Z"',
        url("BASE/rs/changelist/2015-03-01.xml", lastmod="2015-03-01T12:00:00Z", tag="sitemap"),
        links=up,
        root="sitemapindex",
    )
    site.pages["/rs/changelist/2015-03-01.xml"] = doc('capability="changelist"', "", links=up)
    site.pages["/rs/changelist/latest.xml"] = doc('capability="changelist"', changes, links=up)
    site.pages["/rs/capabilitylist.xml"] = doc(
        'capability="capabilitylist"',
        url("BASE/rs/resourcelist.xml", 'capability="resourcelist"')
        + url("BASE/rs/changelist-archive.xml", 'capability="changelist-archive"')
        + url("BASE/rs/changelist/latest.xml", 'capability="changelist"'),
    )


async def test_dspace_shaped_source(tmp_path: Path) -> None:
    site = Site()
    items = {"123456789/10": b"%PDF paper ten" * 20, "123456789/11": b"%PDF paper eleven" * 20}
    async with serve_app(site.app) as base:
        site.base = base
        dspace_site(site, items, "")
        cfg = make_config(tmp_path / "data", {"dspace": site.url("/rs/capabilitylist.xml")})
        row = await assert_ok_and_in_sync(cfg, "dspace")
        assert len(held(cfg)) == 4  # two bitstreams, two metadata records
        assert "relative-loc" in rules(row)  # href="oai_dc"

        # A new item (announced as "updated"), a changed bitstream, a withdrawn item ("deleted").
        items = {"123456789/10": b"%PDF paper ten, revised" * 20, "123456789/12": b"%PDF paper twelve" * 20}
        changes = ""
        for handle in ("123456789/10", "123456789/12"):
            changes += url(
                f"BASE/bitstream/{handle}/1/file.pdf",
                f'change="updated" type="application/pdf" length="{len(items[handle])}"',
            )
            changes += url(
                f"BASE/rs/{handle}?format=oai_dc", 'change="updated"', lastmod="2015-03-02T10:00:00Z"
            )
        changes += url("BASE/bitstream/123456789/11/1/file.pdf", 'change="deleted"')
        changes += url(
            "BASE/rs/123456789/11?format=oai_dc", 'change="deleted"', lastmod="2015-03-01T10:00:00Z"
        )
        dspace_site(site, items, changes)
        site.pages.pop("/bitstream/123456789/11/1/file.pdf")
        row = await assert_ok_and_in_sync(cfg, "dspace")
        assert held(cfg) == {
            **{site.url(f"/bitstream/{h}/1/file.pdf"): sha256(d) for h, d in items.items()},
            **{
                site.url(f"/rs/{h}?format=oai_dc"): sha256(b"<oai_dc:dc>%s</oai_dc:dc>" % h.encode())
                for h in items
            },
        }
        assert "change-without-datetime" not in rules(row)  # §7, §12.1: datetime *may* be given


# -- the rule: never "ok" or "in sync" with a list skipped -------------------------------------------


async def test_a_list_rsagg_cannot_read_never_reports_ok_or_in_sync(tmp_path: Path) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        site.pages["/r1"] = b"one"
        site.pages["/r2"] = b"two"
        site.pages["/capabilitylist.xml"] = doc(
            'capability="capabilitylist"',
            url("BASE/rl-good.xml", 'capability="resourcelist"')
            + url("BASE/rl-bad.xml", 'capability="resourcelist"'),
        )
        site.pages["/rl-good.xml"] = doc(
            'capability="resourcelist" at="2024-01-01T00:00:00Z"', url("BASE/r1")
        )
        site.pages["/rl-bad.xml"] = doc(
            'capability="resourcelist" at="2024-01-01T00:00:00Z"', url("BASE/r2")
        ).replace("</urlset>", "<url><loc>BASE/r3</loc>")  # truncated: not well-formed
        cfg = make_config(tmp_path / "data", {"s": site.url("/capabilitylist.xml")})
        result = (await harvest(cfg))["s"]
        bad = site.url("/rl-bad.xml")
        assert not result.ok and result.degraded and bad in result.skipped, result
        assert bad in (result.error or "")
        row = status_of(cfg, "s")
        assert row["state"] == "degraded" and [k["url"] for k in row["skipped"]] == [bad]
        assert bad in row["last_error"] and "SKIPPED" in row["_table"]
        # What the readable list holds is harvested; nothing is swept for the unread one.
        assert set(held(cfg)) >= {site.url("/r1")}
        try:
            diffs = await audit(cfg)
        except Exception as exc:  # the audit names the list it could not read
            assert bad in str(exc)
        else:
            raise AssertionError(f"audit reported {diffs} instead of failing on {bad}")

        # Once the list is readable again, the source is ok and in sync.
        site.pages["/rl-bad.xml"] = doc('capability="resourcelist" at="2024-01-01T00:00:00Z"', url("BASE/r2"))
        await assert_ok_and_in_sync(cfg, "s")
        assert set(held(cfg)) == {site.url("/r1"), site.url("/r2")}


# -- one test per tolerated deviation that the scenarios above do not pin down -----------------------


async def test_relative_locs_are_resolved_against_the_document(tmp_path: Path) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        site.pages["/sub/a.txt"] = b"a"
        site.pages["/b.txt"] = b"b"
        site.pages["/sub/capabilitylist.xml"] = doc(
            'capability="capabilitylist"', url("resourcelist.xml", 'capability="resourcelist"')
        )
        site.pages["/sub/resourcelist.xml"] = doc(
            'capability="resourcelist" at="2024-01-01T00:00:00Z"', url("a.txt") + url("../b.txt")
        )
        cfg = make_config(tmp_path / "data", {"rel": site.url("/sub/capabilitylist.xml")})
        row = await assert_ok_and_in_sync(cfg, "rel")
        assert set(held(cfg)) == {site.url("/sub/a.txt"), site.url("/b.txt")}
        (note,) = [d for d in row["deviations"] if d["rule"] == "relative-loc"]
        assert note["count"] == 2 and note["url"] == site.url("/sub/resourcelist.xml") and note["line"] == 4


async def test_a_change_list_index_written_as_sitemapindex_of_changes_is_read_as_a_list(
    tmp_path: Path,
) -> None:
    """The reverse of WEKO3's: a <sitemapindex> whose entries are changes."""
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        site.pages["/a"] = b"a1"
        site.pages["/capabilitylist.xml"] = doc(
            'capability="capabilitylist"',
            url("BASE/rl.xml", 'capability="resourcelist"') + url("BASE/cl.xml", 'capability="changelist"'),
        )
        site.pages["/rl.xml"] = doc('capability="resourcelist" at="2024-01-01T00:00:00Z"', url("BASE/a"))
        site.pages["/cl.xml"] = doc(
            'capability="changelist" from="2024-01-01T00:00:00Z"', root="sitemapindex"
        )
        cfg = make_config(tmp_path / "data", {"rev": site.url("/capabilitylist.xml")})
        await assert_ok_and_in_sync(cfg, "rev")
        site.pages["/a"] = b"a2, changed"
        site.pages["/cl.xml"] = doc(
            'capability="changelist" from="2024-01-01T00:00:00Z"',
            url("BASE/a", 'change="updated" datetime="2024-01-02T00:00:00Z"', tag="sitemap"),
            root="sitemapindex",
        )
        row = await assert_ok_and_in_sync(cfg, "rev")
        assert held(cfg) == {site.url("/a"): sha256(b"a2, changed")}
        assert "list-as-sitemapindex" in rules(row)


def test_relation_types_compare_case_insensitively() -> None:
    """RFC 8288 §2.1.1: registered relation types are case-insensitive."""
    e = Entry(
        "http://x/a", links=[Link("describedBy", "http://x/m"), Link("alternate DUPLICATE", "http://x/d")]
    )
    assert [ln.href for ln in e.links_by_rel("describedby")] == ["http://x/m"]
    assert [ln.href for ln in e.links_by_rel("duplicate")] == ["http://x/d"]
    head = Head(links=[Link("UP", "http://x/cl.xml")])
    assert head.link("up") is not None and head.link("up").href == "http://x/cl.xml"
    assert head.link("index") is None


# -- indexes of dumps and ResourceSync Archives ------------------------------------------------------


def dump_package(site: Site, names: list[str], at: str) -> bytes:
    entries = "".join(
        url(site.url(f"/{n}"), f'length="{len(site.pages[f"/{n}"])}" path="/{n}"') for n in names
    )
    return package(
        doc(f'capability="resourcedump-manifest" at="{at}"', entries), {n: site.pages[f"/{n}"] for n in names}
    )


async def test_resource_dump_index_is_read_part_by_part(tmp_path: Path) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        at = "2024-01-01T00:00:00Z"
        for n in ("a", "b", "c"):
            site.pages[f"/{n}"] = f"content of {n}".encode()
        site.pages["/p1.zip"] = dump_package(site, ["a", "b"], at)
        site.pages["/p2.zip"] = dump_package(site, ["c"], at)
        for i in (1, 2):
            site.pages[f"/rd-{i}.xml"] = doc(f'capability="resourcedump" at="{at}"', url(f"BASE/p{i}.zip"))
        site.pages["/rd-index.xml"] = doc(
            f'capability="resourcedump" at="{at}"',
            url("BASE/rd-1.xml", tag="sitemap") + url("BASE/rd-2.xml", tag="sitemap"),
            root="sitemapindex",
        )
        site.pages["/rl.xml"] = doc(
            f'capability="resourcelist" at="{at}"', "".join(url(f"BASE/{n}") for n in "abc")
        )
        site.pages["/capabilitylist.xml"] = doc(
            'capability="capabilitylist"',
            url("BASE/rl.xml", 'capability="resourcelist"')
            + url("BASE/rd-index.xml", 'capability="resourcedump"'),
        )
        cfg = make_config(tmp_path / "data", {"rdi": site.url("/capabilitylist.xml")})
        await assert_ok_and_in_sync(cfg, "rdi")
        assert len(held(cfg)) == 3
        assert "/p1.zip" in site.hits and "/p2.zip" in site.hits
        assert not {"/a", "/b", "/c"} & set(site.hits)


@pytest.mark.parametrize("advertised", ["in the capability list", "by rel=archives"])
async def test_a_change_list_archive_bridges_what_the_open_change_list_no_longer_covers(
    tmp_path: Path, advertised: str
) -> None:
    """Archives draft: closed Change Lists move to a changelist-archive. rsagg reads them from its
    position instead of calling the interval lost (a gap) and re-baselining from a stale list."""
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        t1, t2 = "2024-01-10T00:00:00Z", "2024-01-20T00:00:00Z"
        site.pages["/a"] = b"a, first"
        site.pages["/rl.xml"] = doc(f'capability="resourcelist" at="{t1}"', url("BASE/a"))
        caps = url("BASE/rl.xml", 'capability="resourcelist"') + url("BASE/cl.xml", 'capability="changelist"')
        archives = ""
        if advertised == "in the capability list":
            caps += url("BASE/cl-archive.xml", 'capability="changelist-archive"')
        else:
            archives = ln("archives", "BASE/cl-archive.xml")
        site.pages["/capabilitylist.xml"] = doc('capability="capabilitylist"', caps)
        site.pages["/cl.xml"] = doc(f'capability="changelist" from="{t1}"', links=archives)
        site.pages["/cl-archive.xml"] = doc('capability="changelist-archive"')
        cfg = make_config(tmp_path / "data", {"arc": site.url("/capabilitylist.xml")})
        await assert_ok_and_in_sync(cfg, "arc")

        # The list from t1 to t2 is closed and archived; the open list starts at t2.
        site.pages["/a"] = b"a, second"
        site.pages["/b"] = b"b"
        site.pages["/cl-1.xml"] = doc(
            f'capability="changelist" from="{t1}" until="{t2}"',
            url("BASE/a", 'change="updated" datetime="2024-01-11T00:00:00Z"'),
        )
        site.pages["/cl-archive.xml"] = doc(
            'capability="changelist-archive"', url("BASE/cl-1.xml", f'from="{t1}" until="{t2}"')
        )
        site.pages["/cl.xml"] = doc(
            f'capability="changelist" from="{t2}"',
            url("BASE/b", 'change="created" datetime="2024-01-21T00:00:00Z"'),
            links=archives,
        )
        result = (await harvest(cfg))["arc"]
        assert result.ok and result.gaps == 0 and result.baselines == 0, result
        assert held(cfg) == {site.url("/a"): sha256(b"a, second"), site.url("/b"): sha256(b"b")}
        await assert_ok_and_in_sync(cfg, "arc")


def test_spec_archive_examples_are_read() -> None:
    """The Archives draft's examples parse as the capability each names (tests/data/spec-examples)."""
    from aggregator.rs.parse import parse_bytes

    folder = Path(__file__).parent / "data" / "spec-examples"
    seen = set()
    for path in sorted(folder.glob("archives_ex_*.xml")):
        head, entries = parse_bytes(path.read_bytes(), str(path))
        seen.add(head.capability)
        if head.capability and head.capability.endswith("-archive"):
            assert entries and all(e.loc.startswith("http://example.com/") for e in entries)
    assert {
        "resourcelist-archive",
        "changelist-archive",
        "resourcedump-archive",
        "changedump-archive",
    } <= seen


async def test_change_dump_index_packages_are_read_part_by_part(tmp_path: Path) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        t0, t1, t2 = "2024-01-01T00:00:00Z", "2024-01-02T00:00:00Z", "2024-01-03T00:00:00Z"
        site.pages["/a"] = b"a0"
        site.pages["/b"] = b"b0"
        site.pages["/rl.xml"] = doc(f'capability="resourcelist" at="{t0}"', url("BASE/a") + url("BASE/b"))
        site.pages["/cl.xml"] = doc(f'capability="changelist" from="{t0}"')
        site.pages["/cd-index.xml"] = doc(f'capability="changedump" from="{t0}"', root="sitemapindex")
        site.pages["/capabilitylist.xml"] = doc(
            'capability="capabilitylist"',
            url("BASE/rl.xml", 'capability="resourcelist"')
            + url("BASE/cl.xml", 'capability="changelist"')
            + url("BASE/cd-index.xml", 'capability="changedump"'),
        )
        cfg = make_config(tmp_path / "data", {"cdi": site.url("/capabilitylist.xml")})
        await assert_ok_and_in_sync(cfg, "cdi")

        # Two closed intervals, each packaged (§13), each package in its own Change Dump under an index.
        changes = [("a", b"a1", "2024-01-01T12:00:00Z", t0, t1), ("b", b"b1", "2024-01-02T12:00:00Z", t1, t2)]
        entries = ""
        for i, (name, data, when, start, end) in enumerate(changes, 1):
            site.pages[f"/{name}"] = data
            change = url(
                site.url(f"/{name}"),
                f'change="updated" datetime="{when}" length="{len(data)}" path="/{name}"',
            )
            manifest = doc(f'capability="changedump-manifest" from="{start}" until="{end}"', change)
            site.pages[f"/cd-{i}.zip"] = package(manifest, {name: data})
            site.pages[f"/cd-{i}.xml"] = doc(
                f'capability="changedump" from="{start}" until="{end}"',
                url(f"BASE/cd-{i}.zip", f'from="{start}" until="{end}" type="application/zip"'),
            )
            entries += url(f"BASE/cd-{i}.xml", f'from="{start}" until="{end}"', tag="sitemap")
            site.pages["/cl.xml"] = site.pages["/cl.xml"].replace(
                "</urlset>", url("BASE/" + name, f'change="updated" datetime="{when}"') + "</urlset>"
            )
        site.pages["/cd-index.xml"] = doc(
            f'capability="changedump" from="{t0}"', entries, root="sitemapindex"
        )
        site.hits.clear()
        await assert_ok_and_in_sync(cfg, "cdi")
        assert held(cfg) == {site.url("/a"): sha256(b"a1"), site.url("/b"): sha256(b"b1")}
        assert {"/cd-1.zip", "/cd-2.zip"} <= set(site.hits)
        assert not {"/a", "/b"} & set(site.hits)  # the changes came in the packages


def test_the_time_of_a_change_is_its_datetime_never_its_lastmod() -> None:
    """§7/§12.1: lastmod is the resource's modification time. Without a datetime a change is never
    taken as applied by position: it goes to the pipeline, which applies it by content."""
    from datetime import UTC, datetime

    from aggregator.harvest.lists import ListRef, Position, when
    from aggregator.rs.model import Md
    from aggregator.store.rows import Cursor

    at = datetime(2024, 1, 10, tzinfo=UTC)
    old = datetime(2020, 1, 1, tzinfo=UTC)
    deletion = Entry("http://x/a", lastmod=old, md=Md(change="deleted"))
    assert when(deletion) is None
    pos = Position(Cursor(at, None, at, 0, 0, None))
    ref = ListRef("http://x/cl.xml", None, None)
    assert not pos.is_applied(when(deletion), ref.url, 1)
    # Read again at the same place of the same list: still not skipped (resync-build rewrites in place).
    after = pos.advance(None, ref, 1)
    assert not Position(after).is_applied(None, ref.url, 1)
    assert after.last_datetime == at  # the cursor does not move for it
    # With a datetime, the cursor rules: before it, applied; after it, not; ties counted.
    assert pos.is_applied(datetime(2024, 1, 9, tzinfo=UTC), ref.url, 2)
    assert not pos.is_applied(datetime(2024, 1, 11, tzinfo=UTC), ref.url, 3)
    tie = Position(Cursor(at, None, at, 1, 0, None))
    assert tie.is_applied(at, ref.url, 1) and not tie.is_applied(at, ref.url, 2)


def test_deviations_are_logged_once_per_document_and_counted_each_time(caplog) -> None:
    from aggregator.observe.metrics import Metrics

    metrics = Metrics(process=False)
    noted = Deviations("s", metrics.deviation)
    with collecting(noted), caplog.at_level("WARNING", logger="rsagg.harvest"):
        from aggregator.harvest.deviations import deviation

        for line in (3, 4, 5):
            deviation("relative-loc", "http://x/rl.xml", line, f"relative <loc> on line {line}")
        deviation("relative-loc", "http://x/other.xml", 7, "relative <loc>")
    assert [r.getMessage().count("relative-loc") for r in caplog.records] == [1, 1]  # once per document
    assert "line 3" in caplog.records[0].getMessage()
    assert noted.notes["relative-loc"].as_dict() == {
        "rule": "relative-loc", "count": 4, "url": "http://x/rl.xml", "line": 3,
        "message": "relative <loc> on line 3",
    }  # fmt: skip
    text = metrics.exposition().decode()
    assert 'rsagg_upstream_deviations_total{rule="relative-loc",source="s"} 4.0' in text


async def test_a_source_with_only_a_resource_list_archive_is_baselined_from_its_newest_list(
    tmp_path: Path,
) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        site.pages["/a"] = b"a"
        site.pages["/b"] = b"b"
        site.pages["/rl-old.xml"] = doc('capability="resourcelist" at="2012-11-03T09:00:00Z"', url("BASE/a"))
        site.pages["/rl-new.xml"] = doc(
            'capability="resourcelist" at="2013-01-03T09:00:00Z"', url("BASE/a") + url("BASE/b")
        )
        site.pages["/rl-archive.xml"] = doc(
            'capability="resourcelist-archive"',
            url("BASE/rl-new.xml", 'at="2013-01-03T09:00:00Z"')
            + url("BASE/rl-old.xml", 'at="2012-11-03T09:00:00Z"'),
        )
        site.pages["/capabilitylist.xml"] = doc(
            'capability="capabilitylist"', url("BASE/rl-archive.xml", 'capability="resourcelist-archive"')
        )
        cfg = make_config(tmp_path / "data", {"old": site.url("/capabilitylist.xml")})
        await assert_ok_and_in_sync(cfg, "old")
        assert set(held(cfg)) == {site.url("/a"), site.url("/b")}
        assert "/rl-old.xml" not in site.hits


@pytest.mark.parametrize("contents_link", [True, False])
async def test_a_dump_only_set_is_audited_against_its_manifests(tmp_path: Path, contents_link: bool) -> None:
    """A set offering only a Resource Dump is compared with its packages' manifests: through §11.1's
    rel=contents link, or, that link being optional, out of the package itself."""
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        at = "2024-01-01T00:00:00Z"
        site.pages["/a"] = b"a"
        site.pages["/p.zip"] = dump_package(site, ["a"], at)
        with zipfile.ZipFile(io.BytesIO(site.pages["/p.zip"])) as z:
            site.pages["/p-manifest.xml"] = z.read("manifest.xml").decode()
        links = ln("contents", "BASE/p-manifest.xml") if contents_link else ""
        site.pages["/rd.xml"] = doc(f'capability="resourcedump" at="{at}"', url("BASE/p.zip", links=links))
        site.pages["/capabilitylist.xml"] = doc(
            'capability="capabilitylist"', url("BASE/rd.xml", 'capability="resourcedump"')
        )
        cfg = make_config(tmp_path / "data", {"dump": site.url("/capabilitylist.xml")})
        assert (await harvest(cfg))["dump"].ok
        assert set(held(cfg)) == {site.url("/a")}
        site.hits.clear()
        assert await audit(cfg) == []
        assert ("/p-manifest.xml" in site.hits) == contents_link
        assert ("/p.zip" in site.hits) == (not contents_link)


async def test_a_stale_change_without_datetime_is_superseded_not_a_failure(tmp_path: Path) -> None:
    """resync-build writes its change list once; the files keep changing. A replayed entry announcing
    an old hash, for a resource that serves what rsagg holds, is superseded: no failure, no change.
    Content that matches neither is still a fixity failure."""
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        site.pages["/a"] = b"version 2"
        site.pages["/rl.xml"] = doc('capability="resourcelist" at="2024-01-01T00:00:00Z"', url("BASE/a"))
        site.pages["/cl.xml"] = doc('capability="changelist"')
        site.pages["/capabilitylist.xml"] = doc(
            'capability="capabilitylist"',
            url("BASE/rl.xml", 'capability="resourcelist"') + url("BASE/cl.xml", 'capability="changelist"'),
        )
        cfg = make_config(tmp_path / "data", {"stale": site.url("/capabilitylist.xml")})
        await harvest(cfg)
        site.pages["/cl.xml"] = doc(
            'capability="changelist"', url("BASE/a", f'change="updated" hash="md5:{md5(b"version 1")}"')
        )
        before = changelog(cfg)
        result = (await harvest(cfg))["stale"]
        assert result.ok and not result.failures, result.error
        assert changelog(cfg) == before and held(cfg) == {site.url("/a"): sha256(b"version 2")}
        site.pages["/a"] = b"version 3"  # matches neither the announcement nor what is held
        result = (await harvest(cfg))["stale"]
        assert not result.ok and [f.kind for f in result.failures] == ["fixity"]
        assert held(cfg) == {site.url("/a"): sha256(b"version 2")}


async def test_other_specifications_capabilities_and_bad_values_are_noted_not_fatal(tmp_path: Path) -> None:
    """§9 lets a Capability List name capabilities of other specifications; a value §7 does not allow
    (here a lastmod that is no W3C Datetime) costs that value, not the entry. Both are listed."""
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        site.pages["/a"] = b"a"
        site.pages["/capabilitylist.xml"] = doc(
            'capability="capabilitylist"',
            url("BASE/rl.xml", 'capability="resourcelist"')
            + url("BASE/other.json", 'capability="x-oai-pmh"'),
        )
        site.pages["/rl.xml"] = doc(
            'capability="resourcelist" at="2024-01-01T00:00:00Z"', url("BASE/a", lastmod="yesterday")
        )
        cfg = make_config(tmp_path / "data", {"other": site.url("/capabilitylist.xml")})
        row = await assert_ok_and_in_sync(cfg, "other")
        assert rules(row) == {"unknown-capability", "value"}
        assert "/other.json" not in site.hits


async def test_a_capability_list_of_the_source_description_that_cannot_be_read_degrades_the_source(
    tmp_path: Path,
) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        site.pages["/a"] = b"a"
        site.pages["/.well-known/resourcesync"] = doc(
            'capability="description"',
            url("BASE/set1/capabilitylist.xml", 'capability="capabilitylist"')
            + url("BASE/set2/capabilitylist.xml", 'capability="capabilitylist"'),
        )
        site.pages["/set1/capabilitylist.xml"] = doc(
            'capability="capabilitylist"', url("BASE/set1/rl.xml", 'capability="resourcelist"')
        )
        site.pages["/set1/rl.xml"] = doc('capability="resourcelist" at="2024-01-01T00:00:00Z"', url("BASE/a"))
        cfg = make_config(tmp_path / "data", {"two": site.url("/.well-known/resourcesync")})
        result = (await harvest(cfg))["two"]
        missing = site.url("/set2/capabilitylist.xml")
        assert result.degraded and not result.ok and missing in result.skipped, result
        assert set(held(cfg)) == {site.url("/a")}
        assert status_of(cfg, "two")["state"] == "degraded"
        with pytest.raises(Exception, match="set2"):
            await audit(cfg)


async def test_fewer_resource_dumps_than_resource_lists_baseline_from_the_lists(tmp_path: Path) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        at = "2024-01-01T00:00:00Z"
        for n in ("a", "b"):
            site.pages[f"/{n}"] = f"content of {n}".encode()
        site.pages["/p.zip"] = dump_package(site, ["a"], at)
        site.pages["/rd.xml"] = doc(f'capability="resourcedump" at="{at}"', url("BASE/p.zip"))
        for n in ("a", "b"):
            site.pages[f"/rl-{n}.xml"] = doc(f'capability="resourcelist" at="{at}"', url(f"BASE/{n}"))
        site.pages["/capabilitylist.xml"] = doc(
            'capability="capabilitylist"',
            url("BASE/rl-a.xml", 'capability="resourcelist"')
            + url("BASE/rl-b.xml", 'capability="resourcelist"')
            + url("BASE/rd.xml", 'capability="resourcedump"'),
        )
        cfg = make_config(tmp_path / "data", {"few": site.url("/capabilitylist.xml")})
        await assert_ok_and_in_sync(cfg, "few")
        assert set(held(cfg)) == {site.url("/a"), site.url("/b")}
        assert "/p.zip" not in site.hits
