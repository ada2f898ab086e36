"""The one schema (aggregator/store/sql/schema.py) migrates a state rsagg's last release left at version
14, and a state at version 15, to the schema this rsagg creates, on both backends, and the state works
with this rsagg.

tests/data/state_v14_schema.json holds that release's DDL, state_v15_schema.json the DDL of version 15
(both generated from the migration lists of their time): a state is built from it, opened (step 15
converts it: binary hashes, no uri per changelog row; step 16: rows found by a uri key, SQLite's times
of resources and changelog as integers, no changelog_datetime index), compared with a state this
rsagg creates (tables, columns, types, defaults, keys, indexes), then used through every concern of
the state. A v14 or v15 state with data migrates with every answer unchanged."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from aggregator.publish import documents
from aggregator.publish.links import LinkPolicy
from aggregator.rs.write import iter_document_bytes
from aggregator.store.interface import StateStore
from aggregator.store.open import connect
from aggregator.store.rows import Change, Cursor, DumpPart, HubVerification, ResourceValidators, format_dt
from aggregator.store.sets import PublishedSet
from aggregator.store.sql import codec
from aggregator.store.sql.dialect import from_us, uri_key
from aggregator.store.sql.schema import STEPS

V14 = json.loads((Path(__file__).parent / "data" / "state_v14_schema.json").read_text())
V15 = json.loads((Path(__file__).parent / "data" / "state_v15_schema.json").read_text())
V16 = json.loads((Path(__file__).parent / "data" / "state_v16_schema.json").read_text())
V17 = json.loads((Path(__file__).parent / "data" / "state_v17_schema.json").read_text())
#: The DDL of each older version a state is built from.
DDL = {14: V14, 15: V15, 16: V16, 17: V17}
#: The version this rsagg creates and migrates to.
VERSION = len(STEPS)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sqlite_facts(path: Path) -> dict:
    """What a migration made of a SQLite state, as comparable facts (not the DDL's spelling)."""
    c = sqlite3.connect(path)
    out = {"version": c.execute("PRAGMA user_version").fetchone()[0]}
    for name, sql in c.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name"
    ).fetchall():
        indexes = []
        for r in c.execute(f"PRAGMA index_list({name})").fetchall():
            cols = [x[2] for x in c.execute(f"PRAGMA index_info({r[1]})")]
            isql = c.execute("SELECT sql FROM sqlite_master WHERE name = ?", (r[1],)).fetchone()[0] or ""
            indexes.append((r[1], r[2], r[3], r[4], cols, isql.partition(" WHERE ")[2]))
        out[name] = {
            "columns": c.execute(f"PRAGMA table_info({name})").fetchall(),
            "indexes": sorted(indexes),
            "autoincrement": "AUTOINCREMENT" in sql,
        }
    c.close()
    return out


def exercise(st: StateStore) -> None:
    """Use the state through every concern, as a sync, the publisher, the hub and a cluster node do."""
    st.upsert_source("src", "https://example.org/sd.xml")
    sid = st.ensure_set("src", "https://example.org/cl.xml")
    st.put_document("https://example.org/cl.xml", "src", "capabilitylist", etag='"e"', last_modified=None,
                    sha256=_sha("cl"))  # fmt: skip
    gen = st.begin_baseline(sid)
    st.apply(sid, [Change(f"https://example.org/r/{i}", "created", sha256=_sha(str(i)), generation=gen)
                   for i in range(5)])  # fmt: skip
    when = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    gone = st.finish_baseline(sid, gen, Cursor(baseline_at=when))
    assert gone == [] and st.cursor(sid) == Cursor(baseline_at=when)
    deleted, updated = (
        Change("https://example.org/r/1", "deleted"),
        Change("https://example.org/r/2", "updated", sha256=_sha("2b")),
    )
    applied = st.apply(sid, [deleted, updated])
    assert [c.change for c in applied] == ["deleted", "updated"]
    tombstone = st.resource(sid, "https://example.org/r/1")
    assert st.count_live([sid]) == 4 and tombstone is not None and tombstone.deleted
    assert [r.change for r in st.iter_changelog()] == ["created"] * 5 + ["deleted", "updated"]
    st.put_resource_validators(
        sid, [ResourceValidators("https://example.org/r/0", _sha("0"), '"v"', None, when)]
    )
    assert st.resource_validators(sid, ["https://example.org/r/0"])["https://example.org/r/0"].lastmod == when
    vid = st.hub_queue_verification(
        HubVerification(0, "subscribe", "t", "https://cb.example/", None, 60, None), when
    )
    verification = HubVerification(vid, "subscribe", "t", "https://cb.example/", None, 60, None)
    assert st.hub_finish_verification(verification, True, when + timedelta(seconds=60), when)
    assert st.hub_queue_payload("t", b"<x/>", "application/xml", "<t>", when, 10) == (1, 0)
    part = DumpPart(_sha("zip"), 3, _sha("manifest"), 2, at=when, completed=when, entries=1, bytes=3)
    assert [p.at for p in st.add_resource_dump("src", [sid], st.last_seq(), when, when, [part], when)] == [
        when
    ]
    [fence] = st.claim_leases("node-a", ["src"], want=1, lease_seconds=30)
    assert st.leases()[0].node == "node-a" and st.release_lease(fence)


