"""Find the sets of resources (Capability Lists) of a Source from whatever URL a user configured (§6.3).

Accepted starting points: a Source Description (§8, or its index), a Capability List (§9), any capability
document such as a Resource List or Change List (or an index or part of one; §6.2 ``up``/``index`` links
lead to its Capability List), or a plain web page / site root. For the latter the resource's own HTTP
``Link: <..>; rel="resourcesync"`` header and HTML ``<link rel="resourcesync">`` (§6.3.3) are tried, then
the well-known URI ``/.well-known/resourcesync`` (§6.3.2), then robots.txt ``Sitemap:`` lines (§6.3.4,
only those that are ResourceSync documents). The first approach that yields a set wins.

A capability document without a reachable Capability List becomes a *synthetic* set: its
``capabilitylist_url`` is the document's ``up`` link when it has one, else the document's own URL, and it
holds that one capability.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

import lxml.html
from lxml import etree

from ..net.retry import retryable_status
from ..rs import model
from ..rs.linkheader import links_with_rel
from ..rs.model import Entry, Head, Md
from ..rs.parse import DocumentError
from .deviations import deviation, skip
from .fetch import Fetcher, FetchError

log = logging.getLogger("rsagg.harvest")

WELL_KNOWN_PATH = "/.well-known/resourcesync"
REL = "resourcesync"
#: Caps: discovery reads small documents only, and never follows an unbounded web of links.
MAX_PAGE_BYTES = 2 * 1024 * 1024
MAX_ROBOTS_BYTES = 512 * 1024
MAX_ROBOTS_SITEMAPS = 50
MAX_PAGE_LINKS = 10
MAX_DESCRIPTION_ENTRIES = 100_000
MAX_FETCHES = 2_000
MAX_UP_HOPS = 4


@dataclass
class Capability:
    """One entry of a Capability List (§9): the capability document's URL, its kind, the entry itself."""

    url: str
    capability: str
    entry: Entry


