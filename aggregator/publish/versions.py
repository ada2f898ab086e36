"""Prior versions of the resources rsagg republishes: §14.6 links and Memento (RFC 7089).

rsagg's changelog keeps the sha-256 of every version it applied, and gc keeps those blobs (within
``[publish] versions``, ``store/retention.py``). This module serves them (docs/versions.md)::

    /SET/memento/STAMP/<mapped>       a memento: the version of <mapped> current from STAMP on
    /SET/timegate/<mapped>            its TimeGate (Accept-Datetime -> 302 to a memento)
    /SET/timemap/<mapped>             its TimeMap, application/link-format (RFC 7089 §5)
    /SET/timemap/AFTER/<mapped>       the TimeMap's next pages (mementos after changelog seq AFTER)

``<mapped>`` is the part after ``/SET/r/`` of the resource's own rsagg URI (``uris.rsagg_path``), so
every URI of one resource shares it. ``STAMP`` is the changelog datetime of that version written as 20
digits, ``YYYYMMDDhhmmssffffff`` (rsagg's clock, microseconds: the same instant as the entry's
``lastmod``), so a Resource List can name the memento of each row without a changelog lookup, and
the URI never changes: a memento is immutable (``Cache-Control: immutable``).

TimeGate pattern: RFC 7089 §4.2.1 ("Pattern 2.1": the TimeGate is a resource of its own, URI-R !=
URI-G, 302-style negotiation). The resource's own URI stays a plain, cacheable, offloadable GET (no
``Vary: accept-datetime`` on every resource answer, no extra lookup on the hot route); it points at
its TimeGate and TimeMap with ``Link`` headers (§4.1.1's ``rel="timegate"``). The TimeGate answers
302 to the best memento: the version current at the Accept-Datetime (the last one at or before it),
the first version for an earlier datetime, the current one without the header.

The publish filter applies to each version (as the version's metadata, on the current row), so a
hidden version answers 404 like a resource never held and is left out of the TimeMap; a version
beyond retention answers 410 with a ``Link`` to the TimeMap, and is left out of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime

import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from ..rs.fixity import format_hash
from ..rs.model import DELETED, Link
from ..rs.w3cdt import utcnow
from ..store.interface import StateStore
from ..store.retention import Retention, parse_retention
from ..store.rows import LogRecord, Resource
from ..store.sets import PublishedSet
from .resources import (
    conditional_answer,
    gone,
    http_date,
    remote_response,
    resource_answer,
    resource_headers,
    validators_match,
)
from .uris import NotAResourcePath, rsagg_path, upstream_uri

log = logging.getLogger("rsagg.publish")

MEMENTO, TIMEGATE, TIMEMAP = "memento", "timegate", "timemap"
LINK_FORMAT = "application/link-format"
#: A memento never changes (RFC 9111 §5.2.2, RFC 8246): cached for a year, never revalidated.
IMMUTABLE = "public, max-age=31536000, immutable"
#: Mementos per TimeMap page; a longer history continues on ``rel="next"`` pages.
TIMEMAP_PAGE = 5000
_STAMP = re.compile(r"[0-9]{20}\Z")
_SEQ = re.compile(r"[0-9]{1,19}\Z")


# ---------------------------------------------------------------------------------------------------
# URIs


def stamp(dt: datetime) -> str:
    """``YYYYMMDDhhmmssffffff`` (UTC) of a changelog datetime: the memento's path segment."""
    dt = dt.astimezone(UTC) if dt.tzinfo is not None else dt
    return dt.strftime("%Y%m%d%H%M%S") + f"{dt.microsecond:06d}"


def stamp_text(text: str) -> str:
    """``stamp`` of a stored time text ``YYYY-MM-DDThh:mm:ss.ffffffZ`` (the listing writer's input)."""
    if len(text) == 27 and text[26] == "Z" and text[19] == ".":
        t = text
        return t[0:4] + t[5:7] + t[8:10] + t[11:13] + t[14:16] + t[17:19] + t[20:26]
    from ..store.rows import parse_dt

    dt = parse_dt(text)
    assert dt is not None
    return stamp(dt)


def parse_stamp(text: str) -> datetime | None:
    if not _STAMP.match(text):
        return None
    try:
        return datetime.strptime(text[:14], "%Y%m%d%H%M%S").replace(microsecond=int(text[14:]), tzinfo=UTC)
    except ValueError:
        return None


