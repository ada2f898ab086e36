"""Source leases and fencing in the state (store/state.py, cluster.py), in one process: a fake clock
stands in for time, several State connections on one file stand in for the nodes."""

from __future__ import annotations

import random
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import trio

from aggregator.config import parse_config
from aggregator.rs.model import CREATED
from aggregator.run.cluster import Node
from aggregator.store.interface import LeaseLost, fenced
from aggregator.store.open import connect, open_state
from aggregator.store.rows import Change, Cursor, Fence
from aggregator.store.state import State

from .clustering import assert_no_overlap
from .pgserver import PgServer

SHA = "a" * 64
LEASE = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_a_lease_is_granted_once_and_taken_over_only_after_it_expires(tmp_path: Path, clock: Clock) -> None:
    db = tmp_path / "state.db"
    with State(db, clock=clock) as a, State(db, clock=clock) as b:
        (fa,) = a.claim_leases("A", ["s"], want=5, lease_seconds=LEASE)
        assert fa == Fence("s", "A", 1)
        assert b.claim_leases("B", ["s"], want=5, lease_seconds=LEASE) == []  # held
        clock.advance(LEASE * 0.6)
        assert a.renew_leases([fa], lease_seconds=LEASE) == [fa]
        clock.advance(LEASE * 0.6)
        assert b.claim_leases("B", ["s"], want=5, lease_seconds=LEASE) == []  # renewed: still held
        clock.advance(LEASE)  # A stalls past its lease
        (fb,) = b.claim_leases("B", ["s"], want=5, lease_seconds=LEASE)
        assert fb == Fence("s", "B", 2)
        assert a.renew_leases([fa], lease_seconds=LEASE) == []  # too late: lost
        assert a.release_lease(fa) is False  # and it cannot release B's grant
        (lease,) = a.leases()
        assert (lease.node, lease.epoch) == ("B", 2)
        history = a.lease_history("s")
        assert [(g.node, g.epoch, g.end_reason) for g in history] == [("A", 1, "expired"), ("B", 2, None)]
        assert history[0].ended_at == history[0].granted_at + timedelta(seconds=LEASE * 1.6)  # renewed at 0.6
        assert b.release_lease(fb) is True
        (fa2,) = a.claim_leases("A", ["s"], want=1, lease_seconds=LEASE)  # free at once after a release
        assert fa2.epoch == 3
        assert_no_overlap(a.lease_history())


def test_writes_under_a_fence_are_refused_once_the_lease_is_not_current(tmp_path: Path, clock: Clock) -> None:
    """A node paused past its lease (here: its clock stopped while the other's ran on) writes nothing when
    it resumes: not a change, not a cursor, not a status, not a baseline step."""
    db = tmp_path / "state.db"
    with State(db, clock=clock) as a, State(db, clock=clock) as b:
        a.upsert_source("s", "https://up.example/")
        sid = a.ensure_set("s", "https://up.example/cl.xml")
        (fa,) = a.claim_leases("A", ["s"], want=1, lease_seconds=LEASE)
        with fenced(fa):
            a.apply(sid, [Change("https://up.example/1", CREATED, sha256=SHA)], Cursor(list_index=1))
            generation = a.begin_baseline(sid)
        clock.advance(LEASE + 1)
        with fenced(fa), pytest.raises(LeaseLost, match="expired"):  # expired, nobody took it yet
            a.set_source_status("s", state="syncing")
        (fb,) = b.claim_leases("B", ["s"], want=1, lease_seconds=LEASE)
        before = (a.last_seq(), a.cursor(sid), a.source("s"))
        writes = [
            lambda: a.apply(sid, [Change("https://up.example/2", CREATED, sha256=SHA)], Cursor(list_index=2)),
            lambda: a.finish_baseline(sid, generation, Cursor(list_index=3)),
            lambda: a.set_source_status("s", state="error", last_error="stale"),
            lambda: a.upsert_source("s", "https://elsewhere.example/"),
            lambda: a.ensure_set("s", "https://up.example/other.xml"),
            lambda: a.begin_baseline(sid),
            lambda: a.put_document(
                "https://up.example/cl.xml", "s", None, etag="x", last_modified=None, sha256=None
            ),
            lambda: a.put_upstream_notes("s", [], {}),
            lambda: a.end_retries(sid, ["https://up.example/1"], "gone"),
        ]
        for write in writes:
            with fenced(fa), pytest.raises(LeaseLost, match="epoch 2 held by B"):
                write()
        assert (a.last_seq(), a.cursor(sid), a.source("s")) == before
        assert len(a.sets("s")) == 1
        with fenced(fb):  # the new holder writes
            b.apply(sid, [Change("https://up.example/2", CREATED, sha256=SHA)], Cursor(list_index=2))
        assert a.last_seq() == before[0] + 1


