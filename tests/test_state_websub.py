"""The WebSub, dump and retry tables behind the state seam (store/state.py migrations 5-8): typed
methods, one version counter, and stores made by the previous release upgrading in place."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from aggregator.rs.model import Entry, Md
from aggregator.store.interface import LeaseLost, fenced
from aggregator.store.open import connect
from aggregator.store.rows import (
    Change,
    Cursor,
    DumpPart,
    FailedChange,
    HubVerification,
    NotifyChannel,
    NotifySubscription,
    RetryChanges,
)
from aggregator.store.state import MIGRATIONS, State

A, B, C, D = "a" * 64, "b" * 64, "c" * 64, "d" * 64
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)

# What the previous release ran itself, on connections of its own, next to a schema-5 state
# (websub/hub.py, websub/notifier.py, websub/subscriber.py as released).
OLD_HUB_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS hub_subscriptions (
        id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: in-flight jobs name rows by id
        topic TEXT NOT NULL,
        callback TEXT NOT NULL,
        secret TEXT,                            -- hub.secret as given (needed to sign); NULL = none
        lease_seconds INTEGER NOT NULL,         -- as granted
        lease_expires TEXT NOT NULL,            -- fixed-width W3C UTC (store.state.format_dt)
        created TEXT NOT NULL,
        verified TEXT NOT NULL,                 -- last successful verification (renewals move it)
        UNIQUE (topic, callback)
    )""",
    "CREATE INDEX IF NOT EXISTS hub_subscriptions_expires ON hub_subscriptions(lease_expires)",
    """CREATE TABLE IF NOT EXISTS hub_verifications (
        id INTEGER PRIMARY KEY AUTOINCREMENT,   -- a newer request for the pair replaces the row
        mode TEXT NOT NULL CHECK (mode IN ('subscribe', 'unsubscribe', 'denied')),
        topic TEXT NOT NULL,
        callback TEXT NOT NULL,
        secret TEXT,
        lease_seconds INTEGER,                  -- granted (clamped) lease for subscribe
        reason TEXT,                            -- hub.reason for denied
        requested TEXT NOT NULL,
        UNIQUE (topic, callback)
    )""",
    """CREATE TABLE IF NOT EXISTS hub_payloads (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        topic TEXT NOT NULL,
        body BLOB NOT NULL,
        content_type TEXT NOT NULL,
        link TEXT NOT NULL,                     -- the Link header sent with every delivery of it
        created TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS hub_deliveries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,   -- order of publication per subscription
        subscription_id INTEGER NOT NULL REFERENCES hub_subscriptions(id) ON DELETE CASCADE,
        payload_id INTEGER NOT NULL REFERENCES hub_payloads(id),
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt TEXT NOT NULL,             -- fixed-width W3C UTC
        last_error TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS hub_deliveries_subscription ON hub_deliveries(subscription_id, id)",
    "CREATE INDEX IF NOT EXISTS hub_deliveries_payload ON hub_deliveries(payload_id)",
)

OLD_NOTIFIER_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS notify_channels (
        topic TEXT PRIMARY KEY,
        set_name TEXT NOT NULL,
        kind TEXT NOT NULL,            -- change-notification | framework-notification
        last_seq INTEGER NOT NULL,     -- changelog seq published up to (change channels)
        last_until TEXT,               -- until of the latest payload: the next one's from
        body BLOB,                     -- the latest payload (the topic document)
        snapshot TEXT,                 -- framework channels: JSON {url: [capability, version, index]}
        updated TEXT NOT NULL
    )""",
)