def memento_uri(base_url: str, set_name: str, when: datetime, upstream: str) -> str:
    return f"{base_url}/{set_name}/{MEMENTO}/{stamp(when)}/{rsagg_path(upstream)}"


def timegate_uri(base_url: str, set_name: str, upstream: str) -> str:
    return f"{base_url}/{set_name}/{TIMEGATE}/{rsagg_path(upstream)}"


def timemap_uri(base_url: str, set_name: str, upstream: str, after: int | None = None) -> str:
    page = "" if after is None else f"{after}/"
    return f"{base_url}/{set_name}/{TIMEMAP}/{page}{rsagg_path(upstream)}"


def original_uri(base_url: str, set_name: str, upstream: str) -> str:
    from .uris import rsagg_uri

    return rsagg_uri(base_url, set_name, upstream)


def split_version_path(raw_path: str, kind: str) -> tuple[str, str | None, str] | None:
    """``/SET/<kind>/[NUMBER/]<mapped>`` (raw path) -> (SET, NUMBER or None, upstream URI); None when
    it is not of that form. A mapped path starts with a scheme (a letter) or ``_``, never a digit, so
    the number segment is told apart without ambiguity."""
    from urllib.parse import unquote

    parts = raw_path.split("/", 3)
    if len(parts) != 4 or parts[0] != "" or parts[2] != kind or not parts[1]:
        return None
    rest, number = parts[3], None
    head, sep, tail = rest.partition("/")
    if head[:1].isdigit():
        if not sep:
            return None
        number, rest = head, tail
    try:
        return unquote(parts[1], errors="strict"), number, upstream_uri(rest)
    except (NotAResourcePath, UnicodeDecodeError):
        return None


# ---------------------------------------------------------------------------------------------------
# §14.6 links of list entries


def entry_links(
    base_url: str, set_name: str, upstream: str, when: datetime | None, md: Link | None = None
) -> list[Link]:
    """The three links of §14.6 (Example 29) for an entry: ``rel="memento"`` to the version the entry
    describes (dated ``when``, with ``md``'s hash, length and type; none for a deletion: ``when``
    None), ``rel="timegate"`` (no other attribute) and ``rel="timemap"`` (its type)."""
    out = []
    if when is not None:
        out.append(
            Link(
                MEMENTO,
                memento_uri(base_url, set_name, when, upstream),
                modified=when,
                hash=md.hash if md else None,
                length=md.length if md else None,
                type=md.type if md else None,
            )
        )
    out.append(Link(TIMEGATE, timegate_uri(base_url, set_name, upstream)))
    out.append(Link(TIMEMAP, timemap_uri(base_url, set_name, upstream), type=LINK_FORMAT))
    return out


def resource_entry_links(base_url: str, set_name: str, r: Resource) -> list[Link]:
    """§14.6 links of a Resource List entry: its memento is the current version (``updated_at``)."""
    md = Link(MEMENTO, "", hash=format_hash(r.hashes), length=r.length, type=r.type)
    return entry_links(base_url, set_name, r.uri, r.updated_at, md)


def change_entry_links(base_url: str, set_name: str, rec: LogRecord, hashes: dict[str, str]) -> list[Link]:
    """§14.6 links of a Change List entry: the memento of exactly the version the record applied."""
    if rec.change == DELETED or not rec.sha256:
        return entry_links(base_url, set_name, rec.uri, None)
    md = Link(MEMENTO, "", hash=format_hash(hashes), length=rec.length, type=rec.type)
    return entry_links(base_url, set_name, rec.uri, rec.datetime, md)


def resource_link_header(base_url: str, cap: str, set_name: str, upstream: str) -> str:
    """``Link`` of a held resource's own answers: its Capability List (§6.3.3), its TimeGate and
    TimeMap (RFC 7089 §4.1.1: an original resource names its TimeGate)."""
    return (
        f'<{cap}>; rel="resourcesync", <{timegate_uri(base_url, set_name, upstream)}>; rel="timegate", '
        f'<{timemap_uri(base_url, set_name, upstream)}>; rel="timemap"; type="{LINK_FORMAT}"'
    )


def _memento_links(base_url: str, set_name: str, upstream: str, cap: str) -> str:
    """RFC 7089 §2.2: original, timegate, timemap (and §6.3.3's resourcesync)."""
    return (
        f'<{original_uri(base_url, set_name, upstream)}>; rel="original", '
        f'<{timegate_uri(base_url, set_name, upstream)}>; rel="timegate", '
        f'<{timemap_uri(base_url, set_name, upstream)}>; rel="timemap"; type="{LINK_FORMAT}", '
        f'<{cap}>; rel="resourcesync"'
    )


