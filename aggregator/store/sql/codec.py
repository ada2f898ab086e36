"""How rows are encoded: the columns of the big tables, a resource row back as ``Resource``, links as
JSON, and ``plan_batch`` (the rules of a batch of changes), for every dialect."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Any

from ...rs.model import CREATED, DELETED, UPDATED, Link
from ..rows import Change, LogRecord, Resource, ResourceValidators, format_dt, parse_dt
from .dialect import uri_key

_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
#: A hash the state stores (md5, sha-1, sha-256): hex digits, an even number of them, either case.
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+\Z")
#: Rows fetched per page by the iterators (bounded memory; no lock or connection held between pages).
PAGE_SIZE = 1000
SYNCHRONOUS = ("NORMAL", "FULL", "EXTRA")
#: ``kind`` of a retry that ended (its URI is no longer listed upstream): kept to be seen, not tried.
RETRY_ENDED = "ended"

#: ``json.dumps(value, ensure_ascii=False, separators=(",", ":"))`` without building an encoder per call
#: (dumps does for any argument but the defaults: a fifth of writing a resource row's links).
_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


#: A JSON string literal as ``_compact`` writes one (json's C escaper, ensure_ascii off).
_json_str = json.encoder.encode_basestring


def links_json(links: Sequence[Link], when: Callable[[datetime], str | None] = format_dt) -> str | None:
    """``links`` as the JSON the ``links`` column holds; ``when`` formats ``modified`` (format_dt, or a
    batch's cache of it)."""
    if not links:
        return None
    out = []
    for ln in links:
        if (ln.pri is None and ln.hash is None and ln.length is None and ln.type is None
                and ln.encoding is None and ln.path is None and not ln.extra):  # fmt: skip
            # The common link (rel, href, modified: a "via", a "collection") written directly, byte for
            # byte what the encoder writes: building a dict per link cost a third of a row's write.
            text = f'{{"rel":{_json_str(ln.rel)},"href":{_json_str(ln.href)}'
            out.append(text + "}" if ln.modified is None else f'{text},"modified":"{when(ln.modified)}"}}')
            continue
        d: dict[str, Any] = {"rel": ln.rel, "href": ln.href}
        for k in ("pri", "hash", "length", "type", "encoding", "path"):
            v = getattr(ln, k)
            if v is not None:
                d[k] = v
        if ln.modified is not None:
            d["modified"] = when(ln.modified)
        if ln.extra:
            d["extra"] = ln.extra
        out.append(_compact(d))
    return f"[{','.join(out)}]"


def links_from(text: str | None) -> list[Link]:
    if not text:
        return []
    links = []
    for d in json.loads(text):
        if "modified" in d:
            d["modified"] = parse_dt(d["modified"])
        links.append(Link(**d))
    return links


def json_or_none(value: Any) -> str | None:
    return _compact(value) if value else None


# Hashes are stored binary (schema step 15: half the bytes of their hex text); the seam's rows keep
# lowercase hex strings. These two are the boundary, for every dialect (sqlite3 and psycopg both take
# and give ``bytes`` for BLOB / bytea).


def hash_in(value: str | None) -> bytes | None:
    """A hex hash (either case) as the state stores it; None stays None. Anything but hex digits is a
    ValueError naming it (``check_hashes`` says so before a batch's transaction begins)."""
    if value is None:
        return None
    if not isinstance(value, str) or not _HEX.match(value):
        raise ValueError(f"not a hex hash: {value!r}")
    return bytes.fromhex(value)


def hash_out(value: bytes | None) -> str | None:
    """A stored hash back as the seam's lowercase hex (None stays None)."""
    return None if value is None else value.hex()


def check_hashes(hashes: dict[str, str]) -> None:
    """The md5 / sha-1 of a change are hex (they are stored binary): a clear error, not a failed batch."""
    for alg in ("md5", "sha-1"):
        v = hashes.get(alg)
        if v is not None and (not isinstance(v, str) or not _HEX.match(v)):
            raise ValueError(f"not a hex {alg}: {v!r}")


_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct",
                                        "Nov", "Dec"), 1)}  # fmt: skip
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_IMF_FIXDATE = re.compile(r"([A-Z][a-z]{2}), (\d\d) ([A-Z][a-z]{2}) (\d{4}) (\d\d):(\d\d):(\d\d) GMT\Z")


