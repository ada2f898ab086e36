"""State: the one change pipeline (apply), baselines, cursors, reads, persistence and schema."""

from __future__ import annotations

import random
import sqlite3
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import psycopg
import pytest

from aggregator.rs.model import Entry, Link
from aggregator.store.interface import EmptySnapshot, StateStore
from aggregator.store.rows import (
    Change,
    Cursor,
    DocumentRow,
    FailedChange,
    LogRecord,
    RetryChanges,
    format_dt,
    parse_dt,
)
from aggregator.store.sql import codec
from aggregator.store.sql.dialect import SQLITE
from aggregator.store.state import MIGRATIONS, State

A, B, C = "a" * 64, "b" * 64, "c" * 64
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


class Clock:
    """A wall clock the test moves (also backwards)."""

    def __init__(self, now: datetime = T0) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def tick(self, seconds: float = 1.0) -> None:
        self.now += timedelta(seconds=seconds)


def table_names(st: State) -> set[str]:
    """The tables of a SQLite state."""
    return {r[0] for r in st.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state.db"


@pytest.fixture
def reopen(db_path: Path) -> Callable[..., StateStore]:
    """Opens the state under test (again, for the tests that reopen it): the backend's one part in these
    tests; tests/test_state_postgres.py runs them all again with a PostgreSQL one."""
    return lambda **kw: State(db_path, **kw)


#: What a backend raises for a broken constraint (a foreign key).
INTEGRITY_ERRORS = (sqlite3.IntegrityError, psycopg.IntegrityError)


@pytest.fixture
def fail_changelog_insert(st: State) -> Callable[[str], None]:
    """Makes the state fail (``disk says no``) to insert a changelog record for one uri."""
    return lambda uri: st.conn.execute(
        # the changelog names its row by id (schema step 15): resources are written first
        "CREATE TEMP TRIGGER fail_log BEFORE INSERT ON changelog WHEN "
        f"(SELECT uri FROM resources WHERE id = NEW.resource_id) = '{uri}' "
        "BEGIN SELECT RAISE(ABORT, 'disk says no'); END"
    )


@pytest.fixture
def st(reopen: Callable[..., StateStore], clock: Clock):
    s = reopen(clock=clock)
    s.upsert_source("src", "https://example.org/.well-known/resourcesync")
    yield s
    s.close()


@pytest.fixture
def set_id(st: State) -> int:
    return st.ensure_set("src", "https://example.org/capabilitylist.xml")


def ch(uri: str, change: str, sha: str | None = None, **kw) -> Change:
    return Change(uri, change, sha, **kw)


def log_of(st: State) -> list[tuple[str, str, str | None]]:
    return [(r.uri, r.change, r.sha256) for r in st.iter_changelog()]


@pytest.mark.parametrize("seed", range(8))
def test_a_set_holds_nothing_until_a_row_or_a_retry_is_written(st: State, seed: int) -> None:
    """``holds_nothing``: true exactly while the set has no resource row (a tombstone is one) and no
    retry (an ended one is one), whatever else the other sets hold; generated sequences of writes."""
    rng = random.Random(seed)
    sets = [st.ensure_set("src", f"https://example.org/cl{i}.xml") for i in range(3)]
    rows: dict[int, set[str]] = {s: set() for s in sets}
    retries: dict[int, set[str]] = {s: set() for s in sets}
    assert all(st.holds_nothing(s) for s in sets)
    for _ in range(12):
        sid, uri = rng.choice(sets), rng.choice("uvw")
        op = rng.choice(["created", "deleted", "fail", "clear", "end", "nothing"])
        if op == "created":
            st.apply(sid, [ch(uri, "created", rng.choice([A, B]))])
            rows[sid].add(uri)
        elif op == "deleted":  # a tombstone where a row was; nothing where none was
            st.apply(sid, [ch(uri, "deleted")])
        elif op == "fail":
            st.apply(sid, [], retries=RetryChanges([FailedChange(Entry(uri), "created", "http", "500")]))
            retries[sid].add(uri)
        elif op == "clear":
            st.apply(sid, [], retries=RetryChanges(cleared=[uri]))
            retries[sid].discard(uri)
        elif op == "end":  # an ended retry stays a row of the set
            st.end_retries(sid, [uri], "gone")
        else:
            st.apply(sid, [])
        for s in sets:
            assert st.holds_nothing(s) == (not rows[s] and not retries[s]), (op, s, rows, retries)


# -- apply semantics ------------------------------------------------------------------------------

# (stored before: None | (sha, deleted)), incoming change, expected logged kind, expected row after
SEMANTICS = [
    ("missing + created", None, ch("u", "created", A), "created", (A, False)),
    ("missing + updated", None, ch("u", "updated", A), "created", (A, False)),
    ("missing + deleted", None, ch("u", "deleted"), None, None),
    ("live same + created", (A, False), ch("u", "created", A), None, (A, False)),
    ("live same + updated", (A, False), ch("u", "updated", A), None, (A, False)),
    ("live other + updated", (A, False), ch("u", "updated", B), "updated", (B, False)),
    ("live other + created", (A, False), ch("u", "created", B), "updated", (B, False)),
    ("live + deleted", (A, False), ch("u", "deleted"), "deleted", (A, True)),
    ("deleted + deleted", (A, True), ch("u", "deleted"), None, (A, True)),
    ("deleted + updated same", (A, True), ch("u", "updated", A), "created", (A, False)),
    ("deleted + created other", (A, True), ch("u", "created", B), "created", (B, False)),
]


@pytest.mark.parametrize(
    ("name", "before", "change", "logged", "after"), SEMANTICS, ids=[s[0] for s in SEMANTICS]
)
def test_apply_semantics(st: State, set_id: int, name, before, change, logged, after) -> None:
    if before is not None:
        st.apply(set_id, [ch("u", "created", before[0])])
        if before[1]:
            st.apply(set_id, [ch("u", "deleted")])
    seq0 = st.last_seq()
    applied = st.apply(set_id, [change])
    new_log = [(r.uri, r.change, r.sha256) for r in st.iter_changelog(seq0)]
    if logged is None:
        assert applied == [] and new_log == []
    else:
        assert [c.change for c in applied] == [logged]
        assert applied[0].uri == "u"
        assert new_log == [("u", logged, None if logged == "deleted" else change.sha256)]
    row = st.resource(set_id, "u")
    if after is None:
        assert row is None
    else:
        assert (row.sha256, row.deleted) == after


def test_batch_sees_its_own_earlier_changes(st: State, set_id: int, clock: Clock) -> None:
    st.apply(set_id, [ch("old", "created", C)])
    clock.tick()
    applied = st.apply(
        set_id,
        [
            ch("u", "updated", A),  # new -> created
            ch("u", "updated", A),  # same -> no-op
            ch("u", "updated", B),  # -> updated
            ch("u", "deleted"),  # -> deleted
            ch("u", "deleted"),  # already deleted -> no-op
            ch("u", "created", B),  # -> created again
            ch("old", "deleted"),
            ch("old", "created", C),  # stored row tombstoned then re-created in one batch
            ch("gone", "created", A),
            ch("gone", "deleted"),  # created and deleted in the same batch: a tombstone row
        ],
    )
    assert [(c.uri, c.change) for c in applied] == [
        ("u", "created"), ("u", "updated"), ("u", "deleted"), ("u", "created"),
        ("old", "deleted"), ("old", "created"), ("gone", "created"), ("gone", "deleted"),
    ]  # fmt: skip
    assert log_of(st)[1:] == [
        ("u", "created", A), ("u", "updated", B), ("u", "deleted", None), ("u", "created", B),
        ("old", "deleted", None), ("old", "created", C), ("gone", "created", A), ("gone", "deleted", None),
    ]  # fmt: skip
    u, old, gone = (st.resource(set_id, x) for x in ("u", "old", "gone"))
    assert (u.sha256, u.deleted) == (B, False)
    assert (old.sha256, old.deleted) == (C, False)
    assert (gone.sha256, gone.deleted) == (A, True)
    ids = {r.uri: r.resource_id for r in st.iter_changelog()}
    assert ids == {"old": old.id, "u": u.id, "gone": gone.id}
    assert len({old.id, u.id, gone.id}) == 3


def test_apply_returns_changes_with_logged_kind(st: State, set_id: int) -> None:
    incoming = ch("u", "updated", A, length=3, type="text/plain")
    (out,) = st.apply(set_id, [incoming])
    assert out.change == "created"
    assert (out.uri, out.sha256, out.length, out.type) == ("u", A, 3, "text/plain")
    assert incoming.change == "updated"  # the caller's object is left alone


def test_apply_rejects_bad_input_before_writing(st: State, set_id: int) -> None:
    with pytest.raises(ValueError):
        st.apply(set_id, [ch("ok", "created", A), ch("u", "modified", A)])
    with pytest.raises(ValueError):
        st.apply(set_id, [ch("ok", "created", A), ch("u", "created", A.upper())])
    with pytest.raises(KeyError):
        st.apply(999, [ch("u", "created", A)])
    assert st.count_resources() == 0 and st.last_seq() == 0


# -- changelog ordering ---------------------------------------------------------------------------


def test_changelog_seq_and_datetime_are_monotonic(
    st: State, set_id: int, clock: Clock, reopen: Callable[..., StateStore]
) -> None:
    st.apply(set_id, [ch("a", "created", A)])
    t1 = clock.now
    clock.now = T0 - timedelta(hours=1)  # the wall clock steps back
    st.apply(set_id, [ch("b", "created", A)])
    clock.now = T0 + timedelta(microseconds=1)
    st.apply(set_id, [ch("c", "created", A)])
    recs = list(st.iter_changelog())
    assert [r.seq for r in recs] == [1, 2, 3]
    assert [r.datetime for r in recs] == [t1, t1, T0 + timedelta(microseconds=1)]
    assert all(r.datetime.tzinfo is not None for r in recs)
    if isinstance(st, State):  # stored microseconds (schema step 16) sort like the times they stand for
        stored = [row[0] for row in st.conn.execute("SELECT datetime FROM changelog ORDER BY seq")]
        assert stored == sorted(stored)
        assert all(type(v) is int for v in stored)
        assert [SQLITE.dt_row(v) for v in stored] == [r.datetime for r in recs]
    # and the clock floor survives a restart
    st.close()
    clock.now = T0 - timedelta(days=1)
    s2 = reopen(clock=clock)
    s2.apply(set_id, [ch("d", "created", A)])
    [rec] = s2.iter_changelog(3)
    assert (rec.uri, rec.datetime) == ("d", T0 + timedelta(microseconds=1))
    s2.close()


def test_changelog_paging_and_set_filter(st: State, set_id: int) -> None:
    other = st.ensure_set("src", "https://example.org/other-capabilitylist.xml")
    for i in range(5):
        st.apply(set_id, [ch(f"s{i}", "created", A)])
        st.apply(other, [ch(f"o{i}", "created", B)])
    assert [r.seq for r in st.iter_changelog()] == list(range(1, 11))
    assert [r.uri for r in st.iter_changelog(set_id=other)] == [f"o{i}" for i in range(5)]
    assert [r.seq for r in st.iter_changelog(4, limit=3)] == [5, 6, 7]
    assert [r.uri for r in st.iter_changelog(2, set_id=set_id, limit=2)] == ["s1", "s2"]
    rec = next(st.iter_changelog())
    assert isinstance(rec, LogRecord) and rec.set_id == set_id and rec.change == "created"
    assert st.last_seq() == 10


# -- one transaction ------------------------------------------------------------------------------


def _snapshot(st: State, set_id: int):
    return (list(st.iter_resources(include_deleted=True)), list(st.iter_changelog()), st.cursor(set_id))


def test_failure_while_moving_cursor_rolls_back_everything(
    st: State, set_id: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    st.apply(set_id, [ch("keep", "created", A), ch("drop", "created", A)], Cursor(list_index=1))
    before = _snapshot(st, set_id)

    def boom(*a, **kw):
        raise RuntimeError("crash between the log and the cursor")

    monkeypatch.setattr(st, "_put_cursor", boom)
    with pytest.raises(RuntimeError):
        st.apply(
            set_id,
            [ch("keep", "updated", B), ch("new", "created", C), ch("drop", "deleted")],
            Cursor(list_index=4),
        )
    assert _snapshot(st, set_id) == before
    assert not isinstance(st, State) or not st.conn.in_transaction
    monkeypatch.undo()
    st.apply(set_id, [ch("new", "created", C)], Cursor(list_index=2))  # the connection still works
    assert st.cursor(set_id).list_index == 2
    assert [r.seq for r in st.iter_changelog()] == [1, 2, 3]


def test_sql_failure_in_the_middle_rolls_back_everything(
    st: State, set_id: int, fail_changelog_insert: Callable[[str], None]
) -> None:
    st.apply(set_id, [ch("keep", "created", A)], Cursor(list_index=1))
    before = _snapshot(st, set_id)
    # resources are written before the changelog: fail the changelog insert of one record
    fail_changelog_insert("poison")
    with pytest.raises(Exception, match="disk says no"):
        st.apply(set_id, [ch("keep", "updated", B), ch("poison", "created", C)], Cursor(list_index=2))
    assert _snapshot(st, set_id) == before
    assert st.resource(set_id, "poison") is None


def test_cursor_round_trip(st: State, set_id: int, reopen: Callable[..., StateStore], clock: Clock) -> None:
    assert st.cursor(set_id) is None
    cur = Cursor(
        baseline_at=datetime(2024, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
        changelist_url="https://example.org/changelist.xml",
        last_datetime=datetime(2024, 1, 3, tzinfo=UTC),
        same_datetime_count=2,
        list_index=17,
        list_until=None,
    )
    st.apply(set_id, [], cur)
    assert st.cursor(set_id) == cur
    st.close()
    with reopen(clock=clock) as s2:
        assert s2.cursor(set_id) == cur


# -- baselines ------------------------------------------------------------------------------------


def test_baseline_generation_sweep(st: State, set_id: int, clock: Clock) -> None:
    other = st.ensure_set("src", "https://example.org/cl2.xml")
    st.apply(set_id, [ch(u, "created", A) for u in ("same", "changed", "vanished", "dead")])
    st.apply(set_id, [ch("dead", "deleted")])
    st.apply(other, [ch("elsewhere", "created", A)])
    clock.tick()
    gen = st.begin_baseline(set_id)
    assert st.sets("src")[0].baseline_generation == gen
    seq0 = st.last_seq()
    applied = st.apply(
        set_id,
        [ch("same", "created", A, generation=gen), ch("changed", "created", B, generation=gen),
         ch("fresh", "created", C, generation=gen)],
    )  # fmt: skip
    assert [(c.uri, c.change) for c in applied] == [("changed", "updated"), ("fresh", "created")]
    assert st.resource(set_id, "same").generation == gen  # the no-op still marked it as seen...
    assert [r.uri for r in st.iter_changelog(seq0)] == ["changed", "fresh"]  # ...without logging it
    # an incremental change (no generation) while the baseline is open is not swept
    st.apply(set_id, [ch("notified", "created", A)])
    clock.tick()
    swept = st.finish_baseline(set_id, gen, Cursor(baseline_at=T0))
    assert [(c.uri, c.change) for c in swept] == [("vanished", "deleted")]
    assert [(r.uri, r.change) for r in st.iter_changelog(seq0)][-1] == ("vanished", "deleted")
    assert st.resource(set_id, "vanished").deleted
    live = sorted(r.uri for r in st.iter_resources(set_id))
    assert live == ["changed", "fresh", "notified", "same"]
    assert st.resource(other, "elsewhere").deleted is False  # other sets untouched
    assert st.cursor(set_id) == Cursor(baseline_at=T0)
    assert st.sets("src")[0].baseline_generation is None
    with pytest.raises(ValueError):
        st.finish_baseline(set_id, gen, Cursor())  # not open any more


def test_abandoned_baseline(st: State, set_id: int) -> None:
    g1 = st.begin_baseline(set_id)
    st.apply(set_id, [ch("seen-in-g1", "created", A, generation=g1)])
    g2 = st.begin_baseline(set_id)
    assert g2 == g1 + 1
    with pytest.raises(ValueError):
        st.finish_baseline(set_id, g1, Cursor())
    st.apply(set_id, [ch("seen-in-g2", "created", A, generation=g2)])
    swept = st.finish_baseline(set_id, g2, Cursor())
    assert [c.uri for c in swept] == ["seen-in-g1"]


def test_a_baseline_that_saw_nothing_sweeps_nothing(st: State, set_id: int) -> None:
    """The last line of defence, whoever calls it: ``finish_baseline`` of a generation that saw no
    resource while the set holds some raises EmptySnapshot and changes nothing (the baseline stays
    open); one that saw any of them sweeps the others, as always."""
    gen = st.begin_baseline(set_id)
    st.apply(set_id, [ch(u, "created", A, generation=gen) for u in ("a", "b", "c")])
    st.finish_baseline(set_id, gen, Cursor())
    empty = st.begin_baseline(set_id)
    before = _snapshot(st, set_id)
    with pytest.raises(EmptySnapshot):
        st.finish_baseline(set_id, empty, Cursor(list_index=7))
    assert _snapshot(st, set_id) == before
    assert st.sets("src")[0].baseline_generation == empty
    st.apply(set_id, [ch("b", "created", A, generation=empty)])
    assert sorted(c.uri for c in st.finish_baseline(set_id, empty, Cursor())) == ["a", "c"]
    # An empty set finishes an empty baseline (nothing to sweep).
    other = st.ensure_set("src", "https://example.org/empty.xml")
    st.finish_baseline(other, st.begin_baseline(other), Cursor())


def test_finish_baseline_is_one_transaction(st: State, set_id: int, monkeypatch: pytest.MonkeyPatch) -> None:
    st.apply(set_id, [ch("vanished", "created", A)])
    gen = st.begin_baseline(set_id)
    st.apply(set_id, [ch("seen", "created", B, generation=gen)])  # a baseline that saw something
    before = _snapshot(st, set_id)
    monkeypatch.setattr(st, "_put_cursor", lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        st.finish_baseline(set_id, gen, Cursor(list_index=9))
    assert _snapshot(st, set_id) == before
    assert st.sets("src")[0].baseline_generation == gen


# -- reads ----------------------------------------------------------------------------------------


def test_iter_resources_paging(st: State, set_id: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "PAGE_SIZE", 3)  # exercise the internal keyset paging
    other = st.ensure_set("src", "https://example.org/cl2.xml")
    st.apply(set_id, [ch(f"r{i:02d}", "created", A) for i in range(10)])
    st.apply(other, [ch("x", "created", A)])
    st.apply(set_id, [ch("r03", "deleted"), ch("r07", "deleted")])
    live = list(st.iter_resources(set_id))
    assert [r.uri for r in live] == [f"r{i:02d}" for i in range(10) if i not in (3, 7)]
    assert [r.id for r in live] == sorted(r.id for r in live)
    assert len(list(st.iter_resources(set_id, include_deleted=True))) == 10
    assert len(list(st.iter_resources())) == 9
    assert len(list(st.iter_resources(include_deleted=True))) == 11
    page1 = list(st.iter_resources(set_id, limit=4))
    page2 = list(st.iter_resources(set_id, after_id=page1[-1].id, limit=4))
    page3 = list(st.iter_resources(set_id, after_id=page2[-1].id, limit=4))
    assert [r.uri for r in page1 + page2 + page3] == [r.uri for r in live]
    assert len(page3) == 0 or len(page3) < 4
    assert list(st.iter_resources(set_id, limit=0)) == []


def test_resources_of_a_batch_of_uris(st: State, set_id: int) -> None:
    other = st.ensure_set("src", "https://example.org/cl2.xml")
    st.apply(set_id, [ch("a", "created", A), ch("b", "created", B), ch("gone", "created", C)])
    st.apply(set_id, [ch("gone", "deleted")])
    st.apply(other, [ch("elsewhere", "created", A)])
    got = st.resources(set_id, ["b", "nope", "a", "gone", "elsewhere", "a"])
    assert set(got) == {"a", "b", "gone"}  # this set's rows only, tombstones too, each once
    assert got == {u: st.resource(set_id, u) for u in ("a", "b", "gone")}
    assert got["gone"].deleted and st.resources(set_id, []) == {}


def test_counts(st: State, set_id: int) -> None:
    st.upsert_source("other", "https://other.example/")
    s2 = st.ensure_set("src", "https://example.org/cl2.xml")
    s3 = st.ensure_set("other", "https://other.example/cl.xml")
    st.apply(set_id, [ch(f"a{i}", "created", A) for i in range(4)])
    st.apply(s2, [ch("b", "created", A)])
    st.apply(s3, [ch("c", "created", A), ch("d", "created", A)])
    st.apply(set_id, [ch("a0", "deleted")])
    assert st.count_resources() == 6
    assert st.count_resources(set_id) == 3
    assert st.count_resources(set_id, include_deleted=True) == 4
    assert st.count_resources(source="src") == 4
    assert st.count_resources(source="other") == 2
    assert st.count_resources(source="nobody") == 0


def test_resource_metadata_round_trip(
    st: State, set_id: int, reopen: Callable[..., StateStore], clock: Clock
) -> None:
    links = [
        Link(
            rel="describedby", href="https://example.org/meta/1.xml", pri=1,
            modified=datetime(2024, 1, 1, 9, 30, 0, 123456, tzinfo=UTC), hash="md5:" + "1" * 32,
            length=42, type="application/xml", encoding="gzip", path="/meta/1.xml",
            extra={"{http://example.org/ns}x": "y", "foo": "bär"},
        ),
        Link(rel="duplicate", href="https://mirror.example/1"),
    ]  # fmt: skip
    change = Change(
        uri="https://example.org/res/1",
        change="created",
        sha256=A,
        length=1234,
        type="text/html",
        encoding="utf-8",
        hashes={"md5": "2" * 32, "sha-1": "3" * 40, "sha-256": A},
        lastmod=datetime(2023, 12, 31, 23, 59, 59, tzinfo=UTC),
        upstream_datetime=datetime(2024, 1, 1, tzinfo=UTC),
        links=links,
        md_extra={"{http://example.org/ns}note": "kept"},
        entry_extra=['<x:thing xmlns:x="http://example.org/ns">1</x:thing>'],
    )
    st.apply(set_id, [change])
    st.close()
    with reopen(clock=clock) as s2:
        r = s2.resource(set_id, change.uri)
        assert r.links == links
        assert r.md_extra == change.md_extra and r.entry_extra == change.entry_extra
        assert r.hashes == {"sha-256": A, "md5": "2" * 32, "sha-1": "3" * 40}
        assert (r.sha256, r.length, r.type, r.encoding) == (A, 1234, "text/html", "utf-8")
        assert (r.lastmod, r.upstream_datetime) == (change.lastmod, change.upstream_datetime)
        assert r.updated_at == T0 and r.deleted is False and r.generation is None
        bare = Change("https://example.org/res/2", "created", B)
        s2.apply(set_id, [bare])
        r2 = s2.resource(set_id, bare.uri)
        assert (r2.links, r2.md_extra, r2.entry_extra, r2.hashes) == ([], {}, [], {"sha-256": B})


def test_referenced_hashes(st: State, set_id: int) -> None:
    d = "d" * 64
    st.apply(set_id, [ch("u", "created", C), ch("v", "created", A)])
    st.apply(set_id, [ch("u", "updated", B)])  # C only in the changelog now
    st.apply(set_id, [ch("v", "deleted")])  # A only in the changelog now
    st.put_document(
        "https://example.org/cl.xml", "src", "capabilitylist", etag=None, last_modified=None, sha256=d
    )
    assert list(st.referenced_hashes()) == [A, B, C, d]
    if isinstance(st, State):  # its temp table is dropped
        assert st.conn.execute("SELECT name FROM temp.sqlite_master").fetchall() == []


# -- sources, documents, sets ---------------------------------------------------------------------


def test_sources_and_status(st: State, clock: Clock) -> None:
    st.upsert_source("src", "https://example.org/new-sd.xml")
    st.upsert_source("b", "https://b.example/")
    assert [s.name for s in st.sources()] == ["b", "src"]
    assert st.source("src").url == "https://example.org/new-sd.xml"
    assert st.source("nope") is None
    when = datetime(2024, 5, 1, 11, 0, 0, 5, tzinfo=UTC)
    st.set_source_status(
        "src", state="baseline", last_attempt=when, progress_done=10, progress_total=100,
        last_error="timeout", failures=2,
    )  # fmt: skip
    s = st.source("src")
    assert (s.state, s.last_attempt, s.progress_done, s.progress_total) == (
        "baseline",
        when,
        10,
        100,
    )
    assert (s.last_error, s.failures, s.last_success) == ("timeout", 2, None)
    assert s.created_at == T0
    with pytest.raises(ValueError):
        st.set_source_status("src", colour="red")
    with pytest.raises(KeyError):
        st.set_source_status("nope", state="idle")


def test_documents(st: State, clock: Clock) -> None:
    assert st.document("https://example.org/cl.xml") is None
    st.put_document(
        "https://example.org/cl.xml", "src", "capabilitylist", etag='"x"', last_modified=None, sha256=A
    )
    clock.tick(5)
    st.put_document(
        "https://example.org/cl.xml", "src", "capabilitylist", etag='"y"', last_modified="Wed", sha256=B
    )
    d = st.document("https://example.org/cl.xml")
    assert d == DocumentRow(
        url="https://example.org/cl.xml", source="src", capability="capabilitylist",
        etag='"y"', last_modified="Wed", sha256=B, fetched_at=T0 + timedelta(seconds=5),
    )  # fmt: skip
    with pytest.raises(INTEGRITY_ERRORS):  # foreign keys are on
        st.put_document("https://x/", "unknown-source", None, etag=None, last_modified=None, sha256=None)


def test_sets(st: State) -> None:
    st.upsert_source("src-2", "https://clash.example/")
    s1 = st.ensure_set("src", "https://example.org/cl1.xml")
    assert st.ensure_set("src", "https://example.org/cl1.xml") == s1
    clash = st.ensure_set("src-2", "https://clash.example/cl.xml")
    s2 = st.ensure_set("src", "https://example.org/cl2.xml")
    names = {d.id: d.name for d in st.sets()}
    assert names[s1] == "src" and names[clash] == "src-2" and names[s2] == "src-3"
    assert [d.id for d in st.sets("src")] == [s1, s2]
    assert st.sets("src")[0].capabilitylist_url == "https://example.org/cl1.xml"


# -- schema, pragmas, threads ---------------------------------------------------------------------


def test_migrations_idempotent_and_pragmas(db_path: Path, clock: Clock) -> None:
    with State(db_path, clock=clock) as s1:
        assert s1.schema_version == len(MIGRATIONS)
        assert s1.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s1.conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        assert s1.conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        s1.upsert_source("x", "https://x/")
        tables = table_names(s1)
    with State(db_path, clock=clock, synchronous="FULL") as s2:
        assert s2.schema_version == len(MIGRATIONS)
        assert table_names(s2) == tables
        assert s2.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert s2.source("x").url == "https://x/"
    assert {"sources", "documents", "sets", "cursors", "resources", "changelog"} <= tables
    with pytest.raises(ValueError):
        State(db_path, synchronous="OFF")


def test_dump_tables_made_before_they_were_a_migration_are_kept(db_path: Path) -> None:
    """Stores whose dump tables publish/dumps.py created itself (schema version 4) upgrade in place."""
    conn = sqlite3.connect(db_path)
    for step in MIGRATIONS[:4]:
        for statement in step:
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 4")
    for statement in MIGRATIONS[4]:  # as the dump builder did, before this was migration 5
        conn.execute(statement)
    conn.execute(
        "INSERT INTO publish_dumps (set_name, kind, part, sha256, length, manifest_sha256, manifest_length, "
        "entries, bytes, created) VALUES ('s', 'changedump', 1, ?, 1, ?, 1, 1, 1, 't')",
        (A, B),
    )
    conn.commit()
    conn.close()
    with State(db_path) as st:
        assert st.schema_version == len(MIGRATIONS) >= 5
        assert st.conn.execute("SELECT sha256 FROM publish_dumps").fetchall() == [(A,)]
    with State(db_path, readonly=True) as ro:  # a reader accepts the upgraded store
        assert {"publish_dumps", "publish_dump_runs"} <= set(table_names(ro))


def test_newer_schema_is_refused(db_path: Path) -> None:
    State(db_path).close()
    conn = sqlite3.connect(db_path)
    conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    conn.close()
    with pytest.raises(RuntimeError, match="schema version"):
        State(db_path)


def test_apply_from_several_threads(st: State, set_id: int) -> None:
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(20):
                st.apply(set_id, [ch(f"t{n}-{i}", "created", A)])
                list(st.iter_resources(set_id, limit=5))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert st.count_resources(set_id) == 80
    assert [r.seq for r in st.iter_changelog()] == list(range(1, 81))


def test_datetime_text_form() -> None:
    t = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert format_dt(t) == "2024-01-02T03:04:05.000000Z"
    assert format_dt(t.replace(microsecond=120)) == "2024-01-02T03:04:05.000120Z"
    assert format_dt(datetime(2024, 1, 2, 4, 4, 5)) == "2024-01-02T04:04:05.000000Z"  # naive = UTC
    assert parse_dt(format_dt(t)) == t
    assert parse_dt("2024-01-02T04:04:05+01:00") == t  # any W3C form is accepted back
    assert format_dt(t) < format_dt(t.replace(microsecond=1))  # fixed width: text order is time order


def test_links_column_is_the_json_of_every_link_shape() -> None:
    """The common links (rel, href, modified) are written without the JSON encoder: byte for byte what
    it writes, for any text, and every other shape still through it; and read back as they were."""
    import json
    import random

    def encoded(links: list[Link]) -> str:
        out = []
        for ln in links:
            d: dict = {"rel": ln.rel, "href": ln.href}
            for k in ("pri", "hash", "length", "type", "encoding", "path"):
                if getattr(ln, k) is not None:
                    d[k] = getattr(ln, k)
            if ln.modified is not None:
                d["modified"] = format_dt(ln.modified)
            if ln.extra:
                d["extra"] = ln.extra
            out.append(d)
        return json.dumps(out, ensure_ascii=False, separators=(",", ":"))

    texts = ["via", 'é"\\\n\x01', "http://x/?a=b&c=<d>", "\u2028x", "😀", ""]
    times = [
        None,
        datetime(2020, 1, 1, tzinfo=UTC),
        datetime(2020, 1, 1, 5, tzinfo=timezone(timedelta(hours=2))),
    ]
    pick = random.Random(7).choice
    for _ in range(3000):
        links = [
            Link(
                pick(texts),
                pick(texts),
                pri=pick([None, 1]),
                modified=pick(times),
                hash=pick([None, "md5:ab"]),
                type=pick([None, "text/xml"]),
                extra=pick([{}, {"k": "v"}]),
            )
            for _ in range(pick([1, 2, 3]))
        ]
        written = codec.links_json(links)
        assert written == encoded(links)
        assert codec.links_from(written) == [
            Link(**{**vars_of(ln), "modified": ln.modified.astimezone(UTC) if ln.modified else None})
            for ln in links
        ]


def vars_of(link: Link) -> dict:
    import dataclasses

    return {f.name: getattr(link, f.name) for f in dataclasses.fields(link)}


# -- reconciliation (harvest/reconcile.py) --------------------------------------------------------------


def test_reconciliation_round_trips(st: State, set_id: int) -> None:
    """The last reconciliation of a set is replaced, never appended."""
    from aggregator.store.rows import Reconciliation

    assert st.reconciliation(set_id) is None
    at = datetime(2024, 5, 1, 10, 0, tzinfo=UTC)
    first = Reconciliation(set_id, at, "scheduled", {"https://e.org/rl.xml": {"etag": '"x"', "at": None}},
                           3, {"deleted": 2, "created": 1}, 0, True)  # fmt: skip
    st.put_reconciliation(first)
    assert st.reconciliation(set_id) == first
    second = Reconciliation(set_id, at + timedelta(days=1), "list moved", {}, 1, {}, 1, False, "not read: x")
    st.put_reconciliation(second)
    assert st.reconciliation(set_id) == second


#: Last-Modified values an upstream may send: IMF-fixdates (kept), and what is not kept (RFC 850 and
#: asctime forms, a wrong weekday, a day that does not exist, junk).
_LAST_MODIFIED = [
    "Mon, 01 Jan 2024 00:00:00 GMT", "Sat, 28 Nov 2026 11:11:32 GMT", "Thu, 29 Feb 2024 23:59:59 GMT",
    "Sunday, 06-Nov-94 08:49:37 GMT", "Sun Nov  6 08:49:37 1994", "Tue, 01 Jan 2024 00:00:00 GMT",
    "Thu, 31 Feb 2024 00:00:00 GMT", "yesterday", None,
]  # fmt: skip


@pytest.mark.parametrize("seed", range(16))
def test_validators_name_the_version_their_row_holds(st: State, set_id: int, seed: int) -> None:
    """Random histories of a few resources (batches of created, updated, no-op, deleted, created again)
    with the upstream's validators given with a batch (``apply``) or alone (``put_resource_validators``),
    for the version held or another one, against a model of the rule: validators are kept for the
    version the row holds (and only an IMF-fixdate Last-Modified), a change of content drops those of the
    version before, a deletion hides them, validators of another version change nothing, and the
    lastmod read back is the one they were confirmed under, else the row's own."""
    import random

    from aggregator.store.rows import ResourceValidators
    from aggregator.store.sql.codec import http_date_in

    rng = random.Random(seed)
    uris = [f"https://example.org/r/{i}" for i in range(4)]
    shas = [f"{i:064x}" for i in range(1, 4)]
    times = [None, *(datetime(2020 + i, 1, 1, tzinfo=UTC) for i in range(3))]
    held: dict[str, tuple[str, datetime | None]] = {}  # live rows: uri -> (sha256, the row's lastmod)
    kept: dict[str, tuple] = {}  # uri -> (etag, Last-Modified, confirmed lastmod) as stored

    def validators(uri: str) -> ResourceValidators:
        sha = held[uri][0] if uri in held and rng.random() < 0.7 else rng.choice(shas)
        etag, modified = rng.choice(['"a"', 'W/"b"', None]), rng.choice(_LAST_MODIFIED)
        return ResourceValidators(uri, sha, etag, modified, rng.choice(times))

    def keep(v: ResourceValidators) -> None:  # the model: v names the version its row holds
        modified = v.last_modified if http_date_in(v.last_modified) else None
        confirmed = None if v.lastmod == held[v.uri][1] else v.lastmod
        if v.etag is None and modified is None and confirmed is None:
            kept.pop(v.uri, None)
        else:
            kept[v.uri] = (v.etag, modified, confirmed)

    for _ in range(40):
        batch_uris = rng.sample(uris, rng.randint(1, 2))
        if rng.random() < 0.6:
            changes, rewritten = [], set()
            for uri in batch_uris:
                kind = rng.choice(["created", "updated", "deleted"])
                sha, lastmod = rng.choice(shas), rng.choice(times)
                changes.append(ch(uri, kind, None if kind == "deleted" else sha, lastmod=lastmod))
                if kind == "deleted":
                    held.pop(uri, None)
                    kept.pop(uri, None)
                    rewritten.discard(uri)
                elif uri not in held or held[uri][0] != sha:  # new content (else a no-op)
                    held[uri] = (sha, lastmod)
                    kept.pop(uri, None)
                    rewritten.add(uri)
            given = [validators(u) for u in batch_uris if rng.random() < 0.7]
            st.apply(set_id, changes, validators=given)
            for v in {v.uri: v for v in given}.values():  # the last given for a uri
                if v.uri in held and held[v.uri][0] == v.sha256:
                    keep(v)
        else:
            v = validators(batch_uris[0])
            st.put_resource_validators(set_id, [v])
            if v.uri in held and held[v.uri][0] == v.sha256:
                keep(v)
        expected = {
            u: ResourceValidators(u, held[u][0], e, m, held[u][1] if c is None else c)
            for u, (e, m, c) in kept.items()
        }
        assert st.resource_validators(set_id, [*uris, "https://example.org/none"]) == expected
    assert st.resource_validators(set_id, []) == {}