def _sqlite_at(path: Path, ddl: dict, version: int) -> Path:
    c = sqlite3.connect(path)
    for statement in ddl["sqlite"]:
        c.execute(statement)
    c.execute(f"PRAGMA user_version = {version}")
    c.commit()
    c.close()
    return path


@pytest.fixture
def v14_sqlite(tmp_path: Path) -> Path:
    """A SQLite state as the last release left it at version 14."""
    return _sqlite_at(tmp_path / "state.db", V14, 14)


@pytest.fixture
def v15_sqlite(tmp_path: Path) -> Path:
    """A SQLite state at version 15 (before step 16)."""
    return _sqlite_at(tmp_path / "state15.db", V15, 15)


@pytest.mark.parametrize("version", sorted(DDL))
def test_an_older_sqlite_state_migrates_to_this_schema_and_works(version: int, tmp_path: Path) -> None:
    """A state built from each older version's DDL (16: before step 17, which changes nothing in SQLite;
    17: before step 18, the validators in their own table)."""
    path = _sqlite_at(tmp_path / f"state{version}.db", DDL[version], version)
    with connect(tmp_path / "new.db"):
        pass
    with connect(path) as st:
        assert st.schema_version == VERSION
        exercise(st)
    assert sqlite_facts(path) == sqlite_facts(tmp_path / "new.db")
    assert sqlite_facts(path)["changelog"]["autoincrement"]


PG_FACTS = (
    "SELECT table_name, column_name, data_type, is_nullable, column_default, is_identity, "
    "identity_generation FROM information_schema.columns WHERE table_schema = current_schema() "
    "ORDER BY table_name, ordinal_position"
)
PG_INDEXES = (
    "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema() ORDER BY indexname"
)


def pg_facts(url: str) -> dict:
    import psycopg

    with psycopg.connect(url) as conn:
        indexes = [(n, re.sub(r" ON \S+\.", " ON ", d)) for n, d in conn.execute(PG_INDEXES).fetchall()]
        sequences = conn.execute(
            "SELECT sequence_name, data_type FROM information_schema.sequences "
            "WHERE sequence_schema = current_schema() ORDER BY 1"
        ).fetchall()
        return {"columns": conn.execute(PG_FACTS).fetchall(), "indexes": indexes, "sequences": sequences}


@pytest.mark.slow
@pytest.mark.parametrize("ddl", [V14, V15, V16, V17], ids=["v14", "v15", "v16", "v17"])
def test_an_older_postgres_state_migrates_to_this_schema_and_works(pg_server, ddl: dict) -> None:  # type: ignore[no-untyped-def]
    import psycopg

    old, new = pg_server.fresh_url(), pg_server.fresh_url()
    with psycopg.connect(old) as conn:
        for statement in ddl["postgresql"]:
            conn.execute(statement)
    with connect(new):
        pass
    with connect(old) as st:
        assert st.schema_version == VERSION
        exercise(st)
    assert pg_facts(old) == pg_facts(new)


# -- step 15 with data: every answer the same before and after ------------------------------------

T0 = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
BASE = "https://agg.example/rs"


def _clock() -> Callable[[], datetime]:
    ticks = itertools.count()
    return lambda: T0 + timedelta(seconds=next(ticks))


def fill(st: StateStore) -> None:
    """Two sets of resources as harvests leave them: created (sha-256 + md5, some sha-1, some without
    any hash), updated, deleted (one by a baseline), recreated."""
    st.upsert_source("src", "https://example.org/sd.xml")
    sets = [st.ensure_set("src", f"https://example.org/cl{i}.xml") for i in range(2)]
    for n, sid in enumerate(sets):
        uri = f"https://repository.example.org/objects/{n}/item-%05d/datastreams/content.xml"
        changes = []
        for i in range(40):
            body = f"{n}/{i}".encode()
            hashes = {"md5": hashlib.md5(body).hexdigest()}
            if i % 3 == 0:
                hashes["sha-1"] = hashlib.sha1(body).hexdigest()
            sha = None if i % 7 == 6 else hashlib.sha256(body).hexdigest()
            # times of every kind: microseconds, before 1970, far future, another zone, none
            lastmod = T0 - timedelta(days=1000 * i, microseconds=7 * i) if i % 2 else None
            zone = timezone(timedelta(hours=i % 12 - 5, minutes=30 * (i % 2)))
            upstream = (
                (T0 + timedelta(days=10_000 * i, microseconds=i)).astimezone(zone) if i % 5 == 0 else None
            )
            changes.append(
                Change(uri % i, "created", sha, len(body), "text/xml", hashes=hashes if sha else {},
                       lastmod=lastmod, upstream_datetime=upstream)
            )  # fmt: skip
        st.apply(sid, changes)
        st.apply(sid, [Change(uri % i, "updated", _sha(f"{n}/{i}b"), 9, "text/xml") for i in range(0, 40, 4)])
        st.apply(sid, [Change(uri % i, "deleted") for i in range(1, 40, 5)])
        st.apply(sid, [Change(uri % 1, "created", _sha("again"), 5, "text/plain", hashes={"md5": "ab" * 16})])
    gen = st.begin_baseline(sets[1])
    st.apply(
        sets[1], [Change(r.uri, "created", r.sha256, generation=gen) for r in st.iter_live([sets[1]])][:30]
    )
    st.finish_baseline(sets[1], gen, Cursor(baseline_at=T0))
    # The upstream's validators of some held versions: ETags, Last-Modified (one the state does not
    # keep), confirmed under the row's own lastmod, another or none; one for a version not held.
    for n, sid in enumerate(sets):
        live = [r for r in st.iter_live([sid]) if r.sha256][: 12 + n]
        st.put_resource_validators(sid, [
            ResourceValidators(r.uri, r.sha256 if i != 5 else _sha("not held"), f'"e{i}"' if i % 2 else None,
                               ["Wed, 04 Mar 2026 05:06:07 GMT", None, "4 March 2026"][i % 3],
                               [r.lastmod, T0 + timedelta(days=i), None][i % 3])
            for i, r in enumerate(live)
        ])  # fmt: skip


