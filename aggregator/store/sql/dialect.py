"""What SQLite and PostgreSQL spell differently, in one object per database.

The shared SQL (store/sql/) is written in SQLite's spelling: ``?`` placeholders, ``deleted = 0`` for a
live row (the form SQLite's partial index ``resources_live`` matches), a list parameter as
``IN (SELECT value FROM json_each(?))``. ``PostgresDialect.sql`` rewrites those few spellings once per
statement (cached); every other difference is a method here: how a time, a list, a JSON document or an
array is stored and read back.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import struct
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from ..rows import format_dt, parse_dt

#: The largest 64-bit integer (SQLite INTEGER, PostgreSQL BIGINT): "no upper bound" in range queries.
MAX_INT = 2**63 - 1


#: Cached: ``State.apply`` keys a batch's uris twice (the lookup of what is stored, then the rows it
#: inserts), and a key is a tenth of a new row's time in Python; bounded, so a big harvest only evicts.
@functools.lru_cache(maxsize=4096)
def uri_key(uri: str) -> int:
    """The lookup key of a resource row (schema step 16): the first 4 bytes of the MD5 of the uri's
    UTF-8, as a signed 32-bit integer. The index ``resources_uri (uri_key, set_id)`` is 16 bytes an
    entry where ``(set_id, uri)``'s was a hundred; a lookup names both the key and the uri (two uris may
    share a key: the key only narrows, the uri decides). PostgreSQL computes the same value in SQL
    (``URI_KEY_SQL``, step 16's conversion)."""
    return _key_of(hashlib.md5(uri.encode(), usedforsecurity=False).digest())[0]


_key_of = struct.Struct(">i").unpack_from


#: ``uri_key`` in PostgreSQL's SQL, of a column ``uri``.
URI_KEY_SQL = "('x' || left(md5(convert_to(uri, 'UTF8')), 8))::bit(32)::int"

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


def to_us(dt: datetime | None) -> int | None:
    """A datetime as whole microseconds since 1970-01-01T00:00:00Z (negative before; naive = UTC, as
    ``rows.format_dt`` reads it); None stays None. Exact: a datetime holds microseconds, no finer, and
    every datetime (years 1 to 9999) fits in 64 bits. How SQLite stores the times of ``resources`` and
    ``changelog`` since schema step 16 (8 bytes instead of 27 of text); integer order is time order."""
    if dt is None:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return (dt - _EPOCH) // _US


def from_us(value: int | None) -> datetime | None:
    """``to_us``'s integer back as an aware UTC datetime (what ``rows.parse_dt`` gives for the text)."""
    return None if value is None else _EPOCH + timedelta(0, 0, value)  # positional: twice as fast


#: ``from_us`` remembering the last values: the rows of a batch share their ``updated_at``, the records
#: of a batch their datetime (a hit costs a fifth of a conversion); datetimes are immutable.
from_us_cached = functools.lru_cache(maxsize=4096)(from_us)


def us_text(value: int | None) -> str | None:
    """``to_us``'s integer as ``rows.format_dt``'s text (``YYYY-MM-DDThh:mm:ss.ffffffZ``)."""
    return None if value is None else format_dt(_EPOCH + timedelta(0, 0, value))


def us_of_text(text: str | None) -> int | None:
    """A stored time text (``format_dt``'s, or any W3C Datetime) as ``to_us``'s integer (schema step
    16); None stays None. Anything else is a ValueError naming it."""
    if text is None or isinstance(text, int):
        return text
    try:
        dt = parse_dt(text) if isinstance(text, str) else None
    except (ValueError, OverflowError):
        dt = None
    if dt is None:
        raise ValueError(f"not a W3C datetime: {text!r}")
    return to_us(dt)


class Dialect:
    """SQLite's spelling (the shared SQL's own): every method is the identity or SQLite's encoding."""

    name = "sqlite"
    #: A time as stored: SQLite keeps fixed-width UTC text (rows.format_dt), text order == time order.
    t: Callable[[datetime | None], Any] = staticmethod(format_dt)
    #: A stored time back as an aware datetime (None stays None; typed Any: rows say which may be None).
    dt: Callable[[Any], Any] = staticmethod(parse_dt)
    #: A time of the two big tables (``resources``, ``changelog``) as stored: SQLite keeps microseconds
    #: since the epoch (schema step 16: 8 bytes, not 27 of text); PostgreSQL's ``timestamptz`` is that
    #: already (8 bytes), so there it is ``t``.
    t_row: Callable[[datetime | None], Any] = staticmethod(to_us)
    #: A stored time of the big tables back as an aware datetime.
    dt_row: Callable[[Any], Any] = staticmethod(from_us_cached)
    #: A time of the big tables as read by ``w3c`` (``listing_cols``) to ``rows.format_dt``'s text.
    text_row: Callable[[Any], Any] = staticmethod(us_text)
    #: Appended to a claim's SELECT: skip rows another transaction is granting (SQLite has one writer).
    skip_locked = ""
    #: Appended to a SELECT whose row the transaction then updates (SQLite has one writer at a time).
    for_update = ""

    def sql(self, text: str) -> str:
        """``text`` as this database reads it."""
        return text

    def w3c(self, column: str) -> str:
        """A time column of the big tables read as ``text_row`` turns into ``rows.format_dt``'s text
        (what a list writer puts in a document): SQLite's integer, converted in Python (``us_text``)."""
        return column

    def literal_row(self, when: datetime) -> str:
        """A time of the big tables as an SQL literal (a query built without placeholders)."""
        return str(to_us(when))

    def hex(self, column: str) -> str:
        """A stored binary hash column read as the seam's lowercase hex (NULL stays NULL; no stored hash
        is empty), converted by the database: for a sorted list of hashes (gc)."""
        return f"nullif(lower(hex({column})), '')"

    @functools.cached_property
    def listing_cols(self) -> str:
        """``iter_live_listing``'s columns: interface.ListingRow's, then whether the row has more."""
        times = ", ".join(self.w3c(c) for c in ("lastmod", "upstream_datetime", "updated_at"))
        return (  # hashes binary: Reads._listing_pages turns them to hex (SQLite's lower(hex()) cost more)
            f"id, uri, sha256, length, type, encoding, md5, sha1, {times}, "
            "(links IS NOT NULL OR md_extra IS NOT NULL OR entry_extra IS NOT NULL)"
        )

    def by_uri(self, cols: Sequence[str], set_id: int, uris: Sequence[str]) -> tuple[str, tuple]:
        """A query (and its parameters) for ``cols`` of the resources of ``uris`` in one set, in one
        statement whatever their number (SQLite: ``json_each``, no variable limit). ``cols`` must hold
        ``uri``: the rows are those of the uris' keys (``uri_key``), and the caller keeps the uris it
        asked for (in Python: a third cheaper than SQLite matching a second list)."""
        return (
            f"SELECT {', '.join(cols)} FROM resources "
            "WHERE set_id = ? AND uri_key IN (SELECT value FROM json_each(?))",
            (set_id, json.dumps([uri_key(u) for u in dict.fromkeys(uris)])),
        )

    @staticmethod
    def ids(values: Sequence[Any]) -> Any:
        """A list as the one parameter of ``IN (SELECT value FROM json_each(?))``."""
        return json.dumps(list(values))

    @staticmethod
    def json_out(value: Any) -> Any:
        """A stored JSON document back (SQLite: its text)."""
        return json.loads(value)

    @staticmethod
    def array(values: Sequence[Any] | None) -> Any:
        """A list stored in one column (SQLite: JSON text; PostgreSQL: an array)."""
        return None if values is None else json.dumps(list(values))

    @staticmethod
    def array_out(value: Any) -> tuple | None:
        return None if value is None else tuple(json.loads(value))


_REWRITES = [
    (re.compile(r"\bNOT IN \(SELECT value FROM json_each\(\?\)\)"), "<> ALL(%s)"),
    (re.compile(r"\bIN \(SELECT value FROM json_each\(\?\)\)"), "= ANY(%s)"),
    (re.compile(r"\b(\w+\.)?deleted = 0\b"), r"NOT \1deleted"),
    (re.compile(r"\?"), "%s"),
]


def _identity(value: Any) -> Any:
    return value


class PostgresDialect(Dialect):
    """PostgreSQL: ``%s`` placeholders, booleans, ``timestamptz`` (the session's zone is UTC), arrays."""

    name = "postgresql"
    t = staticmethod(_identity)
    dt = staticmethod(_identity)
    t_row = staticmethod(_identity)
    dt_row = staticmethod(_identity)
    text_row = staticmethod(_identity)
    skip_locked = " FOR UPDATE SKIP LOCKED"
    for_update = " FOR UPDATE"

    @functools.lru_cache(maxsize=1024)  # noqa: B019 (one instance per process, statements are few)
    def sql(self, text: str) -> str:
        for pattern, repl in _REWRITES:
            text = pattern.sub(repl, text)
        return text

    @staticmethod
    def ids(values: Sequence[Any]) -> Any:
        return list(values)

    def hex(self, column: str) -> str:
        return f"encode({column}, 'hex')"

    def literal_row(self, when: datetime) -> str:
        return f"'{format_dt(when)}'::timestamptz"

    def w3c(self, column: str) -> str:
        return f"""to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')"""

    def by_uri(self, cols: Sequence[str], set_id: int, uris: Sequence[str]) -> tuple[str, tuple]:
        # One (uri_key, set_id) key lookup per uri, whatever the planner's statistics say (``uri = ANY(...)``
        # on a table not analysed yet scanned the whole set for every batch); OFFSET 0 keeps the subquery
        # a lookup per uri (pulled up into the join, it became a hash join over the whole set).
        uris = list(dict.fromkeys(uris))
        return (
            f"SELECT {', '.join('r.' + c for c in cols)} FROM unnest(%s::int[], %s::text[]) AS u(k, uri) "
            "CROSS JOIN LATERAL (SELECT * FROM resources "
            "WHERE set_id = %s AND uri_key = u.k AND uri = u.uri OFFSET 0) AS r",
            ([uri_key(u) for u in uris], uris, set_id),
        )

    @staticmethod
    def json_out(value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value  # JSONB arrives decoded

    @staticmethod
    def array(values: Sequence[Any] | None) -> Any:
        return None if values is None else list(values)

    @staticmethod
    def array_out(value: Any) -> tuple | None:
        return None if value is None else tuple(value)


SQLITE = Dialect()
POSTGRES = PostgresDialect()