OLD_SUBSCRIBER_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS notify_subscriptions (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        token TEXT NOT NULL UNIQUE,        -- callback path segment: BASE/_websub/<token>
        secret TEXT NOT NULL,              -- hub.secret (needed to check signatures)
        source TEXT NOT NULL,
        capabilitylist_url TEXT NOT NULL,
        kind TEXT NOT NULL,                -- change-notification | framework-notification
        topic TEXT NOT NULL,
        hub TEXT NOT NULL,
        wanted INTEGER NOT NULL DEFAULT 1, -- 0: being unsubscribed
        pending TEXT,                      -- subscribe | unsubscribe, awaiting verification
        requested TEXT,
        lease_seconds INTEGER,
        lease_expires TEXT,
        verified TEXT,
        last_until TEXT,                   -- continuity of change notifications
        failures INTEGER NOT NULL DEFAULT 0,
        next_attempt TEXT
    )""",
)


def _old_store(path: Path) -> None:
    """A state.db as the previous release left it: migrations 1-5, then the WebSub modules' own tables
    with a subscription, a pending delivery, a channel and an upstream subscription in them."""
    conn = sqlite3.connect(path)
    for step in MIGRATIONS[:5]:
        for statement in step:
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 5")
    conn.execute("PRAGMA foreign_keys = ON")
    for statement in OLD_HUB_SCHEMA + OLD_NOTIFIER_SCHEMA + OLD_SUBSCRIBER_SCHEMA:
        conn.execute(statement)
    conn.execute(
        "INSERT INTO hub_subscriptions (topic, callback, secret, lease_seconds, lease_expires, created, "
        "verified) VALUES ('https://agg/t', 'https://cb/1', 's3cret', 60, '2026-01-01T12:01:00.000000Z', "
        "'2026-01-01T12:00:00.000000Z', '2026-01-01T12:00:00.000000Z')"
    )
    conn.execute(
        "INSERT INTO hub_payloads (topic, body, content_type, link, created) "
        "VALUES ('https://agg/t', x'3c612f3e', 'application/xml', '<h>; rel=\"hub\"', "
        "'2026-01-01T12:00:00.000000Z')"
    )
    conn.execute(
        "INSERT INTO hub_deliveries (subscription_id, payload_id, next_attempt) "
        "VALUES (1, 1, '2026-01-01T12:00:00.000000Z')"
    )
    conn.execute(
        "INSERT INTO notify_channels (topic, set_name, kind, last_seq, last_until, body, snapshot, updated) "
        "VALUES ('https://agg/s/change-notification.xml', 's', 'change-notification', 7, "
        "'2026-01-01T12:00:00.000000Z', x'3c612f3e', NULL, '2026-01-01T12:00:00.000000Z')"
    )
    conn.execute(
        "INSERT INTO notify_subscriptions (token, secret, source, capabilitylist_url, kind, topic, hub, "
        "wanted, lease_seconds, lease_expires) VALUES ('tok', 'sec', 'src', 'https://up/cl.xml', "
        "'change-notification', 'https://up/t', 'https://up/hub', 1, 600, '2026-01-01T12:10:00.000000Z')"
    )
    conn.commit()
    conn.close()


def test_a_store_of_the_previous_release_upgrades_in_place(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    _old_store(path)
    with State(path) as st:
        assert st.schema_version == len(MIGRATIONS) >= 8
        (sub,) = st.hub_subscriptions()
        assert (sub.topic, sub.callback, sub.secret, sub.lease_expires) == (
            "https://agg/t", "https://cb/1", "s3cret", T0 + timedelta(minutes=1),
        )  # fmt: skip
        assert st.hub_backlog().deliveries == 1
        (d,) = st.hub_due_deliveries(T0, [], 10)
        assert (d.subscription_id, d.body, d.callback, d.secret) == (
            sub.id,
            b"<a/>",
            "https://cb/1",
            "s3cret",
        )
        (ch,) = st.notify_channels()
        assert (ch.set_name, ch.last_seq, ch.last_until, ch.body, ch.snapshot) == ("s", 7, T0, b"<a/>", {})
        (ns,) = st.notify_subscriptions()
        assert (ns.token, ns.wanted, ns.lease_seconds) == ("tok", True, 600)
        assert ns.lease_expires == T0 + timedelta(minutes=10) and ns.pending is None
    with State(path, readonly=True) as ro:  # a reader accepts the upgraded store
        assert [s.callback for s in ro.hub_subscriptions("https://agg/t")] == ["https://cb/1"]


def test_a_fresh_store_has_the_same_tables_as_an_upgraded_one(tmp_path: Path) -> None:
    _old_store(tmp_path / "old.db")
    State(tmp_path / "old.db").close()
    State(tmp_path / "new.db").close()

    def schema(p: Path) -> set[tuple[str, str]]:
        with sqlite3.connect(p) as c:
            return set(c.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))

    assert schema(tmp_path / "old.db") == schema(tmp_path / "new.db")


@pytest.fixture
def location(tmp_path: Path) -> Path | str:
    """Where the state under test lives (tests/test_state_postgres.py runs these tests on PostgreSQL)."""
    return tmp_path / "state.db"


@pytest.fixture
def count_rows(location: Path | str) -> Callable[[str], int]:
    """Rows of one table of the state, read behind the store's back."""

    def count(table: str) -> int:
        with sqlite3.connect(location) as c:
            return c.execute(f"SELECT count(*) FROM {table}").fetchone()[0]

    return count


