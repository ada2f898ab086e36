"""Changes whose fetch failed, kept to be tried again (table ``retries``, migration 2).

The cursor of incremental sync moves past a failed change (the stream must go on), so without them the
resource would stay stale until it changed upstream again. Each is kept with its entry (a one-entry
ResourceSync document, written and read back by rs/), retried through the one pipeline at the start of
the set's next sync, and dropped when a change of the same URI applies. A retry also ends when the
upstream no longer lists its URI: the row stays, kind ``RETRY_ENDED`` with the reason, for ``rsagg
status``/``rsagg retries``, until ``--clear``; an ended retry is not tried again, and a new change of its
URI replaces it like any other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...rs.model import Entry, Head
from ..rows import RetryChanges, format_dt
from .base import SqlState
from .codec import RETRY_ENDED


class Retries(SqlState):
    def _put_retries(self, c: Any, now: Any, set_id: int, retries: RetryChanges) -> None:
        """Inside the transaction that applies a batch: a crash can neither leave a retry of a change
        already superseded nor lose a failure the cursor has moved past."""
        from ...rs.write import iter_document_bytes  # lxml: not at start-up (``rsagg status``, ``retries``)

        if retries.failed:
            c.executemany(
                "INSERT INTO retries (set_id, uri, change, entry, kind, message, first_at, last_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (set_id, uri) DO UPDATE SET "
                "change = excluded.change, entry = excluded.entry, kind = excluded.kind, "
                "message = excluded.message, attempts = retries.attempts + 1, last_at = excluded.last_at",
                [(set_id, f.entry.loc, f.change, b"".join(iter_document_bytes(Head(), [f.entry])), f.kind,
                  f.message, now, now) for f in retries.failed],
            )  # fmt: skip
        if retries.cleared:
            c.execute(
                "DELETE FROM retries WHERE set_id = ? AND uri IN (SELECT value FROM json_each(?))",
                (set_id, self.d.ids(retries.cleared)),
            )

    def pending_retries(self, set_id: int) -> list[tuple[Entry, str, int]]:
        """(entry, change, attempts) of every failed change of a set still to be tried, oldest first."""
        with self._read() as c:
            rows = c.execute(
                "SELECT entry, change, attempts FROM retries WHERE set_id = ? AND kind != ? "
                "ORDER BY first_at",
                (set_id, RETRY_ENDED),
            ).fetchall()
        from ...rs.parse import parse_bytes  # lxml: not at start-up (``rsagg status``, ``retries``)

        out: list[tuple[Entry, str, int]] = []
        for data, change, attempts in rows:
            _, entries = parse_bytes(bytes(data))
            out.extend((e, change, attempts) for e in entries)
        return out

    def holds_nothing(self, set_id: int) -> bool:
        """The set holds no resource row (tombstones included) and no retry: a sync of it has nothing
        to look up or to try again (a set seen for the first time)."""
        with self._read() as c:
            row = c.execute(
                "SELECT EXISTS (SELECT 1 FROM resources WHERE set_id = ?) "
                "OR EXISTS (SELECT 1 FROM retries WHERE set_id = ?)",
                (set_id, set_id),
            ).fetchone()
        return not row[0]

    def retry_uris(self, set_id: int) -> set[str]:
        """Every URI of a set with a retry row, ended ones included."""
        with self._read() as c:
            rows = c.execute("SELECT uri FROM retries WHERE set_id = ?", (set_id,)).fetchall()
        return {r[0] for r in rows}

    def end_retries(self, set_id: int, ended: Iterable[str], reason: str) -> None:
        """Mark retries as ended (no longer listed upstream): kept to be seen, not tried; ``reason``
        first, the last failure kept after it."""
        now = self.d.t(self._now())
        rows = [(reason, RETRY_ENDED, now, set_id, uri, RETRY_ENDED) for uri in ended]
        with self._write() as c:
            if rows:
                c.executemany(
                    "UPDATE retries SET message = ? || ' (last failure: ' || kind || ': ' || message || ')', "
                    "kind = ?, last_at = ? WHERE set_id = ? AND uri = ? AND kind != ?",
                    rows,
                )

    def retry_rows(self, sources: Iterable[str] = ()) -> list[dict]:
        """Every retry (waiting or ended) with its source and set, for ``rsagg retries`` (JSON-ready)."""
        wanted = list(sources)
        sql = (
            "SELECT s.source, s.name AS set_name, r.uri, r.change, r.kind, r.message, r.attempts, "
            "r.first_at, r.last_at FROM retries r JOIN sets s ON s.id = r.set_id"
        )
        params: list[Any] = []
        if wanted:
            sql += " WHERE s.source IN (SELECT value FROM json_each(?))"
            params.append(self.d.ids(wanted))
        with self._read() as c:
            cur = c.execute(sql + " ORDER BY s.source, r.first_at", params)
            names = [d[0] for d in cur.description]
            rows = cur.fetchall()
        dt = self.d.dt
        out: list[dict] = []
        for r in rows:
            d = dict(zip(names, r, strict=True))
            d["first_at"], d["last_at"] = format_dt(dt(d["first_at"])), format_dt(dt(d["last_at"]))
            out.append({**d, "state": "ended" if d["kind"] == RETRY_ENDED else "waiting"})
        return out

    def clear_retries(self, sources: Iterable[str] = (), *, ended_only: bool = False) -> int:
        """Forget retries (of some sources; only ended ones): the operator gives up. Returns how many."""
        wanted = list(sources)
        where: list[str] = []
        params: list[Any] = []
        if wanted:
            where.append("set_id IN (SELECT id FROM sets WHERE source IN (SELECT value FROM json_each(?)))")
            params.append(self.d.ids(wanted))
        if ended_only:
            where.append("kind = ?")
            params.append(RETRY_ENDED)
        sql = "DELETE FROM retries" + (" WHERE " + " AND ".join(where) if where else "")
        with self._write() as c:
            return c.execute(sql, params).rowcount

    def retries_by_source(self) -> dict[str, dict[str, int]]:
        """Source -> {"waiting": n, "ended": m}, for the status displays."""
        out: dict[str, dict[str, int]] = {}
        with self._read() as c:
            rows = c.execute(
                "SELECT s.source, r.kind = ?, count(*) FROM retries r JOIN sets s ON s.id = r.set_id "
                "GROUP BY 1, 2",
                (RETRY_ENDED,),
            ).fetchall()
        for source, ended, n in rows:
            counts = out.setdefault(source, {"waiting": 0, "ended": 0})
            counts["ended" if ended else "waiting"] += n
        return out
