"""The one schema (aggregator/store/sql/schema.py) is the schema rsagg's last release created, on both
backends: a state it left at version 14 opens unchanged (nothing to migrate) and works with this rsagg.

tests/data/state_v14_schema.json holds that release's DDL (generated from its migration lists): a
state is built from it, compared with a state this rsagg creates (tables, columns, types, defaults,
keys, indexes), then opened and used through every concern of the state."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from aggregator.store.interface import StateStore
from aggregator.store.open import connect
from aggregator.store.rows import Change, Cursor, DumpPart, HubVerification, ResourceValidators

V14 = json.loads((Path(__file__).parent / "data" / "state_v14_schema.json").read_text())


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


@pytest.fixture
def v14_sqlite(tmp_path: Path) -> Path:
    """A SQLite state as the last release left it at version 14."""
    path = tmp_path / "state.db"
    c = sqlite3.connect(path)
    for statement in V14["sqlite"]:
        c.execute(statement)
    c.execute("PRAGMA user_version = 14")
    c.commit()
    c.close()
    return path


def test_this_rsagg_creates_the_released_sqlite_schema(v14_sqlite: Path, tmp_path: Path) -> None:
    with connect(tmp_path / "new.db"):
        pass
    assert sqlite_facts(tmp_path / "new.db") == sqlite_facts(v14_sqlite)


def test_a_released_v14_sqlite_state_opens_unchanged_and_works(v14_sqlite: Path) -> None:
    before = sqlite_facts(v14_sqlite)
    with connect(v14_sqlite) as st:
        assert st.schema_version == 14
        exercise(st)
    assert sqlite_facts(v14_sqlite) == before  # nothing migrated, nothing added


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
def test_a_released_v14_postgres_state_is_this_schema_and_opens_unchanged(pg_server) -> None:  # type: ignore[no-untyped-def]
    import psycopg

    old, new = pg_server.fresh_url(), pg_server.fresh_url()
    with psycopg.connect(old) as conn:
        for statement in V14["postgresql"]:
            conn.execute(statement)
    with connect(new):
        pass
    before = pg_facts(old)
    assert pg_facts(new) == before
    with connect(old) as st:
        assert st.schema_version == 14
        exercise(st)
    assert pg_facts(old) == before
