"""Read a downloaded Resource Dump / Change Dump package (§11, §13) safely into the blob store.

A package is untrusted input: its ``manifest.xml`` names the paths, the ZIP holds the bytes. Nothing is
ever extracted to a path; each bitstream is streamed out of ``zipfile`` into a ``BlobWriter`` while byte
counts are checked against caps (ZIP headers may lie, so the caps count what is actually read), and each
one is verified against the manifest's ``hash``/``length`` (§7). The manifest is the only index: members
it does not name are ignored.

The package is checked in two passes so that structural faults (hostile paths, missing members, duplicate
names, oversize headers, a bad manifest) are reported before any item is yielded; content faults (hash or
length mismatch, a member that inflates beyond a cap, a corrupt stream) can only be found while reading and
may come after earlier items were yielded. Callers that want a package to count all-or-nothing keep the
yielded writers until the iterator ends and ``abort`` them on ``DumpError``.
"""

from __future__ import annotations

import re
import zipfile
from collections import Counter, deque
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import trio

from ..errors import CountedError
from ..rs import model
from ..rs.fixity import mismatches
from ..rs.model import Entry, Head
from ..rs.parse import DocumentError, DocumentReader
from ..store.blobs import BlobInfo, BlobStore, BlobWriter, begin_spooled
from .deviations import deviation

#: Bytes read out of the ZIP per thread hop (and per manifest parse step).
CHUNK = 1 << 20
#: Size of one read() inside a hop; caps are checked between reads.
PIECE = 64 * 1024
#: Members finished in one thread hop at most (many small members share one hop).
MEMBERS_PER_HOP = 512
#: §11.2 / §13.2: "must be named manifest.xml and must be located at the top level of the ZIP package".
MANIFEST_NAME = "manifest.xml"
MANIFEST_KINDS = frozenset({model.RESOURCEDUMP_MANIFEST, model.CHANGEDUMP_MANIFEST})

_DRIVE = re.compile(r"[A-Za-z]:")


class DumpError(CountedError):
    """A package that cannot be used; names the package URL, the member/path and the problem."""

    kind = "dump"

    def __init__(self, url: str, reason: str, path: str | None = None) -> None:
        self.url = url
        self.path = path
        self.reason = reason
        super().__init__(f"{url}: {path}: {reason}" if path else f"{url}: {reason}")


@dataclass
class DumpLimits:
    """Zip-bomb and resource caps, all enforced on the bytes actually read (headers are only a first check).

    ``max_ratio`` (uncompressed / compressed) applies to a member, and to the whole package, once more than
    ``ratio_min_bytes`` came out of it: small highly compressible files (a page of zeros) are normal.
    """

    max_package_bytes: int = 2**34
    max_member_bytes: int = 2**32
    max_total_uncompressed: int = 2**36
    max_ratio: int = 200
    max_members: int = 1_000_000
    max_manifest_bytes: int = 256 * 1024 * 1024
    ratio_min_bytes: int = 1 << 20


@dataclass
class DumpItem:
    """One manifest entry with its verified bitstream; ``blob`` is None for ``change="deleted"`` (§13.2)."""

    entry: Entry
    blob: BlobWriter | None = None  # finished, not committed
    info: BlobInfo | None = None


def member_name(path: str | None) -> str:
    """Map a manifest ``path`` to the ZIP member name, refusing anything but a plain relative path.

    §11.2/§13.2: the path is relative to the package root "expressed with a leading slash". We accept
    exactly that and nothing clever: no ``.``/``..``/empty segments, no backslashes, control characters
    or drive letters. Raises ValueError with the reason.
    """
    if not path:
        raise ValueError("no path")
    if not path.startswith("/"):
        raise ValueError("path must start with '/' (§11.2, §13.2)")
    if "\\" in path:
        raise ValueError("backslash in path")
    if any(ord(c) < 0x20 or c == "\x7f" for c in path):
        raise ValueError("control character (NUL...) in path")
    rest = path[1:]
    segments = rest.split("/")
    for seg in segments:
        if seg in ("", ".", ".."):
            raise ValueError(f"path segment {seg!r} not allowed")
    if _DRIVE.match(segments[0]):
        raise ValueError("drive letter in path")
    return rest