@pytest.fixture
def st(location: Path | str):
    with connect(location) as s:
        yield s


def test_hub_verification_subscription_delivery_round(st: State, count_rows: Callable[[str], int]) -> None:
    req = HubVerification(0, "subscribe", "https://agg/t", "https://cb/1", "s", 60, None)
    before = st.hub_request_state("https://agg/t", "https://cb/1")
    assert (before.waiting, before.pending, before.subscribed) == (0, False, False)
    first = st.hub_queue_verification(req, T0)
    state = st.hub_request_state("https://agg/t", "https://cb/1")
    assert (state.waiting, state.pending, state.subscribed) == (1, True, False)
    assert st.hub_subscriber_callbacks() == ["https://cb/1"]
    second = st.hub_queue_verification(req, T0)  # a newer request replaces the waiting one
    assert second > first and [v.id for v in st.hub_due_verifications([], 10)] == [second]
    assert st.hub_due_verifications([second], 10) == []
    stale = HubVerification(first, *[getattr(req, f) for f in ("mode", "topic", "callback", "secret",
                                                               "lease_seconds", "reason")])  # fmt: skip
    assert not st.hub_finish_verification(stale, True, T0 + timedelta(minutes=1), T0)
    (v,) = st.hub_due_verifications([], 10)
    assert st.hub_finish_verification(v, True, T0 + timedelta(minutes=1), T0)
    (sub,) = st.hub_subscriptions()
    assert (sub.lease_seconds, sub.verified, st.hub_next_lease_end()) == (60, T0, T0 + timedelta(minutes=1))
    assert st.hub_queue_payload("https://agg/other", b"x", "application/xml", "", T0, 5) == (0, 0)
    for i in range(3):
        assert st.hub_queue_payload("https://agg/t", b"%d" % i, "application/xml", "", T0, 2) == (
            1,
            int(i == 2),
        )
    assert st.hub_backlog().deliveries == 2
    (d,) = st.hub_due_deliveries(T0, [], 10)
    assert d.body == b"1" and st.hub_due_deliveries(T0, [sub.id], 10) == []  # in order, the oldest kept
    assert st.hub_finish_delivery(d, "retry", T0 + timedelta(seconds=5), "status 500") == "retry"
    assert (
        st.hub_next_delivery_due([]) == T0 + timedelta(seconds=5) and st.hub_due_deliveries(T0, [], 9) == []
    )
    (d,) = st.hub_due_deliveries(T0 + timedelta(seconds=5), [], 10)
    assert d.attempts == 1
    assert st.hub_finish_delivery(d, "retry", T0 + timedelta(minutes=2), "x") == "failed"  # past the lease
    (d,) = st.hub_due_deliveries(T0, [], 10)
    assert st.hub_finish_delivery(d, "ok", T0, "") == "ok" and st.hub_backlog().deliveries == 0
    assert st.hub_expire(T0) == 0 and st.hub_expire(T0 + timedelta(minutes=1)) == 1
    assert st.hub_subscriptions() == [] and st.hub_next_lease_end() is None
    assert count_rows("hub_payloads") == 0  # every payload went with its deliveries


