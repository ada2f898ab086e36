"""rsagg's own Resource Dumps (§11) and Change Dumps (§13): ZIP packages built from the store.

Why packages: a Destination copying a set of 1,000,000 resources should not need 1,000,000 requests.

- A **Resource Dump** is one *run*: a snapshot of a published set's live resources, cut into packages of
  at most ``max_entries`` entries / ``max_bytes`` bytes of bitstreams (uncompressed). Each package is a ZIP
  with ``manifest.xml`` (§11.2, written first) and the bitstreams under ``/resources/<id>/<name>``. The
  Resource Dump document (§11.1) lists the packages of the newest run; the last ``keep`` runs stay
  downloadable so a Destination in the middle of a download is not cut off.
- A **Change Dump** has one package per *closed* Change List window of the publisher (global changelog
  seq windows of ``window_size``, see the publish contract), with the window's ``from``/``until``, so a
  package holds exactly the changes of Change List K (§13.1, §13.2). Windows without a change of the set
  get no package (like the Change List). Packages are immutable once built.

Every ZIP is streamed straight into a ``BlobWriter`` (never held in memory) and stored in the blob store
under its SHA-256; the manifest is also stored as a blob of its own, served at the ``rel="contents"`` URL
(§11.1, §13.1: "the Source needs to ensure that the referred Manifest corresponds with the Manifest
included in the bitstream package": both are the same bytes). Blobs are committed before the rows that
name them (docs/architecture.md invariant 2).

Bookkeeping lives in the state (runs and packages: ``StateStore.dump_*``, ``add_resource_dump``,
``add_change_dump``, ``prune_resource_dumps``; migrations 5 and 12 of store/state.py). ``gc`` must keep the
blobs they name: see ``referenced_hashes`` / ``DumpBuilder.referenced_hashes``.

One visibility rule for every view: a package holds what the Resource List and Change List show, under
the publish filter (``rsagg_filter_publish``) and configuration of the moment it was built. Each run and
package records the *fingerprint* of those (``publish/site.view_fingerprint``); every read asks for the
current fingerprint only, so once the filter or configuration changes (a restart, a reload) the packages
built under the old one are neither listed nor downloadable (404) from that moment, and the builder
deletes them (``withdraw``) and builds them again, Resource Dumps and closed Change Dump windows alike.

Building blocks the harvester is picky about (aggregator/harvest/dumps.py reads our packages too): member
paths are plain (``[A-Za-z0-9._-]`` names, no ``..``), every member is hashed while it is copied and
checked against its SHA-256 (a damaged blob fails the build instead of shipping), and a member whose
sample compresses better than ``MAX_DEFLATE_RATIO`` is stored, not deflated, so that no package trips a
reader's zip-bomb ratio check (ours refuses more than 200:1).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from email.utils import format_datetime, parsedate_to_datetime
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import Route

from ..rs import model
from ..rs.model import Entry, Head, Link, Md
from ..rs.w3cdt import utcnow
from ..rs.write import iter_document_bytes
from ..store.blobs import BlobInfo, BlobStore, BlobWriter
from ..store.interface import StateStore
from ..store.rows import DumpPackage, DumpPart, DumpRun, LogRecord, Resource
from ..store.sets import PublishedSet
from .documents import CACHE_CLOSED, CACHE_OPEN, Site, UriOf, Windows, change_entry, resource_entry
from .links import LinkPolicy
from .resources import http_date, validators_match
from .uris import number

log = logging.getLogger("rsagg.publish.dumps")

RESOURCEDUMP = model.RESOURCEDUMP
RESOURCEDUMP_ARCHIVE = model.RESOURCEDUMP_ARCHIVE
CHANGEDUMP_ARCHIVE = model.CHANGEDUMP_ARCHIVE
CHANGEDUMP = model.CHANGEDUMP
ZIP_TYPE = "application/zip"
XML_TYPE = "application/xml"
#: §11.2 / §13.2: "must be named manifest.xml and must be located at the top level of the ZIP package".
MANIFEST_NAME = "manifest.xml"
#: Bytes per read when copying a blob into a package; also the compressibility sample.
CHUNK = 1 << 20
#: A member whose first CHUNK deflates better than this is stored instead (readers cap the ratio; ours
#: at 200:1, counted once more than 1 MiB came out, so small members never matter: see _method).
MAX_DEFLATE_RATIO = 50
#: Below this a member is always deflated (its headers alone keep its ratio far below any cap).
SMALL_MEMBER = 4096
#: Worth deflating: samples that shrink by less than this factor are stored (saves CPU on both sides).
MIN_DEFLATE_RATIO = 1.1
#: §7: a document (a manifest is one) holds at most 50,000 entries.
MAX_MANIFEST_ENTRIES = 50_000
_ZIP_EPOCH = datetime(1980, 1, 1, tzinfo=UTC)
#: Media types never worth deflating in "auto" mode (already compressed).
_STORED_PREFIXES = ("image/", "audio/", "video/")
_STORED_TYPES = frozenset(
    {"application/zip", "application/gzip", "application/x-gzip", "application/x-bzip2", "application/x-xz",
     "application/zstd", "application/x-7z-compressed", "application/x-rar-compressed", "application/pdf",
     "application/epub+zip", "application/java-archive"}
)  # fmt: skip
_COMPRESSIBLE_IMAGES = frozenset({"image/svg+xml", "image/bmp", "image/x-portable-anymap", "image/tiff"})
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class DumpBuildError(Exception):
    """A package could not be built (a blob missing or damaged, ...); nothing of it was published."""


@dataclass(frozen=True, slots=True)
class PackageInfo:
    """One published package: where it is, what it holds, what it covers."""

    set_name: str
    kind: str  # "resourcedump" | "changedump"
    number: int  # URL number: package id (resourcedump) or window K (changedump)
    url: str
    manifest_url: str
    sha256: str
    length: int
    manifest_sha256: str
    manifest_length: int
    entries: int
    bytes: int
    created: datetime
    at: datetime | None = None
    completed: datetime | None = None
    from_: datetime | None = None
    until: datetime | None = None
    run: int | None = None
    part: int = 1


@dataclass(slots=True)
class _Member:
    """One entry of a package being built: its manifest entry and the blob that goes with it."""

    entry: Entry
    sha256: str | None  # None: a deletion (no bitstream, §13.2)
    length: int
    name: str | None  # ZIP member name (the manifest path without its leading slash)
    when: datetime


@dataclass(slots=True)
class _Built:
    zip_writer: BlobWriter
    zip_info: BlobInfo
    manifest_writer: BlobWriter
    manifest_info: BlobInfo
    entries: int
    bytes: int

    def abort(self) -> None:
        self.zip_writer.abort()
        self.manifest_writer.abort()


class _WriterFile:
    """A write-only, non-seekable file over a BlobWriter, for ``zipfile`` (it then uses data descriptors)."""

    def __init__(self, writer: BlobWriter) -> None:
        self._w = writer
        self._pos = 0

    def write(self, data: bytes) -> int:
        self._w.write(bytes(data))
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        """Nothing: ``zipfile`` never closes a file it is given (the caller commits the blob writer)."""


# ---------------------------------------------------------------------------------------------------


class DumpBuilder:
    """Builds, records, prunes and describes the dump packages of published sets (blocking methods).

    Manifest entries are made by ``publish/documents.py`` (``resource_entry``, ``change_entry``: the same
    loc, fixity, links and extras as the Resource List and Change List) plus the ``path`` of the
    bitstream; Change Dump windows are ``documents.Windows``, so package K covers exactly Change List K.
    ``site`` gives the link policy and the other published sets (for ``describedby`` rewrites); without
    it the default policy and no other sets are used.
    """

    def __init__(
        self,
        state: StateStore,
        blobs: BlobStore,
        *,
        base_url: str,
        site: Site | None = None,
        max_entries: int = 10_000,
        max_bytes: int = 2**30,
        keep: int = 2,
        compression: str = "auto",
        clock: Callable[[], datetime] = utcnow,
        fingerprint: Callable[[], str] | None = None,
        site_of: Callable[[StateStore], Site] | None = None,
    ) -> None:
        if not 1 <= max_entries <= MAX_MANIFEST_ENTRIES:
            raise ValueError(f"max_entries must be in 1..{MAX_MANIFEST_ENTRIES} (§7 document limit)")
        if max_bytes < 1 or keep < 1:
            raise ValueError("max_bytes and keep must be positive")
        if compression not in ("auto", "deflated", "stored"):
            raise ValueError(f"compression must be auto, deflated or stored, not {compression!r}")
        self.state = state
        self.blobs = blobs
        self.base_url = base_url.rstrip("/")
        if site is None:
            site = Site(base_url=self.base_url, sets={}, policy=LinkPolicy(), changelist_size=10_000)
        self.site = replace(site, base_url=self.base_url)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.keep = keep
        self.compression = compression
        self._clock = clock
        #: The fingerprint of the publish filter and configuration running now (a getter: a reload
        #: changes it); without one, every dump is built and read under "".
        self.fingerprint: Callable[[], str] = fingerprint or (lambda: "")
        #: The Site of the running configuration and plugins, for ``refresh`` (None: ``site`` stays).
        self._site_of = site_of
        self._lock = threading.Lock()  # the build locks' table, the withdrawal
        self._build_locks: dict[tuple[str, str], threading.Lock] = {}
        self._withdrawn_for: str | None = None  # the fingerprint the last withdrawal kept
        self._view: tuple[Site, str] | None = None  # refresh's Site and its fingerprint

    def close(self) -> None:
        """Nothing of its own to close (``state`` belongs to the caller)."""

    # -- URLs (documents.Site has the rest of the layout) -----------------------------------------------

    def document_url(self, set_name: str, kind: str) -> str:
        return f"{self.base_url}/{set_name}/{kind}.xml"

    def package_url(self, set_name: str, kind: str, number: int) -> str:
        return f"{self.base_url}/{set_name}/{kind}/{number}.zip"

    def manifest_url(self, set_name: str, kind: str, number: int) -> str:
        return f"{self.base_url}/{set_name}/{kind}/{number}/{MANIFEST_NAME}"

    # -- the filter and configuration of the moment ------------------------------------------------

    def refresh(self) -> str:
        """Take the running configuration and plugins (the Site every package is built with, and its
        fingerprint, read as one pair) and withdraw what was built under another fingerprint; returns
        the current fingerprint (blocking)."""
        if self._site_of is None:
            return self._withdraw(self.fingerprint())
        while True:  # a reload between the two reads: read again, never a Site with another's name
            fp = self.fingerprint()
            site = replace(self._site_of(self.state), base_url=self.base_url)
            if self.fingerprint() == fp:
                break
        self.site, self._view = site, (site, fp)
        return self._withdraw(fp)

    def _snapshot(self) -> tuple[Site, str]:
        """The Site a build uses and the fingerprint its rows are recorded under (one pair), once what
        was built under another fingerprint is withdrawn."""
        if self._site_of is None:
            site, fp = self.site, self.fingerprint()
        else:
            if self._view is None:
                self.refresh()
            assert self._view is not None
            site, fp = self._view
        self._withdraw(fp)
        return site, fp

    def _withdraw(self, fp: str) -> str:
        """Withdraw every run and package not built under ``fp``: their rows deleted (reads already
        ignore them), then the blobs nothing else names."""
        with self._lock:
            if fp == self._withdrawn_for:
                return fp
            shas = self.state.withdraw_dumps(fp)
            self._withdrawn_for = fp
        if shas:
            log.warning(
                "dumps built under another publish filter or configuration withdrawn (%d blobs); "
                "they are built again", len(shas),
            )  # fmt: skip
            self._release(shas)
        return fp

    # -- bookkeeping -------------------------------------------------------------------------------

    def _build_lock(self, set_name: str, kind: str) -> threading.Lock:
        with self._lock:
            return self._build_locks.setdefault((set_name, kind), threading.Lock())

    def _info(self, row: DumpPackage) -> PackageInfo:
        kind = row.kind
        number = row.id if kind == RESOURCEDUMP else row.window
        assert number is not None
        return PackageInfo(
            set_name=row.set_name, kind=kind, number=number,
            url=self.package_url(row.set_name, kind, number),
            manifest_url=self.manifest_url(row.set_name, kind, number),
            sha256=row.sha256, length=row.length, manifest_sha256=row.manifest_sha256,
            manifest_length=row.manifest_length, entries=row.entries, bytes=row.bytes,
            created=row.created, at=row.at, completed=row.completed,
            from_=row.from_, until=row.until, run=row.run, part=row.part,
        )  # fmt: skip

    # -- reads (also used by the routes) -------------------------------------------------------------

    def latest_run(self, set_name: str) -> DumpRun | None:
        return self.state.dump_latest_run(set_name, self.fingerprint())

    def resource_dump_packages(self, set_name: str, run: DumpRun | None = None) -> list[PackageInfo]:
        """The packages of a run, by default the newest (what ``/SET/resourcedump.xml`` lists)."""
        if run is None:
            run = self.latest_run(set_name)
        if run is None:
            return []
        return [self._info(r) for r in self.state.dump_run_packages(run.id)]

    def change_dump_packages(self, set_name: str) -> list[PackageInfo]:
        """Every Change Dump package of the set, in window (== chronological) order."""
        return [self._info(r) for r in self.state.change_dump_packages(set_name, self.fingerprint())]

    def package(self, set_name: str, kind: str, number: int) -> PackageInfo | None:
        """A package by its URL number (also an older, still kept Resource Dump run's package)."""
        row = self.state.dump_package(set_name, kind, number, self.fingerprint())
        return self._info(row) if row else None

    def available(self, set_name: str) -> dict[str, str]:
        """Capability -> document URL, for the Capability List (§9): only what has been built."""
        out: dict[str, str] = {}
        if self.latest_run(set_name) is not None:
            out[RESOURCEDUMP] = self.document_url(set_name, RESOURCEDUMP)
            out[RESOURCEDUMP_ARCHIVE] = self.document_url(set_name, RESOURCEDUMP_ARCHIVE)
        if self.state.has_change_dump(set_name, self.fingerprint()):
            out[CHANGEDUMP] = self.document_url(set_name, CHANGEDUMP)
            out[CHANGEDUMP_ARCHIVE] = self.document_url(set_name, CHANGEDUMP_ARCHIVE)
        return out

    def referenced_hashes(self) -> Iterator[str]:
        """Every blob a dump names, ascending (for gc, alongside ``State.referenced_hashes``)."""
        return self.state.dump_hashes()

    # -- documents (§11.1, §13.1) --------------------------------------------------------------------

    def resource_dump_document(
        self, set_name: str, run_id: int | None = None
    ) -> tuple[Head, list[Entry]] | None:
        """The Resource Dump of the newest run, or of the kept run ``run_id`` (the archive's entries);
        None when there is no such run. Each points at the archive of past runs (``rel="archives"``)."""
        if run_id is None:
            run = self.latest_run(set_name)
        else:
            run = next((r for r in self.runs(set_name) if r.id == run_id), None)
        if run is None:
            return None
        head = Head(
            model.URLSET,
            Md(capability=RESOURCEDUMP, at=run.at, completed=run.completed),
            [
                Link(rel="up", href=self.site.capabilitylist(set_name)),
                Link(rel="archives", href=self.document_url(set_name, RESOURCEDUMP_ARCHIVE)),
            ],
        )
        return head, [_package_entry(p) for p in self.resource_dump_packages(set_name, run)]

    def runs(self, set_name: str) -> list[DumpRun]:
        return self.state.dump_runs(set_name, self.fingerprint())

    def run_url(self, set_name: str, run_id: int) -> str:
        """The Resource Dump document of one kept run (the newest also has ``/SET/resourcedump.xml``)."""
        return f"{self.base_url}/{set_name}/{RESOURCEDUMP}/run/{run_id}.xml"

    # -- Archives (ResourceSync Archives draft: resourcedump-archive, changedump-archive) -------------

    def resource_dump_archive(self, set_name: str) -> tuple[Head, list[Entry]] | None:
        """The kept Resource Dump runs (``keep``), oldest first: one Resource Dump document each, with its
        ``at``/``completed`` and ``lastmod`` = completed, so a Destination finds past snapshots."""
        runs = self.runs(set_name)
        if not runs:
            return None
        head = Head(
            model.URLSET,
            Md(capability=RESOURCEDUMP_ARCHIVE),
            [Link(rel="up", href=self.site.capabilitylist(set_name))],
        )
        entries = [
            Entry(self.run_url(set_name, r.id), lastmod=r.completed, md=Md(at=r.at, completed=r.completed))
            for r in runs
        ]
        return head, entries

    def change_dump_archive(self, set_name: str) -> tuple[Head, list[Entry]] | None:
        """The past Change Dumps: rsagg's Change Dump is one open document that keeps every package
        (they are immutable and never pruned), so its archive lists that one document, ``from`` its
        first package, without ``until`` (it is still open)."""
        packages = self.change_dump_packages(set_name)
        if not packages:
            return None
        head = Head(
            model.URLSET,
            Md(capability=CHANGEDUMP_ARCHIVE),
            [Link(rel="up", href=self.site.capabilitylist(set_name))],
        )
        last = max(p.created for p in packages)
        entry = Entry(self.document_url(set_name, CHANGEDUMP), lastmod=last, md=Md(from_=packages[0].from_))
        return head, [entry]

    def change_dump_document(self, set_name: str) -> tuple[Head, list[Entry]] | None:
        """The Change Dump: open (no ``until``, more packages will come), from = the first package's."""
        packages = self.change_dump_packages(set_name)
        if not packages:
            return None
        head = Head(
            model.URLSET,
            Md(capability=CHANGEDUMP, from_=packages[0].from_),
            [
                Link(rel="up", href=self.site.capabilitylist(set_name)),
                Link(rel="archives", href=self.document_url(set_name, CHANGEDUMP_ARCHIVE)),
            ],
        )
        return head, [_package_entry(p) for p in packages]

    # -- Resource Dumps (§11) ----------------------------------------------------------------------------

    def build_resource_dump(
        self, set_name: str, state_set_ids: Sequence[int], *, force: bool = False
    ) -> list[PackageInfo]:
        """Snapshot the live resources of ``state_set_ids`` as a new Resource Dump run of ``set_name``.

        Returns the packages built now: [] when nothing changed in those sets since the last run (unless
        ``force``). A run with no live resource is recorded too (an empty Resource Dump), so that a set
        emptied upstream stops offering stale packages. Older runs beyond ``keep`` are pruned.
        """
        ids = sorted(set(state_set_ids))
        if not ids:
            return []  # nothing harvested into the set yet: no snapshot to offer
        with self._build_lock(set_name, RESOURCEDUMP):
            site, fp = self._snapshot()
            last = self.state.dump_latest_run(set_name, fp)
            if last is not None and not force and not self._changed_since(last, ids):
                return []
            last_seq = self.state.last_seq()
            run_at = self._now()
            built: list[tuple[_Built, datetime, datetime]] = []
            try:
                # Every package's `at` is the run's: rows are read in pages ahead of the package that
                # uses them, so only the run's start is before every read (§11.2 at: the guarantee).
                # `completed` is when the package's last row had been read.
                for members in self._resource_batches(site, set_name, ids):
                    completed = self._now()
                    head = Head(
                        model.URLSET,
                        Md(capability=model.RESOURCEDUMP_MANIFEST, at=run_at, completed=completed),
                        [Link(rel="up", href=site.capabilitylist(set_name))],
                    )
                    built.append((self._write_package(head, members), run_at, completed))
                run_completed = built[-1][2] if built else self._now()
                self.blobs.commit([w for b, _, _ in built for w in (b.zip_writer, b.manifest_writer)])
            except BaseException:
                for b, _, _ in built:
                    b.abort()
                raise
            infos = self._record_run(set_name, ids, last_seq, run_at, run_completed, built, fp)
            self._prune(set_name)
            log.info(
                "set=%s resource dump: %d package(s), %d entries, %d bytes",
                set_name, len(infos), sum(p.entries for p in infos), sum(p.bytes for p in infos),
            )  # fmt: skip
            return infos

    def _changed_since(self, run: DumpRun, ids: list[int]) -> bool:
        if list(run.set_ids) != ids:
            return True
        return any(next(self.state.iter_changelog(run.last_seq, set_id=s, limit=1), None) for s in ids)

    def _resource_batches(self, site: Site, set_name: str, ids: list[int]) -> Iterator[list[_Member]]:
        """Live resources in id order, cut at max_entries / max_bytes (a lone big resource gets its own)."""
        ps = PublishedSet(set_name, tuple(ids))
        uri_of = UriOf(site, self.state, ps)
        batch: list[_Member] = []
        size = 0
        for r in self.state.iter_live(ids):
            if not site.visible(set_name, r):
                continue  # hidden by a publish filter: the Resource List leaves it out too
            if r.sha256 is None:
                log.warning("set=%s %s: live resource without content hash, left out", set_name, r.uri)
                continue
            member = self._resource_member(site, ps, r, uri_of)
            if batch and (len(batch) >= self.max_entries or size + member.length > self.max_bytes):
                yield batch
                batch, size = [], 0
            batch.append(member)
            size += member.length
        if batch:
            yield batch

    def _resource_member(self, site: Site, ps: PublishedSet, r: Resource, uri_of: UriOf) -> _Member:
        """§11.2: the Resource List entry plus the bitstream's path (and type, recommended there)."""
        assert r.sha256 is not None
        entry = resource_entry(site, ps, r, uri_of)
        return self._member(entry, r.sha256, r.length, f"resources/{r.id}/{_file_name(r.uri)}", r.updated_at)

    def _member(self, entry: Entry, sha256: str, length: int | None, name: str, when: datetime) -> _Member:
        md = entry.md = entry.md or Md()
        if length is None:
            length = md.length = self._blob_size(sha256, entry.loc)
        md.path = "/" + name
        if md.type is None:  # what GET of the resource answers then (publish/resources.py)
            md.type = "application/octet-stream"
        return _Member(entry, sha256, length, name, when)

    def _record_run(
        self,
        set_name: str,
        ids: list[int],
        last_seq: int,
        at: datetime,
        completed: datetime,
        built: list[tuple[_Built, datetime, datetime]],
        fingerprint: str,
    ) -> list[PackageInfo]:
        parts = [
            DumpPart(b.zip_info.sha256, b.zip_info.length, b.manifest_info.sha256, b.manifest_info.length,
                     b.entries, b.bytes, at=pkg_at, completed=pkg_completed)
            for b, pkg_at, pkg_completed in built
        ]  # fmt: skip
        rows = self.state.add_resource_dump(
            set_name, ids, last_seq, at, completed, parts, self._now(), fingerprint
        )
        return [self._info(r) for r in rows]

    def _prune(self, set_name: str) -> None:
        """Keep the newest ``keep`` runs; drop the rows of older ones, then their blobs if nothing else
        names them (another dump row, or a resource/changelog/document of the State)."""
        shas = self.state.prune_resource_dumps(set_name, self.keep)
        self._release(shas)

    def _release(self, shas: set[str]) -> None:
        """Delete blobs no dump row and no State row names any more."""
        if not shas:
            return
        still = {sha for sha in self.referenced_hashes() if sha in shas}
        candidates = shas - still
        if not candidates:
            return
        for sha in self.state.referenced_hashes():  # one sorted pass; pruning is rare (once per dump)
            candidates.discard(sha)
        for sha in sorted(candidates):
            self.blobs.delete(sha)

    # -- Change Dumps (§13) ------------------------------------------------------------------------------

    def build_change_dumps(
        self, set_name: str, state_set_ids: Sequence[int], window_size: int
    ) -> list[PackageInfo]:
        """Build the missing packages of the set's closed Change List windows, in order; returns them.

        Windows are ``documents.Windows`` with ``window_size`` (= ``publish.changelist_size``): window K
        holds the set's records with (K-1)*N < seq <= K*N and is closed once the global last seq reaches
        K*N; windows without a record of the set are not listed and get no package. Stops at the first
        window that cannot be built (raises DumpBuildError), so packages never appear out of order.
        """
        if window_size < 1:
            raise ValueError("window_size must be positive")
        ids = sorted(set(state_set_ids))
        out: list[PackageInfo] = []
        if not ids:
            return out
        ps = PublishedSet(set_name, tuple(ids))
        with self._build_lock(set_name, CHANGEDUMP):
            site, fp = self._snapshot()
            site = replace(site, changelist_size=window_size)
            windows = Windows(site, self.state, ps, self._now())
            done = {p.window for p in self.state.change_dump_packages(set_name, fp)}
            for k in windows.listed:
                if k < windows.open_k and k not in done:
                    out.append(self._build_window(site, ps, windows, k, fp))
        return out

    def _build_window(
        self, site: Site, ps: PublishedSet, windows: Windows, k: int, fingerprint: str
    ) -> PackageInfo:
        w = windows.window(k)
        if w is None or w.until is None:
            raise DumpBuildError(f"set {ps.name}: window {k} is not closed")
        n = windows.size
        head = Head(
            model.URLSET,
            Md(capability=model.CHANGEDUMP_MANIFEST, from_=w.from_, until=w.until),
            [Link(rel="up", href=site.capabilitylist(ps.name))],
        )
        uri_of = UriOf(site, self.state, ps)
        members = []
        for rec, row in self.state.iter_log_range(ps.set_ids, (k - 1) * n, k * n):
            if not site.shows(ps.name, row):
                continue  # hidden by a publish filter: the Change List leaves it out too
            member = self._change_member(site, ps, rec, row, uri_of)
            if member is not None:
                members.append(member)
        if len(members) > MAX_MANIFEST_ENTRIES:
            log.warning("set=%s change dump %d: %d entries exceed §7's 50,000", ps.name, k, len(members))
        built = self._write_package(head, members)
        try:
            self.blobs.commit([built.zip_writer, built.manifest_writer])
        except BaseException:
            built.abort()
            raise
        part = DumpPart(
            built.zip_info.sha256, built.zip_info.length, built.manifest_info.sha256,
            built.manifest_info.length, built.entries, built.bytes, from_=w.from_, until=w.until,
        )  # fmt: skip
        info = self._info(
            self.state.add_change_dump(ps.name, k, (k - 1) * n, k * n, part, self._now(), fingerprint)
        )
        log.info("set=%s change dump %d: %d entries, %d bytes", ps.name, k, info.entries, info.bytes)
        return info

    def _change_member(
        self, site: Site, ps: PublishedSet, rec: LogRecord, row: Resource | None, uri_of: UriOf
    ) -> _Member | None:
        """§13.2: the Change List entry (change, datetime, fixity, links) plus the path, except for a
        deletion, which has no bitstream."""
        entry = change_entry(site, ps, rec, row, uri_of)
        if rec.change == model.DELETED:
            return _Member(entry, None, 0, None, rec.datetime)
        if rec.sha256 is None:
            log.warning("set=%s seq=%d %s: change without content hash, left out", ps.name, rec.seq, rec.uri)
            return None
        name = f"changes/{rec.seq}/{_file_name(rec.uri)}"
        return self._member(entry, rec.sha256, rec.length, name, rec.datetime)

    # -- packages ------------------------------------------------------------------------------------

    def _write_package(self, head: Head, members: list[_Member]) -> _Built:
        """Stream one ZIP into a blob: manifest.xml first (also teed into its own blob), then bitstreams."""
        zw = self.blobs.begin()
        mw = self.blobs.begin()
        try:
            with zipfile.ZipFile(_WriterFile(zw), "w", allowZip64=True) as zf:
                md = head.md
                assert md is not None  # the manifests built here always carry rs:md
                info = _zip_info(MANIFEST_NAME, md.at or md.until or self._now(), zipfile.ZIP_DEFLATED)
                with zf.open(info, "w") as out:
                    for chunk in iter_document_bytes(head, (m.entry for m in members)):
                        out.write(chunk)
                        mw.write(chunk)
                total = 0
                for m in members:
                    if m.sha256 is not None:
                        self._copy(zf, m)
                        total += m.length
            return _Built(zw, zw.finish(), mw, mw.finish(), len(members), total)
        except BaseException:
            zw.abort()
            mw.abort()
            raise

    def _copy(self, zf: zipfile.ZipFile, m: _Member) -> None:
        """Copy one blob into the ZIP, checking it is the bytes its SHA-256 names."""
        assert m.sha256 is not None and m.name is not None
        try:
            f: BinaryIO = self.blobs.open(m.sha256)
        except FileNotFoundError:
            raise DumpBuildError(f"{m.entry.loc}: blob {m.sha256} is missing from the store") from None
        with f:
            data = f.read(CHUNK)
            md = m.entry.md
            info = _zip_info(
                m.name, m.when, self._method(md.type if md else None, md.encoding if md else None, data)
            )
            info.file_size = m.length  # lets zipfile choose ZIP64 before writing (members > 2 GiB)
            h = hashlib.sha256()
            n = 0
            with zf.open(info, "w") as out:
                while data:
                    h.update(data)
                    n += len(data)
                    out.write(data)
                    data = f.read(CHUNK)
        if h.hexdigest() != m.sha256 or n != m.length:
            raise DumpBuildError(
                f"{m.entry.loc}: blob {m.sha256} is damaged ({n} bytes, sha-256 {h.hexdigest()}, "
                f"expected {m.length} bytes)"
            )

    def _method(self, type_: str | None, encoding: str | None, sample: bytes) -> int:
        """Deflate what is worth it and safe for readers' ratio caps; store the rest."""
        if self.compression == "stored":
            return zipfile.ZIP_STORED
        if self.compression == "auto" and (encoding or not _compressible_type(type_)):
            return zipfile.ZIP_STORED
        if len(sample) < SMALL_MEMBER:
            return zipfile.ZIP_DEFLATED
        ratio = len(sample) / max(len(zlib.compress(sample, 1)), 1)
        if ratio > MAX_DEFLATE_RATIO or (self.compression == "auto" and ratio < MIN_DEFLATE_RATIO):
            return zipfile.ZIP_STORED
        return zipfile.ZIP_DEFLATED

    def _blob_size(self, sha256: str, uri: str) -> int:
        try:
            return self.blobs.size(sha256)
        except FileNotFoundError:
            raise DumpBuildError(f"{uri}: blob {sha256} is missing from the store") from None

    def _now(self) -> datetime:
        return self._clock().astimezone(UTC)


def referenced_hashes(state: StateStore) -> Iterator[str]:
    """The blobs dumps name, ascending, for gc to merge with ``StateStore.referenced_hashes``
    (heapq.merge): without it gc would delete every package. Nothing when no dump was ever built."""
    return state.dump_hashes()


def _package_entry(p: PackageInfo) -> Entry:
    """A Resource Dump / Change Dump entry (§11.1, §13.1; Appendix A: at/completed or from/until)."""
    md = Md(
        at=p.at, completed=p.completed, from_=p.from_, until=p.until,
        hash=f"sha-256:{p.sha256}", length=p.length, type=ZIP_TYPE,
    )  # fmt: skip
    return Entry(loc=p.url, md=md, links=[Link(rel="contents", href=p.manifest_url, type=XML_TYPE)])


def _file_name(uri: str) -> str:
    """A safe file name for a member, from the last path segment of the URI (readable when unpacked)."""
    p = urlsplit(uri)
    segment = p.path.rsplit("/", 1)[-1]
    name = _NAME_UNSAFE.sub("_", segment).lstrip(".")[:100]
    return name or "content"


def _compressible_type(type_: str | None) -> bool:
    if not type_:
        return True  # unknown: the sample decides
    t = type_.split(";", 1)[0].strip().lower()
    if t in _STORED_TYPES:
        return False
    if t.startswith(_STORED_PREFIXES):
        return t in _COMPRESSIBLE_IMAGES
    return True


def _zip_info(name: str, when: datetime, method: int) -> zipfile.ZipInfo:
    """A member header: UTC time (ZIP has no zone; never before 1980), rw-r--r--."""
    when = max(when.astimezone(UTC), _ZIP_EPOCH)
    info = zipfile.ZipInfo(
        name, date_time=(when.year, when.month, when.day, when.hour, when.minute, when.second)
    )
    info.compress_type = method
    info.external_attr = 0o644 << 16
    return info


# ---------------------------------------------------------------------------------------------------
# HTTP


def dump_routes(builder: DumpBuilder) -> list[Route]:
    """Starlette routes: the Resource Dump and Change Dump documents, the ZIPs and their manifests.

    ``/SET/resourcedump.xml``, ``/SET/resourcedump/<id>.zip``, ``/SET/resourcedump/<id>/manifest.xml``,
    ``/SET/changedump.xml``, ``/SET/changedump/<K>.zip``, ``/SET/changedump/<K>/manifest.xml``.
    """

    def document(kind: str) -> Callable[[Request], Any]:
        makers: dict[str, Callable[..., Any]] = {
            RESOURCEDUMP: builder.resource_dump_document,
            CHANGEDUMP: builder.change_dump_document,
            RESOURCEDUMP_ARCHIVE: builder.resource_dump_archive,
            CHANGEDUMP_ARCHIVE: builder.change_dump_archive,
            "run": lambda name, run_id: builder.resource_dump_document(name, run_id),
        }
        make = makers[kind]

        async def endpoint(request: Request) -> Response:
            args = [request.path_params["number"]] if kind == "run" else []
            doc = await run_in_threadpool(make, request.path_params["set"], *args)
            if doc is None:
                raise HTTPException(404)
            head, entries = doc  # one entry per package: small, written whole
            body = b"".join(iter_document_bytes(head, entries))
            times = [t for md in [head.md, *(e.md for e in entries)] if md is not None
                     for t in (md.at, md.completed, md.until) if t is not None]  # fmt: skip
            # Strong: equal bytes (RFC 9110 §8.8.1); it changes with every package built.
            headers = {"ETag": f'"{hashlib.sha256(body).hexdigest()[:32]}"', "Cache-Control": CACHE_OPEN}
            if times:
                headers["Last-Modified"] = http_date(max(times))
            if validators_match(request, headers["ETag"], max(times) if times else None):
                return Response(status_code=304, headers=headers)
            if request.method == "HEAD":  # the GET's length, no bytes
                return Response(
                    b"", media_type=XML_TYPE, headers={**headers, "Content-Length": str(len(body))}
                )
            return Response(body, media_type=XML_TYPE, headers=headers)

        return endpoint

    def blob(kind: str, zip_file: bool) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            p = request.path_params
            pkg = await run_in_threadpool(builder.package, p["set"], kind, p["number"])
            if pkg is None:
                raise HTTPException(404)
            if zip_file:
                sha, length, media_type = pkg.sha256, pkg.length, ZIP_TYPE
            else:
                sha, length, media_type = pkg.manifest_sha256, pkg.manifest_length, XML_TYPE
            return await _blob_response(request, builder.blobs, sha, length, media_type, pkg.created)

        return endpoint

    routes = []
    get = ["GET", "HEAD"]
    for kind in (RESOURCEDUMP, CHANGEDUMP):
        routes += [
            Route(f"/{{set}}/{kind}.xml", document(kind), methods=["GET", "HEAD"]),
            Route(f"/{{set}}/{kind}/{number('number')}.zip", blob(kind, True), methods=get),
            Route(f"/{{set}}/{kind}/{number('number')}/{MANIFEST_NAME}", blob(kind, False), methods=get),
        ]
    routes += [  # the Archives (draft): past Resource Dump runs kept (``keep``), the Change Dump
        Route(f"/{{set}}/{RESOURCEDUMP_ARCHIVE}.xml", document(RESOURCEDUMP_ARCHIVE), methods=get),
        Route(f"/{{set}}/{CHANGEDUMP_ARCHIVE}.xml", document(CHANGEDUMP_ARCHIVE), methods=get),
        Route(f"/{{set}}/{RESOURCEDUMP}/run/{number('number')}.xml", document("run"), methods=get),
    ]
    return routes


async def _blob_response(
    request: Request, blobs: BlobStore, sha256: str, length: int, media_type: str, created: datetime
) -> Response:
    """An immutable blob: strong ETag = its SHA-256, conditional GET, Range (via FileResponse) when local."""
    etag = f'"{sha256}"'
    headers = {"ETag": etag, "Last-Modified": format_datetime(created.astimezone(UTC), usegmt=True)}
    headers["Cache-Control"] = CACHE_CLOSED  # a package never changes (content-addressed)
    if _not_modified(request, etag, created):
        return Response(status_code=304, headers=headers)
    inline = await run_in_threadpool(blobs.read_inline, sha256)
    if inline is not None:  # a small manifest
        return Response(inline, media_type=media_type, headers=headers)
    path = blobs.local_path(sha256)
    if path is not None:
        exists = await run_in_threadpool(path.is_file)
        if not exists:
            raise HTTPException(404)
        return FileResponse(path, media_type=media_type, headers=headers)

    def chunks() -> Iterator[bytes]:
        with blobs.open(sha256) as f:
            yield from iter(lambda: f.read(CHUNK), b"")

    headers["Content-Length"] = str(length)
    return StreamingResponse(iterate_in_threadpool(chunks()), media_type=media_type, headers=headers)


def _not_modified(request: Request, etag: str, created: datetime) -> bool:
    inm = request.headers.get("if-none-match")
    if inm is not None:
        tags = [t.strip() for t in inm.split(",")]
        return "*" in tags or etag in tags or f"W/{etag}" in tags
    ims = request.headers.get("if-modified-since")
    if ims:
        try:
            since = parsedate_to_datetime(ims)
        except (TypeError, ValueError):
            return False
        if since.tzinfo is None:
            since = since.replace(tzinfo=UTC)
        return created.replace(microsecond=0) <= since
    return False


__all__ = [
    "DumpBuildError",
    "DumpBuilder",
    "PackageInfo",
    "dump_routes",
    "referenced_hashes",
]