def _manifest_url(url: str) -> str:
    return f"{url}#{MANIFEST_NAME}"


@dataclass
class _Package:
    """The opened ZIP plus the running byte counts shared by both passes."""

    url: str
    zf: zipfile.ZipFile
    size: int
    members: dict[str, zipfile.ZipInfo]
    limits: DumpLimits
    total_out: int = 0

    def error(self, reason: str, path: str | None = None) -> DumpError:
        return DumpError(self.url, reason, path)

    def count_total(self, n: int, path: str) -> None:
        """Package-wide caps on bytes actually inflated (total and overall ratio)."""
        lim = self.limits
        self.total_out += n
        if self.total_out > lim.max_total_uncompressed:
            raise self.error(
                f"package inflates beyond max_total_uncompressed={lim.max_total_uncompressed}", path
            )
        if self.total_out > lim.ratio_min_bytes and self.total_out > lim.max_ratio * max(self.size, 1):
            raise self.error(f"package compression ratio exceeds {lim.max_ratio}", path)


def _open(path: Path, url: str, limits: DumpLimits) -> _Package:
    """Blocking: size and entry-count checks *before* zipfile loads the central directory, then open."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DumpError(url, f"cannot read package: {exc}") from None
    if size > limits.max_package_bytes:
        raise DumpError(
            url, f"package is {size} bytes, more than max_package_bytes={limits.max_package_bytes}"
        )
    try:
        with path.open("rb") as fp:
            endrec = zipfile._EndRecData(fp)  # type: ignore[attr-defined]  # private but stable since 2.x
    except OSError as exc:
        raise DumpError(url, f"cannot read package: {exc}") from None
    except AttributeError:  # pragma: no cover - a future zipfile without it: count after opening
        endrec = None
    if endrec is not None and endrec[zipfile._ECD_ENTRIES_TOTAL] > limits.max_members:  # type: ignore[attr-defined]
        raise DumpError(url, f"ZIP has more than max_members={limits.max_members} members")
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise DumpError(url, f"not a readable ZIP package: {exc}") from None
    try:
        infos = zf.infolist()
        if len(infos) > limits.max_members:
            raise DumpError(url, f"ZIP has {len(infos)} members, more than max_members={limits.max_members}")
        counts = Counter(i.filename for i in infos)
        dupes = sorted(name for name, n in counts.items() if n > 1)
        if dupes:
            raise DumpError(url, f"duplicate member name in ZIP ({len(dupes)} names duplicated)", dupes[0])
        members = {i.filename: i for i in infos}
        if MANIFEST_NAME not in members:
            raise DumpError(url, f"no {MANIFEST_NAME} at the top level of the package (§11.2, §13.2)")
        return _Package(url, zf, size, members, limits)
    except BaseException:
        zf.close()
        raise


def _check_header(pkg: _Package, info: zipfile.ZipInfo, path: str, length: int | None) -> None:
    """First line of defence from what the central directory claims (the streaming caps are the second)."""
    lim = pkg.limits
    if info.is_dir():
        raise pkg.error("names a directory, not a file", path)
    if info.flag_bits & 0x1:
        raise pkg.error("member is encrypted", path)
    if info.file_size > lim.max_member_bytes:
        raise pkg.error(
            f"member is {info.file_size} bytes, more than max_member_bytes={lim.max_member_bytes}", path
        )
    if info.file_size > lim.ratio_min_bytes and info.file_size > lim.max_ratio * max(info.compress_size, 1):
        raise pkg.error(f"member compression ratio exceeds {lim.max_ratio}", path)
    if length is not None and info.file_size != length:
        raise pkg.error(f"length mismatch: manifest says {length}, ZIP header says {info.file_size}", path)


class _ManifestStream:
    """The manifest read out of the ZIP in CHUNK steps and fed to the streaming parser (blocking methods)."""

    def __init__(self, pkg: _Package, *, count: bool) -> None:
        self.pkg = pkg
        self.count = count
        self.info = pkg.members[MANIFEST_NAME]
        lim = pkg.limits
        if self.info.file_size > lim.max_manifest_bytes:
            raise pkg.error(
                f"manifest is {self.info.file_size} bytes, over max_manifest_bytes={lim.max_manifest_bytes}",
                MANIFEST_NAME,
            )
        self.reader = DocumentReader(_manifest_url(pkg.url), max_bytes=lim.max_manifest_bytes)
        self.file: IO[bytes] | None = None
        self.read = 0
        self.done = False

    async def step(self) -> list[Head | Entry]:
        """Read up to CHUNK bytes in a worker thread, parse them here; returns the items completed.

        The parser must stay on the trio thread: lxml parsers intern names in per-thread dictionaries,
        and feeding one from whichever worker thread is free corrupts memory (seen as glibc aborts when
        blob commits and state writes kept other workers busy). See ``parse.DocumentReader``.
        """
        data = await trio.to_thread.run_sync(self._pull)
        if not data:
            self.done = True
            self.close()
            return self._parse(None)
        out: list[Head | Entry] = []
        for i in range(0, len(data), PIECE):  # a checkpoint every PIECE keeps the event loop responsive
            out += self._parse(data[i : i + PIECE])
            await trio.lowlevel.checkpoint()
        return out

    def _pull(self) -> bytes:
        """Blocking: the next CHUNK of the manifest (b"" at its end), counted against the caps."""
        pkg, lim = self.pkg, self.pkg.limits
        try:
            if self.file is None:
                self.file = pkg.zf.open(self.info)
            data = self.file.read(min(CHUNK, lim.max_manifest_bytes - self.read + 1))
        except Exception as exc:
            raise pkg.error(f"cannot read manifest: {exc}", MANIFEST_NAME) from None
        self.read += len(data)
        if self.read > lim.max_manifest_bytes:
            raise pkg.error(
                f"manifest is larger than max_manifest_bytes={lim.max_manifest_bytes}", MANIFEST_NAME
            )
        if self.count and data:
            pkg.count_total(len(data), MANIFEST_NAME)
        return data

    def _parse(self, data: bytes | None) -> list[Head | Entry]:
        """Feed the parser (``None``: the end); trio thread only."""
        try:
            return self.reader.feed(data) if data is not None else self.reader.close()
        except DocumentError as exc:
            raise self.pkg.error(f"bad manifest: line {exc.line}: {exc.reason}", MANIFEST_NAME) from None
        except Exception as exc:
            raise self.pkg.error(f"cannot read manifest: {exc}", MANIFEST_NAME) from None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _check_head(pkg: _Package, head: Head) -> None:
    if head.is_index or head.capability not in MANIFEST_KINDS:
        raise pkg.error(
            f"manifest is a {model.kind_name(head)}, expected a Resource Dump or Change Dump Manifest",
            MANIFEST_NAME,
        )


def _entry_member(pkg: _Package, entry: Entry, *, note: bool = False) -> tuple[str, zipfile.ZipInfo] | None:
    """The (path, ZipInfo) an entry refers to, None for a deletion; raises DumpError for a bad reference.

    A path without its leading ``/`` (resync-build's and CORE's packages) is read from the package root
    (a tolerated deviation, noted when ``note``: in the first pass only, so once per entry).
    """
    md = entry.md
    if md is not None and md.change == model.DELETED:
        return None  # §13.2: no bitstream for a deletion (a stray path is ignored)
    path = given = md.path if md is not None else None
    if path and not path.startswith("/"):
        if note:
            deviation(
                "dump-path-no-slash", _manifest_url(pkg.url), entry.line,
                f"manifest path {path!r} lacks the leading '/' (§11.2, §13.2); read from the package root",
            )  # fmt: skip
        path = "/" + path
    try:
        name = member_name(path)
    except ValueError as exc:
        where = f"entry {entry.loc!r} (manifest line {entry.line})"
        raise pkg.error(f"unsafe or invalid manifest path for {where}: {exc}", given or None) from None
    info = pkg.members.get(name)
    if info is None:
        raise pkg.error(f"manifest path names a file that is not in the ZIP (entry {entry.loc!r})", given)
    return "/" + name, info


async def _pass_one(pkg: _Package) -> int:
    """Parse the whole manifest once and check every reference before anything is yielded; returns how
    many entries it has (what a baseline's progress counts towards)."""
    stream = _ManifestStream(pkg, count=True)
    state = {"entries": 0, "claimed": 0}

    def check(items: list[Head | Entry]) -> None:
        lim = pkg.limits
        for item in items:
            if isinstance(item, Head):
                _check_head(pkg, item)
                continue
            state["entries"] += 1
            if state["entries"] > lim.max_members:
                raise pkg.error(
                    f"manifest has more than max_members={lim.max_members} entries", MANIFEST_NAME
                )
            ref = _entry_member(pkg, item, note=True)
            if ref is None:
                continue
            path, info = ref
            _check_header(pkg, info, path, item.md.length if item.md else None)
            state["claimed"] += info.file_size
            if state["claimed"] > lim.max_total_uncompressed:
                raise pkg.error(
                    f"manifest members exceed max_total_uncompressed={lim.max_total_uncompressed}",
                    path,
                )

    try:
        while not stream.done:
            check(await stream.step())
    finally:
        stream.close()
    return state["entries"]


@dataclass
class _Member:
    """A member being copied into the store, possibly across several hops."""

    entry: Entry
    path: str
    info: zipfile.ZipInfo
    writer: BlobWriter | None = None
    file: IO[bytes] | None = None
    out: int = 0

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


@dataclass
class _Copier:
    """Pass 2 state: entries waiting, the member in progress, and items finished but not yet yielded."""

    pkg: _Package
    store: BlobStore
    pending: deque[Entry] = field(default_factory=deque)
    current: _Member | None = None
    ready: deque[DumpItem] = field(default_factory=deque)

    def hop(self) -> None:
        """Blocking: copy members until CHUNK bytes or MEMBERS_PER_HOP members are done."""
        budget = CHUNK
        finished = 0
        while budget > 0 and finished < MEMBERS_PER_HOP and (self.current is not None or self.pending):
            if self.current is None:
                entry = self.pending.popleft()
                ref = _entry_member(self.pkg, entry)
                if ref is None:
                    self.ready.append(DumpItem(entry))
                    finished += 1
                    continue
                self.current = _Member(entry, ref[0], ref[1])
            budget -= self._copy(self.current, budget)
            if self.current.file is None and self.current.writer is not None:
                self.ready.append(self._finish(self.current))
                self.current = None
                finished += 1

    def _copy(self, m: _Member, budget: int) -> int:
        """Stream up to ``budget`` bytes of a member into its writer, enforcing the caps on real counts."""
        pkg, lim = self.pkg, self.pkg.limits
        md = m.entry.md
        length = md.length if md is not None else None
        cap = lim.max_member_bytes if length is None else min(lim.max_member_bytes, length)
        used = 0
        try:
            if m.writer is None:
                # Small members stay in memory until their commit (as fetched bodies do): a dump of
                # many small records becomes rows of the file store's small.db, not a file each.
                m.writer = begin_spooled(self.store, frozenset(md.hashes if md is not None else ()))
                m.file = pkg.zf.open(m.info)
            f = m.file
            assert f is not None
            while used < budget:
                # Ask for at most one byte past the cap: we never inflate much more than we allow.
                data = f.read(min(PIECE, cap - m.out + 1))
                if not data:
                    f.close()
                    m.file = None
                    break
                m.out += len(data)
                used += len(data)
                if m.out > cap:
                    if cap == length:
                        raise pkg.error(f"length mismatch: manifest says {length}, member is longer", m.path)
                    raise pkg.error(f"member inflates beyond max_member_bytes={lim.max_member_bytes}", m.path)
                if m.out > lim.ratio_min_bytes and m.out > lim.max_ratio * max(m.info.compress_size, 1):
                    raise pkg.error(f"member compression ratio exceeds {lim.max_ratio}", m.path)
                pkg.count_total(len(data), m.path)
                m.writer.write(data)
        except DumpError:
            m.abort()
            raise
        except Exception as exc:  # zlib.error, BadZipFile (bad CRC), EOFError, unsupported method...
            m.abort()
            raise pkg.error(f"cannot read member: {type(exc).__name__}: {exc}", m.path) from None
        return used

    def _finish(self, m: _Member) -> DumpItem:
        """Close the blob and check it against the manifest's length and hashes (§7)."""
        writer = m.writer
        assert writer is not None
        info = writer.finish()
        md = m.entry.md
        problems = []
        if md is not None and md.length is not None and info.length != md.length:
            problems.append(f"length mismatch: manifest says {md.length}, member has {info.length}")
        expected = md.hashes if md is not None else {}
        for algo in mismatches(expected, info.hashes):
            problems.append(
                f"{algo} mismatch: manifest says {expected[algo]}, member has {info.hashes[algo]}"
            )
        if problems:
            writer.abort()
            m.writer = None
            raise self.pkg.error("; ".join(problems), m.path)
        m.writer = None
        return DumpItem(m.entry, writer, info)

    def abort_all(self) -> None:
        if self.current is not None:
            self.current.abort()
            self.current = None
        for item in self.ready:
            if item.blob is not None:
                item.blob.abort()
        self.ready.clear()


async def read_package(
    path: Path,
    url: str,
    store: BlobStore,
    *,
    limits: DumpLimits | None = None,
    on_count: Callable[[int], None] | None = None,
) -> AsyncGenerator[DumpItem]:
    """Yield the manifest entries of a downloaded package (§11.2, §13.2) in manifest order.

    Each created/updated/resource entry comes with a finished (not committed) BlobWriter verified against
    the manifest; deletions come with ``blob=None``. Raises DumpError. Use ``contextlib.aclosing`` when the
    loop may stop early, so the unconsumed writers are aborted at once. ``on_count`` gets the manifest's
    number of entries once the first pass has read it (a baseline's progress total).
    """
    limits = limits or DumpLimits()
    pkg = await trio.to_thread.run_sync(_open, Path(path), url, limits)
    copier = _Copier(pkg, store)
    stream: _ManifestStream | None = None
    try:
        entries = await _pass_one(pkg)
        if on_count is not None:
            on_count(entries)
        stream = _ManifestStream(pkg, count=False)
        while True:
            if not copier.pending and copier.current is None:
                if stream.done:
                    break
                items = await stream.step()
                copier.pending.extend(i for i in items if isinstance(i, Entry))
                continue
            await trio.to_thread.run_sync(copier.hop)
            while copier.ready:
                item = copier.ready.popleft()
                yield item
    finally:
        copier.abort_all()
        if stream is not None:
            stream.close()
        pkg.zf.close()


async def read_manifest(
    path: Path, url: str, *, limits: DumpLimits | None = None
) -> AsyncGenerator[tuple[Head, Entry]]:
    """The entries of a downloaded package's ``manifest.xml`` (§11.2, §13.2), streamed, with its head;
    no bitstream is read. For whoever must know what a package holds without storing it (``rsagg
    audit`` of a dump whose packages have no ``rel="contents"`` link, which §11.1 makes optional)."""
    limits = limits or DumpLimits()
    pkg = await trio.to_thread.run_sync(_open, Path(path), url, limits)
    stream: _ManifestStream | None = None
    head: Head | None = None
    try:
        stream = _ManifestStream(pkg, count=False)
        while not stream.done:
            for item in await stream.step():
                if isinstance(item, Head):
                    _check_head(pkg, item)
                    head = item
                elif head is None:
                    raise pkg.error("manifest entries before its <rs:md>", MANIFEST_NAME)
                else:
                    yield head, item
    finally:
        if stream is not None:
            stream.close()
        pkg.zf.close()


async def fetch_package(
    fetcher,
    package: Entry,
    store: BlobStore,
    folder: Path,
    *,
    limits: DumpLimits,
    on_count: Callable[[int], None] | None = None,
) -> AsyncGenerator[DumpItem]:
    """Download one package listed in a Resource Dump or Change Dump (verified against the dump's
    ``hash``/``length`` for it) into ``folder``, then yield its items; the file is removed afterwards."""
    from .fetch import Expected  # fetch imports parse; keep this module importable on its own

    path = folder / "package.zip"
    try:
        with path.open("wb") as f:
            await fetcher.download(
                package.loc, f, max_bytes=limits.max_package_bytes,
                expected=Expected(package.hashes, package.md.length if package.md else None),
            )  # fmt: skip
        items = read_package(path, package.loc, store, limits=limits, on_count=on_count)
        async with aclosing(items):
            async for item in items:
                yield item
    finally:
        path.unlink(missing_ok=True)
