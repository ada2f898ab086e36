"""rsagg's capability documents, built from the state as the request comes (spec §8-§10, §12).

Every function here is blocking (SQLite reads): the app calls them in a worker thread with a reader
``State`` of its own, and streams the entries with ``rs.write.iter_document_bytes`` while they are read
page by page (docs/architecture.md invariant 4: no list is held whole). A function returns ``(head, entries)``
where ``entries`` is a lazy iterator that reads the state as it is consumed, or None for "no such
document" (404).

Views (docs/architecture.md invariant 3): Resource Lists show the ``resources`` table now; Change Lists show
the ``changelog``, cut into windows of the GLOBAL changelog seq so every set's windows line up and a
window never changes once closed:

- window K holds the set's records with ``(K-1)*N < seq <= K*N`` (N = ``publish.changelist_size``);
  it is closed once the global last seq reaches K*N, and ``until`` is then the datetime of the last
  record with seq <= K*N (§12.1: a closed list is never updated again);
- the index lists the windows that hold a record of the set, and always the open window last (an
  open list to poll, §12.1, even while it is empty);
- ``from`` of a listed window is the ``until`` of the listed window before it (the set had no change
  in the windows between), and for the first one the start of the set's history: windows listed in
  order are back to back, and the changelog datetime never decreases, so every entry falls in
  ``[from, until]`` (§7) and a Destination reading windows in order never misses nor repeats one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime

from ..rs.fixity import format_hash
from ..rs.model import (
    CAPABILITYLIST,
    CHANGEDUMP,
    CHANGEDUMP_ARCHIVE,
    CHANGELIST,
    DELETED,
    DESCRIPTION,
    RESOURCEDUMP,
    RESOURCEDUMP_ARCHIVE,
    RESOURCELIST,
    RS_NS,
    SITEMAPINDEX,
    Doc,
    Entry,
    Head,
    Link,
    Md,
)
from ..store.interface import StateStore
from ..store.rows import LogRecord, Resource
from ..store.sets import PublishedSet
from . import listing, versions
from .links import LinkPolicy, PluginLinks
from .uris import rsagg_uri

#: §7: at most 50,000 entries per <urlset> (the Sitemap limit). Above it a Resource List is an index;
#: a module constant so tests can make it small.
MAX_ENTRIES = 50_000
#: Cache-Control by document kind (for a CDN or browser in front): what may change, and what never does
#: (a closed Change List window, §12.1; a dump package).
CACHE_OPEN = "public, max-age=10"
CACHE_CLOSED = "public, max-age=86400"
#: Capabilities the dump helper may add to a Capability List (§9, §11, §13), in the order written.
DUMP_CAPABILITIES = (RESOURCEDUMP, CHANGEDUMP)
_URI_CACHE = 4096

#: ``dumps_available(set name)``: the dump capabilities a Capability List lists, capability -> URL.
DumpsAvailable = Callable[[str], dict[str, str]]
#: ``extra_capabilities(set name)``: more Capability List entries (e.g. notification channels).
ExtraCapabilities = Callable[[str], list[Entry]]


def no_dumps(set_name: str) -> dict[str, str]:
    """The default ``dumps_available``: no Resource Dump, no Change Dump."""
    return {}


def no_extra_capabilities(set_name: str) -> list[Entry]:
    """The default ``extra_capabilities``: nothing beyond the core capabilities."""
    return []


def show_all(set_name: str, resource: Resource) -> bool:
    """The publish filter when no plugin has one: every resource is shown."""
    return True


@dataclass(frozen=True)
class Site:
    """What the documents of one request need: the base URL, the published sets, the policies."""

    base_url: str  # no trailing slash
    sets: dict[str, PublishedSet]
    policy: LinkPolicy | PluginLinks
    changelist_size: int
    dumps_available: DumpsAvailable = no_dumps
    #: ``visible(set name, resource)``: False hides a resource (plugins' ``rsagg_filter_publish``).
    visible: Callable[[str, Resource], bool] = show_all
    #: ``extra_capabilities(set name)``: more Capability List entries, e.g. the notification channels
    #: (Change/Framework Notification: topic ``loc`` + ``rs:ln rel="hub"``; ``websub/notifier.py``).
    extra_capabilities: ExtraCapabilities = no_extra_capabilities

    def shows(self, set_name: str, row: Resource | None) -> bool:
        """Whether a changelog record is published: unless the publish filter hides its resource (a
        record without a resource row is shown). Change Lists, Change Dumps and notifications agree."""
        return row is None or self.visible(set_name, row)

    # -- URL layout (one place) -----------------------------------------------------------------
    @property
    def well_known(self) -> str:
        return f"{self.base_url}/.well-known/resourcesync"

    @property
    def home(self) -> str:
        return f"{self.base_url}/"

    def capabilitylist(self, name: str) -> str:
        return f"{self.base_url}/{name}/capabilitylist.xml"

    def resourcelist(self, name: str) -> str:
        return f"{self.base_url}/{name}/resourcelist.xml"

    def resourcelist_part(self, name: str, lo: int, hi: int | None) -> str:
        return f"{self.base_url}/{name}/resourcelist/{lo}-{'end' if hi is None else hi}.xml"

    def changelist(self, name: str) -> str:
        return f"{self.base_url}/{name}/changelist.xml"

    def changelist_window(self, name: str, k: int) -> str:
        return f"{self.base_url}/{name}/changelist/{k}.xml"

    def resource(self, name: str, upstream_uri: str) -> str:
        return rsagg_uri(self.base_url, name, upstream_uri)


# ---------------------------------------------------------------------------------------------------
# Source Description (§8) and Capability Lists (§9): small, built whole.


def source_description(site: Site) -> Doc:
    """One entry per published set; the home page describes the Source (§8 recommends describedby)."""
    head = Head(md=Md(capability=DESCRIPTION), links=[Link("describedby", site.home, type="text/html")])
    entries = []
    for ps in site.sets.values():
        links = [Link("describedby", ps.describedby)] if ps.describedby else []
        entries.append(Entry(site.capabilitylist(ps.name), md=Md(capability=CAPABILITYLIST), links=links))
    return head, iter(entries)


def capability_list(site: Site, ps: PublishedSet) -> tuple[Head, Iterator[Entry]]:
    """Resource List and Change List always; dumps when the dump helper says they exist (§9: one entry
    per capability)."""
    links = [Link("up", site.well_known)]
    if ps.describedby:
        links.append(Link("describedby", ps.describedby))
    dumps = site.dumps_available(ps.name) or {}
    entries = [Entry(site.resourcelist(ps.name), md=Md(capability=RESOURCELIST))]
    if RESOURCEDUMP in dumps:
        entries.append(Entry(dumps[RESOURCEDUMP], md=Md(capability=RESOURCEDUMP)))
    entries.append(Entry(site.changelist(ps.name), md=Md(capability=CHANGELIST)))
    if CHANGEDUMP in dumps:
        entries.append(Entry(dumps[CHANGEDUMP], md=Md(capability=CHANGEDUMP)))
    # The Archives (draft; Example 2.1 lists them in the Capability List): past dumps kept.
    for archive in (RESOURCEDUMP_ARCHIVE, CHANGEDUMP_ARCHIVE):
        if archive in dumps:
            entries.append(Entry(dumps[archive], md=Md(capability=archive)))
    entries += site.extra_capabilities(ps.name)
    return Head(md=Md(capability=CAPABILITYLIST), links=links), iter(entries)


# ---------------------------------------------------------------------------------------------------
# Entries for resources (Resource Lists) and changes (Change Lists)


class UriOf:
    """``uri_of`` for the link policy: our URI of an upstream URI we hold live, else None.

    The entry's own published set is looked at first, then the others; answers are cached for the
    request (bounded), since metadata records are linked from many entries.
    """

    def __init__(self, site: Site, state: StateStore, ps: PublishedSet) -> None:
        self.site, self.state = site, state
        self.order = [ps, *(o for o in site.sets.values() if o.name != ps.name)]
        self.cache: dict[str, str | None] = {}

    def __call__(self, href: str) -> str | None:
        if href in self.cache:
            return self.cache[href]
        found = None
        for ps in self.order:
            if self.state.live_set_of(ps.set_ids, href) is not None:
                found = self.site.resource(ps.name, href)
                break
        if len(self.cache) >= _URI_CACHE:
            self.cache.clear()
        self.cache[href] = found
        return found


def _md_extra(extra: dict[str, str]) -> dict[str, str]:
    """Foreign-namespace attributes pass through (§7 lets communities add them); unprefixed unknown
    ones and rs-namespace ones do not (they break §7 and would be ours to answer for)."""
    return {k: v for k, v in extra.items() if k.startswith("{") and not k.startswith("{" + RS_NS + "}")}


def resource_entry(site: Site, ps: PublishedSet, r: Resource, uri_of: Callable[[str], str | None]) -> Entry:
    """A Resource List entry: our URI, our time (updated_at), the fixity we verified, policy links."""
    md = Md(
        hash=format_hash(r.hashes),
        length=r.length,
        type=r.type,
        encoding=r.encoding,
        extra=_md_extra(r.md_extra),
    )
    return Entry(
        site.resource(ps.name, r.uri),
        lastmod=r.updated_at,
        md=md,
        links=[
            *site.policy.links(r, uri_of=uri_of, set_name=ps.name),
            *versions.resource_entry_links(site.base_url, ps.name, r),
        ],
        extra=list(r.entry_extra),
    )


def change_entry(
    site: Site,
    ps: PublishedSet,
    rec: LogRecord,
    row: Resource | None,
    uri_of: Callable[[str], str | None],
) -> Entry:
    """A Change List entry for one changelog record (§12.1): change + datetime, and for created/updated
    the fixity of that version (md5 too when the row still holds that version), length, type.

    ``lastmod`` is the record's datetime: the row's ``updated_at`` when that change was applied.
    """
    current = row is not None and rec.change != DELETED and row.sha256 == rec.sha256
    hashes: dict[str, str] = {}
    if rec.change == DELETED:
        md = Md(change=DELETED, datetime=rec.datetime)
    else:
        hashes = row.hashes if current and row is not None else {"sha-256": rec.sha256} if rec.sha256 else {}
        md = Md(
            change=rec.change,
            datetime=rec.datetime,
            hash=format_hash(hashes),
            length=rec.length,
            type=rec.type,
            encoding=row.encoding if current and row is not None else None,
            extra=_md_extra(row.md_extra) if current and row is not None else {},
        )
    if row is not None:
        links = site.policy.links(row, uri_of=uri_of, record=rec, set_name=ps.name)
    else:  # rows are never deleted; defensive only
        links = [Link("via", rec.uri)]
    links += versions.change_entry_links(site.base_url, ps.name, rec, hashes)  # §14.6
    extra = list(row.entry_extra) if current and row is not None else []
    return Entry(site.resource(ps.name, rec.uri), lastmod=rec.datetime, md=md, links=links, extra=extra)


# ---------------------------------------------------------------------------------------------------
# Resource Lists (§10.1) and Resource List Indexes (§10.2)


def resource_list(
    site: Site, state: StateStore, ps: PublishedSet, now: datetime, *, lines: bool = False
) -> Doc:
    """A <urlset> when the set has at most MAX_ENTRIES live resources, else an index of id-range parts.

    Part boundaries are the id of every MAX_ENTRIES-th live resource, computed now; parts are
    ``LO-HI`` (LO < id <= HI) and the last ``LO-end`` (also what was created since). The index's head
    goes out before its parts are counted out (a pass over every live row: ~1 s at 1,000,000).

    ``lines``: entries may come as their ready-written lines (``str``, ``publish/listing.py``) where
    that is faster; for ``rs.write.iter_document_bytes``, which writes them as they are.
    """
    up = Link("up", site.capabilitylist(ps.name))
    size = MAX_ENTRIES
    if not state.live_more_than(ps.set_ids, size):
        head = Head(md=Md(capability=RESOURCELIST, at=now), links=[up])
        return head, _resources(site, state, ps, 0, None, lines)
    head = Head(root=SITEMAPINDEX, md=Md(capability=RESOURCELIST, at=now), links=[up])
    return head, _index_entries(site, state, ps, size)


def _boundaries(state: StateStore, set_ids: tuple[int, ...], size: int) -> Iterator[int]:
    """The id of every ``size``-th live resource of the sets, in order."""
    ids = tuple(dict.fromkeys(set_ids))
    if len(ids) != 1:  # rows of several sets, numbered together
        yield from state.iter_live_part_boundaries(ids, size)
        return
    b = state.live_part_boundary(ids[0], 0, size)
    while b is not None:
        yield b
        b = state.live_part_boundary(ids[0], b, size)


def _index_entries(site: Site, state: StateStore, ps: PublishedSet, size: int) -> Iterator[Entry]:
    lo, last = 0, None
    for b in _boundaries(state, ps.set_ids, size):
        if last is not None:
            yield Entry(site.resourcelist_part(ps.name, lo, last))
            lo = last
        last = b
    # The last boundary closes a part only when live rows follow it; else its part is "LO-end".
    if last is not None and state.live_after(ps.set_ids, last):
        yield Entry(site.resourcelist_part(ps.name, lo, last))
        lo = last
    yield Entry(site.resourcelist_part(ps.name, lo, None))


def resource_list_part(
    site: Site,
    state: StateStore,
    ps: PublishedSet,
    lo: int,
    hi: int | None,
    now: datetime,
    *,
    lines: bool = False,
) -> Doc:
    """Part ``LO-HI`` of the Resource List Index: live resources with lo < id <= hi (§10.2)."""
    links = [Link("up", site.capabilitylist(ps.name)), Link("index", site.resourcelist(ps.name))]
    head = Head(md=Md(capability=RESOURCELIST, at=now), links=links)
    return head, _resources(site, state, ps, lo, hi, lines)


def _resources(
    site: Site, state: StateStore, ps: PublishedSet, lo: int, hi: int | None, lines: bool = False
) -> Iterator[Entry | str]:
    uri_of = UriOf(site, state, ps)
    if lines and listing.plain_policy(site.policy):
        writer = listing.ListingWriter(site.base_url, ps.name)

        def general(r: Resource) -> Entry:
            return resource_entry(site, ps, r, uri_of)

        if site.visible is show_all:
            yield from listing.listing(writer, state, ps.set_ids, lo, hi, general)
        else:
            yield from listing.filtered(writer, state, ps, lo, hi, site.visible, general)
        return
    for r in state.iter_live(ps.set_ids, after_id=lo, until_id=hi):
        if site.visible(ps.name, r):
            yield resource_entry(site, ps, r, uri_of)


# ---------------------------------------------------------------------------------------------------
# Validators: what a document's ETag, Last-Modified and cached rendering follow (cheap: no rendering)


@dataclass(frozen=True)
class Validity:
    """A document's version: it renders the same (but for ``at``) while ``version`` stays.

    ``name`` names the document in the rendering cache; ``closed``: it never changes again (a closed
    Change List window, §12.1)."""

    name: str
    version: str
    last_modified: datetime | None
    closed: bool = False


def _set_changed(state: StateStore, ps: PublishedSet) -> tuple[int, datetime | None]:
    seq = state.set_last_seq(ps.set_ids)
    return seq, (state.log_datetime(seq) if seq else state.history_start(ps.set_ids))


def resource_list_validity(site: Site, state: StateStore, ps: PublishedSet) -> Validity:
    """Every change of the set's rows is logged: the list (or index) follows the set's last record."""
    seq, when = _set_changed(state, ps)
    return Validity(f"{ps.name}.resourcelist", f"s{seq}", when)


def resource_list_part_validity(
    site: Site, state: StateStore, ps: PublishedSet, lo: int, hi: int | None
) -> Validity:
    """An untouched part (no row of its id range changed) keeps its version, whatever else changed."""
    count, newest = state.rows_version(ps.set_ids, lo, hi)
    version = f"{count}-{newest.strftime('%Y%m%dT%H%M%S%f') if newest else ''}"
    return Validity(f"{ps.name}.resourcelist-{lo}-{'end' if hi is None else hi}", version, newest)


def change_list_validity(site: Site, state: StateStore, ps: PublishedSet) -> Validity:
    """The index's windows follow the global changelog seq (a window closes when it fills up)."""
    _, when = _set_changed(state, ps)
    return Validity(f"{ps.name}.changelist", f"g{state.last_seq()}", when)


