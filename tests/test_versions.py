"""Prior versions (§14.6, RFC 7089; aggregator/publish/versions.py, store/retention.py, commands/gc.py).

A resource updated five times (at known times): mementoweb's ``memento-client`` 0.6.1, a client nobody
here wrote, finds through rsagg's TimeGate the version current at datetimes before, between and after
the changes; the TimeMap lists exactly the five versions; the list entries carry the three §14.6
links; retention policies keep and drop exactly what they say after gc; hidden versions 404.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import trio
from memento_client import MementoClient

from aggregator.commands.gc import collect_garbage, retention_for
from aggregator.config import Config, PublishConfig
from aggregator.publish.uris import rsagg_path, rsagg_uri
from aggregator.publish.versions import (
    BadDatetime,
    accept_datetime,
    parse_stamp,
    split_version_path,
    stamp,
)
from aggregator.rs.parse import parse_bytes
from aggregator.rs.validate import validate_source
from aggregator.store.blobs import FileBlobStore
from aggregator.store.retention import Retention, RetentionError, parse_retention
from aggregator.store.rows import Change
from aggregator.store.state import State

from .harvesting import make_config
from .test_publish import NoLocalPath, publishing
from .test_resource_get import answer

UP = "http://upstream.example/"
DOC = UP + "doc.html"
OTHER = UP + "other.txt"
T0 = datetime(2024, 3, 1, 12, 0, 0, tzinfo=UTC)
#: The five versions of DOC, a day apart (seconds apart would do: Accept-Datetime has seconds).
TIMES = [T0 + timedelta(days=i) for i in range(5)]
BODIES = [f"<p>version {i}</p>".encode() for i in range(5)]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def filled(tmp_path: Path, *, versions: Any = "all", deleted: bool = False, extra: int = 0) -> Config:
    """DOC created then updated four times at TIMES (plus OTHER once, and ``extra`` more versions of
    OTHER an hour apart after them); DOC deleted a day after the last when ``deleted``."""
    cfg = make_config(tmp_path / "data", {"up": UP + ".well-known/resourcesync"})
    cfg = dataclasses.replace(cfg, publish=PublishConfig(versions=versions, dump_interval=0))
    cfg.store_path.mkdir(parents=True, exist_ok=True)
    others = [f"other {i}".encode() for i in range(extra + 1)]
    blobs = FileBlobStore(cfg.store_path / "blobs")
    try:
        for data in [*BODIES, *others]:
            blobs.put_bytes(data)
    finally:
        blobs.close()
    clock_at = [T0]
    with State(cfg.store_path / "state.db", clock=lambda: clock_at[0]) as st:
        st.upsert_source("up", UP + ".well-known/resourcesync")
        sid = st.ensure_set("up", UP + "capabilitylist.xml")
        for i, (when, body) in enumerate(zip(TIMES, BODIES, strict=True)):
            clock_at[0] = when
            batch = [Change(DOC, "created" if i == 0 else "updated", sha(body), len(body), "text/html")]
            if i == 0:
                batch.append(Change(OTHER, "created", sha(others[0]), len(others[0]), "text/plain"))
            st.apply(sid, batch)
        for j, body in enumerate(others[1:], 1):
            clock_at[0] = TIMES[-1] + timedelta(hours=j)
            st.apply(sid, [Change(OTHER, "updated", sha(body), len(body), "text/plain")])
        if deleted:
            clock_at[0] = TIMES[-1] + timedelta(days=1)
            st.apply(sid, [Change(DOC, "deleted")])
    return cfg


def http(dt: datetime) -> str:
    return dt.strftime("%a, %d %b %Y %H:%M:%S GMT")


# ---------------------------------------------------------------------------------------------------
# URIs and parsing (tables that generate cases)


@pytest.mark.parametrize(
    "uri",
    [DOC, "https://h.example/a%2Fb/c?d=1&e", "urn:x-y:z", "http://h.example/1/2/3", "ftp://h/x y"],
)
@pytest.mark.parametrize("kind", ["memento", "timegate", "timemap"])
@pytest.mark.parametrize("number", [None, "0", "20240301120000000000", "42"])
def test_version_paths_round_trip(uri: str, kind: str, number: str | None):
    """Every URI rsagg maps comes back from every kind of version path, with or without its number
    segment (a mapped path never starts with a digit)."""
    raw = f"/set/{kind}/{'' if number is None else number + '/'}{rsagg_path(uri)}"
    assert split_version_path(raw, kind) == ("set", number, uri)
    assert split_version_path(raw, "other") is None


def test_stamps_round_trip():
    for i in range(200):
        dt = T0 + timedelta(seconds=i * 9_973.123457, microseconds=i)
        s = stamp(dt)
        assert len(s) == 20 and parse_stamp(s) == dt
    for bad in ["", "2024", "2024030112000000000x", "20241301120000000000", "202403011200000000000"]:
        assert parse_stamp(bad) is None


@pytest.mark.parametrize(
    "value",
    ["", "yesterday", "Fri, 01 Mar 2024 12:00:00", "2024-03-01T12:00:00Z", "Fri, 41 Mar 2024 12:00:00 GMT"],
)
def test_bad_accept_datetime(value: str):
    with pytest.raises(BadDatetime):
        accept_datetime(value)


def test_accept_datetime():
    assert accept_datetime("Fri, 01 Mar 2024 12:00:00 GMT") == T0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("all", Retention()),
        (1, Retention(last=1)),
        (7, Retention(last=7)),
        ("90d", Retention(younger=90 * 86400)),
        ("12h", Retention(younger=12 * 3600)),
        ("2w", Retention(younger=14 * 86400)),
        ("30 m", Retention(younger=1800)),
        ("1.5s", Retention(younger=1.5)),
    ],
)
def test_parse_retention(value: Any, expected: Retention):
    assert parse_retention(value) == expected


@pytest.mark.parametrize("value", [0, -3, True, "", "forever", "10", "0d", "5y", 1.5, None])
def test_parse_retention_refuses(value: Any):
    with pytest.raises(RetentionError):
        parse_retention(value)


def test_config_refuses_bad_versions():
    from aggregator.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"publish\.versions: must be"):
        parse_config({"publish": {"versions": "forever"}}, "t.toml")


# ---------------------------------------------------------------------------------------------------
# memento-client against rsagg


async def test_memento_client_finds_each_version(tmp_path: Path):
    cfg = filled(tmp_path)
    async with publishing(cfg) as (base, client):
        uri_r = rsagg_uri(base, "up", DOC)

        def ask(when: datetime) -> dict:
            with MementoClient(timegate_uri=base + "/", check_native_timegate=True) as mc:
                return mc.get_memento_info(uri_r, when.replace(tzinfo=None))

        probes = [(TIMES[0] - timedelta(days=30), 0)]  # before the first: the first (RFC 7089 §4.1)
        for i, t in enumerate(TIMES):
            probes += [(t, i), (t + timedelta(hours=1), i)]  # at a change, and between changes
        probes.append((TIMES[-1] + timedelta(days=400), 4))  # after the last: the last
        for when, i in probes:
            info = await trio.to_thread.run_sync(ask, when)
            closest = info["mementos"]["closest"]
            assert info["timegate_uri"] == f"{base}/up/timegate/{rsagg_path(DOC)}"
            assert closest["datetime"] == TIMES[i].replace(tzinfo=None), when
            r = await client.get(closest["uri"][0])
            assert r.status_code == 200 and r.content == BODIES[i], when
            assert r.headers["memento-datetime"] == http(TIMES[i])
            assert "immutable" in r.headers["cache-control"]
            links = r.headers["link"]
            for rel in ("original", "timegate", "timemap"):
                assert f'rel="{rel}"' in links

        r = await client.get(f"{base}/up/timemap/{rsagg_path(DOC)}")
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/link-format")
        mementos = _timemap_mementos(r.text)
        assert [dt for _, dt in mementos] == [http(t) for t in TIMES]
        for (uri_m, _), body in zip(mementos, BODIES, strict=True):
            assert (await client.get(uri_m)).content == body


def _timemap_mementos(text: str) -> list[tuple[str, str]]:
    """(URI, datetime) of the memento entries of a link-format TimeMap, in order."""
    out = []
    for m in re.finditer(r'<([^>]*)>;rel="([^"]*)"(?:;datetime="([^"]*)")?', text):
        if "memento" in m.group(2).split():
            out.append((m.group(1), m.group(3)))
    return out


async def test_timegate_answers(tmp_path: Path):
    cfg = filled(tmp_path)
    async with publishing(cfg) as (base, client):
        tg = f"{base}/up/timegate/{rsagg_path(DOC)}"
        r = await client.get(tg, headers={"accept-datetime": http(TIMES[2] + timedelta(minutes=5))})
        assert r.status_code == 302 and r.headers["vary"] == "accept-datetime"
        assert r.headers["location"] == f"{base}/up/memento/{stamp(TIMES[2])}/{rsagg_path(DOC)}"
        assert 'rel="original"' in r.headers["link"] and 'rel="timemap"' in r.headers["link"]
        assert f'<{r.headers["location"]}>; rel="memento"' in r.headers["link"]
        r = await client.get(tg)  # no Accept-Datetime: the current version
        assert r.headers["location"].split("/memento/")[1].startswith(stamp(TIMES[4]))
        for bad in ["tomorrow", "2024-03-01", "Fri, 01 Mar 2024 12:00:00 +0100"]:
            r = await client.get(tg, headers={"accept-datetime": bad})
            assert r.status_code == 400 and "Accept-Datetime" in r.text
        r = await client.get(f"{base}/up/timegate/{rsagg_path(UP + 'never.html')}")
        assert r.status_code == 404
        # the resource's own URI points at its TimeGate and TimeMap
        r = await client.get(rsagg_uri(base, "up", DOC))
        assert r.content == BODIES[4]
        assert f'<{tg}>; rel="timegate"' in r.headers["link"] and 'rel="resourcesync"' in r.headers["link"]
        # a memento URI rsagg never wrote
        r = await client.get(f"{base}/up/memento/{stamp(TIMES[2] + timedelta(seconds=1))}/{rsagg_path(DOC)}")
        assert r.status_code == 404


async def test_list_entries_carry_the_links_of_14_6(tmp_path: Path):
    """Every Change List entry names the memento of exactly its version (Example 29), which serves
    those bytes; the Resource List names the current one; the validator finds nothing to say."""
    cfg = filled(tmp_path)
    async with publishing(cfg) as (base, client):
        rl = await client.get(f"{base}/up/resourcelist.xml")
        cl = await client.get(f"{base}/up/changelist.xml")
        for doc in (rl, cl):
            assert validate_source(doc.content) == []
        _, entries = parse_bytes(cl.content)
        seen = []
        for e in entries:
            rels = {ln.rel: ln for ln in e.links}
            assert set(rels) >= {"via", "memento", "timegate", "timemap"}
            assert rels["timemap"].type == "application/link-format"
            tg = rels["timegate"]
            assert (tg.modified, tg.hash, tg.length, tg.type) == (None, None, None, None)
            m = rels["memento"]
            assert m.modified == e.md.datetime and m.hash == e.md.hash and m.length == e.md.length
            r = await client.get(m.href)
            assert r.status_code == 200 and sha(r.content) == e.md.hash.split("sha-256:")[1].split()[0]
            if e.loc == rsagg_uri(base, "up", DOC):
                seen.append(r.content)
        assert seen == BODIES
        _, entries = parse_bytes(rl.content)
        for e in entries:
            m = next(ln for ln in e.links if ln.rel == "memento")
            assert m.modified == e.lastmod and m.hash == e.md.hash
            assert (await client.get(m.href)).status_code == 200


async def test_deleted_resource_keeps_its_timemap(tmp_path: Path):
    cfg = filled(tmp_path, deleted=True)
    async with publishing(cfg) as (base, client):
        assert (await client.get(rsagg_uri(base, "up", DOC))).status_code == 410
        r = await client.get(f"{base}/up/timemap/{rsagg_path(DOC)}")
        mementos = _timemap_mementos(r.text)
        assert [dt for _, dt in mementos] == [http(t) for t in TIMES]
        assert (await client.get(mementos[-1][0])).content == BODIES[-1]
        r = await client.get(f"{base}/up/timegate/{rsagg_path(DOC)}")
        assert r.status_code == 302 and stamp(TIMES[-1]) in r.headers["location"]


async def test_timemap_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A history longer than a page goes on at ``rel="next"``: the pages together list each version
    once, in order."""
    from aggregator.publish import versions

    monkeypatch.setattr(versions, "TIMEMAP_PAGE", 2)
    cfg = filled(tmp_path)
    async with publishing(cfg) as (base, client):
        url: str | None = f"{base}/up/timemap/{rsagg_path(DOC)}"
        listed, pages = [], 0
        while url is not None:
            text = (await client.get(url)).text
            pages += 1
            listed += [dt for _, dt in _timemap_mementos(text)]
            m = re.search(r'<([^>]*)>;rel="next"', text)
            url = m.group(1) if m else None
        assert listed == [http(t) for t in TIMES] and pages == 3