def http_date_in(text: str | None) -> datetime | None:
    """An upstream's ``Last-Modified`` as the resource row keeps it (schema step 18: 8 bytes, not 29 of
    text): only an IMF-fixdate (RFC 9110 §5.6.7, what every current server sends) that ``http_date_out``
    writes back byte for byte, so ``If-Modified-Since`` repeats exactly what the upstream said. Any
    other value (the obsolete forms, a wrong weekday, a date that does not exist, junk) is None: not
    kept, and that resource's re-check is then unconditional or by ``ETag`` (a full answer, never a
    wrong 304). Every field's width is fixed by the pattern, so a valid date with the right weekday is
    what ``http_date_out`` writes (tests/test_state_dialect.py checks it both ways)."""
    if text is None:
        return None
    m = _IMF_FIXDATE.match(text)
    if m is None:
        return None
    day, d, mon, y, hh, mm, ss = m.groups()
    month = _MONTHS.get(mon)
    if month is None:
        return None
    try:
        dt = datetime(int(y), month, int(d), int(hh), int(mm), int(ss), tzinfo=UTC)
    except ValueError:
        return None
    return dt if _DAYS[dt.weekday()] == day else None


def http_date_out(dt: datetime) -> str:
    """A kept ``Last-Modified`` back as the IMF-fixdate the upstream sent (``http_date_in``)."""
    return format_datetime(dt.astimezone(UTC), usegmt=True)


SOURCE_STATUS_FIELDS = frozenset(
    {"state", "last_error", "last_error_at", "last_success", "last_attempt", "next_attempt", "failures",
     "progress_done", "progress_total", "progress_what", "using_url"}
)  # fmt: skip
SOURCE_TIMES = ("last_error_at", "last_success", "last_attempt", "next_attempt", "created_at", "updated_at")

RES_COLS = (
    "set_id", "uri", "sha256", "length", "type", "encoding", "md5", "sha1", "lastmod",
    "upstream_datetime", "links", "md_extra", "entry_extra", "deleted", "generation", "updated_at",
)  # fmt: skip
SELECT_RES = "SELECT id, " + ", ".join(RES_COLS) + " FROM resources"
#: The upstream's validators of the version a row holds (schema step 18), written with the row by
#: ``apply`` (a row with new content has those of its new version, or none: the old ones named the
#: version before); read only by ``resource_validators``.
VALIDATOR_COLS = ("etag", "last_modified", "confirmed")
#: A row as ``apply`` writes it (``plan_batch``'s rows, their id appended).
WRITE_COLS = (*RES_COLS, *VALIDATOR_COLS)
# Positions in a row being written (RES_COLS order, its id appended last) ...
_W_UPSTREAM, _W_DELETED, _W_GENERATION = (
    RES_COLS.index(c) for c in ("upstream_datetime", "deleted", "generation")
)
# ... and in a row read by SELECT_RES (id first, then RES_COLS).
(
    _R_SET, R_URI, _R_SHA256, _R_LENGTH, _R_TYPE, _R_ENCODING, _R_MD5, _R_SHA1, _R_LASTMOD, _R_UPSTREAM,
    _R_LINKS, _R_MD_EXTRA, _R_ENTRY_EXTRA, _R_DELETED, _R_GENERATION, _R_UPDATED,
) = range(1, len(RES_COLS) + 1)  # fmt: skip
# What _apply knows of a uri of the batch: [id, sha256, live, stored] (stored: the row exists on disk).
_C_ID, _C_SHA256, _C_LIVE, C_STORED = range(4)
#: A change kind as the changelog stores it (schema step 16: a small integer, no bytes at all in SQLite
#: for 0 and 1, where the text took 8), and back (``LOG_KINDS[code]``).
LOG_KINDS = (CREATED, UPDATED, DELETED)
KIND_CODE = {kind: code for code, kind in enumerate(LOG_KINDS)}
#: ``deleted``'s code, spelled into SQL (``change != {DELETED_CODE}``).
DELETED_CODE = KIND_CODE[DELETED]
#: The changelog's columns as written (step 15: no uri, the resource row ``resource_id`` has it) ...
LOG_COLS = ("seq", "set_id", "resource_id", "change", "datetime", "sha256", "length", "type")
#: ... and a record as read (``LogRecord``'s fields): the uri from the row the record names, or the
#: record's own for a record whose row is gone (none today: rows are never deleted, only whole sets
#: with their log; schema step 15 keeps the uri of any such record).
LOG_SELECT = (
    "SELECT c.seq, c.set_id, c.resource_id, coalesce(c.uri, r.uri), c.change, c.datetime, "
    "c.sha256, c.length, c.type FROM changelog c LEFT JOIN resources r ON r.id = c.resource_id"
)