def answers(st: StateStore) -> dict:
    """Everything a reader of the resources and the changelog gets: rows, pages, Change Lists."""
    sids = [s.id for s in st.sets()]
    ps = PublishedSet("all", tuple(sids))
    site = documents.Site(BASE, {"all": ps}, LinkPolicy(), 25)
    lists = {}
    for k in range(1, st.last_seq() // 25 + 2):
        doc = documents.change_list_window(site, st, ps, k, T0 + timedelta(days=1))
        lists[k] = doc and b"".join(iter_document_bytes(*doc, flush_head=True))
    head, entries = documents.resource_list_part(site, st, ps, 0, None, T0, lines=True)
    resources = list(st.iter_resources(include_deleted=True))
    return {
        "resources": resources,
        "by_uri": [st.resources(r.set_id, [r.uri]) for r in resources],
        "changelog": list(st.iter_changelog()),
        "pages": [
            list(st.iter_changelog(after, set_id=sid, limit=7)) for sid in sids for after in (0, 13, 50)
        ],
        "log_range": list(st.iter_log_range(sids, 10, 90)),
        "versions": [list(st.iter_versions(r.id)) for r in resources],
        "version_at": [st.version_at(r.id, T0 + timedelta(seconds=3)) for r in resources],
        "record": [st.log_record(seq) for seq in range(st.last_seq() + 2)],
        "hashes": list(st.referenced_hashes()),
        "listing": list(st.iter_live_listing(sids)),
        "validators": [st.resource_validators(sid, [r.uri for r in resources]) for sid in sids],
        "change_lists": lists,
        "resource_list": b"".join(iter_document_bytes(head, entries, flush_head=True)),
        "last_seq": st.last_seq(),
    }


def next_change(st: StateStore) -> list:
    """A change applied after the migration: its seq follows the last one (AUTOINCREMENT kept)."""
    sid = st.sets()[0].id
    st.apply(sid, [Change("https://repository.example.org/new", "created", _sha("new"))])
    return [(r.seq, r.uri) for r in st.iter_changelog(st.last_seq() - 1)]


#: A change kind's code (codec.LOG_KINDS) as the text versions 14 and 15 stored.
KIND_TEXT = "CASE change WHEN 0 THEN 'created' WHEN 1 THEN 'updated' WHEN 2 THEN 'deleted' END"


def _big_tables_ddl(ddl: dict) -> list[str]:
    return [s for s in ddl["sqlite"] if re.search(r"\b(TABLE|ON) \"?(resources|changelog)\b", s)]


#: The validators of version 17's table as read back from the resource rows that keep them since step 18.
_VALIDATORS_AS_V17 = (
    "INSERT INTO resource_validators SELECT set_id, uri, {hex}, etag, {http}, {w3c} FROM resources "
    "WHERE deleted = {false} AND (etag IS NOT NULL OR last_modified IS NOT NULL OR confirmed IS NOT NULL)"
)


def downgrade_sqlite(path: Path, to: int = 14) -> None:
    """Put a state this rsagg wrote back into the form of version 17 (the upstream's validators in
    their own table, step 13's), 15 (times as format_dt's text, no uri_key, the (set_id, uri) key and
    changelog_datetime) or, ``to`` 14, of the last release (hex text hashes, half of them uppercase as
    some writers left them, the uri on every changelog row)."""
    c = sqlite3.connect(path)
    c.create_function("w3c", 1, lambda us: format_dt(from_us(us)))
    c.create_function("http", 1, lambda us: None if us is None else codec.http_date_out(from_us(us)))
    c.execute(next(x for x in V17["sqlite"] if "TABLE resource_validators" in x))
    c.execute(_VALIDATORS_AS_V17.format(hex="lower(hex(sha256))", http="http(last_modified)",
                                        w3c="w3c(coalesce(confirmed, lastmod))", false="0"))  # fmt: skip
    for column in ("etag", "last_modified", "confirmed"):
        c.execute(f"ALTER TABLE resources DROP COLUMN {column}")
    c.execute("PRAGMA user_version = 17")
    c.commit()
    if to == 17:
        c.close()
        return
    c.executescript(
        "ALTER TABLE resources RENAME TO r16; ALTER TABLE changelog RENAME TO c16;"
        "DROP INDEX resources_set_id; DROP INDEX resources_live; DROP INDEX changelog_set_seq;"
        "DROP INDEX resources_uri; DROP INDEX changelog_resource;"
    )
    for statement in _big_tables_ddl(V15):
        c.execute(statement)
    c.execute(
        "INSERT INTO resources SELECT id, set_id, uri, sha256, length, type, encoding, md5, sha1, "
        "w3c(lastmod), w3c(upstream_datetime), links, md_extra, entry_extra, deleted, generation, "
        "w3c(updated_at) FROM r16"
    )
    c.execute(
        f"INSERT INTO changelog SELECT seq, set_id, resource_id, {KIND_TEXT}, w3c(datetime), sha256, length, "
        "type, uri FROM c16"
    )
    c.execute("UPDATE sqlite_sequence SET seq = (SELECT seq FROM sqlite_sequence WHERE name = 'c16') "
              "WHERE name = 'changelog'")  # fmt: skip
    c.executescript("DROP TABLE r16; DROP TABLE c16; PRAGMA user_version = 15")
    c.commit()
    if to == 15:
        c.close()
        return
    c.executescript(
        "ALTER TABLE resources RENAME TO r15; ALTER TABLE changelog RENAME TO c15;"
        "DROP INDEX resources_set_id; DROP INDEX resources_live; DROP INDEX changelog_set_seq;"
        "DROP INDEX changelog_datetime; DROP INDEX changelog_resource;"
    )
    for statement in _big_tables_ddl(V14):
        c.execute(statement)
    hx = "CASE WHEN {0} IS NULL THEN NULL WHEN id % 2 THEN upper(hex({0})) ELSE lower(hex({0})) END"
    c.execute(
        "INSERT INTO resources SELECT id, set_id, uri, {}, length, type, encoding, {}, {}, lastmod, "
        "upstream_datetime, links, md_extra, entry_extra, deleted, generation, updated_at FROM r15".format(
            hx.format("sha256"), hx.format("md5"), hx.format("sha1")
        )
    )
    c.execute(
        "INSERT INTO changelog SELECT c.seq, c.set_id, c.resource_id, r.uri, c.change, c.datetime, "
        "lower(hex(c.sha256)), c.length, c.type FROM c15 c JOIN r15 r ON r.id = c.resource_id"
    )
    c.execute("UPDATE changelog SET sha256 = NULL WHERE sha256 = ''")
    c.executescript("DROP TABLE r15; DROP TABLE c15; PRAGMA user_version = 14")
    c.commit()
    c.close()


@pytest.mark.parametrize("version", [14, 15, 17])
def test_an_older_sqlite_state_with_data_migrates_with_every_answer_unchanged(
    version: int, tmp_path: Path
) -> None:
    path = tmp_path / "data.db"
    with connect(path, clock=_clock()) as st:
        fill(st)
        before = answers(st)
    downgrade_sqlite(path, to=version)
    form = _sqlite_at(tmp_path / "form.db", DDL[version] if version != 15 else V15, version)
    assert sqlite_facts(path) == sqlite_facts(form)  # that version's form, exactly
    raw = sqlite3.connect(path)
    assert raw.execute("SELECT count(*) FROM resource_validators").fetchone()[0] > 10
    if version == 14:
        assert raw.execute("SELECT count(*) FROM resources WHERE sha256 <> lower(sha256)").fetchone()[0] > 0
    if version < 16:  # times as text then: lastmod, upstream datetimes (some), the log's clock
        assert {t for (t,) in raw.execute("SELECT DISTINCT typeof(updated_at) FROM resources")} == {"text"}
        assert raw.execute("SELECT count(*) FROM resources WHERE typeof(lastmod) = 'text'").fetchone()[0] > 0
    raw.close()
    with connect(path, clock=_clock()) as st:
        assert st.schema_version == VERSION
        assert answers(st) == before
        assert next_change(st) == [(before["last_seq"] + 1, "https://repository.example.org/new")]
    raw = sqlite3.connect(path)
    assert raw.execute("SELECT count(*) FROM changelog WHERE uri IS NOT NULL").fetchone()[0] == 0
    assert {t for (t,) in raw.execute("SELECT DISTINCT typeof(sha256) FROM resources")} == {"blob", "null"}
    for table, column in [("resources", "updated_at"), ("resources", "lastmod"), ("changelog", "datetime")]:
        kinds = {t for (t,) in raw.execute(f"SELECT DISTINCT typeof({column}) FROM {table}")}
        assert kinds <= {"integer", "null"} and "integer" in kinds, (table, column, kinds)
    raw.close()


@pytest.mark.parametrize(
    ("table", "column", "value"),
    [("resources", "updated_at", "yesterday"), ("resources", "lastmod", "2026-13-01T00:00:00Z"),
     ("changelog", "datetime", "")],
)  # fmt: skip
def test_a_time_that_does_not_parse_fails_step_16_and_leaves_v15(
    v15_sqlite: Path, table: str, column: str, value: str
) -> None:
    c = sqlite3.connect(v15_sqlite)
    c.execute("INSERT INTO sources (name, url, created_at, updated_at) VALUES ('s', 'u', 't', 't')")
    c.execute(
        "INSERT INTO sets (id, source, capabilitylist_url, name, created_at) VALUES (1, 's', 'c', 'n', 't')"
    )
    ok = "2026-01-01T00:00:00.000000Z"
    c.execute(
        "INSERT INTO resources (id, set_id, uri, deleted, lastmod, updated_at) VALUES (1, 1, 'x', 0, ?, ?)",
        (value if column == "lastmod" else ok, value if column == "updated_at" else ok),
    )
    c.execute(
        "INSERT INTO changelog (set_id, resource_id, change, datetime) VALUES (1, 1, 'created', ?)",
        (value if table == "changelog" else ok,),
    )
    c.commit()
    c.close()
    with pytest.raises(ValueError) as caught:
        connect(v15_sqlite)
    assert str(caught.value) == (
        f"{v15_sqlite}: schema step 16 cannot convert a stored time: not a W3C datetime: {value!r}"
    )
    assert sqlite_facts(v15_sqlite) == sqlite_facts(_sqlite_at(v15_sqlite.with_name("f.db"), V15, 15))
    c = sqlite3.connect(v15_sqlite)
    assert c.execute(f"SELECT {column} FROM {table}").fetchone() == (value,)
    c.close()


def test_a_changelog_row_whose_resource_row_is_gone_keeps_its_uri(v14_sqlite: Path) -> None:
    c = sqlite3.connect(v14_sqlite)
    c.execute("INSERT INTO sources (name, url, created_at, updated_at) VALUES ('s', 'u', 't', 't')")
    c.execute(
        "INSERT INTO sets (id, source, capabilitylist_url, name, created_at) VALUES (1, 's', 'c', 'n', 't')"
    )
    c.execute(
        "INSERT INTO changelog (set_id, resource_id, uri, change, datetime, sha256) VALUES "
        f"(1, 99, 'https://gone.example/x', 'created', '2026-01-01T00:00:00.000000Z', '{_sha('x').upper()}')"
    )
    c.commit()
    c.close()
    with connect(v14_sqlite) as st:
        [rec] = st.iter_changelog()
    assert (rec.uri, rec.sha256) == ("https://gone.example/x", _sha("x"))


def test_a_hash_that_is_not_hex_fails_the_migration_and_leaves_v14(v14_sqlite: Path) -> None:
    c = sqlite3.connect(v14_sqlite)
    c.execute("INSERT INTO sources (name, url, created_at, updated_at) VALUES ('s', 'u', 't', 't')")
    c.execute(
        "INSERT INTO sets (id, source, capabilitylist_url, name, created_at) VALUES (1, 's', 'c', 'n', 't')"
    )
    c.execute(
        "INSERT INTO resources (id, set_id, uri, sha256, deleted, updated_at) "
        "VALUES (1, 1, 'x', 'zz', 0, 't')"
    )
    c.commit()
    c.close()
    with pytest.raises(ValueError, match="schema step 15 cannot convert a stored hash: not a hex hash: 'zz'"):
        connect(v14_sqlite)
    assert sqlite_facts(v14_sqlite)["version"] == 14


#: PostgreSQL's two big tables put back into the form of version 16 (step 1's columns as steps 15 and 16
#: altered them, in that order; 8-byte set ids; the indexes of step 16), their rows kept.
PG_DOWNGRADE_TO_16 = [
    "ALTER TABLE resources RENAME TO r17",
    "ALTER TABLE changelog RENAME TO c17",
    "ALTER INDEX resources_pkey RENAME TO r17_pkey",
    "ALTER INDEX changelog_pkey RENAME TO c17_pkey",
    "DROP INDEX resources_set, resources_uri, changelog_set_seq, changelog_resource",
    """CREATE TABLE resources (
        id BIGINT PRIMARY KEY, set_id BIGINT NOT NULL REFERENCES sets(id) ON DELETE CASCADE,
        uri TEXT NOT NULL, sha256 BYTEA, length BIGINT, type TEXT, encoding TEXT, md5 BYTEA, sha1 BYTEA,
        lastmod TIMESTAMPTZ, upstream_datetime TIMESTAMPTZ, links TEXT, md_extra TEXT, entry_extra TEXT,
        deleted BOOLEAN NOT NULL DEFAULT false, generation INTEGER, updated_at TIMESTAMPTZ NOT NULL,
        uri_key INTEGER NOT NULL
    )""",
    "INSERT INTO resources SELECT id, set_id, uri, sha256, length, type, encoding, md5, sha1, lastmod, "
    "upstream_datetime, links, md_extra, entry_extra, deleted, generation, updated_at, uri_key FROM r17",
    """CREATE TABLE changelog (
        seq BIGINT PRIMARY KEY, set_id BIGINT NOT NULL REFERENCES sets(id) ON DELETE CASCADE,
        resource_id BIGINT NOT NULL, uri TEXT,
        change SMALLINT NOT NULL CONSTRAINT changelog_change_check CHECK (change IN (0, 1, 2)),
        datetime TIMESTAMPTZ NOT NULL, sha256 BYTEA, length BIGINT, type TEXT
    )""",
    "INSERT INTO changelog SELECT seq, set_id, resource_id, uri, change, datetime, sha256, length, type "
    "FROM c17",
    "DROP TABLE r17, c17",
    "CREATE INDEX resources_set_id ON resources(set_id, id)",
    "CREATE INDEX resources_live ON resources(set_id, id) WHERE NOT deleted",
    "CREATE INDEX changelog_set_seq ON changelog(set_id, seq)",
    "CREATE INDEX changelog_resource ON changelog(resource_id, seq)",
    "CREATE INDEX resources_uri ON resources(uri_key, set_id)",
    "UPDATE schema_version SET version = 16",
]


def _to_15(conn: Any) -> None:
    """PostgreSQL's version 16 put back into the form of version 15 (no uri_key, the (set_id, uri) key,
    changelog_datetime, the change kind as text)."""
    conn.execute("DROP INDEX resources_uri")
    conn.execute("ALTER TABLE resources DROP COLUMN uri_key")
    conn.execute("ALTER TABLE resources ADD CONSTRAINT resources_set_id_uri_key UNIQUE (set_id, uri)")
    conn.execute("CREATE INDEX changelog_datetime ON changelog(datetime)")
    conn.execute(
        "ALTER TABLE changelog DROP CONSTRAINT changelog_change_check, "
        f"ALTER COLUMN change TYPE TEXT USING {KIND_TEXT}, "
        "ADD CONSTRAINT changelog_change_check CHECK (change IN ('created', 'updated', 'deleted'))"
    )
    conn.execute("UPDATE schema_version SET version = 15")


@pytest.mark.slow
@pytest.mark.parametrize("version", [14, 15, 16, 17])
def test_an_older_postgres_state_with_data_migrates_with_every_answer_unchanged(
    pg_server, version: int
) -> None:  # type: ignore[no-untyped-def]
    import psycopg

    url, ref = pg_server.fresh_url(), pg_server.fresh_url()
    with psycopg.connect(ref) as conn:
        for statement in DDL[version]["postgresql"]:
            conn.execute(statement)
    with connect(url, clock=_clock()) as st:
        fill(st)
        before = answers(st)
    with psycopg.connect(url) as conn:  # back to version 17's form: the validators in their table
        conn.execute(next(x for x in V17["postgresql"] if "TABLE IF NOT EXISTS resource_validators" in x))
        http = """to_char(last_modified AT TIME ZONE 'UTC', 'Dy, DD Mon YYYY HH24:MI:SS "GMT"')"""
        kept = _VALIDATORS_AS_V17.format(
            hex="encode(sha256, 'hex')", http=http, w3c="coalesce(confirmed, lastmod)", false="false"
        )
        conn.execute(kept)
        conn.execute(
            "ALTER TABLE resources DROP COLUMN etag, DROP COLUMN last_modified, DROP COLUMN confirmed"
        )
        conn.execute("UPDATE schema_version SET version = 17")
        assert conn.execute("SELECT count(*) FROM resource_validators").fetchone()[0] > 10
    if version < 17:
        with psycopg.connect(url) as conn:  # back to version 16's form: step 17 rebuilt both tables
            for statement in PG_DOWNGRADE_TO_16:
                conn.execute(statement)
    if version < 16:
        with psycopg.connect(url) as conn:  # back to version 15's form (as downgrade_sqlite)
            _to_15(conn)
    if version == 14:
        hx = "CASE WHEN id % 2 = 1 THEN upper(encode({0}, 'hex')) ELSE encode({0}, 'hex') END"
        with psycopg.connect(url) as conn:  # and to the last release's form
            conn.execute(
                "ALTER TABLE resources ALTER COLUMN sha256 TYPE TEXT USING {}, ALTER COLUMN md5 TYPE TEXT "
                "USING {}, ALTER COLUMN sha1 TYPE TEXT USING {}".format(
                    hx.format("sha256"), hx.format("md5"), hx.format("sha1")
                )
            )
            conn.execute("UPDATE changelog c SET uri = r.uri FROM resources r WHERE r.id = c.resource_id")
            conn.execute(
                "ALTER TABLE changelog ALTER COLUMN uri SET NOT NULL, "
                "ALTER COLUMN sha256 TYPE TEXT USING encode(sha256, 'hex')"
            )
            conn.execute("UPDATE schema_version SET version = 14")
    assert pg_facts(url) == pg_facts(ref)
    with connect(url, clock=_clock()) as st:
        assert st.schema_version == VERSION
        assert answers(st) == before
        assert next_change(st) == [(before["last_seq"] + 1, "https://repository.example.org/new")]
    fresh = pg_server.fresh_url()
    connect(fresh).close()
    assert pg_facts(url) == pg_facts(fresh)  # step 17's column order, types and indexes


@contextmanager
def _pg_old_state_with_a_set(url: str, schema: dict[str, list[str]]) -> Iterator[Any]:
    """A PostgreSQL database at an old schema version (``schema``'s DDL) holding source "s" and its set
    1: the connection, committed when the block ends."""
    import psycopg

    with psycopg.connect(url) as conn:
        for statement in schema["postgresql"]:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO sources (name, url, created_at, updated_at) VALUES ('s', 'u', now(), now())"
        )
        conn.execute(
            "INSERT INTO sets (id, source, capabilitylist_url, name, created_at) "
            "VALUES (1, 's', 'c', 'n', now())"
        )
        yield conn