def test_notify_channels_and_subscriptions(st: State) -> None:
    ch = NotifyChannel(
        "https://agg/s/fw.xml", "s", "framework-notification", 0, T0, b"<x/>", {"u": ["c", "1", None]}
    )
    st.put_notify_channels([ch])
    assert st.notify_channels() == [ch]
    st.put_notify_channels([], ["https://agg/s/fw.xml"])
    assert st.notify_channels() == []
    sub = NotifySubscription(0, "tok", "sec", "src", "https://up/cl.xml", "change-notification", "https://up/t",
                             "https://up/hub", pending="subscribe", requested=T0)  # fmt: skip
    sub.id = st.add_notify_subscription(sub)
    assert sub.id > 0 and st.notify_subscriptions() == [sub]
    sub.wanted, sub.lease_expires, sub.failures = False, T0, 2
    st.put_notify_subscriptions([sub])
    assert st.notify_subscriptions() == [sub]
    st.delete_notify_subscription(sub.id)
    assert st.notify_subscriptions() == []


def test_the_shared_inbox_is_bounded_deduplicated_and_fenced_for_the_holder(st: State) -> None:
    """Any node records (never fenced: it need not hold the source); the holder takes and deletes under
    its fence, which a node that lost the lease cannot do."""
    assert st.add_notify_notice("src", "tok", b"<a/>", limit=2) == "added"
    assert st.add_notify_notice("src", "tok", b"<a/>", limit=2) == "duplicate"  # a hub's retry
    assert st.add_notify_notice("other", "tok2", b"<a/>", limit=2) == "added"
    assert st.add_notify_notice("src", "tok", b"<b/>", limit=2) == "added"
    assert st.add_notify_notice("src", "tok", b"<c/>", limit=2) == "full"
    assert st.add_notify_notice("src", "tok", b"<d/>", limit=2) == "full"  # one poll request only
    waiting = st.notify_notices("src")
    assert [(n.token, n.body) for n in waiting] == [("tok", b"<a/>"), ("tok", b"<b/>"), ("", b"")]
    (fence,) = st.claim_leases("n1", ["src"], want=1, lease_seconds=60)
    assert st.release_lease(fence)
    (newer,) = st.claim_leases("n2", ["src"], want=1, lease_seconds=60)
    with fenced(fence), pytest.raises(LeaseLost):
        st.delete_notify_notices([n.id for n in waiting])
    with fenced(fence):  # recording stays open to every node
        assert st.add_notify_notice("src", "tok", b"<e/>", limit=5) == "added"
    with fenced(newer):
        st.delete_notify_notices([n.id for n in waiting])
    assert [n.body for n in st.notify_notices("src")] == [b"<e/>"]
    assert [n.body for n in st.notify_notices("other")] == [b"<a/>"]


def test_dump_runs_and_packages(st: State) -> None:
    part = DumpPart(A, 10, B, 5, 3, 30, at=T0, completed=T0)
    assert st.dump_latest_run("s") is None and list(st.dump_hashes()) == []
    (p1,) = st.add_resource_dump("s", [2, 1], 9, T0, T0, [part], T0)
    run = st.dump_latest_run("s")
    assert run is not None and (run.set_ids, run.last_seq, run.entries, run.bytes) == ((2, 1), 9, 3, 30)
    assert st.dump_run_packages(run.id) == [p1] and st.dump_package("s", "resourcedump", p1.id) == p1
    st.add_resource_dump("s", [1], 10, T0, T0, [DumpPart(C, 1, C, 1, 1, 1)], T0)
    assert st.prune_resource_dumps("s", 1) == {A, B} and st.dump_package("s", "resourcedump", p1.id) is None
    assert not st.has_change_dump("s")
    cd = st.add_change_dump("s", 3, 20, 30, DumpPart(A, 1, B, 1, 1, 1, from_=T0, until=T0), T0)
    assert (cd.window, cd.first_seq, cd.last_seq, cd.until) == (3, 20, 30, T0)
    assert st.has_change_dump("s") and st.change_dump_packages("s") == [cd] == [
        st.dump_package("s", "changedump", 3)
    ]
    assert list(st.dump_hashes()) == [A, B, C]
    with pytest.raises(ValueError):
        st.dump_package("s", "resourcelist", 1)
    for number in (-1, 2**63, 10**30):  # no row has it, and it never reaches SQL (OverflowError)
        assert st.dump_package("s", "resourcedump", number) is None
        assert st.dump_package("s", "changedump", number) is None


