"""Times and uri keys at the state's seam since schema step 16: SQLite stores the times of resources and
changelog as integer microseconds (dialect.to_us), rows are found by ``uri_key``. Generated datetimes
(microseconds, before 1970, far future, naive and in other zones) read back as they were given (in UTC,
to the microsecond), render to ``format_dt``'s text and keep their order, on both backends; the uri key
PostgreSQL computes in SQL (step 16's conversion) is the one rsagg computes."""

from __future__ import annotations

import hashlib
import random
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from aggregator.store.interface import StateStore
from aggregator.store.open import connect
from aggregator.store.rows import Change, format_dt, parse_dt
from aggregator.store.sql.dialect import URI_KEY_SQL, from_us, to_us, uri_key, us_of_text, us_text

_MIN = datetime(1, 1, 2, tzinfo=UTC)  # a day of margin: a zone's offset keeps the instant in range
_MAX = datetime(9999, 12, 30, 23, 59, 59, 999999, tzinfo=UTC)


def generated_times(seed: int, n: int) -> list[datetime]:
    """Datetimes of every kind the seam may be given: anywhere in datetime's range, near the epoch and
    now, with and without microseconds, aware in UTC or another zone (whole, half-hour, odd minutes), or
    naive (read as UTC)."""
    rng = random.Random(seed)
    span = int((_MAX - _MIN) / timedelta(microseconds=1))
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    fixed = [_MIN, _MAX, epoch, epoch - timedelta(microseconds=1), epoch + timedelta(microseconds=1),
             datetime(2026, 11, 28, 5, 0, tzinfo=UTC)]  # fmt: skip
    out = []
    for i in range(n):
        if i < len(fixed):
            t = fixed[i]
        else:
            where = rng.choice(["any", "epoch", "now"])
            if where == "any":
                t = _MIN + timedelta(microseconds=rng.randrange(span))
            else:
                centre = (
                    datetime(1970, 1, 1, tzinfo=UTC) if where == "epoch" else datetime(2026, 1, 1, tzinfo=UTC)
                )
                t = centre + timedelta(microseconds=rng.randrange(-(10**15), 10**15))
            if rng.random() < 0.3:
                t = t.replace(microsecond=0)
        form = rng.choice(["utc", "zone", "naive"])
        if form == "zone":
            t = t.astimezone(timezone(timedelta(minutes=rng.randrange(-14 * 60, 14 * 60 + 1))))
        elif form == "naive":
            t = t.replace(tzinfo=None)
        out.append(t)
    return out