@dataclass
class SetInfo:
    """One set of resources of a Source: its Capability List and what it offers, keyed by capability.

    Notification channels are ``capabilities["change-notification"].entry`` with ``rel="hub"`` links.
    ``synthetic`` is True when no Capability List could be read and the set was made from a bare
    capability document.
    """

    capabilitylist_url: str
    head: Head
    capabilities: dict[str, Capability]
    synthetic: bool = False
    #: Every entry per capability, in document order (``capabilities`` holds the first). §9 allows one
    #: per capability, but WEKO3 lists one Resource List and one Change List per repository index:
    #: all of them are harvested into this one set.
    lists: dict[str, list[Capability]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for cap, first in self.capabilities.items():
            self.lists.setdefault(cap, [first])

    def urls(self, capability: str) -> list[str]:
        """Every advertised document of one capability."""
        return [c.url for c in self.lists.get(capability, [])]


class DiscoveryError(Exception):
    """Nothing usable was found; the message names every URL tried and why it did not help."""

    def __init__(self, url: str, attempts: list[tuple[str, str]], *, transient: bool = False) -> None:
        self.url = url
        self.attempts = attempts
        self.transient = transient  # some attempt failed in a way that may pass (timeout, 503...)
        # One clause per reason, naming the URLs that failed for it: a host that is down fails every
        # approach the same way, and the message should say so once.
        reasons: dict[str, list[str]] = {}
        for u, why in attempts:
            reasons.setdefault(why, []).append(u)
        tried = (
            "; ".join(f"{', '.join(dict.fromkeys(us))}: {why}" for why, us in reasons.items()) or "nothing"
        )
        super().__init__(
            f"{url}: no ResourceSync Capability List or Source Description found (tried {tried})"
        )

    @property
    def root_cause(self) -> str | None:
        """Why the configured URL (tried first) failed: what the operator acts on (a host down, a 404),
        where "nothing found" only wraps it (errors.root_cause)."""
        return f"{self.attempts[0][0]}: {self.attempts[0][1]}" if self.attempts else None


# -- small parsers ---------------------------------------------------------------------------------


def html_links(content: bytes, base: str, rel: str = REL) -> list[str]:
    """``<link rel="resourcesync" href>`` targets of an HTML page (§6.3.3), resolved against ``<base>``."""
    if not content.strip():
        return []
    try:
        root = lxml.html.document_fromstring(content)
    except (etree.ParserError, ValueError):
        return []
    for b in root.iter("base"):
        href = (b.get("href") or "").strip()
        if href:
            base = urljoin(base, href)
            break
    out = []
    for ln in root.iter("link"):
        href = (ln.get("href") or "").strip()
        if href and rel in (ln.get("rel") or "").lower().split():
            out.append(urljoin(base, href))
    return out


def robots_sitemaps(text: str) -> list[str]:
    """The ``Sitemap:`` directives of a robots.txt (§6.3.4), in order."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        name, sep, value = line.partition(":")
        if sep and name.strip().lower() == "sitemap" and value.strip():
            out.append(value.strip())
    return out


def site_root(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/"


def _without_url(message: str, url: str, line: int | None) -> str:
    """ "URL:LINE: reason" (the parser's form) -> "line LINE: reason": the URL is named once already."""
    if message.startswith(url):
        m = re.match(r":(\d+|None)?:?\s*(.*)", message[len(url) :], re.S)
        if m is not None:
            message = f"line {m.group(1)}: {m.group(2)}" if m.group(1) not in (None, "None") else m.group(2)
    return message


def _unique(urls: list[str]) -> list[str]:
    return list(dict.fromkeys(urls))


# -- the walk --------------------------------------------------------------------------------------


@dataclass
class _Doc:
    """A fetched capability document: head, the entries when they were needed, the response Link header."""

    url: str  # as requested (identity); relative locs resolve against final_url
    final_url: str
    head: Head
    entries: list[Entry] | None
    link_header: str | None

    @property
    def capability(self) -> str | None:
        return self.head.capability


@dataclass
class Known:
    """A capability document read by an earlier sync, with the validators it was served with: the next
    sync asks for it conditionally, and a 304 reuses it as read (nothing downloaded or parsed again)."""

    etag: str | None
    last_modified: str | None
    doc: _Doc


def _needs_entries(head: Head) -> bool:
    return head.capability in (model.DESCRIPTION, model.CAPABILITYLIST)


@dataclass
class _Discovery:
    fetcher: Fetcher
    attempts: list[tuple[str, str]] = field(default_factory=list)
    transient: bool = False
    cache: dict[str, _Doc | None] = field(default_factory=dict)
    fetches: int = 0
    not_a_document: bool = False  # the last failed fetch was a body that is no capability document
    fallback: str | None = None  # the configured URL failed: what was used instead (see run)
    #: URL -> the document as an earlier sync read it (``Known``); None: every document read afresh.
    known: dict[str, Known] | None = None

    def note(self, url: str, why: str) -> None:
        self.attempts.append((url, why))

    def _count(self, url: str) -> None:
        self.fetches += 1
        if self.fetches > MAX_FETCHES:
            raise DiscoveryError(url, [*self.attempts, (url, f"more than {MAX_FETCHES} fetches")])

    def _failed(self, url: str, exc: Exception) -> None:
        if isinstance(exc, FetchError):
            if exc.kind == "http":
                why = f"HTTP {exc.status}"
                self.transient |= exc.status is not None and retryable_status(exc.status)
            else:
                why = f"{exc.kind}: {_without_url(exc.message, exc.url, exc.line)}"
                self.transient |= exc.kind in ("timeout", "network")
        elif isinstance(exc, DocumentError):
            why = f"parse: {exc.reason}"
        else:  # pragma: no cover - defensive
            why = f"{type(exc).__name__}: {exc}"
        self.not_a_document = isinstance(exc, DocumentError) or getattr(exc, "kind", None) == "parse"
        self.note(url, why)

    async def doc(self, url: str) -> _Doc | None:
        """Fetch a capability document once (cached); None, with the reason noted, when it is not one."""
        if url in self.cache:
            return self.cache[url]
        self.cache[url] = None  # also breaks cycles of up/index links
        if urlsplit(url).scheme not in ("http", "https"):
            self.note(url, "not an http(s) URL")
            return None
        self._count(url)
        prior = self.known.get(url) if self.known is not None else None
        try:
            async with self.fetcher.document(
                url, etag=prior.etag if prior else None, last_modified=prior.last_modified if prior else None
            ) as stream:
                if stream.not_modified and prior is not None:  # 304: the document read last time
                    self.cache[url] = prior.doc
                    return prior.doc
                head = stream.head
                if head is None:  # pragma: no cover - a 304 comes only to a conditional request
                    self.note(url, "no document")
                    return None
                entries = None
                if _needs_entries(head):
                    entries = []
                    async for e in stream.entries:
                        entries.append(e)
                        if len(entries) > MAX_DESCRIPTION_ENTRIES:
                            self.note(url, f"more than {MAX_DESCRIPTION_ENTRIES} entries")
                            return None
                found = _Doc(url, stream.url or url, head, entries, stream.link_header)
                validators = (stream.etag, stream.last_modified)
        except (FetchError, DocumentError) as exc:
            if self.known is not None:
                self.known.pop(url, None)
            self._failed(url, exc)
            return None
        if self.known is not None:
            if any(validators):
                self.known[url] = Known(*validators, found)
            else:
                self.known.pop(url, None)
        self.cache[url] = found
        return found

    async def page(self, url: str) -> list[str]:
        """Capability List URLs announced by a web resource: its Link header, then its HTML (§6.3.3)."""
        self._count(url)
        try:
            got = await self.fetcher.get_bytes(url, max_bytes=MAX_PAGE_BYTES)
        except FetchError as exc:
            self._failed(url, exc)
            return []
        base = got.url or url
        found = links_with_rel(got.link_header, REL, base) + html_links(got.content, base)
        if not found:
            self.note(url, 'no Link header or HTML <link> with rel="resourcesync"')
        return _unique(found)[:MAX_PAGE_LINKS]

    # -- documents to sets

    async def sets_from(self, d: _Doc) -> list[SetInfo]:
        cap = d.capability
        if cap == model.DESCRIPTION:
            return await self.from_description(d)
        if cap == model.CAPABILITYLIST:
            return [self.from_capabilitylist(d)]
        if cap in model.CAPABILITIES:
            return [await self.from_member(d)]
        what = f"capability {cap!r}" if cap else "no rs:md capability"
        self.note(d.url, f"not a ResourceSync document ({what})")
        return []

    def from_capabilitylist(self, d: _Doc) -> SetInfo:
        caps: dict[str, Capability] = {}
        lists: dict[str, list[Capability]] = {}
        for e in d.entries or []:
            cap = e.capability
            if not cap:
                log.warning("capability list %s: entry %s has no capability, ignored", d.url, e.loc)
                continue
            if cap not in model.CAPABILITIES:  # §9: capabilities of other specifications may be listed
                deviation("unknown-capability", d.url, e.line, f"capability {cap!r} of {e.loc} not read")
            entry = Capability(urljoin(d.final_url, e.loc), cap, e)
            if cap in caps:  # §9: "must only contain one entry per capability"; WEKO3 lists several
                deviation(
                    "capability-repeated", d.url, e.line,
                    f"another {cap} entry ({e.loc}); every one is harvested into this set",
                )  # fmt: skip
                if entry.url not in {c.url for c in lists[cap]}:
                    lists[cap].append(entry)
                continue
            caps[cap] = entry
            lists[cap] = [entry]
        return SetInfo(d.url, d.head, caps, lists=lists)

    async def from_description(self, d: _Doc) -> list[SetInfo]:
        urls = [urljoin(d.final_url, e.loc) for e in d.entries or []]
        entries = [(u, e) for u, e in zip(urls, d.entries or [], strict=True)]
        if d.head.is_index:  # Source Description Index (§8): its parts are Source Descriptions
            entries = []
            for part_url in urls:
                sub = await self.doc(part_url)
                if sub is not None and sub.capability == model.DESCRIPTION and not sub.head.is_index:
                    entries += [(urljoin(sub.final_url, e.loc), e) for e in sub.entries or []]
                else:  # the Capability Lists it names are unknown: the source cannot be in sync
                    skip(part_url, f"part of Source Description Index {d.url} unusable")
        sets = []
        for url, e in entries:
            if e.capability not in (None, model.CAPABILITYLIST):  # §8: the md is optional
                continue
            cl = await self.doc(url)
            if cl is None:
                # The other sets are still harvested, but the source is degraded, never "ok".
                why = next((w for u, w in reversed(self.attempts) if u == url), "unreadable")
                skip(url, f"Capability List listed in {d.url} unusable: {why}")
                continue
            if cl.capability != model.CAPABILITYLIST or cl.head.is_index:
                self.note(url, f"listed in {d.url} but is a {model.kind_name(cl.head)}")
                skip(url, f"listed in {d.url} as a Capability List but is a {model.kind_name(cl.head)}")
                continue
            sets.append(self.from_capabilitylist(cl))
        if not sets and not entries:
            self.note(d.url, "Source Description lists no Capability List")
        return sets

    async def from_member(self, d: _Doc) -> SetInfo:
        """A capability document found on its own: walk ``up`` (via ``index`` if needed) to its set (§6.2)."""
        cur = d
        for _ in range(MAX_UP_HOPS):
            up = cur.head.link("up")
            if up is not None:
                up_url = urljoin(cur.final_url, up.href)
                cl = await self.doc(up_url)
                if cl is not None and cl.capability == model.CAPABILITYLIST and not cl.head.is_index:
                    return self.from_capabilitylist(cl)
                if cl is None:  # unreachable now: keep the set's identity the upstream gave it
                    return _synthetic(cur, up_url)
                self.note(up_url, f"the up link of {cur.url} is a {model.kind_name(cl.head)}")
                break
            index = cur.head.link("index")
            if index is None or cur.head.is_index:
                break
            ix = await self.doc(urljoin(cur.final_url, index.href))
            if ix is None or ix.capability != cur.capability or not ix.head.is_index:
                break
            cur = ix  # the whole list is the index: continue from there
        for url in links_with_rel(d.link_header, REL, d.final_url):
            cl = await self.doc(url)
            if cl is not None and cl.capability == model.CAPABILITYLIST:
                return self.from_capabilitylist(cl)
        return _synthetic(cur, cur.url)

    # -- the approaches, in order

    async def run(self, url: str) -> list[SetInfo]:
        d = await self.doc(url)
        # The URL itself failed (not a web page; not a site root, whose well-known URI is the way in).
        failed = d is None and not self.not_a_document and urlsplit(url).path not in ("", "/")
        if d is not None:
            sets = await self.sets_from(d)
            if not sets:
                sets = await self.from_urls(links_with_rel(d.link_header, REL, d.final_url))
            if d.capability in model.CAPABILITIES:
                return _dedup(sets)  # the user named a ResourceSync document: no guessing beyond it
        elif self.not_a_document:
            sets = await self.from_urls(await self.page(url))  # a web page, not a document
        else:
            sets = []
        if not sets:
            sets = await self.from_urls([urljoin(url, WELL_KNOWN_PATH)])
        if not sets:
            sets = await self.from_robots(urljoin(url, "/robots.txt"))
        if sets and failed:
            # The configured URL itself failed (e.g. HTTP 404) and guessing found something else: say
            # so, or an operator never learns that the URL they configured is wrong.
            why = next((w for u, w in self.attempts if u == url), "unusable")
            used = ", ".join(sorted({s.capabilitylist_url for s in sets}))
            self.fallback = f"{url} answered {why}; using {used}"
            log.warning(
                "%s answered %s: using %s (found by discovery) instead; configure that URL", url, why, used
            )
        return _dedup(sets)

    async def from_urls(self, urls: list[str]) -> list[SetInfo]:
        sets: list[SetInfo] = []
        for u in urls:
            d = await self.doc(u)
            if d is not None:
                sets += await self.sets_from(d)
        return sets

    async def from_robots(self, url: str) -> list[SetInfo]:
        self._count(url)
        try:
            got = await self.fetcher.get_bytes(url, max_bytes=MAX_ROBOTS_BYTES)
        except FetchError as exc:
            self._failed(url, exc)
            return []
        sitemaps = _unique(robots_sitemaps(got.content.decode("utf-8", "replace")))
        if not sitemaps:
            self.note(url, "no Sitemap: lines")
            return []
        sets: list[SetInfo] = []
        for sm in sitemaps[:MAX_ROBOTS_SITEMAPS]:
            d = await self.doc(urljoin(got.url or url, sm))
            if d is not None:
                sets += await self.sets_from(d)  # plain Sitemaps are noted and skipped there
        return sets


def _synthetic(d: _Doc, capabilitylist_url: str) -> SetInfo:
    """A set made of one bare capability document (§6.3.4 when no Capability List can be had)."""
    cap = d.capability or model.RESOURCELIST
    entry = Entry(d.url, md=Md(capability=cap))
    links = [ln for ln in d.head.links if model.has_rel(ln, "describedby")]
    head = Head(md=Md(capability=model.CAPABILITYLIST), links=links)
    return SetInfo(capabilitylist_url, head, {cap: Capability(d.url, cap, entry)}, synthetic=True)


def _dedup(sets: list[SetInfo]) -> list[SetInfo]:
    seen: dict[str, SetInfo] = {}
    for s in sets:
        seen.setdefault(s.capabilitylist_url, s)
    return list(seen.values())


async def discover(
    fetcher: Fetcher,
    url: str,
    *,
    on_fallback: Callable[[str | None], None] | None = None,
    known: dict[str, Known] | None = None,
) -> list[SetInfo]:
    """The sets of the Source at ``url`` (§6.3); raises DiscoveryError naming everything tried.

    ``on_fallback`` hears, once the sets are found, what was used instead of ``url`` when ``url`` itself
    failed (e.g. "URL answered HTTP 404; using CAPABILITYLIST"), or None when ``url`` led to the sets.
    ``known``: the documents an earlier discovery of this Source read (kept by the caller, updated
    here): each is asked for conditionally, and one not modified is not downloaded or parsed again."""
    d = _Discovery(fetcher, known=known)
    sets = await d.run(url)
    if not sets:
        raise DiscoveryError(url, d.attempts, transient=d.transient)
    if on_fallback is not None:
        on_fallback(d.fallback)
    return sets