def test_dumps_of_another_fingerprint_are_never_read_and_are_withdrawn(st: State) -> None:
    """Every read asks for one fingerprint (the publish filter and configuration the dump was built
    under); ``withdraw_dumps`` deletes every other one (NULL included) and names their blobs."""
    (old,) = st.add_resource_dump("s", [1], 9, T0, T0, [DumpPart(A, 1, B, 1, 1, 1)], T0, "f1")
    st.add_change_dump("s", 1, 0, 2, DumpPart(C, 1, C, 1, 1, 1, from_=T0, until=T0), T0, "f1")
    for fp in ("f2", ""):
        assert st.dump_latest_run("s", fp) is None and not st.has_change_dump("s", fp)
        assert (
            st.change_dump_packages("s", fp) == []
            and st.dump_package("s", "resourcedump", old.id, fp) is None
        )
        assert st.dump_package("s", "changedump", 1, fp) is None
    assert st.dump_latest_run("s", "f1") is not None and st.dump_package("s", "changedump", 1, "f1")
    assert st.withdraw_dumps("f1") == set()
    (new,) = st.add_resource_dump("s", [1], 9, T0, T0, [DumpPart(D, 1, D, 1, 1, 1)], T0, "f2")
    assert st.withdraw_dumps("f2") == {A, B, C}
    assert st.dump_latest_run("s", "f1") is None and st.dump_package("s", "changedump", 1, "f1") is None
    assert st.dump_package("s", "resourcedump", new.id, "f2") == new and list(st.dump_hashes()) == [D]
    # the window can be built again under the new fingerprint (one package per window)
    again = st.add_change_dump("s", 1, 0, 2, DumpPart(C, 1, C, 1, 1, 1, from_=T0, until=T0), T0, "f2")
    assert st.change_dump_packages("s", "f2") == [again]


def test_retries_are_written_with_the_batch_as_data(st: State) -> None:
    st.upsert_source("src", "https://up/sd.xml")
    sid = st.ensure_set("src", "https://up/cl.xml")
    e = Entry("https://up/a", md=Md(hash=f"sha-256:{A}"))
    st.apply(sid, [], retries=RetryChanges([FailedChange(e, "created", "hash_mismatch", "bad")]))
    st.apply(sid, [], retries=RetryChanges([FailedChange(e, "updated", "http_status", "500")]))
    ((entry, change, attempts),) = st.pending_retries(sid)
    assert (entry.loc, change, attempts) == ("https://up/a", "updated", 2)
    assert st.retry_rows()[0]["kind"] == "http_status"
    st.apply(sid, [Change("https://up/a", "created", A, 1)], retries=RetryChanges(cleared=["https://up/a"]))
    assert st.retry_uris(sid) == set()
    gen = st.begin_baseline(sid)
    # The baseline sees a resource (one that saw none while the set holds some sweeps nothing: it is
    # refused with EmptySnapshot), and its failed changes are written with it.
    st.apply(sid, [Change("https://up/b", "created", A, 1, generation=gen)])
    st.finish_baseline(sid, gen, Cursor(), RetryChanges([FailedChange(e, "created", "k", "m")]))
    assert st.retry_uris(sid) == {"https://up/a"}


def test_version_grows_with_every_commit_from_anyone(location: Path | str) -> None:
    with connect(location) as writer, connect(location, readonly=True) as reader:
        w0, r0 = writer.version(), reader.version()
        assert writer.version() == w0 and reader.version() == r0  # nothing committed: unchanged
        writer.upsert_source("src", "https://up/sd.xml")
        w1, r1 = writer.version(), reader.version()
        assert w1 != w0 and r1 != r0  # the writer's own commit and another connection's
        assert writer.version() == w1 and reader.version() == r1
