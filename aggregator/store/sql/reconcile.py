"""Reconciliation with the Resource List (harvest/reconcile.py; migration 13): the last reconciliation
of each set, and the upstream's validators of each held version (conditional re-checks; on the
resource row since schema step 18)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ..rows import Reconciliation, ResourceValidators
from .base import SqlState
from .codec import PUT_VALIDATORS, http_date_out, put_validators_rows, upsert

_REC_COLS = (
    "set_id", "reconciled_at", "cause", "lists", "differences", "repaired", "unrepaired", "complete", "error",
)  # fmt: skip
#: A resource row's validators as ``resource_validators`` reads them (with what decides whether they hold).
_READ_VALIDATORS = ("uri", "sha256", "deleted", "etag", "last_modified", "confirmed", "lastmod")


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
        wanted = set(uris)
        with self._read() as c:
            rows = c.execute(*self.d.by_uri(_READ_VALIDATORS, set_id, uris)).fetchall()
        dt = self.d.dt_row
        out = {}
        for uri, sha, deleted, etag, modified, confirmed, lastmod in rows:
            if uri not in wanted or deleted or sha is None:
                continue
            if etag is None and modified is None and confirmed is None:
                continue
            when = None if modified is None else http_date_out(dt(modified))
            out[uri] = ResourceValidators(
                uri, sha.hex(), etag, when, dt(lastmod if confirmed is None else confirmed)
            )
        return out

    def put_resource_validators(self, set_id: int, rows: Sequence[ResourceValidators]) -> None:
        """On the row holding the version each names (schema step 18; ``apply`` writes a batch's own
        with its rows)."""
        if not rows:
            return
        last = {r.uri: r for r in rows}  # one row per uri, the last given
        with self._write() as c:
            c.executemany(PUT_VALIDATORS, put_validators_rows(set_id, last.values(), self.d.t_row))
