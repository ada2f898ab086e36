"""OAI-PMH sources end to end, against PyPI ``oaipmh``'s data provider (tests/oaiserver.py): a full walk
of 5,000 records over many pages, additions, updates and deletions, a ``kill -9`` in the middle of a
ListRecords walk (and an expired resumption token) with no gap and no duplicate in the changelog, then
resync (the reference ResourceSync client) in sync with what rsagg republishes, every document valid."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import zipfile
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import trio
from lxml import etree

from aggregator.config import parse_config
from aggregator.harvest.oaipage import parse_page, peek_token
from aggregator.net import lean
from aggregator.publish.dumps import DumpBuilder
from aggregator.publish.uris import rsagg_uri
from aggregator.rs.validate import ERROR, validate_source
from aggregator.store.blobs import FileBlobStore
from aggregator.store.state import State

from .faultystores import FaultyStores
from .harvesting import audit, changelog, harvest, held
from .httpserver import serve_app
from .oaiserver import OaiApp, Repository
from .plugintesting import add_plugin
from .test_publish import local_files, publishing, resync, walk

RSAGG = str(Path(sys.executable).parent / "rsagg")
OAI_DC = "{http://www.openarchives.org/OAI/2.0/oai_dc/}dc"


def oai_config(tmp_path: Path, url: str, store: dict | None = None, **source):
    return parse_config(
        {
            "store": {"path": str(tmp_path / "data"), **(store or {})},
            "harvest": {"retries": 2, "backoff_base": 0.01, "backoff_max": 0.05, "timeout": 10},
            "sources": [{"name": "oai", "url": url, "kind": "oai-pmh", **source}],
        },
        str(tmp_path / "test.toml"),
    )


def write_config(tmp_path: Path, url: str, extra: str = "") -> Path:
    path = tmp_path / "rsagg.toml"
    path.write_text(
        f'[store]\npath = "{tmp_path / "data"}"\n[harvest]\nretries = 2\nbackoff_base = 0.01\n'
        f'backoff_max = 0.05\ntimeout = 10\n\n[[sources]]\nname = "oai"\nkind = "oai-pmh"\nurl = "{url}"\n'
        + extra
    )
    return path


def titles(cfg) -> dict[str, str]:
    """identifier -> dc:title of every live record rsagg holds (read back from its blob store)."""
    out = {}
    with FileBlobStore(cfg.store_path / "blobs") as blobs:
        for uri, sha in held(cfg).items():
            with blobs.open(sha) as f:
                root = etree.fromstring(f.read())
            assert root.tag == OAI_DC
            out[uri] = root.findtext("{http://purl.org/dc/elements/1.1/}title")
    return out


async def next_second() -> None:
    """Wait until the repository clock (whole seconds) has moved on: datestamps after this are later."""
    start = datetime.now(UTC).replace(microsecond=0)
    while datetime.now(UTC).replace(microsecond=0) <= start:
        await trio.sleep(0.05)


async def change(repo: Repository, *, added: range, updated: range, deleted: range) -> None:
    """Add, update and delete records, all datestamped after the previous walk began."""
    await next_second()
    repo.bulk_add(added.start, len(added))
    for i in updated:
        repo.update(repo.ident(i), f"Updated {i} at {datetime.now(UTC)}")
    for i in deleted:
        repo.delete(repo.ident(i))


def kinds(log) -> Counter:
    return Counter(change for _, change, _ in log)


@pytest.mark.slow  # 1,000 records through rsagg and read back by the resync client
async def test_oai_harvest_changes_and_resync(tmp_path: Path):
    """The whole way at a size resync (one GET per resource) crosses quickly; 5,000 records: below."""
    repo = Repository()
    repo.bulk_add(0, 1000)
    app = OaiApp(repo, page_size=100)
    async with serve_app(app) as base:
        repo.base_url = f"{base}/oai"
        cfg = oai_config(tmp_path, f"{base}/oai")
        result = (await harvest(cfg))["oai"]
        assert result.ok, result.error
        assert result.sets == 1 and result.stats[0].applied == {"created": 1000}
        assert len(app.list_requests()) == 10  # 1,000 records in pages of 100
        assert titles(cfg) == repo.live()
        log = changelog(cfg)
        assert len(log) == 1000 and kinds(log) == {"created": 1000} and len({u for u, _, _ in log}) == 1000
        with State(cfg.store_path / "state.db") as st:
            (s,) = st.sets("oai")
            row = st.resource(s.id, repo.ident(7))
            assert row.type == "application/xml" and row.lastmod == repo.items[
                repo.ident(7)
            ].datestamp.replace(tzinfo=UTC)
            (via,) = row.links
            assert via.rel == "via" and "verb=GetRecord" in via.href and "metadataPrefix=oai_dc" in via.href
            cur = st.cursor(s.id)
            assert cur.changelist_url is None and cur.last_datetime is not None  # walk complete
            assert st.source("oai").progress_done == 1000  # rsagg status shows the walk's progress

        # The via link names the record: GetRecord answers the same metadata, byte for byte once
        # canonicalised (what rsagg stores).
        async with httpx.AsyncClient() as client:
            got = parse_page((await client.get(via.href)).content, via.href)
        assert got.records[0].identifier == repo.ident(7)
        with FileBlobStore(cfg.store_path / "blobs") as blobs:
            assert got.records[0].content == blobs.read_inline(row.sha256)  # a record: a row of small.db

        # Additions, updates, deletions: exactly those enter the changelog; an unchanged walk logs nothing
        # (``from`` is inclusive: the records of the previous walk's last second come again, as no-ops).
        await change(repo, added=range(5000, 5040), updated=range(100, 130), deleted=range(200, 220))
        result = (await harvest(cfg))["oai"]
        assert result.ok, result.error
        assert app.list_requests()[10].args.get("from")  # an incremental walk
        log2 = changelog(cfg)[1000:]
        assert kinds(log2) == {"created": 40, "updated": 30, "deleted": 20}, kinds(log2)
        assert titles(cfg) == repo.live()
        assert (await harvest(cfg))["oai"].ok
        assert len(changelog(cfg)) == 1090

        # resync from rsagg's republished set: baseline, incremental, audit; every document valid.
        async with publishing(cfg) as (rbase, client):
            docs = await walk(client, rbase)  # every document validated on the way (get_doc)
            assert f"{rbase}/oai/resourcelist.xml" in docs
            await rsagg_validate([u for u in docs], tmp_path)
            dest, cwd = tmp_path / "dest", tmp_path / "cwd"
            cwd.mkdir()
            out = await resync("--baseline", "--delete", rbase, str(dest), cwd=cwd)
            assert "SYNCED" in out or "IN SYNC" in out, out
            assert local_titles(dest, rbase) == repo.live()

            await change(repo, added=range(6000, 6005), updated=range(300, 305), deleted=range(400, 403))
            assert (await harvest(cfg))["oai"].ok
            assert kinds(changelog(cfg)[1090:]) == {"created": 5, "updated": 5, "deleted": 3}
            docs = await walk(client, rbase)
            await rsagg_validate([u for u in docs if "changelist" in u], tmp_path)
            head, entries = docs[f"{rbase}/oai/changelist.xml"]
            open_list = f"{rbase}/oai/changelist.xml" if not head.is_index else entries[-1].loc
            out = await resync(
                "--incremental", "--delete", "--changelist-uri", open_list, rbase, str(dest), cwd=cwd
            )
            assert "CHANGES APPLIED" in out, out
            assert local_titles(dest, rbase) == repo.live()
            out = await resync("--audit", "--hash", "md5", rbase, str(dest), cwd=cwd)
            assert "IN SYNC" in out and "NOT IN SYNC" not in out, out

    # A Resource Dump of the set (§11, what the daemon builds on its schedule): every record, valid.
    with State(cfg.store_path / "state.db") as st, FileBlobStore(cfg.store_path / "blobs") as blobs:
        builder = DumpBuilder(st, blobs, base_url="http://rsagg.example", max_entries=400)
        try:
            packages = builder.build_resource_dump("oai", [s.id for s in st.sets("oai")])
            names = []
            for p in packages:
                with zipfile.ZipFile(blobs.local_path(p.sha256)) as zf:
                    manifest = zf.read("manifest.xml")
                    url = "http://rsagg.example/oai/manifest.xml"
                    assert [i for i in validate_source(manifest, url) if i.severity == ERROR] == []
                    names += [n for n in zf.namelist() if n != "manifest.xml"]
        finally:
            builder.close()
    assert len(packages) == 3 and len(names) == len(repo.live())


def local_titles(dest: Path, rbase: str) -> dict[str, str]:
    """identifier -> title of the files resync wrote (it maps our URIs under BASE to files under DEST)."""
    out = {}
    prefix = rsagg_uri(rbase, "oai", "oai:x")[: -len("oai:x")]
    for rel, data in local_files(dest).items():
        uri = f"{rbase}/{rel}"
        assert uri.startswith(prefix), uri
        root = etree.fromstring(data)
        out[uri[len(prefix) :]] = root.findtext("{http://purl.org/dc/elements/1.1/}title")
    return out


async def rsagg_validate(urls: list[str], tmp_path: Path) -> None:
    assert urls
    done = await trio.run_process([RSAGG, "validate", *urls], capture_stdout=True, capture_stderr=True,
                                  check=False)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr).decode()


def cursor_token(db: Path) -> str | None:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            row = conn.execute("SELECT changelist_url FROM cursors").fetchone()
    except sqlite3.OperationalError:  # not created yet
        return None
    return row[0] if row else None


async def kill_mid_walk(config: Path, app: OaiApp, db: Path, tmp_path: Path) -> None:
    """Start ``rsagg harvest --once``, hold its walk after 10 more pages and SIGKILL it there (a page
    committed, the next ones fetched or asked for)."""
    app.hold_after = len(app.list_requests()) + 10
    app.holding, app.release = trio.Event(), trio.Event()
    log = open(tmp_path / "harvest-killed.log", "ab")
    proc = subprocess.Popen([RSAGG, "harvest", "-c", str(config), "--once"], stdout=log, stderr=log)
    try:
        with trio.fail_after(120):
            while not (app.holding.is_set() and cursor_token(db)):
                assert proc.poll() is None, "the harvest ended before it could be killed"
                await trio.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
        log.close()
        app.hold_after = None
        app.release.set()
    assert proc.returncode == -signal.SIGKILL
    assert cursor_token(db), "killed with no committed page"


async def run_harvest(config: Path) -> None:
    done = await trio.run_process([RSAGG, "harvest", "-c", str(config), "--once"], capture_stdout=True,
                                  capture_stderr=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-3000:]


@pytest.mark.slow  # kill -9 of an rsagg process
async def test_kill_9_mid_walk_then_resume_no_gap_no_duplicate(tmp_path: Path):
    repo = Repository()
    repo.bulk_add(0, 5000)
    app = OaiApp(repo, page_size=100)
    async with serve_app(app) as base:
        config = write_config(tmp_path, f"{base}/oai")
        db = tmp_path / "data" / "state.db"
        await kill_mid_walk(config, app, db, tmp_path)
        killed_at = len(app.list_requests())
        await run_harvest(config)
        resumed = app.list_requests()[killed_at:]
        # The restart went on from the stored token (Identify first), not from a fresh walk.
        assert "resumptionToken" in resumed[0].args, resumed[0].args
        assert len(resumed) < 50
        cfg = oai_config(tmp_path, f"{base}/oai")
        log = changelog(cfg)
        assert kinds(log) == {"created": 5000} and len({u for u, _, _ in log}) == 5000
        assert titles(cfg) == repo.live()

        # Killed in an incremental walk, and the repository forgot its tokens meanwhile: the walk starts
        # again from its ``from`` (badResumptionToken) and the records already applied are no-ops.
        await change(repo, added=range(5000, 5100), updated=range(0, 2500), deleted=range(2500, 2600))
        await kill_mid_walk(config, app, db, tmp_path)
        app.expire_tokens()
        killed_at = len(app.list_requests())
        await run_harvest(config)
        resumed = app.list_requests()[killed_at:]
        assert "resumptionToken" in resumed[0].args and "from" in resumed[1].args  # refused, restarted
        log = changelog(cfg)[5000:]
        assert kinds(log) == {"created": 100, "updated": 2500, "deleted": 100}, kinds(log)
        assert len({u for u, _, _ in log}) == 2700  # each change logged once
        assert titles(cfg) == repo.live()


@pytest.mark.slow  # about 4 s: every set and deletion policy, with errors, against the server
async def test_sets_errors_and_deleted_policies(tmp_path: Path, caplog):
    repo = Repository(deleted_record="transient")
    repo.bulk_add(0, 300)
    app = OaiApp(repo, page_size=50)
    async with serve_app(app) as base:
        # A selective harvest: only the records of set "even".
        await next_second()  # the walk's responseDate (the next ``from``) is after every datestamp
        cfg = oai_config(tmp_path / "a", f"{base}/oai", set="even")
        assert (await harvest(cfg))["oai"].ok
        assert set(held(cfg)) == {repo.ident(i) for i in range(0, 300, 2)}
        assert all(r.args["set"] == "even" for r in app.list_requests() if "resumptionToken" not in r.args)
        # rsagg audit walks the repository against the store: in sync, then each kind of difference.
        assert await audit(cfg) == []
        repo.update(repo.ident(2), "Rekord 2")  # same length: the hash tells
        repo.delete(repo.ident(4))
        repo.add(1000, sets=("even",))
        found = sorted((d.kind, d.uri) for d in await audit(cfg))
        assert found == [
            ("hash", repo.ident(2)),
            ("missing", repo.ident(1000)),
            ("not-deleted", repo.ident(4)),
        ]
        assert (await harvest(cfg))["oai"].ok and await audit(cfg) == []

        # noRecordsMatch: nothing changed is not an error, and moves nothing.
        await next_second()
        before = changelog(cfg)
        await next_second()
        result = (await harvest(cfg))["oai"]
        assert result.ok, result.error
        assert changelog(cfg) == before

        # cannotDisseminateFormat: a clear error naming the config key's value; the source is "error".
        bad = oai_config(tmp_path / "b", f"{base}/oai", metadata_prefix="marc21")
        result = (await harvest(bad))["oai"]
        assert not result.ok
        assert "cannotDisseminateFormat" in result.error and "'marc21'" in result.error, result.error
        with State(bad.store_path / "state.db") as st:
            assert st.source("oai").state == "error"

    # Not an OAI-PMH repository at all (an HTML page): the source fails with a message naming the URL.
    async def html(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        elif scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/html")]})  # fmt: skip
            await send({"type": "http.response.body", "body": b"<html><body><p>Welcome<br></body></html>"})

    async with serve_app(html) as base:
        result = (await harvest(oai_config(tmp_path / "e", f"{base}/oai")))["oai"]
        assert not result.ok and f"{base}/oai?verb=Identify" in result.error, result.error

    # A repository that keeps no deletions ("no"): a deleted record is simply gone from the lists, so
    # an incremental walk cannot see it; a full walk (full_harvest_interval) sweeps it.
    repo = Repository(deleted_record="no")
    repo.bulk_add(0, 20)
    async with serve_app(OaiApp(repo, page_size=7)) as base:
        cfg = oai_config(tmp_path / "d", f"{base}/oai")
        assert (await harvest(cfg))["oai"].ok and len(held(cfg)) == 20
        repo.delete(repo.ident(3))
        await change(repo, added=range(50, 51), updated=range(5, 6), deleted=range(0, 0))
        assert (await harvest(cfg))["oai"].ok
        assert len(held(cfg)) == 21 and repo.ident(3) in held(cfg)  # incremental: the deletion unseen
        every = oai_config(tmp_path / "d", f"{base}/oai", full_harvest_interval=0.001)
        assert (await harvest(every))["oai"].ok
        assert set(held(cfg)) == set(repo.live()) and repo.ident(3) not in held(cfg)
        assert kinds(changelog(cfg)[20:]) == {"created": 1, "updated": 1, "deleted": 1}


def test_config_keys(tmp_path: Path):
    from aggregator.config import ConfigError

    def parse(**src):
        return parse_config({"sources": [{"name": "o", "url": "http://h/oai", **src}]}, "t.toml")

    assert parse(kind="oai-pmh").sources[0].metadata_prefix == "oai_dc"
    for bad, key in [
        ({"kind": "oai"}, "sources[0].kind"),
        ({"set": "x"}, "sources[0].kind"),
        ({"kind": "oai-pmh", "auth": {"bearer_token": "s3cret"}}, "sources[0].auth.bearer_token"),
        ({"auth": {"headers": {"X-Key": "s3cret"}}}, "sources[0].auth.headers.X-Key"),
        ({"auth": {"basic_username": "u"}}, "sources[0].auth"),
        (
            {"auth": {"bearer_token_env": "A", "basic_username": "u", "basic_password_env": "B"}},
            "sources[0].auth",
        ),
        ({"max_rate": -1}, "sources[0].max_rate"),
    ]:
        with pytest.raises(ConfigError) as err:
            parse(**bad)
        assert err.value.key == key, (bad, err.value)
        assert "s3cret" not in str(err.value)
    with pytest.raises(ConfigError, match="password"):
        parse_config({"sources": [{"name": "o", "url": "http://u:pw@h/oai"}]}, "t.toml")


def test_parse_page_is_lenient_and_hostile_proof(tmp_path: Path):
    """A record without identifier or metadata is skipped with a reason; an external entity is never read;
    broken XML is an OaiError naming the URL; the content is canonical (same bytes whatever the prefixes)."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    doc = f"""<?xml version="1.0"?>