def change_list_window_validity(site: Site, state: StateStore, ps: PublishedSet, k: int) -> Validity | None:
    """A closed window is final (§12.1); the open one follows the set's last record."""
    last = state.last_seq()
    open_k = last // site.changelist_size + 1
    if not 1 <= k <= open_k:
        return None
    name = f"{ps.name}.changelist-{k}"
    if k < open_k:
        return Validity(name, "closed", state.log_datetime(k * site.changelist_size), closed=True)
    seq, when = _set_changed(state, ps)
    return Validity(name, f"open-s{seq}", when)


# ---------------------------------------------------------------------------------------------------
# Change Lists (§12.1) and the Change List Index (§12.2)


@dataclass(frozen=True)
class Window:
    k: int
    from_: datetime
    until: datetime | None  # None: the open window


class Windows:
    """The Change List windows of one published set, as of now (see the module docstring)."""

    def __init__(self, site: Site, state: StateStore, ps: PublishedSet, now: datetime) -> None:
        self.state, self.ps, self.now = state, ps, now
        self.size = site.changelist_size
        self.last_seq = state.last_seq()
        self.open_k = self.last_seq // self.size + 1
        found = state.log_windows(ps.set_ids, self.size)
        self.listed = [k for k in found if k < self.open_k] + [self.open_k]

    def window(self, k: int) -> Window | None:
        """Window k (listed or not), None when it does not exist yet."""
        if not 1 <= k <= self.open_k:
            return None
        before = [w for w in self.listed if w < k]
        if before:
            start = self.state.log_datetime(before[-1] * self.size)
        else:
            start = self.state.history_start(self.ps.set_ids)
        if start is None:  # a configured set nothing was harvested into yet: no history to cover
            start = self.state.log_datetime(self.last_seq) or self.now
        until = self.state.log_datetime(k * self.size) if k < self.open_k else None
        if until is not None and until < start:  # only if the clock stepped back across sets
            until = start
        return Window(k, start, until)


