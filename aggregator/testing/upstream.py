"""A programmable ResourceSync Source (spec §8-§14) for the test suite and ``rsagg demo``.

The suite needs a Source it controls completely: one whose change history, timing, splitting into
indexes and misbehaviour can be set up by a test and then compared with what rsagg harvested. Real
peers (resync-build output served statically) cover "software nobody here wrote"; this one covers
every capability and every fault on demand.

State lives in memory. Every operation (create/update/delete) appends a ``ChangeRecord`` to the
set's change log with a strictly increasing UTC datetime (microsecond resolution, injectable clock).
Documents are rendered on request with ``aggregator.rs.write`` from that state.

URL layout (``<set>`` is a set name, ``<path>`` a resource path, both URL-quoted)::

    /.well-known/resourcesync                 Source Description (§8)
    /about, /<set>/about                      describedby targets of the above and the Capability List
    /<set>/capabilitylist.xml                 Capability List (§9)
    /<set>/resourcelist.xml                   Resource List, or Resource List Index above the page size (§10)
    /<set>/resourcelist-N.xml                 Resource List parts (N from 1)
    /<set>/resourcedump.xml                   Resource Dump (§11.1), one package:
    /<set>/resourcedump.zip                     ZIP with manifest.xml (§11.2) + resources/<path>
    /<set>/resourcedump-manifest.xml            copy of that manifest (rel="contents")
    /<set>/changelist.xml                     Change List Index if lists were closed, else the open list (§12)
    /<set>/changelist-N.xml                   Change Lists: closed 1..C, open C+1
    /<set>/changedump.xml                     Change Dump (§13.1), one package per closed Change List:
    /<set>/changedump-N.zip                     ZIP: manifest.xml (§13.2) + changes/<seq>/<path> + patches/
    /<set>/changedump-N-manifest.xml            copy of that manifest
    /<set>/patch/<seq>.json                   JSON Patch of change <seq> (§14.4)
    /<set>/res/<path>                         the resources
    /<set>/memento/<sha256>/<path>            every version ever held (§14.6), when ``mementos`` is set
    /<set>/moved/<sha256>/<path>              the same, reached by a redirect (``memento_faults``)
    /mirror/<set>/res/<path>                  their duplicates (§14.2), when ``mirror`` is set
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import re
import zipfile
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from functools import partial
from typing import Any, Literal
from urllib.parse import quote
from xml.sax.saxutils import escape

import anyio
import jsonpatch
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from aggregator.rs import model
from aggregator.rs.fixity import format_hash
from aggregator.rs.model import Entry, Head, Link, Md
from aggregator.rs.w3cdt import format_w3c, utcnow
from aggregator.rs.write import iter_document_bytes
from aggregator.run.serving import serve, serving

__all__ = [
    "META_SUFFIX",
    "PATCH_TYPE",
    "ChangeList",
    "ChangeRecord",
    "MementoFault",
    "StepClock",
    "Upstream",
    "Version",
    "canonical_json",
    "serve",
]

#: §14.4: the patch Media Type must allow unambiguous application; RFC 6902 JSON Patch does.
PATCH_TYPE = "application/json-patch+json"
#: Path suffix of the metadata record of a resource when ``metadata=True`` (§14.5).
META_SUFFIX = ".meta.xml"
DC_PROFILE = "http://purl.org/dc/elements/1.1/"
ZIP_TYPE = "application/zip"
XML_TYPE = "application/xml"
#: Packages are built on demand and kept (closed lists never change) up to this many bytes.
ZIP_CACHE_BYTES = 256 * 2**20

HostileDump = Literal["traversal", "bomb", "missing"]
#: How a resource's memento links misbehave (``Upstream.memento_faults``).
MementoFault = Literal["missing", "corrupt", "nohash", "redirect", "redirect-current", "elsewhere"]
#: A link-local address the outbound policy refuses (``memento_faults`` "elsewhere").
ELSEWHERE = "http://169.254.0.1:9"
MirrorMode = Literal["ok", "broken", "missing"]

_SET_NAME = re.compile(r"[A-Za-z0-9_-]+\Z")
_RESERVED_SETS = frozenset({"mirror", "about", ".well-known"})
_ZIP_EPOCH = datetime(1980, 1, 1, tzinfo=UTC)


def canonical_json(obj: Any) -> bytes:
    """The byte form of JSON resources written by ``patch_json``.

    A JSON Patch works on parsed values; a Destination that applies it must serialize the result, and
    only a canonical form lets it reproduce the announced hash: sorted keys, no whitespace, UTF-8.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class StepClock:
    """A deterministic clock for tests: every call returns a time ``step`` later than the previous one."""

    def __init__(self, start: datetime | None = None, step: timedelta = timedelta(seconds=1)) -> None:
        self.now = start or datetime(2024, 1, 1, tzinfo=UTC)
        self.step = step

    def __call__(self) -> datetime:
        self.now += self.step
        return self.now


@dataclass(frozen=True, slots=True)
class Version:
    """One state of a resource: bytes plus what the Source announces about them."""

    data: bytes
    type: str
    lastmod: datetime
    md5: str
    sha256: str
    links: tuple[Link, ...] = ()

    @property
    def length(self) -> int:
        return len(self.data)

    @classmethod
    def of(cls, data: bytes, type: str, lastmod: datetime, links: Iterable[Link] = ()) -> Version:
        return cls(
            data, type, lastmod, hashlib.md5(data).hexdigest(), hashlib.sha256(data).hexdigest(), tuple(links)
        )


@dataclass(frozen=True, slots=True)
class ChangeRecord:
    """One entry of a set's change log (§12.1); ``seq`` is its 1-based position in that log."""

    seq: int
    path: str
    change: str
    datetime: datetime
    version: Version | None  # None for deletions
    patch: bytes | None = None  # RFC 6902 patch from the previous version (§14.4)


@dataclass(slots=True)
class ChangeList:
    """A slice ``log[start:end]`` of a set's change log; closed once ``until`` is set (§12.1)."""

    number: int
    from_: datetime
    start: int
    until: datetime | None = None
    end: int | None = None