<!DOCTYPE OAI-PMH [<!ENTITY xxe SYSTEM "file://{secret}">]>
<OAI-PMH xmlns="http://www.openarchives.org/OAI/2.0/">
  <responseDate>2026-01-02T03:04:05Z</responseDate>
  <ListRecords>
    <record><header><identifier>oai:x:1</identifier><datestamp>2026-01-01</datestamp></header>
      <metadata><a:dc xmlns:a="http://www.openarchives.org/OAI/2.0/oai_dc/"><t>&xxe;</t></a:dc></metadata></record>
    <record><header><datestamp>2026-01-01</datestamp></header><metadata><x/></metadata></record>
    <record><header><identifier>oai:x:3</identifier><datestamp>2026-01-01</datestamp></header></record>
    <record><header status="deleted"><identifier>oai:x:4</identifier><datestamp>2026-01-01</datestamp>
      </header></record>
    <record><header><identifier>oai:x:5</identifier><datestamp>2026-01-01</datestamp></header>
      <metadata><b:dc xmlns:b="http://www.openarchives.org/OAI/2.0/oai_dc/"><b:t/></b:dc></metadata></record>
    <resumptionToken completeListSize="9">tok-1</resumptionToken>
  </ListRecords>
</OAI-PMH>""".encode()
    page = parse_page(doc, "http://h/oai")
    # oai:x:1 names an entity that is never resolved: its record cannot be canonicalised, so skipped
    assert [r.identifier for r in page.records] == ["oai:x:4", "oai:x:5"]
    assert page.token == "tok-1" and page.response_date == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert page.complete_size == 9 and page.cursor is None
    assert len(page.problems) == 3 and "oai:x:1" in page.problems[0] and "oai:x:3" in page.problems[2]
    assert all(b"TOP-SECRET" not in (r.content or b"") for r in page.records)
    assert page.records[0].deleted and page.records[0].content is None
    # exclusive C14N: the prefix is the document's, the bytes are stable and self-contained XML
    dc = b'<b:dc xmlns:b="http://www.openarchives.org/OAI/2.0/oai_dc/"><b:t></b:t></b:dc>'
    assert page.records[1].content == dc
    from aggregator.harvest.oaipage import OaiError

    with pytest.raises(OaiError, match="http://h/oai"):
        parse_page(b"<OAI-PMH><ListRecords><record>", "http://h/oai")


def test_parse_page_reads_records_in_any_order_of_their_parts():
    """The schema's order is read by position, any other by name: both give the same records."""
    meta = '<metadata><dc xmlns="http://www.openarchives.org/OAI/2.0/oai_dc/">t</dc></metadata>'
    doc = f"""<OAI-PMH xmlns="http://www.openarchives.org/OAI/2.0/"><ListRecords>
    <record><header><identifier> oai:x:1 </identifier><datestamp>2026-01-01</datestamp></header>
      {meta}</record>
    <record><header><datestamp>2026-01-01</datestamp><setSpec>s</setSpec><identifier>oai:x:2</identifier>
      </header><about><x/></about>{meta}</record>
    <record>{meta}<header><identifier>oai:x:3</identifier><identifier>second</identifier></header></record>
    </ListRecords></OAI-PMH>""".encode()
    page = parse_page(doc, "http://h/oai")
    assert [r.identifier for r in page.records] == ["oai:x:1", "oai:x:2", "oai:x:3"] and not page.problems
    assert len({r.content for r in page.records}) == 1
    assert [r.datestamp for r in page.records] == [datetime(2026, 1, 1, tzinfo=UTC)] * 2 + [None]


