"""Checks a ResourceSync document against the specification, streaming, and lists every problem found.

Why: rsagg reads documents written by others and writes its own; both sides need one place that knows the
rules of ResourceSync 1.1 (core §7–§13, Appendix A), Change/Framework Notification 1.0.1 and the Archives
draft, and can say *where* a document breaks them. Each problem is an ``Issue`` with a line, a short
kebab-case rule id and a severity: "error" for what the texts say *must* (or mandatory), "warning" for
*should*/recommended, for "only used for" (§7) and for things the texts leave undefined or leave to other
specifications (capabilities beyond the core list, §6.1, §9).

Memory does not grow with the number of entries: rules keep only what they strictly need (the last
datetimes seen for order checks, a Capability List's few capabilities, a bounded window of recent
``<loc>`` values for duplicate detection).
"""

from __future__ import annotations

import os
import re
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from hashlib import blake2b
from typing import BinaryIO

from lxml import etree

from . import model as m
from .fixity import bad_hash_tokens
from .model import Entry, Head, Link, Md
from .parse import DEFAULT_MAX_BYTES, DocumentError, DocumentReader
from .w3cdt import DatetimeError, is_strict_w3c, parse_w3c

ERROR = "error"
WARNING = "warning"

#: How many issues of one rule a document reports before the rest are only counted (bounded output).
MAX_PER_RULE = 1000
#: How many recent ``<loc>`` values the duplicate check remembers (bounded memory, exact within the window).
LOC_WINDOW = 65_536
CHUNK = 65_536
#: §7 follows the Sitemap protocol's limits: at most 50,000 entries in one document (more need an index).
MAX_ENTRIES = 50_000


@dataclass(slots=True)
class Issue:
    """One problem: where (line, None when unknown), which rule, what, and how bad."""

    line: int | None
    rule: str
    message: str
    severity: str = ERROR

    def as_dict(self) -> dict:
        return {"line": self.line, "severity": self.severity, "rule": self.rule, "message": self.message}


def _key(issue: Issue) -> int:
    return issue.line or 0


# --- per-document profiles -------------------------------------------------------------------------------
# Modes for the at/from attributes (Appendix A, Table 4, and §7's "is used for ... not used for" lists):
MANDATORY, RECOMMENDED, OPTIONAL = "mandatory", "recommended", "optional"
NOT_USED = "not-used"  # the text says the attribute is not used here: error when present
ELSEWHERE = "elsewhere"  # §7 says the entry attribute is "only used for" other documents: warning
UNDEFINED = "undefined"  # the text does not define the attribute here: warning when present


@dataclass(frozen=True, slots=True)
class _Profile:
    top_at: str = UNDEFINED
    top_from: str = UNDEFINED
    child_at: str = ELSEWHERE
    child_from: str = ELSEWHERE
    up: tuple[str, str] | None = None  # (severity, why) when the top rel="up" link is missing
    order: tuple[str, str, str] | None = None  # (key "datetime"|"from"|"at", severity, section)
    change: str | None = None  # section requiring rs:md/@change on every entry
    path: bool = False  # a Dump Manifest: entries carry @path (§11.2, §13.2)
    datetime_ok: bool = False  # entries may carry @datetime (§7)
    loc_unique: bool = False  # one entry per resource (§8, §10.1, §11.1: "should")


#: Where the text makes the top-level rs:ln rel="up" mandatory (error when missing).
_UP_MUST = {
    m.CAPABILITYLIST: "to the Source Description (mandatory, §9)",
    m.RESOURCELIST: "to the Capability List (mandatory, §10.1)",
    # §11.1's bullet list lost this item in our text conversion (an empty "- -" item); the 1.0.9 draft
    # text of §11.1 has it, as does the parallel §13.1 for Change Dumps.
    m.RESOURCEDUMP: "to the Capability List (mandatory, §11.1)",
    m.CHANGEDUMP: "to the Capability List (mandatory, §13.1)",
}
#: Elsewhere §7 describes rel="up" from a capability document to its Capability List, but the document's
#: own section (§10.2, §11.2, §12.1, §13.2) does not list it: a warning.
_UP_SHOULD = "to the Capability List (§7; not listed as mandatory for this document)"


