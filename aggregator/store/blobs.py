"""Content-addressed blob storage: the bytes of every resource we hold, named by their SHA-256.

Why content addressing: the same bytes harvested twice (from two Sources, or unchanged between two
baselines) are stored once, and a state row only has to name a hash. ``BlobStore`` is the interface the
rest of rsagg uses (a plugin may provide another backend later); ``FileBlobStore`` keeps blobs on the
local filesystem under ``root/ab/cd/<sha256>``.

ARCHITECTURE invariant 2 ("blob before state"): ``commit`` returns only once every blob it names is
durable (data fsynced, renamed into place, directory fsynced); callers commit blobs first and then the
state transaction that names them. Everything here blocks: async callers use ``trio.to_thread``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, runtime_checkable

from ..rs.fixity import Hasher

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_HEX2 = re.compile(r"[0-9a-f]{2}\Z")
#: Committed blobs are immutable: nothing may write into a file that other rows may name.
BLOB_MODE = 0o444
#: Threads used to fsync a batch: concurrent fsyncs on ext4/xfs share journal commits, so a batch of
#: 500 small blobs costs a few journal flushes instead of 500 (on the ext4 dev VM: 500 x 2 KiB files,
#: sequential fsync ~120 ms, 16 threads ~40 ms; 32 or 64 threads were no better).
FSYNC_THREADS = 16
_TMP_PREFIX = "blob-"


def check_sha256(sha256: str) -> str:
    """Return ``sha256`` if it is 64 lowercase hex digits, else raise ValueError.

    Why: the hash becomes a file name, so anything else (``..``, ``/``, upper case aliases) is refused.
    """
    if not isinstance(sha256, str) or not _SHA256.match(sha256):
        raise ValueError(f"not a lowercase hex SHA-256: {sha256!r}")
    return sha256


@dataclass(frozen=True)
class BlobInfo:
    """What a finished blob is: its SHA-256, length and every hash asked for (token names, §7)."""

    sha256: str
    length: int
    hashes: dict[str, str]  # "sha-256" always, plus "md5"/"sha-1" when asked for


class BlobWriter:
    """One blob being written: bytes go to a private temp file and are hashed on the way.

    ``write`` is cheap (no fsync); ``finish`` closes the temp file and says what it holds; the blob is
    neither durable nor visible until ``BlobStore.commit``. ``abort`` may be called in any state, so
    ``with store.begin() as w:`` cleans up on error.
    """

    __slots__ = ("_file", "_hasher", "_info", "_state", "tmp_path")

    def __init__(self, tmp_path: Path, file: BinaryIO, hasher: Hasher) -> None:
        self.tmp_path = tmp_path
        self._file: BinaryIO | None = file
        self._hasher = hasher
        self._info: BlobInfo | None = None
        self._state = "open"  # open -> finished -> committed; any -> aborted

    @property
    def info(self) -> BlobInfo | None:
        """The result of ``finish`` (None before)."""
        return self._info

    @property
    def state(self) -> str:
        return self._state

    def write(self, chunk: bytes) -> None:
        if self._state != "open" or self._file is None:
            raise ValueError(f"write on a {self._state} blob writer")
        self._file.write(chunk)
        self._hasher.update(chunk)

    def finish(self) -> BlobInfo:
        if self._state == "finished" and self._info is not None:
            return self._info
        if self._state != "open" or self._file is None:
            raise ValueError(f"finish on a {self._state} blob writer")
        f, self._file = self._file, None
        try:
            f.flush()
            # Read-only before it gets its final name, so a visible blob is never writable.
            os.fchmod(f.fileno(), BLOB_MODE)
        finally:
            f.close()
        self._info = BlobInfo(self._hasher.sha256, self._hasher.length, self._hasher.hexdigests())
        self._state = "finished"
        return self._info

    def abort(self) -> None:
        if self._state in ("committed", "aborted"):
            return
        if self._file is not None:
            self._file.close()
            self._file = None
        self.tmp_path.unlink(missing_ok=True)
        self._state = "aborted"

    def _committed(self) -> None:
        self._state = "committed"

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()


@runtime_checkable
class BlobStore(Protocol):
    """Storage backends for blobs (the filesystem one here; a plugin may add S3 and the like)."""

    def begin(self, algorithms: frozenset[str] = frozenset()) -> BlobWriter: ...

    def commit(self, writers: Sequence[BlobWriter]) -> None:
        """Make finished blobs durable and visible; an existing blob means dedup (temp dropped)."""
        ...

    def put_bytes(self, data: bytes) -> BlobInfo: ...

    def exists(self, sha256: str) -> bool: ...

    def open(self, sha256: str) -> BinaryIO: ...

    def size(self, sha256: str) -> int: ...

    def delete(self, sha256: str) -> None: ...

    def iter_hashes(self) -> Iterator[str]: ...

    def local_path(self, sha256: str) -> Path | None: ...


def _fsync_path(path: Path | str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileBlobStore:
    """Blobs as read-only files ``root/ab/cd/<sha256>`` (two fan-out levels keep directories small).

    Temp files live in ``root/tmp/`` (same filesystem, so the final ``rename`` is atomic). Stale temp
    files of a crashed process are removed at start-up, but only when no other live ``FileBlobStore``
    uses the same root: every instance holds a shared ``flock`` on ``root/tmp/.lock``, and cleaning needs
    the exclusive lock, so a second process (``rsagg gc`` next to the daemon) never deletes live temps.
    """

    def __init__(self, root: Path | str, *, fsync_threads: int = FSYNC_THREADS) -> None:
        self.root = Path(root)
        self.tmp = self.root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._fsync_threads = max(1, fsync_threads)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._lock_fd: int | None = os.open(self.tmp / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("blob store %s is in use by another process: stale temp files left alone", self.root)
        else:
            self._clean_tmp()
        fcntl.flock(self._lock_fd, fcntl.LOCK_SH)

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the start-up lock and the fsync threads (the store is not usable afterwards)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> FileBlobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _clean_tmp(self) -> None:
        removed = 0
        with os.scandir(self.tmp) as it:
            for e in it:
                if e.name == ".lock":
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    Path(e.path).unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("removed %d stale temp file(s) from %s", removed, self.tmp)

    # -- paths -----------------------------------------------------------------------------------

    def _path(self, sha256: str) -> Path:
        check_sha256(sha256)
        return self.root / sha256[0:2] / sha256[2:4] / sha256

    def local_path(self, sha256: str) -> Path | None:
        """Where the blob is (or would be) on disk, for serving it with sendfile; not checked to exist."""
        return self._path(sha256)

    # -- writing ---------------------------------------------------------------------------------

    def begin(self, algorithms: frozenset[str] = frozenset()) -> BlobWriter:
        """Start a blob; ``algorithms`` are extra hash tokens to compute ("md5", "sha-1")."""
        # mkstemp: O_CREAT|O_EXCL with a random name, mode 0o600.
        fd, name = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self.tmp)
        return BlobWriter(Path(name), os.fdopen(fd, "wb"), Hasher(algorithms))

    def put_bytes(self, data: bytes) -> BlobInfo:
        with self.begin() as w:
            w.write(data)
            info = w.finish()
            self.commit([w])
        return info

    def commit(self, writers: Sequence[BlobWriter]) -> None:
        """Make every finished writer's blob durable and visible, in three batched steps.

        1. fsync each temp file's data (concurrently: see FSYNC_THREADS); 2. rename into place, or drop
        the temp when the blob already exists (dedup); 3. fsync each touched directory once (the
        directories holding the new names, and the parents of fan-out directories created now).
        Only then is the blob durable: a crash before step 3 may lose the name, never expose a partial
        file, since a name only ever points at fsynced bytes.
        """
        todo: list[tuple[BlobWriter, BlobInfo]] = []
        for w in writers:
            if w.state == "committed":
                continue
            if w.state != "finished" or w.info is None:
                raise ValueError(f"commit of a {w.state} blob writer (call finish first)")
            todo.append((w, w.info))
        if not todo:
            return
        # Two writers of the same content in one batch: the first one wins, the others are dropped.
        first: dict[str, BlobWriter] = {}
        for w, info in todo:
            first.setdefault(info.sha256, w)
        to_sync = [w for w, info in todo if first[info.sha256] is w and not self._exists_ok(info)]
        self._fsync_files([w.tmp_path for w in to_sync])
        dirs: set[Path] = set()
        syncing = set(map(id, to_sync))
        for w, info in todo:
            target = self._path(info.sha256)
            if id(w) in syncing:
                dirs.update(self._ensure_dirs(target.parent))
                os.replace(w.tmp_path, target)
            else:
                # Dedup: the blob is already there. Its directory entry may come from a concurrent
                # commit that has not fsynced it yet, so its directory is synced here too.
                w.tmp_path.unlink(missing_ok=True)
            dirs.add(target.parent)
            w._committed()
        self._fsync_dirs(sorted(dirs))

    def _exists_ok(self, info: BlobInfo) -> bool:
        """True when the target already holds this blob (a wrong size means damage: replace it)."""
        try:
            st = os.stat(self._path(info.sha256))
        except FileNotFoundError:
            return False
        if st.st_size != info.length:
            log.warning(
                "blob %s has %d bytes, expected %d: replacing it", info.sha256, st.st_size, info.length
            )
            return False
        return True

    def _ensure_dirs(self, d: Path) -> list[Path]:
        """Create the two fan-out levels; return the parents whose entries changed (to fsync)."""
        changed: list[Path] = []
        for p in (d.parent, d):
            try:
                os.mkdir(p, 0o755)
            except FileExistsError:
                continue
            changed.append(p.parent)
        return changed

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._fsync_threads, thread_name_prefix="blob-fsync")
            return self._pool

    def _fsync_all(self, paths: Sequence[Path], flags: int = os.O_RDONLY) -> None:
        if len(paths) <= 1 or self._fsync_threads == 1:
            for p in paths:
                _fsync_path(p, flags)
            return
        # list() re-raises the first OSError: fsync errors must reach the caller (no blob is named).
        list(self._executor().map(lambda p: _fsync_path(p, flags), paths))

    def _fsync_files(self, paths: list[Path]) -> None:
        self._fsync_all(paths)

    def _fsync_dirs(self, dirs: list[Path]) -> None:
        try:
            self._fsync_all(dirs, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:  # some filesystems refuse fsync on directories
            if exc.errno not in (errno.EINVAL, errno.EBADF):
                raise

    # -- reading ---------------------------------------------------------------------------------

    def exists(self, sha256: str) -> bool:
        return self._path(sha256).is_file()

    def open(self, sha256: str) -> BinaryIO:
        """A seekable read-only binary file; FileNotFoundError when the blob is not stored."""
        return open(self._path(sha256), "rb")  # the caller owns (and closes) the file

    def size(self, sha256: str) -> int:
        return os.stat(self._path(sha256)).st_size

    def delete(self, sha256: str) -> None:
        """Remove a blob; deleting one that is not there is not an error (gc may run twice).

        The caller (gc) must make sure no state row names it and no commit races with it.
        """
        self._path(sha256).unlink(missing_ok=True)

    def iter_hashes(self) -> Iterator[str]:
        """Every committed blob's SHA-256, by walking the fan-out directories (temp files excluded)."""
        for top in _scandir_sorted(self.root):
            if not (top.is_dir(follow_symlinks=False) and _HEX2.match(top.name)):
                continue
            for mid in _scandir_sorted(top.path):
                if not (mid.is_dir(follow_symlinks=False) and _HEX2.match(mid.name)):
                    continue
                prefix = top.name + mid.name
                for f in _scandir_sorted(mid.path):
                    if (
                        _SHA256.match(f.name)
                        and f.name.startswith(prefix)
                        and f.is_file(follow_symlinks=False)
                    ):
                        yield f.name


def _scandir_sorted(path: str | Path) -> list[os.DirEntry[str]]:
    with os.scandir(path) as it:
        return sorted(it, key=lambda e: e.name)
