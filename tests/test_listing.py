"""Resource List lines written from state rows (``publish/listing.py``) are byte for byte the ordinary
writer's (``resource_entry`` + ``rs.write``): for plain rows and for every kind of row that differs from
the common one (other hashes, encoding, upstream times, links, extras, URIs to escape or map, odd
types, times without a fraction), with and without a publish filter, and across an id range."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from pathlib import Path

import pytest

from aggregator.publish import documents
from aggregator.publish.links import LinkPolicy
from aggregator.publish.listing import ListingWriter, _text_time
from aggregator.rs.model import Link
from aggregator.rs.parse import parse_bytes
from aggregator.rs.write import _dt, iter_document_bytes
from aggregator.store.open import connect
from aggregator.store.rows import Change, format_dt
from aggregator.store.sets import PublishedSet
from aggregator.store.state import State

BASE = "http://rsagg.example/pub"
T0 = datetime(2026, 3, 1, tzinfo=UTC)
SHA = "ab" * 32
URIS = [
    "http://up.example/a.txt",
    "https://up.example:8443/dir/b.html?x=1&y=2",  # & to escape, ? to map
    "http://up.example/sp ace/é",
    "http://up.example/a/../b",  # a dot segment
    "http://up.example/.well-known/resourcesync",
    "urn:isbn:0451450523",
    "http://up.example/100%25",
    "http://up.example/quote'star*(x)",
    'http://up.example/"q"<x>',
    "HTTP://UP.example/Caps",
]


def changes() -> list[Change]:
    out = []
    for i, uri in enumerate(URIS):
        out.append(Change(uri, "created", f"{i:064x}", 10 + i, "text/plain"))
    n = itertools.count()

    def c(**kw) -> Change:
        return Change(f"http://up.example/k/{next(n)}", "created", kw.pop("sha256", SHA), **kw)

    out += [
        c(length=1, type="text/html"),
        c(length=None, type=None),
        c(length=0, type="application/xml", encoding="gzip"),
        c(length=5, type='text/x-"odd"&<type>', encoding="x&y"),
        c(length=5, type="text/plain", hashes={"md5": "0" * 32}),
        c(length=5, type="text/plain", hashes={"md5": "1" * 32, "sha-1": "2" * 40}),
        c(length=5, type="text/plain", lastmod=datetime(2020, 1, 2, 3, 4, 5, tzinfo=UTC)),
        c(length=5, type="text/plain", lastmod=datetime(2020, 1, 2, 3, 4, 5, 120000, tzinfo=UTC)),
        c(length=5, type="text/plain", lastmod=datetime(999, 1, 2, 3, 4, 5, 7, tzinfo=UTC)),
        c(length=5, type="text/plain", upstream_datetime=datetime(2021, 6, 7, 8, 9, 10, 1, tzinfo=UTC)),
        c(length=5, type="text/plain", links=[Link("describedby", URIS[0]), Link("license", "http://l/")]),
        c(length=5, type="text/plain", links=[Link("via", "http://elsewhere.example/x")]),
        c(length=5, type="text/plain", md_extra={"{http://ex.org/ns}note": "n"}),
        c(length=5, type="text/plain", entry_extra=['<ex:x xmlns:ex="http://ex.org/ns">1</ex:x>']),
    ]
    return out


def ticking() -> object:
    """updated_at times: some with a fraction, some whole seconds, some shared by neighbours."""
    times = [T0, T0, T0.replace(microsecond=500), T0.replace(second=1, microsecond=123456), T0]
    it = itertools.cycle(times)
    return lambda: next(it)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def state(request: pytest.FixtureRequest, tmp_path: Path):
    """The same rows in each backend: PostgreSQL writes the times of its ``ListingRow``s itself."""
    if request.param == "sqlite":
        st = State(tmp_path / "state.db", clock=ticking())
    else:
        st = connect(request.getfixturevalue("pg_server").fresh_url(), clock=ticking())
    st.upsert_source("up", "http://up.example/")
    set_id = st.ensure_set("up", "http://up.example/capabilitylist.xml")
    batch = changes()
    for i in range(0, len(batch), 3):  # several transactions: several updated_at times
        st.apply(set_id, batch[i : i + 3])
    yield st
    st.close()


def render(site: documents.Site, state: State, ps: PublishedSet, lines: bool, lo=0, hi=None) -> bytes:
    head, entries = documents.resource_list_part(site, state, ps, lo, hi, T0, lines=lines)
    return b"".join(iter_document_bytes(head, entries, flush_head=True))


def test_lines_are_the_writers_bytes(state: State):
    [row] = state.sets("up")
    ps = PublishedSet("up", (row.id,))
    site = documents.Site(BASE, {"up": ps}, LinkPolicy(), 10)
    fresh = render(site, state, ps, lines=True)
    assert fresh == render(site, state, ps, lines=False)
    _, entries = parse_bytes(fresh, BASE + "/up/resourcelist.xml")
    assert len(entries) == len(changes())
    # an id range, and the written lines were really used (not the ordinary writer for every row)
    assert render(site, state, ps, True, 3, 12) == render(site, state, ps, False, 3, 12)
    _, lines = documents.resource_list_part(site, state, ps, 0, None, T0, lines=True)
    assert sum(e.count("<url>") for e in lines if isinstance(e, str)) >= len(URIS)
    # the plain rows come as ListingRow tuples, their times in the fixed form SQLite stores
    rows = list(state.iter_live_listing([row.id]))
    plain = [r for r in rows if type(r) is tuple]
    assert len(plain) >= len(URIS) and len(rows) == len(changes())
    live = {r.id: r for r in state.iter_live([row.id])}
    for r in plain:
        res = live[r[0]]
        assert r[8:] == (format_dt(res.lastmod), format_dt(res.upstream_datetime), format_dt(res.updated_at))


def test_lines_with_a_publish_filter(state: State):
    [row] = state.sets("up")
    ps = PublishedSet("up", (row.id,))
    site = documents.Site(BASE, {"up": ps}, LinkPolicy(), 10, visible=lambda s, r: "/k/1" not in r.uri)
    fresh = render(site, state, ps, lines=True)
    assert fresh == render(site, state, ps, lines=False)
    assert b"/k/1<" not in fresh and b"/k/10<" not in fresh and b"/k/2<" in fresh


def test_a_plugin_link_policy_gets_the_ordinary_writer(state: State):
    class Policy(LinkPolicy):  # not the built-in one: it may say anything
        def links(self, resource, **kw):
            return [Link("via", "http://mine.example/")]

    [row] = state.sets("up")
    ps = PublishedSet("up", (row.id,))
    site = documents.Site(BASE, {"up": ps}, Policy(), 10)
    fresh = render(site, state, ps, lines=True)
    assert fresh == render(site, state, ps, lines=False) and b"http://mine.example/" in fresh


@pytest.mark.parametrize(
    "when",
    [
        datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        datetime(2026, 1, 2, 3, 4, 5, 100, tzinfo=UTC),
        datetime(2026, 1, 2, 3, 4, 5, 120000, tzinfo=UTC),
        datetime(1000, 1, 1, tzinfo=UTC),
        datetime(999, 12, 31, 23, 59, 59, 9, tzinfo=UTC),
        datetime(1, 1, 1, tzinfo=UTC),
    ],
)
def test_stored_times_print_as_the_writer_prints_them(when: datetime):
    stored = format_dt(when)
    assert stored is not None
    assert _text_time(stored) == _dt(when)
    assert _text_time("2026-01-02T03:04:05+01:00") == "2026-01-02T02:04:05Z"  # not our fixed form


def test_a_value_xml_cannot_hold_is_an_error_naming_the_entry():
    w = ListingWriter(BASE, "up")
    with pytest.raises(ValueError, match=r"http://up\.example/bad"):
        w.line(
            "http://up.example/bad\x01", SHA, 1, "text/plain", None, None, None, None, "2026-01-01T00:00:00Z"
        )


def test_years_before_1000_are_written_with_four_digits():
    from aggregator.rs.w3cdt import format_w3c

    assert format_w3c(datetime(999, 12, 31, 23, 59, 59, 9, tzinfo=UTC)) == "0999-12-31T23:59:59.000009Z"
    assert format_w3c(datetime(999, 12, 31, tzinfo=UTC)) == "0999-12-31T00:00:00Z"