# ---------------------------------------------------------------------------------------------------
# Retention and the publish filter, per version


def retention_of(pub) -> Retention:
    return parse_retention(pub.config.publish.versions)


def version_resource(row: Resource, rec: LogRecord) -> Resource:
    """The row as it was at ``rec``: the version's content, type and length, dated by the record
    (what the publish filter and the resource answer code see)."""
    same = row.sha256 == rec.sha256
    return dataclasses.replace(
        row,
        sha256=rec.sha256,
        length=rec.length,
        type=rec.type,
        encoding=row.encoding if same else None,
        hashes=row.hashes if same else ({"sha-256": rec.sha256} if rec.sha256 else {}),
        updated_at=rec.datetime,
        deleted=False,
    )


def is_retained(state: StateStore, retention: Retention, rec: LogRecord, now: datetime) -> bool:
    """Whether ``rec``'s version is within ``[publish] versions`` (``Retention.retained``)."""
    if retention.keeps_all:
        return True
    newer = state.count_versions(rec.resource_id, rec.seq, retention.last)
    nxt = next(state.iter_versions(rec.resource_id, rec.seq, 1), None)
    return retention.retained(newer, nxt.datetime if nxt else None, now)


# ---------------------------------------------------------------------------------------------------
# Handlers


def _raw_path(request: Request) -> str | None:
    raw = request.scope.get("raw_path") or request.scope["path"].encode("utf-8")
    try:
        return raw.decode("utf-8").partition("?")[0]
    except UnicodeDecodeError:
        return None


def _held(
    pub, state: StateStore, set_name: str, uri: str
) -> tuple[PublishedSet | None, Resource | None, str]:
    """(published set, the row if held and shown, the Capability List URI)."""
    site = pub.site(state)
    ps = site.sets.get(set_name)
    if ps is None:
        return None, None, ""
    row = state.resource_in(ps.set_ids, uri)
    cap = site.capabilitylist(ps.name)
    if row is None or not site.visible(ps.name, row):
        return ps, None, cap
    return ps, row, cap


def _shown(pub, ps: PublishedSet, row: Resource, rec: LogRecord) -> bool:
    return rec.change != DELETED and bool(rec.sha256) and pub.visible(ps.name, version_resource(row, rec))


@dataclasses.dataclass(slots=True)
class Found:
    """What a memento URI names as the state has it now: ``status`` 200 (``version`` to serve), 404
    or 410 (beyond retention), the ``link`` header of that answer, and for a 200 under a duration
    policy the instant the version leaves retention (``until``: then it answers 410 with no state
    change, which the hot route's cache must know)."""

    status: int
    link: str | None
    version: Resource | None = None
    until: datetime | None = None


def find_memento(pub, state: StateStore, set_name: str, uri: str, when: datetime) -> Found:
    """The memento of ``uri`` dated ``when`` (blocking): the one decision of the app's route and of
    the hot route (``fastpath.ResourceFastPath``), so both answer alike."""
    ps, row, cap = _held(pub, state, set_name, uri)
    if ps is None or row is None:
        return Found(404, f'<{cap}>; rel="resourcesync"' if cap else None)
    rec = state.version_at(row.id, when)
    if rec is None or rec.datetime != when or not _shown(pub, ps, row, rec):
        return Found(404, f'<{cap}>; rel="resourcesync"')
    link = _memento_links(pub.base_url, ps.name, uri, cap)
    retention = retention_of(pub)
    # Beyond retention; or a prior version whose blob is gone (a stricter policy applied by an
    # earlier gc than the one configured now): no longer kept, the same 410, never a 500.
    gone_blob = rec.sha256 != row.sha256 and not pub.blobs.exists(rec.sha256)
    if gone_blob or not is_retained(state, retention, rec, utcnow()):
        return Found(410, link)
    until = None
    if retention.younger is not None:
        nxt = next(state.iter_versions(rec.resource_id, rec.seq, 1), None)
        if nxt is not None:
            until = nxt.datetime + timedelta(seconds=retention.younger)
    return Found(200, link, version_resource(row, rec), until)


