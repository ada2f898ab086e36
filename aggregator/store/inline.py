"""Small blobs as rows of one SQLite database (``blobs/small.db``) instead of a file each.

Why: a harvest of small resources (OAI-PMH records of 1-3 KiB, tiny JSON documents) spent most of its
time creating files: per blob a temp file, a fan-out directory, a rename and their syncs, each a
syscall that also hands the GIL to another thread. One transaction per batch stores a page of records
with one WAL append and one fsync. SQLite measured the same for blobs of a few KiB
(https://www.sqlite.org/fasterthanfs.html: about 35% faster than one file each, in less space).

Durability (docs/architecture.md invariant 2, "blob before state"): the database is in WAL mode with
``synchronous = FULL``, so a ``put_many`` that returned is durable even across a power loss, whatever the
state store's own ``synchronous`` setting; only then does the caller commit the state rows that name the
blobs. Several threads and processes (the daemon and its harvest worker processes, ``rsagg gc``, the
nodes of a cluster on one host) share the file through SQLite's locking, writers queueing on a lock file
beside it (``small.db.lock``). A network filesystem does not give SQLite the locks it needs: a store
shared by several machines uses an object store (the S3 plugin) or sets ``inline_bytes = 0``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

#: The database's name in a filesystem blob store's root.
INLINE_FILE = "small.db"
#: How long a writer waits for another process's transaction (gc, another node) before failing.
BUSY_TIMEOUT_MS = 60_000
#: Keys per query when listing hashes: ``iter_hashes`` holds no cursor open between pages, so a
#: caller may delete rows as it goes (gc).
PAGE = 1000
#: Beside the database: writers of every process take it (``flock``) before they write.
LOCK_SUFFIX = ".lock"
#: ``stored_at``: UNIX time the row was last stored, by its first commit or one that found it there already
#: (dedup): ``rsagg gc`` keeps rows stored within its grace period (``commands/gc.py``).
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS blobs (sha256 BLOB PRIMARY KEY, data BLOB NOT NULL, stored_at REAL NOT NULL)"
)
#: Keys per query asking which of a batch's blobs are stored already (well under SQLite's variable limit).
_HELD_CHUNK = 500
#: SQLite result codes -> the OSError a file store would raise (callers handle OSError: full disk etc.)
_ERRNO = {13: errno.ENOSPC, 3: errno.EACCES, 8: errno.EROFS, 14: errno.EACCES}


def _as_os_error(fn: Callable) -> Callable:
    """SQLite's errors as OSError naming the database: what every caller of a blob store expects."""

    @functools.wraps(fn)
    def call(self: InlineBlobs, *args: object) -> object:
        try:
            return fn(self, *args)
        except sqlite3.Error as exc:
            code = getattr(exc, "sqlite_errorcode", 0) & 0xFF  # the primary code of an extended one
            raise OSError(_ERRNO.get(code, errno.EIO), f"{self.path}: {exc}") from None

    return call