def test_a_page_too_big_for_a_tree_is_parsed_incrementally_with_the_same_result(monkeypatch):
    """Pages up to TREE_BYTES are parsed whole, bigger ones a record at a time: the same Page either way,
    problems, errors and the token included."""
    import aggregator.harvest.oaipage as oaipage

    def record(i: int) -> str:
        status = ' status="deleted"' if i % 7 == 0 else ""
        meta = (
            ""
            if i % 7 == 0 or i % 11 == 0
            else f"<metadata><dc xmlns='urn:dc'><t>{i} &amp; é</t></dc></metadata>"
        )
        head = f"<identifier>oai:x:{i}</identifier><datestamp>2026-01-0{1 + i % 9}</datestamp>"
        return f"<record><header{status}>{head}</header>{meta}</record>"

    records = "".join(record(i) for i in range(300))
    doc = (f'<OAI-PMH xmlns="http://www.openarchives.org/OAI/2.0/"><responseDate>2026-01-02T03:04:05Z'
           f"</responseDate><ListRecords>{records}<resumptionToken cursor='0' completeListSize='900'>t-2"
           "</resumptionToken></ListRecords></OAI-PMH>").encode()  # fmt: skip
    whole = parse_page(doc, "http://h/oai")
    monkeypatch.setattr(oaipage, "TREE_BYTES", len(doc) - 1)
    assert parse_page(doc, "http://h/oai") == whole
    assert len(whole.records) == 300 - 24 and len(whole.problems) == 24 and whole.token == "t-2"
    error = (
        b'<OAI-PMH xmlns="http://www.openarchives.org/OAI/2.0/"><error code="badVerb">no</error></OAI-PMH>'
    )
    assert parse_page(error, "u").errors == [("badVerb", "no")]
    monkeypatch.setattr(oaipage, "TREE_BYTES", 0)
    assert parse_page(error, "u").errors == [("badVerb", "no")]