async def test_hidden_versions_answer_404(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The publish filter sees each version: one it hides is 404 and missing from the TimeMap, as a
    resource never held; the TimeGate skips it."""
    from aggregator.publish import app as app_module

    hidden = sha(BODIES[2])
    real = app_module.publish_filter

    def hiding(plugins):
        visible = real(plugins)
        return lambda set_name, r: r.sha256 != hidden and visible(set_name, r)

    monkeypatch.setattr(app_module, "publish_filter", hiding)
    cfg = filled(tmp_path)
    async with publishing(cfg) as (base, client):
        m2 = f"{base}/up/memento/{stamp(TIMES[2])}/{rsagg_path(DOC)}"
        r = await client.get(m2)
        assert r.status_code == 404 and "memento-datetime" not in r.headers
        assert (await client.get(m2.replace(stamp(TIMES[2]), stamp(TIMES[3])))).status_code == 200
        r = await client.get(f"{base}/up/timemap/{rsagg_path(DOC)}")
        assert [dt for _, dt in _timemap_mementos(r.text)] == [http(TIMES[i]) for i in (0, 1, 3, 4)]
        r = await client.get(
            f"{base}/up/timegate/{rsagg_path(DOC)}", headers={"accept-datetime": http(TIMES[2])}
        )
        assert stamp(TIMES[1]) in r.headers["location"]


# ---------------------------------------------------------------------------------------------------
# Retention: each policy keeps and drops exactly what it says


def _kept_by_policy(policy: Any, now: datetime) -> set[int]:
    """Indexes of DOC's versions the policy keeps (the definition in store/retention.py, by hand)."""
    if policy == "all":
        return set(range(5))
    if isinstance(policy, int):
        return set(range(max(0, 5 - policy), 5))
    seconds = parse_retention(policy).younger
    assert seconds is not None
    # version i is superseded at TIMES[i + 1]; the last never is
    return {i for i in range(5) if i == 4 or TIMES[i + 1] > now - timedelta(seconds=seconds)}


POLICIES = ["all", 1, 2, 3, 5, 9, "1s", "1d", "2d", "3d", "1w"]


@pytest.mark.parametrize("policy", POLICIES)
async def test_retention_after_gc(tmp_path: Path, policy: Any):
    """After gc: exactly the versions the policy keeps have their blobs and answer 200; the others
    410 with a Link to the TimeMap and are left out of it; the current version of every resource, and
    every blob a Change List memento link names that still answers 200, are kept."""
    now = TIMES[-1] + timedelta(days=1, hours=1)
    cfg = filled(tmp_path, versions=policy)
    kept = _kept_by_policy(policy, now)
    with State(cfg.store_path / "state.db") as st:
        blobs = FileBlobStore(cfg.store_path / "blobs")
        try:
            retention = retention_for(cfg, st).at_time(now)
            collect_garbage(st, blobs, grace=0, retention=retention)
            present = {i for i, body in enumerate(BODIES) if blobs.exists(sha(body))}
        finally:
            blobs.close()
    assert present == kept

    from aggregator.publish import versions

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(versions, "utcnow", lambda: now)
        async with publishing(cfg) as (base, client):
            for i, t in enumerate(TIMES):
                r = await client.get(f"{base}/up/memento/{stamp(t)}/{rsagg_path(DOC)}")
                assert r.status_code == (200 if i in kept else 410), (policy, i)
                if i not in kept:
                    assert f'/up/timemap/{rsagg_path(DOC)}>; rel="timemap"' in r.headers["link"]
            r = await client.get(f"{base}/up/timemap/{rsagg_path(DOC)}")
            assert [dt for _, dt in _timemap_mementos(r.text)] == [http(TIMES[i]) for i in sorted(kept)]
            # the TimeGate chooses among the kept versions: before them, the oldest kept one
            for when, i in [(TIMES[0] - timedelta(days=1), 0), *((t, i) for i, t in enumerate(TIMES))]:
                expected = i if i in kept else min(kept)
                r = await client.get(
                    f"{base}/up/timegate/{rsagg_path(DOC)}", headers={"accept-datetime": http(when)}
                )
                assert r.status_code == 302 and stamp(TIMES[expected]) in r.headers["location"], (policy, i)
            assert (await client.get(rsagg_uri(base, "up", DOC))).content == BODIES[4]
            assert (await client.get(rsagg_uri(base, "up", OTHER))).status_code == 200
            # The Change Lists keep working, and no memento they name answers 500 (a blob gone
            # although retained): each is 200 with its bytes, or 410 beyond retention.
            cl = await client.get(f"{base}/up/changelist.xml")
            assert cl.status_code == 200 and validate_source(cl.content) == []
            _, entries = parse_bytes(cl.content)
            assert len(entries) == 6
            for e in entries:
                m = next((ln for ln in e.links if ln.rel == "memento"), None)
                assert m is not None
                r = await client.get(m.href)
                assert r.status_code in (200, 410)
                if r.status_code == 200:
                    assert sha(r.content) == m.hash.split(":")[1]


async def test_retention_keeps_records_not_yet_in_a_change_dump(tmp_path: Path):
    """While dumps are built, every record after the last Change Dump package stays, whatever the
    policy: the packages still to come are built from them."""
    cfg = filled(tmp_path, versions=1)
    cfg = dataclasses.replace(cfg, publish=dataclasses.replace(cfg.publish, dump_interval=3600.0))
    with State(cfg.store_path / "state.db") as st:
        retention = retention_for(cfg, st)
        assert retention.floor_seq == 0
        blobs = FileBlobStore(cfg.store_path / "blobs")
        try:
            collect_garbage(st, blobs, grace=0, retention=retention)
            assert all(blobs.exists(sha(b)) for b in BODIES)
        finally:
            blobs.close()


def test_retention_sql_and_version_at_match_their_definitions(tmp_path: Path):
    """The SQL gc runs and ``Retention.retained`` (what the mementos answer) agree, and ``version_at``
    (the TimeGate's choice) is the last version at or before the instant, else the first, for a
    random history and every policy (SQLite here, PostgreSQL in the test below)."""
    from aggregator.store.sql.dialect import SQLITE

    _check_definitions(lambda clock: State(tmp_path / "s.db", clock=clock), SQLITE.literal_row)


def test_retention_sql_and_version_at_on_postgres(pg_server):
    from aggregator.store.open import connect
    from aggregator.store.sql.dialect import POSTGRES

    url = pg_server.fresh_url()
    _check_definitions(lambda clock: connect(url, clock=clock), POSTGRES.literal_row)


def _check_definitions(open_state, when) -> None:
    import random

    from aggregator.store.retention import retained_sql

    rnd = random.Random(7)
    start = T0
    clock = [start]
    st = open_state(lambda: clock[0])
    try:
        st.upsert_source("x", UP + "desc.xml")
        sid = st.ensure_set("x", UP + "cap.xml")
        uris = [UP + f"r{i}" for i in range(12)]
        live: set[str] = set()
        for step in range(300):
            clock[0] = start + timedelta(minutes=step * rnd.choice([1, 7, 60]))
            u = rnd.choice(uris)
            if u in live and rnd.random() < 0.15:
                st.apply(sid, [Change(u, "deleted")])
                live.discard(u)
            else:
                body = f"{u} {step}".encode()
                st.apply(sid, [Change(u, "updated" if u in live else "created", sha(body), len(body))])
                live.add(u)
        now = clock[0] + timedelta(minutes=30)
        records = list(st.iter_changelog())
        for policy in [1, 2, 5, "1h", "6h", "2d", "30d"]:
            r = parse_retention(policy).at_time(now)
            sql = f"SELECT sha256 FROM ({retained_sql(r, when)}) AS q"
            by_sql = {bytes(row[0]).hex() for row in _query(st, sql)}  # stored binary
            by_def = set()
            for rec in records:
                if rec.change == "deleted":
                    continue
                later = [x for x in records if x.resource_id == rec.resource_id and x.seq > rec.seq]
                newer = sum(1 for x in later if x.change != "deleted")
                if r.retained(newer, later[0].datetime if later else None, now):
                    by_def.add(rec.sha256)
            assert by_sql == by_def, policy
        instants = [rec.datetime for rec in records]
        instants += [start + timedelta(minutes=rnd.uniform(-100, 300 * 60)) for _ in range(300)]
        for rid in {rec.resource_id for rec in records}:
            mine = [x for x in records if x.resource_id == rid and x.change != "deleted"]
            for at in instants:
                before = [x for x in mine if x.datetime <= at]
                expected = before[-1] if before else mine[0]
                assert st.version_at(rid, at) == expected, (rid, at)
    finally:
        st.close()


def _query(st, sql: str) -> list[tuple]:
    if hasattr(st, "conn"):
        return st.conn.execute(sql).fetchall()
    with st._read() as c:
        return c.execute(sql).fetchall()


# ---------------------------------------------------------------------------------------------------
# Validator: §14.6 links


@pytest.mark.parametrize(
    ("link", "rule"),
    [
        ('<rs:ln rel="memento" href=""/>', "memento-href-missing"),
        ('<rs:ln rel="timegate" href="http://e.example/tg" type="text/html"/>', "timegate-attributes"),
        ('<rs:ln rel="timegate" href="http://e.example/tg" length="3"/>', "timegate-attributes"),
        ('<rs:ln rel="timegate" href="http://e.example/tg" modified="2013-01-03T07:00:00Z"/>',
         "timegate-attributes"),
        ('<rs:ln rel="timegate" href="http://e.example/tg"/>', None),
        ('<rs:ln rel="memento" href="http://e.example/m" modified="2013-01-03T07:00:00Z"/>', None),
    ],
)  # fmt: skip
def test_validator_checks_links_of_14_6(link: str, rule: str | None):
    doc = (
        '<?xml version="1.0" encoding="UTF-8"?>\n<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" '
        'xmlns:rs="http://www.openarchives.org/rs/terms/"><rs:ln rel="up" href="http://e.example/cap.xml"/>'
        '<rs:md capability="changelist" from="2013-01-03T00:00:00Z"/><url><loc>http://e.example/res1</loc>'
        '<lastmod>2013-01-03T18:00:00Z</lastmod><rs:md change="updated"/>' + link + "</url></urlset>"
    )
    rules = [i.rule for i in validate_source(doc.encode())]
    assert rules == ([] if rule is None else [rule])


# ---------------------------------------------------------------------------------------------------
# Offload modes: a memento is handed over like a current resource


@pytest.mark.parametrize("offload", ["x-accel", "redirect"])
async def test_mementos_under_offload(tmp_path: Path, offload: str):
    """x-accel: the version's blob is named for nginx (with the memento's headers); redirect with a
    store without URLs: rsagg sends the bytes itself. 304 stays rsagg's."""
    cfg = filled(tmp_path)
    cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, offload=offload))
    async with publishing(cfg) as (base, client):
        url = f"{base}/up/memento/{stamp(TIMES[1])}/{rsagg_path(DOC)}"
        r = await client.get(url)
        assert r.status_code == 200
        assert r.headers["memento-datetime"] == http(TIMES[1]) and "immutable" in r.headers["cache-control"]
        if offload == "x-accel":
            h = sha(BODIES[1])
            assert r.headers["x-accel-redirect"].startswith(cfg.server.offload_location)
            assert r.headers["x-accel-redirect"].endswith(h) and r.content == b""
            assert r.headers["etag"] == f'"{h}"' and 'rel="original"' in r.headers["link"]
        else:
            assert r.content == BODIES[1]
        r = await client.get(url, headers={"if-none-match": f'"{sha(BODIES[1])}"'})
        assert r.status_code == 304 and "x-accel-redirect" not in r.headers