def log_record(r: Sequence[Any], dt: Callable[[Any], Any] = parse_dt) -> LogRecord:
    """A row read by ``LOG_SELECT`` as a ``LogRecord``."""
    sha = r[6]
    return LogRecord(
        r[0], r[1], r[2], r[3], LOG_KINDS[r[4]], dt(r[5]), None if sha is None else sha.hex(), r[7], r[8]
    )


def plan_batch(
    set_id: int,
    changes: Sequence[Change],
    current: dict[str, list],
    open_generation: int | None,
    now: Any,
    new_id: Callable[[], int],
    when: Callable[[datetime | None], Any],
    validators: dict[str, ResourceValidators] | None = None,
) -> tuple[dict[str, list], dict[int, tuple], dict[int, int], list[tuple], list[Change]]:
    """What a batch does, change by change, against the rows as they stand (``State.apply`` says the
    rules): one place for them, whatever the backend writes with.

    ``changes`` have been checked (``check_sha``, ``check_hashes``). ``current``: uri -> [id, sha256,
    live, stored] of the batch's stored rows (the ``_C_*`` positions; updated as the batch goes);
    ``now`` the batch's changelog time and ``when`` a time as the backend stores it; ``new_id()`` an
    id for a new row; ``validators``: by uri, the upstream's validators of the version each change
    brings (those of another version are not written). Returns (rows: uri -> the ``WRITE_COLS``
    values and the id, the final row per uri; tombstones: stored row id -> (generation,
    upstream_datetime); seen: id -> generation of no-ops during a baseline; log: changelog rows
    without seq; applied: the changes that changed state, each with the logged kind).
    """
    fromhex = bytes.fromhex
    # Records of a batch share a few datestamps, and formatting one cost more than the rest of its row.
    when, stamp = functools.cache(when), functools.cache(format_dt)
    # Collapse to the final row per uri; keep the log in order.
    rows: dict[str, list] = {}  # uri -> column values (WRITE_COLS order) + [id] (the _W_* positions)
    validators = validators or {}
    tombstones: dict[int, tuple] = {}  # id of a stored row -> (generation, upstream_datetime)
    seen: dict[int, int] = {}  # id -> generation, for no-ops during a baseline
    log: list[tuple] = []  # changelog rows
    applied: list[Change] = []
    for ch in changes:
        gen = ch.generation if ch.generation is not None else open_generation
        cur: Any = current.get(ch.uri)  # [id, sha256, live, stored] or None
        live = cur is not None and cur[_C_LIVE]
        if ch.change == DELETED:
            if not live:
                continue
            cur[_C_LIVE] = False
            row = rows.get(ch.uri)
            if row is not None:  # created/updated earlier in this batch: write it as a tombstone
                row[_W_DELETED] = True
                if gen is not None:
                    row[_W_GENERATION] = gen
                if ch.upstream_datetime is not None:
                    row[_W_UPSTREAM] = when(ch.upstream_datetime)
            else:
                tombstones[cur[_C_ID]] = (gen, when(ch.upstream_datetime))
            log.append((set_id, cur[_C_ID], DELETED_CODE, now, None, None, None))
            applied.append(ch)
            continue
        if live and cur[_C_SHA256] == ch.sha256:
            if gen is not None:
                if ch.uri in rows:
                    rows[ch.uri][_W_GENERATION] = gen
                else:
                    seen[cur[_C_ID]] = gen
            continue
        kind = UPDATED if live else CREATED
        if cur is None:
            cur = current[ch.uri] = [new_id(), ch.sha256, True, False]
        else:
            cur[_C_SHA256], cur[_C_LIVE] = ch.sha256, True
            tombstones.pop(cur[_C_ID], None)
        # hashes binary (checked as hex by ``State.apply`` before the batch: no second check per row)
        h = ch.hashes
        sha = None if ch.sha256 is None else fromhex(ch.sha256)
        md5, sha1 = h.get("md5"), h.get("sha-1")
        v = validators.get(ch.uri)
        if v is not None and v.sha256 != ch.sha256:
            v = None
        rows[ch.uri] = [
            set_id, ch.uri, sha, ch.length, ch.type, ch.encoding, None if md5 is None else fromhex(md5),
            None if sha1 is None else fromhex(sha1), when(ch.lastmod), when(ch.upstream_datetime),
            links_json(ch.links, stamp), json_or_none(ch.md_extra), json_or_none(ch.entry_extra),
            False, gen, now, *validator_values(v, ch.lastmod, when), cur[_C_ID],
        ]  # fmt: skip
        log.append((set_id, cur[_C_ID], KIND_CODE[kind], now, sha, ch.length, ch.type))
        applied.append(ch if ch.change == kind else dataclasses.replace(ch, change=kind))
    return rows, tombstones, seen, log, applied