def _profile(capability: str | None, is_index: bool) -> _Profile:
    """The rules that depend on the kind of document (Appendix A and the section of each document)."""
    up_must = (ERROR, _UP_MUST[capability]) if capability in _UP_MUST and not is_index else None
    up_should = (WARNING, _UP_SHOULD)
    match capability:
        case m.RESOURCELIST if is_index:  # §10.2
            return _Profile(
                top_at=MANDATORY, top_from=NOT_USED, child_at=OPTIONAL, up=up_should, loc_unique=True
            )
        case m.RESOURCELIST:  # §10.1
            return _Profile(top_at=MANDATORY, top_from=NOT_USED, up=up_must, loc_unique=True)
        case m.RESOURCEDUMP:  # §11.1 (index: "similar to" §10.2)
            up = up_should if is_index else up_must
            return _Profile(top_at=MANDATORY, top_from=NOT_USED, child_at=OPTIONAL, up=up, loc_unique=True)
        case m.RESOURCEDUMP_MANIFEST:  # §11.2
            return _Profile(top_at=MANDATORY, top_from=NOT_USED, up=up_should, path=True)
        case m.CHANGELIST if is_index:  # §12.2: up mandatory, Change Lists "must" be in forward order
            return _Profile(
                top_at=NOT_USED,
                top_from=MANDATORY,
                child_from=RECOMMENDED,
                up=(ERROR, "to the Capability List (mandatory, §12.2)"),
                order=("from", ERROR, "§12.2"),
            )
        case m.CHANGELIST:  # §12.1
            return _Profile(
                top_at=NOT_USED,
                top_from=MANDATORY,
                up=up_should,
                order=("datetime", ERROR, "§12.1"),
                change="§12.1",
                datetime_ok=True,
            )
        case m.CHANGEDUMP if is_index:  # §13.1: a Change Dump Index "in a manner similar to" §12.2
            return _Profile(
                top_at=NOT_USED,
                top_from=MANDATORY,
                child_from=RECOMMENDED,
                up=(ERROR, "to the Capability List (mandatory, §13.1 by way of §12.2)"),
                order=("from", ERROR, "§13.1/§12.2"),
            )
        case m.CHANGEDUMP:  # §13.1: entries "should" be in forward chronological order
            return _Profile(
                top_at=NOT_USED,
                top_from=MANDATORY,
                child_from=RECOMMENDED,
                up=up_must,
                order=("from", WARNING, "§13.1"),
            )
        case m.CHANGEDUMP_MANIFEST:  # §13.2
            return _Profile(
                top_at=NOT_USED,
                top_from=MANDATORY,
                up=up_should,
                order=("datetime", ERROR, "§13.2"),
                change="§13.2",
                path=True,
                datetime_ok=True,
            )
        case m.CHANGE_NOTIFICATION:  # Change Notification 1.0.1 (NOTES.md)
            return _Profile(
                top_at=NOT_USED,
                top_from=MANDATORY,
                child_at=UNDEFINED,
                child_from=UNDEFINED,
                order=("datetime", ERROR, "Change Notification"),
                change="Change Notification",
                datetime_ok=True,
            )
        case m.FRAMEWORK_NOTIFICATION:  # Framework Notification 1.0.1: from/until optional
            return _Profile(
                top_from=OPTIONAL,
                child_at=UNDEFINED,
                child_from=UNDEFINED,
                change="Framework Notification",
                datetime_ok=True,
            )
        case m.DESCRIPTION:  # §8
            return _Profile(loc_unique=True)
        case m.CAPABILITYLIST:  # §9
            return _Profile(up=up_must)
        case m.RESOURCELIST_ARCHIVE | m.RESOURCEDUMP_ARCHIVE:  # Archives draft: chronological, with up
            return _Profile(
                child_at=OPTIONAL, child_from=UNDEFINED, up=up_should, order=("at", WARNING, "Archives")
            )
        case m.CHANGELIST_ARCHIVE | m.CHANGEDUMP_ARCHIVE:
            return _Profile(
                child_at=UNDEFINED, child_from=OPTIONAL, up=up_should, order=("from", WARNING, "Archives")
            )
    return _Profile(child_at=UNDEFINED, child_from=UNDEFINED)


#: An attribute where it does not belong: (severity, why) by mode.
_OUT_OF_PLACE = {
    NOT_USED: (ERROR, "not used here (§7, Appendix A)"),
    ELSEWHERE: (WARNING, "§7 says it is only used for {docs}"),
    UNDEFINED: (WARNING, "not defined for this document"),
}
#: §7's "only used for" lists of the entry-level time attributes.
_ONLY_USED_FOR = {
    "at": "Resource List Indexes, Resource Dumps and Resource Dump Indexes",
    "from": "Change List Indexes, Change Dumps and Change Dump Indexes",
}
#: Relation types of the IANA Link Relation Type Registry (§7: a relation type is registered there or is a
#: URI), and ``resourcesync``, which §6.3.3 defines for discovery links. Compared case-insensitively
#: (RFC 8288 §2.1.1).
_REGISTERED_RELS = frozenset(
    """resourcesync
    about acl alternate amphtml api-catalog appendix apple-touch-icon apple-touch-startup-image archives
    author blocked-by bookmark c2pa-manifest canonical chapter cite-as collection compression-dictionary
    contents convertedfrom copyright create-form current deprecation describedby describes disclosure
    dns-prefetch duplicate edit edit-form edit-media enclosure external first geofeed glossary help hosts hub
    ice-server icon index intervalafter intervalbefore intervalcontains intervaldisjoint intervalduring
    intervalequals intervalfinishedby intervalfinishes intervalin intervalmeets intervalmetby
    intervaloverlappedby intervaloverlaps intervalstartedby intervalstarts item last latest-version license
    linkset lrdd manifest mask-icon me media-feed memento micropub modulepreload monitor monitor-group next
    next-archive nofollow noopener noreferrer opener openid2.local_id openid2.provider original p3pv1 payment
    pingback preconnect predecessor-version prefetch preload prerender prev prev-archive preview previous
    privacy-policy profile publication related replies restconf ruleinput search section self service
    service-desc service-doc service-meta sip-trunking-capability sponsored start status stylesheet
    subsection successor-version sunset tag terms-of-service timegate timemap type ugc up version-history via
    webmention working-copy working-copy-of""".split()
)
#: An absolute URI begins with its scheme (RFC 3986 §3.1); anything else is a relative reference.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_PATCH_REL = m.PATCH_REL.lower()


_MEMENTO_REL = "memento"
#: Attributes a §14.6 timegate link should not carry (Example 29: rel and href only).
_TIMEGATE_EXTRA = ("pri", "modified", "hash", "length", "type", "encoding", "path")


