"""Follow what a Source links, or say so (docs/truth.md).

Lists paged with ``rel="next"`` are read to the end (harvest and audit) with a loop guard; a ``<urlset>``
whose entries are Resource Lists is read as the index it is, decided by fetching them; whatever rsagg
reads past without using makes the source ``degraded``, never ``ok``, and fails the audit naming it.

The Sources are built here from the implementations' public code, not from rsagg's writer:

- Heratio (ArchiveHeritageGroup/heratio, ``packages/ahg-resourcesync/src/Controllers/
  ResourceSyncController.php``): Resource List and Change List as offset pages linked by ``rel="next"``
  and ``rel="prev"`` written after the document's ``rs:md``; the Resource List's ``at`` and the Change
  List's ``until`` are the time of the request, its ``from`` that time minus a 30-day horizon; the
  Change List holds each live record once, at its ``updated_at``, ordered by it, *then* the tombstones
  ordered by deletion time; a record's ``<loc>`` is its slug URL while its tombstone's is
  ``/informationobject/by-oai/<id>`` (a URI it never had).
- POD, Platform for Open Discovery (pod4lib/aggregator views of November 2020 to March 2021,
  ``organizations/index.xml.builder``, ``streams/show.xml.builder``,
  ``streams/normalized_dump.xml.builder``): the Capability List names a Resource List "index" that is a
  ``<urlset>`` whose entries carry only ``<rs:md at=...>`` (before their ``<loc>``) and point at the
  organizations' stream Resource Lists; those start with ``<url>URI</url>`` (the "removed since the
  previous stream" file, no ``<loc>``) and give each file's ``<rs:md hash type length>`` before its
  ``<loc>``; a normalized-dump list may have no ``at``.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aggregator.harvest.audit import AuditError
from aggregator.harvest.lists import Cursor, ListRef, Position
from aggregator.harvest.pipeline import list_document
from aggregator.observe.report import lag_since
from tests.harvesting import audit, harvest, held, make_config
from tests.httpserver import serve_app
from tests.test_interop import NS, Site, doc, ln, status_of, url

XML = "application/xml"


def iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def audit_fails(cfg, *names: str) -> str:
    """The audit must fail (never "in sync") and name each of ``names``."""
    try:
        diffs = await audit(cfg)
    except AuditError as exc:
        text = str(exc)
        assert all(n in text for n in names), (text, names)
        return text
    raise AssertionError(f"audit reported {diffs} instead of failing on {names}")


# -- Heratio ------------------------------------------------------------------------------------------


@dataclass
class Record:
    id: int
    slug: str
    created: datetime
    updated: datetime
    body: bytes


class Heratio:
    """The shape of Heratio's ResourceSyncController, served from records in memory."""

    HORIZON = timedelta(days=30)

    def __init__(self, page_size: int = 3) -> None:
        self.page_size = page_size
        self.records: dict[int, Record] = {}
        self.tombstones: list[tuple[int, datetime]] = []
        self.base = ""
        self.hits: list[str] = []
        #: Called once after a Change List page has been rendered (a change while pages are read).
        self.after_page: dict[int, object] = {}
        self.clock = datetime.now(UTC).replace(microsecond=0) - timedelta(days=1)
        self.list_at = self.clock  # the Resource List's ``at`` of the last read of its first page
        self.live = False
        self.app = Starlette(
            routes=[
                Route("/.well-known/resourcesync", self.source_description),
                Route("/resourcesync/capabilitylist.xml", self.capability_list),
                Route("/resourcesync/resourcelist.xml", self.resource_list),
                Route("/resourcesync/changelist.xml", self.change_list),
                Route("/{slug}", self.record),
            ]
        )

    def tick(self) -> datetime:
        """Heratio's ``updated_at``: the time of the change, to the second. The records that exist
        before the test starts harvesting were made a day ago, one a second; later ones now."""
        if self.live:
            return datetime.now(UTC).replace(microsecond=0)
        self.clock += timedelta(seconds=1)
        return self.clock

    # the archive's own life
    def create(self, n: int) -> None:
        t = self.tick()
        self.records[n] = Record(n, f"record-{n}", t, t, f"record {n} v1".encode())

    def update(self, n: int, when: datetime | None = None) -> None:
        r = self.records[n]
        r.updated = when or self.tick()
        r.body = r.body[:-1] + bytes([r.body[-1] + 1])

    def delete(self, n: int) -> None:
        del self.records[n]
        self.tombstones.append((n, self.tick()))

    def loc(self, r: Record) -> str:
        return f"{self.base}/{r.slug}"

    # the controller
    async def source_description(self, request: Request) -> Response:
        self.hits.append(request.url.path)
        cap = url(f"{self.base}/resourcesync/capabilitylist.xml", 'capability="capabilitylist"')
        body = doc('capability="description"', cap, links=ln("describedby", f"{self.base}/oai/docs"))
        return Response(body, media_type=XML)

    async def capability_list(self, request: Request) -> Response:
        self.hits.append(request.url.path)
        body = doc(
            'capability="capabilitylist"',
            url(f"{self.base}/resourcesync/resourcelist.xml", 'capability="resourcelist"')
            + url(f"{self.base}/resourcesync/changelist.xml", 'capability="changelist"'),
            links=ln("up", f"{self.base}/.well-known/resourcesync"),
        )
        return Response(body, media_type=XML)

    def _page(self, request: Request, total: int) -> tuple[int, int, str]:
        page = max(1, int(request.query_params.get("page", 1)))
        pages = max(1, -(-total // self.page_size))
        path = request.url.path
        links = ""
        if page < pages:
            links += ln("next", f"{self.base}{path}?page={page + 1}")
        if page > 1:
            links += ln("prev", f"{self.base}{path}?page={page - 1}")
        return page, (page - 1) * self.page_size, links

    def _doc(self, md: str, links: str, body: str, up: str) -> str:
        # rel="up" before rs:md, next/prev after it, as Heratio writes them
        head = f'<?xml version="1.0" encoding="UTF-8"?>\n<urlset {NS}>\n'
        return f"{head}{up}<rs:md {md}/>\n{links}{body}</urlset>\n"

    def _entry(self, r: Record, change: str | None) -> str:
        ch = f'change="{change}" ' if change else ""
        return url(self.loc(r), f'{ch}datetime="{iso(r.updated)}"', lastmod=iso(r.updated))

    async def resource_list(self, request: Request) -> Response:
        self.hits.append(str(request.url.path) + "?" + str(request.url.query))
        live = sorted(self.records.values(), key=lambda r: r.id)
        page, offset, links = self._page(request, len(live))
        body = "".join(self._entry(r, None) for r in live[offset : offset + self.page_size])
        up = ln("up", f"{self.base}/resourcesync/capabilitylist.xml")
        # Heratio writes the time of the request, to the second. Two reads within one second would say
        # the same ``at``, so each read of the first page is given a later second than the one before
        # (the list moves on every read, as on a real server polled minutes apart: no test races the
        # clock); the later pages of a read carry their first page's.
        if page == 1:
            now = datetime.now(UTC).replace(microsecond=0)
            self.list_at = max(now, self.list_at + timedelta(seconds=1))
        return Response(
            self._doc(f'capability="resourcelist" at="{iso(self.list_at)}"', links, body, up),
            media_type=XML,
        )

    async def change_list(self, request: Request) -> Response:
        self.hits.append(str(request.url.path) + "?" + str(request.url.query))
        now = datetime.now(UTC)
        cutoff = now - self.HORIZON
        live = sorted(
            (r for r in self.records.values() if r.updated >= cutoff), key=lambda r: (r.updated, r.id)
        )
        tombs = sorted(((n, t) for n, t in self.tombstones if t >= cutoff), key=lambda x: (x[1], x[0]))
        page, offset, links = self._page(request, len(live) + len(tombs))
        rows = [("live", r) for r in live] + [("tomb", x) for x in tombs]
        body = ""
        for kind, item in rows[offset : offset + self.page_size]:
            if kind == "live":
                body += self._entry(item, "created" if item.created == item.updated else "updated")
            else:
                n, t = item
                loc = f"{self.base}/informationobject/by-oai/{n}"
                body += url(loc, f'change="deleted" datetime="{iso(t)}"', lastmod=iso(t))
        up = ln("up", f"{self.base}/resourcesync/capabilitylist.xml")
        md = f'capability="changelist" from="{iso(cutoff)}" until="{iso(now)}"'
        response = Response(self._doc(md, links, body, up), media_type=XML)
        hook = self.after_page.pop(page, None)
        if hook is not None:
            hook()
        return response

    async def record(self, request: Request) -> Response:
        self.hits.append(request.url.path)
        slug = request.path_params["slug"]
        for r in self.records.values():
            if r.slug == slug:
                return Response(r.body, media_type="text/html")
        return Response("not found", status_code=404)

    def expected(self) -> dict[str, str]:
        return {self.loc(r): sha256(r.body) for r in self.records.values()}


async def test_heratio_shaped_source_paged_lists_across_a_baseline_and_changes(tmp_path: Path) -> None:
    h = Heratio(page_size=3)
    for n in range(1, 8):
        h.create(n)
    async with serve_app(h.app) as base:
        h.base = base
        h.live = True
        cfg = make_config(tmp_path / "data", {"heratio": f"{base}/.well-known/resourcesync"})

        # Baseline: all 7 records (3 pages of the Resource List), not page 1 only.
        result = (await harvest(cfg))["heratio"]
        assert result.ok, result.error
        assert held(cfg) == h.expected() and len(held(cfg)) == 7
        assert "/resourcesync/resourcelist.xml?page=3" in h.hits
        assert await audit(cfg) == []
        row = status_of(cfg, "heratio")
        assert row["state"] == "ok" and row["skipped"] == [], row

        # Changes: updates that move records to the end of the window, creations, across pages.
        h.update(2)
        h.create(8)
        h.update(5)
        h.create(9)
        result = (await harvest(cfg))["heratio"]
        assert result.ok, result.error
        assert held(cfg) == h.expected()
        assert await audit(cfg) == []

        # A poll with nothing new: the position resumed exactly. Only the changes of the position's own
        # second are read again (Heratio orders one second's changes by id: a later one may come first).
        h.hits.clear()
        result = (await harvest(cfg))["heratio"]
        newest = max(r.updated for r in h.records.values())
        again = {f"/{r.slug}" for r in h.records.values() if r.updated == newest}
        assert result.ok and {p for p in h.hits if p.startswith("/record-")} <= again, (h.hits, again)
        assert held(cfg) == h.expected()

        # The window changes while its pages are read: record 1 is updated right after page 1 is
        # served, so every later entry shifts one place left and one change is on no page read.
        h.update(3)
        h.update(4)
        h.update(6)
        h.update(7)
        h.after_page[1] = lambda: h.update(1, datetime.now(UTC) + timedelta(seconds=5))
        result = (await harvest(cfg))["heratio"]
        assert result.ok, result.error
        result = (await harvest(cfg))["heratio"]  # the torn read is read again from its position
        assert result.ok, result.error
        assert held(cfg) == h.expected(), "a change lost between two pages of a sliding window"
        assert await audit(cfg) == []
        row = status_of(cfg, "heratio")
        assert row["state"] == "ok" and row["skipped"] == [], row


async def test_heratio_a_change_in_the_second_of_the_position_is_not_skipped(tmp_path: Path) -> None:
    """Heratio orders the changes of one second by record id: a change made in the second the position
    is at may come before the ones of that second already applied, and must not be skipped as one."""
    h = Heratio(page_size=2)
    for n in range(1, 6):
        h.create(n)
    async with serve_app(h.app) as base:
        h.base = base
        cfg = make_config(tmp_path / "data", {"heratio": f"{base}/.well-known/resourcesync"})
        assert (await harvest(cfg))["heratio"].ok
        second = datetime.now(UTC).replace(microsecond=0)
        h.update(4, second)
        h.update(5, second)
        assert (await harvest(cfg))["heratio"].ok  # the position: two changes of `second` applied
        h.update(3, second)  # listed before 4 and 5 (same second, lower id)
        assert (await harvest(cfg))["heratio"].ok
        assert held(cfg) == h.expected()
        assert await audit(cfg) == []


async def test_heratio_tombstone_names_a_uri_the_record_never_had(tmp_path: Path) -> None:
    """What Heratio really does: the tombstone's ``<loc>`` is ``/informationobject/by-oai/<id>`` while the
    record was listed (and held) at its slug URL, so the Change List never says the held URI is gone.
    rsagg applies the deletion it is told (of a URI it does not hold); the Resource List no longer lists
    the slug URI, and reconciliation with the Resource List removes it."""
    h = Heratio(page_size=3)
    for n in range(1, 6):
        h.create(n)
    async with serve_app(h.app) as base:
        h.base = base
        h.live = True
        cfg = make_config(tmp_path / "data", {"heratio": f"{base}/.well-known/resourcesync"})
        assert (await harvest(cfg))["heratio"].ok
        gone = h.loc(h.records[4])
        h.delete(4)
        result = (await harvest(cfg))["heratio"]
        assert result.ok, result.error
        assert f"{base}/informationobject/by-oai/4" not in held(cfg)
        # The Resource List's ``at`` moved (Heratio writes the time of the request): the set is
        # reconciled with it in the same sync, and the slug URI the Change List never named is deleted.
        assert [r.repaired for r in result.reconciled] == [{"deleted": 1}], result.reconciled
        assert gone not in held(cfg)
        assert await audit(cfg) == []
        assert status_of(cfg, "heratio")["state"] == "ok"


# -- paging: loops, unreachable pages, what is not followed -----------------------------------------


def paged_site(site: Site, pages: int = 3, per: int = 2) -> dict[str, bytes]:
    """A Resource List of ``pages`` pages linked by rel="next"/"prev", and its resources."""
    at = 'capability="resourcelist" at="2024-01-01T00:00:00Z"'
    site.pages["/capabilitylist.xml"] = doc(
        'capability="capabilitylist"', url("BASE/rl.xml", 'capability="resourcelist"')
    )
    bodies = {}
    for p in range(1, pages + 1):
        links = ln("next", f"BASE/rl.xml?page={p + 1}") if p < pages else ""
        links += ln("prev", f"BASE/rl.xml?page={p - 1}" if p > 2 else "BASE/rl.xml") if p > 1 else ""
        body = ""
        for i in range(per):
            name = f"/r{p}-{i}"
            site.pages[name] = bodies[name] = f"resource {p}.{i}".encode()
            body += url(f"BASE{name}")
        site.pages["/rl.xml" if p == 1 else f"/rl.xml?page={p}"] = doc(at, body, links=links)
    return bodies


async def test_a_paged_resource_list_is_read_to_the_end_in_harvest_and_audit(tmp_path: Path) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        bodies = paged_site(site, pages=4)
        cfg = make_config(tmp_path / "data", {"s": site.url("/capabilitylist.xml")})
        assert (await harvest(cfg))["s"].ok
        assert held(cfg) == {site.url(p): sha256(b) for p, b in bodies.items()}
        assert await audit(cfg) == []
        assert status_of(cfg, "s")["state"] == "ok"
        # The audit reads every page too: a resource dropped from the last page is found.
        last = doc('capability="resourcelist" at="2024-01-01T00:00:00Z"', url("BASE/r4-0"),
                   links=ln("prev", "BASE/rl.xml?page=3"))  # fmt: skip
        site.pages["/rl.xml?page=4"] = last
        assert [(d.kind, d.uri) for d in await audit(cfg)] == [("extra", site.url("/r4-1"))]


@pytest.mark.parametrize("loop_to", ["BASE/rl.xml", "BASE/rl.xml?page=2"])
async def test_a_page_loop_is_named_and_degrades_the_source(tmp_path: Path, loop_to: str) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        bodies = paged_site(site, pages=3)
        page3 = site.pages["/rl.xml?page=3"]
        site.pages["/rl.xml?page=3"] = page3.replace("<rs:md ", ln("next", loop_to) + "<rs:md ")
        cfg = make_config(tmp_path / "data", {"s": site.url("/capabilitylist.xml")})
        result = (await harvest(cfg))["s"]
        assert not result.ok and result.degraded, result
        assert "loop" in (result.error or "") and site.url("/rl.xml") in result.error
        row = status_of(cfg, "s")
        assert row["state"] == "degraded" and "loop" in row["last_error"]
        assert set(held(cfg)) == {site.url(p) for p in bodies}  # what was read is harvested
        await audit_fails(cfg, "loop")


async def test_a_page_that_cannot_be_reached_degrades_and_sweeps_nothing(tmp_path: Path) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        bodies = paged_site(site, pages=3)
        cfg = make_config(tmp_path / "data", {"s": site.url("/capabilitylist.xml")})
        assert (await harvest(cfg))["s"].ok
        page3 = site.pages.pop("/rl.xml?page=3")
        result = (await harvest(cfg))["s"]
        assert not result.ok, result
        assert status_of(cfg, "s")["state"] in {"degraded", "error"}
        assert set(held(cfg)) == {site.url(p) for p in bodies}  # nothing of page 3 was swept
        await audit_fails(cfg, site.url("/rl.xml?page=3"))
        site.pages["/rl.xml?page=3"] = page3
        assert (await harvest(cfg))["s"].ok
        assert status_of(cfg, "s")["state"] == "ok"


# -- "ok" only when understood: a table of unexpected structure, and random mixes of it ------------

T0 = "2024-01-01T00:00:00Z"
T1 = "2024-01-02T00:00:00Z"


def base_source(site: Site) -> None:
    """A Source rsagg understands completely: a Resource List of two pages and a Change List."""
    site.pages["/capabilitylist.xml"] = doc(
        'capability="capabilitylist"',
        url("BASE/rl.xml", 'capability="resourcelist"') + url("BASE/cl.xml", 'capability="changelist"'),
    )
    for name in ("a", "b", "c", "d"):
        site.pages[f"/{name}"] = f"resource {name}".encode()
    site.pages["/rl.xml"] = doc(f'capability="resourcelist" at="{T0}"', url("BASE/a") + url("BASE/b"),
                                links=ln("next", "BASE/rl-2.xml"))  # fmt: skip
    site.pages["/rl-2.xml"] = doc(f'capability="resourcelist" at="{T0}"', url("BASE/c"),
                                  links=ln("prev", "BASE/rl.xml"))  # fmt: skip
    site.pages["/cl.xml"] = doc(
        f'capability="changelist" from="{T0}"',
        url("BASE/d", f'change="created" datetime="{T1}"'),
    )


def _add_link(site: Site, page: str, link: str) -> None:
    site.pages[page] = site.pages[page].replace("<rs:md ", link + "<rs:md ", 1)


#: name -> what it does to the understood Source (each is structure rsagg would otherwise read past)
PERTURBATIONS = {
    "unknown rel on the Resource List": lambda s: _add_link(s, "/rl.xml", ln("http://example.org/rel/more",
                                                                             "BASE/more.xml")),
    "unknown rel on a later page": lambda s: _add_link(s, "/rl-2.xml", ln("successor", "BASE/rl-3.xml")),
    "unknown rel on the Change List": lambda s: _add_link(s, "/cl.xml", ln("more", "BASE/cl-2.xml")),
    "page loop": lambda s: _add_link(s, "/rl-2.xml", ln("next", "BASE/rl.xml")),
    "Resource List entry listed as deleted": lambda s: s.pages.__setitem__(
        "/rl.xml", s.pages["/rl.xml"].replace("</urlset>", url("BASE/d", 'change="deleted"') + "</urlset>")),
    "Change List page loop": lambda s: _add_link(s, "/cl.xml", ln("next", "BASE/cl.xml")),
    "page not reachable": lambda s: _add_link(s, "/rl-2.xml", ln("next", "BASE/rl-3.xml")),
    "page of another capability": lambda s: (
        _add_link(s, "/rl-2.xml", ln("next", "BASE/rl-3.xml")),
        s.pages.__setitem__("/rl-3.xml", doc(f'capability="changelist" from="{T0}"', "")),
    ),
    "prev on the advertised page": lambda s: _add_link(s, "/rl.xml", ln("prev", "BASE/rl-0.xml")),
    "Change List entry whose change is unknown": lambda s: s.pages.__setitem__(
        "/cl.xml", s.pages["/cl.xml"].replace("</urlset>", url("BASE/a", f'change="moved" datetime="{T1}"')
                                              + "</urlset>")),
    "rel=next after the Change List's entries": lambda s: s.pages.__setitem__(
        "/cl.xml", s.pages["/cl.xml"].replace("</urlset>", ln("next", "BASE/cl-2.xml") + "</urlset>")),
    "Resource List entry that is a Change List": lambda s: (
        s.pages.__setitem__("/rl-2.xml", s.pages["/rl-2.xml"].replace(
            "</urlset>", url("BASE/cl-old.xml", f'from="{T0}"') + "</urlset>")),
        s.pages.__setitem__("/cl-old.xml", doc(f'capability="changelist" from="{T0}"', "")),
    ),
    "Resource List entry that is a list but does not say so": lambda s: (
        s.pages.__setitem__("/rl-2.xml", s.pages["/rl-2.xml"].replace("</urlset>", url("BASE/hidden.xml")
                                                                      + "</urlset>")),
        s.pages.__setitem__("/hidden.xml", doc(f'capability="resourcelist" at="{T0}"', url("BASE/e"))),
    ),
    "Resource List entry whose list cannot be read": lambda s: s.pages.__setitem__(
        "/rl-2.xml", s.pages["/rl-2.xml"].replace("</urlset>", url("BASE/gone.xml", f'at="{T0}"')
                                                  + "</urlset>")),
}  # fmt: skip


async def _never_ok(tmp_path: Path, names: list[str]) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        base_source(site)
        for name in names:
            PERTURBATIONS[name](site)
        cfg = make_config(tmp_path / "data", {"s": site.url("/capabilitylist.xml")})
        for poll in range(2):  # the baseline (Resource List), then the incremental poll (Change List)
            result = (await harvest(cfg))["s"]
            row = status_of(cfg, "s")
            if poll == 0 and all("Change List" in n for n in names):
                continue  # a baseline does not read the Change List: nothing unexpected seen yet
            assert not result.ok and row["state"] != "ok", (names, row)
            assert row["last_error"], (names, row)
        try:
            diffs = await audit(cfg)
        except Exception:
            return
        assert diffs, f"audit in sync despite {names}"


async def test_a_source_rsagg_understands_is_ok(tmp_path: Path) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        base_source(site)
        cfg = make_config(tmp_path / "data", {"s": site.url("/capabilitylist.xml")})
        for _poll in range(2):
            assert (await harvest(cfg))["s"].ok
        assert status_of(cfg, "s")["state"] == "ok"
        assert set(held(cfg)) == {site.url(f"/{n}") for n in "abcd"}
        assert await audit(cfg) == []


@pytest.mark.parametrize("name", sorted(PERTURBATIONS))
async def test_unexpected_structure_is_never_ok(tmp_path: Path, name: str) -> None:
    await _never_ok(tmp_path, [name])


@pytest.mark.parametrize("seed", range(6))
async def test_random_mixes_of_unexpected_structure_are_never_ok(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    names = rng.sample(sorted(PERTURBATIONS), rng.randint(2, 4))
    await _never_ok(tmp_path, names)


# -- POD, 2020-21 -------------------------------------------------------------------------------------


def pod_site(site: Site, orgs: dict[str, dict[str, bytes]], normalized: dict[str, bytes]) -> dict[str, bytes]:
    """POD's ResourceSync as its views wrote it in 2020-21; returns path -> body of every resource."""
    xsi = ('xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" xsi:schemaLocation="http://www.sitemaps.org/'
           'schemas/sitemap/0.9 http://www.sitemaps.org/schemas/sitemap/0.9/sitemap.xsd" ')  # fmt: skip

    def urlset(inner: str) -> str:
        return f'<?xml version="1.0" encoding="UTF-8"?>\n<urlset {xsi}{NS}>\n{inner}</urlset>\n'

    def file_entry(path: str, data: bytes) -> str:
        md5 = hashlib.md5(data).hexdigest()
        return (f'<url><rs:md hash="md5:{md5}" type="application/marc" length="{len(data)}"/>'
                f"<loc>BASE{path}</loc><lastmod>2020-11-10T12:00:00Z</lastmod></url>\n")  # fmt: skip

    resources: dict[str, bytes] = {}
    site.pages["/.well-known/resourcesync"] = urlset(
        '<rs:md capability="description"/>\n'
        '<url><loc>BASE/capabilitylist.xml</loc><rs:md capability="capabilitylist"/></url>\n'
        '<url><loc>BASE/normalized/capabilitylist.xml</loc><rs:md capability="capabilitylist"/></url>\n'
    )
    for prefix, index in (("", "/organizations/resourcelist"), ("/normalized", "/normalized/resourcelist")):
        site.pages[f"{prefix}/capabilitylist.xml"] = urlset(
            '<rs:ln rel="up" href="BASE/.well-known/resourcesync"/><rs:md capability="capabilitylist"/>\n'
            f'<url><loc>BASE{index}</loc><rs:md capability="resourcelist"/></url>\n'
        )
    # the "index": a <urlset> of Resource Lists, each entry only <rs:md at>, before its <loc>
    site.pages["/organizations/resourcelist"] = urlset(
        '<rs:ln rel="up" href="BASE/capabilitylist.xml"/>'
        '<rs:md capability="resourcelist" at="2021-01-05T10:00:00Z"/>\n'
        + "".join(f'<url><rs:md at="2021-01-0{i + 1}T00:00:00Z"/><loc>BASE/organizations/{org}/streams/1/'
                  f"resourcelist</loc></url>\n" for i, org in enumerate(orgs))
    )  # fmt: skip
    for org, files in orgs.items():
        removed = f"/organizations/{org}/streams/1/removed_since_previous_stream"
        site.pages[removed] = resources[removed] = f"removed from {org}: none\n".encode()
        body = f"<url>BASE{removed}</url>\n"  # text, no <loc>
        for name, data in files.items():
            path = f"/rails/active_storage/blobs/{org}/{name}"
            site.pages[path] = resources[path] = data
            body += file_entry(path, data)
        site.pages[f"/organizations/{org}/streams/1/resourcelist"] = urlset(
            '<rs:ln rel="up" href="BASE/organizations/resourcelist"/>'
            f'<rs:md capability="resourcelist" at="2021-01-0{len(org) % 5 + 1}T00:00:00Z"/>\n{body}'
        )
    site.pages["/normalized/resourcelist"] = urlset(
        '<rs:ln rel="up" href="BASE/normalized/capabilitylist.xml"/>'
        '<rs:md capability="resourcelist" at="2021-01-05T10:00:00Z"/>\n'
        + "".join(f'<url><rs:md at="2021-01-02T00:00:00Z"/><loc>BASE/organizations/{org}/streams/1/'
                  f"normalized_resourcelist/marcxml</loc></url>\n" for org in orgs)
    )  # fmt: skip
    for org in orgs:
        data = normalized.get(org)
        inner = '<rs:ln rel="up" href="BASE/normalized/resourcelist"/>'
        if data is None:  # a normalized dump not made yet: the list has no `at` and no entries
            inner += '<rs:md capability="resourcelist"/>\n'
        else:
            path = f"/rails/active_storage/blobs/{org}/full.xml.gz"
            site.pages[path] = resources[path] = data
            inner += '<rs:md capability="resourcelist" at="2021-01-02T00:00:00Z"/>\n' + file_entry(path, data)
        site.pages[f"/organizations/{org}/streams/1/normalized_resourcelist/marcxml"] = urlset(inner)
    return resources


async def test_pod_2020_shaped_source(tmp_path: Path) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        orgs = {
            "stanford": {"2020-11-01.mrc": b"\x00marc stanford 1", "2020-11-08.mrc": b"\x00marc stanford 2"},
            "cornell": {"full.mrc": b"\x00marc cornell"},
        }
        resources = pod_site(site, orgs, {"stanford": b"<collection>stanford</collection>"})
        cfg = make_config(tmp_path / "data", {"pod": site.url("/.well-known/resourcesync")})
        for _poll in range(2):
            result = (await harvest(cfg))["pod"]
            assert result.ok, result.error
        # Every file and no list document: compared entry by entry with what the Source lists.
        assert held(cfg) == {site.url(p): sha256(b) for p, b in resources.items()}
        assert not [u for u in held(cfg) if u.endswith("resourcelist") or "normalized_resourcelist" in u]
        assert await audit(cfg) == []
        row = status_of(cfg, "pod")
        assert row["state"] == "ok" and row["skipped"] == [] and row["last_error"] is None, row
        rules = {d["rule"] for d in row["deviations"]}
        assert rules >= {"list-in-urlset", "loc-as-text", "md-before-loc", "at-missing"}, rules

        # A new stream file replaces another: the lists are re-read and the store follows them.
        orgs["cornell"] = {"2021-01-04.mrc": b"\x00marc cornell, the next year"}
        resources = pod_site(site, orgs, {"stanford": b"<collection>stanford</collection>"})
        assert (await harvest(cfg))["pod"].ok
        assert held(cfg) == {site.url(p): sha256(b) for p, b in resources.items()}
        assert await audit(cfg) == []


# -- lag for Change Lists without datetimes ------------------------------------------------------------


def test_lag_of_a_change_list_without_datetimes_counts_from_the_last_complete_read() -> None:
    at = datetime(2024, 1, 1, tzinfo=UTC)
    success = datetime(2024, 6, 1, tzinfo=UTC)
    # changes without datetime applied: the position stays at the snapshot's `at`
    pos = Position(Cursor(at, None, at, 0, 0, None))
    cur = pos.advance(None, ListRef("http://e.com/cl.xml", None, None), 1)
    assert cur.last_datetime == at and cur.changelist_url
    assert lag_since(cur, success) == (success, "change list read")
    # with datetimes, the position is the last change applied (the lag basis stays the Change List)
    dated = pos.advance(datetime(2024, 5, 1, tzinfo=UTC), ListRef("http://e.com/cl.xml", None, None), 2)
    assert lag_since(dated, success) == (datetime(2024, 5, 1, tzinfo=UTC), "change list")
    # a sync that was not complete is no success: without one, the position is all there is
    assert lag_since(cur, None) == (at, "change list")


async def test_lag_does_not_grow_while_polls_of_an_undated_change_list_succeed(tmp_path: Path) -> None:
    site = Site()
    async with serve_app(site.app) as base:
        site.base = base
        site.pages["/a"] = b"a"
        site.pages["/b"] = b"b"
        site.pages["/capabilitylist.xml"] = doc(
            'capability="capabilitylist"',
            url("BASE/rl.xml", 'capability="resourcelist"') + url("BASE/cl.xml", 'capability="changelist"'),
        )
        site.pages["/rl.xml"] = doc('capability="resourcelist" at="2020-01-01T00:00:00Z"', url("BASE/a"))
        site.pages["/cl.xml"] = doc('capability="changelist" from="2020-01-01T00:00:00Z"',
                                    url("BASE/b", 'change="created"'))  # fmt: skip
        cfg = make_config(tmp_path / "data", {"s": site.url("/capabilitylist.xml")})
        for _poll in range(3):
            assert (await harvest(cfg))["s"].ok
        row = status_of(cfg, "s")
        assert row["lag_basis"] == "change list read", row
        # years after the snapshot's `at`, but counted from the last poll, which read everything
        assert row["lag_seconds"] is not None and row["lag_seconds"] < 24 * 3600, row
        assert "change-without-datetime" not in {d["rule"] for d in row["deviations"]}


# -- a list document fetched as a resource -----------------------------------------------------------

RS_DOC = (
    f'<urlset {NS}><rs:md capability="resourcelist" at="{T0}"/><url><loc>http://e.com/a</loc></url></urlset>'
)


class _Peek:
    tmp_path = None

    def __init__(self, body: bytes) -> None:
        self.body = body

    def peek(self, n: int) -> bytes:
        return self.body[:n]


@pytest.mark.parametrize(
    ("body", "capability"),
    [
        (RS_DOC.encode(), "resourcelist"),
        (b'<?xml version="1.0" encoding="UTF-8"?>\n' + RS_DOC.encode(), "resourcelist"),
        (b"\xef\xbb\xbf <!-- made by hand -->\n" + RS_DOC.replace("resourcelist", "changelist").encode(),
         "changelist"),
        (RS_DOC.replace("<urlset", "<sitemapindex").replace("</urlset>", "</sitemapindex>").encode(),
         "resourcelist"),
        (b'<sm:urlset xmlns:sm="http://www.sitemaps.org/schemas/sitemap/0.9" '
         b'xmlns:rs="http://www.openarchives.org/rs/terms/"><rs:md capability="capabilitylist"/>',
         "capabilitylist"),
        (b'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9"><url><loc>x</loc></url>', None),
        (b'<feed xmlns:rs="http://www.openarchives.org/rs/terms/"><urlset><rs:md capability="x"/>', None),
        (b"<html><body>urlset rs:md capability</body></html>", None),
        (b"\x00\x01marc record", None),
        (b"", None),
    ],
)  # fmt: skip
def test_a_fetched_body_that_is_a_resourcesync_document_is_told(body: bytes, capability: str | None) -> None:
    assert list_document(_Peek(body)) == capability
