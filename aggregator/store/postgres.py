"""The state in a PostgreSQL server: ``StateStore`` (store/interface.py) for ``[store] state = "postgresql://..."``.

The state's SQL, its schema and its rules are written once in store/sql/ (run through
``dialect.POSTGRES``); this module is the PostgreSQL backend: the connection pool, transactions, the
version counter (a sequence), the schema version (a table) and how a batch of rows is written (COPY).

Connections come from a psycopg-pool ``ConnectionPool``: every method borrows one for its transaction,
so the store may be called from many threads at once (psycopg's async mode is asyncio-only: trio code
calls this blocking API through ``trio.to_thread.run_sync``, at most ``limiter``'s pool size at once).

Where this differs from SQLite, and why:

- The changelog's ``seq`` and rsagg's changelog clock come from one row, ``changelog_head``, locked
  (``FOR UPDATE``) at the start of every transaction that may log changes. Writers, in one process or
  many, append to the changelog one transaction at a time, so seq order is commit order: a reader never
  sees change N+1 before N is committed, a rolled-back transaction leaves no gap (the row's update rolls
  back with it), and the clock floor (never before the last record) holds across processes.
- Resource ids come from a sequence: never reused (invariant), possibly with gaps (a rolled-back batch).
- Times are ``timestamptz`` (microseconds, compared as times); the session's time zone is UTC.
- Migrations run in one transaction under an advisory lock: several processes starting at once
  migrate once; the version is the one row of ``schema_version``.
- ``synchronous`` maps to ``synchronous_commit``: "NORMAL" -> off (a commit survives a crash of rsagg, a
  crash of the server may lose the last few; their cursors roll back with them, so the harvester redoes
  that work — SQLite's NORMAL, in the same words), "FULL"/"EXTRA" -> on (durable at commit).

Secrets: the password (in the URL, ``PGPASSWORD`` or a ``PGPASSFILE``) never leaves this module; every
message names the server by ``redact(url)``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import trio
from psycopg_pool import ConnectionPool, PoolTimeout

from ..rs.w3cdt import utcnow
from .interface import FENCE, LeaseLost, StateUnavailable
from .rows import (
    Fence,
)
from .sql import codec
from .sql.changes import Changes
from .sql.cluster import Cluster
from .sql.codec import (
    LOG_COLS,
    SYNCHRONOUS,
    WRITE_COLS,
)
from .sql.dialect import POSTGRES, uri_key
from .sql.dumps import Dumps
from .sql.hub import Hub
from .sql.notify import Notifications
from .sql.reads import Reads
from .sql.reconcile import Reconciliations
from .sql.schema import migrations

#: URL schemes this backend opens (``store.open.connect`` picks it by them).
SCHEMES = ("postgresql", "postgres")
#: Key of the advisory lock migrations run under (any constant; "rsagg" in ASCII).
_MIGRATION_LOCK = 0x7273616767

# ---------------------------------------------------------------------------------------------------
#: The schema's steps as this backend runs them (store/sql/schema.py: one list for every backend).
MIGRATIONS = migrations(POSTGRES)

#: A time as SQLite stores it (state.format_dt: ``YYYY-MM-DDThh:mm:ss.ffffffZ``, UTC), written by the server.
_W3C = """to_char({} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')"""
#: iter_live_listing: interface.ListingRow's columns, then whether the row has more than those.
_COPY_RES = "COPY {table} (id, " + ", ".join(WRITE_COLS) + ", uri_key) FROM STDIN"
#: Stored rows changed by a batch are copied into this temporary table, then updated in one statement.
_BATCH = "rsagg_changed_rows"
_UPDATE_FROM_BATCH = (
    "UPDATE resources r SET "
    + ", ".join(
        f"{c} = COALESCE(b.{c}, r.{c})" if c == "generation" else f"{c} = b.{c}" for c in WRITE_COLS[2:]
    )
    + f" FROM {_BATCH} b WHERE r.id = b.id"
)
# ---------------------------------------------------------------------------------------------------
# Locations and their secrets


def is_postgres_url(location: object) -> bool:
    return isinstance(location, str) and location.split("://", 1)[0].lower() in SCHEMES and "://" in location


def redact(url: str) -> str:
    """``url`` without its password (``postgresql://user:***@host/db``): what logs, status and errors show."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "postgresql://(unparsable URL)"
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


#: What an operator does about a state server that went away (said with it).
_AWAY_FIX = "(start the server or correct store.state)"


def _scrub(text: str, url: str) -> str:
    """``text`` (a driver's message) with the URL redacted and its password blanked, wherever they occur."""
    password = None
    with contextlib.suppress(ValueError):
        password = urlsplit(url).password
    text = text.replace(url, redact(url))
    if password:
        text = text.replace(password, "***")
    return " ".join(text.split())  # libpq's messages span lines: one line


# ---------------------------------------------------------------------------------------------------


class _Conn:
    """A pooled connection that reads the shared SQL (``Dialect.sql``: SQLite's spelling rewritten once
    per statement) and has ``executemany``, as a sqlite3 connection does."""

    __slots__ = ("raw",)

    def __init__(self, raw: psycopg.Connection) -> None:
        self.raw = raw

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        return self.raw.execute(POSTGRES.sql(sql), params)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any:
        cur = self.raw.cursor()
        cur.executemany(POSTGRES.sql(sql), rows)
        return cur

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        return self.raw.cursor(*args, **kwargs)

    def transaction(self) -> Any:
        return self.raw.transaction()


class PostgresState(Changes, Reads, Reconciliations, Notifications, Dumps, Hub, Cluster):
    """The state of one rsagg (or of many sharing it) in a PostgreSQL database."""

    d = POSTGRES

    def __init__(
        self,
        url: str,
        *,
        readonly: bool = False,
        synchronous: str = "NORMAL",
        clock: Callable[[], datetime] = utcnow,
        pool_size: int = 4,
        connect_timeout: float = 10.0,
        **_sqlite_only: Any,  # cache_mib, busy_timeout, wal_autocheckpoint: SQLite's knobs, no meaning here
    ) -> None:
        sync = synchronous.upper()
        if sync not in SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS}, not {synchronous!r}")
        self.url = url
        self.location = redact(url)
        self.readonly = readonly
        self._clock = clock
        self._closed = False
        self._away = False  # the server was seen gone (``_unavailable``)
        self._connect_timeout = max(1, int(connect_timeout))
        settings = ["SET TIME ZONE 'UTC'", f"SET synchronous_commit = {'off' if sync == 'NORMAL' else 'on'}"]
        if readonly:
            settings.append("SET default_transaction_read_only = on")

        def configure(conn: psycopg.Connection, *, pooled: bool = True) -> None:
            for statement in settings:
                conn.execute(statement)
            if pooled and not readonly:  # a writer's temporary table for batches (``_apply``)
                conn.execute(
                    f"CREATE TEMP TABLE {_BATCH} (LIKE resources INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
                )
            conn.commit()

        # One connection first, for a clear error (the pool would only time out) and for migrations.
        try:
            with psycopg.connect(url, connect_timeout=max(1, int(connect_timeout))) as conn:
                configure(conn, pooled=False)
                version = self._migrate(conn) if not readonly else _schema_version(conn)
        except psycopg.Error as exc:
            raise StateUnavailable(
                f"state {self.location}: cannot open the PostgreSQL state: {_scrub(str(exc), url)}"
            ) from None
        if version != len(MIGRATIONS):
            raise RuntimeError(
                f"{self.location} has schema version {version}, this rsagg reads {len(MIGRATIONS)} "
                "(open it once read-write to create or migrate it)"
            )
        size = 1 if readonly else max(1, pool_size)  # a reader serves one request at a time
        self.pool = ConnectionPool(
            url,
            min_size=1,
            max_size=size,
            configure=configure,
            kwargs={"connect_timeout": max(1, int(connect_timeout)), "autocommit": True},
            name=f"rsagg-state-{id(self):x}",
            open=True,
        )
        #: Async callers: ``trio.to_thread.run_sync(fn, limiter=state.limiter)`` never waits on the pool.
        self.limiter = trio.CapacityLimiter(size)
        self._lock = threading.Lock()  # close

    # -- plumbing --------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.pool.close()

    def __enter__(self) -> PostgresState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PostgresState({self.location!r})"

    @property
    def schema_version(self) -> int:
        with self.pool.connection() as conn:
            return _schema_version(conn)

    def _migrate(self, conn: psycopg.Connection) -> int:
        """Bring the schema up to date: one transaction, under an advisory lock (processes starting at
        once wait for the first, then find nothing to do)."""
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                conn.execute("INSERT INTO schema_version VALUES (0)")
            version = row[0] if row else 0
            if version > len(MIGRATIONS):
                raise RuntimeError(
                    f"{self.location} has schema version {version}; this rsagg knows up to {len(MIGRATIONS)}"
                )
            for i in range(version, len(MIGRATIONS)):
                for statement in MIGRATIONS[i]:
                    conn.execute(statement)
                conn.execute("UPDATE schema_version SET version = %s", (i + 1,))
        return len(MIGRATIONS)

    @contextlib.contextmanager
    def _write(self, *, fence: bool = True) -> Iterator[_Conn]:
        """One transaction on a pooled connection: COMMIT, or ROLLBACK on any exception; once committed,
        ``version()`` moves (after the commit, so a reader never caches what it could not see yet).

        Under a fence (``interface.FENCE``, a cluster node's source task) the lease row is read first,
        ``FOR SHARE``: a grant (an UPDATE of that row) waits for this transaction, and this one refuses to
        write (``LeaseLost``) unless the fence's grant is current and unexpired by the server's clock."""
        current = FENCE.get() if fence else None
        with self._unavailable(), self.pool.connection() as conn:
            with conn.transaction():
                if current is not None:
                    _check_fence(conn, current)
                yield _Conn(conn)
            conn.execute("SELECT nextval('state_version')")

    @contextlib.contextmanager
    def _unavailable(self) -> Iterator[None]:
        """The server gone, restarting or out of connections (psycopg's OperationalError, a pool timeout)
        is ``StateUnavailable``: one line naming the redacted URL, which the harvester survives.

        Once the server was seen away, each call first tries one connection of its own (at most
        ``connect_timeout``): while the server is down a call fails at once with the server's own reason
        (connection refused, ...) instead of waiting out the pool's timeout to say "couldn't get a
        connection"; once it answers again, the pool is used as before."""
        if self._away:
            try:
                with psycopg.connect(self.url, connect_timeout=self._connect_timeout):
                    self._away = False
            except psycopg.Error as exc:
                raise StateUnavailable(
                    f"state {self.location} unavailable: {_scrub(str(exc), self.url)} {_AWAY_FIX}"
                ) from None
        try:
            yield
        except (psycopg.OperationalError, PoolTimeout) as exc:
            self._away = True
            with contextlib.suppress(Exception):  # the pool's other dead connections go now, not one per call
                self.pool.check()
            raise StateUnavailable(
                f"state {self.location} unavailable: {_scrub(str(exc), self.url)} {_AWAY_FIX}"
            ) from None

    def version(self) -> int:
        """Grows with every committed write of anyone (this process or another): the ``state_version``
        sequence, bumped after each commit (``_write``). One round trip, no lock."""
        with self._read() as c:
            return c.execute(
                "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM state_version"
            ).fetchone()[0]

    @contextlib.contextmanager
    def _read(self) -> Iterator[_Conn]:
        with self._unavailable(), self.pool.connection() as conn:
            yield _Conn(conn)

    # -- the change pipeline's bulk writes (sql/changes.py) ----------------------------------------
    # The changelog's seq and clock come from the one row of ``changelog_head``, locked FOR UPDATE by
    # ``_log_head``; each kind of write is one statement whatever the batch's size (COPY, or arrays
    # unnested): row-by-row statements, even pipelined, made a batch of updates 4x slower.

    def _log_head(self, c: _Conn) -> tuple[int, Any]:
        return c.execute("SELECT seq, datetime FROM changelog_head FOR UPDATE").fetchone()

    def _append_log(self, c: _Conn, seq: int, log: list[tuple]) -> None:
        with c.cursor() as cur:
            with cur.copy(f"COPY changelog ({', '.join(LOG_COLS)}) FROM STDIN") as copy:
                for i, r in enumerate(log, seq + 1):
                    copy.write_row((i, *r))
            cur.execute("UPDATE changelog_head SET seq = %s, datetime = %s", (seq + len(log), log[-1][3]))

    def _new_ids(self, c: _Conn, n: int) -> Callable[[], int]:
        # ids from the sequence: never reused, whichever process asks
        ids: Iterator[int] = iter(())
        if n > 0:
            ids = iter(
                [r[0] for r in c.execute(
                    "SELECT nextval('resources_id_seq') FROM generate_series(1, %s)", (n,)
                ).fetchall()]
            )  # fmt: skip
        return lambda: next(ids)

    def _write_batch(
        self,
        c: _Conn,
        new: list[tuple],
        old: list[tuple],
        tombstones: dict[int, tuple],
        seen: dict[int, int],
        now: Any,
    ) -> None:
        with c.cursor() as cur:
            if seen:
                cur.execute(
                    "UPDATE resources r SET generation = v.g "
                    "FROM unnest(%s::bigint[], %s::int[]) AS v(id, g) WHERE r.id = v.id",
                    (list(seen), list(seen.values())),
                )
            if tombstones:
                cur.execute(
                    "UPDATE resources r SET deleted = true, generation = COALESCE(v.g, r.generation), "
                    "upstream_datetime = COALESCE(v.up, r.upstream_datetime), updated_at = %s FROM "
                    "unnest(%s::bigint[], %s::int[], %s::timestamptz[]) AS v(id, g, up) WHERE r.id = v.id",
                    (now, list(tombstones), [g for g, _ in tombstones.values()],
                     [up for _, up in tombstones.values()]),
                )  # fmt: skip
            if new:  # with its uri_key (schema step 16), as are the old (the batch table's NOT NULL)
                with cur.copy(_COPY_RES.format(table="resources")) as copy:
                    for r in new:
                        copy.write_row((*r, uri_key(r[2])))
            if old:
                with cur.copy(_COPY_RES.format(table=_BATCH)) as copy:
                    for r in old:
                        copy.write_row((*r, uri_key(r[2])))
                cur.execute(_UPDATE_FROM_BATCH)

    def _lock_set_names(self, c: _Conn) -> None:
        c.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK + 1,))

    def _db_now(self, c: Any) -> datetime:
        """The server's clock (``now()``, the transaction's start): nodes on many machines agree on it."""
        return c.execute("SELECT now()").fetchone()[0]

    # -- PostgreSQL's own ways (the shared SQL is in store/sql/) -----------------------------------

    def _snapshot(self, sql: str, params: Sequence[Any] = ()) -> Iterator[tuple]:
        """Rows of one query as of one instant, fetched in pages from a server-side cursor (bounded
        memory whatever the result's size); the pooled connection is held until the iterator ends."""
        with self._read() as conn, conn.transaction(), conn.cursor(name=f"rsagg_{id(self):x}") as cur:
            cur.itersize = codec.PAGE_SIZE
            cur.execute(POSTGRES.sql(sql), params)
            while rows := cur.fetchmany(codec.PAGE_SIZE):
                yield from rows


def _check_fence(c: psycopg.Connection, fence: Fence) -> None:
    row = c.execute(
        "SELECT node, epoch, expires_at, expires_at > now() FROM leases WHERE source = %s FOR SHARE",
        (fence.source,),
    ).fetchone()
    node, epoch, expires, valid = row if row else (None, None, None, False)
    if node != fence.node or epoch != fence.epoch:
        raise LeaseLost(fence, node, epoch, "another grant is current")
    if not valid:
        raise LeaseLost(fence, node, epoch, f"it expired at {expires}")


def _schema_version(conn: psycopg.Connection) -> int:
    try:
        with conn.transaction():
            row = conn.execute("SELECT version FROM schema_version").fetchone()
    except psycopg.errors.UndefinedTable:
        return 0
    return row[0] if row else 0


__all__ = ["MIGRATIONS", "SCHEMES", "PostgresState", "StateUnavailable", "is_postgres_url", "redact"]
