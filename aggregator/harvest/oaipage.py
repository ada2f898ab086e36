"""One OAI-PMH response (OAI-PMH 2.0 §3): parsed, and its records' content made durable blobs.

Why a module of its own: ``store_page`` runs in the harvest's worker processes (``offload.py``), which
import this module and what it needs (lxml, the blob store), not the daemon's configuration, HTTP client
or state store: a worker starts sooner and holds about 25 MB less. The walk itself is ``oaipmh.py``.
"""

from __future__ import annotations

import functools
import html
import io
import pickle
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast
from urllib.parse import quote

from lxml import etree

from ..rs.w3cdt import parse_w3c
from ..store.blobs import BlobStore, BlobWriter, begin_spooled

OAI = "http://www.openarchives.org/OAI/2.0/"
#: The elements the page parser stops at (Clark notation -> local name).
_TAGS = {f"{{{OAI}}}{t}": t for t in ("responseDate", "error", "record", "resumptionToken", "Identify")}
_HEADER, _IDENTIFIER, _DATESTAMP, _METADATA = (
    f"{{{OAI}}}{t}" for t in ("header", "identifier", "datestamp", "metadata")
)


class OaiError(Exception):
    """An OAI-PMH error response (§3.6) or a response that is not OAI-PMH; names the request."""

    def __init__(self, url: str, code: str, message: str) -> None:
        super().__init__(url, code, message)
        self.url, self.code, self.message = url, code, message

    def __str__(self) -> str:
        return f"{self.url}: OAI-PMH {self.code}: {self.message}"


@dataclass(slots=True)
class Record:
    identifier: str
    datestamp: datetime | None
    deleted: bool
    content: bytes | None  # the metadata element, exclusive C14N; None when deleted


@dataclass
class Page:
    """One OAI-PMH response: records in document order, the token after them, errors."""

    records: list[Record] = field(default_factory=list)
    token: str | None = None  # None or "": the list is complete (§3.5)
    complete_size: int | None = None  # resumptionToken's completeListSize, when given
    cursor: int | None = None  # resumptionToken's cursor: the list position of this page's first record
    response_date: datetime | None = None
    errors: list[tuple[str, str]] = field(default_factory=list)  # (code, message)
    identify: dict[str, str] = field(default_factory=dict)  # Identify's simple child elements
    problems: list[str] = field(default_factory=list)  # records skipped, with why


def _datestamp(text: str | None) -> datetime | None:
    return _parse_stamp(text) if text else None


@functools.lru_cache(maxsize=1024)  # bounded: a hostile page of distinct stamps only evicts
def _parse_stamp(text: str) -> datetime | None:
    """A datestamp, parsed once: the records of a page often share one (day granularity, a repository
    loaded in bulk), and the one object shared is also pickled once when the page's records go back to
    the daemon from a worker process (``store_page``). A datetime is immutable: sharing it is safe."""
    try:
        return parse_w3c(text.strip())
    except ValueError:
        return None