class InlineBlobs:
    """Content-addressed rows ``(sha256 as 32 bytes, data)``; every method blocks (worker threads).

    Connections are pooled, not per thread: trio's worker threads come and go (an idle one exits), and a
    connection per thread would stay open after its thread for as long as the daemon runs.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._idle: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()
        self._writing = threading.Lock()
        self._lock_fd: int | None = None  # the lock file, opened at the first write
        self._closed = False
        self.check()

    @_as_os_error
    def check(self) -> None:
        """Open a connection (creating the database): a bad store path fails at start-up.

        A database made before rows had ``stored_at`` gets the column, every row counted as stored now:
        gc then keeps them for one grace period, as it would rows a running harvest just stored.
        """
        with self._conn() as conn:
            if "stored_at" in {row[1] for row in conn.execute("PRAGMA table_info(blobs)")}:
                return
            conn.execute("BEGIN IMMEDIATE")  # another process may be adding it at the same instant
            try:
                if "stored_at" not in {row[1] for row in conn.execute("PRAGMA table_info(blobs)")}:
                    conn.execute("ALTER TABLE blobs ADD COLUMN stored_at REAL NOT NULL DEFAULT 0")
                    conn.execute("UPDATE blobs SET stored_at = ?", (time.time(),))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    @contextlib.contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        try:
            conn = self._idle.get_nowait()
        except queue.Empty:
            conn = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
            )
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = FULL")  # see the module docstring: blob before state
                conn.execute(_SCHEMA)
            except BaseException:
                conn.close()
                raise
        try:
            yield conn
        finally:
            if self._closed:
                conn.close()
            else:
                self._idle.put(conn)

    @contextlib.contextmanager
    def _write_lock(self) -> Iterator[None]:
        """Writers queue here, those of this process on a mutex and those of every process (the
        harvest's worker processes, ``rsagg gc``, cluster nodes on one host) on an ``flock`` of the lock
        file: the lock's holder hands it on the instant it is done. Queued in SQLite's busy handler
        instead, a writer sleeps up to 100 ms between tries, and two processes storing pages at once lost
        a third of their time to those sleeps."""
        with self._writing:
            if self._lock_fd is None:
                lock_path = self.path.with_name(self.path.name + LOCK_SUFFIX)
                flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
                try:
                    self._lock_fd = os.open(lock_path, flags, 0o644)
                except OSError as exc:
                    raise OSError(exc.errno, f"{lock_path}: {exc.strerror}") from None
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    @_as_os_error
    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Store ``(sha256, data)`` pairs in one durable transaction; per pair, True when it was new.

        A row there already gets its ``stored_at`` refreshed: the caller is about to name it, so gc must
        count it as recent (in the same transaction, so a gc deleting it conditionally either runs
        before, and the row is inserted anew, or after, and sees it recent).
        """
        keys = [bytes.fromhex(sha) for sha, _ in items]
        with self._write_lock(), self._conn() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                held: set[bytes] = set()
                for i in range(0, len(keys), _HELD_CHUNK):
                    chunk = keys[i : i + _HELD_CHUNK]
                    marks = ",".join("?" * len(chunk))
                    held.update(
                        k
                        for (k,) in conn.execute(f"SELECT sha256 FROM blobs WHERE sha256 IN ({marks})", chunk)
                    )
                new = [k not in held for k in keys]
                now = time.time()
                conn.executemany(
                    "INSERT INTO blobs (sha256, data, stored_at) VALUES (?, ?, ?)",
                    [(k, data, now) for k, (_, data), fresh in zip(keys, items, new, strict=True) if fresh],
                )
                conn.executemany("UPDATE blobs SET stored_at = ? WHERE sha256 = ?", [(now, k) for k in held])
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        return new

    def get(self, sha256: str) -> bytes | None:
        return self._one("SELECT data FROM blobs WHERE sha256 = ?", sha256)

    def length(self, sha256: str) -> int | None:
        return self._one("SELECT length(data) FROM blobs WHERE sha256 = ?", sha256)

    @_as_os_error
    def _one(self, sql: str, sha256: str) -> Any:
        """The one value ``sql`` selects for a blob, or None when it is not stored."""
        with self._conn() as conn:
            row = conn.execute(sql, (bytes.fromhex(sha256),)).fetchone()
        return None if row is None else row[0]

    @_as_os_error
    def delete(self, sha256: str, stored_before: float | None = None) -> bool:
        """Remove the row (only if stored before ``stored_before``, when given); True when one went."""
        key = bytes.fromhex(sha256)
        with self._write_lock(), self._conn() as conn:
            if stored_before is None:
                cur = conn.execute("DELETE FROM blobs WHERE sha256 = ?", (key,))
            else:
                sql = "DELETE FROM blobs WHERE sha256 = ? AND stored_at < ?"
                cur = conn.execute(sql, (key, stored_before))
            return cur.rowcount > 0

    def iter_hashes(self) -> Iterator[str]:
        """Every hash, ascending (raw bytes sort as their lowercase hex does), a page at a time."""
        return (sha for sha, _ in self.iter_stored())

    def iter_stored(self) -> Iterator[tuple[str, float]]:
        """Every ``(hash, stored_at)``, ascending by hash, a page at a time."""
        after = b""
        while True:
            rows = self._rows_after(after)
            for key, stored_at in rows:
                yield key.hex(), stored_at
            if len(rows) < PAGE:
                return
            after = rows[-1][0]

    @_as_os_error
    def _rows_after(self, after: bytes) -> list[tuple[bytes, float]]:
        with self._conn() as conn:
            rows = conn.execute(
                "SELECT sha256, stored_at FROM blobs WHERE sha256 > ? ORDER BY sha256 LIMIT ?", (after, PAGE)
            )
            return list(rows)

    def close(self) -> None:
        """Close the idle connections; one in use closes when it is handed back."""
        self._closed = True
        with self._writing:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


def inline_totals(path: str | Path) -> tuple[int, int]:
    """(rows, bytes) of an inline blob database, read-only; (0, 0) when there is none (metrics)."""
    if not os.path.exists(path):
        return 0, 0
    try:
        with contextlib.closing(
            sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True, timeout=5)
        ) as conn:
            rows, nbytes = conn.execute(
                "SELECT count(*), coalesce(sum(length(data)), 0) FROM blobs"
            ).fetchone()
    except sqlite3.Error as exc:
        raise OSError(errno.EIO, f"{path}: {exc}") from None
    return rows, nbytes


__all__ = ["INLINE_FILE", "InlineBlobs", "inline_totals"]
