"""Changes whose fetch failed, kept to be tried again (a hash mismatch, a 5xx that outlasted retries).

The cursor of incremental sync moves past a failed change (the stream must go on), so without this list
the resource would stay stale until it changed upstream again. Each failed change is kept with its
entry (as a one-entry ResourceSync document, written and read back by ``rs/``; table ``retries``,
schema migration 2 of store/state.py), retried through the one
pipeline at the start of the set's next sync, and dropped when a change of the same URI is applied.

A retry also ends when the upstream no longer lists its URI (harvest/source.py checks the set's current
lists when a retry fails again): the row stays, marked ``kind = "ended"`` with the reason, so that
``rsagg status`` and ``rsagg retries`` show what was given up, until ``rsagg retries --clear``. An ended
retry is not tried again; a new change of its URI replaces it like any other.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

from ..rs.model import Entry, Head
from ..rs.parse import parse_bytes
from ..rs.write import iter_document_bytes
from .state import State, format_dt


def update(
    conn: sqlite3.Connection,
    now: str,
    set_id: int,
    failed: Iterable[tuple[Entry, str, str, str]],
    cleared: Iterable[str],
) -> None:
    """Inside the transaction that applies a batch (``State.apply(..., also=...)``): remember the
    changes that failed — (entry, change, kind, message), a repeat counts an attempt — and forget the
    URIs whose change applied. One transaction with the cursor: a crash can neither leave a retry of a
    change already superseded nor lose a failure the cursor has moved past."""
    rows = [
        (set_id, e.loc, change, b"".join(iter_document_bytes(Head(), [e])), kind, message, now, now)
        for e, change, kind, message in failed
    ]
    conn.executemany(
        "INSERT INTO retries (set_id, uri, change, entry, kind, message, first_at, last_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (set_id, uri) DO UPDATE SET "
        "change = excluded.change, entry = excluded.entry, kind = excluded.kind, "
        "message = excluded.message, attempts = retries.attempts + 1, last_at = excluded.last_at",
        rows,
    )
    conn.executemany("DELETE FROM retries WHERE set_id = ? AND uri = ?", [(set_id, u) for u in cleared])


#: ``kind`` of a retry that ended (its URI is no longer listed upstream): kept to be seen, not tried.
ENDED = "ended"


def pending(state: State, set_id: int) -> list[tuple[Entry, str, int]]:
    """(entry, change, attempts) of every failed change of a set still to be tried, oldest first."""
    rows = state.conn.execute(
        "SELECT entry, change, attempts FROM retries WHERE set_id = ? AND kind != ? ORDER BY first_at",
        (set_id, ENDED),
    ).fetchall()
    out = []
    for data, change, attempts in rows:
        _, entries = parse_bytes(bytes(data))
        out.extend((e, change, attempts) for e in entries)
    return out


def uris(state: State, set_id: int) -> set[str]:
    """Every URI of a set with a retry row, ended ones included (an applied change clears either)."""
    rows = state.conn.execute("SELECT uri FROM retries WHERE set_id = ?", (set_id,)).fetchall()
    return {r[0] for r in rows}


def end(state: State, set_id: int, ended: Iterable[str], reason: str) -> None:
    """Mark retries as ended (``reason`` first, the last failure kept after it); they stay to be seen."""
    now = format_dt(state._now())
    with state._write() as conn:
        conn.executemany(
            "UPDATE retries SET message = ? || ' (last failure: ' || kind || ': ' || message || ')', "
            "kind = ?, last_at = ? WHERE set_id = ? AND uri = ? AND kind != ?",
            [(reason, ENDED, now, set_id, uri, ENDED) for uri in ended],
        )


def rows(state: State, sources: Iterable[str] = ()) -> list[dict]:
    """Every retry (waiting or ended) with its source and set, for ``rsagg retries``."""
    wanted = list(sources)
    sql = (
        "SELECT s.source, s.name AS set_name, r.uri, r.change, r.kind, r.message, r.attempts, r.first_at, "
        "r.last_at FROM retries r JOIN sets s ON s.id = r.set_id"
    )
    if wanted:
        sql += f" WHERE s.source IN ({', '.join('?' * len(wanted))})"
    cur = state.conn.execute(sql + " ORDER BY s.source, r.first_at", wanted)
    names = [d[0] for d in cur.description]
    return [
        {**dict(zip(names, r, strict=True)), "state": "ended" if r[4] == ENDED else "waiting"}
        for r in cur.fetchall()
    ]


def clear(state: State, sources: Iterable[str] = (), *, ended_only: bool = False) -> int:
    """Forget retries (of some sources; only ended ones): the operator gives up on them. Returns how many."""
    wanted = list(sources)
    where, params = [], []
    if wanted:
        where.append(f"set_id IN (SELECT id FROM sets WHERE source IN ({', '.join('?' * len(wanted))}))")
        params += wanted
    if ended_only:
        where.append("kind = ?")
        params.append(ENDED)
    sql = "DELETE FROM retries" + (" WHERE " + " AND ".join(where) if where else "")
    with state._write() as conn:
        return conn.execute(sql, params).rowcount


def by_source(state: State) -> dict[str, dict[str, int]]:
    """Source -> {"waiting": n, "ended": m}, for the status displays."""
    out: dict[str, dict[str, int]] = {}
    for source, kind, n in state.conn.execute(
        "SELECT s.source, r.kind = ?, count(*) FROM retries r JOIN sets s ON s.id = r.set_id "
        "GROUP BY s.source, r.kind = ?",
        (ENDED, ENDED),
    ):
        counts = out.setdefault(source, {"waiting": 0, "ended": 0})
        counts["ended" if kind else "waiting"] += n
    return out


def count(state: State, set_id: int | None = None) -> int:
    if set_id is None:
        return state.conn.execute("SELECT count(*) FROM retries").fetchone()[0]
    return state.conn.execute("SELECT count(*) FROM retries WHERE set_id = ?", (set_id,)).fetchone()[0]