def beyond_retention(link: str | None) -> Response:
    """410 for a memento beyond ``[publish] versions``, with the ``Link`` that names the TimeMap."""
    return Response(
        "gone: this version is beyond the retention of prior versions; see the TimeMap\n",
        status_code=410,
        media_type="text/plain",
        headers={"link": link} if link else None,
    )


def memento_headers(response: Response, version: Resource) -> None:
    """RFC 7089 §2.1.1 ``Memento-Datetime`` on every answer about the version; ``Cache-Control:
    immutable`` on its 200, 206 and 304 (not on a 307: a presigned URL expires)."""
    response.headers["memento-datetime"] = http_date(version.updated_at)
    if response.status_code in (200, 206, 304):
        response.headers["cache-control"] = IMMUTABLE


async def memento(request: Request) -> Response:
    """``/SET/memento/STAMP/<mapped>``: the version current from STAMP on (RFC 7089 §4: immutable,
    ``Memento-Datetime``, ``Link`` original/timegate/timemap); 404 never held or hidden, 410 beyond
    retention. Bytes as the resource's own answer gives them (same code: Range, conditionals,
    offload ``x-accel`` and ``redirect``). The hot route (``fastpath.py``) answers most memento
    requests before they get here, from the same ``find_memento``."""
    pub = request.app.state.publisher
    raw = _raw_path(request)
    parsed = split_version_path(raw, MEMENTO) if raw is not None else None
    when = parse_stamp(parsed[1] or "") if parsed is not None else None
    if parsed is None or when is None:
        return gone(None, 404)
    set_name, _, uri = parsed
    offload = pub.config.server.offload

    def answer(state: StateStore) -> tuple[Response | None, Resource | None, str]:
        found = find_memento(pub, state, set_name, uri, when)
        if found.status == 404:
            return gone(found.link, 404), None, ""
        if found.status == 410 or found.version is None:
            return beyond_retention(found.link), None, ""
        version, link = found.version, found.link or ""
        if offload != "none":
            offloaded = _offloaded(pub, request, version, link, offload)
            if offloaded is not None:
                return offloaded, version, link
        return resource_answer(request, version, pub.blobs, link), version, link

    response, version, link = await pub.run(answer)
    if response is None:
        assert version is not None
        response = await remote_response(request, version, pub.blobs, link)
    if version is not None:
        memento_headers(response, version)
    return response


def parse_memento_path(raw_path: str) -> tuple[str, str, datetime] | None:
    """(set, upstream URI, datetime) of ``/SET/memento/STAMP/<mapped>``; None: not a memento URI."""
    parsed = split_version_path(raw_path, MEMENTO)
    when = parse_stamp(parsed[1] or "") if parsed is not None else None
    if parsed is None or when is None:
        return None
    return parsed[0], parsed[2], when


def _offloaded(pub, request: Request, version: Resource, link: str, offload: str) -> Response | None:
    """The offload answer for a memento, as the hot route gives it for a current resource
    (``fastpath.ResourceFastPath._answer``); None: rsagg sends the bytes (a Range or precondition,
    a store without URLs)."""
    assert version.sha256 is not None
    headers = resource_headers(version, link)
    early = conditional_answer(request, version, headers)
    if early is not None:
        return early
    if {"if-match", "if-unmodified-since"} & set(request.headers.keys()):
        return None
    if offload == "x-accel":
        headers.pop("accept-ranges", None)
        headers["x-accel-redirect"] = pub.config.server.offload_location + pub.blobs.blob_name(version.sha256)
        return Response(headers=headers)
    if offload == "redirect":
        url = pub.blobs.url(version.sha256, pub.config.server.redirect_lifetime, headers["content-type"])
        if url is not None:
            return Response(status_code=307, headers={"location": url, "link": link})
    return None


class BadDatetime(ValueError):
    """An ``Accept-Datetime`` that is not an RFC 1123 date in GMT (RFC 7089 §2.1.1)."""


def accept_datetime(value: str) -> datetime:
    """RFC 7089 §2.1.1: ``Accept-Datetime`` is an HTTP-date (RFC 1123 form, ``GMT``)."""
    text = value.strip()
    if not text.endswith("GMT"):
        raise BadDatetime(f"Accept-Datetime {value!r} is not an RFC 1123 date in GMT")
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        raise BadDatetime(f"Accept-Datetime {value!r} is not an RFC 1123 date in GMT") from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


