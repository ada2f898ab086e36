"""The state in a SQLite file: ``StateStore`` (store/interface.py) for ``[store] path``/state.db.

The state's SQL is written once in store/sql/ (one mixin per concern, one schema); this module is the
SQLite backend: the connection (WAL mode, one per handle), its write transactions (BEGIN IMMEDIATE),
the version counter (``PRAGMA data_version``), the schema version (``PRAGMA user_version``) and how a
batch of rows is written (``executemany``). Times are stored as fixed-width W3C text
(``rows.format_dt``: text order equals time order), but in the two big tables (``resources``,
``changelog``) as integer microseconds since the epoch (``dialect.to_us``, schema step 16).

Threads: the harvester calls ``State`` from worker threads, so the connection is opened with
``check_same_thread=False`` and every method takes ``self._lock``: nobody reads another thread's
half-done transaction through the shared connection. Iterators read in pages and hold the lock only
while fetching a page, so a slow consumer (an HTTP response) never blocks writers.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import is_environmental, operator_line
from ..rs.w3cdt import utcnow
from .interface import FENCE, LeaseLost, StateUnavailable
from .rows import (
    Fence,
    format_dt,
)
from .sql.changes import Changes
from .sql.cluster import Cluster
from .sql.codec import (
    SYNCHRONOUS,
    WRITE_COLS,
    hash_in,
    http_date_in,
)
from .sql.dialect import SQLITE, to_us, uri_key, us_of_text
from .sql.dumps import Dumps
from .sql.hub import Hub
from .sql.notify import Notifications
from .sql.reads import Reads
from .sql.reconcile import Reconciliations
from .sql.schema import migrations

# ---------------------------------------------------------------------------------------------------
#: The schema's steps as this backend runs them (store/sql/schema.py: one list for every backend).
MIGRATIONS = migrations(SQLITE)

# New rows get their id from us (max(id) + 1 under the write lock, as SQLite would) so the changelog
# can name them without reading them back; stored rows are updated by primary key (2x faster than an
# INSERT .. ON CONFLICT upsert, measured). Rows are never deleted (tombstones), so ids are never reused;
# a future purge of tombstones must keep that true (e.g. keep the highest row) or use a counter.
_INSERT_RES = (
    f"INSERT INTO resources (id, {', '.join(WRITE_COLS)}, uri_key) "
    f"VALUES ({', '.join('?' * (len(WRITE_COLS) + 2))})"
)
_UPDATE_RES = (
    "UPDATE resources SET "
    + ", ".join(f"{c} = COALESCE(?, {c})" if c == "generation" else f"{c} = ?" for c in WRITE_COLS[2:])
    + " WHERE id = ?"
)
_INSERT_LOG = (
    "INSERT INTO changelog (set_id, resource_id, change, datetime, sha256, length, type) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)


def _http_us(value: str | None) -> int | None:
    """Schema step 18: a kept ``Last-Modified`` header as the row's time (None: not an IMF-fixdate)."""
    return to_us(http_date_in(value))


def _unhex(value: str | bytes | None) -> bytes | None:
    """Schema step 15: a stored hex hash (either case) as its bytes; NULL stays NULL."""
    if value is None or isinstance(value, bytes):
        return value
    return hash_in(value)


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