def as_utc(t: datetime) -> datetime:
    """What the seam gives back for ``t``: the same instant, aware, in UTC (naive read as UTC)."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


TIMES = generated_times(16, 400)


def test_times_round_trip_through_the_integer_codec() -> None:
    for t in TIMES:
        us = to_us(t)
        assert isinstance(us, int) and -(2**63) <= us < 2**63
        back = from_us(us)
        assert back == as_utc(t) and back is not None and back.tzinfo is UTC
        assert us_text(us) == format_dt(t)  # what SQLite's text held, byte for byte
        assert us_of_text(format_dt(t)) == us  # step 16's conversion of that text
        assert parse_dt(us_text(us)) == back
    assert (
        to_us(None) is None and from_us(None) is None and us_text(None) is None and us_of_text(None) is None
    )
    ordered = sorted(TIMES, key=as_utc)
    assert sorted(TIMES, key=to_us) == ordered  # integer order is time order
    assert sorted(TIMES, key=format_dt) == ordered  # as the text's was


@pytest.mark.parametrize(
    "junk", ["", "yesterday", "2026-13-01T00:00:00Z", "2026-01-01T25:00:00Z", "20260101"]
)
def test_a_time_text_that_does_not_parse_is_refused(junk: str) -> None:
    with pytest.raises(ValueError, match="not a W3C datetime"):
        us_of_text(junk)


def _sha(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def check_times_at_the_seam(st: StateStore) -> None:
    """Resources carrying the generated times as lastmod and upstream datetime read back as given, in
    every reader (rows, listing text, Change List records) and sort by time as the times do."""
    st.upsert_source("s", "https://example.org/sd.xml")
    sid = st.ensure_set("s", "https://example.org/cl.xml")
    uri = "https://example.org/r/{}".format
    changes = [
        Change(uri(i), "created", _sha(i), lastmod=t, upstream_datetime=TIMES[-1 - i])
        for i, t in enumerate(TIMES)
    ]
    for b in range(0, len(changes), 100):
        st.apply(sid, changes[b : b + 100])
    rows = {r.uri: r for r in st.iter_resources(sid)}
    for i, t in enumerate(TIMES):
        r = rows[uri(i)]
        assert (r.lastmod, r.upstream_datetime) == (as_utc(t), as_utc(TIMES[-1 - i])), i
        assert r.lastmod is not None and r.lastmod.tzinfo is not None
    listing = {row[1]: row for row in st.iter_live_listing([sid])}  # type: ignore[index]
    for i, t in enumerate(TIMES):
        row = listing[uri(i)]
        assert (row[8], row[9]) == (format_dt(t), format_dt(TIMES[-1 - i]))  # type: ignore[index]
        assert row[10] == format_dt(rows[uri(i)].updated_at)  # type: ignore[index]
    # a tombstone keeps the upstream datetime of its deletion
    st.apply(sid, [Change(uri(0), "deleted", upstream_datetime=TIMES[1])])
    assert st.resource(sid, uri(0)).upstream_datetime == as_utc(TIMES[1])  # type: ignore[union-attr]
    # the changelog's own clock: records read back in seq order with non-decreasing times
    recs = list(st.iter_changelog())
    assert [r.datetime for r in recs] == sorted(r.datetime for r in recs)
    assert all(r.datetime.tzinfo is not None for r in recs)


def test_times_at_the_seam_on_sqlite(tmp_path: Path) -> None:
    with connect(tmp_path / "s.db") as st:
        check_times_at_the_seam(st)


@pytest.mark.slow
def test_times_at_the_seam_on_postgres(pg_server) -> None:  # type: ignore[no-untyped-def]
    with connect(pg_server.fresh_url()) as st:
        check_times_at_the_seam(st)


def generated_uris(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcxyz019-._~%/?#[]@!$&'()*+,;=: éü漢字🙂\u00a0\u2028"
    return [
        "https://example.org/" + "".join(rng.choices(alphabet, k=rng.randrange(0, 120))) for _ in range(n)
    ] + ["", "é", "🙂" * 50]


def test_uri_key_is_a_signed_32_bit_integer_of_the_uri() -> None:
    uris = generated_uris(7, 500)
    keys = [uri_key(u) for u in uris]
    assert all(-(2**31) <= k < 2**31 for k in keys)
    assert keys == [uri_key(u) for u in uris]  # stable
    assert len(set(keys)) > len(set(uris)) - 3  # a narrowing key: collisions are rare


def test_two_uris_sharing_a_key_are_two_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key only narrows: with every uri given the same key, each lookup still finds its own row."""
    from aggregator.store import state
    from aggregator.store.sql import dialect, reads

    for module in (state, dialect, reads):
        monkeypatch.setattr(module, "uri_key", lambda uri: 7)
    with connect(tmp_path / "s.db") as st:
        st.upsert_source("s", "https://example.org/sd.xml")
        sid = st.ensure_set("s", "https://example.org/cl.xml")
        uris = [f"https://example.org/{i}" for i in range(20)]
        st.apply(sid, [Change(u, "created", _sha(i)) for i, u in enumerate(uris)])
        applied = st.apply(sid, [Change(uris[3], "updated", _sha(3)), Change(uris[4], "updated", _sha(44))])
        assert [(c.uri, c.change) for c in applied] == [(uris[4], "updated")]  # 3 unchanged: a no-op
        assert {u: r.sha256 for u, r in st.resources(sid, uris[:6]).items()} == {
            u: _sha(44 if i == 4 else i) for i, u in enumerate(uris[:6])
        }
        assert st.resource(sid, uris[5]).sha256 == _sha(5)  # type: ignore[union-attr]
        assert st.resource(sid, "https://example.org/none") is None
        assert (
            st.live_set_of([sid], uris[7]) == sid and st.live_set_of([sid], "https://example.org/x") is None
        )


