"""The state in a PostgreSQL server: ``StateStore`` (store/interface.py) for ``[store] state = "postgresql://..."``.

Same tables, same migrations (in PostgreSQL's dialect, step *i* here is step *i* of store/state.py's
``MIGRATIONS``), same rules as the SQLite ``State``: resource rows, changelog records, the cursor and
the retry bookkeeping move in ONE transaction (docs/architecture.md invariants 1 and 2); the changelog
is the truth of what rsagg republishes (invariant 3).

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
import dataclasses
import heapq
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import trio
from psycopg_pool import ConnectionPool, PoolTimeout

from ..rs.model import CHANGES, DELETED, Entry, Head
from ..rs.parse import parse_bytes
from ..rs.w3cdt import utcnow
from ..rs.write import iter_document_bytes
from .interface import FENCE, EmptySnapshot, LeaseLost, ListingRow, StateUnavailable
from .retention import Retention, retained_sql
from .rows import (
    Change,
    Cursor,
    DocumentRow,
    Fence,
    LogRecord,
    NotifySubscription,
    Reconciliation,
    Resource,
    ResourceValidators,
    RetryChanges,
    SetRow,
    SourceRow,
    format_dt,
)
from .sql import codec
from .sql.base import SqlState
from .sql.cluster import Cluster
from .sql.codec import (
    C_STORED,
    LOG_COLS,
    R_URI,
    RES_COLS,
    RETRY_ENDED,
    SELECT_RES,
    SOURCE_STATUS_FIELDS,
    SYNCHRONOUS,
    W_ID,
    check_sha,
    plan_batch,
    resource_row,
)
from .sql.dialect import MAX_INT, POSTGRES
from .sql.dumps import Dumps
from .sql.hub import Hub
from .sql.notify import Notifications

#: URL schemes this backend opens (``store.state.connect`` picks it by them).
SCHEMES = ("postgresql", "postgres")
#: Key of the advisory lock migrations run under (any constant; "rsagg" in ASCII).
_MIGRATION_LOCK = 0x7273616767

# ---------------------------------------------------------------------------------------------------
# Schema: MIGRATIONS[i] brings schema_version i to i + 1, step for step the SQLite MIGRATIONS of
# store/state.py. Never edit a released step; append a new one (in both lists).

MIGRATIONS: list[tuple[str, ...]] = [
    (
        """CREATE TABLE sources (
            name TEXT PRIMARY KEY,
            url TEXT NOT NULL,
            state TEXT,
            last_error TEXT,
            last_error_at TIMESTAMPTZ,
            last_success TIMESTAMPTZ,
            last_attempt TIMESTAMPTZ,
            next_attempt TIMESTAMPTZ,
            failures INTEGER NOT NULL DEFAULT 0,
            progress_done BIGINT,
            progress_total BIGINT,
            progress_what TEXT,
            created_at TIMESTAMPTZ NOT NULL,
            updated_at TIMESTAMPTZ NOT NULL
        )""",
        """CREATE TABLE documents (
            url TEXT PRIMARY KEY,
            source TEXT NOT NULL REFERENCES sources(name) ON DELETE CASCADE,
            capability TEXT,
            etag TEXT,
            last_modified TEXT,
            sha256 TEXT,
            fetched_at TIMESTAMPTZ NOT NULL
        )""",
        "CREATE INDEX documents_source ON documents(source)",
        """CREATE TABLE sets (
            id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            source TEXT NOT NULL REFERENCES sources(name) ON DELETE CASCADE,
            capabilitylist_url TEXT NOT NULL,
            name TEXT NOT NULL UNIQUE,
            generation INTEGER NOT NULL DEFAULT 0,
            baseline_generation INTEGER,
            created_at TIMESTAMPTZ NOT NULL,
            UNIQUE (source, capabilitylist_url)
        )""",
        """CREATE TABLE cursors (
            set_id BIGINT PRIMARY KEY REFERENCES sets(id) ON DELETE CASCADE,
            baseline_at TIMESTAMPTZ,
            changelist_url TEXT,
            last_datetime TIMESTAMPTZ,
            same_datetime_count INTEGER NOT NULL DEFAULT 0,
            list_index INTEGER NOT NULL DEFAULT 0,
            list_until TIMESTAMPTZ,
            updated_at TIMESTAMPTZ NOT NULL
        )""",
        "CREATE SEQUENCE resources_id_seq AS BIGINT",
        """CREATE TABLE resources (
            id BIGINT PRIMARY KEY,
            set_id BIGINT NOT NULL REFERENCES sets(id) ON DELETE CASCADE,
            uri TEXT NOT NULL,
            sha256 TEXT,
            length BIGINT,
            type TEXT,
            encoding TEXT,
            md5 TEXT,
            sha1 TEXT,
            lastmod TIMESTAMPTZ,
            upstream_datetime TIMESTAMPTZ,
            links TEXT,
            md_extra TEXT,
            entry_extra TEXT,
            deleted BOOLEAN NOT NULL DEFAULT false,
            generation INTEGER,
            updated_at TIMESTAMPTZ NOT NULL,
            UNIQUE (set_id, uri)
        )""",
        "CREATE INDEX resources_set_id ON resources(set_id, id)",
        "CREATE INDEX resources_live ON resources(set_id, id) WHERE NOT deleted",
        """CREATE TABLE changelog (
            seq BIGINT PRIMARY KEY,                  -- from changelog_head: dense, in commit order
            set_id BIGINT NOT NULL REFERENCES sets(id) ON DELETE CASCADE,
            resource_id BIGINT NOT NULL,
            uri TEXT NOT NULL,
            change TEXT NOT NULL CHECK (change IN ('created', 'updated', 'deleted')),
            datetime TIMESTAMPTZ NOT NULL,
            sha256 TEXT,
            length BIGINT,
            type TEXT
        )""",
        "CREATE INDEX changelog_set_seq ON changelog(set_id, seq)",
        "CREATE INDEX changelog_datetime ON changelog(datetime)",
        """CREATE TABLE changelog_head (
            one BOOLEAN PRIMARY KEY DEFAULT true CHECK (one),
            seq BIGINT NOT NULL,                     -- the highest seq ever given (never goes back)
            datetime TIMESTAMPTZ                     -- its record's time: the changelog clock's floor
        )""",
        "INSERT INTO changelog_head (seq) VALUES (0)",
    ),
    (
        """CREATE TABLE retries (
            set_id BIGINT NOT NULL REFERENCES sets(id),
            uri TEXT NOT NULL,
            change TEXT NOT NULL,
            entry BYTEA NOT NULL,
            kind TEXT NOT NULL,
            message TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 1,
            first_at TIMESTAMPTZ NOT NULL,
            last_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (set_id, uri)
        )""",
    ),
    (
        """CREATE TABLE upstream_notes (
            source TEXT NOT NULL REFERENCES sources(name) ON DELETE CASCADE,
            kind TEXT NOT NULL CHECK (kind IN ('deviation', 'skipped')),
            rule TEXT NOT NULL,
            count INTEGER NOT NULL DEFAULT 1,
            url TEXT,
            line INTEGER,
            message TEXT,
            updated_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (source, kind, rule)
        )""",
    ),
    ("ALTER TABLE sources ADD COLUMN using_url TEXT",),
    (
        """CREATE TABLE publish_dump_runs (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            set_name TEXT NOT NULL,
            at TIMESTAMPTZ NOT NULL,
            completed TIMESTAMPTZ NOT NULL,
            last_seq BIGINT NOT NULL,
            set_ids BIGINT[] NOT NULL,
            packages INTEGER NOT NULL,
            entries BIGINT NOT NULL,
            bytes BIGINT NOT NULL,
            created TIMESTAMPTZ NOT NULL
        )""",
        "CREATE INDEX publish_dump_runs_set ON publish_dump_runs(set_name, id)",
        """CREATE TABLE publish_dumps (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            set_name TEXT NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ('resourcedump', 'changedump')),
            run BIGINT,
            part INTEGER NOT NULL,
            "window" BIGINT,
            first_seq BIGINT,
            last_seq BIGINT,
            sha256 TEXT NOT NULL,
            length BIGINT NOT NULL,
            manifest_sha256 TEXT NOT NULL,
            manifest_length BIGINT NOT NULL,
            at TIMESTAMPTZ, completed TIMESTAMPTZ,
            from_ TIMESTAMPTZ, until TIMESTAMPTZ,
            entries BIGINT NOT NULL,
            bytes BIGINT NOT NULL,
            created TIMESTAMPTZ NOT NULL,
            UNIQUE (set_name, kind, "window")
        )""",
        "CREATE INDEX publish_dumps_run ON publish_dumps(run)",
        "CREATE INDEX publish_dumps_set ON publish_dumps(set_name, kind, id)",
    ),
    (  # 6: the embedded WebSub hub (websub/hub.py); and the change counter (version())
        """CREATE TABLE hub_subscriptions (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            topic TEXT NOT NULL,
            callback TEXT NOT NULL,
            secret TEXT,
            lease_seconds INTEGER NOT NULL,
            lease_expires TIMESTAMPTZ NOT NULL,
            created TIMESTAMPTZ NOT NULL,
            verified TIMESTAMPTZ NOT NULL,
            UNIQUE (topic, callback)
        )""",
        "CREATE INDEX hub_subscriptions_expires ON hub_subscriptions(lease_expires)",
        """CREATE TABLE hub_verifications (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            mode TEXT NOT NULL CHECK (mode IN ('subscribe', 'unsubscribe', 'denied')),
            topic TEXT NOT NULL,
            callback TEXT NOT NULL,
            secret TEXT,
            lease_seconds INTEGER,
            reason TEXT,
            requested TIMESTAMPTZ NOT NULL,
            UNIQUE (topic, callback)
        )""",
        """CREATE TABLE hub_payloads (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            topic TEXT NOT NULL,
            body BYTEA NOT NULL,
            content_type TEXT NOT NULL,
            link TEXT NOT NULL,
            created TIMESTAMPTZ NOT NULL
        )""",
        """CREATE TABLE hub_deliveries (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            subscription_id BIGINT NOT NULL REFERENCES hub_subscriptions(id) ON DELETE CASCADE,
            payload_id BIGINT NOT NULL REFERENCES hub_payloads(id),
            attempts INTEGER NOT NULL DEFAULT 0,
            next_attempt TIMESTAMPTZ NOT NULL,
            last_error TEXT
        )""",
        "CREATE INDEX hub_deliveries_subscription ON hub_deliveries(subscription_id, id)",
        "CREATE INDEX hub_deliveries_payload ON hub_deliveries(payload_id)",
        # Bumped after every committed write (``_write``), read by ``version()``: a sequence is not
        # transactional and takes no lock, so writers never wait on it.
        "CREATE SEQUENCE state_version AS BIGINT",
    ),
    (  # 7: rsagg's own notification channels (websub/notifier.py)
        """CREATE TABLE notify_channels (
            topic TEXT PRIMARY KEY,
            set_name TEXT NOT NULL,
            kind TEXT NOT NULL,
            last_seq BIGINT NOT NULL,
            last_until TIMESTAMPTZ,
            body BYTEA,
            snapshot TEXT,
            updated TIMESTAMPTZ NOT NULL
        )""",
    ),
    (  # 8: rsagg's subscriptions to upstream channels (websub/subscriber.py)
        """CREATE TABLE notify_subscriptions (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            token TEXT NOT NULL UNIQUE,
            secret TEXT NOT NULL,
            source TEXT NOT NULL,
            capabilitylist_url TEXT NOT NULL,
            kind TEXT NOT NULL,
            topic TEXT NOT NULL,
            hub TEXT NOT NULL,
            wanted BOOLEAN NOT NULL DEFAULT true,
            pending TEXT,
            requested TIMESTAMPTZ,
            lease_seconds INTEGER,
            lease_expires TIMESTAMPTZ,
            verified TIMESTAMPTZ,
            last_until TIMESTAMPTZ,
            failures INTEGER NOT NULL DEFAULT 0,
            next_attempt TIMESTAMPTZ
        )""",
    ),
    (  # 9: cluster nodes, source leases and the lease history (cluster.py)
        """CREATE TABLE nodes (
            name TEXT PRIMARY KEY,
            pid INTEGER,
            host TEXT,
            url TEXT,
            started_at TIMESTAMPTZ NOT NULL,
            heartbeat_at TIMESTAMPTZ NOT NULL,
            expires_at TIMESTAMPTZ NOT NULL,
            stopped_at TIMESTAMPTZ
        )""",
        """CREATE TABLE leases (
            source TEXT PRIMARY KEY,
            node TEXT,
            epoch BIGINT NOT NULL DEFAULT 0,
            granted_at TIMESTAMPTZ,
            expires_at TIMESTAMPTZ
        )""",
        """CREATE TABLE lease_history (
            source TEXT NOT NULL,
            epoch BIGINT NOT NULL,
            node TEXT NOT NULL,
            granted_at TIMESTAMPTZ NOT NULL,
            ended_at TIMESTAMPTZ,
            end_reason TEXT,
            PRIMARY KEY (source, epoch)
        )""",
    ),
    (  # 10: the shared inbox of upstream notifications (websub/subscriber.py in a cluster): any node's
        # callback records a verified delivery, the node holding the source's lease takes it.
        """CREATE TABLE IF NOT EXISTS notify_inbox (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            source TEXT NOT NULL,
            token TEXT NOT NULL,        -- the subscription's callback token; '' asks for a poll
            digest TEXT NOT NULL,       -- SHA-256 of body: a hub's retry is recorded once
            body BYTEA NOT NULL,
            received_at TIMESTAMPTZ NOT NULL,
            UNIQUE (token, digest)
        )""",
        "CREATE INDEX IF NOT EXISTS notify_inbox_source ON notify_inbox (source, id)",
    ),
    (  # 11: what each cluster node follows, with its heartbeat (cluster.py; the "@orphans" role of
        # websub/subscriber.py unsubscribes the channels of sources no live node follows)
        "ALTER TABLE nodes ADD COLUMN follows TEXT[]",  # source names; NULL: not said
    ),
    (  # 12: the publish filter and configuration each dump was built under (publish/dumps.py): a run or
        # package of another fingerprint is withdrawn (never served) and built again. NULL: built before
        # this step, under an unknown filter, so withdrawn too.
        "ALTER TABLE publish_dump_runs ADD COLUMN fingerprint TEXT",
        "ALTER TABLE publish_dumps ADD COLUMN fingerprint TEXT",
    ),
    (  # 13: reconciliation with the Resource List (harvest/reconcile.py) and resource validators
        """CREATE TABLE IF NOT EXISTS reconciliations (
            set_id BIGINT PRIMARY KEY REFERENCES sets(id) ON DELETE CASCADE,
            reconciled_at TIMESTAMPTZ NOT NULL,
            cause TEXT NOT NULL,
            lists JSONB NOT NULL,
            differences BIGINT NOT NULL DEFAULT 0,
            repaired JSONB NOT NULL,
            unrepaired BIGINT NOT NULL DEFAULT 0,
            complete BOOLEAN NOT NULL DEFAULT TRUE,
            error TEXT
        )""",
        """CREATE TABLE IF NOT EXISTS resource_validators (
            set_id BIGINT NOT NULL REFERENCES sets(id) ON DELETE CASCADE,
            uri TEXT NOT NULL,
            sha256 TEXT NOT NULL,
            etag TEXT,
            last_modified TEXT,
            lastmod TIMESTAMPTZ,
            PRIMARY KEY (set_id, uri)
        )""",
    ),
    (  # 14: the versions of one resource are read by resource id (publish/versions.py)
        "CREATE INDEX IF NOT EXISTS changelog_resource ON changelog(resource_id, seq)",
    ),
]

#: A time as SQLite stores it (state.format_dt: ``YYYY-MM-DDThh:mm:ss.ffffffZ``, UTC), written by the server.
_W3C = """to_char({} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')"""
#: iter_live_listing: interface.ListingRow's columns, then whether the row has more than those.
_LISTING_COLS = (
    "id, uri, sha256, length, type, encoding, md5, sha1, "
    + ", ".join(_W3C.format(c) for c in ("lastmod", "upstream_datetime", "updated_at"))
    + ", (links IS NOT NULL OR md_extra IS NOT NULL OR entry_extra IS NOT NULL)"
)
_COPY_RES = "COPY {table} (id, " + ", ".join(RES_COLS) + ") FROM STDIN"
#: Stored rows changed by a batch are copied into this temporary table, then updated in one statement.
_BATCH = "rsagg_changed_rows"
_UPDATE_FROM_BATCH = (
    "UPDATE resources r SET "
    + ", ".join(
        f"{c} = COALESCE(b.{c}, r.{c})" if c == "generation" else f"{c} = b.{c}" for c in RES_COLS[2:]
    )
    + f" FROM {_BATCH} b WHERE r.id = b.id"
)
_SOURCE_COLS = (
    "name", "url", "state", "last_error", "last_error_at", "last_success", "last_attempt", "next_attempt",
    "failures", "progress_done", "progress_total", "progress_what", "created_at", "updated_at", "using_url",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Locations and their secrets


def _jsonb(value: Any) -> Any:
    """A JSONB value as psycopg gives it (decoded already), or its text."""
    return json.loads(value) if isinstance(value, str) else value


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

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> psycopg.Cursor:
        return self.raw.execute(POSTGRES.sql(sql), params)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> psycopg.Cursor:
        cur = self.raw.cursor()
        cur.executemany(POSTGRES.sql(sql), rows)
        return cur

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        return self.raw.cursor(*args, **kwargs)

    def transaction(self) -> Any:
        return self.raw.transaction()


class PostgresState(Notifications, Dumps, Hub, Cluster, SqlState):
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

    def _db_now(self, c: Any) -> datetime:
        """The server's clock (``now()``, the transaction's start): nodes on many machines agree on it."""
        return c.execute("SELECT now()").fetchone()[0]

    def _log_head(self, c: psycopg.Connection) -> tuple[int, datetime]:
        """Lock the changelog head for this transaction: (last seq, this transaction's changelog time)."""
        seq, last = c.execute("SELECT seq, datetime FROM changelog_head FOR UPDATE").fetchone()
        now = self._now()
        return seq, (last if last is not None and now < last else now)

    # -- sources ---------------------------------------------------------------------------------

    def upsert_source(self, name: str, url: str) -> None:
        now = self._now()
        with self._write() as c:
            c.execute(
                "INSERT INTO sources (name, url, created_at, updated_at) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (name) DO UPDATE SET url = excluded.url, updated_at = excluded.updated_at "
                "WHERE sources.url IS DISTINCT FROM excluded.url",
                (name, url, now, now),
            )

    def sources(self) -> list[SourceRow]:
        with self._read() as c:
            rows = c.execute(f"SELECT {', '.join(_SOURCE_COLS)} FROM sources ORDER BY name").fetchall()
        return [SourceRow(*r) for r in rows]

    def source(self, name: str) -> SourceRow | None:
        with self._read() as c:
            row = c.execute(
                f"SELECT {', '.join(_SOURCE_COLS)} FROM sources WHERE name = %s", (name,)
            ).fetchone()
        return SourceRow(*row) if row else None

    def set_source_status(self, name: str, **fields: Any) -> None:
        """Update status columns (``SOURCE_STATUS_FIELDS`` of store/state.py)."""
        unknown = set(fields) - SOURCE_STATUS_FIELDS
        if unknown:
            raise ValueError(f"unknown source status field(s): {', '.join(sorted(unknown))}")
        values = dict(fields)
        values["updated_at"] = self._now()
        sets = ", ".join(f"{k} = %s" for k in values)
        with self._write() as c:
            cur = c.execute(f"UPDATE sources SET {sets} WHERE name = %s", [*values.values(), name])
            if cur.rowcount == 0:
                raise KeyError(f"unknown source {name!r}")

    def put_upstream_notes(self, source: str, deviations: Sequence[dict], skipped: Mapping[str, str]) -> None:
        now = self._now()
        rows = [("deviation", d["rule"], d["count"], d.get("url"), d.get("line"), d.get("message"), now)
                for d in deviations]  # fmt: skip
        rows += [("skipped", url, 1, url, None, why, now) for url, why in skipped.items()]
        with self._write() as c:
            c.execute("DELETE FROM upstream_notes WHERE source = %s", (source,))
            with c.cursor() as cur:
                cur.executemany(
                    "INSERT INTO upstream_notes (source, kind, rule, count, url, line, message, updated_at) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                    [(source, *r) for r in rows],
                )

    def upstream_notes(self, source: str) -> dict[str, list[dict]]:
        with self._read() as c:
            rows = c.execute(
                "SELECT kind, rule, count, url, line, message FROM upstream_notes WHERE source = %s "
                "ORDER BY kind, rule",
                (source,),
            ).fetchall()
        out: dict[str, list[dict]] = {"deviations": [], "skipped": []}
        for kind, rule, count, url, line, message in rows:
            if kind == "deviation":
                out["deviations"].append(
                    {"rule": rule, "count": count, "url": url, "line": line, "message": message}
                )
            else:
                out["skipped"].append({"url": url, "reason": message})
        return out

    # -- documents -------------------------------------------------------------------------------

    def document(self, url: str) -> DocumentRow | None:
        with self._read() as c:
            row = c.execute(
                "SELECT url, source, capability, etag, last_modified, sha256, fetched_at FROM documents "
                "WHERE url = %s",
                (url,),
            ).fetchone()
        return DocumentRow(*row) if row else None

    def put_document(
        self,
        url: str,
        source: str,
        capability: str | None,
        *,
        etag: str | None,
        last_modified: str | None,
        sha256: str | None,
    ) -> None:
        if sha256 is not None:
            check_sha(sha256)
        with self._write() as c:
            c.execute(
                "INSERT INTO documents (url, source, capability, etag, last_modified, sha256, fetched_at) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (url) DO UPDATE SET "
                "source = excluded.source, capability = excluded.capability, etag = excluded.etag, "
                "last_modified = excluded.last_modified, sha256 = excluded.sha256, "
                "fetched_at = excluded.fetched_at",
                (url, source, capability, etag, last_modified, sha256, self._now()),
            )

    # -- sets and cursors ------------------------------------------------------------------------

    def ensure_set(self, source: str, capabilitylist_url: str, *, name: str | None = None) -> int:
        """The set of one upstream Capability List, created on first sight (names as ``State.ensure_set``)."""
        with self._write() as c:
            c.execute(
                "SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK + 1,)
            )  # naming is check-then-insert
            row = c.execute(
                "SELECT id FROM sets WHERE source = %s AND capabilitylist_url = %s",
                (source, capabilitylist_url),
            ).fetchone()
            if row:
                return row[0]
            base = name or source
            candidate, n = base, 1
            while c.execute("SELECT 1 FROM sets WHERE name = %s", (candidate,)).fetchone():
                n += 1
                candidate = f"{base}-{n}"
            return c.execute(
                "INSERT INTO sets (source, capabilitylist_url, name, created_at) VALUES (%s, %s, %s, %s) "
                "RETURNING id",
                (source, capabilitylist_url, candidate, self._now()),
            ).fetchone()[0]

    def sets(self, source: str | None = None) -> list[SetRow]:
        sql = "SELECT id, source, capabilitylist_url, name, generation, baseline_generation FROM sets"
        with self._read() as c:
            if source is None:
                rows = c.execute(sql + " ORDER BY id").fetchall()
            else:
                rows = c.execute(sql + " WHERE source = %s ORDER BY id", (source,)).fetchall()
        return [SetRow(*r) for r in rows]

    def cursor(self, set_id: int) -> Cursor | None:
        with self._read() as c:
            row = c.execute(
                "SELECT baseline_at, changelist_url, last_datetime, same_datetime_count, list_index, "
                "list_until FROM cursors WHERE set_id = %s",
                (set_id,),
            ).fetchone()
        return Cursor(*row) if row else None

    def _put_cursor(self, c: psycopg.Connection, set_id: int, cursor: Cursor, now: datetime) -> None:
        c.execute(
            "INSERT INTO cursors (set_id, baseline_at, changelist_url, last_datetime, same_datetime_count, "
            "list_index, list_until, updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (set_id) DO UPDATE SET baseline_at = excluded.baseline_at, "
            "changelist_url = excluded.changelist_url, last_datetime = excluded.last_datetime, "
            "same_datetime_count = excluded.same_datetime_count, list_index = excluded.list_index, "
            "list_until = excluded.list_until, updated_at = excluded.updated_at",
            (set_id, cursor.baseline_at, cursor.changelist_url, cursor.last_datetime,
             cursor.same_datetime_count, cursor.list_index, cursor.list_until, now),
        )  # fmt: skip

    # -- the change pipeline ---------------------------------------------------------------------

    def apply(
        self,
        set_id: int,
        changes: Sequence[Change],
        cursor: Cursor | None = None,
        retries: RetryChanges | None = None,
    ) -> list[Change]:
        """Apply a batch of changes, move the cursor and write ``retries``, in ONE transaction
        (``State.apply``'s rules)."""
        for ch in changes:
            if ch.change not in CHANGES:
                raise ValueError(f"{ch.uri}: unknown change {ch.change!r}")
            if ch.sha256 is not None:
                check_sha(ch.sha256)
        with self._write() as c:
            row = c.execute("SELECT baseline_generation FROM sets WHERE id = %s", (set_id,)).fetchone()
            if row is None:
                raise KeyError(f"unknown set {set_id}")
            seq, now = self._log_head(c)
            applied = self._apply(c, set_id, changes, row[0], seq, now)
            if cursor is not None:
                self._put_cursor(c, set_id, cursor, now)
            if retries is not None:
                self._put_retries(c, now, set_id, retries)
        return applied

    def _apply(
        self,
        c: psycopg.Connection,
        set_id: int,
        changes: Sequence[Change],
        open_generation: int | None,
        seq: int,
        now: datetime,
    ) -> list[Change]:
        # 1. What is stored now, for every uri of the batch (one query).
        uris = list(dict.fromkeys(ch.uri for ch in changes))
        current: dict[str, list] = {}  # uri -> [id, sha256, live, stored] (the _C_* positions)
        if uris:
            # One (set_id, uri) key lookup per uri, whatever the planner's statistics say (``uri =
            # ANY(...)`` on a table not analysed yet scanned the whole set for every batch).
            for rid, uri, sha, deleted in c.execute(
                "SELECT r.id, r.uri, r.sha256, r.deleted FROM unnest(%s::text[]) AS u(uri) "
                "CROSS JOIN LATERAL (SELECT id, uri, sha256, deleted FROM resources "
                "WHERE set_id = %s AND uri = u.uri) AS r",
                (uris, set_id),
            ):
                current[uri] = [rid, sha, not deleted, True]
        new_ids: Iterator[int] = iter(())
        if len(current) < len(uris):  # ids from the sequence: never reused, whichever process asks
            new_ids = iter(
                r[0]
                for r in c.execute(
                    "SELECT nextval('resources_id_seq') FROM generate_series(1, %s)",
                    (len(uris) - len(current),),
                ).fetchall()
            )
        # 2. Decide, change by change (store/state.py's plan_batch: the rules of every backend).
        rows, tombstones, seen, log, applied = plan_batch(
            set_id, changes, current, open_generation, now, lambda: next(new_ids), lambda t: t
        )
        # 3. Write: no-op marks, tombstones, new rows, changed rows, then the log and its head.
        # Each kind of write is one statement whatever the batch's size (COPY, or arrays unnested):
        # row-by-row statements, even pipelined, made a batch of updates 4x slower.
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
            if rows:
                new, old = [], []
                for uri, row in rows.items():
                    (old if current[uri][C_STORED] else new).append((row[W_ID], *row[:W_ID]))
                if new:
                    with cur.copy(_COPY_RES.format(table="resources")) as copy:
                        for r in new:
                            copy.write_row(r)
                if old:
                    with cur.copy(_COPY_RES.format(table=_BATCH)) as copy:
                        for r in old:
                            copy.write_row(r)
                    cur.execute(_UPDATE_FROM_BATCH)
            if log:
                self._append_log(cur, seq, log)
        return applied

    @staticmethod
    def _append_log(cur: psycopg.Cursor, seq: int, log: list[tuple]) -> None:
        """Append ``log`` (changelog rows without seq) after ``seq``; the head row is locked already."""
        with cur.copy(f"COPY changelog ({', '.join(LOG_COLS)}) FROM STDIN") as copy:
            for i, r in enumerate(log, seq + 1):
                copy.write_row((i, *r))
        cur.execute("UPDATE changelog_head SET seq = %s, datetime = %s", (seq + len(log), log[-1][4]))

    # -- baselines -------------------------------------------------------------------------------

    def begin_baseline(self, set_id: int) -> int:
        with self._write() as c:
            row = c.execute(
                "UPDATE sets SET generation = generation + 1, baseline_generation = generation + 1 "
                "WHERE id = %s RETURNING generation",
                (set_id,),
            ).fetchone()
            if row is None:
                raise KeyError(f"unknown set {set_id}")
            return row[0]

    def finish_baseline(
        self,
        set_id: int,
        generation: int,
        cursor: Cursor,
        retries: RetryChanges | None = None,
    ) -> list[Change]:
        """``State.finish_baseline``: sweep the rows not seen in ``generation``, store the cursor and
        close the baseline, in one transaction (``retries`` too, as in ``apply``)."""
        with self._write() as c:
            row = c.execute(
                "SELECT baseline_generation FROM sets WHERE id = %s FOR UPDATE", (set_id,)
            ).fetchone()
            if row is None:
                raise KeyError(f"unknown set {set_id}")
            if row[0] != generation:
                raise ValueError(f"set {set_id}: baseline {generation} is not the open one ({row[0]})")
            seq, now = self._log_head(c)
            gone = c.execute(
                "SELECT id, uri FROM resources WHERE set_id = %s AND NOT deleted "
                "AND (generation IS NULL OR generation < %s) ORDER BY id",
                (set_id, generation),
            ).fetchall()
            if (
                gone
                and not c.execute(
                    "SELECT 1 FROM resources WHERE set_id = %s AND generation = %s LIMIT 1",
                    (set_id, generation),
                ).fetchone()
            ):
                raise EmptySnapshot(f"it saw no resource, {len(gone)} held: none deleted")
            with c.cursor() as cur:
                if gone:
                    cur.execute(
                        "UPDATE resources SET deleted = true, generation = %s, updated_at = %s "
                        "WHERE id = ANY(%s)",
                        (generation, now, [rid for rid, _ in gone]),
                    )
                    self._append_log(
                        cur, seq, [(set_id, rid, uri, DELETED, now, None, None, None) for rid, uri in gone]
                    )
            self._put_cursor(c, set_id, cursor, now)
            c.execute("UPDATE sets SET baseline_generation = NULL WHERE id = %s", (set_id,))
            if retries is not None:
                self._put_retries(c, now, set_id, retries)
        return [Change(uri, DELETED, generation=generation) for _, uri in gone]

    # -- retries (State's rules: a failed change waits for the next sync; see State._put_retries) ---

    def _put_retries(self, c: psycopg.Connection, now: datetime, set_id: int, retries: RetryChanges) -> None:
        with c.cursor() as cur:
            if retries.failed:
                cur.executemany(
                    "INSERT INTO retries (set_id, uri, change, entry, kind, message, first_at, last_at) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (set_id, uri) DO UPDATE SET "
                    "change = excluded.change, entry = excluded.entry, kind = excluded.kind, "
                    "message = excluded.message, attempts = retries.attempts + 1, last_at = excluded.last_at",
                    [(set_id, f.entry.loc, f.change, b"".join(iter_document_bytes(Head(), [f.entry])), f.kind,
                      f.message, now, now) for f in retries.failed],
                )  # fmt: skip
            if retries.cleared:
                cur.execute(
                    "DELETE FROM retries WHERE set_id = %s AND uri = ANY(%s)", (set_id, list(retries.cleared))
                )

    def pending_retries(self, set_id: int) -> list[tuple[Entry, str, int]]:
        with self._read() as c:
            rows = c.execute(
                "SELECT entry, change, attempts FROM retries WHERE set_id = %s AND kind <> %s "
                "ORDER BY first_at",
                (set_id, RETRY_ENDED),
            ).fetchall()
        out = []
        for data, change, attempts in rows:
            _, entries = parse_bytes(bytes(data))
            out.extend((e, change, attempts) for e in entries)
        return out

    def retry_uris(self, set_id: int) -> set[str]:
        with self._read() as c:
            return {r[0] for r in c.execute("SELECT uri FROM retries WHERE set_id = %s", (set_id,))}

    def end_retries(self, set_id: int, ended: Iterable[str], reason: str) -> None:
        now = self._now()
        with self._write() as c, c.cursor() as cur:
            cur.executemany(
                "UPDATE retries SET message = %s || ' (last failure: ' || kind || ': ' || message || ')', "
                "kind = %s, last_at = %s WHERE set_id = %s AND uri = %s AND kind <> %s",
                [(reason, RETRY_ENDED, now, set_id, uri, RETRY_ENDED) for uri in ended],
            )

    def retry_rows(self, sources: Iterable[str] = ()) -> list[dict]:
        wanted = list(sources)
        sql = (
            "SELECT s.source, s.name AS set_name, r.uri, r.change, r.kind, r.message, r.attempts, "
            "r.first_at, r.last_at FROM retries r JOIN sets s ON s.id = r.set_id"
        )
        params: list[Any] = []
        if wanted:
            sql += " WHERE s.source = ANY(%s)"
            params.append(wanted)
        with self._read() as c:
            cur = c.execute(sql + " ORDER BY s.source, r.first_at", params)
            names = [d.name for d in cur.description]
            rows = cur.fetchall()
        out = []
        for r in rows:
            d = dict(zip(names, r, strict=True))
            d["first_at"], d["last_at"] = format_dt(d["first_at"]), format_dt(d["last_at"])  # as State's
            out.append({**d, "state": "ended" if d["kind"] == RETRY_ENDED else "waiting"})
        return out

    def clear_retries(self, sources: Iterable[str] = (), *, ended_only: bool = False) -> int:
        wanted = list(sources)
        where, params = [], []
        if wanted:
            where.append("set_id IN (SELECT id FROM sets WHERE source = ANY(%s))")
            params.append(wanted)
        if ended_only:
            where.append("kind = %s")
            params.append(RETRY_ENDED)
        sql = "DELETE FROM retries" + (" WHERE " + " AND ".join(where) if where else "")
        with self._write() as c:
            return c.execute(sql, params).rowcount

    def retries_by_source(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        with self._read() as c:
            rows = c.execute(
                "SELECT s.source, r.kind = %s, count(*) FROM retries r JOIN sets s ON s.id = r.set_id "
                "GROUP BY 1, 2",
                (RETRY_ENDED,),
            ).fetchall()
        for source, ended, n in rows:
            counts = out.setdefault(source, {"waiting": 0, "ended": 0})
            counts["ended" if ended else "waiting"] += n
        return out

    # -- reads -----------------------------------------------------------------------------------

    # -- reconciliation ----------------------------------------------------------------------------

    def reconciliation(self, set_id: int) -> Reconciliation | None:
        with self._read() as c:
            row = c.execute(
                "SELECT set_id, reconciled_at, cause, lists, differences, repaired, unrepaired, complete, "
                "error FROM reconciliations WHERE set_id = %s",
                (set_id,),
            ).fetchone()
        if row is None:
            return None
        sid, at, cause, lists, differences, repaired, unrepaired, complete, error = row
        return Reconciliation(sid, at, cause, _jsonb(lists), differences, _jsonb(repaired), unrepaired,
                              bool(complete), error)  # fmt: skip

    def put_reconciliation(self, rec: Reconciliation) -> None:
        with self._write() as c:
            c.execute(
                "INSERT INTO reconciliations (set_id, reconciled_at, cause, lists, differences, repaired, "
                "unrepaired, complete, error) VALUES (%s, %s, %s, %s::jsonb, %s, %s::jsonb, %s, %s, %s) "
                "ON CONFLICT (set_id) DO UPDATE SET reconciled_at = excluded.reconciled_at, "
                "cause = excluded.cause, lists = excluded.lists, differences = excluded.differences, "
                "repaired = excluded.repaired, unrepaired = excluded.unrepaired, "
                "complete = excluded.complete, error = excluded.error",
                (rec.set_id, rec.reconciled_at, rec.cause, json.dumps(rec.lists), rec.differences,
                 json.dumps(rec.repaired), rec.unrepaired, rec.complete, rec.error),
            )  # fmt: skip

    def resource_validators(self, set_id: int, uris: Sequence[str]) -> dict[str, ResourceValidators]:
        if not uris:
            return {}
        with self._read() as c:
            rows = c.execute(
                "SELECT uri, sha256, etag, last_modified, lastmod FROM resource_validators "
                "WHERE set_id = %s AND uri = ANY(%s)",
                (set_id, list(dict.fromkeys(uris))),
            ).fetchall()
        return {r[0]: ResourceValidators(*r) for r in rows}

    def put_resource_validators(self, set_id: int, rows: Sequence[ResourceValidators]) -> None:
        if not rows:
            return
        last = {r.uri: r for r in rows}  # one row per uri: ON CONFLICT may not touch a row twice
        with self._write() as c, c.cursor() as cur:
            cur.executemany(
                "INSERT INTO resource_validators (set_id, uri, sha256, etag, last_modified, lastmod) "
                "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (set_id, uri) DO UPDATE SET "
                "sha256 = excluded.sha256, etag = excluded.etag, last_modified = excluded.last_modified, "
                "lastmod = excluded.lastmod",
                [(set_id, r.uri, r.sha256, r.etag, r.last_modified, r.lastmod) for r in last.values()],
            )

    def resource(self, set_id: int, uri: str) -> Resource | None:
        with self._read() as c:
            row = c.execute(SELECT_RES + " WHERE set_id = %s AND uri = %s", (set_id, uri)).fetchone()
        return _resource(row) if row else None

    def resources(self, set_id: int, uris: Sequence[str]) -> dict[str, Resource]:
        """The stored rows of those of ``uris`` the set holds: one round trip, a key lookup per uri."""
        if not uris:
            return {}
        cols = ", ".join(f"r.{c}" for c in ("id", *RES_COLS))
        with self._read() as c:
            rows = c.execute(
                f"SELECT {cols} FROM unnest(%s::text[]) AS u(uri) CROSS JOIN LATERAL "
                "(SELECT * FROM resources WHERE set_id = %s AND uri = u.uri) AS r",
                (list(dict.fromkeys(uris)), set_id),
            ).fetchall()
        return {r[R_URI]: _resource(r) for r in rows}

    def iter_resources(
        self,
        set_id: int | None = None,
        *,
        include_deleted: bool = False,
        after_id: int = 0,
        limit: int | None = None,
    ) -> Iterator[Resource]:
        where, params = [], []
        if set_id is not None:
            where.append("set_id = %s")
            params.append(set_id)
        if not include_deleted:
            where.append("NOT deleted")
        where.append("id > %s")
        sql = f"{SELECT_RES} WHERE {' AND '.join(where)} ORDER BY id LIMIT %s"
        for row in self._pages(sql, params, 0, after_id, limit):
            yield _resource(row)

    def count_resources(
        self, set_id: int | None = None, *, source: str | None = None, include_deleted: bool = False
    ) -> int:
        where, params = [], []
        if set_id is not None:
            where.append("set_id = %s")
            params.append(set_id)
        if source is not None:
            where.append("set_id IN (SELECT id FROM sets WHERE source = %s)")
            params.append(source)
        if not include_deleted:
            where.append("NOT deleted")
        sql = "SELECT count(*) FROM resources" + (f" WHERE {' AND '.join(where)}" if where else "")
        with self._read() as c:
            return c.execute(sql, params).fetchone()[0]

    def iter_changelog(
        self, after_seq: int = 0, *, set_id: int | None = None, limit: int | None = None
    ) -> Iterator[LogRecord]:
        cols = ", ".join(LOG_COLS)
        if set_id is None:
            sql, params = f"SELECT {cols} FROM changelog WHERE seq > %s ORDER BY seq LIMIT %s", []
        else:
            sql = f"SELECT {cols} FROM changelog WHERE set_id = %s AND seq > %s ORDER BY seq LIMIT %s"
            params = [set_id]
        for r in self._pages(sql, params, 0, after_seq, limit):
            yield LogRecord(*r)

    def last_seq(self) -> int:
        with self._read() as c:
            return c.execute("SELECT seq FROM changelog_head").fetchone()[0]

    # -- reads for publishing --------------------------------------------------------------------

    def history_start(self, set_ids: Sequence[int]) -> datetime | None:
        if not set_ids:
            return None
        times: list[datetime] = []
        with self._read() as c:
            for sid in set_ids:
                row = c.execute("SELECT created_at FROM sets WHERE id = %s", (sid,)).fetchone()
                if row:
                    times.append(row[0])
                row = c.execute(
                    "SELECT datetime FROM changelog WHERE set_id = %s ORDER BY seq LIMIT 1", (sid,)
                ).fetchone()
                if row:
                    times.append(row[0])
        return min(times) if times else None

    def count_live(self, set_ids: Sequence[int]) -> int:
        with self._read() as c:
            return c.execute(
                "SELECT count(*) FROM resources WHERE set_id = ANY(%s) AND NOT deleted", (list(set_ids),)
            ).fetchone()[0]

    def live_part_boundaries(self, set_ids: Sequence[int], size: int) -> list[int]:
        return list(self.iter_live_part_boundaries(set_ids, size))

    def live_more_than(self, set_ids: Sequence[int], n: int) -> bool:
        with self._read() as c:
            return (
                c.execute(
                    "SELECT count(*) FROM (SELECT 1 FROM resources WHERE set_id = ANY(%s) AND NOT deleted "
                    "LIMIT %s) AS x",
                    (list(set_ids), n + 1),
                ).fetchone()[0]
                > n
            )

    def iter_live_part_boundaries(self, set_ids: Sequence[int], size: int) -> Iterator[int]:
        """The id of every ``size``-th live resource in id order (``State.live_part_boundaries``): the
        sets' live ids read by keyset pages and merged, so no connection is held between pages (a
        publisher's reader has one)."""
        if size < 1:
            raise ValueError("size must be at least 1")
        sql = "SELECT id FROM resources WHERE set_id = %s AND NOT deleted AND id > %s ORDER BY id LIMIT %s"
        iters = [self._pages(sql, [sid], 0, 0, None) for sid in dict.fromkeys(set_ids)]
        for n, (rid,) in enumerate(heapq.merge(*iters), 1):
            if n % size == 0:
                yield rid

    def _snapshot(self, sql: str, params: Sequence[Any] = ()) -> Iterator[tuple]:
        """Rows of one query as of one instant, fetched in pages from a server-side cursor (bounded
        memory whatever the result's size); the pooled connection is held until the iterator ends."""
        with self._read() as conn, conn.transaction(), conn.cursor(name=f"rsagg_{id(self):x}") as cur:
            cur.itersize = codec.PAGE_SIZE
            cur.execute(sql, params)
            while rows := cur.fetchmany(codec.PAGE_SIZE):
                yield from rows

    def live_after(self, set_ids: Sequence[int], after_id: int) -> bool:
        with self._read() as c:
            return any(
                c.execute(
                    "SELECT 1 FROM resources WHERE set_id = %s AND NOT deleted AND id > %s LIMIT 1",
                    (sid, after_id),
                ).fetchone()
                for sid in dict.fromkeys(set_ids)
            )

    def rows_version(
        self, set_ids: Sequence[int], after_id: int = 0, until_id: int | None = None
    ) -> tuple[int, datetime | None]:
        top = MAX_INT if until_id is None else until_id
        with self._read() as c:
            n, newest = c.execute(
                "SELECT count(*), max(updated_at) FROM resources "
                "WHERE set_id = ANY(%s) AND id > %s AND id <= %s",
                (list(dict.fromkeys(set_ids)), after_id, top),
            ).fetchone()
        return n, newest

    def set_last_seq(self, set_ids: Sequence[int]) -> int:
        with self._read() as c:
            return max(
                (
                    c.execute(
                        "SELECT coalesce(max(seq), 0) FROM changelog WHERE set_id = %s", (sid,)
                    ).fetchone()[0]
                    for sid in dict.fromkeys(set_ids)
                ),
                default=0,
            )

    def iter_live(
        self, set_ids: Sequence[int], *, after_id: int = 0, until_id: int | None = None
    ) -> Iterator[Resource]:
        top = MAX_INT if until_id is None else until_id
        sql = f"{SELECT_RES} WHERE set_id = %s AND NOT deleted AND id <= %s AND id > %s ORDER BY id LIMIT %s"
        iters = [self._pages(sql, [sid, top], 0, after_id, None) for sid in dict.fromkeys(set_ids)]
        rows = iters[0] if len(iters) == 1 else heapq.merge(*iters, key=lambda r: r[0])
        for row in rows:
            yield _resource(row)

    def iter_live_listing(
        self, set_ids: Sequence[int], *, after_id: int = 0, until_id: int | None = None
    ) -> Iterator[ListingRow | Resource]:
        """``iter_live`` for list writers (``interface.ListingRow``): the server writes the times as the
        fixed-width UTC text SQLite stores, so a plain row goes out without a ``Resource`` or a datetime;
        the rows with links or extras are read whole, a page at a time."""
        top = MAX_INT if until_id is None else until_id
        sql = f"SELECT {_LISTING_COLS} FROM resources "
        sql += "WHERE set_id = %s AND NOT deleted AND id <= %s AND id > %s ORDER BY id LIMIT %s"
        iters = [self._listing_pages(sql, sid, top, after_id) for sid in dict.fromkeys(set_ids)]
        if len(iters) == 1:
            yield from iters[0]
        else:
            yield from heapq.merge(*iters, key=lambda r: r[0] if type(r) is tuple else r.id)

    def _listing_pages(self, sql: str, set_id: int, top: int, after: int) -> Iterator[ListingRow | Resource]:
        page = codec.PAGE_SIZE
        while True:
            with self._read() as c:
                rows = c.execute(sql, (set_id, top, after, page)).fetchall()
                rich = [r[0] for r in rows if r[-1]]
                if rich:
                    full = c.execute(f"{SELECT_RES} WHERE id = ANY(%s)", (rich,)).fetchall()
            if rich:
                whole = {r[0]: _resource(r) for r in full}
                for r in rows:
                    yield whole[r[0]] if r[-1] else r[:-1]
            else:
                for r in rows:
                    yield r[:-1]
            if len(rows) < page:
                return
            after = rows[-1][0]

    def live_part_boundary(self, set_id: int, after_id: int, size: int) -> int | None:
        if size < 1:
            raise ValueError("size must be at least 1")
        with self._read() as c:
            row = c.execute(
                "SELECT id FROM resources WHERE set_id = %s AND NOT deleted AND id > %s "
                "ORDER BY id LIMIT 1 OFFSET %s",
                (set_id, after_id, size - 1),
            ).fetchone()
        return None if row is None else row[0]

    def resource_in(self, set_ids: Sequence[int], uri: str) -> Resource | None:
        best: Resource | None = None
        for sid in dict.fromkeys(set_ids):
            r = self.resource(sid, uri)
            if r is None:
                continue
            if best is None or (not r.deleted, r.updated_at) > (not best.deleted, best.updated_at):
                best = r
        return best

    def live_set_of(self, set_ids: Sequence[int], uri: str) -> int | None:
        with self._read() as c:
            for sid in dict.fromkeys(set_ids):
                if c.execute(
                    "SELECT 1 FROM resources WHERE set_id = %s AND uri = %s AND NOT deleted", (sid, uri)
                ).fetchone():
                    return sid
        return None

    def iter_log_range(
        self, set_ids: Sequence[int], after_seq: int = 0, until_seq: int | None = None
    ) -> Iterator[tuple[LogRecord, Resource | None]]:
        top = MAX_INT if until_seq is None else until_seq
        cols = ", ".join(f"c.{c}" for c in LOG_COLS)
        res_cols = "r.id, " + ", ".join(f"r.{c}" for c in RES_COLS)
        sql = (
            f"SELECT {cols}, {res_cols} FROM changelog c LEFT JOIN resources r ON r.id = c.resource_id "
            "WHERE c.set_id = %s AND c.seq <= %s AND c.seq > %s ORDER BY c.seq LIMIT %s"
        )
        iters = [self._pages(sql, [sid, top], 0, after_seq, None) for sid in dict.fromkeys(set_ids)]
        if not iters:
            return
        rows = iters[0] if len(iters) == 1 else heapq.merge(*iters, key=lambda r: r[0])
        n = len(LOG_COLS)
        for r in rows:
            yield LogRecord(*r[:n]), (_resource(r[n:]) if r[n] is not None else None)

    def log_windows(self, set_ids: Sequence[int], size: int) -> list[int]:
        if size < 1:
            raise ValueError("size must be at least 1")
        out: list[int] = []
        after = 0
        ids = list(dict.fromkeys(set_ids))
        while ids:
            with self._read() as c:
                nxt = c.execute(
                    "SELECT min(seq) FROM changelog WHERE set_id = ANY(%s) AND seq > %s", (ids, after)
                ).fetchone()[0]
            if nxt is None:
                return out
            k = (nxt - 1) // size + 1
            out.append(k)
            after = k * size
        return out

    def log_datetime(self, seq: int) -> datetime | None:
        with self._read() as c:
            row = c.execute(
                "SELECT datetime FROM changelog WHERE seq <= %s ORDER BY seq DESC LIMIT 1", (seq,)
            ).fetchone()
        return row[0] if row else None

    def log_record(self, seq: int) -> LogRecord | None:
        if not 0 <= seq <= MAX_INT:
            return None
        with self._read() as c:
            r = c.execute(f"SELECT {', '.join(LOG_COLS)} FROM changelog WHERE seq = %s", (seq,)).fetchone()
        return LogRecord(*r) if r else None

    def iter_versions(
        self, resource_id: int, after_seq: int = 0, limit: int | None = None
    ) -> Iterator[LogRecord]:
        sql = (
            f"SELECT {', '.join(LOG_COLS)} FROM changelog WHERE resource_id = %s AND seq > %s "
            "ORDER BY seq LIMIT %s"
        )
        for r in self._pages(sql, [resource_id], 0, after_seq, limit):
            yield LogRecord(*r)

    def count_versions(self, resource_id: int, after_seq: int = 0, limit: int | None = None) -> int:
        with self._read() as c:
            return c.execute(
                "SELECT count(*) FROM (SELECT 1 FROM changelog WHERE resource_id = %s AND seq > %s "
                "AND change <> 'deleted' LIMIT %s) AS n",
                (resource_id, after_seq, MAX_INT if limit is None else limit),
            ).fetchone()[0]

    def version_at(self, resource_id: int, when: datetime) -> LogRecord | None:
        cols = ", ".join(LOG_COLS)
        with self._read() as c:
            top = c.execute(  # datetime never decreases with seq: see State.version_at
                "SELECT seq FROM changelog WHERE datetime <= %s ORDER BY datetime DESC, seq DESC LIMIT 1",
                (when,),
            ).fetchone()
            r = None
            if top is not None:
                r = c.execute(
                    f"SELECT {cols} FROM changelog WHERE resource_id = %s AND seq <= %s "
                    "AND change <> 'deleted' ORDER BY seq DESC LIMIT 1",
                    (resource_id, top[0]),
                ).fetchone()
            if r is None:
                r = c.execute(
                    f"SELECT {cols} FROM changelog WHERE resource_id = %s AND change <> 'deleted' "
                    "ORDER BY seq LIMIT 1",
                    (resource_id,),
                ).fetchone()
        return LogRecord(*r) if r else None

    def referenced_hashes(self, retention: Retention | None = None) -> Iterator[str]:
        """Every sha256 gc must keep, each once, ascending, as of one instant (one query, read from a
        server-side cursor: ``State.referenced_hashes`` says which)."""
        sql = (
            "SELECT sha256 FROM resources WHERE NOT deleted AND sha256 IS NOT NULL "
            f"UNION {retained_sql(retention, lambda d: d.isoformat())} "
            "UNION SELECT sha256 FROM documents WHERE sha256 IS NOT NULL ORDER BY 1"
        )
        for (sha,) in self._snapshot(sql, ()):
            yield sha

    # -- the embedded WebSub hub (websub/hub.py; migration 6) ----------------------------------------

    # -- rsagg's notification channels (websub/notifier.py; migration 7) --------------------------

    # -- rsagg's subscriptions to upstream channels (websub/subscriber.py; migration 8) ----------

    # -- the shared inbox of upstream notifications (websub/subscriber.py; migration 10) -------------

    # -- rsagg's own Resource Dumps and Change Dumps (publish/dumps.py; migration 5) ---------------

    # -- cluster: nodes and source leases (cluster.py) ----------------------------------------------
    # Lease times are the server's clock (now()): nodes on many machines agree on one clock. Claims
    # lock the candidate rows FOR UPDATE SKIP LOCKED: concurrent claimers skip what another is granting.


# ---------------------------------------------------------------------------------------------------

# The oldest pending delivery of each subscription: the only one that may go out (in-order delivery).
_HUB_HEADS = "SELECT min(id) FROM hub_deliveries GROUP BY subscription_id"
_HUB_GC_PAYLOADS = (
    "DELETE FROM hub_payloads p WHERE NOT EXISTS (SELECT 1 FROM hub_deliveries d WHERE d.payload_id = p.id)"
)
_NSUB_COLS = tuple(f.name for f in dataclasses.fields(NotifySubscription))
_RUN_COLS = "id, set_name, at, completed, last_seq, set_ids, packages, entries, bytes, created"
_PKG_COLS = (
    'id, set_name, kind, run, part, "window", first_seq, last_seq, sha256, length, manifest_sha256, '
    "manifest_length, at, completed, from_, until, entries, bytes, created"
)


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


def _resource(r: Sequence[Any]) -> Resource:
    return resource_row(r, POSTGRES.dt)


__all__ = ["MIGRATIONS", "SCHEMES", "PostgresState", "StateUnavailable", "is_postgres_url", "redact"]
