"""The ResourceSync document model shared by harvest/ and publish/ (spec §7, Table 2 and Table 3).

A document is a ``Head`` (root element, the document's own ``rs:md`` and ``rs:ln``) followed by
``Entry`` items (``<url>`` or ``<sitemap>``). Parsers yield the head first and then entries one at a
time; writers take a head and an iterator of entries. Nothing here holds a whole list.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from .fixity import parse_hash

SITEMAP_NS = "http://www.sitemaps.org/schemas/sitemap/0.9"
RS_NS = "http://www.openarchives.org/rs/terms/"
NSMAP = {None: SITEMAP_NS, "rs": RS_NS}

URLSET = "urlset"
SITEMAPINDEX = "sitemapindex"

# Capability values: core §7/§8/§9, notifications (Change/Framework Notification 1.0.1), Archives draft.
DESCRIPTION = "description"
CAPABILITYLIST = "capabilitylist"
RESOURCELIST = "resourcelist"
RESOURCEDUMP = "resourcedump"
RESOURCEDUMP_MANIFEST = "resourcedump-manifest"
CHANGELIST = "changelist"
CHANGEDUMP = "changedump"
CHANGEDUMP_MANIFEST = "changedump-manifest"
CHANGE_NOTIFICATION = "change-notification"
FRAMEWORK_NOTIFICATION = "framework-notification"
RESOURCELIST_ARCHIVE = "resourcelist-archive"
RESOURCEDUMP_ARCHIVE = "resourcedump-archive"
CHANGELIST_ARCHIVE = "changelist-archive"
CHANGEDUMP_ARCHIVE = "changedump-archive"

ARCHIVES = frozenset({RESOURCELIST_ARCHIVE, RESOURCEDUMP_ARCHIVE, CHANGELIST_ARCHIVE, CHANGEDUMP_ARCHIVE})
CAPABILITIES = frozenset(
    {DESCRIPTION, CAPABILITYLIST, RESOURCELIST, RESOURCEDUMP, RESOURCEDUMP_MANIFEST, CHANGELIST, CHANGEDUMP,
     CHANGEDUMP_MANIFEST, CHANGE_NOTIFICATION, FRAMEWORK_NOTIFICATION} | ARCHIVES
)  # fmt: skip
#: Capabilities whose documents may be split under a <sitemapindex> (§10.2, §11.1, §12.2, §13.1).
INDEXABLE = frozenset({RESOURCELIST, RESOURCEDUMP, CHANGELIST, CHANGEDUMP} | ARCHIVES)
#: Snapshot documents carry at/completed; change documents carry from/until (§7, Appendix A).
SNAPSHOT_KINDS = frozenset({RESOURCELIST, RESOURCEDUMP, RESOURCEDUMP_MANIFEST})
CHANGE_KINDS = frozenset({CHANGELIST, CHANGEDUMP, CHANGEDUMP_MANIFEST, CHANGE_NOTIFICATION})

CREATED, UPDATED, DELETED = "created", "updated", "deleted"
CHANGES = frozenset({CREATED, UPDATED, DELETED})
CHANGEFREQS = frozenset({"always", "hourly", "daily", "weekly", "monthly", "yearly", "never"})

#: Attribute names of rs:md and rs:ln in the order writers emit them (stable output).
MD_ATTRS = ("capability", "change", "datetime", "at", "completed", "from", "until",
            "hash", "length", "type", "encoding", "path")  # fmt: skip
LN_ATTRS = ("rel", "href", "pri", "modified", "hash", "length", "type", "encoding", "path")
DATETIME_ATTRS = frozenset({"datetime", "at", "completed", "from", "until", "modified"})
INT_ATTRS = frozenset({"length", "pri"})

PATCH_REL = "http://www.openarchives.org/rs/terms/patch"


@dataclass(slots=True)
class Md:
    """The attributes of one ``rs:md`` element; ``from`` is spelt ``from_``.

    ``extra`` keeps attributes of other namespaces (Clark notation ``{ns}name``) and unknown
    unprefixed ones, so that nothing an upstream wrote is lost on the way through.
    """

    capability: str | None = None
    change: str | None = None
    datetime: datetime | None = None
    # `dt.datetime`: below the field `datetime`, the bare name is the field, not the type.
    at: dt.datetime | None = None
    completed: dt.datetime | None = None
    from_: dt.datetime | None = None
    until: dt.datetime | None = None
    hash: str | None = None
    length: int | None = None
    type: str | None = None
    encoding: str | None = None
    path: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def hashes(self) -> dict[str, str]:
        return parse_hash(self.hash)


@dataclass(slots=True)
class Link:
    """One ``rs:ln`` element (§7, §14)."""

    rel: str
    href: str
    pri: int | None = None
    modified: datetime | None = None
    hash: str | None = None
    length: int | None = None
    type: str | None = None
    encoding: str | None = None
    path: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def hashes(self) -> dict[str, str]:
        return parse_hash(self.hash)

    @property
    def priority(self) -> int:
        """``pri`` with its default: absence means 999,999, the lowest priority (§7)."""
        return self.pri if self.pri is not None else 999_999


def has_rel(link: Link, rel: str) -> bool:
    """True when ``link`` is of relation type ``rel``: registered types compare case-insensitively
    (RFC 8288 §2.1.1: ``describedBy``, ``UP``), and ``rel`` may hold several space-separated types."""
    value = link.rel
    if not value:
        return False
    if value == rel:
        return True
    wanted = rel.lower()
    return any(t.lower() == wanted for t in value.split())


@dataclass(slots=True)
class Entry:
    """One ``<url>`` (or ``<sitemap>`` in an index).

    ``extra`` keeps foreign child elements as serialized XML strings; ``line`` is where the entry
    started in its document (for error messages; not part of equality).
    """

    loc: str
    lastmod: datetime | None = None
    changefreq: str | None = None
    md: Md | None = None
    links: list[Link] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    line: int | None = field(default=None, compare=False)

    @property
    def capability(self) -> str | None:
        return self.md.capability if self.md else None

    @property
    def change(self) -> str | None:
        return self.md.change if self.md else None

    @property
    def hashes(self) -> dict[str, str]:
        return self.md.hashes if self.md else {}

    def links_by_rel(self, rel: str) -> list[Link]:
        """Links of one relation, best ``pri`` first (§7: lower integer, higher priority)."""
        if not self.links:
            return []  # most entries have none: asked several times for each, on every harvest
        return sorted((ln for ln in self.links if has_rel(ln, rel)), key=lambda ln: ln.priority)


@dataclass(slots=True)
class Head:
    """What comes before the entries: the root element and the document's own metadata and links."""

    root: str = URLSET
    md: Md | None = None
    links: list[Link] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    line: int | None = field(default=None, compare=False)

    @property
    def capability(self) -> str | None:
        return self.md.capability if self.md else None

    @property
    def is_index(self) -> bool:
        return self.root == SITEMAPINDEX

    def link(self, rel: str) -> Link | None:
        for ln in self.links:
            if has_rel(ln, rel):
                return ln
        return None


#: A document as parsers yield it and writers take it: its head and its entries (or, where a writer
#: is handed them, entries already written as lines).
Doc = tuple[Head, Iterator[Entry]] | tuple[Head, Iterator[Entry | str]]


def kind_name(head: Head) -> str:
    """A human name for the document kind, e.g. "Resource List Index" (for messages)."""
    cap = head.capability or "unknown"
    name = {
        DESCRIPTION: "Source Description",
        CAPABILITYLIST: "Capability List",
        RESOURCELIST: "Resource List",
        RESOURCEDUMP: "Resource Dump",
        RESOURCEDUMP_MANIFEST: "Resource Dump Manifest",
        CHANGELIST: "Change List",
        CHANGEDUMP: "Change Dump",
        CHANGEDUMP_MANIFEST: "Change Dump Manifest",
        CHANGE_NOTIFICATION: "Change Notification",
        FRAMEWORK_NOTIFICATION: "Framework Notification",
    }.get(cap, cap)
    return f"{name} Index" if head.is_index else name