def test_get_record_urls_quote_identifiers_as_urllib_does():
    from urllib.parse import quote

    from aggregator.harvest.oaipage import quote_all

    heads = ("oai:arXiv.org:", "oai:x:é 日本/%:", "", ":", "a b:", "oai:x")
    tails = ("cs/0112017", "".join(map(chr, range(128))), "1234", "abc", "é1", "", ":")
    for text in [h + t for h in heads for t in tails] * 2:  # the second time from the quoted heads
        assert quote_all(text) == quote(text, safe="")


def test_a_records_work_is_the_record_it_stores():
    """``OaiHarvest._work`` makes each record's state change itself (``Work.ready``) and its entry and
    blob info only when asked: for every kind of record (deleted, created in a full walk, updated in an
    incremental one, with and without a datestamp, any identifier) the entry must be the one the record
    describes, and the change what ``change_from`` makes of the work (what the pipeline used before)."""
    from aggregator.harvest.oaipmh import CONTENT_TYPE, OaiHarvest
    from aggregator.harvest.pipeline import change_from
    from aggregator.rs.model import CREATED, DELETED, UPDATED, Entry, Link, Md
    from aggregator.store.blobs import BlobInfo

    stamps = (None, datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC))
    for identifier in ("oai:x:1", "oai:x:é/ 2", ""):
        for stamp in stamps:
            for generation in (None, 3):
                via = "http://h/oai?verb=GetRecord&identifier=" + identifier
                links = [Link("via", via, None, stamp)]
                gone = (identifier, stamp, True, None, 0, None, via)
                work = OaiHarvest._work(gone, generation)
                assert (work.change, work.generation, work.info, work.blob) == (
                    DELETED,
                    generation,
                    None,
                    None,
                )
                assert work.entry == Entry(identifier, stamp, None, Md(None, DELETED, stamp), links)
                assert work.ready == change_from(work, work.info), (gone, generation)
                held = (identifier, stamp, False, "a" * 64, 123, "b" * 32, via)
                work = OaiHarvest._work(held, generation)
                md = Md(None, UPDATED, stamp, type=CONTENT_TYPE)
                assert work.entry == Entry(identifier, stamp, None, md, links)
                assert work.info == BlobInfo("a" * 64, 123, {"sha-256": "a" * 64, "md5": "b" * 32})
                assert work.change == (CREATED if generation is not None else UPDATED)
                assert work.generation == generation and work.blob is None and work.cursor_after is None
                assert work.ready == change_from(work, work.info), (held, generation)


