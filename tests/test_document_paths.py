"""A document read whole by the task that asked for it (a small answer of declared length,
``fetch.INLINE_DOCUMENT``) and one read by a download task of its own while it is parsed: the caller
sees the same in every case — the same entries and digest, the same failure, raised at the same point
(opening the document, or reading its entries) — across generated answers (framings, encodings, cuts,
a stall past the deadline). Only the task differs: none is started for a small document."""

from __future__ import annotations

import gzip
import hashlib
import random
from typing import Any

import pytest
import trio

from aggregator.harvest import fetch
from aggregator.harvest.fetch import Fetcher, FetchError
from tests.httpserver import answer_lifespan, serve_app

HEAD = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" '
    b'xmlns:rs="http://www.openarchives.org/rs/terms/">\n'
    b'  <rs:md capability="resourcelist" at="2013-01-03T09:00:00Z"/>\n'
)


def resource_list(n: int) -> bytes:
    entries = b"".join(f"  <url><loc>http://example.com/r{i}</loc></url>\n".encode() for i in range(n))
    return HEAD + entries + b"</urlset>\n"


class Answer:
    """One generated answer: the body as sent, its framing, where it is cut or stalls."""

    def __init__(self, rng: random.Random) -> None:
        self.doc = resource_list(rng.choice([0, 1, 3, 40, 400]))
        self.gzip = rng.random() < 0.3
        self.sent = gzip.compress(self.doc) if self.gzip else self.doc
        self.declared = rng.random() < 0.7  # Content-Length, else chunked
        self.cut = rng.randrange(len(self.sent)) if rng.random() < 0.3 else None
        self.stall = rng.randrange(1, len(self.sent)) if self.cut is None and rng.random() < 0.2 else None
        self.status = rng.choice([200] * 8 + [404, 503])

    def __repr__(self) -> str:
        return (f"{len(self.doc)}B gzip={self.gzip} declared={self.declared} cut={self.cut} "
                f"stall={self.stall} status={self.status}")  # fmt: skip


def app_for(answer: Answer, stalled: trio.Event) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        headers = [(b"content-type", b"application/xml")]
        if answer.gzip:
            headers.append((b"content-encoding", b"gzip"))
        if answer.declared:
            headers.append((b"content-length", str(len(answer.sent)).encode()))
        if answer.status != 200:
            body = b"no\n"
            headers = [(b"content-type", b"text/plain"), (b"content-length", b"3")]
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        at = answer.cut if answer.cut is not None else answer.stall
        if at is None:
            await send({"type": "http.response.body", "body": answer.sent})
            return
        await send({"type": "http.response.body", "body": answer.sent[:at], "more_body": True})
        if answer.cut is not None:
            raise RuntimeError("cut")  # the server drops the connection mid-body
        with trio.move_on_after(10):
            await stalled.wait()  # past the client's deadline
        await send({"type": "http.response.body", "body": answer.sent[at:]})

    return app


async def read(fetcher: Fetcher, url: str) -> tuple:
    """What a caller sees: where it failed and how, or the entries and digest."""
    try:
        async with fetcher.document(url) as stream:
            locs = []
            try:
                async for e in stream.entries:
                    locs.append(e.loc)
            except FetchError as exc:
                return ("entries failed", exc.kind, exc.transient)
            return ("read", stream.head.capability if stream.head else None, tuple(locs), stream.sha256)
    except FetchError as exc:
        return ("open failed", exc.kind, exc.transient)


@pytest.mark.parametrize("seed", range(24))
async def test_a_document_reads_the_same_whether_read_whole_or_by_a_task(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    answer = Answer(rng)
    tasks: list[str] = []
    spawn = trio.lowlevel.spawn_system_task

    def counting(fn: Any, *args: Any, name: Any = None, **kw: Any) -> Any:
        if str(name).startswith("rsagg.fetch"):
            tasks.append(str(name))
        return spawn(fn, *args, name=name, **kw)

    monkeypatch.setattr(fetch.trio.lowlevel, "spawn_system_task", counting)
    seen = []
    for inline in (10**9, -1):  # every declared length read whole; none
        monkeypatch.setattr(fetch, "INLINE_DOCUMENT", inline)
        tasks.clear()
        stalled = trio.Event()
        with trio.fail_after(30):
            async with serve_app(app_for(answer, stalled)) as base:
                # The deadline passes only where the answer stalls (the rest of it never comes until
                # the test ends): a second there, a minute elsewhere (no race with a loaded machine).
                deadline = 1.0 if answer.stall is not None else 60.0
                async with Fetcher(document_deadline=deadline, retries=0) as fetcher:
                    seen.append(await read(fetcher, f"{base}/rl.xml"))
                stalled.set()
        started = bool(tasks)
        read_whole = inline > 0 and answer.declared and answer.status == 200
        assert started == (answer.status == 200 and not read_whole), (answer, tasks)
    assert seen[0] == seen[1], answer
    if answer.cut is None and answer.stall is None and answer.status == 200:
        assert seen[0] == ("read", "resourcelist", tuple(f"http://example.com/r{i}" for i in range(
            answer.doc.count(b"<url>"))), hashlib.sha256(answer.doc).hexdigest())  # fmt: skip