def _is_absolute(uri: str) -> bool:
    return _SCHEME.match(uri.strip()) is not None


def _rels(value: str | None) -> list[str]:
    """The relation types of a rel attribute, lower-cased (RFC 8288 §2.1.1: case-insensitive)."""
    return value.lower().split() if value else []


def _has_rel(links: Iterable[Link], rel: str) -> bool:
    return any(rel in _rels(ln.rel) and ln.href for ln in links)


#: What a Capability List may advertise (§9, Change/Framework Notification, Archives).
_ADVERTISABLE = frozenset(
    {
        m.RESOURCELIST,
        m.RESOURCEDUMP,
        m.CHANGELIST,
        m.CHANGEDUMP,
        m.CHANGE_NOTIFICATION,
        m.FRAMEWORK_NOTIFICATION,
    }
    | m.ARCHIVES
)
#: Documents a Framework Notification may be about (Framework Notification 1.0.1).
_FRAMEWORK_DOCS = frozenset(
    {m.RESOURCELIST, m.CHANGELIST, m.RESOURCEDUMP, m.CHANGEDUMP, m.CAPABILITYLIST, m.DESCRIPTION} | m.ARCHIVES
)
_MD_KNOWN = frozenset(m.MD_ATTRS)
_LN_KNOWN = frozenset(m.LN_ATTRS)
_RS_PREFIX = "{" + m.RS_NS + "}"


