"""Content-addressed blob storage: the bytes of every resource we hold, named by their SHA-256.

Why content addressing: the same bytes harvested twice (from two Sources, or unchanged between two
baselines) are stored once, and a state row only has to name a hash. ``BlobStore`` is the interface the
rest of rsagg uses (a plugin may provide another backend later); ``FileBlobStore`` keeps blobs on the
local filesystem under ``root/ab/cd/<sha256>``, and small ones as rows of ``root/small.db``
(``store/inline.py``).

docs/architecture.md invariant 2 ("blob before state"): ``commit`` returns only once every blob it names is
durable (data fsynced, renamed into place, directory fsynced); callers commit blobs first and then the
state transaction that names them. Everything here blocks: async callers use ``trio.to_thread``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import heapq
import inspect
import io
import itertools
import logging
import os
import platform
import re
import secrets
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, cast, runtime_checkable

from ..rs.fixity import Hasher, digests
from .inline import INLINE_FILE, InlineBlobs

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_HEX2 = re.compile(r"[0-9a-f]{2}\Z")
#: Committed blobs are immutable: nothing may write into a file that other rows may name.
BLOB_MODE = 0o444
#: The blob folders (the store's root and its two fan-out levels), whatever the process's umask (systemd
#: units run with UMask=0077): a web server reading the blob files (``server.offload = "x-accel"``) must
#: traverse them. Who may reach the store at all is decided by the folder above it (the units'
#: ``StateDirectoryMode=0750``: owner and group rsagg, which nginx's user joins; docs/deploy.md).
FOLDER_MODE = 0o755
#: Threads used to fsync a batch: concurrent fsyncs on ext4/xfs share journal commits, so a batch of
#: 500 small blobs costs a few journal flushes instead of 500 (on the ext4 dev VM: 500 x 2 KiB files,
#: sequential fsync ~120 ms, 16 threads ~40 ms; 32 or 64 threads were no better).
FSYNC_THREADS = 16
#: Batches of at least this many blobs are made durable with two ``syncfs`` calls instead of one
#: fsync per file and per directory. Why: the two-level fan-out means that, until a store holds
#: some 100,000 blobs, nearly every new blob also creates a directory, so a batch of 256 blobs cost
#: ~670 fsyncs (~80 ms on the ext4 dev VM; 250 ms with a busy disk) against ~10 ms for two syncfs.
#: Smaller batches keep per-file fsyncs (syncfs also flushes unrelated dirty data of the filesystem).
SYNCFS_MIN_BATCH = 16
#: Blobs up to this many bytes, when they reach ``commit`` in memory, are stored as rows of the store's
#: ``small.db`` (store/inline.py) rather than as a file each (``[store.settings] inline_bytes``). Served
#: from memory; a front end that reads files (x-accel) gets a file copy written on demand (``blob_name``).
INLINE_BYTES = 16 * 1024
_TMP_PREFIX = "blob-"
#: Temp name prefix of a blob file gc set aside while deciding (``FileBlobStore._delete_file``).
_ASIDE = "gc-"


def _load_syncfs():  # -> Callable[[int], int] | None
    """libc ``syncfs`` where it reports writeback errors (Linux >= 5.8, errseq per open file), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
        if (major, minor) < (5, 8):
            return None
        fn = ctypes.CDLL(None, use_errno=True).syncfs  # releases the GIL while it waits
    except (OSError, AttributeError, ValueError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_SYNCFS = _load_syncfs()


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

    def __init__(self, tmp_path: Path | None, file: BinaryIO | None, hasher: Hasher) -> None:
        self.tmp_path = tmp_path  # None only for a SpooledBlobWriter still in memory
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
        hashes = self._hasher.hexdigests()
        self._info = BlobInfo(hashes["sha-256"], self._hasher.length, hashes)
        self._state = "finished"
        return self._info

    def abort(self) -> None:
        if self._state in ("committed", "aborted"):
            return
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.tmp_path is not None:
            self.tmp_path.unlink(missing_ok=True)
        self._state = "aborted"

    def peek(self, n: int) -> bytes | None:
        """The first ``n`` bytes of a finished, uncommitted blob (to tell what it is), or None."""
        if self._state != "finished" or self.tmp_path is None:
            return None
        try:
            with open(self.tmp_path, "rb") as f:
                return f.read(n)
        except OSError:
            return None

    def _committed(self) -> None:
        self._state = "committed"

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()


class SpooledBlobWriter(BlobWriter):
    """A blob held in memory while it is small: its temp file is written by ``commit``, or on overflow.

    Why: creating, writing, chmod-ing and closing a temp file per resource while fetching cost more
    than the fetch itself for small resources (and file creation stalls behind the journal while a
    commit syncs); ``commit`` writes the small blobs of a batch back to back from its worker thread,
    and skips the ones already stored (dedup) without touching the disk at all.
    """

    __slots__ = ("_limit", "_open_tmp", "_parts", "_size")

    def __init__(self, open_tmp: Callable[[], tuple[Path, BinaryIO]], hasher: Hasher, limit: int) -> None:
        super().__init__(None, None, hasher)
        self._open_tmp = open_tmp
        self._limit = limit
        self._parts: list[bytes] | None = []
        self._size = 0

    def write(self, chunk: bytes) -> None:
        if self._state != "open":
            raise ValueError(f"write on a {self._state} blob writer")
        if self._parts is None:
            super().write(chunk)
            return
        self._parts.append(bytes(chunk))
        self._size += len(chunk)
        self._hasher.update(chunk)
        if self._size > self._limit:  # too big to hold: on to a temp file, as any writer
            self.tmp_path, self._file = self._open_tmp()
            parts, self._parts = self._parts, None
            for part in parts:
                self._file.write(part)

    def finish(self) -> BlobInfo:
        if self._parts is None or self._state != "open":
            return super().finish()
        hashes = self._hasher.hexdigests()
        self._info = BlobInfo(hashes["sha-256"], self._hasher.length, hashes)
        self._state = "finished"
        return self._info

    def abort(self) -> None:
        self._parts = None
        super().abort()

    def peek(self, n: int) -> bytes | None:
        if self._parts is None:
            return super().peek(n)
        if self._state != "finished":
            return None
        out = b""
        for part in self._parts:
            out += part[: n - len(out)]
            if len(out) >= n:
                break
        return out

    def held(self) -> bytes | None:
        """The finished blob's bytes while they are only in memory (no temp file yet), else None."""
        if self._parts is None or self._state != "finished":
            return None
        return self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)

    def _committed(self) -> None:
        self._parts = None
        super()._committed()

    def _write_temp(self, path: str) -> None:
        """Give a finished in-memory blob its read-only temp file (called by ``commit``, blocking)."""
        if self._parts is None:
            return
        self.tmp_path = Path(path)  # set at once: abort() removes it whatever happens next
        try:
            _write_new(path, self._parts)
        except FileExistsError:  # not ours (O_EXCL created nothing): abort() must leave it alone
            self.tmp_path = None
            raise
        self._parts = None