async def timegate(request: Request) -> Response:
    """``/SET/timegate/<mapped>``: RFC 7089 §4.2.1, 302 to the best memento, ``Vary: accept-datetime``;
    400 for a malformed Accept-Datetime; 404 for a resource never held (or hidden)."""
    pub = request.app.state.publisher
    raw = _raw_path(request)
    parsed = split_version_path(raw, TIMEGATE) if raw is not None else None
    if parsed is None or parsed[1] is not None:
        return gone(None, 404)
    set_name, _, uri = parsed
    header = request.headers.get("accept-datetime")
    try:
        wanted = accept_datetime(header) if header is not None else None
    except BadDatetime as exc:
        return PlainTextResponse(f"{exc}\n", status_code=400, headers={"vary": "accept-datetime"})
    base = pub.base_url
    retention = retention_of(pub)

    def negotiate(state: StateStore) -> Response:
        ps, row, cap = _held(pub, state, set_name, uri)
        if ps is None or row is None:
            return gone(f'<{cap}>; rel="resourcesync"' if cap else None, 404)
        # Seconds are the precision of Accept-Datetime: a version stored within the asked second counts.
        when = wanted.replace(microsecond=999_999) if wanted is not None else utcnow()
        rec = state.version_at(row.id, when)
        # A hidden version is skipped: the latest shown one before it, else the first shown one.
        if rec is not None and not _shown(pub, ps, row, rec):
            rec = _best_shown(pub, state, ps, row, when)
        # Beyond retention: the oldest version still kept after it (retention keeps the newest versions
        # of a resource, so the kept ones follow the dropped ones), as for a datetime before the history.
        if rec is not None and not retention.keeps_all:
            rec = _oldest_kept_from(pub, state, ps, row, rec, retention)
        if rec is None:
            return gone(f'<{cap}>; rel="resourcesync"', 404)
        target = memento_uri(base, ps.name, rec.datetime, uri)
        link = (
            f'<{original_uri(base, ps.name, uri)}>; rel="original", '
            f'<{timemap_uri(base, ps.name, uri)}>; rel="timemap"; type="{LINK_FORMAT}", '
            f'<{target}>; rel="memento"; datetime="{http_date(rec.datetime)}"'
        )
        return Response(
            status_code=302,
            headers={"location": target, "vary": "accept-datetime", "link": link, "content-length": "0"},
        )

    return await pub.run(negotiate)


def _oldest_kept_from(
    pub, state: StateStore, ps: PublishedSet, row: Resource, rec: LogRecord, retention: Retention
) -> LogRecord | None:
    """``rec`` if retained, else the first later version that is retained and shown (None: none)."""
    now = utcnow()
    for later in itertools.chain([rec], state.iter_versions(row.id, rec.seq)):
        if _shown(pub, ps, row, later) and is_retained(state, retention, later, now):
            return later
    return None


def _best_shown(pub, state: StateStore, ps: PublishedSet, row: Resource, when: datetime) -> LogRecord | None:
    best = first = None
    for rec in state.iter_versions(row.id):
        if not _shown(pub, ps, row, rec):
            continue
        first = first or rec
        if rec.datetime <= when:
            best = rec
        else:
            break
    return best or first


async def timemap(request: Request) -> Response:
    """``/SET/timemap/[AFTER/]<mapped>``: RFC 7089 §5 link-format, the mementos retained and shown,
    oldest first, TIMEMAP_PAGE a page (``rel="next"`` to the next page), streamed as it is read.
    A deleted resource keeps its TimeMap."""
    from .streaming import DocumentResponse  # a pooled connection held while it streams

    pub = request.app.state.publisher
    raw = _raw_path(request)
    parsed = split_version_path(raw, TIMEMAP) if raw is not None else None
    if parsed is None or (parsed[1] is not None and not _SEQ.match(parsed[1])):
        return gone(None, 404)
    set_name, after_text, uri = parsed
    after = int(after_text) if after_text is not None else 0
    retention = retention_of(pub)
    now = utcnow()

    def held_and_validators(
        state: StateStore,
    ) -> tuple[PublishedSet | None, Resource | None, str, str, datetime | None]:
        ps, row, cap = _held(pub, state, set_name, uri)
        if ps is None or row is None:
            return ps, row, cap, "", None
        return ps, row, cap, *timemap_validators(pub, state, ps, row, after, retention, now)

    state = await pub.pool.acquire()
    try:
        ps, row, cap, etag, last_modified = await trio.to_thread.run_sync(held_and_validators, state)
    except BaseException:
        pub.pool.release(state)
        raise
    if ps is None or row is None:
        pub.pool.release(state)
        return gone(f'<{cap}>; rel="resourcesync"' if cap else None, 404)
    headers = {"content-type": LINK_FORMAT, "cache-control": "public, max-age=10", "etag": etag}
    if last_modified is not None:
        headers["last-modified"] = http_date(last_modified)
    if validators_match(request, etag, last_modified):  # RFC 9110 §13.1.2, §13.1.3
        pub.pool.release(state)
        return Response(status_code=304, headers={k: v for k, v in headers.items() if k != "content-type"})
    if request.method == "HEAD":
        pub.pool.release(state)
        return Response(headers=headers)
    lines = _timemap_lines(pub, state, ps, row, uri, after, retention, now)
    return DocumentResponse(lines, lambda: pub.pool.release(state), headers=headers)


