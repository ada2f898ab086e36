"""Errors shared across the stages: the one place metrics learn what kind of failure stopped a sync
(``CountedError``: the kind it is counted under, whichever stage raised it), and the one place
an operating-system, SQLite or PostgreSQL failure becomes the one line an operator reads (file or URL,
what happened, the fix) instead of a traceback."""

from __future__ import annotations

import errno
import sqlite3


class ConfigError(Exception):
    """A configuration problem; ``str()`` reads ``FILE: KEY: PROBLEM`` (one line per further problem).
    Here rather than in ``config.py`` (which re-exports it) so that raising or catching it loads no
    pydantic: ``rsagg plugins`` without ``-c`` starts without it."""

    def __init__(self, file: str, key: str, problem: str, more: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__("\n".join(f"{file}: {k}: {p}" for k, p in ((key, problem), *more)))
        self.file, self.key, self.problem, self.more = file, key, problem, more


class CountedError(Exception):
    """A failure with a ``kind``: the label of ``rsagg_errors_total`` it is counted under (one of
    ``metrics.ERROR_KINDS``). Subclasses set it per class or per instance."""

    kind: str = "sync"


class StoreFailure(CountedError):
    """The store (state database or blob folder) cannot be written or read: the machine's problem, not
    an upstream's. Its message is one line naming the file, folder or redacted URL and the fix. A sync
    that meets it fails (the daemon tries again on its next interval and keeps serving what it has);
    ``rsagg harvest --once`` and start-up stop with that line and exit 1."""

    kind = "store"


#: errno -> (what it means, the fix): the failures an operator causes or can mend on the machine.
_OS_FIXES: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on the device", "free space on that filesystem or move store.path"),
    errno.EDQUOT: ("disk quota exceeded", "raise the quota of the user rsagg runs as or move store.path"),
    errno.EFBIG: ("file too large for this process or filesystem", "raise the file size limit (ulimit -f)"),
    errno.EROFS: ("read-only filesystem", "mount it read-write or move store.path"),
    errno.EACCES: ("permission denied", "make it writable by the user rsagg runs as (chown/chmod)"),
    errno.EPERM: ("operation not permitted", "make it writable by rsagg's user (chown/chmod, chattr -i)"),
    errno.ENOENT: ("no such file or folder (was the store moved, deleted or unmounted?)",
                   "mount or restore store.path, then start rsagg again"),
    errno.ENOTDIR: ("a part of the path is not a folder", "point store.path at a folder"),
    errno.ESTALE: ("stale file handle (the network filesystem went away)", "remount store.path"),
    errno.EIO: ("input/output error", "check the disk (dmesg) and the filesystem of store.path"),
    errno.EMFILE: ("too many open files", "raise LimitNOFILE / ulimit -n"),
    errno.ENFILE: ("too many open files in the system", "raise fs.file-max"),
}  # fmt: skip

#: SQLite's messages (sqlite3.OperationalError / DatabaseError text) -> (errno-like meaning, the fix).
_SQLITE_FIXES: tuple[tuple[str, str], ...] = (
    ("readonly database", "make it, its -wal/-shm files and its folder writable by the user rsagg runs as"),
    ("database or disk is full", "free space on that filesystem or move store.path"),
    ("disk i/o error", "check the disk (dmesg); was the store moved, deleted or unmounted? restore it"),
    ("unable to open database file", "the file or its folder is missing or not writable: restore store.path"),
    ("database is locked", "another process holds the database's write lock: stop it or raise its timeout"),
    ("file is not a database", "this is not an rsagg state database: restore it from a backup"),
    ("malformed", "the database is corrupt: restore it from a backup"),
)  # fmt: skip


def is_environmental(exc: BaseException) -> bool:
    """Whether ``exc`` is the machine's failure (disk full, read-only, missing store, database away)
    rather than a bug or an upstream's fault: what ``operator_line`` can say in one line."""
    if isinstance(exc, StoreFailure):
        return True
    if isinstance(exc, sqlite3.OperationalError | sqlite3.DatabaseError) and not isinstance(
        exc, sqlite3.IntegrityError | sqlite3.ProgrammingError | sqlite3.InterfaceError
    ):
        text = str(exc).lower()
        return any(pattern in text for pattern, _ in _SQLITE_FIXES)
    return type(exc) in (
        OSError,
        PermissionError,
        FileNotFoundError,
        NotADirectoryError,
        IsADirectoryError,
    ) and (
        exc.errno in _OS_FIXES  # type: ignore[attr-defined]
    )


