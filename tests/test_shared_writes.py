"""State writes of many tasks in shared thread hops and shared transactions (aggregator/harvest/writes.py):
each write keeps its own outcome, its own fence and its own context; what a caller is told was written
was committed; a write waits for others only when asked to."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import random
import sqlite3
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from aggregator.harvest import context
from aggregator.harvest.writes import SharedHops
from aggregator.run.compose import open_context
from aggregator.store.calls import in_thread
from aggregator.store.interface import LeaseLost, StateUnavailable, fenced
from aggregator.store.open import connect
from aggregator.store.state import State
from tests.harvesting import make_config

URL = "http://127.0.0.1:9/capabilitylist.xml"
OK, FAILS, LOSES = "ok", "fails", "loses the transaction"


def hops_of(state: Any, gather: float = 0.0) -> SharedHops:
    return SharedHops(functools.partial(in_thread, limiter=trio.CapacityLimiter(1)), gathering=state,
                      gather=lambda: gather)  # fmt: skip


def write(state: State, i: int, kind: str) -> int:
    """Source ``s{i}`` stored; then, as ``kind`` says, nothing more, an error, or an error after SQLite
    rolled the whole transaction back (as it does on a full disk). One transaction when alone."""
    with state.together():
        state.upsert_source(f"s{i}", URL)
        if kind == FAILS:
            raise ValueError(f"write {i} refused")
        if kind == LOSES:
            with state._write():  # the state's own connection, as a write's statements use it
                state.conn.execute("ROLLBACK")
                raise sqlite3.OperationalError("database or disk is full")
    return i


async def asked_at_once(shared: SharedHops, calls: list) -> list[object]:
    """Each call through ``shared`` from a task of its own, all asked before the first hop ends: what
    each caller got (its result, or its error)."""
    got: list[object] = [None] * len(calls)

    async def one(k: int) -> None:
        try:
            got[k] = await shared.run(calls[k])
        except Exception as exc:
            got[k] = exc

    async with trio.open_nursery() as nursery:
        for k in range(len(calls)):
            nursery.start_soon(one, k)
    return got


@pytest.mark.parametrize("seed", range(12))
async def test_writes_sharing_a_transaction_keep_their_own_outcome(tmp_path: Path, seed: int) -> None:
    """Random writes, some failing, some losing the whole transaction: a write that fails alone is
    undone alone and its caller gets its error; the others are stored. When the transaction is lost,
    nothing of it is stored and every caller of it hears so, none hears "written"."""
    rng = random.Random(seed)
    n = rng.randrange(2, 30)
    kinds = [rng.choice([OK, OK, OK, FAILS]) for _ in range(n)]
    loss = rng.randrange(1, n) if seed % 3 == 0 else None  # the place, in the order run, of a loss
    ran: list[int] = []  # the order the writes ran in (trio starts the tasks in an order of its own)

    def call(state: State, i: int) -> int:
        ran.append(i)
        if len(ran) - 1 == loss:
            kinds[i] = LOSES
        return write(state, i, kinds[i])

    with State(tmp_path / "state.db") as state:
        shared = hops_of(state)
        got = await asked_at_once(shared, [functools.partial(call, state, i) for i in range(n)])
        stored = {s.name for s in state.sources()}
        # The first write asked went alone, at once; the others were asked while it ran: the next hop.
        assert (shared.hops, shared.calls, shared.shared) == (2, n, 1)
        for at, i in enumerate(ran):
            kind, answer = kinds[i], got[i]
            if loss is not None and at > 0 and not (kind == FAILS and at < loss):
                assert isinstance(answer, StateUnavailable), (at, kind, answer)  # not written
                assert f"s{i}" not in stored
                if at <= loss:  # what lost the transaction, named
                    assert "full" in str(answer) and str(tmp_path) in str(answer)
            elif kind == FAILS:
                assert isinstance(answer, ValueError) and f"s{i}" not in stored
            else:
                assert answer == i and f"s{i}" in stored
        state.upsert_source("after", URL)  # the state goes on
        assert "after" in {s.name for s in state.sources()}


def temporary_files() -> list[str]:
    """The temporary files of SQLite this process holds open now (``etilqs_*``, Linux's ``/proc``)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            if "etilqs" in (target := os.readlink(f"/proc/self/fd/{fd}")):
                held.append(target)
    return held


@pytest.mark.parametrize("seed", range(6))
async def test_a_shared_transaction_keeps_its_savepoints_undo_in_memory(tmp_path: Path, seed: int) -> None:
    """Writes of random sizes (up to a few hundred pages each), some failing, share one transaction:
    each is undone alone or kept as before, and no write opens a temporary file for what its savepoint
    would undo (SQLite's sub-journal, which spills to a file past 64 KiB unless kept in memory). Outside
    the shared transaction the state keeps SQLite's default (a large statement spills to disk)."""
    rng = random.Random(seed)
    with State(tmp_path / "state.db") as state:
        with state._write() as c:  # rows on pages of their own, which the writes change
            c.execute("CREATE TABLE pad (id INTEGER PRIMARY KEY, v BLOB NOT NULL)")
            c.executemany("INSERT INTO pad VALUES (?, ?)", [(k, b"-" * 3000) for k in range(600)])
        ids = list(range(600))
        rng.shuffle(ids)
        n = rng.randrange(3, 9)
        cuts = sorted(rng.sample(range(1, 600), n - 1))
        mine = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, 600], strict=True)]  # each write's own rows
        fails = {i for i in range(n) if rng.random() < 0.3}
        seen: list[list[str]] = []

        def mark(i: int) -> bytes:
            return bytes([65 + i]) * 3000

        def change(i: int) -> int:  # one transaction when alone (the first write goes alone)
            with state.together(), state._write() as c:
                c.executemany("UPDATE pad SET v = ? WHERE id = ?", [(mark(i), k) for k in mine[i]])
                seen.append(temporary_files())
                if i in fails:
                    raise ValueError(f"write {i} refused")
            return i

        shared = hops_of(state)
        got = await asked_at_once(shared, [functools.partial(change, i) for i in range(n)])
        assert shared.shared == 1 and len(seen) == n
        assert seen == [[]] * n  # a write changes up to 600 pages of 4 KiB (a row of 3,000 bytes each)
        values = dict(state.conn.execute("SELECT id, v FROM pad"))
        for i in range(n):
            want = b"-" * 3000 if i in fails else mark(i)
            assert all(values[k] == want for k in mine[i]), i
            assert isinstance(got[i], ValueError) if i in fails else got[i] == i
        assert state.conn.execute("PRAGMA temp_store").fetchone()[0] == 0  # the default, outside