class _Rules:
    """The rule checks of one document: ``head`` once, then ``entry`` per entry (streaming)."""

    def __init__(self, head: Head, *, parsed: bool = False) -> None:
        self.head = head
        self.parsed = parsed  # items come from aggregator.rs.parse, which reports some problems itself
        self.md = head.md or Md()
        self.capability = head.capability if head.capability in m.CAPABILITIES else None
        self.p = _profile(self.capability, head.is_index)
        self.capabilities: dict[str, int] = {}  # Capability List: capability -> line of first entry (§9)
        self.last: dict[str, datetime] = {}  # order key kind -> last value seen
        self.recent: set[int] = set()
        self.recent_order: deque[int] = deque()
        self.entries = 0

    # -- head ------------------------------------------------------------------------------------------
    def check_head(self) -> Iterator[Issue]:
        h, line, cap = self.head, self.head.line, self.head.capability
        if h.md is None:
            yield Issue(line, "md-missing", "the document has no top-level rs:md (mandatory, §7)")
        elif not cap:
            yield Issue(line, "capability-missing", "the top-level rs:md has no capability (mandatory, §7)")
        elif cap not in m.CAPABILITIES:
            yield _unknown_capability(line, cap)
        if h.is_index and cap in m.CAPABILITIES and cap not in m.INDEXABLE:
            if cap == m.DESCRIPTION:
                pass  # §8: multiple Source Descriptions "must" be grouped by a Source Description Index
            elif cap == m.CAPABILITYLIST:
                yield Issue(
                    line,
                    "index-not-allowed",
                    "§9: Sources should not publish a Capability List as <sitemapindex>",
                    WARNING,
                )
            else:
                yield Issue(
                    line,
                    "index-not-allowed",
                    f"a {m.kind_name(Head(md=h.md))} has the <urlset> root, never <sitemapindex>",
                )
        if self.capability:
            yield from self._times(self.md, line, self.p.top_at, self.p.top_from, "top-level")
            if cap == m.CHANGE_NOTIFICATION and self.md.until is None:
                yield Issue(
                    line, "until-required", "a change notification's rs:md needs until (Change Notification)"
                )
            yield from self._up(line)
            if cap in (m.DESCRIPTION, m.CAPABILITYLIST) and not _has_rel(h.links, "describedby"):
                sec = "§8" if cap == m.DESCRIPTION else "§9"
                yield Issue(
                    line, "describedby-missing", f'{sec}: a rs:ln rel="describedby" is recommended', WARNING
                )
        yield from self._md_common(self.md, line)
        yield from self._links(h.links, line)

    def _up(self, line: int | None) -> Iterator[Issue]:
        if self.p.up is None or _has_rel(self.head.links, "up"):
            return
        severity, why = self.p.up
        yield Issue(line, "up-link-missing", f'no rs:ln rel="up" {why}', severity)

    def _times(self, md: Md, line: int | None, at_mode: str, from_mode: str, where: str) -> Iterator[Issue]:
        """Appendix A: at/from mandatory, recommended or not used; completed/until only alongside them."""
        cap = self.capability
        for name, value, mode, partner, pvalue in (
            ("at", md.at, at_mode, "completed", md.completed),
            ("from", md.from_, from_mode, "until", md.until),
        ):
            if value is None and mode == MANDATORY:
                yield Issue(
                    line, f"{name}-required", f"the {where} rs:md of a {cap} needs {name} (Appendix A)"
                )
            elif value is None and mode == RECOMMENDED:
                yield Issue(
                    line,
                    f"{name}-recommended",
                    f"the {where} rs:md of a {cap} should have {name} (Appendix A)",
                    WARNING,
                )
            for attr, val in ((name, value), (partner, pvalue)):
                if val is not None and mode in _OUT_OF_PLACE:
                    sev, why = _OUT_OF_PLACE[mode]
                    why = why.format(docs=_ONLY_USED_FOR[name])
                    yield Issue(
                        line, f"{attr}-not-allowed", f"{attr} on the {where} rs:md of a {cap}: {why}", sev
                    )
        if md.at and md.completed and md.completed < md.at:
            yield Issue(line, "completed-before-at", "completed is before at (§7)")
        if md.from_ and md.until and md.until < md.from_:
            yield Issue(line, "until-before-from", "until is before from (§7)")

    # -- both levels -----------------------------------------------------------------------------------
    def _md_common(self, md: Md, line: int | None) -> Iterator[Issue]:
        if md.hash is not None:
            bad = bad_hash_tokens(md.hash)
            if bad:
                yield _hash_issue(bad, line, "rs:md")
        if md.length is not None and md.length < 0:
            yield Issue(line, "length-range", f"length {md.length} is negative")
        if md.change is not None and md.change not in m.CHANGES:
            yield Issue(
                line, "change-unknown", f"change {md.change!r} is not created, updated or deleted (§7)"
            )
        if not self.parsed:
            yield from _extra_attrs(md.extra, _MD_KNOWN, "rs:md", line)

    def _links(self, links: list[Link], line: int | None) -> Iterator[Issue]:
        for ln in links:
            if not ln.rel and not (self.parsed and ln.rel is None):  # None: the parser said so
                yield Issue(line, "ln-rel-missing", "rs:ln without rel (mandatory, §7)")
            if not ln.href and _MEMENTO_REL in _rels(ln.rel):
                yield Issue(
                    line, "memento-href-missing", "a memento link needs href, the version's URI (§14.6)"
                )
            elif not ln.href and not (self.parsed and ln.href is None):
                yield Issue(line, "ln-href-missing", "rs:ln without href (mandatory, §7)")
            yield from self._rel(ln, line)
            if ln.pri is not None and not 1 <= ln.pri <= 999_999:
                yield Issue(line, "pri-range", f"pri {ln.pri} is outside 1..999999 (§7)")
            if ln.hash is not None:
                bad = bad_hash_tokens(ln.hash)
                if bad:
                    yield _hash_issue(bad, line, "rs:ln")
            if ln.length is not None and ln.length < 0:
                yield Issue(line, "length-range", f"rs:ln length {ln.length} is negative")
            if ln.href and not _is_absolute(ln.href):
                yield Issue(
                    line, "href-relative", f"rs:ln href {ln.href.strip()[:80]!r} is not an absolute URI (§7)"
                )
            if not self.parsed:
                yield from _extra_attrs(ln.extra, _LN_KNOWN, "rs:ln", line)

    def _rel(self, ln: Link, line: int | None) -> Iterator[Issue]:
        """§7: registered or a URI; §14.4: a patch link has a type, and a path inside a Change Dump."""
        rels = _rels(ln.rel)
        for rel in rels:
            if rel not in _REGISTERED_RELS and not _is_absolute(rel):
                yield Issue(
                    line,
                    "rel-unknown",
                    f"relation type {rel!r} is neither in the IANA Link Relations registry nor a URI (§7)",
                )
        if "timegate" in rels and len(rels) == 1:
            extra = [a for a in _TIMEGATE_EXTRA if getattr(ln, a) is not None] + sorted(ln.extra)
            if extra:
                yield Issue(
                    line,
                    "timegate-attributes",
                    f"a timegate link should carry only rel and href, not {', '.join(extra)} (§14.6)",
                    WARNING,
                )
        if _PATCH_REL not in rels:
            return
        if ln.type is None:
            yield Issue(line, "patch-type-missing", "a patch link needs type, the patch format (§14.4)")
        if self.capability == m.CHANGEDUMP_MANIFEST and ln.path is None:
            yield Issue(
                line,
                "patch-path-missing",
                "a patch link in a Change Dump Manifest needs path, the patch's place in the package (§14.4)",
            )

    # -- entries ---------------------------------------------------------------------------------------
    def check_entry(self, e: Entry) -> Iterator[Issue]:
        line, md, p, cap = e.line, e.md, self.p, self.capability
        self.entries += 1
        if self.entries == MAX_ENTRIES + 1:
            yield Issue(
                line,
                "entries-limit",
                f"more than {MAX_ENTRIES:,} entries in one document: §7 follows the Sitemap limit; "
                "split the document and group the parts with an index",
            )
        if not e.loc and not (self.parsed and e.loc is None):
            yield Issue(line, "loc-missing", "entry without <loc> (mandatory, §7)")
        elif e.loc and not _is_absolute(e.loc):
            yield Issue(line, "loc-relative", f"<loc> {e.loc.strip()[:80]!r} is not an absolute URI (§7)")
        if e.changefreq is not None and e.changefreq not in m.CHANGEFREQS:
            yield Issue(
                line, "changefreq-unknown", f"changefreq {e.changefreq!r} is not a defined value (§7)"
            )
        if md is not None:
            yield from self._md_common(md, line)
        yield from self._links(e.links, line)
        if cap is None:
            return
        if md is not None:
            yield from self._times(md, line, p.child_at, p.child_from, "entry")
        elif RECOMMENDED in (p.child_at, p.child_from):
            name = "at" if p.child_at == RECOMMENDED else "from"
            yield Issue(
                line,
                f"{name}-recommended",
                f"entries of a {cap} should have rs:md with {name} (Appendix A)",
                WARNING,
            )
        if p.change:
            yield from self._change(e, p.change)
        elif md is not None and md.change is not None:
            yield Issue(
                line,
                "change-not-allowed",
                f"change is used in change documents, not in a {cap} (§7)",
                WARNING,
            )
        if md is not None and md.datetime is not None and not p.datetime_ok:
            yield Issue(
                line,
                "datetime-not-allowed",
                f"datetime is used in change documents, not in a {cap} (§7)",
                WARNING,
            )
        if md is not None and md.datetime is not None and self.md.from_ is not None:
            yield from self._interval(md.datetime, line)
        if p.path:
            yield from self._path(e)
        elif md is not None and md.path is not None:
            yield Issue(line, "path-not-allowed", "path is only used in Dump Manifests (§7)", WARNING)
        if p.order:
            yield from self._order(e)
        if p.loc_unique and e.loc:
            yield from self._duplicate(e)
        if cap == m.RESOURCELIST and not self.head.is_index and md is not None and md.capability is not None:
            yield Issue(
                line,
                "capability-on-entry",
                f"capability {md.capability!r} on a Resource List entry: an entry is a resource (§10.1); "
                "parts of a list belong in a <sitemapindex> (§10.2)",
                WARNING,
            )
        if cap == m.CAPABILITYLIST:
            yield from self._capability_entry(e)
        elif cap == m.DESCRIPTION:
            yield from self._description_entry(e)
        elif cap == m.FRAMEWORK_NOTIFICATION:
            yield from self._framework_entry(e)

    def _change(self, e: Entry, section: str) -> Iterator[Issue]:
        if e.md is None or e.md.change is None:
            yield Issue(e.line, "change-required", f"entry without rs:md change ({section})")

    def _interval(self, dt: datetime, line: int | None) -> Iterator[Issue]:
        """§7: an entry's datetime is at or after the document's from and at or before its until."""
        if dt < self.md.from_:  # type: ignore[operator]
            yield Issue(line, "datetime-outside-interval", "datetime is before the document's from (§7)")
        elif self.md.until is not None and dt > self.md.until:
            yield Issue(line, "datetime-outside-interval", "datetime is after the document's until (§7)")

    def _path(self, e: Entry) -> Iterator[Issue]:
        """§11.2, §13.2: path with a leading slash, mandatory except for deletions."""
        md, line = e.md, e.line
        path = md.path if md else None
        deleted = md is not None and md.change == m.DELETED
        section = "§13.2" if self.capability == m.CHANGEDUMP_MANIFEST else "§11.2"
        if path is None and not deleted:
            yield Issue(line, "path-missing", f"manifest entry without rs:md path ({section})")
        elif path is not None and deleted:
            yield Issue(
                line, "path-on-deletion", "a deletion has no bitstream, yet has a path (§13.2)", WARNING
            )
        elif path is not None and not path.startswith("/"):
            yield Issue(line, "path-leading-slash", f"path {path!r} must start with '/' ({section})")
        if not deleted and (md is None or md.type is None):
            how = "strongly recommended" if section == "§13.2" else "recommended"
            yield Issue(line, "type-missing", f"rs:md type is {how} in manifests ({section})", WARNING)

    def _order(self, e: Entry) -> Iterator[Issue]:
        """Forward chronological order (§12.1, §12.2, §13.1, §13.2, notifications, archives).

        The key is the entry's own time (datetime, from or at); entries without one are compared by
        lastmod, but only with each other: §7 warns that lastmod need not be the change time, so an
        order broken only by lastmod is a warning.
        """
        kind, severity, section = self.p.order  # type: ignore[misc]
        md = e.md
        value = getattr(md, "from_" if kind == "from" else kind) if md else None
        if value is None and e.lastmod is not None:
            kind, value, severity = "lastmod", e.lastmod, WARNING
        if value is None:
            return
        last = self.last.get(kind)
        if last is not None and value < last:
            yield Issue(
                e.line,
                "chronological-order",
                f"entries must be in forward chronological order ({section}): {kind} goes back in time",
                severity,
            )
        else:
            self.last[kind] = value

    def _duplicate(self, e: Entry) -> Iterator[Issue]:
        h = int.from_bytes(blake2b(e.loc.encode(), digest_size=8).digest(), "big")
        if h in self.recent:
            yield Issue(
                e.line, "loc-duplicate", f"{e.loc} is listed more than once (one entry per resource)", WARNING
            )
            return
        self.recent.add(h)
        self.recent_order.append(h)
        if len(self.recent_order) > LOC_WINDOW:
            self.recent.discard(self.recent_order.popleft())

    def _capability_entry(self, e: Entry) -> Iterator[Issue]:
        """§9: every entry has rs:md capability, one entry per capability; notifications need a hub link."""
        cap = e.capability
        if not cap:
            yield Issue(
                e.line, "capability-entry-missing", "Capability List entry without rs:md capability (§9)"
            )
            return
        if cap not in m.CAPABILITIES:
            yield _unknown_capability(e.line, cap)
        elif cap not in _ADVERTISABLE:
            yield Issue(
                e.line, "capability-not-allowed", f"a Capability List does not advertise {cap!r} (§9)"
            )
        if cap in self.capabilities:
            yield Issue(
                e.line,
                "capability-duplicate",
                f"second entry for {cap!r} (first at line "
                f"{self.capabilities[cap]}); one entry per capability (§9)",
            )
        elif len(self.capabilities) < 64:  # bounded even for hostile lists
            self.capabilities[cap] = e.line or 0
        if cap in (m.CHANGE_NOTIFICATION, m.FRAMEWORK_NOTIFICATION) and not _has_rel(e.links, "hub"):
            yield Issue(
                e.line, "hub-link-missing", f'{cap} is advertised with a rs:ln rel="hub" (Notification)'
            )

    def _description_entry(self, e: Entry) -> Iterator[Issue]:
        """§8: the optional rs:md of an entry must say capability="capabilitylist"."""
        if e.md is None:
            return
        allowed = {m.CAPABILITYLIST, m.DESCRIPTION} if self.head.is_index else {m.CAPABILITYLIST}
        if not e.md.capability:
            yield Issue(
                e.line, "capability-entry-missing", "Source Description entry rs:md without capability (§8)"
            )
        elif e.md.capability not in allowed:
            yield Issue(
                e.line,
                "capability-not-allowed",
                f"a Source Description lists Capability Lists, not {e.md.capability!r} (§8)",
            )

    def _framework_entry(self, e: Entry) -> Iterator[Issue]:
        cap = e.capability
        if not cap:
            yield Issue(e.line, "capability-entry-missing", "framework notification entry without capability")
        elif cap not in _FRAMEWORK_DOCS:
            yield Issue(e.line, "capability-not-allowed", f"framework notifications are not about {cap!r}")


