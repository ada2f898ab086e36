"""Changes whose fetch failed, kept to be tried again (a hash mismatch, a 5xx that outlasted retries).

The cursor of incremental sync moves past a failed change (the stream must go on), so without this list
the resource would stay stale until it changed upstream again. Each failed change is kept with its
entry (as a one-entry ResourceSync document, written and read back by ``rs/``; table ``retries``,
schema migration 2 of store/state.py), retried through the one
pipeline at the start of the set's next sync, and dropped when a change of the same URI is applied.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

from ..rs.model import Entry, Head
from ..rs.parse import parse_bytes
from ..rs.write import iter_document_bytes
from .state import State


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
        "message = excluded.message, attempts = attempts + 1, last_at = excluded.last_at",
        rows,
    )
    conn.executemany("DELETE FROM retries WHERE set_id = ? AND uri = ?", [(set_id, u) for u in cleared])


def pending(state: State, set_id: int) -> list[tuple[Entry, str, int]]:
    """(entry, change, attempts) of every failed change of a set, oldest first."""
    rows = state.conn.execute(
        "SELECT entry, change, attempts FROM retries WHERE set_id = ? ORDER BY first_at", (set_id,)
    ).fetchall()
    out = []
    for data, change, attempts in rows:
        _, entries = parse_bytes(bytes(data))
        out.extend((e, change, attempts) for e in entries)
    return out


def count(state: State, set_id: int | None = None) -> int:
    if set_id is None:
        return state.conn.execute("SELECT count(*) FROM retries").fetchone()[0]
    return state.conn.execute("SELECT count(*) FROM retries WHERE set_id = ?", (set_id,)).fetchone()[0]