def operator_line(exc: BaseException, where: str | None = None) -> str:
    """One line for an environmental failure: ``where`` (the file, folder or URL concerned; the error's
    own file name wins), what happened and the fix. Anything else: its type and message, on one line."""
    if isinstance(exc, StoreFailure):
        return " ".join(str(exc).split())
    if isinstance(exc, sqlite3.Error):
        text = str(exc)
        fix = next((f for p, f in _SQLITE_FIXES if p in text.lower()), None)
        head = f"{where}: " if where else ""
        return " ".join(f"{head}{text}{f' ({fix})' if fix else ''}".split())
    if isinstance(exc, OSError) and exc.errno in _OS_FIXES:
        meaning, fix = _OS_FIXES[exc.errno]
        name = exc.filename if exc.filename is not None else where
        detail = exc.strerror or meaning
        # An OSError raised with a message naming its own path (e.g. "/x/small.db: database ...").
        if exc.filename is None and exc.strerror and exc.strerror.startswith("/"):
            name, detail = None, exc.strerror
        head = f"{name}: " if name else ""
        return " ".join(f"{head}{detail} [{errno.errorcode.get(exc.errno, exc.errno)}] ({fix})".split())
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def store_failure(exc: BaseException, where: str | None = None) -> StoreFailure:
    """``exc`` (environmental) as a ``StoreFailure`` with its one line; the cause stays chained."""
    if isinstance(exc, StoreFailure):
        return exc
    failure = StoreFailure(operator_line(exc, where))
    failure.__cause__ = exc
    return failure


def environmental_leaf(exc: BaseException) -> BaseException | None:
    """The environmental failure inside ``exc`` (itself, or the first such leaf of an exception group,
    as trio's nurseries raise them), else None."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = environmental_leaf(inner)
            if found is not None:
                return found
        return None
    if is_environmental(exc):
        return exc
    cause = exc.__cause__  # ``raise ... from exc``: the wrapper says less than what it wraps
    return environmental_leaf(cause) if cause is not None and cause is not exc else None


def _said(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    text = str(exc)
    return " ".join((f"{type(exc).__name__}: {text}" if text else type(exc).__name__).split())


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def _first_real_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first leaf that is not a cancellation (trio cancels the siblings of a failed task)."""
    leaves = _leaves(group)
    real = [e for e in leaves if type(e).__name__ != "Cancelled"]
    return (real or leaves or [group])[0]


def _chain(exc: BaseException) -> list[BaseException | str]:
    """The errors from ``exc`` down to its root cause (see ``root_cause``), groups left out."""
    chain: list[BaseException | str] = []
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, BaseExceptionGroup):
            exc = _first_real_leaf(exc)
            continue
        chain.append(exc)
        declared = getattr(exc, "root_cause", None)
        if isinstance(declared, str):
            chain.append(declared)
            break
        if isinstance(declared, BaseException):
            exc = declared
            continue
        cause = exc.__cause__
        if cause is None or (str(cause) and str(cause) in str(exc)):
            break
        exc = cause
    return chain


def root_cause(exc: BaseException) -> BaseException | str:
    """The first error in ``exc``'s chain that is not a wrapper: the one an operator acts on.

    Wrappers are unwrapped in this order: an exception group (trio's nurseries) by its first leaf that is
    not a cancellation; an error that declares what it wraps (a ``root_cause`` attribute: an exception or
    a text, e.g. discovery's "nothing found" wraps the reason its first URL failed); an error raised
    ``from`` another whose message does not already say that other's (a wrapper that repeats its cause
    in its own words is self-describing, and names more: the URL, the kind)."""
    chain = _chain(exc)
    return chain[-1] if chain else exc


def leading_line(exc: BaseException) -> str:
    """What a sync's error is recorded as (status, the home page, logs): its root cause first, then the
    wrappers from the outermost in, each whole (``--json`` shows all of it; the status table cuts after
    the first line's width, so the root cause is what stays in view). Groups say nothing of their own."""
    chain = _chain(exc) or [exc]
    said = [c if isinstance(c, str) else _said(c) for c in chain]
    return " — ".join([said[-1], *said[:-1]])


__all__ = [
    "CountedError",
    "StoreFailure",
    "environmental_leaf",
    "is_environmental",
    "leading_line",
    "operator_line",
    "root_cause",
    "store_failure",
]