@pytest.fixture(
    params=["sqlite, shared transactions", "sqlite", pytest.param("postgresql", marks=pytest.mark.slow)]
)
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path | str, bool]:
    """Where the state is (a SQLite file, or a fresh schema of the test PostgreSQL server, a cluster's)
    and whether a hop's writes share one transaction there (a server state joins none)."""
    if request.param == "postgresql":
        return request.getfixturevalue("pg_server").fresh_url(), False
    return tmp_path / "state.db", request.param.endswith("transactions")


@pytest.mark.parametrize("seed", range(6))
async def test_each_write_is_checked_against_its_own_fence(where: tuple[Path | str, bool], seed: int) -> None:
    """Writes of sources whose leases are current and of sources whose lease went to another node, asked
    at once in any order: whoever leads the hop, a write is refused (LeaseLost) exactly when its own
    fence is stale, in a shared transaction or not."""
    location, gathered = where
    rng = random.Random(seed)
    names = [f"s{i}" for i in range(rng.randrange(3, 12))]
    with connect(location) as state, connect(location) as other:
        for n in names:
            state.upsert_source(n, URL)
        fences = {f.source: f for f in state.claim_leases("A", names, want=len(names), lease_seconds=60)}
        stale = {n for n in names if rng.random() < 0.5}
        for n in stale:  # another node takes them over (released by A's own handle, then claimed)
            assert other.release_lease(fences[n])
        taken = other.claim_leases("B", sorted(stale), want=len(stale), lease_seconds=60)
        assert {f.source for f in taken} == stale

        def status(name: str) -> str:
            state.set_source_status(name, state="ok")
            return name

        async def fenced_write(name: str) -> object:
            with fenced(fences[name]):
                return await shared.run(functools.partial(status, name))

        shared = hops_of(state if gathered else None)
        order = rng.sample(names, len(names))
        got: dict[str, object] = {}

        async def one(name: str) -> None:
            try:
                got[name] = await fenced_write(name)
            except LeaseLost as exc:
                got[name] = exc

        async with trio.open_nursery() as nursery:
            for n in order:
                nursery.start_soon(one, n)
        assert shared.hops == 2  # the first alone; the others in the next hop, whoever leads it
        for n in names:
            if n in stale:
                assert isinstance(got[n], LeaseLost) and n in str(got[n])
            else:
                assert got[n] == n
        written = {s.name for s in state.sources() if s.state == "ok"}
        assert written == set(names) - stale


