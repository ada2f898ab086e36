"""A real OAI-PMH data provider for tests and benchmarks: PyPI ``oaipmh``'s server behind a little ASGI.

``oaipmh.server.BatchingServer`` writes every response (Identify, ListRecords with resumption tokens,
errors such as noRecordsMatch, badResumptionToken, cannotDisseminateFormat); this module only holds the
records (``Repository``, the ``IBatchingOAI`` interface it asks for) and serves its bytes over HTTP, with
knobs the tests need: a delay per request, an authentication check, a redirect, the headers of every
request recorded, ListRecords answers tampered with (``tamper``), and ``expire_tokens()`` (tokens issued
before it are refused, as after a repository restart: the server's own badResumptionToken answers them).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import parse_qs

import trio
from oaipmh import common, error
from oaipmh.metadata import MetadataRegistry
from oaipmh.server import BatchingServer, oai_dc_writer

SECONDS = "YYYY-MM-DDThh:mm:ssZ"


def now() -> datetime:
    """The repository's clock: naive UTC (what ``oaipmh`` expects), whole seconds."""
    return datetime.now(UTC).replace(tzinfo=None, microsecond=0)


@dataclass
class Item:
    datestamp: datetime
    deleted: bool = False
    title: str = ""
    sets: tuple[str, ...] = ()


class Repository:
    """Records by OAI identifier (``IBatchingOAI`` for ``BatchingServer``), listed in identifier order."""

    def __init__(self, *, base_url: str = "http://127.0.0.1/oai", deleted_record: str = "persistent",
                 granularity: str = SECONDS) -> None:  # fmt: skip
        self.items: dict[str, Item] = {}
        self.base_url = base_url
        self.deleted_record = deleted_record
        self.granularity = granularity
        self._order: list[str] | None = None

    @staticmethod
    def ident(i: int) -> str:
        return f"oai:test.example:{i:06d}"

    def add(self, i: int, title: str | None = None, sets: tuple[str, ...] = ()) -> str:
        ident = self.ident(i)
        self.items[ident] = Item(now(), False, title or f"Record {i}", sets)
        self._order = None
        return ident

    def bulk_add(self, start: int, n: int) -> None:
        for i in range(start, start + n):
            self.add(i, sets=("even",) if i % 2 == 0 else ("odd",))

    def update(self, ident: str, title: str) -> None:
        item = self.items[ident]
        item.title, item.datestamp, item.deleted = title, now(), False

    def delete(self, ident: str) -> None:
        item = self.items[ident]
        item.deleted, item.datestamp = True, now()
        if self.deleted_record == "no":
            del self.items[ident]
            self._order = None

    def live(self) -> dict[str, str]:
        return {k: v.title for k, v in self.items.items() if not v.deleted}

    # -- IBatchingOAI ----------------------------------------------------------------------------

    def identify(self) -> common.Identify:
        earliest = min((i.datestamp for i in self.items.values()), default=now())
        return common.Identify(
            "rsagg test repository", self.base_url, "2.0", ["admin@test.example"], earliest,
            self.deleted_record, self.granularity, ["identity"],
        )  # fmt: skip

    def listMetadataFormats(self, identifier: str | None = None) -> list[tuple[str, str, str]]:
        return [("oai_dc", "http://www.openarchives.org/OAI/2.0/oai_dc.xsd",
                 "http://www.openarchives.org/OAI/2.0/oai_dc/")]  # fmt: skip

    def listSets(self, cursor: int = 0, batch_size: int = 10) -> list:
        return [("even", "Even records", None), ("odd", "Odd records", None)][cursor : cursor + batch_size]

    def _record(self, ident: str, item: Item) -> tuple:
        header = common.Header(None, ident, item.datestamp, list(item.sets), item.deleted)
        if item.deleted:
            return header, None, None
        meta = common.Metadata(None, {"title": [item.title], "identifier": [ident], "type": ["text"]})
        return header, meta, None

    def _check(self, metadataPrefix: str) -> None:
        if metadataPrefix != "oai_dc":
            raise error.CannotDisseminateFormatError(f"unknown metadata format {metadataPrefix}")

    def _select(self, set: str | None, from_: datetime | None, until: datetime | None) -> list[str]:
        if self._order is None:
            self._order = sorted(self.items)
        out = []
        for ident in self._order:
            item = self.items[ident]
            if (from_ is None or item.datestamp >= from_) and (until is None or item.datestamp <= until):
                if set is None or set in item.sets:
                    out.append(ident)
        return out

    def listRecords(
        self, metadataPrefix: str, set: str | None = None, from_: datetime | None = None,
        until: datetime | None = None, cursor: int = 0, batch_size: int = 10,
    ) -> list:  # fmt: skip
        self._check(metadataPrefix)
        idents = self._select(set, from_, until)[cursor : cursor + batch_size]
        return [self._record(i, self.items[i]) for i in idents]

    def listIdentifiers(
        self, metadataPrefix: str, set: str | None = None, from_: datetime | None = None,
        until: datetime | None = None, cursor: int = 0, batch_size: int = 10,
    ) -> list:  # fmt: skip
        return [h for h, _, _ in self.listRecords(metadataPrefix, set, from_, until, cursor, batch_size)]

    def getRecord(self, metadataPrefix: str, identifier: str) -> tuple:
        self._check(metadataPrefix)
        if identifier not in self.items:
            raise error.IdDoesNotExistError(identifier)
        return self._record(identifier, self.items[identifier])


