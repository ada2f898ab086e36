"""What rsagg knows: Sources, their documents and sets, the resources held, the changelog and cursors.

SQLite in WAL mode through sqlite-utils, one connection. docs/architecture.md invariants 1 and 2 live in
``State.apply``: resource rows, changelog records and the cursor move in ONE transaction, so a crash
never half-applies a batch and never applies one twice. Invariant 3: the ``changelog`` table is the
truth of what rsagg republishes (its Change Lists are views of it; Resource Lists are views of
``resources``).

Times are stored as W3C Datetime text in one fixed-width form, ``YYYY-MM-DDThh:mm:ss.ffffffZ`` (always
six fraction digits, always UTC; a valid W3C Datetime, §7): with a fixed width, text order equals time
order, so ``ORDER BY``/``<`` on those columns compare times. (``w3cdt.format_w3c`` drops a zero
fraction, and ``...:05Z`` sorts after ``...:05.1Z``, hence our own writer.)

Threads: the harvester calls ``State`` from worker threads, so the connection is opened with
``check_same_thread=False`` and every method takes ``self._lock``: nobody reads another thread's
half-done transaction through the shared connection. Iterators read in pages and hold the lock only
while fetching a page, so a slow consumer (an HTTP response) never blocks writers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import json
import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlite_utils import Database

from ..errors import is_environmental, operator_line
from ..rs.model import CHANGES, DELETED, Entry, Head
from ..rs.w3cdt import utcnow
from .interface import FENCE, EmptySnapshot, LeaseLost, ListingRow, StateUnavailable
from .retention import Retention, retained_sql
from .rows import (
    Change,
    Cursor,
    DocumentRow,
    DumpPackage,
    DumpRun,
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
    parse_dt,
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
    W_SHA256,
    check_sha,
    plan_batch,
    resource_row,
    source_row,
)
from .sql.dialect import MAX_INT, SQLITE
from .sql.dumps import Dumps
from .sql.hub import Hub
from .sql.notify import Notifications

if TYPE_CHECKING:
    pass

# ---------------------------------------------------------------------------------------------------
# Schema: MIGRATIONS[i] brings user_version i to i + 1. Never edit a released step; append a new one.

MIGRATIONS: list[tuple[str, ...]] = [
    (
        """CREATE TABLE sources (
            name TEXT PRIMARY KEY,
            url TEXT NOT NULL,
            state TEXT,                 -- e.g. idle, discovering, baseline, incremental, error
            last_error TEXT,
            last_error_at TEXT,
            last_success TEXT,
            last_attempt TEXT,
            next_attempt TEXT,          -- when the next try is due (backoff), for `rsagg status`
            failures INTEGER NOT NULL DEFAULT 0,   -- consecutive failures
            progress_done INTEGER,
            progress_total INTEGER,
            progress_what TEXT,         -- what the progress counts, e.g. a Resource List URL
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL
        )""",
        """CREATE TABLE documents (
            url TEXT PRIMARY KEY,
            source TEXT NOT NULL REFERENCES sources(name) ON DELETE CASCADE,
            capability TEXT,
            etag TEXT,
            last_modified TEXT,         -- the HTTP header as received (RFC 9110 form, not W3C)
            sha256 TEXT,                -- body kept as a blob (answers a 304)
            fetched_at TEXT NOT NULL
        )""",
        "CREATE INDEX documents_source ON documents(source)",
        """CREATE TABLE sets (
            id INTEGER PRIMARY KEY,
            source TEXT NOT NULL REFERENCES sources(name) ON DELETE CASCADE,
            capabilitylist_url TEXT NOT NULL,
            name TEXT NOT NULL UNIQUE,  -- stable short name for republishing paths
            generation INTEGER NOT NULL DEFAULT 0,  -- last baseline generation begun
            baseline_generation INTEGER,            -- the baseline in progress, NULL when none
            created_at TEXT NOT NULL,
            UNIQUE (source, capabilitylist_url)
        )""",
        """CREATE TABLE cursors (
            set_id INTEGER PRIMARY KEY REFERENCES sets(id) ON DELETE CASCADE,
            baseline_at TEXT,
            changelist_url TEXT,
            last_datetime TEXT,
            same_datetime_count INTEGER NOT NULL DEFAULT 0,
            list_index INTEGER NOT NULL DEFAULT 0,
            list_until TEXT,
            updated_at TEXT NOT NULL
        )""",
        """CREATE TABLE resources (
            id INTEGER PRIMARY KEY,
            set_id INTEGER NOT NULL REFERENCES sets(id) ON DELETE CASCADE,
            uri TEXT NOT NULL,
            sha256 TEXT,
            length INTEGER,
            type TEXT,
            encoding TEXT,
            md5 TEXT,
            sha1 TEXT,
            lastmod TEXT,
            upstream_datetime TEXT,
            links TEXT,                 -- JSON list of rs:ln attribute objects, NULL when none
            md_extra TEXT,              -- JSON object, NULL when empty
            entry_extra TEXT,           -- JSON list of XML strings, NULL when empty
            deleted INTEGER NOT NULL DEFAULT 0,
            generation INTEGER,
            updated_at TEXT NOT NULL,
            UNIQUE (set_id, uri)
        )""",
        # iter_resources(set_id) pages by id; the partial index serves live-only pages and counts.
        "CREATE INDEX resources_set_id ON resources(set_id, id)",
        "CREATE INDEX resources_live ON resources(set_id, id) WHERE deleted = 0",
        """CREATE TABLE changelog (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- never reused, even after pruning
            set_id INTEGER NOT NULL REFERENCES sets(id) ON DELETE CASCADE,
            resource_id INTEGER NOT NULL,            -- no FK: the log outlives pruned rows
            uri TEXT NOT NULL,
            change TEXT NOT NULL CHECK (change IN ('created', 'updated', 'deleted')),
            datetime TEXT NOT NULL,                  -- rsagg's clock, fixed-width W3C, non-decreasing
            sha256 TEXT,
            length INTEGER,
            type TEXT
        )""",
        "CREATE INDEX changelog_set_seq ON changelog(set_id, seq)",
        "CREATE INDEX changelog_datetime ON changelog(datetime)",
    ),
    (  # 2: changes whose fetch failed, retried at the next sync (State.pending_retries)
        """CREATE TABLE IF NOT EXISTS retries (
            set_id INTEGER NOT NULL REFERENCES sets(id),
            uri TEXT NOT NULL,
            change TEXT NOT NULL,
            entry BLOB NOT NULL,                     -- the upstream entry as a one-entry document
            kind TEXT NOT NULL,
            message TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 1,
            first_at TEXT NOT NULL,
            last_at TEXT NOT NULL,
            PRIMARY KEY (set_id, uri)
        )""",
    ),
    (  # 3: what the last sync of a source tolerated and skipped (harvest/deviations.py)
        """CREATE TABLE IF NOT EXISTS upstream_notes (
            source TEXT NOT NULL REFERENCES sources(name) ON DELETE CASCADE,
            kind TEXT NOT NULL CHECK (kind IN ('deviation', 'skipped')),
            rule TEXT NOT NULL,          -- deviation rule, or the URL of the skipped list
            count INTEGER NOT NULL DEFAULT 1,
            url TEXT,                    -- where it was first seen
            line INTEGER,
            message TEXT,
            updated_at TEXT NOT NULL,
            PRIMARY KEY (source, kind, rule)
        )""",
    ),
    (  # 4: the URL discovery used instead of the configured one when that failed (rsagg status)
        "ALTER TABLE sources ADD COLUMN using_url TEXT",
    ),
    (  # 5: rsagg's own Resource Dump runs and Resource/Change Dump packages (publish/dumps.py). Until this
        # step publish/dumps.py created them itself, so IF NOT EXISTS: a store that has them keeps them.
        """CREATE TABLE IF NOT EXISTS publish_dump_runs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            set_name TEXT NOT NULL,
            at TEXT NOT NULL,              -- snapshot started (§11.1 at)
            completed TEXT NOT NULL,       -- snapshot completed (§11.1 completed)
            last_seq INTEGER NOT NULL,     -- global changelog seq when the snapshot started
            set_ids TEXT NOT NULL,         -- JSON list of the state sets it covers
            packages INTEGER NOT NULL,
            entries INTEGER NOT NULL,
            bytes INTEGER NOT NULL,
            created TEXT NOT NULL
        )""",
        "CREATE INDEX IF NOT EXISTS publish_dump_runs_set ON publish_dump_runs(set_name, id)",
        """CREATE TABLE IF NOT EXISTS publish_dumps (
            id INTEGER PRIMARY KEY AUTOINCREMENT,   -- never reused: Resource Dump package URLs name it
            set_name TEXT NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ('resourcedump', 'changedump')),
            run INTEGER,                   -- resourcedump: publish_dump_runs.id
            part INTEGER NOT NULL,         -- 1-based package number within the run (1 for changedump)
            window INTEGER,                -- changedump: Change List window K (its URL number)
            first_seq INTEGER,             -- changedump: the window is seq in (first_seq, last_seq]
            last_seq INTEGER,
            sha256 TEXT NOT NULL,          -- the ZIP blob
            length INTEGER NOT NULL,
            manifest_sha256 TEXT NOT NULL, -- manifest.xml, also a blob (the rel="contents" copy)
            manifest_length INTEGER NOT NULL,
            at TEXT, completed TEXT,       -- resourcedump
            from_ TEXT, until TEXT,        -- changedump
            entries INTEGER NOT NULL,
            bytes INTEGER NOT NULL,        -- bitstream bytes (uncompressed)
            created TEXT NOT NULL,
            UNIQUE (set_name, kind, window)
        )""",
        "CREATE INDEX IF NOT EXISTS publish_dumps_run ON publish_dumps(run)",
        "CREATE INDEX IF NOT EXISTS publish_dumps_set ON publish_dumps(set_name, kind, id)",
    ),
    (  # 6: the embedded WebSub hub (websub/hub.py). Until this step the hub created them itself, so
        # IF NOT EXISTS: a store that has them keeps its subscriptions and pending work.
        """CREATE TABLE IF NOT EXISTS hub_subscriptions (
        id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: in-flight jobs name rows by id
        topic TEXT NOT NULL,
        callback TEXT NOT NULL,
        secret TEXT,                            -- hub.secret as given (needed to sign); NULL = none
        lease_seconds INTEGER NOT NULL,         -- as granted
        lease_expires TEXT NOT NULL,            -- fixed-width W3C UTC (format_dt)
        created TEXT NOT NULL,
        verified TEXT NOT NULL,                 -- last successful verification (renewals move it)
        UNIQUE (topic, callback)
    )""",
        "CREATE INDEX IF NOT EXISTS hub_subscriptions_expires ON hub_subscriptions(lease_expires)",
        """CREATE TABLE IF NOT EXISTS hub_verifications (
        id INTEGER PRIMARY KEY AUTOINCREMENT,   -- a newer request for the pair replaces the row
        mode TEXT NOT NULL CHECK (mode IN ('subscribe', 'unsubscribe', 'denied')),
        topic TEXT NOT NULL,
        callback TEXT NOT NULL,
        secret TEXT,
        lease_seconds INTEGER,                  -- granted (clamped) lease for subscribe
        reason TEXT,                            -- hub.reason for denied
        requested TEXT NOT NULL,
        UNIQUE (topic, callback)
    )""",
        """CREATE TABLE IF NOT EXISTS hub_payloads (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        topic TEXT NOT NULL,
        body BLOB NOT NULL,
        content_type TEXT NOT NULL,
        link TEXT NOT NULL,                     -- the Link header sent with every delivery of it
        created TEXT NOT NULL
    )""",
        """CREATE TABLE IF NOT EXISTS hub_deliveries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,   -- order of publication per subscription
        subscription_id INTEGER NOT NULL REFERENCES hub_subscriptions(id) ON DELETE CASCADE,
        payload_id INTEGER NOT NULL REFERENCES hub_payloads(id),
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt TEXT NOT NULL,             -- fixed-width W3C UTC
        last_error TEXT
    )""",
        "CREATE INDEX IF NOT EXISTS hub_deliveries_subscription ON hub_deliveries(subscription_id, id)",
        "CREATE INDEX IF NOT EXISTS hub_deliveries_payload ON hub_deliveries(payload_id)",
    ),
    (  # 7: rsagg's own notification channels (websub/notifier.py; IF NOT EXISTS as in 6)
        """CREATE TABLE IF NOT EXISTS notify_channels (
        topic TEXT PRIMARY KEY,
        set_name TEXT NOT NULL,
        kind TEXT NOT NULL,            -- change-notification | framework-notification
        last_seq INTEGER NOT NULL,     -- changelog seq published up to (change channels)
        last_until TEXT,               -- until of the latest payload: the next one's from
        body BLOB,                     -- the latest payload (the topic document)
        snapshot TEXT,                 -- framework channels: JSON {url: [capability, version, index]}
        updated TEXT NOT NULL
    )""",
    ),
    (  # 8: rsagg's subscriptions to upstream channels (websub/subscriber.py; IF NOT EXISTS as in 6)
        """CREATE TABLE IF NOT EXISTS notify_subscriptions (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        token TEXT NOT NULL UNIQUE,        -- callback path segment: BASE/_websub/<token>
        secret TEXT NOT NULL,              -- hub.secret (needed to check signatures)
        source TEXT NOT NULL,
        capabilitylist_url TEXT NOT NULL,
        kind TEXT NOT NULL,                -- change-notification | framework-notification
        topic TEXT NOT NULL,
        hub TEXT NOT NULL,
        wanted INTEGER NOT NULL DEFAULT 1, -- 0: being unsubscribed
        pending TEXT,                      -- subscribe | unsubscribe, awaiting verification
        requested TEXT,
        lease_seconds INTEGER,
        lease_expires TEXT,
        verified TEXT,
        last_until TEXT,                   -- continuity of change notifications
        failures INTEGER NOT NULL DEFAULT 0,
        next_attempt TEXT
    )""",
    ),
    (  # 9: many `rsagg run` nodes on one state (cluster.py): their heartbeats, the source leases, and
        # every grant ever made (the lease history: who held which source when, under which epoch).
        """CREATE TABLE IF NOT EXISTS nodes (
            name TEXT PRIMARY KEY,
            pid INTEGER,
            host TEXT,
            url TEXT,
            started_at TEXT NOT NULL,
            heartbeat_at TEXT NOT NULL,
            expires_at TEXT NOT NULL,   -- alive until then (heartbeat + cluster.lease_seconds)
            stopped_at TEXT
        )""",
        """CREATE TABLE IF NOT EXISTS leases (
            source TEXT PRIMARY KEY,    -- a source name (no FK: the lease comes before its first sync)
            node TEXT,                  -- NULL: free
            epoch INTEGER NOT NULL DEFAULT 0,   -- +1 at every grant: the fence of every write
            granted_at TEXT,
            expires_at TEXT
        )""",
        """CREATE TABLE IF NOT EXISTS lease_history (
            source TEXT NOT NULL,
            epoch INTEGER NOT NULL,
            node TEXT NOT NULL,
            granted_at TEXT NOT NULL,
            ended_at TEXT,              -- NULL while held; an expired grant ends at its expiry
            end_reason TEXT,            -- released | expired | lost
            PRIMARY KEY (source, epoch)
        )""",
    ),
    (  # 10: the shared inbox of upstream notifications (websub/subscriber.py in a cluster): any node's
        # callback records a verified delivery, the node holding the source's lease takes it.
        """CREATE TABLE IF NOT EXISTS notify_inbox (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            source TEXT NOT NULL,
            token TEXT NOT NULL,        -- the subscription's callback token; '' asks for a poll
            digest TEXT NOT NULL,       -- SHA-256 of body: a hub's retry is recorded once
            body BLOB NOT NULL,
            received_at TEXT NOT NULL,
            UNIQUE (token, digest)
        )""",
        "CREATE INDEX IF NOT EXISTS notify_inbox_source ON notify_inbox (source, id)",
    ),
    (  # 11: what each cluster node follows, with its heartbeat (cluster.py): the subscriptions of a source
        # no live node follows are unsubscribed by the node holding the "@orphans" role (websub/).
        "ALTER TABLE nodes ADD COLUMN follows TEXT",  # JSON list of source names; NULL: not said
    ),
    (  # 12: the publish filter and configuration each dump was built under (publish/dumps.py): a run or
        # package of another fingerprint is withdrawn (never served) and built again. NULL: built before
        # this step, under an unknown filter, so withdrawn too.
        "ALTER TABLE publish_dump_runs ADD COLUMN fingerprint TEXT",
        "ALTER TABLE publish_dumps ADD COLUMN fingerprint TEXT",
    ),
    (  # 13: reconciliation with the Resource List (harvest/reconcile.py): the last one per set, and the
        # upstream's validators of each held version (conditional re-checks of resources)
        """CREATE TABLE IF NOT EXISTS reconciliations (
            set_id INTEGER PRIMARY KEY REFERENCES sets(id) ON DELETE CASCADE,
            reconciled_at TEXT NOT NULL,
            cause TEXT NOT NULL,
            lists TEXT NOT NULL,        -- JSON: Resource List URL -> {"etag", "at"} as read then
            differences INTEGER NOT NULL DEFAULT 0,
            repaired TEXT NOT NULL,     -- JSON: change kind -> repairs applied
            unrepaired INTEGER NOT NULL DEFAULT 0,
            complete INTEGER NOT NULL DEFAULT 1,
            error TEXT
        )""",
        """CREATE TABLE IF NOT EXISTS resource_validators (
            set_id INTEGER NOT NULL REFERENCES sets(id) ON DELETE CASCADE,
            uri TEXT NOT NULL,
            sha256 TEXT NOT NULL,       -- the held version these validators were answered with
            etag TEXT,
            last_modified TEXT,         -- the HTTP header as received
            lastmod TEXT,               -- the lastmod announced when the version was last confirmed
            PRIMARY KEY (set_id, uri)
        )""",
    ),
    (  # 14: the versions of one resource (publish/versions.py: TimeGate, TimeMap, mementos, §14.6) are
        # read by resource id; without this index every lookup scanned the changelog.
        "CREATE INDEX IF NOT EXISTS changelog_resource ON changelog(resource_id, seq)",
    ),
]

# New rows get their id from us (max(id) + 1 under the write lock, as SQLite would) so the changelog
# can name them without reading them back; stored rows are updated by primary key (2x faster than an
# INSERT .. ON CONFLICT upsert, measured). Rows are never deleted (tombstones), so ids are never reused;
# a future purge of tombstones must keep that true (e.g. keep the highest row) or use a counter.
_INSERT_RES = (
    f"INSERT INTO resources (id, {', '.join(RES_COLS)}) VALUES ({', '.join('?' * (len(RES_COLS) + 1))})"
)
_UPDATE_RES = (
    "UPDATE resources SET "
    + ", ".join(f"{c} = COALESCE(?, {c})" if c == "generation" else f"{c} = ?" for c in RES_COLS[2:])
    + " WHERE id = ?"
)
#: iter_live_listing: interface.ListingRow's columns, then whether the row has more than those.
_LISTING_COLS = (
    "id, uri, sha256, length, type, encoding, md5, sha1, lastmod, upstream_datetime, updated_at, "
    "(links IS NOT NULL OR md_extra IS NOT NULL OR entry_extra IS NOT NULL)"
)
_INSERT_LOG = (
    "INSERT INTO changelog (set_id, resource_id, uri, change, datetime, sha256, length, type) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)


@contextlib.contextmanager
def immediate_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction: BEGIN IMMEDIATE (take the write lock now, not at the first write, so
    concurrent writers wait in busy_timeout instead of failing on lock upgrade) ... COMMIT, or ROLLBACK
    on any exception. Shared by every module that writes to the state database."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    else:
        conn.execute("COMMIT")
        global _last_commit
        _last_commit = next(_commit_numbers)  # after the commit: a reader seeing it sees the data


#: Numbers the commits of this process (any handle, any thread): ``local_commit_mark()``. ``next()`` of
#: an ``itertools.count`` is atomic under the GIL; each commit stores a number no other commit stores,
#: so the mark differs from any value read before a later commit.
_commit_numbers = itertools.count(1)
_last_commit = 0


def local_commit_mark() -> int:
    """Changes whenever a handle of this process commits a write to a SQLite state: a same-process
    change is seen at once (the publisher's hot cache reads ``PRAGMA data_version`` only when this
    moved or a few milliseconds passed; publish/fastpath.py). Nanoseconds, no lock, no query."""
    return _last_commit


class _Reader:
    """``with state._read() as c``: the connection under the lock (a reused object: no generator per read)."""

    __slots__ = ("conn", "lock")

    def __init__(self, lock: threading.RLock, conn: sqlite3.Connection) -> None:
        self.lock, self.conn = lock, conn

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        return self.conn

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


class State(Notifications, Dumps, Hub, Cluster, SqlState):
    """The SQLite database of one rsagg instance (see the module docstring for the rules)."""

    d = SQLITE

    def __init__(
        self,
        path: Path | str,
        *,
        synchronous: str = "NORMAL",
        busy_timeout: float = 30.0,
        cache_mib: int = 64,
        wal_autocheckpoint: int = 10_000,
        clock: Callable[[], datetime] = utcnow,
        readonly: bool = False,
    ) -> None:
        """Open (creating and migrating) the database at ``path``.

        ``synchronous="NORMAL"`` with WAL: a committed transaction survives a crash of the process
        (kill -9: it is in the WAL file, which the OS keeps); a power loss or kernel crash may lose the
        last transactions since the previous checkpoint/sync, but never corrupts the database. Losing
        the newest transactions is safe for rsagg because their cursor moves with them: the harvester
        just redoes that work (and the blobs they named are still there, or re-fetched). Pass
        ``synchronous="FULL"`` to fsync the WAL at every commit (durable against power loss too).

        ``readonly=True`` opens a reader for the publisher (aggregator/publish/): the database must
        exist at the current schema version (a writer created it), nothing is migrated, and the
        connection refuses writes (``PRAGMA query_only``). WAL lets it read while the harvester writes.
        """
        sync = synchronous.upper()
        if sync not in SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS}, not {synchronous!r}")
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.RLock()
        self._commits = 0  # own committed write transactions (version())
        try:
            conn = sqlite3.connect(str(self.path), timeout=busy_timeout, check_same_thread=False)
        except sqlite3.Error as exc:
            if not is_environmental(exc):
                raise
            raise StateUnavailable(f"state {operator_line(exc, str(self.path))}") from exc
        self.db = Database(conn)
        self.conn = conn
        self._reader = _Reader(self._lock, conn)
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        self.readonly = readonly
        if readonly:
            conn.execute(f"PRAGMA cache_size = {-cache_mib * 1024}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version != len(MIGRATIONS):
                conn.close()
                raise RuntimeError(
                    f"{self.path} has schema version {version}, this rsagg reads {len(MIGRATIONS)} "
                    "(open it once read-write to create or migrate it)"
                )
            conn.execute("PRAGMA query_only = ON")
            return
        with self._unwritable():
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal" and str(self.path) != ":memory:":
                raise RuntimeError(f"could not switch {self.path} to WAL (journal_mode={mode})")
            conn.execute(f"PRAGMA synchronous = {sync}")
            conn.execute("PRAGMA foreign_keys = ON")
            # A batch of 1,000 changes dirties a few MB of pages (random sha256 index positions): a
            # 64 MiB page cache keeps them from spilling, and checkpointing every ~40 MB of WAL instead
            # of 4 MB halves the fsyncs that checkpoints cost (measured: ~2x apply throughput).
            conn.execute(f"PRAGMA cache_size = {-cache_mib * 1024}")
            conn.execute(f"PRAGMA wal_autocheckpoint = {wal_autocheckpoint}")
            self._migrate()

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    def __enter__(self) -> State:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------------------

    @property
    def schema_version(self) -> int:
        with self._lock:
            return self.conn.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self) -> None:
        with self._write(fence=False):
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
            if version > len(MIGRATIONS):
                raise RuntimeError(
                    f"{self.path} has schema version {version}; this rsagg knows up to {len(MIGRATIONS)}"
                )
            for i in range(version, len(MIGRATIONS)):
                for statement in MIGRATIONS[i]:
                    self.conn.execute(statement)
                self.conn.execute(f"PRAGMA user_version = {i + 1}")

    @contextlib.contextmanager
    def _write(self, *, fence: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction: BEGIN IMMEDIATE (take the write lock now, not at the first write,
        so concurrent writers wait in busy_timeout instead of failing on lock upgrade) ... COMMIT.

        Under a fence (``interface.FENCE``) the lease is checked first, inside the transaction: the
        write lock is held from the check to the commit, so no grant can come in between."""
        current = FENCE.get() if fence else None
        with self._lock, self._unwritable():
            with immediate_transaction(self.conn) as conn:
                if current is not None:
                    self._check_fence(conn, current)
                yield conn
            self._commits += 1

    @contextlib.contextmanager
    def _unwritable(self) -> Iterator[None]:
        """The machine's failures (read-only file, full disk, the file gone) as ``StateUnavailable``: one line
        naming this file and the fix (errors.operator_line), which a sync reports and the daemon survives."""
        try:
            yield
        except sqlite3.Error as exc:
            if not is_environmental(exc):
                raise
            raise StateUnavailable(f"state {operator_line(exc, str(self.path))}") from exc

    def check_writable(self) -> None:
        """Write once (the schema version, unchanged): a file rsagg cannot write (read-only, its folder
        not writable) says so now, as ``StateUnavailable`` naming it, rather than in the middle of a sync.
        Opening does not write when there is nothing to migrate, and the commands that only read
        (``status``, ``audit``) must keep working on a read-only copy."""
        with self._write(fence=False) as c:
            c.execute(f"PRAGMA user_version = {len(MIGRATIONS)}")

    def version(self) -> int:
        """Grows whenever anyone commits to the state: ``PRAGMA data_version`` (commits of other
        connections, other processes too) plus this connection's own commits (which data_version does
        not count). A few microseconds, no transaction."""
        with self._lock:
            return self.conn.execute("PRAGMA data_version").fetchone()[0] + self._commits

    def _read(self) -> _Reader:
        return self._reader

    def _check_fence(self, c: sqlite3.Connection, fence: Fence) -> None:
        row = c.execute(
            "SELECT node, epoch, expires_at FROM leases WHERE source = ?", (fence.source,)
        ).fetchone()
        node, epoch, expires = row if row else (None, None, None)
        if node != fence.node or epoch != fence.epoch:
            raise LeaseLost(fence, node, epoch, "another grant is current")
        if expires is None or expires <= format_dt(self._now()):
            raise LeaseLost(fence, node, epoch, f"it expired at {expires}")

    def _log_time(self, c: sqlite3.Connection) -> datetime:
        """rsagg's changelog clock: wall clock, but never before the last record (clock steps back).
        The last record is read inside the write transaction: other processes (cluster nodes) append
        to the same changelog, so this process's memory of it is not enough."""
        now = self._now()
        row = c.execute("SELECT datetime FROM changelog ORDER BY seq DESC LIMIT 1").fetchone()
        last = parse_dt(row[0]) if row else None
        if last is not None and now < last:
            now = last
        return now

    # -- sources ---------------------------------------------------------------------------------

    def upsert_source(self, name: str, url: str) -> None:
        now = format_dt(self._now())
        with self._write() as c:
            c.execute(
                "INSERT INTO sources (name, url, created_at, updated_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET url = excluded.url, updated_at = excluded.updated_at "
                "WHERE url IS NOT excluded.url",
                (name, url, now, now),
            )

    def sources(self) -> list[SourceRow]:
        with self._lock:
            return [source_row(r) for r in self.db.query("SELECT * FROM sources ORDER BY name")]

    def source(self, name: str) -> SourceRow | None:
        with self._lock:
            rows = list(self.db.query("SELECT * FROM sources WHERE name = ?", [name]))
        return source_row(rows[0]) if rows else None

    def set_source_status(self, name: str, **fields: Any) -> None:
        """Update status columns (see SOURCE_STATUS_FIELDS); datetimes may be given as datetime."""
        unknown = set(fields) - SOURCE_STATUS_FIELDS
        if unknown:
            raise ValueError(f"unknown source status field(s): {', '.join(sorted(unknown))}")
        values = {k: format_dt(v) if isinstance(v, datetime) else v for k, v in fields.items()}
        values["updated_at"] = format_dt(self._now())
        sets = ", ".join(f"{k} = ?" for k in values)
        with self._write() as c:
            cur = c.execute(f"UPDATE sources SET {sets} WHERE name = ?", [*values.values(), name])
            if cur.rowcount == 0:
                raise KeyError(f"unknown source {name!r}")

    def put_upstream_notes(self, source: str, deviations: Sequence[dict], skipped: Mapping[str, str]) -> None:
        """Replace what the last sync of ``source`` tolerated (``deviations``: rule, count, url, line,
        message) and skipped (list URL -> reason)."""
        now = format_dt(self._now())
        rows = [("deviation", d["rule"], d["count"], d.get("url"), d.get("line"), d.get("message"), now)
                for d in deviations]  # fmt: skip
        rows += [("skipped", url, 1, url, None, why, now) for url, why in skipped.items()]
        with self._write() as c:
            c.execute("DELETE FROM upstream_notes WHERE source = ?", (source,))
            c.executemany(
                "INSERT INTO upstream_notes (source, kind, rule, count, url, line, message, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(source, *r) for r in rows],
            )

    def upstream_notes(self, source: str) -> dict[str, list[dict]]:
        """{"deviations": [{rule, count, url, line, message}], "skipped": [{url, reason}]} of a source."""
        with self._lock:
            rows = self.conn.execute(
                "SELECT kind, rule, count, url, line, message FROM upstream_notes WHERE source = ? "
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
        with self._lock:
            rows = list(self.db.query("SELECT * FROM documents WHERE url = ?", [url]))
        if not rows:
            return None
        return DocumentRow(**{**rows[0], "fetched_at": parse_dt(rows[0]["fetched_at"])})

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
                "INSERT OR REPLACE INTO documents (url, source, capability, etag, last_modified, sha256, "
                "fetched_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (url, source, capability, etag, last_modified, sha256, format_dt(self._now())),
            )

    # -- sets and cursors ------------------------------------------------------------------------

    def ensure_set(self, source: str, capabilitylist_url: str, *, name: str | None = None) -> int:
        """The set of one upstream Capability List, created on first sight.

        Its ``name`` (used in republished paths) is ``name`` if given, else the source name for the
        first set of a source and ``<source>-2``, ``<source>-3``... after it; it never changes.
        """
        with self._write() as c:
            row = c.execute(
                "SELECT id FROM sets WHERE source = ? AND capabilitylist_url = ?",
                (source, capabilitylist_url),
            ).fetchone()
            if row:
                return row[0]
            base = name or source
            candidate, n = base, 1
            while c.execute("SELECT 1 FROM sets WHERE name = ?", (candidate,)).fetchone():
                n += 1
                candidate = f"{base}-{n}"
            cur = c.execute(
                "INSERT INTO sets (source, capabilitylist_url, name, created_at) VALUES (?, ?, ?, ?)",
                (source, capabilitylist_url, candidate, format_dt(self._now())),
            )
            return cur.lastrowid

    def sets(self, source: str | None = None) -> list[SetRow]:
        """The sets (of one source), by id."""
        sql = "SELECT id, source, capabilitylist_url, name, generation, baseline_generation FROM sets"
        with self._lock:
            if source is None:
                return [SetRow(**r) for r in self.db.query(sql + " ORDER BY id")]
            return [SetRow(**r) for r in self.db.query(sql + " WHERE source = ? ORDER BY id", [source])]

    def cursor(self, set_id: int) -> Cursor | None:
        with self._lock:
            row = self.conn.execute(
                "SELECT baseline_at, changelist_url, last_datetime, same_datetime_count, list_index, "
                "list_until FROM cursors WHERE set_id = ?",
                (set_id,),
            ).fetchone()
        if row is None:
            return None
        return Cursor(parse_dt(row[0]), row[1], parse_dt(row[2]), row[3], row[4], parse_dt(row[5]))

    def _put_cursor(self, c: sqlite3.Connection, set_id: int, cursor: Cursor, now: str) -> None:
        c.execute(
            "INSERT OR REPLACE INTO cursors (set_id, baseline_at, changelist_url, last_datetime, "
            "same_datetime_count, list_index, list_until, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (set_id, format_dt(cursor.baseline_at), cursor.changelist_url, format_dt(cursor.last_datetime),
             cursor.same_datetime_count, cursor.list_index, format_dt(cursor.list_until), now),
        )  # fmt: skip

    # -- the change pipeline ---------------------------------------------------------------------

    def apply(
        self,
        set_id: int,
        changes: Sequence[Change],
        cursor: Cursor | None = None,
        retries: RetryChanges | None = None,
    ) -> list[Change]:
        """Apply a batch of changes and move the cursor, in ONE transaction (invariants 1 and 2).

        Per change, against the row as it stands (including earlier changes of the same batch):
        created/updated with the stored live row's sha256 -> no-op (not logged; during a baseline the
        row is still marked seen in the change's generation); no live row -> logged "created" (whatever
        upstream called it); a different sha256 -> "updated"; deleted on a live row -> tombstone (the
        row keeps its last content columns) + "deleted"; deleted on a missing or deleted row -> no-op.
        A no-op is a true no-op: lastmod/links of the stored row are not refreshed, since the changelog
        must account for every change of what we republish.

        ``retries`` (failed changes to keep, URIs whose retry ends) is written in the same transaction,
        after the changes and the cursor.

        Returns the changes that changed state, each with ``change`` set to the logged kind.
        """
        for ch in changes:
            if ch.change not in CHANGES:
                raise ValueError(f"{ch.uri}: unknown change {ch.change!r}")
            if ch.sha256 is not None:
                check_sha(ch.sha256)
        with self._write() as c:
            row = c.execute("SELECT baseline_generation FROM sets WHERE id = ?", (set_id,)).fetchone()
            if row is None:
                raise KeyError(f"unknown set {set_id}")
            open_generation = row[0]
            log_time = self._log_time(c)
            now = format_dt(log_time)
            applied = self._apply(c, set_id, changes, open_generation, now)
            if cursor is not None:
                self._put_cursor(c, set_id, cursor, now)
            if retries is not None:  # bookkeeping that must commit with the changes
                self._put_retries(c, now, set_id, retries)
        return applied

    def _apply(
        self,
        c: sqlite3.Connection,
        set_id: int,
        changes: Sequence[Change],
        open_generation: int | None,
        now: str,
    ) -> list[Change]:
        # 1. What is stored now, for every uri of the batch (one query; json_each avoids variable limits).
        uris = list(dict.fromkeys(ch.uri for ch in changes))
        current: dict[str, list] = {}  # uri -> [id, sha256, live, stored] (the _C_* positions)
        if uris:
            for rid, uri, sha, deleted in c.execute(
                "SELECT id, uri, sha256, deleted FROM resources "
                "WHERE set_id = ? AND uri IN (SELECT value FROM json_each(?))",
                (set_id, json.dumps(uris)),
            ):
                current[uri] = [rid, sha, not deleted, True]
        top: list[int] = []  # max(id), read once a new row needs an id

        def new_id() -> int:
            if not top:
                top.append(c.execute("SELECT coalesce(max(id), 0) FROM resources").fetchone()[0])
            top[0] += 1
            return top[0]

        # 2. Decide, change by change (plan_batch: the rules, shared by every backend).
        rows, tombstones, seen, log, applied = plan_batch(
            set_id, changes, current, open_generation, now, new_id, format_dt
        )
        # 3. Write: no-op marks, tombstones, new rows, changed rows, then the log.
        if seen:
            c.executemany(
                "UPDATE resources SET generation = ? WHERE id = ?", [(g, i) for i, g in seen.items()]
            )
        if tombstones:
            c.executemany(
                "UPDATE resources SET deleted = 1, generation = COALESCE(?, generation), "
                "upstream_datetime = COALESCE(?, upstream_datetime), updated_at = ? WHERE id = ?",
                [(g, up, now, rid) for rid, (g, up) in tombstones.items()],
            )
        if rows:
            new, old = [], []
            for uri, row in rows.items():
                if current[uri][C_STORED]:
                    old.append(row[W_SHA256:])  # _UPDATE_RES: the columns after uri, then the id
                else:
                    new.append((row[W_ID], *row[:W_ID]))
            if new:
                c.executemany(_INSERT_RES, new)
            if old:
                c.executemany(_UPDATE_RES, old)
        if log:
            c.executemany(_INSERT_LOG, log)
        return applied

    # -- baselines -------------------------------------------------------------------------------

    def begin_baseline(self, set_id: int) -> int:
        """Start a baseline of a set: a new generation number for the rows it sees.

        An unfinished earlier baseline is abandoned (its generation is simply never finished).
        Changes applied while a baseline is open mark their rows with it even without a
        ``generation``, so rows created by a concurrent incremental change are not swept.
        """
        with self._write() as c:
            row = c.execute(
                "UPDATE sets SET generation = generation + 1, baseline_generation = generation + 1 "
                "WHERE id = ? RETURNING generation",
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
        """Tombstone (and log "deleted") every live row of the set not seen in ``generation``, store
        the cursor and close the baseline, in one transaction (``retries`` too, as in ``apply``).
        Returns the deletions."""
        with self._write() as c:
            row = c.execute("SELECT baseline_generation FROM sets WHERE id = ?", (set_id,)).fetchone()
            if row is None:
                raise KeyError(f"unknown set {set_id}")
            if row[0] != generation:
                raise ValueError(f"set {set_id}: baseline {generation} is not the open one ({row[0]})")
            gone = c.execute(
                "SELECT id, uri FROM resources WHERE set_id = ? AND deleted = 0 "
                "AND (generation IS NULL OR generation < ?) ORDER BY id",
                (set_id, generation),
            ).fetchall()
            if (
                gone
                and not c.execute(
                    "SELECT 1 FROM resources WHERE set_id = ? AND generation = ? LIMIT 1",
                    (set_id, generation),
                ).fetchone()
            ):
                raise EmptySnapshot(f"it saw no resource, {len(gone)} held: none deleted")
            log_time = self._log_time(c)
            now = format_dt(log_time)
            if gone:
                c.executemany(
                    "UPDATE resources SET deleted = 1, generation = ?, updated_at = ? WHERE id = ?",
                    [(generation, now, rid) for rid, _ in gone],
                )
                c.executemany(
                    _INSERT_LOG, [(set_id, rid, uri, DELETED, now, None, None, None) for rid, uri in gone]
                )
            self._put_cursor(c, set_id, cursor, now)
            c.execute("UPDATE sets SET baseline_generation = NULL WHERE id = ?", (set_id,))
            if retries is not None:
                self._put_retries(c, now, set_id, retries)
        return [Change(uri, DELETED, generation=generation) for _, uri in gone]

    # -- retries ---------------------------------------------------------------------------------
    # Changes whose fetch failed (a hash mismatch, a 5xx that outlasted retries), kept to be tried again:
    # the cursor of incremental sync moves past a failed change (the stream must go on), so without them
    # the resource would stay stale until it changed upstream again. Each is kept with its entry (a
    # one-entry ResourceSync document, written and read back by rs/; table ``retries``, migration 2),
    # retried through the one pipeline at the start of the set's next sync, and dropped when a change of
    # the same URI applies. A retry also ends when the upstream no longer lists its URI: the row stays,
    # kind RETRY_ENDED with the reason, for ``rsagg status``/``rsagg retries``, until ``--clear``; an
    # ended retry is not tried again, and a new change of its URI replaces it like any other.

    def _put_retries(self, c: sqlite3.Connection, now: str, set_id: int, retries: RetryChanges) -> None:
        """Inside the transaction that applies a batch: a crash can neither leave a retry of a change
        already superseded nor lose a failure the cursor has moved past."""
        from ..rs.write import iter_document_bytes  # lxml: not at start-up (``rsagg status``, ``retries``)

        rows = [
            (set_id, f.entry.loc, f.change, b"".join(iter_document_bytes(Head(), [f.entry])), f.kind,
             f.message, now, now)
            for f in retries.failed
        ]  # fmt: skip
        c.executemany(
            "INSERT INTO retries (set_id, uri, change, entry, kind, message, first_at, last_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (set_id, uri) DO UPDATE SET "
            "change = excluded.change, entry = excluded.entry, kind = excluded.kind, "
            "message = excluded.message, attempts = attempts + 1, last_at = excluded.last_at",
            rows,
        )
        c.executemany(
            "DELETE FROM retries WHERE set_id = ? AND uri = ?", [(set_id, u) for u in retries.cleared]
        )

    def pending_retries(self, set_id: int) -> list[tuple[Entry, str, int]]:
        """(entry, change, attempts) of every failed change of a set still to be tried, oldest first."""
        with self._lock:
            rows = self.conn.execute(
                "SELECT entry, change, attempts FROM retries WHERE set_id = ? AND kind != ? "
                "ORDER BY first_at",
                (set_id, RETRY_ENDED),
            ).fetchall()
        from ..rs.parse import parse_bytes  # lxml: not at start-up (``rsagg status``, ``retries``)

        out = []
        for data, change, attempts in rows:
            _, entries = parse_bytes(bytes(data))
            out.extend((e, change, attempts) for e in entries)
        return out

    def retry_uris(self, set_id: int) -> set[str]:
        """Every URI of a set with a retry row, ended ones included."""
        with self._lock:
            rows = self.conn.execute("SELECT uri FROM retries WHERE set_id = ?", (set_id,)).fetchall()
        return {r[0] for r in rows}

    def end_retries(self, set_id: int, ended: Iterable[str], reason: str) -> None:
        """Mark retries as ended (no longer listed upstream): kept to be seen, not tried; ``reason``
        first, the last failure kept after it."""
        now = format_dt(self._now())
        with self._write() as conn:
            conn.executemany(
                "UPDATE retries SET message = ? || ' (last failure: ' || kind || ': ' || message || ')', "
                "kind = ?, last_at = ? WHERE set_id = ? AND uri = ? AND kind != ?",
                [(reason, RETRY_ENDED, now, set_id, uri, RETRY_ENDED) for uri in ended],
            )

    def retry_rows(self, sources: Iterable[str] = ()) -> list[dict]:
        """Every retry (waiting or ended) with its source and set, for ``rsagg retries`` (JSON-ready)."""
        wanted = list(sources)
        sql = (
            "SELECT s.source, s.name AS set_name, r.uri, r.change, r.kind, r.message, r.attempts, "
            "r.first_at, r.last_at FROM retries r JOIN sets s ON s.id = r.set_id"
        )
        if wanted:
            sql += f" WHERE s.source IN ({', '.join('?' * len(wanted))})"
        with self._lock:
            cur = self.conn.execute(sql + " ORDER BY s.source, r.first_at", wanted)
            names = [d[0] for d in cur.description]
            rows = cur.fetchall()
        return [
            {**dict(zip(names, r, strict=True)), "state": "ended" if r[4] == RETRY_ENDED else "waiting"}
            for r in rows
        ]

    def clear_retries(self, sources: Iterable[str] = (), *, ended_only: bool = False) -> int:
        """Forget retries (of some sources; only ended ones): the operator gives up. Returns how many."""
        wanted = list(sources)
        where, params = [], []
        if wanted:
            where.append(f"set_id IN (SELECT id FROM sets WHERE source IN ({', '.join('?' * len(wanted))}))")
            params += wanted
        if ended_only:
            where.append("kind = ?")
            params.append(RETRY_ENDED)
        sql = "DELETE FROM retries" + (" WHERE " + " AND ".join(where) if where else "")
        with self._write() as conn:
            return conn.execute(sql, params).rowcount

    def retries_by_source(self) -> dict[str, dict[str, int]]:
        """Source -> {"waiting": n, "ended": m}, for the status displays."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            rows = self.conn.execute(
                "SELECT s.source, r.kind = ?, count(*) FROM retries r JOIN sets s ON s.id = r.set_id "
                "GROUP BY s.source, r.kind = ?",
                (RETRY_ENDED, RETRY_ENDED),
            ).fetchall()
        for source, kind, n in rows:
            counts = out.setdefault(source, {"waiting": 0, "ended": 0})
            counts["ended" if kind else "waiting"] += n
        return out

    # -- reads -----------------------------------------------------------------------------------

    # -- reconciliation ----------------------------------------------------------------------------

    def reconciliation(self, set_id: int) -> Reconciliation | None:
        with self._lock:
            row = self.conn.execute(
                "SELECT set_id, reconciled_at, cause, lists, differences, repaired, unrepaired, complete, "
                "error FROM reconciliations WHERE set_id = ?",
                (set_id,),
            ).fetchone()
        if row is None:
            return None
        sid, at, cause, lists, differences, repaired, unrepaired, complete, error = row
        return Reconciliation(sid, parse_dt(at), cause, json.loads(lists), differences,  # type: ignore[arg-type]
                              json.loads(repaired), unrepaired, bool(complete), error)  # fmt: skip

    def put_reconciliation(self, rec: Reconciliation) -> None:
        with self._write() as c:
            c.execute(
                "INSERT OR REPLACE INTO reconciliations (set_id, reconciled_at, cause, lists, differences, "
                "repaired, unrepaired, complete, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (rec.set_id, format_dt(rec.reconciled_at), rec.cause, json.dumps(rec.lists), rec.differences,
                 json.dumps(rec.repaired), rec.unrepaired, int(rec.complete), rec.error),
            )  # fmt: skip

    def resource_validators(self, set_id: int, uris: Sequence[str]) -> dict[str, ResourceValidators]:
        out: dict[str, ResourceValidators] = {}
        wanted = list(dict.fromkeys(uris))
        with self._lock:
            for i in range(0, len(wanted), 500):
                part = wanted[i : i + 500]
                rows = self.conn.execute(
                    "SELECT uri, sha256, etag, last_modified, lastmod FROM resource_validators "
                    f"WHERE set_id = ? AND uri IN ({', '.join('?' * len(part))})",
                    [set_id, *part],
                ).fetchall()
                out.update((r[0], ResourceValidators(*r[:4], parse_dt(r[4]))) for r in rows)
        return out

    def put_resource_validators(self, set_id: int, rows: Sequence[ResourceValidators]) -> None:
        if not rows:
            return
        with self._write() as c:
            c.executemany(
                "INSERT OR REPLACE INTO resource_validators (set_id, uri, sha256, etag, last_modified, "
                "lastmod) VALUES (?, ?, ?, ?, ?, ?)",
                [(set_id, r.uri, r.sha256, r.etag, r.last_modified, format_dt(r.lastmod)) for r in rows],
            )

    def resource(self, set_id: int, uri: str) -> Resource | None:
        with self._lock:
            row = self.conn.execute(SELECT_RES + " WHERE set_id = ? AND uri = ?", (set_id, uri)).fetchone()
        return resource_row(row) if row else None

    def resources(self, set_id: int, uris: Sequence[str]) -> dict[str, Resource]:
        """The stored rows of those of ``uris`` the set holds (one query; json_each: no variable limit)."""
        if not uris:
            return {}
        with self._lock:
            rows = self.conn.execute(
                SELECT_RES + " WHERE set_id = ? AND uri IN (SELECT value FROM json_each(?))",
                (set_id, json.dumps(list(uris))),
            ).fetchall()
        return {r[R_URI]: resource_row(r) for r in rows}

    def iter_resources(
        self,
        set_id: int | None = None,
        *,
        include_deleted: bool = False,
        after_id: int = 0,
        limit: int | None = None,
    ) -> Iterator[Resource]:
        """Resources by id (stable keyset paging: pass the last id seen as ``after_id``)."""
        where, params = [], []
        if set_id is not None:
            where.append("set_id = ?")
            params.append(set_id)
        if not include_deleted:
            where.append("deleted = 0")
        where.append("id > ?")
        sql = f"{SELECT_RES} WHERE {' AND '.join(where)} ORDER BY id LIMIT ?"
        for row in self._pages(sql, params, 0, after_id, limit):
            yield resource_row(row)

    def count_resources(
        self, set_id: int | None = None, *, source: str | None = None, include_deleted: bool = False
    ) -> int:
        """Live resources held (of a set, of a source, or all); tombstones too with include_deleted."""
        where, params = [], []
        if set_id is not None:
            where.append("set_id = ?")
            params.append(set_id)
        if source is not None:
            where.append("set_id IN (SELECT id FROM sets WHERE source = ?)")
            params.append(source)
        if not include_deleted:
            where.append("deleted = 0")
        sql = "SELECT count(*) FROM resources" + (f" WHERE {' AND '.join(where)}" if where else "")
        with self._lock:
            return self.conn.execute(sql, params).fetchone()[0]

    def iter_changelog(
        self, after_seq: int = 0, *, set_id: int | None = None, limit: int | None = None
    ) -> Iterator[LogRecord]:
        """Changelog records in seq order (== datetime order), after ``after_seq``."""
        cols = ", ".join(LOG_COLS)
        if set_id is None:
            sql, params = f"SELECT {cols} FROM changelog WHERE seq > ? ORDER BY seq LIMIT ?", []
        else:
            sql = f"SELECT {cols} FROM changelog WHERE set_id = ? AND seq > ? ORDER BY seq LIMIT ?"
            params = [set_id]
        for r in self._pages(sql, params, 0, after_seq, limit):
            yield LogRecord(r[0], r[1], r[2], r[3], r[4], parse_dt(r[5]), r[6], r[7], r[8])

    def last_seq(self) -> int:
        """The highest changelog seq (0 when empty): where a reader starting now would begin."""
        with self._lock:
            return self.conn.execute("SELECT coalesce(max(seq), 0) FROM changelog").fetchone()[0]

    # -- reads for publishing (aggregator/publish/) ------------------------------------------------
    # A published set is a list of state sets (config [[sets]] grouping). Queries run per state set
    # on the indexes of migration 1 (resources_live, the (set_id, uri) key, changelog_set_seq) and are
    # merged by id / seq in Python, so a small set in a big database never scans other sets' rows.

    def history_start(self, set_ids: Sequence[int]) -> datetime | None:
        """The earliest time the sets' change history covers: their creation, or their first changelog
        record if the clock stepped back since (the ``from`` of their first Change List, §12.1)."""
        if not set_ids:
            return None
        times: list[datetime] = []
        with self._lock:
            for sid in set_ids:
                row = self.conn.execute("SELECT created_at FROM sets WHERE id = ?", (sid,)).fetchone()
                if row:
                    times.append(parse_dt(row[0]))
                row = self.conn.execute(
                    "SELECT datetime FROM changelog WHERE set_id = ? ORDER BY seq LIMIT 1", (sid,)
                ).fetchone()
                if row:
                    times.append(parse_dt(row[0]))
        return min(times) if times else None

    def count_live(self, set_ids: Sequence[int]) -> int:
        """Live resources of the sets (decides Resource List vs Resource List Index, §10.2)."""
        with self._lock:
            return sum(
                self.conn.execute(
                    "SELECT count(*) FROM resources WHERE set_id = ? AND deleted = 0", (sid,)
                ).fetchone()[0]
                for sid in set_ids
            )

    def live_part_boundaries(self, set_ids: Sequence[int], size: int) -> list[int]:
        """The id of every ``size``-th live resource of the sets in id order.

        Part k of a Resource List Index then holds the live resources with ``b[k-1] < id <= b[k]``
        (b[0] = 0), at most ``size`` each (§7: 50,000 per document, §10.2). One pass in SQLite.
        """
        return list(self.iter_live_part_boundaries(set_ids, size))

    def live_more_than(self, set_ids: Sequence[int], n: int) -> bool:
        """True when the sets hold more than ``n`` live resources: reads at most n+1 index entries (a
        Resource List Index's head is written before its parts are counted out)."""
        left = n + 1
        with self._lock:
            for sid in dict.fromkeys(set_ids):
                left -= self.conn.execute(
                    "SELECT count(*) FROM (SELECT 1 FROM resources WHERE set_id = ? AND deleted = 0 LIMIT ?)",
                    (sid, left),
                ).fetchone()[0]
                if left <= 0:
                    return True
        return False

    def iter_live_part_boundaries(self, set_ids: Sequence[int], size: int) -> Iterator[int]:
        """``live_part_boundaries``, yielded as SQLite finds them (one pass, not held). The caller holds
        the connection for itself until the iterator is done (a publisher's pooled reader)."""
        if size < 1:
            raise ValueError("size must be at least 1")
        if not set_ids:
            return
        sql = (
            "SELECT id FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM resources "
            "WHERE set_id IN (SELECT value FROM json_each(?)) AND deleted = 0) WHERE n % ? = 0 ORDER BY id"
        )
        cur = self.conn.execute(sql, (json.dumps(list(set_ids)), size))
        try:
            while True:
                with self._lock:
                    rows = cur.fetchmany(64)
                if not rows:
                    return
                for (b,) in rows:
                    yield b
        finally:
            cur.close()

    def live_part_boundary(self, set_id: int, after_id: int, size: int) -> int | None:
        """The id of the ``size``-th live resource of one set after ``after_id`` (None: fewer follow):
        ``iter_live_part_boundaries`` one part at a time, an index walk of ``size`` entries (10x faster
        than numbering every row)."""
        if size < 1:
            raise ValueError("size must be at least 1")
        with self._lock:
            row = self.conn.execute(
                "SELECT id FROM resources WHERE set_id = ? AND deleted = 0 AND id > ? "
                "ORDER BY id LIMIT 1 OFFSET ?",
                (set_id, after_id, size - 1),
            ).fetchone()
        return None if row is None else row[0]

    def live_after(self, set_ids: Sequence[int], after_id: int) -> bool:
        """Whether the sets hold a live resource with ``id > after_id`` (an index seek per set)."""
        with self._lock:
            return any(
                self.conn.execute(
                    "SELECT 1 FROM resources WHERE set_id = ? AND deleted = 0 AND id > ? LIMIT 1",
                    (sid, after_id),
                ).fetchone()
                for sid in dict.fromkeys(set_ids)
            )

    def rows_version(
        self, set_ids: Sequence[int], after_id: int = 0, until_id: int | None = None
    ) -> tuple[int, datetime | None]:
        """What changes whenever a row of the sets with ``after_id < id <= until_id`` changes (created,
        updated, deleted): their count and newest ``updated_at``. A Resource List part renders the same
        while these stay (one range scan of the rows)."""
        top = MAX_INT if until_id is None else until_id
        count, newest = 0, ""
        with self._lock:
            for sid in dict.fromkeys(set_ids):
                n, m = self.conn.execute(
                    "SELECT count(*), max(updated_at) FROM resources WHERE set_id = ? AND id > ? AND id <= ?",
                    (sid, after_id, top),
                ).fetchone()
                count += n
                newest = max(newest, m or "")
        return count, parse_dt(newest) if newest else None

    def set_last_seq(self, set_ids: Sequence[int]) -> int:
        """The sets' newest changelog seq (0: none): every change of their rows is logged, so lists
        built from them render the same while it stays."""
        with self._lock:
            return max(
                (
                    self.conn.execute(
                        "SELECT coalesce(max(seq), 0) FROM changelog WHERE set_id = ?", (sid,)
                    ).fetchone()[0]
                    for sid in dict.fromkeys(set_ids)
                ),
                default=0,
            )

    def iter_live(
        self, set_ids: Sequence[int], *, after_id: int = 0, until_id: int | None = None
    ) -> Iterator[Resource]:
        """Live resources of the sets with ``after_id < id <= until_id`` (no upper bound when None), by id."""
        top = MAX_INT if until_id is None else until_id
        sql = f"{SELECT_RES} WHERE set_id = ? AND deleted = 0 AND id <= ? AND id > ? ORDER BY id LIMIT ?"
        iters = [self._pages(sql, [sid, top], 0, after_id, None) for sid in dict.fromkeys(set_ids)]
        rows = iters[0] if len(iters) == 1 else heapq.merge(*iters, key=lambda r: r[0])
        for row in rows:
            yield resource_row(row)

    def iter_live_listing(
        self, set_ids: Sequence[int], *, after_id: int = 0, until_id: int | None = None
    ) -> Iterator[ListingRow | Resource]:
        """``iter_live`` for list writers (``interface.ListingRow``): the columns a plain entry needs
        and, per row, whether it has more; the rows that do are read whole, a page at a time."""
        top = MAX_INT if until_id is None else until_id
        sql = f"SELECT {_LISTING_COLS} FROM resources "
        sql += "WHERE set_id = ? AND deleted = 0 AND id <= ? AND id > ? ORDER BY id LIMIT ?"
        iters = [self._listing_pages(sql, sid, top, after_id) for sid in dict.fromkeys(set_ids)]
        if len(iters) == 1:
            yield from iters[0]
        else:
            yield from heapq.merge(*iters, key=lambda r: r[0] if type(r) is tuple else r.id)

    def _listing_pages(self, sql: str, set_id: int, top: int, after: int) -> Iterator[ListingRow | Resource]:
        while True:
            with self._lock:
                rows = self.conn.execute(sql, (set_id, top, after, codec.PAGE_SIZE)).fetchall()
                rich = [r[0] for r in rows if r[-1]]
                if rich:
                    marks = ", ".join("?" * len(rich))
                    full = self.conn.execute(f"{SELECT_RES} WHERE id IN ({marks})", rich).fetchall()
                    whole = {r[0]: resource_row(r) for r in full}
            if rich:
                for r in rows:
                    yield whole[r[0]] if r[-1] else r[:-1]
            else:
                for r in rows:
                    yield r[:-1]
            if len(rows) < codec.PAGE_SIZE:
                return
            after = rows[-1][0]

    def resource_in(self, set_ids: Sequence[int], uri: str) -> Resource | None:
        """The resource ``uri`` held in any of the sets: a live row if there is one (the most recently
        changed when several sets hold it), else the most recent tombstone; None when never held."""
        best: Resource | None = None
        for sid in dict.fromkeys(set_ids):
            r = self.resource(sid, uri)
            if r is None:
                continue
            if best is None or (not r.deleted, r.updated_at) > (not best.deleted, best.updated_at):
                best = r
        return best

    def live_set_of(self, set_ids: Sequence[int], uri: str) -> int | None:
        """The first of the sets (in the order given) that holds ``uri`` live, else None: a cheap
        "do we hold it?" for rewriting links to our copy (§14.5)."""
        with self._lock:
            for sid in dict.fromkeys(set_ids):
                row = self.conn.execute(
                    "SELECT 1 FROM resources WHERE set_id = ? AND uri = ? AND deleted = 0", (sid, uri)
                ).fetchone()
                if row:
                    return sid
        return None

    def iter_log_range(
        self, set_ids: Sequence[int], after_seq: int = 0, until_seq: int | None = None
    ) -> Iterator[tuple[LogRecord, Resource | None]]:
        """Changelog records of the sets with ``after_seq < seq <= until_seq``, in seq order, each with
        the resource row it names as that row is now (None if gone): the row holds what the record
        does not (md5, links, upstream lastmod), valid for the record when their sha256 agree."""
        top = MAX_INT if until_seq is None else until_seq
        cols = ", ".join(f"c.{c}" for c in LOG_COLS)
        res_cols = "r.id, " + ", ".join(f"r.{c}" for c in RES_COLS)
        sql = (
            f"SELECT {cols}, {res_cols} FROM changelog c LEFT JOIN resources r ON r.id = c.resource_id "
            "WHERE c.set_id = ? AND c.seq <= ? AND c.seq > ? ORDER BY c.seq LIMIT ?"
        )
        iters = [self._pages(sql, [sid, top], 0, after_seq, None) for sid in dict.fromkeys(set_ids)]
        if not iters:
            return
        rows = iters[0] if len(iters) == 1 else heapq.merge(*iters, key=lambda r: r[0])
        n = len(LOG_COLS)
        for r in rows:
            rec = LogRecord(r[0], r[1], r[2], r[3], r[4], parse_dt(r[5]), r[6], r[7], r[8])
            yield rec, (resource_row(r[n:]) if r[n] is not None else None)

    def log_windows(self, set_ids: Sequence[int], size: int) -> list[int]:
        """Numbers k of the windows ``((k-1)*size, k*size]`` of the global changelog seq that hold at
        least one record of the sets, ascending. One index seek per set and window found."""
        if size < 1:
            raise ValueError("size must be at least 1")
        out: list[int] = []
        after = 0
        ids = list(dict.fromkeys(set_ids))
        while True:
            nxt = None
            with self._lock:
                for sid in ids:
                    row = self.conn.execute(
                        "SELECT seq FROM changelog WHERE set_id = ? AND seq > ? ORDER BY seq LIMIT 1",
                        (sid, after),
                    ).fetchone()
                    if row and (nxt is None or row[0] < nxt):
                        nxt = row[0]
            if nxt is None:
                return out
            k = (nxt - 1) // size + 1
            out.append(k)
            after = k * size

    def log_datetime(self, seq: int) -> datetime | None:
        """The datetime of the last changelog record with seq <= ``seq`` (None when there is none): the
        ``until`` of a closed Change List window ending at ``seq`` (§12.1)."""
        with self._lock:
            row = self.conn.execute(
                "SELECT datetime FROM changelog WHERE seq <= ? ORDER BY seq DESC LIMIT 1", (seq,)
            ).fetchone()
        return parse_dt(row[0]) if row else None

    # -- versions of one resource (publish/versions.py; §14.6, RFC 7089) ----------------------------

    def log_record(self, seq: int) -> LogRecord | None:
        """The changelog record ``seq`` (None when there is none): a memento names its version by it."""
        if not 0 <= seq <= MAX_INT:
            return None
        cols = ", ".join(LOG_COLS)
        with self._lock:
            r = self.conn.execute(f"SELECT {cols} FROM changelog WHERE seq = ?", (seq,)).fetchone()
        return LogRecord(r[0], r[1], r[2], r[3], r[4], parse_dt(r[5]), r[6], r[7], r[8]) if r else None

    def iter_versions(
        self, resource_id: int, after_seq: int = 0, limit: int | None = None
    ) -> Iterator[LogRecord]:
        """The changelog records of one resource row (deletions too), ascending seq, after ``after_seq``."""
        cols = ", ".join(LOG_COLS)
        sql = f"SELECT {cols} FROM changelog WHERE resource_id = ? AND seq > ? ORDER BY seq LIMIT ?"
        for r in self._pages(sql, [resource_id], 0, after_seq, limit):
            yield LogRecord(r[0], r[1], r[2], r[3], r[4], parse_dt(r[5]), r[6], r[7], r[8])

    def count_versions(self, resource_id: int, after_seq: int = 0, limit: int | None = None) -> int:
        """How many versions (records that are not deletions) the row has after ``after_seq``, counted up
        to ``limit`` (the retention check needs no more than N)."""
        top = MAX_INT if limit is None else limit
        with self._lock:
            return self.conn.execute(
                "SELECT count(*) FROM (SELECT 1 FROM changelog WHERE resource_id = ? AND seq > ? "
                "AND change != 'deleted' LIMIT ?)",
                (resource_id, after_seq, top),
            ).fetchone()[0]

    def version_at(self, resource_id: int, when: datetime) -> LogRecord | None:
        """The version current at ``when`` (the last record that is not a deletion at or before it), else
        the first version: the best memento for a TimeGate (RFC 7089 §4.1); None: no version at all."""
        cols = ", ".join(LOG_COLS)
        with self._lock:
            # The changelog's datetime never decreases with seq (``_log_time``): the last seq at or
            # before ``when`` (index changelog_datetime) bounds the row's records (changelog_resource):
            # two index seeks, whatever the length of the history.
            top = self.conn.execute(
                "SELECT seq FROM changelog WHERE datetime <= ? ORDER BY datetime DESC, seq DESC LIMIT 1",
                (format_dt(when),),
            ).fetchone()
            r = None
            if top is not None:
                r = self.conn.execute(
                    f"SELECT {cols} FROM changelog WHERE resource_id = ? AND seq <= ? "
                    "AND change != 'deleted' ORDER BY seq DESC LIMIT 1",
                    (resource_id, top[0]),
                ).fetchone()
            if r is None:
                r = self.conn.execute(
                    f"SELECT {cols} FROM changelog WHERE resource_id = ? AND change != 'deleted' "
                    "ORDER BY seq LIMIT 1",
                    (resource_id,),
                ).fetchone()
        return LogRecord(r[0], r[1], r[2], r[3], r[4], parse_dt(r[5]), r[6], r[7], r[8]) if r else None

    def referenced_hashes(self, retention: Retention | None = None) -> Iterator[str]:
        """Every sha256 gc must keep, each once, in ascending order, as of one instant.

        That is the blobs of live resources, of every changelog record (rsagg's Change Dumps are
        built from the changelog and need the content of past versions; pruning the changelog is what
        lets old versions go) and of cached capability documents (the body answering a 304).
        ``retention`` (``[publish] versions``): only the changelog records it retains count, and every
        record after ``retention.floor_seq`` (not in a Change Dump yet); None: every record.
        Ascending order lets gc merge this with ``FileBlobStore.iter_hashes`` without holding a set.

        No index on sha256 serves this (random-order index pages made every commit ~3x slower): the
        snapshot is sorted once into a TEMP table (temp file, not the WAL) and read back in pages.
        """
        table = f"temp.refs_{secrets.token_hex(8)}"
        with self._lock:
            self.conn.execute(
                f"CREATE TABLE {table} AS "
                "SELECT sha256 FROM resources WHERE deleted = 0 AND sha256 IS NOT NULL "
                f"UNION {retained_sql(retention, format_dt)} "
                "UNION SELECT sha256 FROM documents WHERE sha256 IS NOT NULL ORDER BY 1"
            )
        try:  # rowids follow the insertion order, which is the sort order
            for _, sha in self._pages(
                f"SELECT rowid, sha256 FROM {table} WHERE rowid > ? ORDER BY rowid LIMIT ?", [], 0, 0, None
            ):
                yield sha
        finally:
            with self._lock, contextlib.suppress(sqlite3.ProgrammingError):  # closed meanwhile: gone anyway
                self.conn.execute(f"DROP TABLE IF EXISTS {table}")

    # -- the embedded WebSub hub (websub/hub.py; tables of migration 6) ----------------------------

    # -- rsagg's notification channels (websub/notifier.py; migration 7) ----------------------------

    # -- rsagg's subscriptions to upstream channels (websub/subscriber.py; migration 8) --------------

    # -- the shared inbox of upstream notifications (websub/subscriber.py; migration 10) -------------

    # -- rsagg's own Resource Dumps and Change Dumps (publish/dumps.py; migration 5) ------------------

    # -- cluster: nodes and source leases (cluster.py) ----------------------------------------------
    # Plain SQL both backends speak: SQLite serialises these transactions (BEGIN IMMEDIATE), PostgreSQL
    # claims with SELECT ... FOR UPDATE SKIP LOCKED. Lease times are the claimer's clock here (one
    # machine shares one SQLite file); PostgreSQL uses the server's now().


# ---------------------------------------------------------------------------------------------------


# The oldest pending delivery of each subscription: the only one that may go out (in-order delivery).
_HUB_HEADS = "SELECT MIN(id) FROM hub_deliveries GROUP BY subscription_id"
_HUB_GC_PAYLOADS = (
    "DELETE FROM hub_payloads WHERE NOT EXISTS "
    "(SELECT 1 FROM hub_deliveries d WHERE d.payload_id = hub_payloads.id)"
)
_NSUB_COLS = tuple(f.name for f in dataclasses.fields(NotifySubscription))
_NSUB_TIMES = ("requested", "lease_expires", "verified", "last_until", "next_attempt")
_RUN_COLS = "id, set_name, at, completed, last_seq, set_ids, packages, entries, bytes, created"
_PKG_COLS = (
    "id, set_name, kind, run, part, window, first_seq, last_seq, sha256, length, manifest_sha256, "
    "manifest_length, at, completed, from_, until, entries, bytes, created"
)


def _nsub_values(sub: NotifySubscription) -> list[Any]:
    values = [getattr(sub, k) for k in _NSUB_COLS[1:]]
    return [format_dt(v) if isinstance(v, datetime) else v for v in values]


def _dump_run(r: tuple) -> DumpRun:
    return DumpRun(
        r[0], r[1], parse_dt(r[2]), parse_dt(r[3]), r[4], tuple(json.loads(r[5])), r[6], r[7], r[8],
        parse_dt(r[9]),
    )  # fmt: skip


def _dump_package(r: tuple) -> DumpPackage:
    return DumpPackage(
        *r[:12], parse_dt(r[12]), parse_dt(r[13]), parse_dt(r[14]), parse_dt(r[15]), r[16], r[17],
        parse_dt(r[18]),
    )  # fmt: skip