def _unknown_capability(line: int | None, cap: str) -> Issue:
    return Issue(
        line,
        "capability-unknown",
        f"capability {cap!r} is not defined by ResourceSync (other specifications may add some, §6.1, §9)",
        WARNING,
    )


def _hash_issue(bad: list[str], line: int | None, where: str) -> Issue:
    tokens = ", ".join(t[:40] for t in bad[:3])
    return Issue(
        line,
        "hash-token",
        f"{where} hash token(s) not algorithm:hex (md5, sha-1, sha-256, sha-512): {tokens}",
        WARNING,
    )


def _extra_attrs(
    extra: dict[str, str], known: frozenset[str], where: str, line: int | None
) -> Iterator[Issue]:
    """§7: ResourceSync attributes carry no prefix; other attributes must be in another namespace."""
    for name in extra:
        if name.startswith(_RS_PREFIX):
            local = name[len(_RS_PREFIX) :]
            yield Issue(
                line, "attribute-prefixed", f"{where} attribute rs:{local} must not have a prefix (§7)"
            )
        elif not name.startswith("{") and name not in known:
            yield Issue(
                line,
                "attribute-unknown",
                f"{where} attribute {name!r} is not defined by ResourceSync; "
                "extensions need their own namespace (§7)",
            )


def validate_stream(items: Iterable[Head | Entry]) -> Iterator[Issue]:
    """Check a parsed document (the head first, then entries) and yield issues as they are found."""
    rules: _Rules | None = None
    for item in items:
        if isinstance(item, Head):
            if rules is not None:
                raise ValueError("validate_stream: a second Head")
            rules = _Rules(item)
            yield from rules.check_head()
        else:
            if rules is None:
                raise ValueError("validate_stream: the Head must come first")
            yield from rules.check_entry(item)


