"""A state call that waits on the PostgreSQL server waits in a worker thread: the event loop (every other
download and request) keeps running. The server is stalled by a lock another session holds (as a busy
or unreachable server would), and a heartbeat task measures the longest the loop went without running."""

from __future__ import annotations

import threading
import time

import psycopg
import trio

from aggregator.publish.fastpath import Hot, HotCache
from aggregator.store.calls import limiter_of, state_call
from aggregator.store.open import connect
from aggregator.store.state import State

from .pgserver import PgServer

STALL = 2.0  # seconds the server is held


async def test_calls_waiting_on_a_stalled_server_leave_the_event_loop_running(pg_server: PgServer) -> None:
    url = pg_server.fresh_url()
    connect(url).close()  # creates the tables
    reader = connect(url, readonly=True)
    cache = HotCache(lambda: connect(url, readonly=True), remote_age=0)
    assert limiter_of(reader) is not None
    assert await cache.fresh()  # opens its reader, reads the version once
    blocker = psycopg.connect(url)  # a transaction holding the locks both reads need
    blocker.execute("LOCK TABLE sources IN ACCESS EXCLUSIVE MODE")
    blocker.execute("ALTER SEQUENCE state_version RENAME TO held")  # a sequence's exclusive lock
    release: threading.Timer | None = None
    gaps: list[float] = []
    done: list[str] = []
    try:
        async with trio.open_nursery() as nursery:

            async def heartbeat() -> None:
                last = time.monotonic()
                while True:
                    await trio.sleep(0.01)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            async def version() -> None:
                assert await cache.fresh()
                done.append("version")

            async def sources() -> None:
                assert await state_call(reader, reader.sources) == []
                done.append("sources")

            # released from another thread: a call blocking the event loop would still end (and fail)
            release = threading.Timer(STALL, blocker.rollback)
            release.start()
            nursery.start_soon(heartbeat)
            nursery.start_soon(version)
            nursery.start_soon(sources)
            await trio.sleep(STALL / 2)
            assert done == []  # both really wait on the server ...
            with trio.fail_after(60):  # ... and finish once it answers
                while len(done) < 2:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    finally:
        if release is not None:
            release.join()
        blocker.close()
        cache.close()
        reader.close()
    assert sorted(done) == ["sources", "version"]
    assert len(gaps) > 10 and max(gaps) < STALL / 2, max(gaps)


async def test_sqlite_calls_are_direct(tmp_path) -> None:
    """SQLite's reads are local microseconds: no limiter, no thread hop (store/calls.py)."""
    st = State(tmp_path / "state.db")
    try:
        assert limiter_of(st) is None
        assert await state_call(st, st.sources) == []
    finally:
        st.close()


async def test_hot_cache_on_postgresql_drops_its_answers_once_the_version_is_read_again(
    pg_server: PgServer,
) -> None:
    """A server backend's version is read again once ``remote_age`` has passed: a commit of another
    handle (another node) then drops the cached answers; within ``remote_age`` the last version stands."""
    url = pg_server.fresh_url()
    writer = connect(url)
    cache = HotCache(lambda: connect(url, readonly=True), remote_age=3600)
    try:
        assert await cache.fresh()
        cache.put(b"/s/r/x", Hot(404, None))
        writer.upsert_source("up", "http://up.example/")
        assert await cache.fresh() and cache.get(b"/s/r/x") is not None  # within remote_age: kept
        cache.remote_age = 0
        assert await cache.fresh() and cache.get(b"/s/r/x") is None  # read again: the commit shows
    finally:
        cache.close()
        writer.close()