async def test_a_prior_version_whose_blob_is_gone_is_410_not_500(tmp_path: Path):
    """A stricter policy applied by an earlier gc, then loosened: the versions gc removed are gone
    (410 with the Link to the TimeMap), never a 500 for a blob the store lacks."""
    cfg = filled(tmp_path)  # "all" now
    with State(cfg.store_path / "state.db") as st:
        blobs = FileBlobStore(cfg.store_path / "blobs")
        try:
            collect_garbage(st, blobs, grace=0, retention=parse_retention(1))  # as an earlier gc did
        finally:
            blobs.close()
    async with publishing(cfg) as (base, client):
        for i, t in enumerate(TIMES):
            r = await client.get(f"{base}/up/memento/{stamp(t)}/{rsagg_path(DOC)}")
            assert r.status_code == (200 if i == 4 else 410)
            if i < 4:
                assert 'rel="timemap"' in r.headers["link"]


# ---------------------------------------------------------------------------------------------------
# The hot route answers mementos as the app's memento route does (publish/fastpath.py)


class _WithUrls(NoLocalPath):
    """A blob store without local files whose blobs have URLs (as S3's presigned ones): redirect."""

    def url(self, sha256: str, lifetime: int, content_type: str | None = None) -> str:
        return f"https://blobs.example/{sha256}?type={content_type}&ttl={lifetime}"