@pytest.mark.slow
def test_postgres_step_17_keeps_the_uri_of_a_record_whose_row_is_gone(pg_server) -> None:  # type: ignore[no-untyped-def]

    url = pg_server.fresh_url()
    with _pg_old_state_with_a_set(url, V16) as conn:
        conn.execute(
            "INSERT INTO resources (id, set_id, uri, sha256, deleted, updated_at, uri_key) "
            f"VALUES (7, 1, 'https://kept.example/x', '\\x{_sha('x')}', false, '{format_dt(T0)}', "
            f"{uri_key('https://kept.example/x')})"
        )
        conn.execute(
            "INSERT INTO changelog (seq, set_id, resource_id, uri, change, datetime, sha256) VALUES "
            f"(1, 1, 7, NULL, 0, '{format_dt(T0)}', '\\x{_sha('x')}'), "
            f"(2, 1, 99, 'https://gone.example/y', 0, '{format_dt(T0)}', NULL)"
        )
        conn.execute("UPDATE changelog_head SET seq = 2")
    with connect(url) as st:
        assert [(r.seq, r.resource_id, r.uri, r.sha256) for r in st.iter_changelog()] == [
            (1, 7, "https://kept.example/x", _sha("x")),
            (2, 99, "https://gone.example/y", None),
        ]
        kept = st.resource(1, "https://kept.example/x")
        assert kept is not None and (kept.id, kept.sha256, kept.updated_at) == (7, _sha("x"), T0)
        assert next_change(st) == [(3, "https://repository.example.org/new")]