# --- raw-text checks -------------------------------------------------------------------------------------
_MD_TAG = f"{{{m.RS_NS}}}md"
_LN_TAG = f"{{{m.RS_NS}}}ln"
_LASTMOD_TAG = f"{{{m.SITEMAP_NS}}}lastmod"
_ENTRY_TAGS = (f"{{{m.SITEMAP_NS}}}url", f"{{{m.SITEMAP_NS}}}sitemap")
_MD_TIMES = ("at", "completed", "from", "until", "datetime")


def _recommended_form(value: str) -> bool:
    """§7 recommends YYYY-MM-DDThh:mm:ss[.s]Z."""
    v = value.strip()
    return len(v) >= 20 and v[10] == "T" and v.endswith("Z") and (len(v) == 20 or v[19] == ".")


class _RawScan:
    """The datetimes as written, which the parsed model (datetime values) cannot show.

    §7: values are W3C Datetime, where a time needs a zone designator; the parser reads such times
    leniently as UTC, so strictness is checked here on the raw text of the same bytes fed to the parser.
    """

    def __init__(self) -> None:
        self._parser = etree.XMLPullParser(
            events=("end",),
            tag=(_MD_TAG, _LN_TAG, _LASTMOD_TAG, *_ENTRY_TAGS),
            resolve_entities=False,
            no_network=True,
            load_dtd=False,
            remove_comments=True,
            remove_pis=True,
        )
        self.alive = True

    def feed(self, data: bytes) -> list[Issue]:
        if not self.alive:
            return []
        try:
            self._parser.feed(data)
            return self._drain()
        except etree.LxmlError:
            self.alive = False  # the parser proper reports malformed documents
            return []

    def close(self) -> list[Issue]:
        if not self.alive:
            return []
        self.alive = False
        try:
            self._parser.close()
            return self._drain()
        except etree.LxmlError:
            return []

    def _drain(self) -> list[Issue]:
        out: list[Issue] = []
        for _event, el in self._parser.read_events():
            tag = el.tag
            if tag == _MD_TAG:
                for name in _MD_TIMES:
                    out.extend(_raw_time(el.get(name), f"rs:md {name}", el.sourceline, True))
            elif tag == _LN_TAG:
                out.extend(_raw_time(el.get("modified"), "rs:ln modified", el.sourceline, True))
            elif tag == _LASTMOD_TAG:
                out.extend(_raw_time(el.text, "lastmod", el.sourceline, False))
            else:  # an entry is done: free it and its predecessors, memory stays flat
                el.clear()
                parent = el.getparent()
                if parent is not None:
                    while el.getprevious() is not None:
                        del parent[0]
        return out