class State(Changes, Reads, Reconciliations, Notifications, Dumps, Hub, Cluster):
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
        #: The thread whose writes join one transaction now (``together``), or None.
        self._together: int | None = None
        #: The fences checked in ``together``'s transaction so far (each write's own is checked once).
        self._fenced: set[Fence | None] = set()
        try:
            conn = sqlite3.connect(str(self.path), timeout=busy_timeout, check_same_thread=False)
        except sqlite3.Error as exc:
            if not is_environmental(exc):
                raise
            raise StateUnavailable(f"state {operator_line(exc, str(self.path))}") from exc
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
            mode = self._journal_mode_wal(busy_timeout)
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
        # The converters of the steps that rewrite stored values: step 15's hex decoder (SQLite's own
        # unhex() is 3.41+), step 16's time text to microseconds. A value that does not convert fails
        # the step (the transaction rolls back: the state stays as it was), named in the error (sqlite3
        # only says a function raised).
        refused: list[str] = []

        def converter(step: int, what: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
            def convert(value: Any) -> Any:
                try:
                    return fn(value)
                except ValueError as exc:
                    refused.append(f"schema step {step} cannot convert a stored {what}: {exc}")
                    raise

            return convert

        self.conn.create_function("rsagg_unhex", 1, converter(15, "hash", _unhex), deterministic=True)
        self.conn.create_function("rsagg_us", 1, converter(16, "time", us_of_text), deterministic=True)
        self.conn.create_function("rsagg_uri_key", 1, uri_key, deterministic=True)
        self.conn.create_function("rsagg_http_us", 1, _http_us, deterministic=True)  # step 18
        try:
            self._run_migrations()
        except sqlite3.OperationalError as exc:
            if not refused:
                raise
            raise ValueError(f"{self.path}: {refused[0]}") from exc

    def _run_migrations(self) -> None:
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
    def together(self, *, fence: bool = True) -> Iterator[None]:
        """The writes of this thread inside are one transaction: all of them, or none (an exception
        rolls every one back). Why: a sync's status writes ride along with its next write
        (``HarvestContext.write_later``), and each was a transaction of its own, its locks and its
        WAL frames, a good part of the state writer's work for a small Source
        (benchmarks/bench_many_sources.py). Each write inside is checked against its own fence
        (``interface.FENCE`` where it runs), once per fence; ``fence=False`` checks none for the
        transaction itself (the writes of many sources' tasks gathered in one: ``harvest/writes.py``)."""
        if self._together == threading.get_ident():  # nested: the outer one decides
            yield
            return
        with self._lock, self._undo_in_memory(), self._write(fence=fence):
            self._together = threading.get_ident()
            self._fenced = {FENCE.get()} if fence else set()  # checked by ``_write`` just now
            try:
                yield
                if not self.conn.in_transaction:  # SQLite rolled it back (a full disk) under a write
                    raise self._gone()
            finally:
                self._together = None
                self._fenced = set()

    @contextlib.contextmanager
    def _undo_in_memory(self) -> Iterator[None]:
        """What the transaction's savepoints would undo is kept in memory, not in a temporary file. Why:
        SQLite keeps a savepoint's undo records (its sub-journal) in memory up to 64 KiB, then in a
        file of its own in the temporary folder. The writes of a shared hop (``savepoint``) each
        touched more than that (20 new rows a small Source, on pages at random keys), so every hop
        opened such a file and wrote each page to it: about 45 write calls a Source in a harvest of
        300 small Sources (``strace -f``), none in one Source's. The records are dropped at each
        savepoint's release, so memory holds one write's pages at most; outside ``together`` the
        default holds (a large statement's journal spills to disk). Only between transactions may
        SQLite change where it keeps them."""
        self.conn.execute("PRAGMA temp_store = MEMORY")
        try:
            yield
        finally:
            with contextlib.suppress(sqlite3.Error):  # a connection gone: the error is the write's
                self.conn.execute("PRAGMA temp_store = DEFAULT")

    def _gone(self) -> StateUnavailable:
        return StateUnavailable(f"state {self.path}: a write failed and its transaction is gone")

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """Inside ``together``: the writes inside are undone alone when they raise, and the transaction
        goes on without them. Why: the writes of many sources share one transaction
        (``harvest/writes.py``), and one write's failure must not take the others' with it, nor leave
        half of itself behind (SQLite undoes only the failing statement). Outside ``together`` each
        write is a transaction of its own already: nothing to do."""
        if self._together != threading.get_ident():
            yield
            return
        conn = self.conn
        with self._lock:
            if not conn.in_transaction:  # lost under an earlier write: a SAVEPOINT would begin another
                raise self._gone()
            conn.execute("SAVEPOINT rsagg_write")
        try:
            yield
        except BaseException:
            with self._lock, contextlib.suppress(sqlite3.Error):  # gone with the transaction: the
                if conn.in_transaction:  # next write or the commit says so (``_write``)
                    conn.execute("ROLLBACK TO rsagg_write")
                    conn.execute("RELEASE rsagg_write")
            raise
        with self._lock:
            conn.execute("RELEASE rsagg_write")

    @contextlib.contextmanager
    def _write(self, *, fence: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction: BEGIN IMMEDIATE (take the write lock now, not at the first write,
        so concurrent writers wait in busy_timeout instead of failing on lock upgrade) ... COMMIT.
        Inside ``together``, the writes of its thread are part of its transaction.

        Under a fence (``interface.FENCE``) the lease is checked first, inside the transaction: the
        write lock is held from the check to the commit, so no grant can come in between."""
        if self._together == threading.get_ident():
            if not self.conn.in_transaction:  # SQLite rolled it back after an error a caller let pass
                raise self._gone()
            current = FENCE.get() if fence else None
            with self._unwritable():  # a full disk, a file gone: named, as outside ``together``
                if current is not None and current not in self._fenced:  # another task's, gathered
                    self._check_fence(self.conn, current)
                    self._fenced.add(current)
                yield self.conn  # the lock is held by ``together``'s transaction, in this thread
            return
        current = FENCE.get() if fence else None
        with self._lock, self._unwritable():
            with immediate_transaction(self.conn) as conn:
                if current is not None:
                    self._check_fence(conn, current)
                yield conn
            self._commits += 1

    def _journal_mode_wal(self, busy_timeout: float) -> str:
        """Switch to WAL, waiting up to ``busy_timeout`` for others opening the same file. SQLite does
        not call its busy handler for this switch: processes opening a new state at once (a cluster's
        nodes started together) got "database is locked" at once, whatever the timeout."""
        deadline = time.monotonic() + busy_timeout
        pause = 0.005
        while True:
            try:
                return str(self.conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            except sqlite3.OperationalError as exc:
                if ("locked" not in str(exc) and "busy" not in str(exc)) or time.monotonic() >= deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

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

    # -- the change pipeline's bulk writes (sql/changes.py) ----------------------------------------

    def _log_head(self, c: sqlite3.Connection) -> tuple[int, Any]:
        row = c.execute("SELECT seq, datetime FROM changelog ORDER BY seq DESC LIMIT 1").fetchone()
        return (row[0], row[1]) if row else (0, None)

    def _append_log(self, c: sqlite3.Connection, seq: int, log: list[tuple]) -> None:
        c.executemany(_INSERT_LOG, log)  # seq: AUTOINCREMENT, in commit order (one writer at a time)

    def _new_ids(self, c: sqlite3.Connection, n: int) -> Callable[[], int]:
        top: list[int] = []  # max(id), read once a new row needs an id

        def new_id() -> int:
            if not top:
                top.append(c.execute("SELECT coalesce(max(id), 0) FROM resources").fetchone()[0])
            top[0] += 1
            return top[0]

        return new_id

    def _write_batch(
        self,
        c: sqlite3.Connection,
        new: list[tuple],
        old: list[tuple],
        tombstones: dict[int, tuple],
        seen: dict[int, int],
        now: Any,
    ) -> None:
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
        if new:  # with its uri_key (schema step 16); a row's uri never changes, nor then its key
            c.executemany(_INSERT_RES, [(*r, uri_key(r[2])) for r in new])
        if old:  # _UPDATE_RES: the columns after uri, then the id
            c.executemany(_UPDATE_RES, [(*r[3:], r[0]) for r in old])

    def _check_fence(self, c: sqlite3.Connection, fence: Fence) -> None:
        row = c.execute(
            "SELECT node, epoch, expires_at FROM leases WHERE source = ?", (fence.source,)
        ).fetchone()
        node, epoch, expires = row if row else (None, None, None)
        if node != fence.node or epoch != fence.epoch:
            raise LeaseLost(fence, node, epoch, "another grant is current")
        if expires is None or expires <= format_dt(self._now()):
            raise LeaseLost(fence, node, epoch, f"it expired at {expires}")

    # -- SQLite's own ways (the shared SQL is in store/sql/) ---------------------------------------

    def _snapshot(self, sql: str, params: Sequence[Any] = ()) -> Iterator[tuple]:
        """The rows of one query as of one instant, in bounded memory: sorted once into a TEMP table
        (a temp file, not the WAL) and read back in pages by rowid (insertion order, the query's order),
        the lock held only while a page is read."""
        table = f"temp.snapshot_{secrets.token_hex(8)}"
        with self._lock:
            self.conn.execute(f"CREATE TABLE {table} AS {sql}", params)
        try:
            for row in self._pages(
                f"SELECT rowid, * FROM {table} WHERE rowid > ? ORDER BY rowid LIMIT ?", [], 0, 0, None
            ):
                yield row[1:]
        finally:
            with self._lock, contextlib.suppress(sqlite3.ProgrammingError):  # closed meanwhile: gone anyway
                self.conn.execute(f"DROP TABLE IF EXISTS {table}")

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
