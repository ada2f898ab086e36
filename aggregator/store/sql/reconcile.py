"""Reconciliation with the Resource List (harvest/reconcile.py; migration 13): the last reconciliation
of each set, and the upstream's validators of each held version (conditional re-checks)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..rows import Reconciliation, ResourceValidators
from .base import SqlState
from .codec import upsert

_REC_COLS = (
    "set_id", "reconciled_at", "cause", "lists", "differences", "repaired", "unrepaired", "complete", "error",
)  # fmt: skip
_VALIDATOR_COLS = ("set_id", "uri", "sha256", "etag", "last_modified", "lastmod")


class Reconciliations(SqlState):
    def reconciliation(self, set_id: int) -> Reconciliation | None:
        with self._read() as c:
            row = c.execute(
                f"SELECT {', '.join(_REC_COLS)} FROM reconciliations WHERE set_id = ?", (set_id,)
            ).fetchone()
        if row is None:
            return None
        sid, at, cause, lists, differences, repaired, unrepaired, complete, error = row
        d = self.d
        return Reconciliation(sid, d.dt(at), cause, d.json_out(lists), differences,
                              d.json_out(repaired), unrepaired, bool(complete), error)  # fmt: skip

    def put_reconciliation(self, rec: Reconciliation) -> None:
        with self._write() as c:
            c.execute(
                upsert("reconciliations", _REC_COLS, ("set_id",)),
                (rec.set_id, self.d.t(rec.reconciled_at), rec.cause, json.dumps(rec.lists), rec.differences,
                 json.dumps(rec.repaired), rec.unrepaired, bool(rec.complete), rec.error),
            )  # fmt: skip

    def resource_validators(self, set_id: int, uris: Sequence[str]) -> dict[str, ResourceValidators]:
        if not uris:
            return {}
        with self._read() as c:
            rows = c.execute(
                "SELECT uri, sha256, etag, last_modified, lastmod FROM resource_validators "
                "WHERE set_id = ? AND uri IN (SELECT value FROM json_each(?))",
                (set_id, self.d.ids(list(dict.fromkeys(uris)))),
            ).fetchall()
        dt = self.d.dt
        values: list[list[Any]] = [[*r[:4], dt(r[4])] for r in rows]
        return {v[0]: ResourceValidators(*v) for v in values}

    def put_resource_validators(self, set_id: int, rows: Sequence[ResourceValidators]) -> None:
        if not rows:
            return
        last = {r.uri: r for r in rows}  # one row per uri, the last given
        t = self.d.t
        with self._write() as c:
            c.executemany(
                upsert("resource_validators", _VALIDATOR_COLS, ("set_id", "uri")),
                [(set_id, r.uri, r.sha256, r.etag, r.last_modified, t(r.lastmod)) for r in last.values()],
            )