@pytest.mark.parametrize("gathered", [True, False])
async def test_a_write_runs_in_its_callers_context(tmp_path: Path, gathered: bool) -> None:
    """What a write reads of the context (the source it logs for, its fence) is its caller's, not that of
    the task whose hop took it."""
    who: contextvars.ContextVar[int] = contextvars.ContextVar("who")
    with State(tmp_path / "state.db") as state:
        shared = hops_of(state if gathered else None)

        async def asks(k: int) -> int:
            who.set(k)
            return await shared.run(who.get)

        got: dict[int, int] = {}

        async def one(k: int) -> None:
            got[k] = await asks(k)

        async with trio.open_nursery() as nursery:
            for k in range(10):
                nursery.start_soon(one, k)
        assert got == {k: k for k in range(10)} and shared.hops == 2


@pytest.mark.parametrize("seed", range(8))
def test_the_first_write_waits_for_others_only_when_asked(tmp_path: Path, seed: int) -> None:
    """With a gathering time, writes asked within it after the first go in the first's hop, one
    transaction; without (or where the state joins no writes in one transaction), the first goes at
    once. A first write cancelled while it waits hands the hop to the next: the others run, it does
    not. (trio's MockClock: no real time is waited for.)"""
    rng = random.Random(seed)
    k = rng.randrange(2, 12)
    cancel_first = rng.random() < 0.5
    for gather, gathering in ((0.0, True), (1.0, True), (1.0, False)):
        clock = trio.testing.MockClock(autojump_threshold=0)

        async def main(
            gather: float = gather, gathering: bool = gathering
        ) -> tuple[SharedHops, int, list[int], float | None]:
            with State(tmp_path / f"state-{seed}-{gather}-{gathering}.db") as state:
                shared = hops_of(state if gathering else None, gather)
                ran: list[int] = []
                first_done: list[float] = []

                def call(i: int) -> int:
                    state.upsert_source(f"s{i}", URL)
                    ran.append(i)
                    return i

                commits_before = state._commits
                async with trio.open_nursery() as nursery:
                    first = trio.CancelScope()

                    async def first_write() -> None:
                        with first:
                            await shared.run(functools.partial(call, 0))
                            first_done.append(trio.current_time())

                    nursery.start_soon(first_write)
                    await trio.sleep(0.1)  # within the gathering time
                    if cancel_first and gather and gathering:
                        first.cancel()
                    for i in range(1, k):
                        nursery.start_soon(shared.run, functools.partial(call, i))
                return shared, state._commits - commits_before, ran, (first_done or [None])[0]

        shared, commits, ran, first_at = trio.run(main, clock=clock)
        if gather and gathering:
            assert shared.hops == 1 and commits == 1  # every write in the first's hop and transaction
            assert sorted(ran) == (list(range(1, k)) if cancel_first else list(range(k)))
            assert first_at == (None if cancel_first else gather)
        else:  # no wait asked, or none worth it (no shared transaction: a server state)
            assert ran[0] == 0  # at once, alone: the others were asked after its hop began
            assert sorted(ran) == list(range(k)) and shared.hops >= 2