def _write_new(path: str, parts: Sequence[bytes], *, sync: bool = False) -> None:
    """Write a new read-only file (O_EXCL: never one that exists), optionally fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, BLOB_MODE)
    try:
        os.fchmod(fd, BLOB_MODE)  # open's mode is masked by the umask (0400 under UMask=0077)
        for part in parts:
            view = memoryview(part)
            while view:
                view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def pending_writers(
    writers: Sequence[BlobWriter],
) -> tuple[list[tuple[BlobWriter, BlobInfo]], dict[str, BlobWriter]]:
    """What every store's ``commit`` starts from: the finished writers of a batch not committed yet, and
    per content the first of them (the one to store: the others of the same content are dropped).

    Raises ``ValueError`` for a writer that is neither finished nor committed.
    """
    todo: list[tuple[BlobWriter, BlobInfo]] = []
    for w in writers:
        if w.state == "committed":
            continue
        if w.state != "finished" or w.info is None:
            raise ValueError(f"commit of a {w.state} blob writer (call finish first)")
        todo.append((w, w.info))
    first: dict[str, BlobWriter] = {}
    for w, info in todo:
        first.setdefault(info.sha256, w)
    return todo, first


@runtime_checkable
class BlobStore(Protocol):
    """Storage backends for blobs (the filesystem one here; a plugin may add S3 and the like)."""

    def begin(self, algorithms: frozenset[str] = frozenset()) -> BlobWriter:
        """Start a blob. A backend may also accept ``spool=N``: hold up to N bytes in memory."""
        ...

    def commit(self, writers: Sequence[BlobWriter]) -> None:
        """Make finished blobs durable and visible; an existing blob means dedup (temp dropped)."""
        ...

    def put_bytes(self, data: bytes) -> BlobInfo: ...

    def exists(self, sha256: str) -> bool: ...

    def open(self, sha256: str) -> BinaryIO: ...

    def size(self, sha256: str) -> int: ...

    def delete(self, sha256: str, stored_before: float | None = None) -> bool:
        """Remove a blob; True when it was there and went. ``stored_before`` (a UNIX time): only if it
        was last stored before then, checked as it goes, so a blob a commit stores again meanwhile
        (and will name) stays (``rsagg gc`` with a grace period, beside running harvests)."""
        ...

    def iter_hashes(self) -> Iterator[str]: ...

    def iter_stored(self) -> Iterator[tuple[str, float]]:
        """``(sha256, stored_at)`` of every blob, ascending by hash: when it was last stored (UNIX time),
        written or found there already by a ``commit`` (dedup refreshes it: the commit's caller is
        about to name the blob). What gc's grace period is measured against."""
        ...

    def local_path(self, sha256: str) -> Path | None: ...

    def read_inline(self, sha256: str) -> bytes | None:
        """The bytes of a blob the store keeps inline (small, in a database of its own: one quick read);
        None for every other blob. Callers serving a blob ask this first, then ``local_path``."""
        ...

    def blob_name(self, sha256: str) -> str:
        """The blob's name inside the store, ``ab/cd/<sha256>``: where a front end offloading the bytes
        finds it (a file under the store's root, an object key after the prefix)."""
        ...

    def url(self, sha256: str, lifetime: float, content_type: str | None = None) -> str | None:
        """A URL clients can GET the bytes from directly, valid ``lifetime`` seconds (served with
        ``content_type`` where the store can say so), for ``server.offload = "redirect"``; None when the
        store has no such URLs (a local filesystem)."""
        ...