#: Request headers of the table, with ETAG standing for the version's own ETag.
_ASKED: list[dict[str, str]] = [
    {},
    {"if-none-match": "ETAG"},
    {"if-none-match": "W/ETAG"},
    {"if-none-match": '"other"'},
    {"if-modified-since": http(TIMES[-1] + timedelta(days=9))},
    {"if-modified-since": http(T0 - timedelta(days=9))},
    {"range": "bytes=0-4"},
    {"range": "bytes=-3"},
    {"range": "bytes=3-"},
    {"range": "bytes=0-1,3-4"},
    {"range": "bytes=999-"},
    {"range": "bytes=0-4", "if-range": "ETAG"},
    {"range": "bytes=0-4", "if-range": '"other"'},
    {"if-match": "ETAG"},
    {"if-match": '"other"'},
    {"if-unmodified-since": http(T0 - timedelta(days=9))},
    {"if-unmodified-since": http(TIMES[-1] + timedelta(days=9))},
]
#: Ranges that starlette's FileResponse decides (multipart, 416): the hot route hands them on.
_FILE_RESPONSE_RANGES = {"bytes=0-1,3-4", "bytes=999-"}


def _end_to_end(a: tuple[int, list[tuple[str, str]], bytes]) -> tuple[int, list[tuple[str, str]], bytes]:
    """The answer less ``Connection`` (hop-by-hop, RFC 9110 §7.6.1: the server closes a connection
    after so many requests, whichever route answered the last)."""
    return a[0], [(k, v) for k, v in a[1] if k != "connection"], a[2]