@pytest.mark.slow
def test_a_hash_that_is_not_hex_fails_the_postgres_migration_and_leaves_v14(pg_server) -> None:  # type: ignore[no-untyped-def]
    import psycopg

    url = pg_server.fresh_url()
    with _pg_old_state_with_a_set(url, V14) as conn:
        conn.execute(
            "INSERT INTO resources (id, set_id, uri, sha256, deleted, updated_at) "
            "VALUES (1, 1, 'x', 'zz', false, now())"
        )
    with pytest.raises(Exception, match="hexadecimal"):
        connect(url)
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (14,)
        assert conn.execute("SELECT sha256 FROM resources").fetchone() == ("zz",)


# -- the codec boundary: hex in, bytes stored, hex out --------------------------------------------

_RNG = random.Random(15)
#: Generated hashes: every digest length the state holds and some odd ones, either case, none.
HASHES = [None] + [
    _RNG.randbytes(n).hex() if i % 2 else _RNG.randbytes(n).hex().upper()
    for i, n in enumerate([1, 16, 16, 20, 20, 32, 32, 64, *(_RNG.randrange(1, 80) for _ in range(40))])
]
#: Generated strings that are not hex (a hash the state refuses instead of losing).
JUNK = [
    "",
    "a",
    "abc",
    "0x12",
    "g0",
    "ab cd",
    "12\n",
    "é1",
    *("".join(_RNG.choices("0123456789abcdefXYZ -", k=_RNG.randrange(1, 9))) + "z" for _ in range(20)),
]