def test_concurrent_claimers_never_share_a_source(tmp_path: Path, clock: Clock) -> None:
    """Three connections claiming the same 30 sources at the same instant (threads): each granted once;
    then a random run of renewals, stalls, releases and takeovers keeps the history free of overlaps."""
    db = tmp_path / "state.db"
    State(db, clock=clock).close()
    names = [f"s{i:02d}" for i in range(30)]
    states = [State(db, clock=clock) for _ in range(3)]
    got: dict[str, list[Fence]] = {}
    barrier = threading.Barrier(3)

    def claim(i: int) -> None:
        barrier.wait()
        got[f"N{i}"] = states[i].claim_leases(f"N{i}", names, want=30, lease_seconds=LEASE)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    granted = [f.source for fences in got.values() for f in fences]
    assert sorted(granted) == names  # every source once, whoever won
    rng = random.Random(15)
    held = {f"N{i}": {f.source: f for f in got[f"N{i}"]} for i in range(3)}
    for _ in range(300):
        i = rng.randrange(3)
        node, st = f"N{i}", states[i]
        clock.advance(rng.uniform(0, LEASE / 2))
        action = rng.random()
        if action < 0.4:
            kept = st.renew_leases(list(held[node].values()), lease_seconds=LEASE)
            held[node] = {f.source: f for f in kept}
        elif action < 0.8:
            for f in st.claim_leases(node, names, want=rng.randrange(1, 6), lease_seconds=LEASE):
                held[node][f.source] = f
        elif held[node]:
            f = held[node].pop(rng.choice(sorted(held[node])))
            st.release_lease(f)
        # What each node believes it holds and can write under is never held by two nodes at once.
        current = {(lease.source, lease.node, lease.epoch) for lease in st.leases() if lease.node}
        for n, fences in held.items():
            for f in fences.values():
                if (f.source, n, f.epoch) not in current:
                    with fenced(f), pytest.raises(LeaseLost):
                        st.set_source_status(f.source, state="x")  # (unknown source: never reached)
    history = states[0].lease_history()
    assert_no_overlap(history)
    assert len(history) > 60  # the run did move leases around
    for st in states:
        st.close()


async def test_nodes_balance_their_leases(tmp_path: Path) -> None:
    """A node alone takes every source; a second one arriving gets half once the first releases them."""
    toml = {
        "store": {"path": str(tmp_path / "data")},
        "cluster": {"enabled": True, "lease_seconds": 30.0},
        "sources": [{"name": f"s{i}", "url": f"https://h{i % 2}.example/"} for i in range(6)],
    }
    running: dict[str, dict[str, Fence]] = {"A": {}, "B": {}}

    def make(name: str) -> Node:
        config = parse_config(
            {**toml, "cluster": {**toml["cluster"], "node": name}}, str(tmp_path / "c.toml")
        )
        (tmp_path / "data").mkdir(exist_ok=True)

        def stop(source: str) -> trio.Event:
            running[name].pop(source, None)
            done = trio.Event()
            done.set()
            return done

        return Node(
            lambda: config, state=open_state(config, cache_mib=1), stop=stop,
            start=lambda src, f: running[name].__setitem__(src.name, f), metrics=None, fetcher=None, roles={},
        )  # fmt: skip

    a, b = make("A"), make("B")
    async with trio.open_nursery() as nursery:
        a._nursery = b._nursery = nursery
        await a.beat()
        assert sorted(running["A"]) == [f"s{i}" for i in range(6)]
        await b.beat()  # sees two nodes, nothing free yet
        assert running["B"] == {}
        await a.beat()  # sees two nodes: keeps its share, releases the rest
        assert len(running["A"]) == 3
        with trio.fail_after(60):  # the releases commit in worker threads: wait for them, not for the loop
            while a._stopping:
                await trio.sleep(0.01)
        await b.beat()
        assert len(running["B"]) == 3 and not set(running["A"]) & set(running["B"])
    assert {f.epoch for f in running["B"].values()} == {2}
    a.state.close()
    b.state.close()


def test_postgres_claims_skip_locked_and_fences_every_write(pg_server: PgServer) -> None:
    """The same rules on PostgreSQL (store/postgres.py): concurrent claimers (threads, one pool each)
    never get the same source; a grant taken over after expiry (the server's clock) fences the old one."""
    url = pg_server.fresh_url()
    names = [f"s{i:02d}" for i in range(30)]
    states = [connect(url) for _ in range(3)]
    try:
        got: dict[int, list[Fence]] = {}
        barrier = threading.Barrier(3)

        def claim(i: int) -> None:
            barrier.wait()
            got[i] = states[i].claim_leases(f"N{i}", names, want=30, lease_seconds=LEASE)

        threads = [threading.Thread(target=claim, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(f.source for fences in got.values() for f in fences) == names
        a, b = states[0], states[1]
        a.upsert_source("x", "https://up.example/")
        sid = a.ensure_set("x", "https://up.example/cl.xml")
        (fa,) = a.claim_leases("A", ["x"], want=1, lease_seconds=1.0)
        with fenced(fa):
            a.apply(sid, [Change("https://up.example/1", CREATED, sha256=SHA)], Cursor(list_index=1))
        assert b.claim_leases("B", ["x"], want=1, lease_seconds=LEASE) == []
        time.sleep(1.2)  # past A's lease by the server's clock
        (fb,) = b.claim_leases("B", ["x"], want=1, lease_seconds=LEASE)
        assert fb.epoch == fa.epoch + 1
        before = (a.last_seq(), a.cursor(sid))
        for write in (
            lambda: a.apply(sid, [Change("https://up.example/2", CREATED, sha256=SHA)], Cursor(list_index=2)),
            lambda: a.set_source_status("x", state="error"),
            lambda: a.begin_baseline(sid),
        ):
            with fenced(fa), pytest.raises(LeaseLost, match="held by B"):
                write()
        assert (a.last_seq(), a.cursor(sid)) == before
        assert a.renew_leases([fa], lease_seconds=LEASE) == []
        assert_no_overlap(a.lease_history())
    finally:
        for st in states:
            st.close()