def timemap_validators(
    pub,
    state: StateStore,
    ps: PublishedSet,
    row: Resource,
    after: int,
    retention: Retention,
    now: datetime,
) -> tuple[str, datetime | None]:
    """Strong ``ETag`` and ``Last-Modified`` (None: none) of a TimeMap page, from what decides its
    bytes without listing it (blocking). The changelog is append-only and every record of a resource
    moves its row's ``updated_at``; the row's versions counted and its deletion state guard the same;
    ``pub.fingerprint`` covers base URL, publish filter and retention policy. Under a duration policy
    the listed versions also change with time: the last record at or before the cutoff and whether it
    is still retained tell which ones are listed (the retained versions are a suffix of the history),
    and there is no honest Last-Modified short of listing, so none is given."""
    parts: list[object] = [
        pub.fingerprint,
        TIMEMAP_PAGE,
        ps.name,
        row.id,
        after,
        row.updated_at.isoformat(),
        row.deleted,
        state.count_versions(row.id),
    ]
    last_modified: datetime | None = max(row.updated_at, pub.started)  # a new configuration: new bytes
    if retention.younger is not None:
        rec = state.version_at(row.id, now - timedelta(seconds=retention.younger))
        parts += [None, None] if rec is None else [rec.seq, is_retained(state, retention, rec, now)]
        last_modified = None
    return f'"{hashlib.sha256(repr(parts).encode()).hexdigest()[:32]}"', last_modified


def _timemap_lines(
    pub,
    state: StateStore,
    ps: PublishedSet,
    row: Resource,
    uri: str,
    after: int,
    retention: Retention,
    now: datetime,
) -> Iterator[bytes]:
    """The link-format lines of one TimeMap page (blocking: for the worker thread)."""
    base = pub.base_url
    yield (
        f'<{original_uri(base, ps.name, uri)}>;rel="original",\n'
        f'<{timemap_uri(base, ps.name, uri, after or None)}>;rel="self";type="{LINK_FORMAT}",\n'
        f'<{timegate_uri(base, ps.name, uri)}>;rel="timegate"'
    ).encode()
    newer = None
    if retention.last is not None:  # versions after the page's start, counted down as they go by
        newer = state.count_versions(row.id, after)
    records = state.iter_versions(row.id, after)
    rec = next(records, None)
    listed = 0
    batch: list[str] = []
    first = after == 0
    last_seq = after
    while rec is not None:
        nxt = next(records, None)
        if rec.change != DELETED and rec.sha256:
            if newer is not None:
                newer -= 1
            kept = retention.retained(newer if newer is not None else 0, nxt.datetime if nxt else None, now)
            if kept and _shown(pub, ps, row, rec):
                if listed >= TIMEMAP_PAGE:
                    batch.append(
                        f',\n<{timemap_uri(base, ps.name, uri, last_seq)}>;rel="next";type="{LINK_FORMAT}"'
                    )
                    break
                rels = "memento"
                if first:
                    rels, first = "first memento", False
                if nxt is None:  # the resource's last record (a final deletion leaves it unmarked)
                    rels = "last memento" if rels == "memento" else "first last memento"
                batch.append(
                    f',\n<{memento_uri(base, ps.name, rec.datetime, uri)}>;rel="{rels}";'
                    f'datetime="{http_date(rec.datetime)}"'
                )
                listed += 1
                last_seq = rec.seq
                if len(batch) >= 256:
                    yield "".join(batch).encode()
                    batch.clear()
        rec = nxt
    batch.append("\n")
    yield "".join(batch).encode()
