"""Discovery of a Source's sets (§6.3, §8, §9) against a real local HTTP server: harvest/discovery.py."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aggregator.harvest.discovery import (
    DiscoveryError,
    discover,
    html_links,
    robots_sitemaps,
)
from aggregator.harvest.fetch import Fetcher
from aggregator.rs.linkheader import links_with_rel, parse_link_header
from tests.httpserver import serve_app

XML = "application/xml"
NS = 'xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" xmlns:rs="http://www.openarchives.org/rs/terms/"'


def urlset(md: str, *, links: str = "", urls: str = "", root: str = "urlset") -> str:
    return f'<?xml version="1.0" encoding="UTF-8"?>\n<{root} {NS}>{links}<rs:md {md}/>{urls}</{root}>'


def url(loc: str, md: str = "", links: str = "", tag: str = "url") -> str:
    return f"<{tag}><loc>{loc}</loc>{f'<rs:md {md}/>' if md else ''}{links}</{tag}>"


def ln(rel: str, href: str) -> str:
    return f'<rs:ln rel="{rel}" href="{href}"/>'


DESCRIPTION = urlset(
    'capability="description"',
    links=ln("describedby", "BASE/about.html"),
    urls=url("BASE/set1/capabilitylist.xml", 'capability="capabilitylist"')
    + url("BASE/set2/capabilitylist.xml", 'capability="capabilitylist"'),
)
CAPLIST1 = urlset(
    'capability="capabilitylist"',
    links=ln("up", "BASE/.well-known/resourcesync"),
    urls=url("BASE/set1/resourcelist.xml", 'capability="resourcelist"')
    + url("BASE/set1/changelist.xml", 'capability="changelist"')
    + url("BASE/set1/notify", 'capability="change-notification"', ln("hub", "BASE/hub")),
)
CAPLIST2 = urlset(
    'capability="capabilitylist"',
    links=ln("up", "BASE/.well-known/resourcesync"),
    urls=url("BASE/set2/resourcedump.xml", 'capability="resourcedump"'),
)
RESOURCELIST1 = urlset(
    'capability="resourcelist" at="2013-01-03T09:00:00Z"',
    links=ln("up", "BASE/set1/capabilitylist.xml"),
    urls=url("BASE/res1") + url("BASE/res2"),
)
BARE_RESOURCELIST = urlset('capability="resourcelist" at="2013-01-03T09:00:00Z"', urls=url("BASE/res1"))
PLAIN_SITEMAP = f'<?xml version="1.0"?><urlset {NS}><url><loc>BASE/page</loc></url></urlset>'


class Site:
    """A programmable upstream: path -> (body with BASE placeholders, content type, extra headers)."""

    def __init__(self, pages: dict[str, tuple[str, str] | tuple[str, str, dict[str, str]]]) -> None:
        self.pages = pages
        self.hits: list[str] = []
        self.app = Starlette(routes=[Route("/{path:path}", self.serve)])

    async def serve(self, request: Request) -> Response:
        path = request.url.path
        self.hits.append(path)
        page = self.pages.get(path)
        if page is None:
            return Response("not found", status_code=404, media_type="text/plain")
        body, ctype, *rest = page
        base = f"{request.url.scheme}://{request.url.netloc}"
        headers = {k: v.replace("BASE", base) for k, v in (rest[0] if rest else {}).items()}
        return Response(body.replace("BASE", base), media_type=ctype, headers=headers)


def full_site() -> dict:
    return {
        "/.well-known/resourcesync": (DESCRIPTION, XML),
        "/set1/capabilitylist.xml": (CAPLIST1, XML),
        "/set2/capabilitylist.xml": (CAPLIST2, XML),
        "/set1/resourcelist.xml": (RESOURCELIST1, XML),
    }


async def run(site: Site, path: str):
    async with serve_app(site.app) as base, Fetcher(retries=0) as fetcher:
        return base, await discover(fetcher, base + path)


# -- the walks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("start", ["", "/", "/.well-known/resourcesync"])
async def test_well_known_description_two_sets(start):
    site = Site(full_site())
    base, sets = await run(site, start)
    assert [s.capabilitylist_url for s in sets] == [
        f"{base}/set1/capabilitylist.xml",
        f"{base}/set2/capabilitylist.xml",
    ]
    s1, s2 = sets
    assert not s1.synthetic and s1.head.capability == "capabilitylist"
    assert s1.head.link("up").href == f"{base}/.well-known/resourcesync"
    assert set(s1.capabilities) == {"resourcelist", "changelist", "change-notification"}
    assert s1.capabilities["changelist"].url == f"{base}/set1/changelist.xml"
    assert s1.capabilities["changelist"].capability == "changelist"
    notify = s1.capabilities["change-notification"]
    assert [ln.href for ln in notify.entry.links_by_rel("hub")] == [f"{base}/hub"]
    assert list(s2.capabilities) == ["resourcedump"]
    assert s2.capabilities["resourcedump"].url == f"{base}/set2/resourcedump.xml"


async def test_capability_list_given_directly():
    site = Site(full_site())
    base, sets = await run(site, "/set2/capabilitylist.xml")
    assert len(sets) == 1 and sets[0].capabilitylist_url == f"{base}/set2/capabilitylist.xml"
    assert list(sets[0].capabilities) == ["resourcedump"]
    assert site.hits == ["/set2/capabilitylist.xml"]  # no guessing beyond the document named


async def test_resource_list_with_up_leads_to_its_capability_list():
    site = Site(full_site())
    base, sets = await run(site, "/set1/resourcelist.xml")
    assert [s.capabilitylist_url for s in sets] == [f"{base}/set1/capabilitylist.xml"]
    assert not sets[0].synthetic
    assert set(sets[0].capabilities) == {"resourcelist", "changelist", "change-notification"}


async def test_bare_resource_list_without_up_is_a_synthetic_set():
    site = Site({"/rl.xml": (BARE_RESOURCELIST, XML)})
    base, sets = await run(site, "/rl.xml")
    (s,) = sets
    assert s.synthetic and s.capabilitylist_url == f"{base}/rl.xml"
    assert list(s.capabilities) == ["resourcelist"]
    assert s.capabilities["resourcelist"].url == f"{base}/rl.xml"
    assert s.head.capability == "capabilitylist"


async def test_resource_list_whose_up_is_broken_uses_the_up_url():
    rl = urlset(
        'capability="resourcelist"', links=ln("up", "BASE/gone/capabilitylist.xml"), urls=url("BASE/r")
    )
    site = Site({"/rl.xml": (rl, XML)})
    base, sets = await run(site, "/rl.xml")
    (s,) = sets
    assert s.synthetic and s.capabilitylist_url == f"{base}/gone/capabilitylist.xml"
    assert s.capabilities["resourcelist"].url == f"{base}/rl.xml"


async def test_resource_list_part_walks_index_then_up():
    part = urlset('capability="resourcelist"', links=ln("index", "BASE/rl-index.xml"), urls=url("BASE/r"))
    index = urlset(
        'capability="resourcelist"', links=ln("up", "BASE/set1/capabilitylist.xml"),
        urls=url("BASE/rl-part1.xml", tag="sitemap"), root="sitemapindex",
    )  # fmt: skip
    site = Site(full_site() | {"/rl-part1.xml": (part, XML), "/rl-index.xml": (index, XML)})
    base, sets = await run(site, "/rl-part1.xml")
    assert [s.capabilitylist_url for s in sets] == [f"{base}/set1/capabilitylist.xml"]
    # Without an up link anywhere, the synthetic set names the whole list (the index), not the part.
    index_no_up = index.replace(ln("up", "BASE/set1/capabilitylist.xml"), "")
    site = Site({"/rl-part1.xml": (part, XML), "/rl-index.xml": (index_no_up, XML)})
    base, sets = await run(site, "/rl-part1.xml")
    assert sets[0].synthetic and sets[0].capabilities["resourcelist"].url == f"{base}/rl-index.xml"


async def test_html_home_page_link():
    html = (
        "<!DOCTYPE html><html><head><title>Home</title>"
        '<link rel="stylesheet" href="/style.css">'
        '<link rel="ResourceSync" href="set1/capabilitylist.xml">'
        "</head><body><p>hello</p></body></html>"
    )
    site = Site(full_site() | {"/": (html, "text/html; charset=utf-8")})
    del site.pages["/.well-known/resourcesync"]
    base, sets = await run(site, "/")
    assert [s.capabilitylist_url for s in sets] == [f"{base}/set1/capabilitylist.xml"]


async def test_http_link_header():
    headers = {"Link": '<BASE/about>; rel="describedby", <BASE/set2/capabilitylist.xml>; rel="resourcesync"'}
    site = Site(full_site() | {"/photo.jpg": ("\xff\xd8 not xml", "image/jpeg", headers)})
    del site.pages["/.well-known/resourcesync"]
    base, sets = await run(site, "/photo.jpg")
    assert [s.capabilitylist_url for s in sets] == [f"{base}/set2/capabilitylist.xml"]


async def test_robots_txt_sitemaps_only_resourcesync_ones():
    robots = (
        "User-agent: *\nDisallow: /cgi-bin/\nSitemap: BASE/sitemap.xml\nsitemap: BASE/set1/resourcelist.xml\n"
    )
    pages = full_site() | {"/robots.txt": (robots, "text/plain"), "/sitemap.xml": (PLAIN_SITEMAP, XML)}
    del pages["/.well-known/resourcesync"]
    site = Site(pages)
    base, sets = await run(site, "")
    assert [s.capabilitylist_url for s in sets] == [f"{base}/set1/capabilitylist.xml"]
    assert "/sitemap.xml" in site.hits  # looked at, and skipped: a plain Sitemap is no ResourceSync document


async def test_site_with_nothing_names_what_was_tried():
    site = Site({"/": ("<html><head><title>nothing here</title></head></html>", "text/html")})
    async with serve_app(site.app) as base, Fetcher(retries=0) as fetcher:
        with pytest.raises(DiscoveryError) as exc_info:
            await discover(fetcher, base)
    err = exc_info.value
    message = str(err)
    for tried in (base, f"{base}/.well-known/resourcesync", f"{base}/robots.txt"):
        assert tried in message
    assert 'rel="resourcesync"' in message and "HTTP 404" in message
    assert [u for u, _ in err.attempts][-2:] == [f"{base}/.well-known/resourcesync", f"{base}/robots.txt"]
    assert not err.transient


async def test_description_with_one_broken_capability_list():
    pages = full_site()
    del pages["/set2/capabilitylist.xml"]
    base, sets = await run(Site(pages), "/.well-known/resourcesync")
    assert [s.capabilitylist_url for s in sets] == [f"{base}/set1/capabilitylist.xml"]


async def test_transient_failure_is_flagged():
    site = Site({})

    async def busy(request: Request) -> Response:
        return Response("busy", status_code=503)

    site.app = Starlette(routes=[Route("/{path:path}", busy)])
    async with serve_app(site.app) as base, Fetcher(retries=0) as fetcher:
        with pytest.raises(DiscoveryError) as exc_info:
            await discover(fetcher, base + "/")
    assert exc_info.value.transient and "HTTP 503" in str(exc_info.value)


# -- the small parsers ------------------------------------------------------------------------------


def test_parse_link_header():
    value = (
        '<http://a/x>; rel="up index"; type="application/xml", <y>;rel=resourcesync, <z>; title="a, b"; rel=x'
    )
    assert parse_link_header(value) == [
        ("http://a/x", {"rel": "up index", "type": "application/xml"}),
        ("y", {"rel": "resourcesync"}),
        ("z", {"title": "a, b", "rel": "x"}),
    ]
    assert links_with_rel(value, "resourcesync", "http://h/p/q") == ["http://h/p/y"]
    assert links_with_rel(value, "index", "http://h/") == ["http://a/x"]
    assert parse_link_header(None) == [] and parse_link_header("garbage") == []


def test_html_links():
    page = b'<html><head><base href="http://cdn/s/"><link rel="alternate resourcesync" href="cl.xml">'
    assert html_links(page, "http://h/") == ["http://cdn/s/cl.xml"]
    assert html_links(b"", "http://h/") == []
    assert html_links(b"\x00\xff not html at all", "http://h/") == []


def test_robots_sitemaps():
    text = (
        "User-agent: *\nSitemap: http://a/1.xml # first\n  SITEMAP:http://a/2.xml\nDisallow: /x\nSitemap:\n"
    )
    assert robots_sitemaps(text) == ["http://a/1.xml", "http://a/2.xml"]
