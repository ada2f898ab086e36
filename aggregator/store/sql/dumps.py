"""rsagg's own Resource Dumps and Change Dumps (publish/dumps.py; migrations 5 and 12): the runs, their
packages and the Change Dump of each Change List window."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Any

from ..rows import DumpPackage, DumpPart, DumpRun
from .base import SqlState
from .dialect import MAX_INT

_RUN_COLS = "id, set_name, at, completed, last_seq, set_ids, packages, entries, bytes, created"
_PKG_COLS = (
    'id, set_name, kind, run, part, "window", first_seq, last_seq, sha256, length, manifest_sha256, '
    "manifest_length, at, completed, from_, until, entries, bytes, created"
)
_WITHDRAWN = "fingerprint IS NULL OR fingerprint != ?"


def _package(r: Sequence[Any], dt: Callable[[Any], datetime | None]) -> DumpPackage:
    values: list[Any] = [*r[:12], dt(r[12]), dt(r[13]), dt(r[14]), dt(r[15]), r[16], r[17], dt(r[18])]
    return DumpPackage(*values)


class Dumps(SqlState):
    def _run(self, r: Sequence[Any]) -> DumpRun:
        dt = self.d.dt
        return DumpRun(r[0], r[1], dt(r[2]), dt(r[3]), r[4], self.d.array_out(r[5]) or (), r[6], r[7], r[8],
                       dt(r[9]))  # fmt: skip

    def dump_latest_run(self, set_name: str, fingerprint: str = "") -> DumpRun | None:
        with self._read() as c:
            row = c.execute(
                f"SELECT {_RUN_COLS} FROM publish_dump_runs WHERE set_name = ? AND fingerprint = ? "
                "ORDER BY id DESC LIMIT 1",
                (set_name, fingerprint),
            ).fetchone()
        return self._run(row) if row else None

    def dump_runs(self, set_name: str, fingerprint: str = "") -> list[DumpRun]:
        """The set's kept Resource Dump runs built under ``fingerprint``, oldest first (the archive)."""
        with self._read() as c:
            rows = c.execute(
                f"SELECT {_RUN_COLS} FROM publish_dump_runs WHERE set_name = ? AND fingerprint = ? "
                "ORDER BY id",
                (set_name, fingerprint),
            ).fetchall()
        return [self._run(r) for r in rows]

    def dump_run_packages(self, run_id: int) -> list[DumpPackage]:
        with self._read() as c:
            rows = c.execute(
                f"SELECT {_PKG_COLS} FROM publish_dumps WHERE run = ? ORDER BY part", (run_id,)
            ).fetchall()
        return [_package(r, self.d.dt) for r in rows]

    def change_dump_packages(self, set_name: str, fingerprint: str = "") -> list[DumpPackage]:
        with self._read() as c:
            rows = c.execute(
                f"SELECT {_PKG_COLS} FROM publish_dumps WHERE set_name = ? AND kind = 'changedump' "
                'AND fingerprint = ? ORDER BY "window"',
                (set_name, fingerprint),
            ).fetchall()
        return [_package(r, self.d.dt) for r in rows]

    def dump_package(
        self, set_name: str, kind: str, number: int, fingerprint: str = ""
    ) -> DumpPackage | None:
        key = {"resourcedump": "id", "changedump": '"window"'}.get(kind)
        if key is None:
            raise ValueError(f"unknown dump kind {kind!r}")
        if not 0 <= number <= MAX_INT:  # an id no row can have (and out of a 64-bit integer's range)
            return None
        with self._read() as c:
            row = c.execute(
                f"SELECT {_PKG_COLS} FROM publish_dumps WHERE set_name = ? AND kind = ? AND {key} = ? "
                "AND fingerprint = ?",
                (set_name, kind, number, fingerprint),
            ).fetchone()
        return _package(row, self.d.dt) if row else None

    def has_change_dump(self, set_name: str, fingerprint: str = "") -> bool:
        with self._read() as c:
            return bool(
                c.execute(
                    "SELECT 1 FROM publish_dumps WHERE set_name = ? AND kind = 'changedump' "
                    "AND fingerprint = ? LIMIT 1",
                    (set_name, fingerprint),
                ).fetchone()
            )

    def add_resource_dump(
        self,
        set_name: str,
        set_ids: Sequence[int],
        last_seq: int,
        at: datetime,
        completed: datetime,
        parts: Sequence[DumpPart],
        created: datetime,
        fingerprint: str = "",
    ) -> list[DumpPackage]:
        t = self.d.t
        now = t(created)
        with self._write() as c:
            run = c.execute(
                "INSERT INTO publish_dump_runs (set_name, at, completed, last_seq, set_ids, packages, "
                "entries, bytes, created, fingerprint) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (set_name, t(at), t(completed), last_seq, self.d.array(set_ids), len(parts),
                 sum(p.entries for p in parts), sum(p.bytes for p in parts), now, fingerprint),
            ).fetchone()[0]  # fmt: skip
            if parts:
                c.executemany(
                    "INSERT INTO publish_dumps (set_name, kind, run, part, sha256, length, manifest_sha256, "
                    "manifest_length, at, completed, entries, bytes, created, fingerprint) "
                    "VALUES (?, 'resourcedump', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [(set_name, run, number, p.sha256, p.length, p.manifest_sha256, p.manifest_length,
                      t(p.at), t(p.completed), p.entries, p.bytes, now, fingerprint)
                     for number, p in enumerate(parts, 1)],
                )  # fmt: skip
            rows = c.execute(
                f"SELECT {_PKG_COLS} FROM publish_dumps WHERE run = ? ORDER BY part", (run,)
            ).fetchall()
        return [_package(r, self.d.dt) for r in rows]

    def _blobs_of(self, c: Any, table_filter: str, params: Sequence[Any]) -> set[str]:
        return {
            sha
            for row in c.execute(
                f"SELECT sha256, manifest_sha256 FROM publish_dumps WHERE {table_filter}", params
            ).fetchall()
            for sha in row
        }

    def prune_resource_dumps(self, set_name: str, keep: int) -> set[str]:
        with self._write() as c:
            old = [
                r[0]
                for r in c.execute(
                    "SELECT id FROM publish_dump_runs WHERE set_name = ? ORDER BY id DESC LIMIT ? OFFSET ?",
                    (set_name, MAX_INT, keep),
                ).fetchall()
            ]
            if not old:
                return set()
            ids = (self.d.ids(old),)
            shas = self._blobs_of(c, "run IN (SELECT value FROM json_each(?))", ids)
            c.execute("DELETE FROM publish_dumps WHERE run IN (SELECT value FROM json_each(?))", ids)
            c.execute("DELETE FROM publish_dump_runs WHERE id IN (SELECT value FROM json_each(?))", ids)
        return shas

    def withdraw_dumps(self, fingerprint: str) -> set[str]:
        with self._write() as c:
            shas = self._blobs_of(c, _WITHDRAWN, (fingerprint,))
            c.execute(f"DELETE FROM publish_dumps WHERE {_WITHDRAWN}", (fingerprint,))
            c.execute(f"DELETE FROM publish_dump_runs WHERE {_WITHDRAWN}", (fingerprint,))
        return shas

    def add_change_dump(
        self,
        set_name: str,
        window: int,
        first_seq: int,
        last_seq: int,
        part: DumpPart,
        created: datetime,
        fingerprint: str = "",
    ) -> DumpPackage:
        p, t = part, self.d.t
        with self._write() as c:
            row = c.execute(
                'INSERT INTO publish_dumps (set_name, kind, part, "window", first_seq, last_seq, sha256, '
                "length, manifest_sha256, manifest_length, from_, until, entries, bytes, created, "
                "fingerprint) VALUES (?, 'changedump', 1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                f"RETURNING {_PKG_COLS}",
                (set_name, window, first_seq, last_seq, p.sha256, p.length, p.manifest_sha256,
                 p.manifest_length, t(p.from_), t(p.until), p.entries, p.bytes, t(created), fingerprint),
            ).fetchone()  # fmt: skip
        return _package(row, self.d.dt)

    def change_dump_seqs(self) -> dict[str, int]:
        """Per published set, the last changelog seq its Change Dump packages hold (gc keeps the blobs of
        every later record: the packages still to build need them)."""
        with self._read() as c:
            rows = c.execute(
                "SELECT set_name, max(last_seq) FROM publish_dumps WHERE kind = 'changedump' "
                "GROUP BY set_name"
            ).fetchall()
        return {name: seq or 0 for name, seq in rows}

    def dump_hashes(self) -> Iterator[str]:
        sql = "SELECT sha256 FROM publish_dumps UNION SELECT manifest_sha256 FROM publish_dumps ORDER BY 1"
        for (sha,) in self._snapshot(sql):
            yield sha


__all__ = ["Dumps"]