async def test_day_granularity_overlap_is_idempotent(tmp_path: Path):
    """A repository with day granularity: ``from`` is a date, so every later walk lists all of today's
    records again; only what really changed enters the changelog."""
    repo = Repository(granularity="YYYY-MM-DD")
    repo.bulk_add(0, 120)
    app = OaiApp(repo, page_size=25)
    async with serve_app(app) as base:
        cfg = oai_config(tmp_path, f"{base}/oai")
        assert (await harvest(cfg))["oai"].ok
        await change(repo, added=range(500, 503), updated=range(10, 12), deleted=range(20, 21))
        assert (await harvest(cfg))["oai"].ok
        walk = [r for r in app.list_requests() if "resumptionToken" not in r.args][-1]
        assert len(walk.args["from"]) == 10  # YYYY-MM-DD
        assert kinds(changelog(cfg)[120:]) == {"created": 3, "updated": 2, "deleted": 1}
        assert (await harvest(cfg))["oai"].ok
        assert len(changelog(cfg)) == 126
        assert titles(cfg) == repo.live()


def test_peek_token_reads_the_token_from_the_end_of_a_page():
    page = (b'<OAI-PMH xmlns="http://www.openarchives.org/OAI/2.0/"><ListRecords><record/>'
            b'<resumptionToken cursor="0" completeListSize="9">a&amp;b=1</resumptionToken>'
            b"</ListRecords></OAI-PMH>")  # fmt: skip
    assert peek_token(page) == "a&b=1" == parse_page(page, "http://h/oai").token
    assert peek_token(b"<oai:resumptionToken>t</oai:resumptionToken></oai:ListRecords>") == "t"
    no_guess = [
        b"<resumptionToken/>",  # the list is complete
        b'<resumptionToken cursor="9"/>',
        b"<resumptionToken> </resumptionToken>",
        b"<resumptionToken><![CDATA[t]]></resumptionToken>",  # markup: the parser decides
        b"<ListRecords><record/></ListRecords>",
    ]
    for last in no_guess:
        assert peek_token(last) is None, last


