"""Streaming, hardened reader of ResourceSync documents (spec §7: ``<urlset>`` / ``<sitemapindex>``).

Bytes are pushed in as they arrive (``DocumentReader.feed``), so the harvester can hand over httpx chunks
and never hold a whole list: the ``Head`` comes out first, then one ``Entry`` per ``<url>``/``<sitemap>``,
and every element is freed once read.

Hardening (upstream documents are untrusted): lxml with ``resolve_entities=False, no_network=True,
load_dtd=False, huge_tree=False``; a DOCTYPE that declares entities and any unresolved entity reference are
refused (no XXE, no entity expansion bombs); libxml2 refuses text nodes over 10 MB and nesting deeper than
256; fed bytes are capped (``max_bytes``).

Speed: a pull parser reporting only the root's start event (its hooks stay in C for every other element);
after each slice of input the *completed* children of the root (all but the last) are read and deleted.
That costs far less than one parse event per entry. Plain entries are read by a compiled fast path
(``_speedups.pyx``, through lxml's C API, no proxies); everything else -- and every entry when it was
not compiled or ``RSAGG_PURE_PYTHON=1`` -- by ``DocumentReader._read_child``. Both give equal results.
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from types import ModuleType
from typing import Any, BinaryIO, cast

from lxml import etree

from .model import (
    DATETIME_ATTRS,
    INT_ATTRS,
    LN_ATTRS,
    MD_ATTRS,
    RS_NS,
    SITEMAP_NS,
    SITEMAPINDEX,
    URLSET,
    Entry,
    Head,
    Link,
    Md,
)
from .w3cdt import DatetimeError, parse_w3c

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
#: ``on_problem(line, message)``: receives recoverable value problems instead of an exception.
Problem = Callable[[int | None, str], None]
#: ``on_tolerated(rule, line, message)``: a known deviation read past on purpose (rule ids: the
#: harvester's ``harvest/deviations.py`` RULES); without it such a deviation goes to ``on_problem``.
Tolerated = Callable[[str, int | None, str], None]

_HARDENED: dict[str, Any] = {
    "resolve_entities": False,  # entity references stay unexpanded nodes (then refused below)
    "no_network": True,
    "load_dtd": False,  # never read an external DTD or external parameter entities
    "huge_tree": False,  # libxml2 limits: 10 MB text nodes, depth 256
    "remove_comments": True,
    "remove_pis": True,
}
_SLICE = 64 * 1024  # bytes handed to libxml2 at once: bounds the tree built between two walks
_SNIFF = 4 * 1024  # bytes handed to the root sniffer at once
_READ = 256 * 1024  # read size for files
_MAX_LOG = 10_000  # libxml2 warnings tolerated before a document is refused (they are kept in memory)

_SM = "{" + SITEMAP_NS + "}"
_RS = "{" + RS_NS + "}"
URL_TAG = _SM + "url"
SITEMAP_TAG = _SM + "sitemap"
LOC_TAG = _SM + "loc"
LASTMOD_TAG = _SM + "lastmod"
CHANGEFREQ_TAG = _SM + "changefreq"
MD_TAG = _RS + "md"
LN_TAG = _RS + "ln"
_ROOT_TAGS = (_SM + URLSET, _SM + SITEMAPINDEX)
_ENTRY_OF = {URLSET: URL_TAG, SITEMAPINDEX: SITEMAP_TAG}

#: Pull parsers whose last document closed cleanly, kept for the next document of the same thread (an
#: lxml parser belongs to the thread that made it). Why: the set-up of a parser at its first feed
#: (libxml2's push context, its buffers) was about a third of reading a small document (a Capability
#: List: 26 us with a new parser, 18 with a kept one), and a harvest of many small Sources reads two
#: documents for each (benchmarks/bench_many_sources.py). A parser's next feed starts a new
#: document, its error log emptied; the events of the last one are all read before it is kept.
_free_parsers = threading.local()
_FREE_PARSERS_MOST = 8


def _pull_parser() -> etree.XMLPullParser:
    free: list[etree.XMLPullParser] | None = getattr(_free_parsers, "parsers", None)
    if free:
        return free.pop()
    return etree.XMLPullParser(events=("start",), tag=_ROOT_TAGS, **_HARDENED)


def _keep_parser(parser: etree.XMLPullParser) -> None:
    """``parser`` closed its document without error: kept for the thread's next one."""
    for _ in parser.read_events():  # none may show in the next document
        pass
    free = _free_parsers.__dict__.setdefault("parsers", [])
    if len(free) < _FREE_PARSERS_MOST:
        free.append(parser)