def _count(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


#: Pages up to this size are parsed whole (``etree.fromstring``: libxml2 builds the tree without the GIL,
#: and a third cheaper than feeding an incremental parser); bigger ones incrementally, a record at a time,
#: so memory stays a small multiple of the page's bytes whatever a repository sends.
TREE_BYTES = 4 * 1024 * 1024
#: Entities are not resolved and nothing is fetched from the network (hostile documents).
_SAFE: dict[str, Any] = {
    "resolve_entities": False,
    "no_network": True,
    "huge_tree": False,
    "remove_blank_text": False,
}
_PARSER = etree.XMLParser(**_SAFE)


def parse_page(data: bytes, url: str) -> Page:
    """Parse one response (blocking: run it in a worker thread).

    A page bigger than TREE_BYTES is parsed incrementally, each record serialised and cleared once
    read, so the tree never holds more than one record. Both ways read the same elements in document
    order and give the same Page (tests/test_oaipmh.py compares them).
    """
    page = Page()
    try:
        if len(data) <= TREE_BYTES:
            root = etree.fromstring(data, _PARSER)
            elements = root.iter(*_TAGS) if root.tag not in _TAGS else (root,)
            for el in elements:
                _read_element(el, page)
        else:
            for _, el in etree.iterparse(io.BytesIO(data), events=("end",), tag=list(_TAGS), **_SAFE):
                if _read_element(el, page):
                    el.clear(keep_tail=False)
                    parent = el.getparent()
                    while parent is not None and el.getprevious() is not None:
                        del parent[0]
    except etree.XMLSyntaxError as exc:
        problem = f"not well-formed XML: {exc}"
    else:
        return page
    # Raised outside the handler: the parser's error (its error log cannot be pickled) is not this one's
    # context, so it travels back from a worker process (``store_page``).
    raise OaiError(url, "parse", problem)


def _read_element(el: etree._Element, page: Page) -> bool:
    """Read one element the parser stopped at into ``page``; True for a record (which may go now)."""
    tag = _TAGS[cast(str, el.tag)]  # the parser stops at _TAGS elements only: their tag is a str
    if tag == "record":
        _read_record(el, page)
        return True
    if tag == "resumptionToken":
        page.token = (el.text or "").strip() or None
        page.complete_size, page.cursor = _count(el.get("completeListSize")), _count(el.get("cursor"))
    elif tag == "responseDate":
        page.response_date = _datestamp(el.text)
    elif tag == "error":
        page.errors.append((el.get("code", "unknown"), (el.text or "").strip()))
    elif tag == "Identify":
        page.identify = {etree.QName(c).localname: (c.text or "").strip() for c in el
                         if isinstance(c.tag, str) and len(c) == 0}  # fmt: skip
    return False


def _read_record(el: etree._Element, page: Page) -> None:
    # The schema's order (header, metadata; identifier, datestamp) is looked at first, by position:
    # ``find`` by name cost a third of the parse of a page. Any other order is still read.
    header = el[0] if len(el) and el[0].tag == _HEADER else el.find(_HEADER)
    identifier = stamp = None
    if header is not None:
        for part in header:
            if part.tag == _IDENTIFIER and identifier is None:
                identifier = part.text
            elif part.tag == _DATESTAMP and stamp is None:
                stamp = part.text
    identifier = identifier.strip() if identifier else None
    if header is None or not identifier:
        page.problems.append(f"line {el.sourceline}: a record without header/identifier (skipped)")
        return
    datestamp = _datestamp(stamp)
    if header.get("status") == "deleted":
        page.records.append(Record(identifier, datestamp, True, None))
        return
    metadata: etree._Element | None = el[1] if len(el) > 1 and el[1].tag == _METADATA else el.find(_METADATA)
    child = next((c for c in metadata if isinstance(c.tag, str)), None) if metadata is not None else None
    if child is None:
        page.problems.append(f"record {identifier}: no metadata element (skipped)")
        return
    try:
        content = etree.tostring(child, method="c14n", exclusive=True)
    except etree.C14NError:  # e.g. an unresolved entity reference (entities are never resolved)
        page.problems.append(f"record {identifier}: metadata cannot be canonicalised (skipped)")
        return
    page.records.append(Record(identifier, datestamp, False, content))


#: How far from a page's end ``peek_token`` looks: the token is the last element but the closing tags.
_PEEK_BYTES = 16384
_PEEK = re.compile(rb"<(?:[\w.-]+:)?resumptionToken\b[^>]*?(?:/>|>([^<]*)</(?:[\w.-]+:)?resumptionToken\s*>)")


def peek_token(data: bytes) -> str | None:
    """The resumption token at the end of a response, found without parsing it: the next request can
    go out while this page is parsed (§3.5: the token is the list's last element). Only a guess, for
    the request ahead; the parsed page decides (a wrong guess costs a request whose answer is dropped).
    None: no token there, or one not worth guessing (markup inside, a CDATA section)."""
    found = None
    for found in _PEEK.finditer(data, max(0, len(data) - _PEEK_BYTES)):  # noqa: B007 (the last one)
        pass
    if found is None or found.group(1) is None:
        return None
    try:
        token = html.unescape(found.group(1).decode("utf-8")).strip()
    except UnicodeDecodeError:
        return None
    return token or None


#: ``quote(s, safe="")`` of each ASCII character: all but RFC 3986's unreserved ones escaped.
_QUOTED = {c: f"%{c:02X}" for c in range(128) if not (chr(c).isalnum() or chr(c) in "_.-~")}


def quote_all(text: str) -> str:
    """``urllib.parse.quote(text, safe="")``. Why not quote itself: its loop per character cost a
    quarter of making a record's change. An identifier ``head:tail`` with an alphanumeric ASCII tail
    (nearly all: ``oai:repository.org:1234``) reuses its quoted head; other ASCII ones are quoted by one
    ``translate``."""
    head, colon, tail = text.rpartition(":")
    if colon and tail.isascii() and tail.isalnum():
        return _quoted_head(head) + tail
    return _quote_text(text)


@functools.lru_cache(maxsize=1024)  # bounded: a repository has a few heads, a hostile one many
def _quoted_head(head: str) -> str:
    return _quote_text(head) + "%3A"


def _quote_text(text: str) -> str:
    return text.translate(_QUOTED) if text.isascii() else quote(text, safe="")


#: Hashes of a record besides sha-256: md5 is what resync compares by default.
_MD5 = frozenset({"md5"})
#: A record once its content is a durable blob (``store_page``): identifier, datestamp, deleted, the
#: blob's sha-256, length and md5 (None when deleted), and the record's GetRecord URL (its ``via``
#: link). A plain tuple: a worker process sends a page of them back pickled, and dataclasses cost five
#: times as much to unpickle. The URL is made here, in the worker, not on the daemon's event loop, which
#: is the walk's busiest part.
StoredRecord = tuple[str, datetime | None, bool, str | None, int, str | None, str]


def store_page(
    blobs: BlobStore, data: bytes, url: str, get_record: str = ""
) -> tuple[Page, list[StoredRecord], Exception | None]:
    """Parse a page and make its records' content durable blobs, in one call: in a worker process
    (``harvest/offload.py``), while the daemon fetches the next pages and commits the pages before it
    (blobs before state: the rows that name them come after, in walk order; until then a blob is named
    by nothing, and ``rsagg gc`` removes it if the walk never commits it). ``get_record``: the GetRecord
    URL of the repository, less the identifier (a record's ``via`` is it + the quoted identifier).

    Returns the page without its records (``Page.records`` is emptied: their content stays here), the
    records stored, in page order, and the error that stopped storing them (the walk raises it in walk
    order, after the pages before it commit). Raises OaiError for a page that is not well-formed.
    """
    page = parse_page(data, url)
    records, page.records = page.records, []
    if page.errors:  # an OAI-PMH error answer: no records to store
        return page, [], None
    writers: list[BlobWriter] = []
    try:
        contents = [rec.content for rec in records if rec.content is not None]
        put_small = getattr(blobs, "put_small", None)  # FileBlobStore's: small records, no writer each
        infos = put_small(contents, _MD5) if put_small is not None else None
        if infos is None:  # another store, or a record too big for small.db: a durable blob each
            infos = []
            for content in contents:
                writer = begin_spooled(blobs, _MD5)
                writers.append(writer)
                writer.write(content)
                infos.append(writer.finish())
            blobs.commit(writers)
    except Exception as exc:
        for writer in writers:
            writer.abort()  # its temp file goes now (a committed blob stays)
        return page, [], _portable(exc)
    stored: list[StoredRecord] = []
    found = iter(infos)
    for rec in records:
        via = get_record + quote_all(rec.identifier)
        if rec.content is None:
            stored.append((rec.identifier, rec.datestamp, True, None, 0, None, via))
            continue
        info = next(found)
        stored.append(
            (rec.identifier, rec.datestamp, False, info.sha256, info.length, info.hashes["md5"], via)
        )
    return page, stored, None


def _portable(exc: Exception) -> Exception:
    """``exc``, or an OSError saying the same when it cannot travel back from a worker process."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return OSError(f"{type(exc).__name__}: {exc}")
    return exc


__all__ = [
    "OAI",
    "OaiError",
    "Page",
    "Record",
    "StoredRecord",
    "parse_page",
    "peek_token",
    "quote_all",
    "store_page",
]