async def test_request_ahead_is_a_guess_the_parsed_page_decides(tmp_path: Path):
    """The next page is asked for with a token found in this page's last bytes, before it is parsed. A
    decoy there (a comment after the document) costs a request whose answer is dropped, never a record:
    the parsed page says which request comes next."""
    repo = Repository()
    repo.bulk_add(0, 450)
    decoy = b"\n<!-- <resumptionToken>decoy</resumptionToken> -->\n"
    app = OaiApp(repo, page_size=100, tamper=lambda args, xml: (200, xml + decoy))
    async with serve_app(app) as base:
        repo.base_url = f"{base}/oai"
        cfg = oai_config(tmp_path, f"{base}/oai")
        result = (await harvest(cfg))["oai"]
        assert result.ok, result.error
        log = changelog(cfg)
        assert kinds(log) == {"created": 450} and len({u for u, _, _ in log}) == 450
        assert titles(cfg) == repo.live()
        asked = [r.args.get("resumptionToken") for r in app.list_requests()]
        assert "expired" in asked  # the decoy guessed and asked for (the server refuses it)...
        assert len([t for t in asked if t != "expired"]) == 5  # ...and the walk went on with the real token


async def test_a_page_that_fails_stops_the_walk_after_the_pages_before_it(tmp_path: Path, monkeypatch):
    """Pages are fetched and stored ahead of their state transaction: a page that cannot be had (HTTP
    500 after the retries) or whose records cannot be stored (a full disk) stops the walk once the pages
    before it have committed; the next harvest goes on after the last of them, no gap, no duplicate."""
    repo = Repository()
    repo.bulk_add(0, 450)
    broken = {"http": True}
    fourth = repo.ident(300).encode()  # the first record of page 4

    def tamper(args, xml):
        return (500, b"down") if broken["http"] and fourth in xml else (200, xml)

    app = OaiApp(repo, page_size=100, tamper=tamper)
    async with serve_app(app) as base:
        repo.base_url = f"{base}/oai"
        for name, error in (("http", "500"), ("disk", "No space left on device")):
            cfg = oai_config(tmp_path / name, f"{base}/oai")
            if name == "disk":  # in the harvest's worker processes: a backend that fails on page 4
                broken["http"] = False
                add_plugin(monkeypatch, "faulty", FaultyStores())
                full = {"backend": "full-disk", "settings": {"fail_on": "Record 300<"}}
                result = (await harvest(oai_config(tmp_path / name, f"{base}/oai", store=full)))["oai"]
            else:
                result = (await harvest(cfg))["oai"]
            assert not result.ok and error in result.error, result.error
            assert len(held(cfg)) == 300  # pages 1-3 committed, nothing of page 4
            assert cursor_token(cfg.store_path / "state.db")  # the walk goes on after page 3
            assert temp_files_left(cfg) == []
            monkeypatch.undo()
            broken["http"] = False
            before = len(app.list_requests())
            result = (await harvest(cfg))["oai"]
            assert result.ok, result.error
            assert "resumptionToken" in app.list_requests()[before].args
            log = changelog(cfg)
            assert kinds(log) == {"created": 450} and len({u for u, _, _ in log}) == 450
            assert titles(cfg) == repo.live()


def temp_files_left(cfg) -> list[str]:
    return sorted(p.name for p in (cfg.store_path / "blobs" / "tmp").iterdir() if p.name != ".lock")


async def test_filter_plugin_decides_per_record(tmp_path: Path):
    """Records come a page at a time, yet ``rsagg_filter_harvest`` (here the resourcefilter plugin, by
    identifier) still decides per record: refused in the baseline, a record is not held; refused later
    (the filter narrowed), an update of a held record deletes it."""
    repo = Repository()
    repo.bulk_add(0, 200)
    app = OaiApp(repo, page_size=50)
    async with serve_app(app) as base:
        repo.base_url = f"{base}/oai"
        cfg = oai_config(tmp_path, f"{base}/oai", plugins={"resourcefilter": {"exclude": ["5$"]}})
        assert (await harvest(cfg))["oai"].ok
        assert set(held(cfg)) == {u for u in repo.live() if not u.endswith("5")}
        # Every record in the second the next walk starts from (however long the baseline took to begin):
        # ``from`` is inclusive, so all of them are listed again.
        with State(cfg.store_path / "state.db") as st:
            (s,) = st.sets("oai")
            since = st.cursor(s.id).last_datetime
        for item in repo.items.values():
            item.datestamp = since.astimezone(UTC).replace(tzinfo=None)
        await change(repo, added=range(0, 0), updated=range(3, 5), deleted=range(0, 0))
        cfg = oai_config(tmp_path, f"{base}/oai", plugins={"resourcefilter": {"exclude": ["[45]$"]}})
        assert (await harvest(cfg))["oai"].ok
        # The records of that second are listed again with the updates, so every held record the
        # narrowed filter refuses goes, not only the updated one.
        log = changelog(cfg)[180:]
        assert [u for u, c, _ in log if c == "updated"] == [repo.ident(3)]
        assert {u for u, c, _ in log if c == "deleted"} == {repo.ident(i) for i in range(4, 200, 10)}
        assert len(log) == 21 and set(held(cfg)) == {u for u in repo.live() if u[-1] not in "45"}