#: libxml2 errors and warnings that mean an entity was declared, referenced or expanded.
_ENTITY_ERRORS = frozenset(
    getattr(etree.ErrorTypes, name)
    for name in (
        "ERR_UNDECLARED_ENTITY", "WAR_UNDECLARED_ENTITY", "ERR_ENTITY_LOOP", "ERR_ENTITY_BOUNDARY",
        "ERR_ENTITY_PE_INTERNAL", "ERR_ENTITY_IS_EXTERNAL", "ERR_ENTITY_IS_PARAMETER",
        "ERR_ENTITY_PROCESSING", "ERR_UNPARSED_ENTITY", "ERR_EXT_ENTITY_STANDALONE",
    )
)  # fmt: skip
_ENTITY_NAME = re.compile(r"[Ee]ntity '([^']*)'")
_LIMIT_ERRORS = frozenset({etree.ErrorTypes.ERR_RESOURCE_LIMIT, etree.ErrorTypes.ERR_NAME_TOO_LONG})

_fromisoformat = datetime.fromisoformat


def _fields(names: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """XML attribute -> (model field, kind: "datetime", "int" or "text") for rs:md or rs:ln (§7, Table 3)."""
    kinds = {name: "datetime" for name in DATETIME_ATTRS} | {name: "int" for name in INT_ATTRS}
    return {name: ("from_" if name == "from" else name, kinds.get(name, "text")) for name in names}


_MD_ATTRS = _fields(MD_ATTRS)
_LN_ATTRS = _fields(LN_ATTRS)


def _load_speedups() -> ModuleType | None:
    """The C fast path (``_speedups.pyx``) unless ``RSAGG_PURE_PYTHON`` is set or it was not compiled."""
    if os.environ.get("RSAGG_PURE_PYTHON"):
        return None
    try:
        return importlib.import_module(".rs._speedups", "aggregator")
    except ModuleNotFoundError:  # installed without a C compiler: the Python path reads everything
        return None
    except ImportError as exc:  # compiled, but not for this lxml: say so, the Python path still works
        logging.getLogger("rsagg").warning("document parser: compiled fast path not used: %s", exc)
        return None


_speedups = _load_speedups()
#: True when plain entries are read by the compiled fast path (``rsagg validate --version`` tells).
SPEEDUPS = _speedups is not None


class DocumentError(ValueError):
    """A document that cannot be read: malformed, hostile, too big, wrong root or namespace.

    Also raised for value problems when no ``on_problem`` callback was given.
    """

    def __init__(self, url: str | None, line: int | None, reason: str) -> None:
        self.url = url
        self.line = line
        self.reason = reason
        super().__init__(f"{url or '<document>'}:{line}: {reason}")

    def __reduce__(self) -> tuple:
        return (type(self), (self.url, self.line, self.reason))  # picklable despite its own __init__


def _w3c(value: str) -> datetime:
    """``w3cdt.parse_w3c`` with a C fast path for the form §7 recommends, ``YYYY-MM-DDThh:mm:ssZ``.

    ``datetime.fromisoformat`` alone accepts ISO forms that are not W3C Datetime (week dates, basic
    format), so it is only used once the separators (positions 4, 7, 10, 13, 16, 19) prove the shape.
    """
    if len(value) == 20 and value[4::3] == "--T::Z":
        try:
            return _fromisoformat(value)
        except ValueError:
            pass
    return parse_w3c(value)


def _entity_refusal(entry: etree._LogEntry) -> str | None:
    """The reason to refuse a document for a libxml2 log entry about entities, else None."""
    message = entry.message.strip()
    if entry.type in _ENTITY_ERRORS:
        m = _ENTITY_NAME.search(message)
        return f"entity {m.group(1)!r} not allowed ({message})" if m else f"entity not allowed ({message})"
    if "entity amplification" in message:
        return f"entity expansion not allowed ({message})"
    return None


def _local(tag: str) -> str:
    """``{ns}name`` -> ``name`` (for messages)."""
    return tag.rpartition("}")[2]


def _display(element_tag: object) -> str:
    """A tag as a reader of the document would write it, e.g. ``<rs:md>``, ``<url>``. (``object``: lxml
    types ``.tag`` as str, bytes or QName; a parsed element's is a str, which ``str`` returns as it is.)"""
    tag = str(element_tag)
    if tag.startswith(_RS):
        return f"<rs:{tag[len(_RS) :]}>"
    if tag.startswith(_SM):
        return f"<{tag[len(_SM) :]}>"
    return f"<{tag}>"


def _near(ns: str, expected: str) -> bool:
    """True for a namespace that was meant to be ``expected`` but is not (https, missing slash, case)."""
    if ns == expected:
        return False

    def norm(u: str) -> str:
        return u.lower().split("://", 1)[-1].removeprefix("www.").rstrip("/")

    return norm(ns) == norm(expected)


def _serialize(el: etree._Element) -> str:
    """A foreign element as an XML string carrying the namespace declarations it uses (not its tail)."""
    c = copy.deepcopy(el)  # a detached copy, so in-scope but unused declarations can be dropped
    etree.cleanup_namespaces(c)
    return etree.tostring(c, encoding=str, with_tail=False)


class DocumentReader:
    """Push parser (lxml XMLPullParser, hardened). Feed bytes as they arrive (e.g. from httpx).

    ``feed`` and ``close`` return the items completed so far; over the whole document the ``Head`` is
    always the first item (handed out as soon as the first entry starts); an entry is handed out once the
    next element has started, the last one at ``close``. After a ``DocumentError`` the reader is dead and
    raises it again. Keep one reader on one thread (lxml parsers are not thread-safe and intern names in
    per-thread dictionaries): feeding from the trio thread is fine, under 1 ms per 64 KiB.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        on_problem: Problem | None = None,
        require: bool = False,
        on_tolerated: Tolerated | None = None,
    ) -> None:
        self.url = url
        self._max_bytes = max_bytes
        self._on_problem = on_problem
        self._on_tolerated = on_tolerated
        #: A missing mandatory part (``<loc>`` of an entry, ``rel``/``href`` of an ``rs:ln``) raises even
        #: with ``on_problem``: a harvester cannot place an entry without URI, nor follow a link without
        #: target. Without it (a validator) such an item is reported and kept with None in its place.
        self._require = require
        # The one parser: one event only, the root's start, where the root and the DOCTYPE are checked
        # (``_check_root``). Entries are read by walking the root's children.
        self._parser = _pull_parser()
        # A document whose first _SNIFF bytes gave no <urlset>/<sitemapindex> start (a wrong root, or a
        # long prolog) is read by a second parser too, that sees the first start tag whatever its name,
        # so that a wrong root is refused early rather than after the whole document is built. Kept
        # apart for those: a second parser for every document cost ~0.4 ms each.
        self._sniffer: etree.XMLPullParser | None = None
        self._unsniffed: list[bytes] | None = []  # what was fed before the root showed, up to _SNIFF
        self._root: etree._Element | None = None
        self._entry_tag = URL_TAG
        self._other_entry_tag = SITEMAP_TAG
        self._root_name = URLSET
        self._entry_name = "url"
        self._speedups = _speedups
        self._head: Head | None = None
        self._head_emitted = False
        self._fed = 0
        self._newlines = 0
        self._log_seen = 0
        self._error: DocumentError | None = None
        self._closed = False

    # -- public API ----------------------------------------------------------------------------------

    def feed(self, data: bytes) -> list[Head | Entry]:
        """Parse more bytes; returns the items completed by them (possibly none)."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ValueError("feed() after close()")
        if not isinstance(data, bytes):
            if not isinstance(data, bytearray | memoryview):
                raise TypeError(f"feed() takes bytes, not {type(data).__name__}")
            data = bytes(data)
        out: list[Head | Entry] = []
        if not data:
            return out
        try:
            if self._fed + len(data) > self._max_bytes:
                allowed = data[: self._max_bytes - self._fed]
                self._fail(
                    self._newlines + allowed.count(b"\n") + 1,
                    f"document larger than max_bytes={self._max_bytes}: refused at byte {self._max_bytes}",
                )
            if len(data) <= _SLICE:
                self._feed_slice(data, out)
            else:
                for i in range(0, len(data), _SLICE):
                    self._feed_slice(data[i : i + _SLICE], out)
        except DocumentError as exc:
            self._error = exc
            raise
        return out

    def close(self) -> list[Head | Entry]:
        """Finish the document; raises ``DocumentError`` if it is empty, truncated or not well-formed."""
        if self._error is not None:
            raise self._error
        if self._closed:
            return []
        self._closed = True
        out: list[Head | Entry] = []
        try:
            if self._fed == 0:
                self._fail(1, "empty document (no bytes)")
            try:
                root = self._parser.close()
            except etree.XMLSyntaxError as exc:
                raise self._syntax_error(self._parser, exc, closing=True) from None
            self._check_log()
            _keep_parser(self._parser)  # its document is read: ``root`` stays whole
            if self._head is None:  # a root no event showed (a wrong one): refused here
                self._check_root(root)
            if self._root is None:
                self._root = root
            self._walk(out, final=True)
            if not self._head_emitted:
                out.append(self._emit_head())
        except DocumentError as exc:
            self._error = exc
            raise
        finally:
            self._root = self._sniffer = self._unsniffed = None
        return out

    # -- feeding -------------------------------------------------------------------------------------

    def _feed_slice(self, chunk: bytes, out: list[Head | Entry]) -> None:
        self._fed += len(chunk)
        if self._sniffer is not None:
            self._sniff(chunk)
        try:
            self._parser.feed(chunk)
        except etree.XMLSyntaxError as exc:
            raise self._syntax_error(self._parser, exc) from None
        self._newlines += chunk.count(b"\n")
        self._check_log()
        events = self._parser.read_events()
        if self._root is None:
            for _event, el in events:
                if self._head is None:
                    # A <urlset> inside another element is not the root: the real one is refused.
                    parent = el.getparent()
                    self._check_root(el if parent is None else el.getroottree().getroot())
                self._root = el
                self._sniffer = self._unsniffed = None
                break
            else:
                self._no_root_yet(chunk)
                return
        for _ in events:  # nested <urlset>s deeper down: drop their events
            pass
        self._walk(out, final=False)

    def _no_root_yet(self, chunk: bytes) -> None:
        """No root start after ``chunk``: past _SNIFF bytes, a sniffer reads what came so far (and then
        every slice) to refuse a wrong root before the rest of the document is built."""
        if self._head is not None:
            return
        if self._sniffer is None:
            held = self._unsniffed
            if held is None:
                return
            held.append(chunk)
            if self._fed < _SNIFF:
                return
            self._unsniffed = None
            self._sniffer = etree.XMLPullParser(events=("start",), **_HARDENED)
            self._sniff(b"".join(held))
        # (a sniffer that exists was fed ``chunk`` by ``_feed_slice`` already)

    def _sniff(self, chunk: bytes) -> None:
        sniffer = self._sniffer
        assert sniffer is not None  # set by the caller
        for i in range(0, len(chunk), _SNIFF):
            try:
                sniffer.feed(chunk[i : i + _SNIFF])
            except etree.XMLSyntaxError as exc:
                raise self._syntax_error(sniffer, exc) from None
            for _event, el in sniffer.read_events():
                self._check_root(el)
                self._sniffer = None  # the root is right: the one parser will show it
                return

    def _check_root(self, root: etree._Element) -> None:
        """Root <urlset> or <sitemapindex> in the Sitemap namespace (§7); no entity declarations."""
        line = root.sourceline
        dtd = root.getroottree().docinfo.internalDTD
        if dtd is not None:
            for ent in dtd.iterentities():
                self._fail(line, f"entity {ent.name!r} not allowed: the DOCTYPE declares entities")
        tag = cast(str, root.tag)  # lxml types .tag for its setter too; an element's is a str
        ns, local = (tag[1:].split("}", 1)) if tag[:1] == "{" else ("", tag)
        if local not in _ENTRY_OF:
            self._fail(line, f"root element is <{local}>, expected <urlset> or <sitemapindex> (§7)")
        if ns != SITEMAP_NS:
            self._fail(line, f"root <{local}> is in namespace {ns or 'none'!r}, expected {SITEMAP_NS!r} (§7)")
        nsmap = root.nsmap
        rs = nsmap.get("rs")
        if rs is not None and rs != RS_NS:
            self._fail(line, f"prefix rs is bound to {rs!r}, expected the ResourceSync namespace {RS_NS!r}")
        for uri in nsmap.values():
            if _near(uri, RS_NS):
                self._fail(line, f"namespace {uri!r} is not the ResourceSync namespace {RS_NS!r}")
        self._root_name = local
        self._entry_name = "url" if local == URLSET else "sitemap"
        self._entry_tag = _ENTRY_OF[local]
        self._other_entry_tag = SITEMAP_TAG if local == URLSET else URL_TAG
        self._head = Head(root=local, line=line)

    def _check_log(self) -> None:
        """Refuse unresolved entity references, which lxml lets pass when entities are not resolved.

        With a DOCTYPE, libxml2 reports an undeclared entity only as a warning and drops it from
        attribute values silently; without one, lxml ignores the error and fails later with a wrong
        message. The push parser's log has the truth.
        """
        log = self._parser.feed_error_log
        n = len(log)
        if n <= self._log_seen:
            return
        for entry in list(log)[self._log_seen :]:
            reason = _entity_refusal(entry)
            if reason is not None:
                self._fail(entry.line, reason)
        self._log_seen = n
        if n > _MAX_LOG:
            first = next(iter(log))
            self._fail(first.line, f"more than {_MAX_LOG} XML warnings, e.g. {first.message.strip()}")

    def _syntax_error(
        self, parser: etree.XMLPullParser, exc: etree.XMLSyntaxError, closing: bool = False
    ) -> DocumentError:
        """Turn lxml's exception into a DocumentError naming the first real problem and its line.

        The exception's own ``error_log`` is lxml's thread-global log (it holds errors of earlier
        documents), so the parser's ``feed_error_log`` is read instead.
        """
        first = None
        for entry in parser.feed_error_log:
            reason = _entity_refusal(entry)
            if reason is not None:
                return DocumentError(self.url, entry.line, reason)
            if first is None and entry.level >= etree.ErrorLevels.ERROR:
                first = entry
        if first is None:
            line, message = exc.lineno or self._newlines + 1, str(exc)
        else:
            line, message = first.line, first.message.strip()
            if first.type in _LIMIT_ERRORS:
                return DocumentError(
                    self.url, line, f"XML limit exceeded (text over 10 MB, depth over 256...): {message}"
                )
            if first.type == etree.ErrorTypes.ERR_ENTITYREF_SEMICOL_MISSING:
                message += " (an unescaped '&'?)"
            elif first.type == etree.ErrorTypes.ERR_DOCUMENT_EMPTY:
                return DocumentError(self.url, line, f"no XML element in the document ({message})")
            elif closing and (first.type == etree.ErrorTypes.ERR_TAG_NOT_FINISHED or line > self._newlines):
                # libxml2 holds back the end of its input until close: only an error there is a truncation.
                return DocumentError(self.url, line, f"truncated document: {message}")
        return DocumentError(self.url, line, f"not well-formed XML: {message}")

    # -- reading the tree ----------------------------------------------------------------------------

    def _walk(self, out: list[Head | Entry], final: bool) -> None:
        """Read and delete the completed children of the root (all but the last unless ``final``).

        The hot path of the module: the C speedups read every plain entry and hand the rest to
        ``_read_child``; without them, every child goes through ``_read_child``.
        """
        root = self._root
        assert root is not None  # the root is read before its children
        n = len(root) if final else len(root) - 1
        if n > 0:
            if self._speedups is not None:
                self._speedups.read_children(self, root, n, out, self._entry_name)
            else:
                read = self._read_child
                el: etree._Element | None
                for el in root[:n]:
                    read(el, out)
                el = None  # no proxies left: deleted nodes are freed at once, not moved to a new document
            del root[:n]
        self._head_if_entry_started(out)

    def _read_child(self, el: etree._Element, out: list[Head | Entry]) -> None:
        """One child of the root: an entry (§7 ``<url>``/``<sitemap>``) or document metadata."""
        if el.tag != self._entry_tag:
            self._root_child(el)
            return
        if not self._head_emitted:
            out.append(self._emit_head())
        loc = lastmod = changefreq = md = None
        md_first = False
        links: list[Link] = []
        extra: list[str] = []
        for child in el[:]:  # a list of the children: twice as fast as iterating the element
            tag = child.tag
            if tag == LOC_TAG and loc is None:
                if md is not None:
                    md_first = True
                # .text stops at the first child node; entity nodes were refused before this point.
                text = child.text
                loc = text.strip() if text else ""
            elif tag == LASTMOD_TAG and lastmod is None:
                try:
                    lastmod = _w3c(child.text)  # type: ignore[arg-type]  # None: the TypeError below
                except (DatetimeError, TypeError):
                    self._problem(child.sourceline, f"<lastmod> is not a W3C Datetime: {child.text!r}")
            elif tag == MD_TAG and md is None:
                md = self._md(child)
            elif tag == LN_TAG:
                links.append(self._ln(child))
            elif tag == CHANGEFREQ_TAG and changefreq is None:
                text = child.text
                changefreq = text.strip() or None if text else None
            else:
                self._entry_child(el, child, tag, extra)
        if loc is None and len(el) == 0 and el.text and el.text.strip():
            # POD (2020): <url>URI</url>, the URI as the element's text. Read as its <loc>.
            loc = el.text.strip()
            self._tolerated("loc-as-text", el.sourceline, f"{_display(el.tag)} with text and no <loc> "
                            f"(§7: <loc> is mandatory); its text {loc!r} read as the <loc>")  # fmt: skip
        elif md_first:
            self._tolerated("md-before-loc", el.sourceline, f"<rs:md> before <loc> in {_display(el.tag)} "
                            "(§7, sitemap schema: <loc> comes first); read in any order")  # fmt: skip
        if not loc:
            self._missing(el.sourceline, f"{_display(el.tag)} without <loc> (§7: mandatory)")
            loc = None
        # An entry without <loc> goes on with loc None (reported just above, as §7 wants).
        out.append(Entry(loc, lastmod, changefreq, md, links, extra, el.sourceline))  # type: ignore[arg-type]

    def _head_if_entry_started(self, out: list[Head | Entry]) -> None:
        """The head is complete once the first entry has started: hand it out before that entry ends."""
        root = self._root
        assert root is not None  # entries start inside the root
        if not self._head_emitted and len(root) and root[-1].tag == self._entry_tag:
            out.append(self._emit_head())

    def _emit_head(self) -> Head:
        self._head_emitted = True
        assert self._head is not None  # made with the root (_check_root)
        return self._head

    def _root_child(self, el: etree._Element) -> None:
        """A child of the root that is not an entry: document metadata/links (§7) or something misplaced."""
        tag = el.tag
        if not isinstance(tag, str):  # an unresolved entity node: refused already (_check_log); skip
            return
        line = el.sourceline
        if tag == self._other_entry_tag:
            self._fail(line, f"{_display(tag)} not allowed in <{self._root_name}> (§7)")
        self._check_ns(el, tag)
        head = self._head
        assert head is not None  # made with the root (_check_root)
        if self._head_emitted:
            if tag == LN_TAG:
                # Kept: the head object handed out earlier gains it, so a reader that looks at the
                # document's links after its entries (paging: rel="next") still sees it.
                self._tolerated("late-head-link", line, "<rs:ln> of the document after its first entry "
                                "(§7: it belongs before them); read as a link of the document")  # fmt: skip
                head.links.append(self._ln(el))
                return
            self._problem(
                line, f"{_display(tag)} after the first entry is ignored (§7: it belongs before them)"
            )
            return
        if tag == MD_TAG:
            if head.md is not None:
                self._problem(line, "more than one <rs:md> for the document; the first one is used")
            else:
                head.md = self._md(el)
        elif tag == LN_TAG:
            head.links.append(self._ln(el))
        else:
            head.extra.append(_serialize(el))

    def _check_ns(self, el: etree._Element, tag: str) -> None:
        """A namespace meant to be ResourceSync's or the Sitemap's but not quite is a structural error."""
        if tag[:1] == "{":
            ns = tag[1:].partition("}")[0]
            if _near(ns, RS_NS) or _near(ns, SITEMAP_NS):
                self._fail(
                    el.sourceline,
                    f"<{_local(tag)}> in namespace {ns!r}, expected {RS_NS!r} or {SITEMAP_NS!r}",
                )

    def _entry_child(self, el: etree._Element, child: etree._Element, tag: object, extra: list[str]) -> None:
        """A child of an entry other than the first loc/lastmod/changefreq/rs:md or an rs:ln."""
        if not isinstance(tag, str):  # an unresolved entity node: refused already (_check_log); skipped
            return
        line = child.sourceline
        if tag in (LOC_TAG, LASTMOD_TAG, CHANGEFREQ_TAG, MD_TAG):
            note = " (§7: not repeatable)" if tag == MD_TAG else ""
            self._problem(
                line,
                f"more than one {_display(tag)} in {_display(el.tag)}{note}; the first one is used",
            )
        elif tag == URL_TAG or tag == SITEMAP_TAG:
            self._fail(line, f"{_display(tag)} nested in {_display(el.tag)}")
        else:
            self._check_ns(child, tag)
            extra.append(_serialize(child))

    def _md(self, el: etree._Element) -> Md:
        """The attributes of an rs:md (§7, Table 3); unknown and foreign ones are kept in ``extra``."""
        values, extra = self._attributes(el, _MD_ATTRS)
        return Md(**values, extra=extra)

    def _ln(self, el: etree._Element) -> Link:
        """The attributes of an rs:ln (§7, Table 3); rel and href are mandatory."""
        values, extra = self._attributes(el, _LN_ATTRS)
        for name in ("rel", "href"):
            if name not in values:
                self._missing(el.sourceline, f"<rs:ln> without {name} (§7: mandatory)")
        return Link(values.pop("rel", None), values.pop("href", None), **values, extra=extra)

    def _attributes(
        self, el: etree._Element, known: dict[str, tuple[str, str]]
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Known attributes as model fields (text, integer or W3C Datetime); the others in ``extra``."""
        values: dict[str, Any] = {}  # each value of its field's type (str, int or datetime), or None
        extra: dict[str, str] = {}
        for name, value in el.items():
            field_kind = known.get(name)
            if field_kind is None:
                self._unknown_attribute(el, name, value, extra)
                continue
            field, kind = field_kind
            if kind == "int":
                values[field] = self._int(el, name, value)
            elif kind == "datetime":
                values[field] = self._dt(el, name, value)
            else:
                values[field] = value
        return values, extra

    def _unknown_attribute(self, el: etree._Element, name: str, value: str, extra: dict[str, str]) -> None:
        """Keep it (nothing an upstream wrote is lost); §7 wants extensions in a namespace of their own."""
        extra[name] = value
        if name[:1] != "{":
            self._problem(
                el.sourceline,
                f"unknown attribute {name!r} on {_display(el.tag)} (§7); kept as extra",
            )
        elif name.startswith(_RS):
            self._problem(
                el.sourceline,
                f"attribute {_local(name)!r} on {_display(el.tag)} is in the rs namespace (§7: unprefixed)",
            )

    def _dt(self, el: etree._Element, name: str, value: str) -> datetime | None:
        try:
            return _w3c(value)
        except DatetimeError:
            self._problem(el.sourceline, f"{name}={value!r} on {_display(el.tag)} is not a W3C Datetime (§7)")
            return None

    def _int(self, el: etree._Element, name: str, value: str) -> int | None:
        text = value.strip()
        if text.isdigit() and text.isascii():
            return int(text)
        self._problem(el.sourceline, f"{name}={value!r} on {_display(el.tag)} is not a non-negative integer")
        return None

    # -- problems ------------------------------------------------------------------------------------

    def _fail(self, line: int | None, reason: str) -> None:
        raise DocumentError(self.url, line, reason)

    def _tolerated(self, rule: str, line: int | None, message: str) -> None:
        if self._on_tolerated is not None:
            self._on_tolerated(rule, line, message)
        else:
            self._problem(line, message)

    def _missing(self, line: int | None, message: str) -> None:
        if self._require:
            self._fail(line, message)
        self._problem(line, message)

    def _problem(self, line: int | None, message: str) -> None:
        if self._on_problem is None:
            raise DocumentError(self.url, line, message)
        self._on_problem(line, message)


def _chunks(source: str | os.PathLike | bytes | BinaryIO) -> Iterator[bytes]:
    if isinstance(source, bytes | bytearray | memoryview):
        view = memoryview(source)
        for i in range(0, len(view), _SLICE):
            yield bytes(view[i : i + _SLICE])
    elif isinstance(source, str | os.PathLike):
        with open(source, "rb") as f:
            yield from iter(lambda: f.read(_READ), b"")
    else:
        while chunk := source.read(_READ):
            yield chunk


def iter_document(
    source: str | os.PathLike | bytes | BinaryIO,
    url: str | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    on_problem: Problem | None = None,
    require: bool = False,
    on_tolerated: Tolerated | None = None,
) -> Iterator[Head | Entry]:
    """Yield the ``Head`` and then each ``Entry`` of a document (a path, bytes or a binary file)."""
    if url is None and isinstance(source, str | os.PathLike):
        url = os.fspath(source)
    reader = DocumentReader(
        url, max_bytes=max_bytes, on_problem=on_problem, require=require, on_tolerated=on_tolerated
    )
    for chunk in _chunks(source):
        yield from reader.feed(chunk)
    yield from reader.close()


def read_document(
    source: str | os.PathLike | bytes | BinaryIO, url: str | None = None, **kw
) -> tuple[Head, Iterator[Entry]]:
    """The head at once (so a caller can decide what the document is), the entries lazily."""
    items = iter_document(source, url, **kw)
    head = next(items)
    return head, items  # type: ignore[return-value]  # only entries follow the head


def parse_bytes(data: bytes, url: str | None = None, **kw) -> tuple[Head, list[Entry]]:
    """A whole (small) document at once: capability lists, source descriptions, notifications."""
    head, entries = read_document(data, url, **kw)
    return head, list(entries)