def change_list(site: Site, state: StateStore, ps: PublishedSet, now: datetime) -> Doc:
    """``/SET/changelist.xml``: the open list itself when it is the only window, else the index."""
    ws = Windows(site, state, ps, now)
    if len(ws.listed) == 1:
        doc = change_list_window(site, state, ps, ws.open_k, now, windows=ws)
        assert doc is not None
        return doc
    windows = [ws.window(k) for k in ws.listed]
    entries = [
        Entry(site.changelist_window(ps.name, w.k), md=Md(from_=w.from_, until=w.until))
        for w in windows
        if w is not None
    ]
    head = Head(
        root=SITEMAPINDEX,
        md=Md(capability=CHANGELIST, from_=entries[0].md.from_ if entries[0].md else None),
        links=[Link("up", site.capabilitylist(ps.name))],
    )
    return head, iter(entries)


def change_list_window(
    site: Site, state: StateStore, ps: PublishedSet, k: int, now: datetime, *, windows: Windows | None = None
) -> Doc | None:
    """``/SET/changelist/K.xml``: the set's records of window K in seq order (None: no such window)."""
    ws = windows or Windows(site, state, ps, now)
    w = ws.window(k)
    if w is None:
        return None
    links = [Link("up", site.capabilitylist(ps.name))]
    if len(ws.listed) > 1:
        links.append(Link("index", site.changelist(ps.name)))
    head = Head(md=Md(capability=CHANGELIST, from_=w.from_, until=w.until), links=links)
    lo, hi = (k - 1) * ws.size, k * ws.size
    return head, _changes(site, state, ps, lo, hi)


def _changes(site: Site, state: StateStore, ps: PublishedSet, lo: int, hi: int) -> Iterator[Entry]:
    uri_of = UriOf(site, state, ps)
    for rec, row in state.iter_log_range(ps.set_ids, lo, hi):
        if site.shows(ps.name, row):
            yield change_entry(site, ps, rec, row, uri_of)


__all__ = [
    "CACHE_CLOSED",
    "CACHE_OPEN",
    "DUMP_CAPABILITIES",
    "MAX_ENTRIES",
    "Doc",
    "DumpsAvailable",
    "ExtraCapabilities",
    "Site",
    "UriOf",
    "Validity",
    "Window",
    "Windows",
    "capability_list",
    "change_entry",
    "change_list",
    "change_list_validity",
    "change_list_window",
    "change_list_window_validity",
    "no_dumps",
    "resource_entry",
    "resource_list",
    "resource_list_part",
    "resource_list_part_validity",
    "resource_list_validity",
    "source_description",
]