def _generated_page(rng, n: int) -> tuple[bytes, list[tuple[str, bool, bytes | None]], str | None, int]:
    """A ListRecords page of ``n`` generated records, and what a harvester must store of it: per
    record kept (identifier, deleted, exclusive C14N of its metadata element, or None when deleted);
    the token (None: the list is complete) and how many records are skipped (no identifier, no
    metadata). Identifiers and texts carry character references and entities (&amp; &lt; &#233;)."""
    from xml.sax.saxutils import escape

    oai = "http://www.openarchives.org/OAI/2.0/"
    texts = ["plain", "a & b < c", "é 日本", "  spaced  ", "quote \" and '", ""]
    body, kept, skipped = [], [], 0
    for i in range(n):
        ident = f"oai:x:{i}/{rng.choice(texts).strip()}"
        stamp = f"<datestamp>2026-01-{rng.randint(1, 28):02d}</datestamp>" if rng.random() < 0.9 else ""
        kind = rng.choice(["live", "live", "live", "deleted", "no-metadata", "no-identifier", "empty-meta"])
        # a character reference for one character of the identifier: the same identifier once parsed
        head = escape(ident).replace("x", "&#120;", 1)
        if kind == "deleted":
            body.append(
                f'<record><header status="deleted"><identifier>{head}</identifier>{stamp}</header></record>'
            )
            kept.append((ident, True, None))
            continue
        if kind == "no-identifier":
            body.append(f"<record><header>{stamp}</header><metadata><m/></metadata></record>")
            skipped += 1
            continue
        if kind == "no-metadata":
            body.append(f"<record><header><identifier>{head}</identifier>{stamp}</header></record>")
            skipped += 1
            continue
        if kind == "empty-meta":  # a metadata element with nothing in it: no record content
            header = f"<header><identifier>{head}</identifier>{stamp}</header>"
            body.append(f"<record>{header}<metadata> </metadata></record>")
            skipped += 1
            continue
        prefix = rng.choice(["", "dc:", "oai_dc:"])
        decl = f'xmlns{":" + prefix[:-1] if prefix else ""}="http://www.openarchives.org/OAI/2.0/oai_dc/"'
        meta = (f'<{prefix}dc {decl} lang="en"><{prefix}title>{escape(rng.choice(texts))}</{prefix}title>'
                f"<{prefix}n>{i}</{prefix}n></{prefix}dc>")  # fmt: skip
        body.append(
            f"<record><header><identifier>{head}</identifier>{stamp}</header><metadata>{meta}</metadata></record>"
        )
        kept.append((ident, False, etree.tostring(etree.fromstring(meta), method="c14n", exclusive=True)))
    token = rng.choice([None, "", "tok&amp;1", "t-2"])
    size = rng.randint(n, 10 * n + 1)
    if token is None:
        tail = ""
    elif token == "":  # the last page of a list: an empty token, with attributes (§3.5)
        tail = f'<resumptionToken completeListSize="{size}" cursor="3"/>'
    else:
        attrs = f'expirationDate="2030-01-01T00:00:00Z" completeListSize="{size}" cursor="0"'
        tail = f"<resumptionToken {attrs}>{token}</resumptionToken>"
    doc = (f'<?xml version="1.0" encoding="UTF-8"?>\n<OAI-PMH xmlns="{oai}">'
           "<responseDate>2026-01-02T03:04:05Z</responseDate>"
           f"<ListRecords>{''.join(body)}{tail}</ListRecords></OAI-PMH>")  # fmt: skip
    return doc.encode(), kept, (token.replace("&amp;", "&") or None) if token is not None else None, skipped


