"""What SQLite and PostgreSQL spell differently, in one object per database.

The shared SQL (store/sql/) is written in SQLite's spelling: ``?`` placeholders, ``deleted = 0`` for a
live row (the form SQLite's partial index ``resources_live`` matches), a list parameter as
``IN (SELECT value FROM json_each(?))``. ``PostgresDialect.sql`` rewrites those few spellings once per
statement (cached); every other difference is a method here: how a time, a list, a JSON document or an
array is stored and read back.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from ..rows import format_dt, parse_dt

#: The largest 64-bit integer (SQLite INTEGER, PostgreSQL BIGINT): "no upper bound" in range queries.
MAX_INT = 2**63 - 1


class Dialect:
    """SQLite's spelling (the shared SQL's own): every method is the identity or SQLite's encoding."""

    name = "sqlite"
    #: A time as stored: SQLite keeps fixed-width UTC text (rows.format_dt), text order == time order.
    t: Callable[[datetime | None], Any] = staticmethod(format_dt)
    #: A stored time back as an aware datetime (None stays None; typed Any: rows say which may be None).
    dt: Callable[[Any], Any] = staticmethod(parse_dt)
    #: Appended to a claim's SELECT: skip rows another transaction is granting (SQLite has one writer).
    skip_locked = ""
    #: Appended to a SELECT whose row the transaction then updates (SQLite has one writer at a time).
    for_update = ""

    def sql(self, text: str) -> str:
        """``text`` as this database reads it."""
        return text

    def w3c(self, column: str) -> str:
        """A time column read as ``rows.format_dt``'s text (what a list writer puts in a document)."""
        return column

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
        statement whatever their number (SQLite: ``json_each``, no variable limit)."""
        return (
            f"SELECT {', '.join(cols)} FROM resources "
            "WHERE set_id = ? AND uri IN (SELECT value FROM json_each(?))",
            (set_id, json.dumps(list(uris))),
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

    def w3c(self, column: str) -> str:
        return f"""to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')"""

    def by_uri(self, cols: Sequence[str], set_id: int, uris: Sequence[str]) -> tuple[str, tuple]:
        # One (set_id, uri) key lookup per uri, whatever the planner's statistics say (``uri = ANY(...)``
        # on a table not analysed yet scanned the whole set for every batch).
        return (
            f"SELECT {', '.join('r.' + c for c in cols)} FROM unnest(%s::text[]) AS u(uri) CROSS JOIN "
            "LATERAL (SELECT * FROM resources WHERE set_id = %s AND uri = u.uri) AS r",
            (list(dict.fromkeys(uris)), set_id),
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