@pytest.mark.parametrize(
    ("offload", "store"),
    [("none", "file"), ("none", "stream"), ("x-accel", "file"), ("redirect", "urls"), ("redirect", "file")],
)
async def test_hot_route_answers_mementos_as_the_app_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offload: str, store: str
):
    """Every memento request of a table (versions served, beyond retention, hidden, never written,
    of a resource or set never held; x validators, ranges, preconditions; x GET, HEAD) gets the same
    status, headers (in order, less Date and Server) and bytes from the hot route (and the server's
    fast lane) as from the app's memento route. Under offload "none" with local files, the hot route
    answers all of them itself but the ranges only FileResponse decides."""
    from aggregator.publish import app as app_module
    from aggregator.publish import fastpath, versions

    hidden = sha(BODIES[3])
    real_filter = app_module.publish_filter

    def hiding(plugins):
        visible = real_filter(plugins)
        return lambda set_name, r: r.sha256 != hidden and visible(set_name, r)

    monkeypatch.setattr(app_module, "publish_filter", hiding)
    paths: list[fastpath.ResourceFastPath] = []
    real_init = fastpath.ResourceFastPath.__init__

    def recorded(self, *args: Any, **kw: Any) -> None:
        real_init(self, *args, **kw)
        paths.append(self)

    monkeypatch.setattr(fastpath.ResourceFastPath, "__init__", recorded)
    reached: list[str] = []  # memento requests the app's route answered
    real_memento = versions.memento

    async def counted(request: Any) -> Any:
        reached.append(request.method)
        return await real_memento(request)

    monkeypatch.setattr(versions, "memento", counted)

    cfg = filled(tmp_path, versions=3)  # TIMES[0] and TIMES[1] beyond retention
    cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, offload=offload))
    inner = FileBlobStore(cfg.store_path / "blobs")
    blobs = {"file": None, "stream": NoLocalPath(inner), "urls": _WithUrls(inner)}[store]
    try:
        async with publishing(cfg, blobs=blobs) as (base, client):
            (fast,) = paths
            memento_route = fast.memento_route
            assert memento_route is not None
            cases: list[tuple[str, bytes | None]] = [  # (URL, the bytes of the version when served)
                *(
                    (f"{base}/up/memento/{stamp(t)}/{rsagg_path(DOC)}", body)
                    for t, body in zip(TIMES, BODIES, strict=True)
                ),
                (f"{base}/up/memento/{stamp(T0)}/{rsagg_path(OTHER)}", b"other 0"),
                (f"{base}/up/memento/{stamp(TIMES[2] + timedelta(seconds=1))}/{rsagg_path(DOC)}", None),
                (f"{base}/up/memento/{stamp(T0)}/{rsagg_path(UP + 'never.html')}", None),
                (f"{base}/nosuchset/memento/{stamp(T0)}/{rsagg_path(DOC)}", None),
                (f"{base}/up/memento/99999999999999999999/{rsagg_path(DOC)}", None),
            ]
            statuses = set()
            for url, body in cases:
                etag = f'"{sha(body or BODIES[0])}"'
                for asked in _ASKED:
                    headers = {k: v.replace("ETAG", etag) for k, v in asked.items()}
                    for method in ("GET", "HEAD"):
                        fast.memento_route = memento_route
                        del reached[:]
                        hot = answer(await client.request(method, url, headers=headers))  # looked up
                        cached = answer(await client.request(method, url, headers=headers))
                        by_hot_route = not reached
                        fast.memento_route = None  # the hot route leaves mementos to the app ...
                        fast.cache._lru.clear()  # ... and has none in its cache
                        app = answer(await client.request(method, url, headers=headers))
                        assert reached, "the app's memento route answered"
                        hot, cached, app = (_end_to_end(a) for a in (hot, cached, app))
                        assert hot == cached == app, (method, url, headers)
                        statuses.add(hot[0])
                        if offload == "none" and store == "file":
                            # 404 (hidden, never held) and 410 (beyond retention) are the hot route's; a
                            # path that is no memento URI at all (no date in it) is the app's
                            expect = hot[0] in (404, 410) or headers.get("range") not in _FILE_RESPONSE_RANGES
                            expect = expect and "/99999999999999999999/" not in url
                            assert by_hot_route == expect, (method, url, headers)
    finally:
        inner.close()
    assert {404, 410} <= statuses
    assert statuses & {200, 307}, statuses