@pytest.mark.parametrize("inline", [{}, {"inline_bytes": 0}], ids=["put_small", "writers"])
@pytest.mark.parametrize("whole", [True, False], ids=["tree", "incremental"])
def test_the_records_stored_are_the_records_served(tmp_path: Path, monkeypatch, whole: bool, inline: dict):
    """Generated pages (deleted records, records without identifier or metadata, character references,
    tokens with attributes, the empty token of the last page), parsed whole and incrementally: every
    record served is stored, with its identifier, its deletion, the exclusive C14N of its metadata as
    a durable blob and its GetRecord URL; the skipped ones are counted as problems; the token is read
    as served. Both ways a page's records become blobs: rows of small.db at once (``put_small``), or a
    writer each (a store without small.db)."""
    import hashlib
    import random
    from urllib.parse import quote

    import aggregator.harvest.oaipage as oaipage
    from aggregator.harvest.oaipage import store_page
    from aggregator.store.defaults import create_store

    if not whole:
        monkeypatch.setattr(oaipage, "TREE_BYTES", 0)
    blobs = create_store(inline, tmp_path)
    get_record = "http://h/oai?verb=GetRecord&metadataPrefix=oai_dc&identifier="
    rng = random.Random(28)
    try:
        for n in [0, 1, 2, 5, 17, 60] * 4:
            data, kept, token, skipped = _generated_page(rng, n)
            page, stored, error = store_page(blobs, data, "http://h/oai", get_record)
            assert error is None and page.records == [] and not page.errors
            assert (page.token, len(page.problems)) == (token, skipped), data
            assert [(s[0], s[2]) for s in stored] == [(ident, gone) for ident, gone, _ in kept]
            for (ident, gone, content), (_, _, _, sha, length, md5, via) in zip(kept, stored, strict=True):
                assert via == get_record + quote(ident, safe="")
                if gone:
                    assert (sha, md5) == (None, None)
                    continue
                assert sha is not None and length == len(content) and blobs.exists(sha)
                assert (sha, md5) == (hashlib.sha256(content).hexdigest(), hashlib.md5(content).hexdigest())
                assert (blobs.read_inline(sha) is not None) == (not inline)  # a row, or a file each
                with blobs.open(sha) as f:
                    assert f.read() == content
    finally:
        blobs.close()


# -- pages over the lean client ------------------------------------------------------------------------


def _coded(body: bytes, coding: str) -> bytes:
    import gzip
    import zlib

    return {"gzip": gzip.compress, "deflate": zlib.compress}.get(coding, lambda b: b)(body)


def _get_bytes_cases() -> list[tuple[str, bytes, bool, int]]:
    """(name, raw response, server closes after it, max_bytes): content codings x framings x statuses x
    sizes, generated, as an OAI-PMH walk may meet them."""
    import random

    from .test_lean import response

    rng = random.Random(28)
    cases = []
    for i in range(30):
        status = rng.choice([200, 200, 200, 404, 500, 503])
        coding = rng.choice(["identity", "gzip", "deflate"])
        framing = rng.choice(["length", "chunked", "close"])
        body = b"<OAI-PMH>" + rng.randbytes(rng.choice([0, 10, 3000, 70000])).hex().encode() + b"</OAI-PMH>"
        headers = {"Content-Type": "text/xml"}
        if coding != "identity":
            headers["Content-Encoding"] = coding
        if status == 503:
            headers["Retry-After"] = "0"
        cap = rng.choice([10**6, 10**6, 1000])
        raw = response(status, _coded(body, coding), framing=framing, headers=headers)
        cases.append(
            (f"{i}: {status} {coding} {framing} {len(body)}B cap={cap}", raw, framing == "close", cap)
        )
    return cases


GET_BYTES_CASES = _get_bytes_cases()


@pytest.mark.parametrize("case", range(len(GET_BYTES_CASES)), ids=[c[0] for c in GET_BYTES_CASES])
async def test_pages_over_the_lean_client_read_as_over_httpx(case: int) -> None:
    """A walk fetches its pages over the lean keep-alive client (``get_bytes(lean_ok=True)``): the page
    it reads (decoded), its status and its failures are what the httpx path gives for the same answer."""
    from aggregator.harvest.fetch import FetchError

    from .test_lean import Script, fetcher, scripted

    name, raw, close, cap = GET_BYTES_CASES[case]
    outcomes = []
    for lean_ok in (True, False):
        script = Script()
        async with scripted(script) as base:
            url = base + script.add("/oai?verb=ListRecords&resumptionToken=t", raw, close=close)
            async with fetcher() as f:
                try:
                    got = await f.get_bytes(url, max_bytes=cap, lean_ok=lean_ok)
                    outcomes.append(("ok", got.status, got.content, got.content_type))
                except FetchError as exc:
                    outcomes.append(("error", exc.kind, exc.status, exc.transient, exc.retry_after))
                assert f._lean is not None
                assert (f._lean.connections_opened >= 1) == lean_ok, name  # which path ran
        assert script.requests[0][1].get("accept-encoding") == "gzip, deflate", name
    assert outcomes[0] == outcomes[1], name


async def test_a_walk_fetches_its_pages_over_the_lean_client(tmp_path: Path) -> None:
    """Every request of a walk (Identify, the ListRecords pages) goes over the lean client's keep-alive
    connections: a handful of connections for many pages."""
    repo = Repository()
    repo.bulk_add(0, 250)
    sent: list[str] = []
    opened = 0
    real_send, real_aclose = lean.LeanPool.send, lean.LeanPool.aclose

    async def send(self: lean.LeanPool, request: lean.Request) -> lean.Response:
        sent.append(str(request.url))
        return await real_send(self, request)

    async def aclose(self: lean.LeanPool) -> None:
        nonlocal opened
        opened += self.connections_opened
        await real_aclose(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lean.LeanPool, "send", send)
        mp.setattr(lean.LeanPool, "aclose", aclose)
        async with serve_app(OaiApp(repo, page_size=50)) as base:
            repo.base_url = f"{base}/oai"
            cfg = oai_config(tmp_path, f"{base}/oai")
            result = (await harvest(cfg))["oai"]
            assert result.ok, result.error
    assert len(held(cfg)) == 250
    assert sum("verb=ListRecords" in u for u in sent) == 5 and any("verb=Identify" in u for u in sent)
    assert 1 <= opened < len(sent)