@pytest.mark.parametrize("value", HASHES)
def test_hashes_round_trip_through_the_codec(value: str | None) -> None:
    stored = codec.hash_in(value)
    assert codec.hash_out(stored) == (None if value is None else value.lower())
    if value is not None:
        assert stored is not None and len(stored) == len(value) // 2  # half the bytes of the hex text


@pytest.mark.parametrize("junk", JUNK)
def test_a_hash_that_is_not_hex_is_refused(junk: str) -> None:
    with pytest.raises(ValueError, match="not a hex hash"):
        codec.hash_in(junk)


def _uri(rng: random.Random) -> str:
    chars = "abcdefghijklmnopqrstuvwxyz0123456789-._~%/?=;:@!$()*+,"
    return (
        "https://example.org/" + "".join(rng.choices(chars, k=rng.randrange(0, 90))) + "é" * rng.randrange(2)
    )


def test_a_change_s_hashes_read_back_as_given(tmp_path: Path) -> None:
    """Generated changes (uris, sha-256 or none, md5 only, sha-1, either case) read back with their
    hashes as given (lowercase), from the row, the changelog and the listing."""
    rng = random.Random(1515)
    with connect(tmp_path / "s.db") as st:
        st.upsert_source("s", "https://example.org/sd.xml")
        sid = st.ensure_set("s", "https://example.org/cl.xml")
        want = {}
        for i in range(200):
            uri = _uri(rng) + f"#{i}"
            sha = rng.choice([None, rng.randbytes(32).hex()])
            hashes = {}
            if rng.random() < 0.7:
                hashes["md5"] = rng.randbytes(16).hex()
            if rng.random() < 0.3:
                hashes["sha-1"] = rng.randbytes(20).hex()
            if rng.random() < 0.5:
                hashes = {k: v.upper() for k, v in hashes.items()}
            want[uri] = (sha, {k: v.lower() for k, v in hashes.items()} | ({"sha-256": sha} if sha else {}))
            st.apply(sid, [Change(uri, "created", sha, hashes=hashes)])
        got = {r.uri: (r.sha256, r.hashes) for r in st.iter_resources()}
        log = {rec.uri: rec.sha256 for rec in st.iter_changelog()}
        listing = {row[1]: (row[2], row[6], row[7]) for row in st.iter_live_listing([sid])}
    assert got == want
    assert log == {u: sha for u, (sha, _) in want.items()}
    assert listing == {u: (sha, h.get("md5"), h.get("sha-1")) for u, (sha, h) in want.items()}