async def test_hot_route_retires_a_memento_when_its_duration_ends(tmp_path: Path, monkeypatch):
    """Under a duration policy a version leaves retention with no change to the state: the hot route's
    cached 200 lasts only until then, after which the memento answers 410 as the app's route does.
    rsagg's clock and the hot cache's monotonic clock are both the test's."""
    import time
    from types import SimpleNamespace

    from aggregator.publish import fastpath, versions

    until = TIMES[4] + timedelta(days=1)  # TIMES[3], superseded at TIMES[4], leaves "1d" then
    now = [until - timedelta(hours=1)]
    later = [0.0]  # seconds added to the monotonic clock
    for module in (versions, fastpath):
        monkeypatch.setattr(module, "utcnow", lambda: now[0])
    clock = SimpleNamespace(monotonic=lambda: time.monotonic() + later[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(fastpath, "time", clock)
    cfg = filled(tmp_path, versions="1d")
    async with publishing(cfg) as (base, client):
        url = f"{base}/up/memento/{stamp(TIMES[3])}/{rsagg_path(DOC)}"
        r = await client.get(url)
        assert r.status_code == 200 and r.content == BODIES[3]
        now[0] = until + timedelta(seconds=1)
        later[0] = 3600.5  # the hour the cached answer was good for has passed
        r = await client.get(url)
        assert r.status_code == 410 and 'rel="timemap"' in r.headers["link"]
        assert (await client.get(url.replace(stamp(TIMES[3]), stamp(TIMES[4])))).status_code == 200


# ---------------------------------------------------------------------------------------------------
# TimeMap validators: ETag (and Last-Modified) and 304


@pytest.mark.parametrize("policy", ["all", 2, "1d"])
async def test_timemap_etag_names_one_body(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: Any):
    """Through updates, a deletion and time passing (which retires versions under a duration policy),
    for two pages: one ETag never names two TimeMap bodies, and each state's validators get 304
    (If-None-Match, also weak; If-Modified-Since when Last-Modified is given), a stale ETag 200."""
    from aggregator.publish import versions

    now = [TIMES[4] + timedelta(hours=1)]
    monkeypatch.setattr(versions, "utcnow", lambda: now[0])
    cfg = filled(tmp_path, versions=policy)
    later = [TIMES[4] + timedelta(hours=h) for h in (2, 28, 36)]
    v5 = b"<p>version 5</p>"
    blobs = FileBlobStore(cfg.store_path / "blobs")
    blobs.put_bytes(v5)
    blobs.close()

    def apply(change: Change, when: datetime) -> None:
        with State(cfg.store_path / "state.db", clock=lambda: when) as st:
            st.apply(st.ensure_set("up", UP + "capabilitylist.xml"), [change])

    steps = [
        (lambda: None, TIMES[4] + timedelta(hours=1)),
        (lambda: None, TIMES[4] + timedelta(hours=1)),
        (lambda: apply(Change(DOC, "updated", sha(v5), len(v5), "text/html"), later[0]), later[0]),
        (lambda: None, TIMES[4] + timedelta(days=1, hours=1)),  # "1d": TIMES[3] retired
        (lambda: None, TIMES[4] + timedelta(days=1, hours=3)),  # "1d": TIMES[4] retired
        (lambda: apply(Change(DOC, "deleted"), later[1]), later[1] + timedelta(hours=1)),
        (lambda: None, later[1] + timedelta(days=1, hours=1)),  # "1d": version 5 retired
    ]
    seen: dict[str, bytes] = {}
    bodies = set()
    async with publishing(cfg) as (base, client):
        for change, when in steps:
            change()
            now[0] = when
            for url in (f"{base}/up/timemap/{rsagg_path(DOC)}", f"{base}/up/timemap/3/{rsagg_path(DOC)}"):
                r = await client.get(url)
                assert r.status_code == 200 and r.headers["content-type"] == "application/link-format"
                etag = r.headers["etag"]
                assert etag.startswith('"') and seen.setdefault(etag, r.content) == r.content
                bodies.add(r.content)
                for asked in ({"if-none-match": etag}, {"if-none-match": f'"x", W/{etag}'}):
                    for method in ("GET", "HEAD"):
                        c = await client.request(method, url, headers=asked)
                        assert c.status_code == 304 and c.content == b"" and c.headers["etag"] == etag
                        assert "content-type" not in c.headers
                lm = r.headers.get("last-modified")
                assert (lm is None) == (policy == "1d")
                if lm is not None:
                    assert (await client.get(url, headers={"if-modified-since": lm})).status_code == 304
                    earlier = http(datetime.strptime(lm, "%a, %d %b %Y %H:%M:%S GMT") - timedelta(seconds=1))
                    assert (await client.get(url, headers={"if-modified-since": earlier})).status_code == 200
                    # If-None-Match decides when both are sent (RFC 9110 §13.2.2)
                    both = {"if-none-match": '"stale"', "if-modified-since": lm}
                    assert (await client.get(url, headers=both)).status_code == 200
                assert (await client.get(url, headers={"if-none-match": '"stale"'})).status_code == 200
    assert len(bodies) >= 4  # the steps changed the TimeMaps, and their ETags followed
    assert len(seen) >= len(bodies)


async def test_hot_route_passes_the_lifespan_on(tmp_path: Path):
    """The hot route sits in front of the router: a lifespan scope (no method, no path) goes through
    it to the app's lifespan, which starts up."""
    from .apps import create_app

    cfg = filled(tmp_path)
    blobs = FileBlobStore(cfg.store_path / "blobs")
    app = create_app(cfg, blobs=blobs, state_path=cfg.store_path / "state.db")
    sent: list[dict] = []
    asks = [{"type": "lifespan.shutdown"}, {"type": "lifespan.startup"}]

    async def receive() -> dict:
        return asks.pop()

    async def send(message: dict) -> None:
        sent.append(message)

    try:
        with trio.fail_after(30):
            await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    finally:
        blobs.close()
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
