"""Sources, what their last sync tolerated, the documents fetched, the sets and their cursors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from ..rows import Cursor, DocumentRow, SetRow, SourceRow
from .base import SqlState
from .codec import SOURCE_STATUS_FIELDS, SOURCE_TIMES, check_sha, upsert

_SOURCE_COLS = (
    "name", "url", "state", "last_error", "last_error_at", "last_success", "last_attempt", "next_attempt",
    "failures", "progress_done", "progress_total", "progress_what", "created_at", "updated_at", "using_url",
)  # fmt: skip
_SELECT_SOURCES = f"SELECT {', '.join(_SOURCE_COLS)} FROM sources"
_DOCUMENT_COLS = ("url", "source", "capability", "etag", "last_modified", "sha256", "fetched_at")
_CURSOR_COLS = (
    "set_id", "baseline_at", "changelist_url", "last_datetime", "same_datetime_count", "list_index",
    "list_until", "updated_at",
)  # fmt: skip
_SELECT_DOCUMENT = f"SELECT {', '.join(_DOCUMENT_COLS)} FROM documents WHERE url = ?"
_SELECT_CURSOR = f"SELECT {', '.join(_CURSOR_COLS[1:-1])} FROM cursors WHERE set_id = ?"


class Sources(SqlState):
    def _lock_set_names(self, c: Any) -> None:
        """Inside ``ensure_set``'s transaction: no other writer names a set until it commits (naming is
        check-then-insert). SQLite's write transaction already excludes every other writer."""

    def _source_row(self, r: Sequence[Any]) -> SourceRow:
        dt = self.d.dt
        d: dict[str, Any] = {
            k: dt(v) if k in SOURCE_TIMES else v for k, v in zip(_SOURCE_COLS, r, strict=True)
        }
        return SourceRow(**d)

    def upsert_source(self, name: str, url: str) -> None:
        now = self.d.t(self._now())
        with self._write() as c:
            c.execute(
                "INSERT INTO sources (name, url, created_at, updated_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET url = excluded.url, updated_at = excluded.updated_at "
                "WHERE sources.url != excluded.url",
                (name, url, now, now),
            )

    def sources(self) -> list[SourceRow]:
        with self._read() as c:
            rows = c.execute(_SELECT_SOURCES + " ORDER BY name").fetchall()
        return [self._source_row(r) for r in rows]

    def source(self, name: str) -> SourceRow | None:
        with self._read() as c:
            row = c.execute(_SELECT_SOURCES + " WHERE name = ?", (name,)).fetchone()
        return self._source_row(row) if row else None

    def set_source_status(self, name: str, **fields: Any) -> None:
        """Update status columns (see SOURCE_STATUS_FIELDS); datetimes may be given as datetime."""
        unknown = set(fields) - SOURCE_STATUS_FIELDS
        if unknown:
            raise ValueError(f"unknown source status field(s): {', '.join(sorted(unknown))}")
        t = self.d.t
        values = {k: t(v) if isinstance(v, datetime) else v for k, v in fields.items()}
        values["updated_at"] = t(self._now())
        sets = ", ".join(f"{k} = ?" for k in values)
        with self._write() as c:
            cur = c.execute(f"UPDATE sources SET {sets} WHERE name = ?", [*values.values(), name])
            if cur.rowcount == 0:
                raise KeyError(f"unknown source {name!r}")

    def put_upstream_notes(self, source: str, deviations: Sequence[dict], skipped: Mapping[str, str]) -> None:
        """Replace what the last sync of ``source`` tolerated (``deviations``: rule, count, url, line,
        message) and skipped (list URL -> reason)."""
        now = self.d.t(self._now())
        rows = [("deviation", d["rule"], d["count"], d.get("url"), d.get("line"), d.get("message"), now)
                for d in deviations]  # fmt: skip
        rows += [("skipped", url, 1, url, None, why, now) for url, why in skipped.items()]
        with self._write() as c:
            c.execute("DELETE FROM upstream_notes WHERE source = ?", (source,))
            if rows:
                c.executemany(
                    "INSERT INTO upstream_notes (source, kind, rule, count, url, line, message, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(source, *r) for r in rows],
                )

    def upstream_notes(self, source: str) -> dict[str, list[dict]]:
        """{"deviations": [{rule, count, url, line, message}], "skipped": [{url, reason}]} of a source."""
        with self._read() as c:
            rows = c.execute(
                "SELECT kind, rule, count, url, line, message FROM upstream_notes WHERE source = ? "
                "ORDER BY kind, rule",
                (source,),
            ).fetchall()
        out: dict[str, list[dict]] = {"deviations": [], "skipped": []}
        for kind, rule, count, url, line, message in rows:
            if kind == "deviation":
                out["deviations"].append(
                    {"rule": rule, "count": count, "url": url, "line": line, "message": message}
                )
            else:
                out["skipped"].append({"url": url, "reason": message})
        return out

    # -- documents -------------------------------------------------------------------------------

    def document(self, url: str) -> DocumentRow | None:
        with self._read() as c:
            row = c.execute(_SELECT_DOCUMENT, (url,)).fetchone()
        if row is None:
            return None
        values: list[Any] = [*row[:6], self.d.dt(row[6])]
        return DocumentRow(*values)

    def put_document(
        self,
        url: str,
        source: str,
        capability: str | None,
        *,
        etag: str | None,
        last_modified: str | None,
        sha256: str | None,
    ) -> None:
        if sha256 is not None:
            check_sha(sha256)
        with self._write() as c:
            c.execute(
                upsert("documents", _DOCUMENT_COLS, ("url",)),
                (url, source, capability, etag, last_modified, sha256, self.d.t(self._now())),
            )

    # -- sets and cursors ------------------------------------------------------------------------

    def ensure_set(self, source: str, capabilitylist_url: str, *, name: str | None = None) -> int:
        """The set of one upstream Capability List, created on first sight.

        Its ``name`` (used in republished paths) is ``name`` if given, else the source name for the
        first set of a source and ``<source>-2``, ``<source>-3``... after it; it never changes.
        """
        with self._write() as c:
            self._lock_set_names(c)
            row = c.execute(
                "SELECT id FROM sets WHERE source = ? AND capabilitylist_url = ?",
                (source, capabilitylist_url),
            ).fetchone()
            if row:
                return row[0]
            base = name or source
            candidate, n = base, 1
            while c.execute("SELECT 1 FROM sets WHERE name = ?", (candidate,)).fetchone():
                n += 1
                candidate = f"{base}-{n}"
            return c.execute(
                "INSERT INTO sets (source, capabilitylist_url, name, created_at) VALUES (?, ?, ?, ?) "
                "RETURNING id",
                (source, capabilitylist_url, candidate, self.d.t(self._now())),
            ).fetchone()[0]

    def sets(self, source: str | None = None) -> list[SetRow]:
        """The sets (of one source), by id."""
        sql = "SELECT id, source, capabilitylist_url, name, generation, baseline_generation FROM sets"
        with self._read() as c:
            if source is None:
                rows = c.execute(sql + " ORDER BY id").fetchall()
            else:
                rows = c.execute(sql + " WHERE source = ? ORDER BY id", (source,)).fetchall()
        return [SetRow(*r) for r in rows]

    def cursor(self, set_id: int) -> Cursor | None:
        with self._read() as c:
            row = c.execute(_SELECT_CURSOR, (set_id,)).fetchone()
        if row is None:
            return None
        dt = self.d.dt
        return Cursor(dt(row[0]), row[1], dt(row[2]), row[3], row[4], dt(row[5]))

    def _put_cursor(self, c: Any, set_id: int, cursor: Cursor, now: Any) -> None:
        t = self.d.t
        c.execute(
            upsert("cursors", _CURSOR_COLS, ("set_id",)),
            (set_id, t(cursor.baseline_at), cursor.changelist_url, t(cursor.last_datetime),
             cursor.same_datetime_count, cursor.list_index, t(cursor.list_until), now),
        )  # fmt: skip
