"""``SqlState``: what every concern of the shared state builds on (the dialect, the clock, paging).

A backend subclasses it with the concern mixins and supplies connections: ``_read()`` and
``_write(fence=...)`` are context managers giving a connection with ``execute(sql, params)`` and
``executemany(sql, rows)`` that reads the shared SQL (``Dialect.sql``); ``_write`` is one transaction
(COMMIT, or ROLLBACK on any exception) that checks the cluster fence first (interface.FENCE).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any

from . import codec
from .dialect import Dialect


class SqlState:
    """The plumbing the concern mixins share; a backend gives ``d``, ``_clock``, ``_read`` and ``_write``."""

    d: Dialect
    _clock: Callable[[], datetime]

    def _read(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _write(self, *, fence: bool = True) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _now(self) -> datetime:
        return self._clock().astimezone(UTC)

    def _pages(
        self, sql: str, params: list[Any], key_index: int, after: Any, limit: int | None
    ) -> Iterator[tuple]:
        """Keyset paging: ``sql`` has a ``> ?`` placeholder last-but-one and ``LIMIT ?`` last; the
        connection (or SQLite's lock) is held only while a page is fetched, so a slow consumer (an HTTP
        response) never blocks writers."""
        left = limit
        while left is None or left > 0:
            n = codec.PAGE_SIZE if left is None else min(codec.PAGE_SIZE, left)
            with self._read() as c:
                rows = c.execute(sql, [*params, after, n]).fetchall()
            yield from rows
            if len(rows) < n:
                return
            after = rows[-1][key_index]
            if left is not None:
                left -= len(rows)

    def _snapshot(self, sql: str, params: Sequence[Any] = ()) -> Iterator[tuple]:
        """The rows of one query as of one instant, in bounded memory whatever their number (gc's
        sorted hash lists): SQLite sorts them into a TEMP table, PostgreSQL reads a server-side cursor."""
        raise NotImplementedError
