"""A ResourceSync Source whose documents are written exactly as a test shapes them (tests/test_reconcile.py).

Not rsagg's writer's view of a Source: the Hyrax shape is built from the public code of samvera/hyrax
(``lib/hyrax/resource_sync/``): a Resource List whose ``at`` is the time of the request, entries with a
``<loc>`` and a ``<lastmod>`` only; a Change List with ``from`` (its oldest change), entries newest first,
``<lastmod>`` and ``change`` created/updated (created when modified equals created), no ``datetime``, and
no deletions ever (a deleted work simply leaves both lists); every ``<loc>`` is a route that answers 301
to the work's canonical URL, which serves the content with an ETag and answers 304 to it. Other shapes
(digests, lengths, datetimes, a Change List that drops, reorders or repeats entries) are options, for the
property test.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from aggregator.rs import model
from aggregator.rs.fixity import format_hash
from aggregator.rs.model import Entry, Head, Link, Md
from aggregator.rs.write import iter_document_bytes

XML = "application/xml"


@dataclass
class Work:
    body: bytes
    created: datetime
    modified: datetime

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.body).hexdigest()


@dataclass
class Published:
    """One Change List entry as the Source writes it."""

    path: str
    change: str
    lastmod: datetime | None
    datetime: datetime | None = None
    body: bytes | None = None  # the version it announces (its digest, when digests are written)


@dataclass
class ListSource:
    """An in-memory Source; attributes may change between requests."""

    hashes: bool = False  # rs:md hash on Resource List and Change List entries
    lengths: bool = False  # rs:md length
    datetimes: bool = False  # rs:md datetime on changes
    redirect: bool = True  # every <loc> answers 301 to the canonical URL (Hyrax)
    at: datetime | None = None  # the Resource List's `at`; None: the time of the request (Hyrax)
    works: dict[str, Work] = field(default_factory=dict)
    #: The Change List as published (newest first for Hyrax); tests write it.
    changes: list[Published] = field(default_factory=list)
    #: Paths of works that answer 500 (a repair that cannot succeed).
    broken: set[str] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)
    base: str = ""
    clock: datetime = field(default_factory=lambda: datetime(2024, 1, 1, tzinfo=UTC))

    def tick(self) -> datetime:
        self.clock += timedelta(seconds=1)
        return self.clock

    # -- what a Source does ------------------------------------------------------------------------

    def create(self, path: str, body: bytes) -> Published:
        t = self.tick()
        self.works[path] = Work(body, t, t)
        return Published(path, model.CREATED, t, t, body)

    def update(self, path: str, body: bytes) -> Published:
        t = self.tick()
        w = self.works[path]
        self.works[path] = Work(body, w.created, t)
        return Published(path, model.UPDATED, t, t, body)

    def delete(self, path: str) -> Published:
        t = self.tick()
        w = self.works.pop(path)
        return Published(path, model.DELETED, w.modified, t, w.body)

    def hyrax_changes(self) -> None:
        """The Change List Hyrax writes: every work now, newest modified first, created or updated."""
        works = sorted(self.works.items(), key=lambda kv: kv[1].modified, reverse=True)
        self.changes = [
            Published(
                p, model.CREATED if w.modified == w.created else model.UPDATED, w.modified, None, w.body
            )
            for p, w in works
        ]

    # -- URLs -------------------------------------------------------------------------------------

    def loc(self, path: str) -> str:
        return f"{self.base}/concern/works/{path}" if self.redirect else self.canonical(path)

    def canonical(self, path: str) -> str:
        return f"{self.base}/works/{path}"

    def listed(self) -> dict[str, str]:
        """What the Resource List says exists: the URI rsagg holds it under -> sha256 of its content."""
        return {self.loc(p): w.sha256 for p, w in self.works.items()}

    # -- documents --------------------------------------------------------------------------------

    def _md(self, body: bytes | None, **kw: object) -> Md:
        extra: dict[str, object] = {}
        if body is not None and self.hashes:
            extra["hash"] = format_hash({"md5": hashlib.md5(body).hexdigest()})
        if body is not None and self.lengths:
            extra["length"] = len(body)
        return Md(**kw, **extra)  # type: ignore[arg-type]

    def resource_list(self) -> bytes:
        at = self.at or datetime.now(UTC)
        head = Head(md=Md(capability=model.RESOURCELIST, at=at), links=[Link("up", self._cap())])
        entries = [
            Entry(
                self.loc(p), lastmod=w.modified, md=self._md(w.body) if self.hashes or self.lengths else None
            )
            for p, w in self.works.items()
        ]
        return b"".join(iter_document_bytes(head, entries))

    def change_list(self) -> bytes:
        oldest = min((c.lastmod for c in self.changes if c.lastmod), default=self.clock)
        head = Head(md=Md(capability=model.CHANGELIST, from_=oldest), links=[Link("up", self._cap())])
        entries = [
            Entry(
                self.loc(c.path),
                lastmod=c.lastmod,
                md=self._md(
                    c.body if c.change != model.DELETED else None,
                    change=c.change,
                    datetime=c.datetime if self.datetimes else None,
                ),
            )
            for c in self.changes
        ]
        return b"".join(iter_document_bytes(head, entries))

    def _cap(self) -> str:
        return f"{self.base}/capabilitylist.xml"

    def capability_list(self) -> bytes:
        head = Head(md=Md(capability=model.CAPABILITYLIST), links=[Link("up", self._well_known())])
        entries = [
            Entry(f"{self.base}/resourcelist.xml", md=Md(capability=model.RESOURCELIST)),
            Entry(f"{self.base}/changelist.xml", md=Md(capability=model.CHANGELIST)),
        ]
        return b"".join(iter_document_bytes(head, entries))

    def _well_known(self) -> str:
        return f"{self.base}/.well-known/resourcesync"

    def description(self) -> bytes:
        head = Head(md=Md(capability=model.DESCRIPTION))
        entries = [Entry(self._cap(), md=Md(capability=model.CAPABILITYLIST))]
        return b"".join(iter_document_bytes(head, entries))

    # -- the app ----------------------------------------------------------------------------------

    def app(self) -> Starlette:
        async def doc(request: Request) -> Response:
            self.counts[request.url.path] += 1
            make = {
                "/.well-known/resourcesync": self.description,
                "/capabilitylist.xml": self.capability_list,
                "/resourcelist.xml": self.resource_list,
                "/changelist.xml": self.change_list,
            }[request.url.path]
            return Response(make(), media_type=XML)

        async def route(request: Request) -> Response:
            self.counts[request.url.path] += 1
            path = request.path_params["path"]
            if path not in self.works:
                return Response(status_code=404)
            return RedirectResponse(self.canonical(path), status_code=301)

        async def work(request: Request) -> Response:
            self.counts[request.url.path] += 1
            path = request.path_params["path"]
            w = self.works.get(path)
            if w is None:
                return Response(status_code=404)
            if path in self.broken:
                return Response(b"failed\n", status_code=500)
            tag = f'W/"{w.sha256[:32]}"'  # Rails' Rack::ETag: a weak tag of the body
            headers = {"ETag": tag, "Last-Modified": format_datetime(w.modified, usegmt=True)}
            if request.headers.get("if-none-match") == tag:
                return Response(status_code=304, headers=headers)
            return Response(w.body, media_type="text/html", headers=headers)

        return Starlette(
            routes=[
                Route("/.well-known/resourcesync", doc),
                Route("/capabilitylist.xml", doc),
                Route("/resourcelist.xml", doc),
                Route("/changelist.xml", doc),
                Route("/concern/works/{path:path}", route),
                Route("/works/{path:path}", work),
            ]
        )

    def gets(self, prefix: str) -> int:
        """Requests served under a path prefix (``/works/``: content; ``/concern/``: the 301 routes)."""
        return sum(n for p, n in self.counts.items() if p.startswith(prefix))