#: Bodies up to this size arriving from upstream (fetched, dump members, patch results) stay in memory
#: until their batch commits; at most (workers x 4 + batch_size) of them are alive (the pipeline's
#: in-flight bound), e.g. 20 MB by default.
SPOOL_BYTES = 64 * 1024


def begin_spooled(store: BlobStore, algorithms: frozenset[str], limit: int = SPOOL_BYTES) -> BlobWriter:
    """A blob writer that holds up to ``limit`` bytes in memory when the backend can (``begin``'s
    ``spool``; 0: never); the caller bounds how many such writers are alive at once.

    Why: a temp file per resource, created and written on the event loop, cost ~12% of the loop's
    time in a 10,000-resource baseline (file creation also waits for the journal while a commit
    syncs); the file store writes spooled blobs at commit, back to back, or as rows of its small.db.
    """
    kind = type(store)
    spools = _SPOOLS.get(kind)
    if spools is None:
        try:
            spools = _SPOOLS[kind] = "spool" in inspect.signature(store.begin).parameters
        except (TypeError, ValueError):
            spools = _SPOOLS[kind] = False
    if spools and limit > 0:
        return store.begin(algorithms, spool=limit)  # type: ignore[call-arg]
    return store.begin(algorithms)


_SPOOLS: dict[type, bool] = {}


#: What a backend must have: the protocol's methods (checked when a store is opened).
BLOB_STORE_METHODS = tuple(name for name in vars(BlobStore) if not name.startswith("_"))


def blob_name(sha256: str) -> str:
    """``ab/cd/<sha256>``: the two fan-out levels every store names its blobs by."""
    check_sha256(sha256)
    return f"{sha256[0:2]}/{sha256[2:4]}/{sha256}"