def test_a_change_with_a_hash_that_is_not_hex_is_refused_before_writing(tmp_path: Path) -> None:
    with connect(tmp_path / "s.db") as st:
        st.upsert_source("s", "https://example.org/sd.xml")
        sid = st.ensure_set("s", "https://example.org/cl.xml")
        with pytest.raises(ValueError, match="not a hex md5"):
            st.apply(sid, [Change("https://example.org/x", "created", _sha("x"), hashes={"md5": "nope"})])
        assert st.last_seq() == 0


_OPEN_WHEN_TOLD = """
import sys, time
from pathlib import Path
from aggregator.store.state import State
go = Path(sys.argv[2])
Path(sys.argv[3]).touch()  # imported and ready
while not go.exists():
    pass
State(sys.argv[1]).close()
"""


@pytest.mark.parametrize("round_", range(3))
def test_processes_opening_a_new_state_at_once_all_open_it(tmp_path: Path, round_: int) -> None:
    """SQLite does not wait (busy_timeout) to switch a file to WAL: processes creating one state at once
    (a cluster's nodes started together) must still all open it, and migrate it once."""
    import subprocess
    import sys
    import time

    go, db = tmp_path / "go", tmp_path / "state.db"
    ready = [tmp_path / f"ready-{i}" for i in range(4)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_WHEN_TOLD, str(db), str(go), str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in ready
    ]
    while not all(r.exists() for r in ready) and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    go.touch()  # all at once
    outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outputs
    from aggregator.store.state import MIGRATIONS

    with connect(db) as state:
        assert state.schema_version == len(MIGRATIONS)