_TOKEN = re.compile(rb"(<resumptionToken[^>]*>)([^<]+)(</resumptionToken>)")


@dataclass
class Seen:
    method: str
    path: str
    args: dict[str, str]
    headers: dict[str, str]


@dataclass
class OaiApp:
    """ASGI: GET or POST (form) OAI-PMH requests answered by ``BatchingServer`` over ``repo``."""

    repo: Repository
    page_size: int = 100
    delay: float = 0.0  # seconds before each answer (a remote repository's latency)
    #: headers (lower-case names) -> True when the request may pass; else 401
    check: Callable[[dict[str, str]], bool] | None = None
    redirect: str | None = None  # answer every request with a 302 to this URL + the same query
    seen: list[Seen] = field(default_factory=list)
    epoch: int = 0
    #: After this many ListRecords requests, later ones wait for ``release`` (``holding`` is then set):
    #: a harvest stopped mid-walk at a known point, whatever the machine's speed.
    hold_after: int | None = None
    holding: trio.Event = field(default_factory=trio.Event)
    release: trio.Event = field(default_factory=trio.Event)
    #: (request args, response) -> (status, body) actually sent, for every ListRecords answer: a broken
    #: page, a failing request, markup the parser must see through.
    tamper: Callable[[dict[str, str], bytes], tuple[int, bytes]] | None = None
    server: BatchingServer = field(init=False)

    def __post_init__(self) -> None:
        registry = MetadataRegistry()
        registry.registerWriter("oai_dc", oai_dc_writer)
        self.server = BatchingServer(self.repo, registry, resumption_batch_size=self.page_size)

    def expire_tokens(self) -> None:
        """Refuse every resumption token issued until now (as a repository restart may)."""
        self.epoch += 1

    def list_requests(self) -> list[Seen]:
        return [s for s in self.seen if s.args.get("verb") == "ListRecords"]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                kind = "startup" if msg["type"] == "lifespan.startup" else "shutdown"
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        query = scope["query_string"] if scope["method"] == "GET" else body
        args = {k: v[0] for k, v in parse_qs(query.decode(), keep_blank_values=True).items()}
        self.seen.append(Seen(scope["method"], scope["path"], args, headers))
        if self.delay:
            await trio.sleep(self.delay)
        if self.hold_after is not None and len(self.list_requests()) > self.hold_after:
            self.holding.set()
            await self.release.wait()
        if self.check is not None and not self.check(headers):
            await self._answer(send, 401, b"unauthorized", [(b"www-authenticate", b'Bearer realm="oai"')])
            return
        if self.redirect is not None:
            location = self.redirect + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
            await self._answer(send, 302, b"", [(b"location", location.encode())])
            return
        token = args.get("resumptionToken")
        if token is not None:
            epoch, _, inner = token.partition(".")
            args["resumptionToken"] = inner if epoch == str(self.epoch) else "expired"
        xml = self.server.handleRequest(args)
        xml = _TOKEN.sub(lambda m: m[1] + f"{self.epoch}.".encode() + m[2] + m[3], xml)
        status = 200
        if self.tamper is not None and args.get("verb") == "ListRecords":
            status, xml = self.tamper(args, xml)
        await self._answer(send, status, xml, [(b"content-type", b"text/xml; charset=utf-8")])

    @staticmethod
    async def _answer(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