def validator_values(
    v: ResourceValidators | None, row_lastmod: datetime | None, when: Callable[[datetime | None], Any]
) -> tuple[Any, Any, Any]:
    """``VALIDATOR_COLS``' values of ``v`` on a row whose lastmod is ``row_lastmod``: Last-Modified only
    as an IMF-fixdate (``http_date_in``), the confirmed lastmod only when it is not the row's own."""
    if v is None:
        return None, None, None
    return v.etag, when(http_date_in(v.last_modified)), None if v.lastmod == row_lastmod else when(v.lastmod)


#: The validators of a version a stored row holds (a no-op change's, ``put_resource_validators``'):
#: validators of a version the row no longer holds, or of a deleted row, name nothing and are not kept.
PUT_VALIDATORS = (
    "UPDATE resources SET etag = ?, last_modified = ?, confirmed = nullif(?, lastmod) "
    "WHERE set_id = ? AND uri_key = ? AND uri = ? AND sha256 = ? AND deleted = 0"
)


def put_validators_rows(
    set_id: int, rows: Iterable[ResourceValidators], when: Callable[[datetime | None], Any]
) -> list[tuple]:
    """``PUT_VALIDATORS``' parameters for ``rows``."""
    return [
        (v.etag, when(http_date_in(v.last_modified)), when(v.lastmod), set_id, uri_key(v.uri), v.uri,
         hash_in(v.sha256)) for v in rows
    ]  # fmt: skip


def check_sha(sha256: str) -> None:
    if not isinstance(sha256, str) or not _SHA256.match(sha256):
        raise ValueError(f"not a lowercase hex SHA-256: {sha256!r}")


def resource_row(r: Sequence[Any], dt: Callable[[Any], Any] = parse_dt) -> Resource:
    """A row read by ``SELECT_RES`` (id, then ``RES_COLS``) as a ``Resource``; ``dt`` reads a stored time."""
    hashes = {}
    sha = r[_R_SHA256]
    if sha is not None:
        hashes["sha-256"] = sha = sha.hex()
    if r[_R_MD5] is not None:
        hashes["md5"] = r[_R_MD5].hex()
    if r[_R_SHA1] is not None:
        hashes["sha-1"] = r[_R_SHA1].hex()
    md_extra, entry_extra = r[_R_MD_EXTRA], r[_R_ENTRY_EXTRA]
    return Resource(
        id=r[0], set_id=r[_R_SET], uri=r[R_URI], sha256=sha, length=r[_R_LENGTH], type=r[_R_TYPE],
        encoding=r[_R_ENCODING], hashes=hashes, lastmod=dt(r[_R_LASTMOD]),
        upstream_datetime=dt(r[_R_UPSTREAM]), links=links_from(r[_R_LINKS]),
        md_extra=json.loads(md_extra) if md_extra else {},
        entry_extra=json.loads(entry_extra) if entry_extra else [],
        deleted=bool(r[_R_DELETED]), updated_at=dt(r[_R_UPDATED]), generation=r[_R_GENERATION],
    )  # fmt: skip


@functools.cache
def upsert(table: str, cols: tuple[str, ...], key: tuple[str, ...]) -> str:
    """``INSERT`` of every column of a row, replacing the row of the same ``key``: what SQLite's
    ``INSERT OR REPLACE`` did, spelled as both databases read it (the statement sets every column)."""
    sets = ", ".join(f"{c} = excluded.{c}" for c in cols if c not in key)
    return (
        f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
        f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET {sets}"
    )