#: Last-Modified values as version 17 kept them (the header as received): step 18 keeps the IMF-fixdates
#: (RFC 9110 §5.6.7) only.
_HEADERS = [
    "Mon, 01 Jan 2024 00:00:00 GMT", "Thu, 29 Feb 2024 23:59:59 GMT", "Fri, 31 Dec 9999 23:59:59 GMT",
    "Sunday, 06-Nov-94 08:49:37 GMT", "Sun Nov  6 08:49:37 1994", "Tue, 01 Jan 2024 00:00:00 GMT",
    "Thu, 31 Feb 2024 00:00:00 GMT", "Mon, 01 Jan 2024 24:00:00 GMT", "mon, 01 jan 2024 00:00:00 gmt", "",
]  # fmt: skip


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def test_step_18_carries_over_the_validators_of_the_versions_held(
    backend: str, request, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Version 17's validators table onto the rows (step 18): each header kept only when it is an
    IMF-fixdate written back byte for byte (the same rule as codec.http_date_in, in SQL on PostgreSQL),
    the confirmed lastmod kept, and nothing of a version the row no longer holds or of a deleted row."""
    uris = [f"https://example.org/r/{i}" for i in range(len(_HEADERS) + 2)]
    confirmed = T0 - timedelta(days=3)
    rows, validators = [], []
    for i, uri in enumerate(uris):
        stale, deleted = i == len(_HEADERS), i == len(_HEADERS) + 1
        rows.append((i + 1, uri, _sha(uri), deleted, uri_key(uri)))
        header = _HEADERS[i] if i < len(_HEADERS) else _HEADERS[0]
        etag = f'"{i}"' if i % 2 else None
        validators.append(
            (uri, _sha("old") if stale else _sha(uri), etag, header, confirmed if i % 3 else None)
        )
    if backend == "sqlite":
        path = _sqlite_at(tmp_path / "v17.db", V17, 17)
        raw = sqlite3.connect(path)
        raw.execute("INSERT INTO sources (name, url, created_at, updated_at) VALUES ('s', 'u', 't', 't')")
        raw.execute(
            "INSERT INTO sets (id, source, capabilitylist_url, name, created_at) "
            "VALUES (1, 's', 'c', 'n', 't')"
        )
        raw.executemany(
            "INSERT INTO resources (id, set_id, uri, sha256, deleted, updated_at, uri_key) "
            "VALUES (?, 1, ?, ?, ?, 0, ?)",
            [(rid, uri, bytes.fromhex(sha), int(gone), key) for rid, uri, sha, gone, key in rows],
        )
        raw.executemany(
            "INSERT INTO resource_validators VALUES (1, ?, ?, ?, ?, ?)",
            [(*v[:4], format_dt(v[4])) for v in validators],
        )
        raw.commit()
        raw.close()
        location: Any = path
    else:
        location = request.getfixturevalue("pg_server").fresh_url()
        with _pg_old_state_with_a_set(location, V17) as conn:
            conn.cursor().executemany(
                "INSERT INTO resources (id, set_id, uri, sha256, deleted, updated_at, uri_key) "
                "VALUES (%s, 1, %s, %s, %s, now(), %s)",
                [(rid, uri, bytes.fromhex(sha), gone, key) for rid, uri, sha, gone, key in rows],
            )
            conn.cursor().executemany(
                "INSERT INTO resource_validators VALUES (1, %s, %s, %s, %s, %s)", validators
            )
    with connect(location) as st:
        got = st.resource_validators(1, uris)
    expected = {}
    for uri, sha, etag, header, when in validators[: len(_HEADERS)]:
        kept = header if codec.http_date_in(header) else None
        if etag or kept or when:
            expected[uri] = ResourceValidators(uri, sha, etag, kept, when)
    assert got == expected
    assert [u for u, v in got.items() if v.last_modified] == uris[:3]  # the three IMF-fixdates