def _fsync_path(path: Path | str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TempArea:
    """The temp folder of a blob store, shared by every process that opens the store.

    Each open store holds a shared ``flock`` on ``folder/.lock``; stale temp files of a crashed process
    are removed at start-up, but only under the exclusive lock (no other live store uses the folder),
    so a second process (``rsagg gc`` next to the daemon) never deletes live temps. ``restore(path)``,
    when given, is asked first about each stale file: True when it put the file back where it belongs.
    """

    def __init__(self, folder: Path, restore: Callable[[str], bool] | None = None) -> None:
        self.folder = folder
        self._restore = restore
        folder.mkdir(parents=True, exist_ok=True)
        # Names of spooled blobs' temp files: unique in this process, O_EXCL against any other. A count,
        # not a generator: commits run in several threads at once (a generator raises "already executing").
        self._prefix = f"{folder}/{_TMP_PREFIX}{secrets.token_hex(6)}-"
        self._numbers = itertools.count()
        #: Open while the store is: its flock, and the fd ``syncfs`` flushes the filesystem through.
        self.lock_fd: int | None = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("temp folder %s is in use by another process: stale temp files left alone", folder)
        else:
            self._clean()
        fcntl.flock(self.lock_fd, fcntl.LOCK_SH)

    def begin(self, algorithms: frozenset[str], spool: int) -> BlobWriter:
        """A writer into a private temp file, or held in memory up to ``spool`` bytes (SpooledBlobWriter)."""
        hasher = Hasher(algorithms)
        if spool > 0:
            return SpooledBlobWriter(self.open, hasher, spool)
        path, file = self.open()
        return BlobWriter(path, file, hasher)

    def open(self) -> tuple[Path, BinaryIO]:
        # mkstemp: O_CREAT|O_EXCL with a random name, mode 0o600.
        fd, name = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self.folder)
        return Path(name), os.fdopen(fd, "wb")

    def next_name(self) -> str:
        """A fresh temp file name (for ``SpooledBlobWriter._write_temp``)."""
        return f"{self._prefix}{next(self._numbers)}"

    def close(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = None

    def _clean(self) -> None:
        removed = restored = 0
        with os.scandir(self.folder) as it:
            for e in it:
                if e.name == ".lock":
                    continue
                if self._restore is not None and self._restore(e.path):
                    restored += 1
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    Path(e.path).unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("removed %d stale temp file(s) from %s", removed, self.folder)
        if restored:
            log.info("put %d blob file(s) a killed gc had set aside back in place", restored)


def put_bytes(store: BlobStore, data: bytes, *, spool: int = 0) -> BlobInfo:
    """One blob from bytes in memory, committed: ``BlobStore.put_bytes`` of every store (``spool``:
    held in memory up to that many bytes where the store can, see ``begin_spooled``)."""
    with begin_spooled(store, frozenset(), spool) as w:
        w.write(data)
        info = w.finish()
        store.commit([w])
    return info


def _make_folder(path: str) -> bool:
    """``mkdir`` with exactly FOLDER_MODE (mkdir's own mode is masked by the umask); False if it existed."""
    try:
        os.mkdir(path, FOLDER_MODE)
    except FileExistsError:
        return False
    os.chmod(path, FOLDER_MODE)
    return True


def _repair_folder_modes(root: Path) -> None:
    """Give every blob folder FOLDER_MODE when the root has another mode (a store written under an older
    unit with UMask=0077 has 0700 folders): one ``stat`` when all is well, the root is set last."""
    try:
        if stat.S_IMODE(os.stat(root).st_mode) == FOLDER_MODE:
            return
        fixed = 0
        for top in os.scandir(root):
            if not (_HEX2.match(top.name) and top.is_dir(follow_symlinks=False)):
                continue
            for folder in [top.path, *(e.path for e in os.scandir(top.path) if _HEX2.match(e.name))]:
                if stat.S_IMODE(os.stat(folder, follow_symlinks=False).st_mode) != FOLDER_MODE:
                    os.chmod(folder, FOLDER_MODE)
                    fixed += 1
        os.chmod(root, FOLDER_MODE)
    except PermissionError as exc:  # another user's store (a gc run as root sets them, the owner too)
        log.warning("blob folders of %s keep their mode (%s): a web server may not read them", root, exc)
        return
    log.info("blob folders of %s: mode set to %o (%d fan-out folders changed)", root, FOLDER_MODE, fixed)


class FileBlobStore:
    """Blobs as read-only files ``root/ab/cd/<sha256>`` (two fan-out levels keep directories small), and
    those of at most ``inline_bytes`` that reach ``commit`` in memory as rows of ``root/small.db``.

    Temp files live in ``root/tmp/`` (same filesystem, so the final ``rename`` is atomic), a TempArea:
    stale ones of a crashed process are removed at start-up when no other process uses the store.
    A blob may be in both places (a small file written before ``small.db`` existed, stored again inline):
    readers take the row, ``delete`` removes both, ``iter_hashes`` names it once.
    """

    #: ``on_commit(written, deduplicated)``: BlobInfos of each commit, for metrics (``metrics.py``).
    on_commit: Callable[[list[BlobInfo], list[BlobInfo]], None] | None = None

    def __init__(
        self,
        root: Path | str,
        *,
        fsync_threads: int = FSYNC_THREADS,
        syncfs: bool | None = None,
        inline_bytes: int = INLINE_BYTES,
    ) -> None:
        """``syncfs``: None = use it for big batches where the OS supports it; False = never.
        ``inline_bytes``: 0 = a file for every new blob (rows stored earlier are still read)."""
        if inline_bytes < 0:
            raise ValueError(f"inline_bytes must be 0 or more, not {inline_bytes}")
        self.root = Path(root)
        self.root.parent.mkdir(parents=True, exist_ok=True)
        _make_folder(str(self.root))
        _repair_folder_modes(self.root)
        self.inline_bytes = inline_bytes
        self.tmp = self.root / "tmp"
        self._fsync_threads = max(1, fsync_threads)
        #: Fan-out directories known to exist ("ab", "ab/cd"): no mkdir per blob once seen (never removed;
        #: should one vanish anyway, the rename fails and commit creates it again).
        self._dirs_known: set[str] = set()
        if syncfs and _SYNCFS is None:
            raise ValueError("syncfs is not available here (Linux >= 5.8 needed)")
        self._use_syncfs = _SYNCFS is not None and syncfs is not False
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._temp = TempArea(self.tmp, restore=self._put_back)
        small = self.root / INLINE_FILE
        self._inline = InlineBlobs(small) if inline_bytes or small.exists() else None

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the start-up lock and the fsync threads (the store is not usable afterwards)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._inline is not None:
            self._inline.close()
        self._temp.close()

    def __enter__(self) -> FileBlobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- paths -----------------------------------------------------------------------------------

    def _path(self, sha256: str) -> Path:
        check_sha256(sha256)
        return self.root / sha256[0:2] / sha256[2:4] / sha256

    def local_path(self, sha256: str) -> Path | None:
        """Where the blob is (or would be) on disk, for serving it with sendfile; not checked to exist
        (an inline blob has no file: ``read_inline`` first)."""
        return self._path(sha256)

    def read_inline(self, sha256: str) -> bytes | None:
        check_sha256(sha256)
        return None if self._inline is None else self._inline.get(sha256)

    def blob_name(self, sha256: str) -> str:
        """``ab/cd/<sha256>``; an inline blob first gets a file there (``_file_copy``): a front end
        offloading the bytes reads files (``server.offload = "x-accel"``)."""
        name = blob_name(sha256)
        if self._inline is not None:
            try:
                self._file_copy(sha256)
            except OSError as exc:  # the front end finds no file, and hands the request to rsagg
                log.warning("blob %s: cannot write its file for the front end: %s", sha256, exc)
        return name

    def _file_copy(self, sha256: str) -> None:
        """Write an inline blob's file, once (the row stays the blob; ``delete`` removes both).

        Written as any blob file (read-only temp, fsync, rename), so a front end never reads a partial
        one. Not durable by itself: a name lost in a crash is written again on the next request.
        """
        target = self._path(sha256)
        if target.exists():
            return
        data = self._inline.get(sha256) if self._inline is not None else None
        if data is None:
            return
        tmp = self._temp.next_name()
        try:
            _write_new(tmp, [data], sync=True)
            self._place(tmp, f"{sha256[0:2]}/{sha256[2:4]}", str(target))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _place(self, tmp: Path | str, leaf: str, target: str) -> list[str]:
        """Rename a temp file to its blob name, in fan-out directories made as needed; returns the
        directories whose entries changed besides the leaf's own (to fsync)."""
        changed = self._ensure_dirs(leaf)
        try:
            os.replace(tmp, target)
        except FileNotFoundError:  # a fan-out directory we knew is gone: make it again
            self._dirs_known.clear()
            changed += self._ensure_dirs(leaf)
            os.replace(tmp, target)
        return changed

    def url(self, sha256: str, lifetime: float, content_type: str | None = None) -> str | None:
        return None  # clients cannot reach a local file by URL: use x-accel offload instead

    # -- writing ---------------------------------------------------------------------------------

    def begin(self, algorithms: frozenset[str] = frozenset(), *, spool: int = 0) -> BlobWriter:
        """Start a blob; ``algorithms`` are extra hash tokens to compute ("md5", "sha-1").

        ``spool``: keep up to that many bytes in memory (no file until ``commit``, see
        SpooledBlobWriter); the caller bounds how many such writers are alive at once.
        """
        return self._temp.begin(algorithms, spool)

    def put_bytes(self, data: bytes) -> BlobInfo:
        return put_bytes(self, data, spool=self.inline_bytes)  # small ones stay in memory: inline

    def put_small(
        self, contents: Sequence[bytes], algorithms: frozenset[str] = frozenset()
    ) -> list[BlobInfo] | None:
        """Store blobs whole in memory, each of at most ``inline_bytes``, as rows of ``small.db`` in one
        durable transaction: what ``commit`` does with such blobs held by spooled writers, without a
        writer, a Hasher and the commit's bookkeeping per blob (an OAI-PMH page's records, in a worker
        process: that bookkeeping cost a sixth of a page's work there). Their BlobInfos, in order
        (``algorithms``: extra hash tokens, as ``begin``'s). None, with nothing stored, when the store keeps
        no blob inline or one is bigger: the caller then uses writers. Blocking; ``on_commit`` as ``commit``.
        """
        if self._inline is None or not self.inline_bytes or any(len(c) > self.inline_bytes for c in contents):
            return None
        infos: list[BlobInfo] = []
        first: dict[str, bytes] = {}  # per content, its bytes (a repeat in the batch is stored once)
        for data in contents:
            hashes = digests(data, algorithms)
            sha = hashes["sha-256"]
            infos.append(BlobInfo(sha, len(data), hashes))
            first.setdefault(sha, data)
        if not first:
            return infos
        added = self._inline.put_many(list(first.items()))
        if self.on_commit is not None:  # durable now: as ``commit_steps`` counts them
            fresh = {sha for sha, new in zip(first, added, strict=True) if new}
            written: list[BlobInfo] = []
            found: list[BlobInfo] = []
            for info in infos:
                if info.sha256 in fresh:
                    fresh.discard(info.sha256)  # a repeat in the batch: deduplicated
                    written.append(info)
                else:
                    found.append(info)
            self.on_commit(written, found)
        return infos

    def commits_inline(self, writers: Sequence[BlobWriter]) -> bool:
        """True when ``commit(writers)`` is one ``small.db`` transaction and touches no file: every blob
        not committed yet is finished, held in memory and small enough to be stored inline. Such a
        commit has no per-blob syscall, so it may run whole in a worker thread (``commit_steps`` says
        why the others may not): the harvest then commits it in the thread hop of the state write that
        names its blobs (``HarvestContext.write_after_blobs``)."""
        if self._inline is None or not self.inline_bytes:
            return False
        limit = self.inline_bytes
        for w in writers:
            if w.state == "committed":
                continue
            if not isinstance(w, SpooledBlobWriter) or w.tmp_path is not None or w._parts is None:
                return False
            info = w.info
            if w.state != "finished" or info is None or info.length > limit:
                return False
        return True

    def commit(self, writers: Sequence[BlobWriter]) -> None:
        """Make every finished writer's blob durable and visible (see ``commit_steps``); blocking."""
        for slow in self.commit_steps(writers):
            slow()

    def commit_steps(self, writers: Sequence[BlobWriter]) -> Iterator[Callable[[], None]]:
        """``commit`` as a generator: quick steps run as it advances, slow ones are yielded to the caller.

        The caller must run each yielded step (blocking: a syncfs or a batch of fsyncs) before advancing.
        Why: an event loop can drive this itself and send only the slow steps to a worker thread. Run
        whole in a worker thread, commit's few syscalls per blob each handed the GIL back and forth with
        the busy event loop: 3-4x their own CPU time on both threads, and ~200 ms per batch of 256.

        Make every finished writer's blob durable and visible, in three batched steps.

        1. fsync each temp file's data (concurrently: see FSYNC_THREADS); 2. rename into place, or drop
        the temp when the blob already exists (dedup); 3. fsync each touched directory once (the
        directories holding the new names, and the parents of fan-out directories created now).
        Only then is the blob durable: a crash before step 3 may lose the name, never expose a partial
        file, since a name only ever points at fsynced bytes. Big batches do steps 1 and 3 with one
        ``syncfs`` each (see SYNCFS_MIN_BATCH): same order, same guarantee, the whole filesystem at once.

        Small blobs held in memory skip all that: one transaction of ``small.db`` stores them, durable
        when it commits (store/inline.py), before any file of the batch is touched.
        """
        todo, first = pending_writers(writers)
        if not todo:
            return
        inline = self._inline_candidates(first)
        added: list[bool] = []
        if inline:
            yield functools.partial(self._put_inline, inline, added)
        files = [(w, info) for w, info in todo if info.sha256 not in inline]
        to_sync = [w for w, info in files if first[info.sha256] is w and not self._exists_ok(info)]
        for w in to_sync:
            if isinstance(w, SpooledBlobWriter):
                w._write_temp(self._temp.next_name())
        whole_fs = self._use_syncfs and self._temp.lock_fd is not None and len(files) >= SYNCFS_MIN_BATCH
        if whole_fs:
            if to_sync:
                yield self._syncfs
        elif to_sync:
            # each has its temporary file now (written just above when it was still in memory)
            yield functools.partial(self._fsync_files, [cast(Path, w.tmp_path) for w in to_sync])
        dirs: set[str] = set()
        syncing = set(map(id, to_sync))
        syncing.update(id(inline[sha][0]) for sha, new in zip(inline, added, strict=True) if new)
        root = str(self.root)
        for w, info in todo:
            sha = check_sha256(info.sha256)
            if sha in inline:  # stored by the transaction above (a duplicate's temp file, if any, goes)
                if w.tmp_path is not None:
                    w.tmp_path.unlink(missing_ok=True)
                w._committed()
                continue
            leaf = f"{sha[0:2]}/{sha[2:4]}"
            target = f"{root}/{leaf}/{sha}"  # self._path(), without pathlib's cost per blob
            if id(w) in syncing:
                assert w.tmp_path is not None
                dirs.update(self._place(w.tmp_path, leaf, target))
            else:
                # Dedup: the blob is already there. Its directory entry may come from a concurrent
                # commit that has not fsynced it yet, so its directory is synced here too.
                if w.tmp_path is not None:
                    w.tmp_path.unlink(missing_ok=True)
            dirs.add(f"{root}/{leaf}")
            w._committed()
        if dirs:
            yield self._syncfs if whole_fs else functools.partial(self._fsync_dirs, sorted(dirs))
        if self.on_commit is not None:  # durable now: count what was written vs already there (dedup)
            new = [i for w, i in todo if id(w) in syncing]
            self.on_commit(new, [i for w, i in todo if id(w) not in syncing])

    def _inline_candidates(self, first: dict[str, BlobWriter]) -> dict[str, tuple[BlobWriter, bytes]]:
        """The blobs of a batch to store inline: small, and still in memory (per content, its writer
        and its bytes)."""
        if not self.inline_bytes or self._inline is None:
            return {}
        inline: dict[str, tuple[BlobWriter, bytes]] = {}
        for sha, w in first.items():
            if isinstance(w, SpooledBlobWriter) and w.info is not None and w.info.length <= self.inline_bytes:
                data = w.held()
                if data is not None:
                    inline[sha] = (w, data)
        return inline

    def _put_inline(self, inline: dict[str, tuple[BlobWriter, bytes]], added: list[bool]) -> None:
        """Store the batch's inline blobs in one durable transaction; ``added`` says which were new."""
        assert self._inline is not None
        added[:] = self._inline.put_many([(sha, data) for sha, (_, data) in inline.items()])

    def _syncfs(self) -> None:
        """Flush the store's filesystem (data and metadata) and wait; raises on a writeback error.

        Through the store's long-lived lock fd: since Linux 5.8 ``syncfs`` reports writeback errors
        that happened on the filesystem since that file was opened (or since the last report).
        """
        assert _SYNCFS is not None and self._temp.lock_fd is not None
        if _SYNCFS(self._temp.lock_fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs of {self.root}: {os.strerror(err)}")

    def _exists_ok(self, info: BlobInfo) -> bool:
        """True when the target already holds this blob (a wrong size means damage: replace it).

        Its mtime is set to now: the blob is stored again (dedup) and about to be named, so gc's grace
        period starts again. A file gc removed between the stat and the touch counts as missing (the
        commit writes it anew); one gc sets aside after the touch it puts back (``_delete_file``).
        """
        sha = check_sha256(info.sha256)
        path = f"{self.root}/{sha[0:2]}/{sha[2:4]}/{sha}"  # self._path(), as a plain str
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        if st.st_size != info.length:
            log.warning(
                "blob %s has %d bytes, expected %d: replacing it", info.sha256, st.st_size, info.length
            )
            return False
        try:
            os.utime(path)  # a read-only file's times may still be set by its owner
        except (FileNotFoundError, PermissionError):  # gone, or another user's: write it anew
            return False
        return True

    def _ensure_dirs(self, leaf: str) -> list[str]:
        """Create the two fan-out levels of ``leaf`` ("ab/cd"); return the parents whose entries
        changed (to fsync)."""
        changed: list[str] = []
        root = str(self.root)
        for rel in (leaf[0:2], leaf):
            if rel in self._dirs_known:
                continue
            if _make_folder(f"{root}/{rel}"):
                changed.append(os.path.dirname(f"{root}/{rel}"))
            self._dirs_known.add(rel)
        return changed

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._fsync_threads, thread_name_prefix="blob-fsync")
            return self._pool

    def _fsync_all(self, paths: Sequence[Path | str], flags: int = os.O_RDONLY) -> None:
        if len(paths) <= 1 or self._fsync_threads == 1:
            for p in paths:
                _fsync_path(p, flags)
            return
        # list() re-raises the first OSError: fsync errors must reach the caller (no blob is named).
        list(self._executor().map(lambda p: _fsync_path(p, flags), paths))

    def _fsync_files(self, paths: Sequence[Path | str]) -> None:
        self._fsync_all(paths)

    def _fsync_dirs(self, dirs: Sequence[Path | str]) -> None:
        try:
            self._fsync_all(dirs, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:  # some filesystems refuse fsync on directories
            if exc.errno not in (errno.EINVAL, errno.EBADF):
                raise

    # -- reading ---------------------------------------------------------------------------------

    def exists(self, sha256: str) -> bool:
        if self._inline is not None and self._inline.length(check_sha256(sha256)) is not None:
            return True
        return self._path(sha256).is_file()

    def open(self, sha256: str) -> BinaryIO:
        """A seekable read-only binary file; FileNotFoundError when the blob is not stored."""
        data = self.read_inline(sha256)
        if data is not None:
            return io.BytesIO(data)
        return open(self._path(sha256), "rb")  # the caller owns (and closes) the file

    def size(self, sha256: str) -> int:
        if self._inline is not None:
            length = self._inline.length(check_sha256(sha256))
            if length is not None:
                return length
        return os.stat(self._path(sha256)).st_size

    def delete(self, sha256: str, stored_before: float | None = None) -> bool:
        """Remove a blob (its row and its file); deleting one that is not there is not an error (gc may
        run twice). The caller (gc) makes sure no state row names it; ``stored_before`` guards against a
        commit storing it again meanwhile (see the protocol): a row or file stored since then stays,
        and so does the other copy of a blob in both places.
        """
        check_sha256(sha256)
        removed = False
        if self._inline is not None:
            removed = self._inline.delete(sha256, stored_before)
            if not removed and stored_before is not None and self._inline.length(sha256) is not None:
                return False  # stored again: its file copy (if any) stays with it
        file = self._delete_file(sha256, stored_before)
        if file is False:
            return False  # stored again as a file: the blob stays
        return bool(file) or removed

    def _delete_file(self, sha256: str, stored_before: float | None) -> bool | None:
        """Unlink a blob file (True; None when there is none); with ``stored_before``, only one not
        touched since (``_exists_ok``; False when it stays).

        The file is first renamed aside, then its mtime read: a commit touching it before the rename
        is seen (the file goes back, durably), one after the rename finds no file and writes it anew.
        So the check and the removal are one step as far as a concurrent commit can tell.
        """
        path = self._path(sha256)
        if stored_before is None:
            try:
                path.unlink()
            except FileNotFoundError:
                return None
            return True
        aside = f"{self.tmp}/{_ASIDE}{sha256}.{secrets.token_hex(4)}"  # a killed gc's is put back
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return None
        try:
            recent = os.stat(aside).st_mtime >= stored_before
        except BaseException:
            os.replace(aside, path)
            raise
        if not recent:
            os.unlink(aside)
            return True
        os.replace(aside, path)  # a commit found it there and will name it: keep it, durably
        self._fsync_dirs([path.parent])
        return False

    def _put_back(self, path: str) -> bool:
        """A blob file a killed gc had set aside (``_delete_file``), back at its name: the gc may have
        been about to keep it (a commit stored it again and will name it); if not, the next gc removes
        it. False for any other temp file. Called at start-up, when no other process uses the store."""
        name = os.path.basename(path)
        sha = name[len(_ASIDE) :].partition(".")[0]
        if not (name.startswith(_ASIDE) and _SHA256.match(sha)):
            return False
        target = self._path(sha)
        if target.exists():  # stored anew meanwhile: the copy set aside is not needed
            os.unlink(path)
        else:
            made = self._place(path, f"{sha[0:2]}/{sha[2:4]}", str(target))
            self._fsync_dirs([*made, str(target.parent)])
        return True

    def iter_hashes(self) -> Iterator[str]:
        """Every committed blob's SHA-256 once, ascending: the rows of ``small.db`` merged with the files."""
        return (sha for sha, _ in self.iter_stored())

    def iter_stored(self) -> Iterator[tuple[str, float]]:
        """Every blob once, ascending, with when it was last stored: a file's mtime (when its bytes were
        written, or when a commit last found it there), a row's ``stored_at``; for a blob in both
        places, the later of the two."""
        files = self._iter_files()
        if self._inline is None:
            yield from files
            return
        last: tuple[str, float] | None = None
        for sha, stored_at in heapq.merge(self._inline.iter_stored(), files):
            if last is not None and sha != last[0]:
                yield last
            last = (sha, stored_at) if last is None or sha != last[0] else (sha, max(stored_at, last[1]))
        if last is not None:
            yield last

    def _iter_files(self) -> Iterator[tuple[str, float]]:
        """Every blob file's SHA-256 and mtime, ascending, by walking the fan-out directories (temp files
        excluded; a file removed while listed is skipped)."""
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
                        try:
                            mtime = f.stat(follow_symlinks=False).st_mtime
                        except FileNotFoundError:
                            continue
                        yield f.name, mtime


def _scandir_sorted(path: str | Path) -> list[os.DirEntry[str]]:
    with os.scandir(path) as it:
        return sorted(it, key=lambda e: e.name)