@pytest.mark.slow
def test_postgres_computes_the_same_uri_key(pg_server) -> None:  # type: ignore[no-untyped-def]
    import psycopg

    uris = generated_uris(8, 300)
    with psycopg.connect(pg_server.fresh_url()) as conn:
        got = conn.execute(
            f"SELECT {URI_KEY_SQL} FROM unnest(%s::text[]) WITH ORDINALITY AS u(uri, n) ORDER BY n", (uris,)
        ).fetchall()
    assert [k for (k,) in got] == [uri_key(u) for u in uris]


# -- plans: a lookup by uri is a key lookup on both backends -----------------------------------------


def _filled(st: StateStore, n: int = 3000) -> tuple[int, int, list[str]]:
    st.upsert_source("s", "https://example.org/sd.xml")
    st.upsert_source("t", "https://example.org/td.xml")
    big, small = (
        st.ensure_set("s", "https://example.org/cl.xml"),
        st.ensure_set("t", "https://example.org/c2.xml"),
    )
    uris = [f"https://example.org/r/{i}" for i in range(n)]
    for b in range(0, n, 1000):
        st.apply(big, [Change(u, "created", _sha(i)) for i, u in enumerate(uris[b : b + 1000], b)])
    st.apply(small, [Change(u, "created", _sha(i)) for i, u in enumerate(uris[:20])])
    return big, small, uris


def test_sqlite_plans_use_the_uri_key_only_for_lookups_by_uri(tmp_path: Path) -> None:
    from aggregator.store.sql.dialect import SQLITE

    with connect(tmp_path / "s.db") as st:
        big, small, uris = _filled(st)

        def plan(sql: str, params: tuple) -> str:
            return " | ".join(r[3] for r in st.conn.execute("EXPLAIN QUERY PLAN " + sql, params))

        q = SQLITE.by_uri(("id", "uri"), big, uris[:50])
        assert "USING INDEX resources_uri (uri_key=? AND set_id=?)" in plan(*q)
        one = (big, uri_key(uris[7]), uris[7])
        assert "resources_uri (uri_key=? AND set_id=?)" in plan(
            "SELECT id FROM resources WHERE set_id = ? AND uri_key = ? AND uri = ?", one
        )
        # a whole set's rows: never the key index (it is the smallest, and SQLite liked it for counts)
        whole = [
            "SELECT count(*) FROM resources WHERE set_id = ? AND deleted = 0",
            "SELECT 1 FROM resources WHERE set_id = ? AND generation = 3 LIMIT 1",
            "SELECT count(*), max(updated_at) FROM resources WHERE set_id = ? AND id > 5",
        ]
        for sql in whole:
            assert "resources_uri" not in plan(sql, (small,)), sql


@pytest.mark.slow
def test_postgres_looks_up_each_uri_by_its_key_analysed_or_not(pg_server) -> None:  # type: ignore[no-untyped-def]
    import psycopg

    from aggregator.store.sql.dialect import POSTGRES

    url = pg_server.fresh_url()
    with connect(url) as st:
        big, _, uris = _filled(st)
    sql, params = POSTGRES.by_uri(("id", "uri"), big, uris[:200])
    with psycopg.connect(url, autocommit=True) as conn:
        for analyse in (False, True):
            if analyse:
                conn.execute("ANALYZE resources")
            plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql, params))
            assert "Index Scan using resources_uri" in plan and "Nested Loop" in plan, plan
            assert "Seq Scan on resources" not in plan and "Hash Join" not in plan, plan