def _raw_time(value: str | None, what: str, line: int | None, recommend: bool) -> list[Issue]:
    if value is None or (len(value) == 20 and value[4::3] == "--T::Z"):
        return []  # absent, or the recommended YYYY-MM-DDThh:mm:ssZ (the parser checks the digits)
    try:
        parse_w3c(value)
    except DatetimeError:
        return []  # unparseable: the parser reports it
    if not is_strict_w3c(value):
        return [
            Issue(
                line,
                "w3c-datetime",
                f"{what} {value.strip()!r} is not W3C Datetime (a time needs a zone designator, §7)",
            )
        ]
    if recommend and not _recommended_form(value):
        return [
            Issue(
                line,
                "datetime-form",
                f"{what} {value.strip()!r}: §7 recommends YYYY-MM-DDThh:mm:ss[.s]Z",
                WARNING,
            )
        ]
    return []


# --- encoding -------------------------------------------------------------------------------------------
#: Byte-order marks and the first bytes of ``<?`` in encodings that are not UTF-8 (XML 1.0 Appendix F).
_NOT_UTF8_STARTS = (
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\xfe\xff", "UTF-16"),
    (b"\xff\xfe", "UTF-16"),
    (b"\x00\x00\x00<", "UTF-32"),
    (b"<\x00\x00\x00", "UTF-32"),
    (b"\x00<", "UTF-16"),
    (b"<\x00", "UTF-16"),
)
_DECLARED = re.compile(rb"<\?xml[^>]*?\sencoding\s*=\s*[\"']([A-Za-z][A-Za-z0-9._-]*)[\"']")
#: Declared encodings whose documents are UTF-8 byte for byte (ASCII is a subset).
_UTF8_NAMES = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})
#: How many leading bytes hold the XML declaration, if there is one.
_PROLOG = 512


def _encoding_issue(prolog: bytes) -> Issue | None:
    """The Sitemap protocol, on which §7 builds, requires UTF-8; a BOM or the declaration says otherwise."""
    name = next((n for start, n in _NOT_UTF8_STARTS if prolog.startswith(start)), None)
    if name is None:
        found = _DECLARED.match(prolog.removeprefix(b"\xef\xbb\xbf").lstrip())
        if found is None or found.group(1).decode().lower() in _UTF8_NAMES:
            return None
        name = found.group(1).decode()
    return Issue(1, "encoding-not-utf8", f"the document is in {name}, not UTF-8 (Sitemap protocol, §7)")


# --- bytes in, report out --------------------------------------------------------------------------------
@dataclass
class Report:
    """The outcome for one document: what it is, how many entries, and its issues."""

    source: str
    kind: str | None = None
    capability: str | None = None
    entries: int = 0
    issues: list[Issue] = field(default_factory=list)
    errors: int = 0
    warnings: int = 0

    @property
    def valid(self) -> bool:
        return self.errors == 0

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "kind": self.kind,
            "capability": self.capability,
            "entries": self.entries,
            "valid": self.valid,
            "errors": self.errors,
            "warnings": self.warnings,
            "issues": [i.as_dict() for i in self.issues],
        }


class _Gunzip:
    """Transparent gunzip for ``.xml.gz`` sitemaps (detected by the magic bytes, not the name).

    Output comes in pieces of at most ``CHUNK`` bytes, so the parser's byte cap stops a gzip bomb
    before it is inflated in memory.
    """

    def __init__(self) -> None:
        self._z: zlib._Decompress | None = None  # a zlib decompressobj once gzip is detected
        self._decided = False
        self._head = b""

    def feed(self, data: bytes) -> Iterator[bytes]:
        if not self._decided:
            self._head += data
            if len(self._head) < 2:
                return
            self._decided = True
            data, self._head = self._head, b""
            if data[:2] == b"\x1f\x8b":
                self._z = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        if self._z is None:
            yield data
            return
        piece = self._z.decompress(data, CHUNK)
        while piece:
            yield piece
            piece = self._z.decompress(self._z.unconsumed_tail, CHUNK) if self._z.unconsumed_tail else b""

    def close(self) -> bytes:
        if not self._decided:
            self._decided = True
            return self._head
        if self._z is not None and not self._z.eof:
            raise zlib.error("truncated gzip stream")
        return b""


#: Parser problems (``aggregator.rs.parse`` messages) that are one of our rules; all others are "value".
#: The rules skip these checks for parsed documents so that each problem is reported once.
#: The parser's tolerated deviations as validator rules (all errors: §7 says otherwise).
_TOLERATED_RULES = {"loc-as-text": "loc-missing", "md-before-loc": "element-order", "late-head-link": "value"}

_PROBLEM_RULES = (
    ("without <loc>", "loc-missing"),
    ("<rs:ln> without rel", "ln-rel-missing"),
    ("<rs:ln> without href", "ln-href-missing"),
    ("unknown attribute", "attribute-unknown"),
    ("is in the rs namespace", "attribute-prefixed"),
)


