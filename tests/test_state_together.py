"""``State.together``: the writes of one thread inside are one transaction, all or none."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from aggregator.store.interface import StateUnavailable
from aggregator.store.state import State


def rows(state: State) -> list[tuple]:
    return [(s.name, s.url, s.state, s.last_error) for s in state.sources()] + [
        (s.source, s.capabilitylist_url) for s in state.sets()
    ]


class Boom(Exception):
    pass


@pytest.mark.parametrize("seed", range(12))
def test_writes_together_are_all_or_none(tmp_path: Path, seed: int) -> None:
    """Generated: writes of several kinds inside ``together`` (some nested), one of them failing or
    none. Without a failure the state holds what the same writes alone give it, in one commit; with
    one, it holds what it held before."""
    rng = random.Random(seed)
    steps = []
    for _ in range(rng.randrange(1, 12)):
        name = rng.choice(["a", "b", "c"])
        steps.append(rng.choice([("source", name), ("status", name, rng.choice(["ok", "error", None])),
                                 ("set", name), ("nested", name)]))  # fmt: skip
    fail_at = rng.randrange(len(steps)) if rng.random() < 0.5 else None

    def run(state: State, grouped: bool) -> None:
        for name in "abc":
            state.upsert_source(name, f"http://x/{name}")
        for i, step in enumerate(steps):
            if grouped and i == fail_at:
                raise Boom()
            kind, name = step[0], step[1]
            if kind in ("source", "nested"):
                state.upsert_source(name, f"http://x/{name}")
            if kind == "nested":
                with state.together():
                    state.set_source_status(name, last_error="nested")
            elif kind == "status":
                state.set_source_status(name, state=step[2])
            elif kind == "set":
                state.upsert_source(name, f"http://x/{name}")
                state.ensure_set(name, f"http://x/{name}/capabilitylist.xml")

    alone = State(tmp_path / "alone.db")
    run(alone, grouped=False)
    grouped = State(tmp_path / "grouped.db")
    before, commits = rows(grouped), grouped._commits
    try:
        with grouped.together():
            run(grouped, grouped=True)
    except Boom:
        assert fail_at is not None
        assert rows(grouped) == before and grouped._commits == commits  # none of them
    else:
        assert fail_at is None
        assert rows(grouped) == rows(alone) and grouped._commits == commits + 1  # all, in one commit


def test_another_thread_does_not_join(tmp_path: Path) -> None:
    """A write of another thread waits for the transaction instead of joining it."""
    state = State(tmp_path / "s.db")
    state.upsert_source("a", "http://x/a")
    seen: list[str | None] = []
    with state.together():
        state.set_source_status("a", state="ok")
        t = threading.Thread(target=lambda: seen.append(state.source("a").state))  # reads wait too
        writer = threading.Thread(target=lambda: state.set_source_status("a", state="error"))
        writer.start()
        writer.join(0.2)
        assert writer.is_alive()  # it waits for the lock the transaction holds
    writer.join(5)
    t.start()
    t.join(5)
    assert seen == ["error"]


def test_a_transaction_sqlite_ended_is_not_continued_in_autocommit(tmp_path: Path) -> None:
    state = State(tmp_path / "s.db")
    state.upsert_source("a", "http://x/a")
    with pytest.raises(StateUnavailable, match="transaction is gone"):
        with state.together():
            state.conn.execute("ROLLBACK")  # as SQLite does after some errors (a full disk)
            state.set_source_status("a", state="ok")
    assert state.source("a").state is None