@dataclass(slots=True)
class _Snapshot:
    at: datetime
    completed: datetime
    items: list[tuple[str, Version]]  # sorted by path
    serial: int
    state_version: int


@dataclass(slots=True)
class _Set:
    name: str
    open: ChangeList  # the one open Change List; closed ones move to ``closed``
    resources: dict[str, Version] = field(default_factory=dict)
    #: Every version ever held, by (path, sha256): what the memento URIs serve (§14.6).
    versions: dict[tuple[str, str], Version] = field(default_factory=dict)
    log: list[ChangeRecord] = field(default_factory=list)
    closed: list[ChangeList] = field(default_factory=list)
    snapshot: _Snapshot | None = None
    state_version: int = 0


class Upstream:
    """An in-memory ResourceSync Source with one or more sets of resources.

    Options are plain attributes and may be changed between requests (faults switched on mid-test):

    - ``sets``: names of the sets (one Capability List each); operations default to the first.
    - ``changes_per_list``: a Change List is closed after this many changes (None: never).
    - ``resourcelist_page_size``: above it the Resource List becomes an index with parts.
    - ``resource_dump``, ``change_dump``, ``change_list``: which capabilities are advertised.
    - ``mirror``: "ok" (duplicate links to /mirror/... serving the same bytes), "broken" (the mirror
      serves corrupted bytes), "missing" (the mirror answers 404), or None (no duplicate links).
    - ``json_patches``: updates of JSON resources (``patch_json``/``update``) carry a patch link.
    - ``metadata``: every resource has a metadata record ``<path>.meta.xml`` in the same set (§14.5).
    - ``dc_elements``: {path: {element: value or [values]}}: more Dublin Core elements in that
      resource's record (e.g. ``{"a.txt": {"type": "Text"}}``); set before the create/update writing it.
    - ``latency``: seconds slept before answering each request.
    - ``wrong_hash``: resource paths whose announced hash is wrong everywhere (lists and manifests);
      their memento links (``mementos``) keep the right one: an entry that contradicts its memento.
    - ``announce_hashes``: False writes no ``hash`` anywhere (a Source of lastmod and length only).
    - ``serve_503``: {request path: n} answers the first n requests 503 with ``Retry-After: 0``.
    - ``drop_oldest_changelists``: the k oldest closed Change Lists (and their Change Dump packages)
      are gone: 404 and no longer in the index, as after a Source pruned its history.
    - ``hostile_dump``: "traversal", "bomb" or "missing" adds a hostile member to every dump package.
    - ``auto_snapshot``: the Resource List/Dump follow the state (a new snapshot when the top document
      is requested after a change); when False they stay at the last ``snapshot()``.
    - ``clock``: callable returning aware datetimes; times are forced strictly increasing.
    - ``mementos``: every entry that names a version (Resource List, Change List) carries the three
      links of §14.6 (Example 29): ``memento`` (a time-specific URI serving exactly that version, with
      its ``modified``, ``hash``, ``length``, ``type``), ``timegate`` and ``timemap``.
    - ``memento_faults``: {path: fault} for the memento links of that resource: "missing" (404),
      "corrupt" (other bytes), "nohash" (the link carries no hash or length), "redirect" (302 to a
      URI serving the version), "redirect-current" (302 to the time-generic ``<loc>``), "elsewhere"
      (the href on a link-local origin the outbound policy refuses).
    - ``public_url``: base URL written in documents (default: the bound address, else the request's).
    """

    def __init__(
        self,
        *,
        sets: Sequence[str] = ("default",),
        changes_per_list: int | None = 1000,
        resourcelist_page_size: int = 50_000,
        resource_dump: bool = True,
        change_dump: bool = True,
        change_list: bool = True,
        mirror: MirrorMode | None = None,
        json_patches: bool = False,
        metadata: bool = False,
        latency: float = 0.0,
        wrong_hash: Iterable[str] = (),
        announce_hashes: bool = True,
        serve_503: dict[str, int] | None = None,
        drop_oldest_changelists: int = 0,
        hostile_dump: HostileDump | None = None,
        bomb_bytes: int = 64 * 2**20,
        auto_snapshot: bool = True,
        clock: Callable[[], datetime] = utcnow,
        public_url: str | None = None,
        mementos: bool = False,
    ) -> None:
        if not sets:
            raise ValueError("at least one set is needed")
        for name in sets:
            if not _SET_NAME.match(name) or name in _RESERVED_SETS:
                raise ValueError(f"bad set name {name!r}")
        self.changes_per_list = changes_per_list
        self.resourcelist_page_size = resourcelist_page_size
        self.resource_dump = resource_dump
        self.change_dump = change_dump
        self.change_list = change_list
        self.mirror = mirror
        self.json_patches = json_patches
        self.metadata = metadata
        self.dc_elements: dict[str, dict[str, str | list[str]]] = {}
        self.latency = latency
        self.wrong_hash: set[str] = set(wrong_hash)
        self.announce_hashes = announce_hashes
        self.drop_oldest_changelists = drop_oldest_changelists
        self.hostile_dump = hostile_dump
        self.bomb_bytes = bomb_bytes
        self.auto_snapshot = auto_snapshot
        self.public_url = public_url.rstrip("/") if public_url else None
        self.mementos = mementos
        self.memento_faults: dict[str, MementoFault] = {}
        #: Set when ``serve`` has bound its socket.
        self.base_url: str | None = None
        #: Requests per URL path (HEAD and GET), for tests; see ``reset_counts``.
        self.counts: Counter[str] = Counter()
        #: Extra Capability List entries per set (room for notification channels, §9 + Change Notification).
        self.extra_capabilities: dict[str, list[Entry]] = {}
        #: Called with (set name, record) after every change (room for notifications).
        self.listeners: list[Callable[[str, ChangeRecord], None]] = []
        #: Routes matched before the built-in ones (notification topics and hub: ``demo/notify.py``);
        #: add them before the app is first built (``serve``).
        self.extra_routes: list[BaseRoute] = []
        self._clock = clock
        self._last: datetime | None = None
        self._serve_503: dict[str, int] = {}
        self._served_503: Counter[str] = Counter()
        self.serve_503 = serve_503 or {}
        self._snapshot_serial = 0
        self._zip_cache: dict[tuple, bytes] = {}  # LRU, bounded by ZIP_CACHE_BYTES
        self._app: Starlette | None = None
        t0 = self._tick()
        self._sets: dict[str, _Set] = {}
        for name in sets:
            self._sets[name] = _Set(name, open=ChangeList(1, from_=t0, start=0))

    # ------------------------------------------------------------------ options with side effects

    @property
    def serve_503(self) -> dict[str, int]:
        return self._serve_503

    @serve_503.setter
    def serve_503(self, value: dict[str, int]) -> None:
        """Setting the fault re-arms it (the counters of 503s already served start again)."""
        self._serve_503 = dict(value)
        self._served_503.clear()

    def reset_counts(self) -> None:
        self.counts.clear()

    # ------------------------------------------------------------------ clock

    def _tick(self) -> datetime:
        """Strictly increasing UTC time at microsecond resolution (ties would make cursors ambiguous)."""
        now = self._clock().astimezone(UTC)
        if self._last is not None and now <= self._last:
            now = self._last + timedelta(microseconds=1)
        self._last = now
        return now

    # ------------------------------------------------------------------ reading the model

    @property
    def set_names(self) -> list[str]:
        return list(self._sets)

    def _set(self, set_name: str | None) -> _Set:
        if set_name is None:
            return next(iter(self._sets.values()))
        try:
            return self._sets[set_name]
        except KeyError:
            raise KeyError(f"no set {set_name!r}") from None

    def resources(self, set_name: str | None = None) -> dict[str, Version]:
        """The current resources of a set (a copy)."""
        return dict(self._set(set_name).resources)

    def changes(self, set_name: str | None = None) -> list[ChangeRecord]:
        """The whole change log of a set, oldest first."""
        return list(self._set(set_name).log)

    def change_lists(self, set_name: str | None = None) -> list[ChangeList]:
        """All Change Lists of a set, closed ones first and the open one last (dropped ones included)."""
        s = self._set(set_name)
        return [*s.closed, s.open]

    def base(self) -> str:
        base = self.public_url or self.base_url
        if base is None:
            raise RuntimeError("not served yet: no base URL")
        return base

    def url(self, path: str, set_name: str | None = None) -> str:
        """Absolute URL of a resource (needs a base URL)."""
        return self.base() + _res_path(self._set(set_name).name, path)

    def doc_url(self, name: str, set_name: str | None = None) -> str:
        """Absolute URL of a document of a set, e.g. ``doc_url("changelist.xml")``."""
        return f"{self.base()}/{self._set(set_name).name}/{name}"

    @property
    def well_known_url(self) -> str:
        return self.base() + "/.well-known/resourcesync"

    # ------------------------------------------------------------------ operations

    def create(
        self,
        path: str,
        data: bytes,
        type: str = "text/plain",
        *,
        lastmod: datetime | None = None,
        extra_links: Iterable[Link] = (),
        set_name: str | None = None,
    ) -> ChangeRecord:
        """Add a resource; ``extra_links`` hrefs starting with "/" are resolved against the base URL."""
        _check_path(path)
        s = self._set(set_name)
        if path in s.resources:
            raise ValueError(f"{path!r} exists in set {s.name!r}")
        dt = self._tick()
        rec = self._record(s, path, model.CREATED, dt, Version.of(data, type, lastmod or dt, extra_links))
        self._touch_metadata(s, path, model.CREATED)
        return rec

    def update(
        self,
        path: str,
        data: bytes,
        type: str | None = None,
        *,
        lastmod: datetime | None = None,
        extra_links: Iterable[Link] | None = None,
        set_name: str | None = None,
    ) -> ChangeRecord:
        """Replace a resource's bytes (type and links kept unless given); same bytes still log a change."""
        s = self._set(set_name)
        old = s.resources.get(path)
        if old is None:
            raise KeyError(f"{path!r} not in set {s.name!r}")
        new_type = type or old.type
        links = old.links if extra_links is None else extra_links
        dt = self._tick()
        version = Version.of(data, new_type, lastmod or dt, links)
        rec = self._record(s, path, model.UPDATED, dt, version, self._json_patch(old, version))
        self._touch_metadata(s, path, model.UPDATED)
        return rec

    def put(self, path: str, data: bytes, type: str | None = None, **kw: Any) -> ChangeRecord:
        """Create or update."""
        if path in self._set(kw.get("set_name")).resources:
            return self.update(path, data, type, **kw)
        return self.create(path, data, type or "text/plain", **kw)

    def patch_json(self, path: str, new_obj: Any, *, set_name: str | None = None) -> ChangeRecord:
        """Update a JSON resource to ``canonical_json(new_obj)``; with ``json_patches`` the change
        carries a patch link (§14.4) computed with ``jsonpatch`` from the previous version."""
        return self.update(path, canonical_json(new_obj), set_name=set_name)

    def delete(self, path: str, *, set_name: str | None = None) -> ChangeRecord:
        s = self._set(set_name)
        if path not in s.resources:
            raise KeyError(f"{path!r} not in set {s.name!r}")
        rec = self._record(s, path, model.DELETED, self._tick(), None)
        self._touch_metadata(s, path, model.DELETED)
        return rec

    def bulk_create(
        self,
        n: int,
        *,
        prefix: str = "r",
        suffix: str = ".txt",
        start: int = 0,
        type: str = "text/plain",
        size: int | None = None,
        make_data: Callable[[int], bytes] | None = None,
        set_name: str | None = None,
    ) -> list[str]:
        """Create ``n`` resources ``<prefix><i:06d><suffix>``; returns their paths."""
        paths = []
        for i in range(start, start + n):
            path = f"{prefix}{i:06d}{suffix}"
            if make_data is not None:
                data = make_data(i)
            else:
                data = f"resource {path}\n".encode()
                if size is not None:
                    data = (data + b"x" * size)[:size]
            self.create(path, data, type, set_name=set_name)
            paths.append(path)
        return paths

    def snapshot(self, set_name: str | None = None) -> datetime:
        """Freeze the Resource List/Dump of one set (or all sets) at the current state; returns ``at``.

        ``at`` is taken after the last change, so every state listed is the result of all changes up
        until ``at`` (§7, §10.1).
        """
        targets = [self._set(set_name)] if set_name is not None else list(self._sets.values())
        at = self._tick()
        for s in targets:
            self._take_snapshot(s, at)
        return at

    # ------------------------------------------------------------------ change log internals

    def _record(
        self,
        s: _Set,
        path: str,
        change: str,
        dt: datetime,
        version: Version | None,
        patch: bytes | None = None,
    ) -> ChangeRecord:
        rec = ChangeRecord(len(s.log) + 1, path, change, dt, version, patch)
        if version is None:
            del s.resources[path]
        else:
            s.resources[path] = version
            s.versions[(path, version.sha256)] = version
        s.log.append(rec)
        s.state_version += 1
        self._maybe_roll(s)
        for listener in self.listeners:
            listener(s.name, rec)
        return rec

    def _maybe_roll(self, s: _Set) -> None:
        """Close the open list after ``changes_per_list`` changes; the next one starts at its ``until``
        so that the lists are back-to-back (§12.1, §12.2)."""
        if not self.changes_per_list or len(s.log) - s.open.start < self.changes_per_list:
            return
        until = self._tick()
        s.open.until, s.open.end = until, len(s.log)
        s.closed.append(s.open)
        s.open = ChangeList(s.open.number + 1, from_=until, start=len(s.log))

    def _touch_metadata(self, s: _Set, path: str, change: str) -> None:
        if not self.metadata or path.endswith(META_SUFFIX):
            return
        meta = path + META_SUFFIX
        if change == model.DELETED:
            if meta in s.resources:
                self._record(s, meta, model.DELETED, self._tick(), None)
            return
        version = s.resources[path]
        dt = self._tick()
        data = _dc_record(path, version.type, version.lastmod, self.dc_elements.get(path))
        record_change = model.UPDATED if meta in s.resources else model.CREATED
        self._record(s, meta, record_change, dt, Version.of(data, XML_TYPE, dt))

    def _json_patch(self, old: Version, new: Version) -> bytes | None:
        if not self.json_patches or not (_is_json(old.type) and _is_json(new.type)):
            return None
        try:
            old_obj, new_obj = json.loads(old.data), json.loads(new.data)
        except ValueError:
            return None
        patch = jsonpatch.make_patch(old_obj, new_obj)
        # Only an honest patch is announced: applying it must give exactly the new bytes.
        if canonical_json(patch.apply(old_obj)) != new.data:
            return None
        return json.dumps(patch.patch, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    def _take_snapshot(self, s: _Set, at: datetime | None = None) -> _Snapshot:
        at = at or self._tick()
        self._snapshot_serial += 1
        items = sorted(s.resources.items())
        s.snapshot = _Snapshot(at, self._tick(), items, self._snapshot_serial, s.state_version)
        return s.snapshot

    def _current_snapshot(self, s: _Set, *, refresh: bool) -> _Snapshot:
        """The snapshot documents are served from; ``refresh`` only for top documents, so parts and
        packages requested after an index stay consistent with it."""
        snap = s.snapshot
        if snap is None or (refresh and self.auto_snapshot and snap.state_version != s.state_version):
            snap = self._take_snapshot(s)
        return snap

    def _available_closed(self, s: _Set) -> list[ChangeList]:
        return s.closed[max(0, self.drop_oldest_changelists) :]

    # ------------------------------------------------------------------ document building

    def _base_for(self, request: Request) -> str:
        return self.public_url or self.base_url or str(request.base_url).rstrip("/")

    def _announced_hash(self, path: str, v: Version) -> str | None:
        if not self.announce_hashes:
            return None
        if path in self.wrong_hash:
            wrong = v.data + b"\0wrong"
            return format_hash(
                {"md5": hashlib.md5(wrong).hexdigest(), "sha-256": hashlib.sha256(wrong).hexdigest()}
            )
        return format_hash({"md5": v.md5, "sha-256": v.sha256})

    def _links(self, base: str, s: _Set, path: str, v: Version) -> list[Link]:
        links: list[Link] = []
        if self.mirror is not None:
            links.append(
                Link("duplicate", base + "/mirror" + _res_path(s.name, path), pri=1, modified=v.lastmod)
            )
        if self.metadata:
            if path.endswith(META_SUFFIX):
                described = path[: -len(META_SUFFIX)]
                links.append(Link("describes", base + _res_path(s.name, described)))
                links.append(Link("profile", DC_PROFILE))
            elif path + META_SUFFIX in s.resources:
                links.append(Link("describedby", base + _res_path(s.name, path + META_SUFFIX), type=XML_TYPE))
        for ln in v.links:
            links.append(replace(ln, href=base + ln.href) if ln.href.startswith("/") else ln)
        if self.mementos and not path.endswith(META_SUFFIX):
            links += self._memento_links(base, s, path, v)
        return links

    def _memento_links(self, base: str, s: _Set, path: str, v: Version) -> list[Link]:
        """§14.6, Example 29: the version's time-specific URI, then the TimeGate and TimeMap."""
        fault = self.memento_faults.get(path)
        where = ELSEWHERE if fault == "elsewhere" else base
        href = f"{where}/{s.name}/memento/{v.sha256}/{quote(path, safe='/~')}"
        if fault == "nohash":
            memento = Link("memento", href, modified=v.lastmod, type=v.type)
        else:
            memento = Link("memento", href, modified=v.lastmod, hash=format_hash(_hashes(v.data)),
                           length=v.length, type=v.type)  # fmt: skip
        generic = base + _res_path(s.name, path)
        return [
            memento,
            Link("timegate", f"{base}/timegate/{generic}"),
            Link("timemap", f"{base}/timemap/{generic}", type="application/link-format"),
        ]

    def _resource_entry(
        self, base: str, s: _Set, path: str, v: Version, *, zip_path: str | None = None
    ) -> Entry:
        md = Md(hash=self._announced_hash(path, v), length=v.length, type=v.type, path=zip_path)
        return Entry(
            base + _res_path(s.name, path), lastmod=v.lastmod, md=md, links=self._links(base, s, path, v)
        )

    def _change_entry(self, base: str, s: _Set, rec: ChangeRecord, *, in_dump: bool = False) -> Entry:
        loc = base + _res_path(s.name, rec.path)
        v = rec.version
        if v is None:
            return Entry(loc, md=Md(change=rec.change, datetime=rec.datetime))
        md = Md(
            change=rec.change,
            datetime=rec.datetime,
            hash=self._announced_hash(rec.path, v),
            length=v.length,
            type=v.type,
            path=f"/{_change_member(rec)}" if in_dump else None,
        )
        links = self._links(base, s, rec.path, v)
        if rec.patch is not None:
            links.append(
                Link(
                    model.PATCH_REL,
                    f"{base}/{s.name}/patch/{rec.seq}.json",
                    type=PATCH_TYPE,
                    hash=format_hash(_hashes(rec.patch)),
                    length=len(rec.patch),
                    path=f"/{_patch_member(rec)}" if in_dump else None,
                )
            )
        return Entry(loc, lastmod=v.lastmod, md=md, links=links)

    def _up(self, base: str, s: _Set) -> Link:
        return Link("up", f"{base}/{s.name}/capabilitylist.xml")

    def source_description(self, base: str) -> tuple[Head, list[Entry]]:
        """§8: one entry per Capability List."""
        head = Head(
            md=Md(capability=model.DESCRIPTION),
            links=[Link("describedby", base + "/about", type="text/plain")],
        )
        entries = [
            Entry(
                f"{base}/{name}/capabilitylist.xml",
                md=Md(capability=model.CAPABILITYLIST),
                links=[Link("describedby", f"{base}/{name}/about", type="text/plain")],
            )
            for name in self._sets
        ]
        return head, entries

    def capability_list(self, base: str, s: _Set) -> tuple[Head, list[Entry]]:
        """§9: ``up`` to the Source Description, one entry per capability."""
        head = Head(
            md=Md(capability=model.CAPABILITYLIST),
            links=[
                Link("describedby", f"{base}/{s.name}/about", type="text/plain"),
                Link("up", base + "/.well-known/resourcesync"),
            ],
        )
        caps = [
            (model.RESOURCELIST, "resourcelist.xml", True),
            (model.RESOURCEDUMP, "resourcedump.xml", self.resource_dump),
            (model.CHANGELIST, "changelist.xml", self.change_list),
            (model.CHANGEDUMP, "changedump.xml", self.change_dump),
        ]
        entries = [Entry(f"{base}/{s.name}/{doc}", md=Md(capability=cap)) for cap, doc, on in caps if on]
        entries += self.extra_capabilities.get(s.name, [])
        return head, entries

    def resource_list(self, base: str, s: _Set, part: int | None) -> tuple[Head, list[Entry]] | None:
        """§10.1/§10.2: a single list, or an index of parts of ``resourcelist_page_size`` entries."""
        snap = self._current_snapshot(s, refresh=part is None)
        page = max(1, self.resourcelist_page_size)
        n_parts = max(1, -(-len(snap.items) // page))
        md = Md(capability=model.RESOURCELIST, at=snap.at, completed=snap.completed)
        index_url = f"{base}/{s.name}/resourcelist.xml"
        if part is None:
            if n_parts == 1:
                return Head(md=md, links=[self._up(base, s)]), self._resource_entries(base, s, snap.items)
            entries = [
                Entry(f"{base}/{s.name}/resourcelist-{i}.xml", md=Md(at=snap.at, completed=snap.completed))
                for i in range(1, n_parts + 1)
            ]
            return Head(root=model.SITEMAPINDEX, md=md, links=[self._up(base, s)]), entries
        if n_parts == 1 or not 1 <= part <= n_parts:
            return None
        items = snap.items[(part - 1) * page : part * page]
        head = Head(md=md, links=[self._up(base, s), Link("index", index_url)])
        return head, self._resource_entries(base, s, items)

    def _resource_entries(self, base: str, s: _Set, items: list[tuple[str, Version]]) -> list[Entry]:
        return [self._resource_entry(base, s, path, v) for path, v in items]

    def change_list_doc(self, base: str, s: _Set, number: int | None) -> tuple[Head, list[Entry]] | None:
        """§12: ``changelist.xml`` is the index when closed lists exist (else the open list itself);
        ``number`` selects one list. Dropped lists are gone (404)."""
        available = [*self._available_closed(s), s.open]
        up = self._up(base, s)
        index_url = f"{base}/{s.name}/changelist.xml"
        has_index = bool(s.closed)
        if number is None:
            if not has_index:
                return self._change_list_body(base, s, s.open, [up])
            entries = [
                Entry(f"{base}/{s.name}/changelist-{cl.number}.xml", md=Md(from_=cl.from_, until=cl.until))
                for cl in available
            ]
            head = Head(
                root=model.SITEMAPINDEX,
                md=Md(capability=model.CHANGELIST, from_=available[0].from_),
                links=[up],
            )
            return head, entries
        for cl in available:
            if cl.number == number:
                return self._change_list_body(
                    base, s, cl, [up, Link("index", index_url)] if has_index else [up]
                )
        return None

    def _change_list_body(
        self, base: str, s: _Set, cl: ChangeList, links: list[Link]
    ) -> tuple[Head, list[Entry]]:
        head = Head(md=Md(capability=model.CHANGELIST, from_=cl.from_, until=cl.until), links=links)
        return head, [self._change_entry(base, s, rec) for rec in s.log[cl.start : cl.end]]

    # ------------------------------------------------------------------ dumps

    def _resource_manifest(self, base: str, s: _Set, snap: _Snapshot) -> tuple[bytes, list[_Member]]:
        """§11.2: manifest + members of the Resource Dump package of a snapshot."""
        head = Head(
            md=Md(capability=model.RESOURCEDUMP_MANIFEST, at=snap.at, completed=snap.completed),
            links=[self._up(base, s)],
        )
        entries, members = [], []
        for path, v in snap.items:
            name = f"resources/{path}"
            entries.append(self._resource_entry(base, s, path, v, zip_path="/" + name))
            members.append(_Member(name, v.data, v.lastmod))
        self._add_hostile(base, s, entries, members, change_at=None)
        return _render(head, entries), members

    def _change_manifest(self, base: str, s: _Set, cl: ChangeList) -> tuple[bytes, list[_Member]]:
        """§13.2: manifest + members (one bitstream per change, patches too) of one closed list."""
        head = Head(
            md=Md(capability=model.CHANGEDUMP_MANIFEST, from_=cl.from_, until=cl.until),
            links=[self._up(base, s)],
        )
        entries, members = [], []
        for rec in s.log[cl.start : cl.end]:
            entries.append(self._change_entry(base, s, rec, in_dump=True))
            if rec.version is not None:
                members.append(_Member(_change_member(rec), rec.version.data, rec.datetime))
            if rec.patch is not None:
                members.append(_Member(_patch_member(rec), rec.patch, rec.datetime))
        self._add_hostile(base, s, entries, members, change_at=cl.until)
        return _render(head, entries), members

    def _add_hostile(
        self, base: str, s: _Set, entries: list[Entry], members: list[_Member], change_at: datetime | None
    ) -> None:
        """Hostile packages for the dump reader's defences (§11.2/§13.2 paths are relative to the root)."""
        mode = self.hostile_dump
        if mode is None:
            return
        when = change_at or self._last or utcnow()
        change: dict[str, Any] = dict(change=model.CREATED, datetime=change_at) if change_at else {}
        data: bytes | int  # an int: that many zero bytes (the bomb)
        if mode == "traversal":
            data, name, member = b"evil\n", "evil.txt", "../../../tmp/rsagg-evil.txt"
        elif mode == "missing":
            data, name, member = b"not in the package\n", "missing.txt", None
        elif mode == "bomb":
            data, name, member = self.bomb_bytes, "bomb.bin", "bomb.bin"
        else:
            raise ValueError(f"unknown hostile_dump {mode!r}")
        if isinstance(data, int):
            hashes, length = _zeros_hashes(data), data
        else:
            hashes, length = _hashes(data), len(data)
        zpath = "/" + (member or f"resources/{name}")
        md = Md(
            hash=format_hash(hashes), length=length, type="application/octet-stream", path=zpath, **change
        )
        entries.append(Entry(base + _res_path(s.name, name), md=md))
        if member is not None:
            members.append(_Member(member, data, when))

    async def _zip(self, key: tuple, manifest: bytes, members: list[_Member]) -> bytes:
        key = (*key, hashlib.sha256(manifest).hexdigest())
        blob = self._zip_cache.pop(key, None)
        if blob is None:
            blob = await anyio.to_thread.run_sync(_build_zip, manifest, members)
        self._zip_cache[key] = blob  # most recently used last
        total = sum(len(b) for b in self._zip_cache.values())
        while total > ZIP_CACHE_BYTES and len(self._zip_cache) > 1:
            total -= len(self._zip_cache.pop(next(iter(self._zip_cache))))
        return blob

    async def resource_dump_package(self, base: str, s: _Set, snap: _Snapshot) -> tuple[bytes, bytes]:
        manifest, members = self._resource_manifest(base, s, snap)
        return manifest, await self._zip((s.name, "rd", snap.serial), manifest, members)

    async def change_dump_package(self, base: str, s: _Set, cl: ChangeList) -> tuple[bytes, bytes]:
        manifest, members = self._change_manifest(base, s, cl)
        return manifest, await self._zip((s.name, "cd", cl.number), manifest, members)

    async def resource_dump_doc(self, base: str, s: _Set) -> tuple[Head, list[Entry]]:
        """§11.1: one package for the current snapshot, with a ``contents`` link to its manifest."""
        snap = self._current_snapshot(s, refresh=True)
        _, blob = await self.resource_dump_package(base, s, snap)
        head = Head(
            md=Md(capability=model.RESOURCEDUMP, at=snap.at, completed=snap.completed),
            links=[self._up(base, s)],
        )
        entry = Entry(
            f"{base}/{s.name}/resourcedump.zip",
            lastmod=snap.completed,
            md=Md(
                at=snap.at,
                completed=snap.completed,
                hash=format_hash(_hashes(blob)),
                length=len(blob),
                type=ZIP_TYPE,
            ),
            links=[Link("contents", f"{base}/{s.name}/resourcedump-manifest.xml", type=XML_TYPE)],
        )
        return head, [entry]

    async def change_dump_doc(self, base: str, s: _Set) -> tuple[Head, list[Entry]]:
        """§13.1: one package per available closed Change List, forward chronological."""
        available = self._available_closed(s)
        head = Head(
            md=Md(capability=model.CHANGEDUMP, from_=available[0].from_ if available else s.open.from_),
            links=[self._up(base, s)],
        )
        entries = []
        for cl in available:
            _, blob = await self.change_dump_package(base, s, cl)
            entries.append(
                Entry(
                    f"{base}/{s.name}/changedump-{cl.number}.zip",
                    lastmod=cl.until,
                    md=Md(
                        from_=cl.from_,
                        until=cl.until,
                        hash=format_hash(_hashes(blob)),
                        length=len(blob),
                        type=ZIP_TYPE,
                    ),
                    links=[
                        Link(
                            "contents", f"{base}/{s.name}/changedump-{cl.number}-manifest.xml", type=XML_TYPE
                        )
                    ],
                )
            )
        return head, entries

    def _closed_list(self, s: _Set, number: int) -> ChangeList | None:
        for cl in self._available_closed(s):
            if cl.number == number:
                return cl
        return None

    # ------------------------------------------------------------------ HTTP

    def app(self) -> Starlette:
        """The ASGI application (one per Upstream)."""
        if self._app is None:
            self._app = Starlette(routes=self._routes(), middleware=[Middleware(_Instrument, upstream=self)])
        return self._app

    def _routes(self) -> list[BaseRoute]:
        return [
            *self.extra_routes,
            Route("/.well-known/resourcesync", self._h_description),
            Route("/about", self._h_about),
            Route("/mirror/{set}/res/{path:path}", self._h_mirror),
            Route("/{set}/about", self._h_about),
            Route("/{set}/capabilitylist.xml", self._h_capabilitylist),
            Route("/{set}/resourcelist.xml", self._h_resourcelist),
            Route("/{set}/resourcelist-{n:int}.xml", self._h_resourcelist),
            Route("/{set}/changelist.xml", self._h_changelist),
            Route("/{set}/changelist-{n:int}.xml", self._h_changelist),
            Route("/{set}/resourcedump.xml", self._h_resourcedump),
            Route("/{set}/resourcedump.zip", self._h_resourcedump_zip),
            Route("/{set}/resourcedump-manifest.xml", self._h_resourcedump_zip),
            Route("/{set}/changedump.xml", self._h_changedump),
            Route("/{set}/changedump-{n:int}.zip", self._h_changedump_zip),
            Route("/{set}/changedump-{n:int}-manifest.xml", self._h_changedump_zip),
            Route("/{set}/patch/{seq:int}.json", self._h_patch),
            Route("/{set}/res/{path:path}", self._h_resource),
            Route("/{set}/memento/{sha}/{path:path}", self._h_memento),
            Route("/{set}/moved/{sha}/{path:path}", self._h_memento),
        ]

    def _req_set(self, request: Request) -> _Set:
        s = self._sets.get(request.path_params["set"])
        if s is None:
            raise HTTPException(404)
        return s

    async def _h_description(self, request: Request) -> Response:
        return _xml(request, *self.source_description(self._base_for(request)))

    async def _h_about(self, request: Request) -> Response:
        name = request.path_params.get("set")
        if name is not None:
            s = self._req_set(request)
            return PlainTextResponse(f"rsagg demo upstream: set {s.name!r}, {len(s.resources)} resources\n")
        return PlainTextResponse("rsagg demo upstream: a programmable ResourceSync Source\n")

    async def _h_capabilitylist(self, request: Request) -> Response:
        return _xml(request, *self.capability_list(self._base_for(request), self._req_set(request)))

    async def _h_resourcelist(self, request: Request) -> Response:
        doc = self.resource_list(
            self._base_for(request), self._req_set(request), request.path_params.get("n")
        )
        if doc is None:
            raise HTTPException(404)
        return _xml(request, *doc)

    async def _h_changelist(self, request: Request) -> Response:
        if not self.change_list:
            raise HTTPException(404)
        doc = self.change_list_doc(
            self._base_for(request), self._req_set(request), request.path_params.get("n")
        )
        if doc is None:
            raise HTTPException(404)
        return _xml(request, *doc)

    async def _h_resourcedump(self, request: Request) -> Response:
        if not self.resource_dump:
            raise HTTPException(404)
        return _xml(request, *await self.resource_dump_doc(self._base_for(request), self._req_set(request)))

    async def _h_resourcedump_zip(self, request: Request) -> Response:
        if not self.resource_dump:
            raise HTTPException(404)
        s = self._req_set(request)
        snap = self._current_snapshot(s, refresh=False)
        manifest, blob = await self.resource_dump_package(self._base_for(request), s, snap)
        if request.url.path.endswith(".zip"):
            return _bytes(request, blob, ZIP_TYPE)
        return _bytes(request, manifest, XML_TYPE)

    async def _h_changedump(self, request: Request) -> Response:
        if not self.change_dump:
            raise HTTPException(404)
        return _xml(request, *await self.change_dump_doc(self._base_for(request), self._req_set(request)))

    async def _h_changedump_zip(self, request: Request) -> Response:
        s = self._req_set(request)
        cl = self._closed_list(s, request.path_params["n"])
        if not self.change_dump or cl is None:
            raise HTTPException(404)
        manifest, blob = await self.change_dump_package(self._base_for(request), s, cl)
        if request.url.path.endswith(".zip"):
            return _bytes(request, blob, ZIP_TYPE)
        return _bytes(request, manifest, XML_TYPE)

    async def _h_patch(self, request: Request) -> Response:
        s = self._req_set(request)
        seq = request.path_params["seq"]
        if not 1 <= seq <= len(s.log) or s.log[seq - 1].patch is None:
            raise HTTPException(404)
        patch = s.log[seq - 1].patch
        assert patch is not None
        return _bytes(request, patch, PATCH_TYPE)

    async def _h_resource(self, request: Request) -> Response:
        s = self._req_set(request)
        v = s.resources.get(request.path_params["path"])
        if v is None:
            raise HTTPException(404)
        return _bytes(request, v.data, v.type, lastmod=v.lastmod, etag=v.sha256)

    async def _h_memento(self, request: Request) -> Response:
        """A time-specific URI (§14.6): exactly one version, whatever the resource is now."""
        s = self._req_set(request)
        path, sha = request.path_params["path"], request.path_params["sha"]
        v = s.versions.get((path, sha))
        fault = self.memento_faults.get(path)
        if v is None or not self.mementos or fault == "missing":
            raise HTTPException(404)
        if fault == "corrupt":
            return Response(b"not that version: " + v.data[::-1], media_type=v.type)
        if "/memento/" in request.url.path and fault == "redirect":
            moved = f"{self._base_for(request)}/{s.name}/moved/{sha}/{quote(path, safe='/~')}"
            return Response(status_code=302, headers={"Location": moved})
        if fault == "redirect-current":
            return Response(
                status_code=302, headers={"Location": self._base_for(request) + _res_path(s.name, path)}
            )
        return _bytes(request, v.data, v.type, lastmod=v.lastmod, etag=v.sha256)

    async def _h_mirror(self, request: Request) -> Response:
        s = self._req_set(request)
        v = s.resources.get(request.path_params["path"])
        if v is None or self.mirror in (None, "missing"):
            raise HTTPException(404)
        if self.mirror == "broken":
            return Response(b"corrupted copy of " + v.data[::-1], media_type=v.type)
        return _bytes(request, v.data, v.type, lastmod=v.lastmod, etag=v.sha256)

    # ------------------------------------------------------------------ serving

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled (or ``shutdown_trigger`` returns); ``await nursery.start(up.serve)``
        returns the base URL, also kept in ``base_url`` for the documents."""
        async with trio.open_nursery() as nursery:
            self.base_url = await nursery.start(
                partial(serve, self.app(), host, port, shutdown_trigger=shutdown_trigger)
            )
            task_status.started(self.base_url)

    @asynccontextmanager
    async def serving(self, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
        """``async with up.serving() as base_url:`` serves for the duration of the block
        (``aggregator.run.serving.serving``); the base URL is also kept in ``base_url`` for the documents."""
        async with serving(self.app(), host, port) as base_url:
            self.base_url = base_url
            yield base_url


# ---------------------------------------------------------------------- module helpers


class _Instrument:
    """Per-request bookkeeping and faults: counts, latency, 503 + Retry-After: 0."""

    def __init__(self, app: ASGIApp, upstream: Upstream) -> None:
        self.app = app
        self.up = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        up = self.up
        path = scope["path"]
        up.counts[path] += 1
        if up.latency > 0:
            await anyio.sleep(up.latency)
        if up._served_503[path] < up.serve_503.get(path, 0):
            up._served_503[path] += 1
            response = PlainTextResponse("busy, try again\n", status_code=503, headers={"Retry-After": "0"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


@dataclass(frozen=True, slots=True)
class _Member:
    name: str
    data: bytes | int  # an int is that many zero bytes (the bomb), written without holding them
    when: datetime


def _build_zip(manifest: bytes, members: list[_Member]) -> bytes:
    """A deterministic ZIP: manifest.xml at the top level (§11.2, §13.2), then the bitstreams."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(_zinfo("manifest.xml", _ZIP_EPOCH), manifest)
        for m in members:
            info = _zinfo(m.name, m.when)
            if isinstance(m.data, int):
                chunk = bytes(2**20)
                with zf.open(info, "w", force_zip64=True) as out:
                    left = m.data
                    while left > 0:
                        out.write(chunk[: min(left, len(chunk))])
                        left -= len(chunk)
            else:
                zf.writestr(info, m.data)
    return buf.getvalue()


def _zinfo(name: str, when: datetime) -> zipfile.ZipInfo:
    when = max(when.astimezone(UTC), _ZIP_EPOCH)
    info = zipfile.ZipInfo(
        name, date_time=(when.year, when.month, when.day, when.hour, when.minute, when.second)
    )
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    return info


def _render(head: Head, entries: Iterable[Entry]) -> bytes:
    return b"".join(iter_document_bytes(head, entries))


def _xml(request: Request, head: Head, entries: Iterable[Entry]) -> Response:
    return _bytes(request, _render(head, entries), XML_TYPE)


def _bytes(
    request: Request,
    body: bytes,
    media_type: str,
    *,
    lastmod: datetime | None = None,
    etag: str | None = None,
) -> Response:
    """A full response with a strong ETag; If-None-Match gets 304 (conditional GET of documents)."""
    tag = f'"{etag or hashlib.sha256(body).hexdigest()}"'
    headers = {"ETag": tag}
    if lastmod is not None:
        headers["Last-Modified"] = format_datetime(lastmod.astimezone(UTC), usegmt=True)
    inm = request.headers.get("if-none-match")
    if inm and (inm.strip() == "*" or tag in [t.strip() for t in inm.split(",")]):
        return Response(status_code=304, headers=headers)
    return Response(body, media_type=media_type, headers=headers)


def _res_path(set_name: str, path: str) -> str:
    return f"/{set_name}/res/{quote(path, safe='/~')}"


def _change_member(rec: ChangeRecord) -> str:
    return f"changes/{rec.seq:06d}/{rec.path}"


def _patch_member(rec: ChangeRecord) -> str:
    return f"patches/{rec.seq:06d}.json"


def _check_path(path: str) -> None:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in path:
        raise ValueError(f"bad resource path {path!r}")


def _is_json(media_type: str) -> bool:
    base = media_type.split(";")[0].strip().lower()
    return base == "application/json" or base.endswith("+json")


def _hashes(data: bytes) -> dict[str, str]:
    return {"md5": hashlib.md5(data).hexdigest(), "sha-256": hashlib.sha256(data).hexdigest()}


@functools.lru_cache(maxsize=4)
def _zeros_hashes(n: int) -> dict[str, str]:
    md5, sha = hashlib.md5(), hashlib.sha256()
    chunk = bytes(2**20)
    left = n
    while left > 0:
        piece = chunk[: min(left, len(chunk))]
        md5.update(piece)
        sha.update(piece)
        left -= len(piece)
    return {"md5": md5.hexdigest(), "sha-256": sha.hexdigest()}


def _dc_record(
    path: str, media_type: str, lastmod: datetime, extra: dict[str, str | list[str]] | None = None
) -> bytes:
    """A small Dublin Core record for §14.5 (independent of the base URL so its hash is stable)."""
    more = "".join(
        f"<dc:{name}>{escape(v)}</dc:{name}>"
        for name, values in (extra or {}).items()
        for v in ([values] if isinstance(values, str) else values)
    )
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<oai_dc:dc xmlns:oai_dc="http://www.openarchives.org/OAI/2.0/oai_dc/" '
        f'xmlns:dc="{DC_PROFILE}">'
        f"<dc:identifier>{escape(path)}</dc:identifier><dc:format>{escape(media_type)}</dc:format>"
        f"<dc:date>{format_w3c(lastmod)}</dc:date>{more}</oai_dc:dc>\n"
    ).encode()