class Checker:
    """Push-style validation of one document: ``feed`` bytes as they arrive, then ``close``.

    Issues come back from each call (roughly in line order) so that a caller can print them while a
    large document is still arriving; ``report`` keeps them too, up to ``max_per_rule`` per rule.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        max_bytes: int | None = None,
        max_per_rule: int | None = MAX_PER_RULE,
        source: str | None = None,
    ) -> None:
        self._pending: list[Issue] = []
        self._reader = DocumentReader(
            url, max_bytes=max_bytes or DEFAULT_MAX_BYTES, on_problem=self._on_problem,
            on_tolerated=self._on_tolerated,
        )  # fmt: skip
        self._raw = _RawScan()
        self._gunzip = _Gunzip()
        self._rules: _Rules | None = None
        self._done = False
        self._max = max_per_rule
        self._counts: dict[str, int] = {}
        self._hidden: dict[str, list[int]] = {}  # rule -> [count, errors]
        self._prolog: bytes | None = b""  # the first bytes, until the encoding is checked (then None)
        self.report = Report(source or url or "<document>")

    def _on_tolerated(self, rule: str, line: int | None, message: str) -> None:
        """What a harvester reads past on purpose is still an error of the document."""
        self._pending.append(Issue(line, _TOLERATED_RULES.get(rule, rule), message))

    def _on_problem(self, line: int | None, message: str) -> None:
        rule = next((r for fragment, r in _PROBLEM_RULES if fragment in message), "value")
        self._pending.append(Issue(line, rule, message))

    @property
    def done(self) -> bool:
        """True once the document is finished or refused: further bytes are ignored (stop reading)."""
        return self._done

    def feed(self, data: bytes) -> list[Issue]:
        out: list[Issue] = []
        try:
            for piece in self._gunzip.feed(data):
                if self._done:
                    break
                out += self._step(piece, final=False)
        except zlib.error as exc:
            out += self._refuse(None, f"not a valid gzip stream: {exc}")
        return out

    def close(self) -> list[Issue]:
        if self._done:
            return []
        try:
            tail = self._gunzip.close()
        except zlib.error as exc:
            out = self._refuse(None, f"not a valid gzip stream: {exc}")
        else:
            out = self._step(tail, final=True)
        self._done = True
        for rule, (count, errors) in self._hidden.items():
            sev = ERROR if errors else WARNING
            out.append(Issue(None, rule, f"{count} more issue(s) of this rule not shown", sev))
            self.report.issues.append(out[-1])
        return out

    def _step(self, data: bytes, *, final: bool) -> list[Issue]:
        found: list[Issue] = []
        if self._prolog is not None:  # before the parser, which may refuse such a document outright
            self._prolog += data[:_PROLOG]
            if final or len(self._prolog) >= _PROLOG or b">" in self._prolog:
                issue = _encoding_issue(self._prolog)
                self._pending.extend([issue] if issue else [])
                self._prolog = None
        try:
            items = self._reader.feed(data) if data else []
            if final:
                items = [*items, *self._reader.close()]
        except DocumentError as exc:
            return self._refuse(exc.line, exc.reason)
        found.extend(self._pending)
        self._pending = []
        for item in items:
            if isinstance(item, Head):
                self._rules = _Rules(item, parsed=True)
                self.report.capability = item.capability
                self.report.kind = m.kind_name(item)
                found.extend(self._rules.check_head())
            elif self._rules is not None:
                self.report.entries += 1
                found.extend(self._rules.check_entry(item))
        found.extend(self._raw.feed(data) if data else [])
        if final:
            found.extend(self._raw.close())
        found.sort(key=_key)
        return self._keep(found)

    def _refuse(self, line: int | None, reason: str) -> list[Issue]:
        """The document cannot be read on: one ``malformed`` issue, then nothing more."""
        self._done = True
        found, self._pending = [*self._pending, Issue(line, "malformed", reason)], []
        return self._keep(found)

    def _keep(self, found: list[Issue]) -> list[Issue]:
        shown = []
        for issue in found:
            if issue.severity == ERROR:
                self.report.errors += 1
            else:
                self.report.warnings += 1
            n = self._counts[issue.rule] = self._counts.get(issue.rule, 0) + 1
            if self._max is not None and n > self._max:
                hidden = self._hidden.setdefault(issue.rule, [0, 0])
                hidden[0] += 1
                hidden[1] += issue.severity == ERROR
                continue
            shown.append(issue)
            self.report.issues.append(issue)
        return shown


def _chunks(source: str | os.PathLike | bytes | BinaryIO) -> Iterator[bytes]:
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
        for i in range(0, len(data), CHUNK):
            yield data[i : i + CHUNK]
        return
    if isinstance(source, str | os.PathLike):
        with open(source, "rb") as fh:
            yield from iter(lambda: fh.read(CHUNK), b"")
        return
    yield from iter(lambda: source.read(CHUNK), b"")


def check_source(
    source: str | os.PathLike | bytes | BinaryIO,
    url: str | None = None,
    *,
    max_bytes: int | None = None,
    max_per_rule: int | None = MAX_PER_RULE,
    on_issue: Callable[[Issue], None] | None = None,
) -> Report:
    """Validate a document (path, bytes or binary file) and return its ``Report``."""
    name = url or (os.fspath(source) if isinstance(source, str | os.PathLike) else None)
    checker = Checker(url, max_bytes=max_bytes, max_per_rule=max_per_rule, source=name)
    for chunk in _chunks(source):
        for issue in checker.feed(chunk):
            if on_issue:
                on_issue(issue)
        if checker.done:
            break
    for issue in checker.close():
        if on_issue:
            on_issue(issue)
    return checker.report


def validate_source(source: str | os.PathLike | bytes | BinaryIO, url: str | None = None) -> list[Issue]:
    """Parse leniently and check; a document the parser cannot read gives one ``malformed`` issue."""
    return sorted(check_source(source, url, max_per_rule=None).issues, key=_key)


__all__ = [
    "ERROR",
    "WARNING",
    "Checker",
    "Issue",
    "Report",
    "check_source",
    "validate_source",
    "validate_stream",
]