@pytest.mark.parametrize("seed", range(12))
def test_the_first_write_waits_until_enough_others_wait_or_its_time_is_up(tmp_path: Path, seed: int) -> None:
    """The first write's wait ends when ``enough()`` writes wait (itself included) or after ``gather()``
    seconds, whichever comes first; its hop takes every write asked until then, and the later ones go in
    later hops. ``enough() == 0`` waits the whole time. (trio's MockClock.)"""
    rng = random.Random(seed)
    k = rng.randrange(2, 10)
    enough = rng.choice([0, *range(2, k + 2)])  # k + 1: never reached
    gather = 1.0
    asked_at = [0.0, *sorted(rng.uniform(0.01, 2.0) for _ in range(k - 1))]
    reached = asked_at[enough - 1] if 0 < enough <= k else None
    ends = min(gather, reached) if reached is not None else gather
    expected = sum(1 for t in asked_at if t <= ends)

    async def main() -> list[tuple[float, int]]:
        with State(tmp_path / "state.db") as state:
            hops: list[tuple[float, int]] = []  # (when a hop began, the writes asked before it)
            limiter = trio.CapacityLimiter(1)

            async def hop(fn: Any) -> Any:
                hops.append((trio.current_time(), shared.calls))
                return await in_thread(fn, limiter=limiter)

            shared = SharedHops(hop, gathering=state, gather=lambda: gather, enough=lambda: enough)

            async def one(i: int) -> None:
                await trio.sleep_until(asked_at[i])
                await shared.run(functools.partial(state.upsert_source, f"s{i}", URL))

            async with trio.open_nursery() as nursery:
                for i in range(k):
                    nursery.start_soon(one, i)
            assert len(state.sources()) == k  # every write ran, once
            return hops

    hops = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert hops[0] == (pytest.approx(ends), expected)  # the first hop: when its wait ended, whom it took
    assert all(calls > expected for _, calls in hops[1:])  # the others: later hops


async def test_the_writes_that_end_a_wait_follow_the_syncs_running(tmp_path: Path) -> None:
    """Three quarters of the syncs running, two at least: each sync has a write on its way at most."""
    config = make_config(tmp_path / "store", {})
    async with open_context(config) as ctx:

        def slots(host: str) -> int:
            return 1

        seen = []
        async with AsyncExitStack() as stack:
            for n in range(1, 10):
                await stack.enter_async_context(ctx.admissions.admitted(f"http://h{n}.example/cl.xml", slots))
                seen.append((ctx.admissions.running, ctx._enough()))
        assert seen == [(n, max(2, n * 3 // 4)) for n in range(1, 10)]
        assert ctx._shared_writes()._enough == ctx._enough


async def test_a_write_waits_for_others_only_while_other_syncs_run(tmp_path: Path) -> None:
    """The harvest's gathering time: nothing while one sync runs (or none: a one-shot write), ``GATHER``
    while another runs too, of any host; nothing again once it ended."""
    config = make_config(tmp_path / "store", {})
    async with open_context(config) as ctx:
        assert ctx._gather() == 0

        def slots(host: str) -> int:
            return 1

        async with ctx.admissions.admitted("http://127.0.0.1:9/a/capabilitylist.xml", slots):
            assert ctx._gather() == 0
            async with ctx.admissions.admitted("http://localhost:9/b/capabilitylist.xml", slots):
                assert ctx._gather() == context.GATHER > 0
            assert ctx._gather() == 0
        async with ctx.admissions.admitted("no host", slots), ctx.admissions.admitted("no host", slots):
            assert ctx._gather() == context.GATHER
        assert ctx.admissions.running == 0
        assert ctx._shared_writes()._gathering is ctx.writer  # SQLite: shared transactions