#: Reads of one set (store/sql/reads.py's shapes) and their parameters for the set ``s`` and its row ``r``.
_SET_READS = [
    ("{res} WHERE set_id = ? AND deleted = 0 AND id <= ? AND id > ? ORDER BY id LIMIT ?", "s, big, 0, 1000"),
    ("{res} WHERE set_id = ? AND id > ? ORDER BY id LIMIT ?", "s, 0, 1000"),
    ("SELECT count(*) FROM resources WHERE set_id = ? AND deleted = 0", "s"),
    (
        "SELECT id FROM resources WHERE set_id = ? AND deleted = 0 AND id > ? ORDER BY id LIMIT 1 OFFSET ?",
        "s, 0, 9",
    ),
    ("SELECT count(*), max(updated_at) FROM resources WHERE set_id = ? AND id > ? AND id <= ?", "s, 0, big"),
    ("SELECT 1 FROM resources WHERE set_id = ? AND generation = ? LIMIT 1", "s, 3"),
    ("{res} WHERE set_id = ? AND uri_key = ? AND uri = ?", "s, key, uri"),
    ("{log} WHERE c.set_id = ? AND c.seq <= ? AND c.seq > ? ORDER BY c.seq LIMIT ?", "s, big, 0, 1000"),
    ("SELECT coalesce(max(seq), 0) FROM changelog WHERE set_id = ?", "s"),
    ("SELECT seq FROM changelog WHERE set_id = ? AND seq > ? ORDER BY seq LIMIT 1", "s, 0"),
    ("{log} WHERE c.resource_id = ? AND c.seq > ? ORDER BY c.seq LIMIT ?", "r, 0, 1000"),
    (
        "{log} WHERE c.resource_id = ? AND c.datetime <= now() AND c.change != 2 ORDER BY c.seq DESC LIMIT 1",
        "r",
    ),
]


@pytest.mark.slow
def test_postgres_reads_a_small_set_by_its_indexes_analysed_or_not(pg_server) -> None:  # type: ignore[no-untyped-def]
    """A set of 20 rows beside one of 20,000: every read of it is an index scan (schema step 17's
    resources_set, the uri key, changelog_set_seq, changelog_resource), with statistics or without."""
    import psycopg

    from aggregator.store.sql.codec import LOG_SELECT, SELECT_RES
    from aggregator.store.sql.dialect import POSTGRES

    url = pg_server.fresh_url()
    with connect(url) as st:
        _, small, uris = _filled(st, 20000)
        row = st.resource(small, uris[7])
        assert row is not None
    values = {"s": small, "big": 2**62, "key": uri_key(uris[7]), "uri": uris[7], "r": row.id}
    with psycopg.connect(url, autocommit=True) as conn:
        for analyse in (False, True):
            if analyse:
                conn.execute("VACUUM ANALYZE resources")
                conn.execute("VACUUM ANALYZE changelog")
            for sql, names in _SET_READS:
                text = POSTGRES.sql(sql.format(res=SELECT_RES, log=LOG_SELECT))
                params = [values.get(n, n) for n in names.split(", ")]
                params = [int(p) if isinstance(p, str) and p.isdigit() else p for p in params]
                plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + text, params))
                assert "Seq Scan on" not in plan, (analyse, sql, plan)
                assert "Index" in plan, (analyse, sql, plan)


# -- one row per uri and set, without a unique index --------------------------------------------------


def check_one_row_per_uri(handles: list[StateStore]) -> None:
    """Writers racing to create the same uris (each its own handle, in threads) leave one row per uri:
    the writers take turns (SQLite's write lock; PostgreSQL's changelog head, locked before the rows
    are read), which is what keeps a uri to one row since step 16 dropped the UNIQUE (set_id, uri)."""
    import threading

    first = handles[0]
    first.upsert_source("s", "https://example.org/sd.xml")
    sid = first.ensure_set("s", "https://example.org/cl.xml")
    uris = [f"https://example.org/race/{i}" for i in range(40)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(handles))

    def write(st: StateStore, n: int) -> None:
        try:
            start.wait(timeout=60)
            for round_ in range(5):
                st.apply(
                    sid, [Change(u, "created", _sha(n * 1000 + round_ * 100 + i)) for i, u in enumerate(uris)]
                )
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(st, n)) for n, st in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    rows = list(first.iter_resources(sid, include_deleted=True))
    assert sorted(r.uri for r in rows) == sorted(uris)
    assert first.count_resources(set_id=sid, include_deleted=True) == len(uris)


def test_racing_writers_leave_one_row_per_uri_on_sqlite(tmp_path: Path) -> None:
    handles = [connect(tmp_path / "s.db") for _ in range(4)]
    try:
        check_one_row_per_uri(handles)
    finally:
        for st in handles:
            st.close()


@pytest.mark.slow
def test_racing_writers_leave_one_row_per_uri_on_postgres(pg_server) -> None:  # type: ignore[no-untyped-def]
    url = pg_server.fresh_url()
    handles = [connect(url) for _ in range(4)]
    try:
        check_one_row_per_uri(handles)
    finally:
        for st in handles:
            st.close()
