"""The change pipeline: a batch of changes applied, the cursor moved and the retries written in ONE
transaction (docs/architecture.md invariants 1 and 2), and baselines. The changelog these append to is
the truth of what rsagg republishes (invariant 3).

The rules are ``codec.plan_batch``'s; how a batch's rows reach the table (``executemany`` in SQLite,
``COPY`` and array updates in PostgreSQL) and where the changelog's seq comes from are the backend's
(``_log_head``, ``_append_log``, ``_new_ids``, ``_write_batch``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from ...rs.model import CHANGES, DELETED
from ..interface import EmptySnapshot
from ..rows import Change, Cursor, ResourceValidators, RetryChanges
from .codec import (
    C_STORED,
    DELETED_CODE,
    PUT_VALIDATORS,
    check_hashes,
    check_sha,
    plan_batch,
    put_validators_rows,
)
from .retries import Retries
from .sources import Sources


class Changes(Sources, Retries):
    # -- what a backend supplies -----------------------------------------------------------------

    def _log_head(self, c: Any) -> tuple[int, Any]:
        """Inside a write transaction that may log changes: (the last seq, its stored datetime or None)."""
        raise NotImplementedError

    def _append_log(self, c: Any, seq: int, log: list[tuple]) -> None:
        """Append changelog rows (without seq) after ``seq``."""
        raise NotImplementedError

    def _new_ids(self, c: Any, n: int) -> Callable[[], int]:
        """A source of ``n`` new resource ids (never reused)."""
        raise NotImplementedError

    def _write_batch(
        self,
        c: Any,
        new: list[tuple],
        old: list[tuple],
        tombstones: dict[int, tuple],
        seen: dict[int, int],
        now: Any,
    ) -> None:
        """Write a planned batch: rows ``new`` (id first, then ``RES_COLS``) and ``old`` (the same, rows
        that exist), tombstones (id -> (generation, upstream_datetime)) and no-op marks (id -> generation)."""
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------

    def _log_time(self, c: Any) -> tuple[int, datetime]:
        """rsagg's changelog clock: wall clock, but never before the last record (clock steps back). The
        last record is read inside the write transaction: other processes (cluster nodes) append to the
        same changelog, so this process's memory of it is not enough."""
        seq, last = self._log_head(c)
        now, last_dt = self._now(), self.d.dt_row(last)
        return seq, (last_dt if last_dt is not None and now < last_dt else now)

    def apply(
        self,
        set_id: int,
        changes: Sequence[Change],
        cursor: Cursor | None = None,
        retries: RetryChanges | None = None,
        validators: Sequence[ResourceValidators] = (),
    ) -> list[Change]:
        """Apply a batch of changes and move the cursor, in ONE transaction (invariants 1 and 2).

        Per change, against the row as it stands (including earlier changes of the same batch):
        created/updated with the stored live row's sha256 -> no-op (not logged; during a baseline the
        row is still marked seen in the change's generation); no live row -> logged "created" (whatever
        upstream called it); a different sha256 -> "updated"; deleted on a live row -> tombstone (the
        row keeps its last content columns) + "deleted"; deleted on a missing or deleted row -> no-op.
        A no-op is a true no-op: lastmod/links of the stored row are not refreshed, since the changelog
        must account for every change of what we republish.

        ``retries`` (failed changes to keep, URIs whose retry ends) is written in the same transaction,
        after the changes and the cursor. ``validators``: the upstream's validators of the versions the
        batch fetched or confirmed, kept on their rows (schema step 18) in the same transaction: in the
        row a change writes, else on the row already holding that version (``put_resource_validators``'
        rule; the last given for a uri wins).

        Returns the changes that changed state, each with ``change`` set to the logged kind.
        """
        for ch in changes:
            if ch.change not in CHANGES:
                raise ValueError(f"{ch.uri}: unknown change {ch.change!r}")
            if ch.sha256 is not None:
                check_sha(ch.sha256)
            if ch.hashes:
                check_hashes(ch.hashes)
        with self._write() as c:
            row = c.execute("SELECT baseline_generation FROM sets WHERE id = ?", (set_id,)).fetchone()
            if row is None:
                raise KeyError(f"unknown set {set_id}")
            seq, log_time = self._log_time(c)
            now = self.d.t(log_time)  # the cursor's and the retries' tables store times as ``t``
            applied = self._apply(c, set_id, changes, row[0], seq, self.d.t_row(log_time), validators)
            if cursor is not None:
                self._put_cursor(c, set_id, cursor, now)
            if retries is not None:  # bookkeeping that must commit with the changes
                self._put_retries(c, now, set_id, retries)
        return applied

    def _apply(
        self,
        c: Any,
        set_id: int,
        changes: Sequence[Change],
        open_generation: int | None,
        seq: int,
        now: Any,
        validators: Sequence[ResourceValidators] = (),
    ) -> list[Change]:
        """``apply``'s work in its transaction; ``now``: the log time as the big tables store it (t_row)."""
        # 1. What is stored now, for every uri of the batch (one query).
        wanted = dict.fromkeys(ch.uri for ch in changes)
        uris = list(wanted)
        current: dict[str, list] = {}  # uri -> [id, sha256, live, stored] (codec's _C_* positions)
        if uris:
            for rid, uri, sha, deleted in c.execute(
                *self.d.by_uri(("id", "uri", "sha256", "deleted"), set_id, uris)
            ):
                if uri in wanted:  # not another uri of the same key (by_uri)
                    current[uri] = [rid, None if sha is None else sha.hex(), not deleted, True]
        # 2. Decide, change by change (plan_batch: the rules).
        new_id = self._new_ids(c, len(uris) - len(current))
        kept = {v.uri: v for v in validators}
        rows, tombstones, seen, log, applied = plan_batch(
            set_id, changes, current, open_generation, now, new_id, self.d.t_row, kept
        )
        # 3. Write: no-op marks, tombstones, new rows, changed rows, then the log.
        new: list[tuple] = []
        old: list[tuple] = []
        for uri, r in rows.items():
            (old if current[uri][C_STORED] else new).append((r[-1], *r[:-1]))
        self._write_batch(c, new, old, tombstones, seen, now)
        if log:
            self._append_log(c, seq, log)
        held = [v for uri, v in kept.items() if uri not in rows]  # the versions of rows not written
        if held:
            c.executemany(PUT_VALIDATORS, put_validators_rows(set_id, held, self.d.t_row))
        return applied

    # -- baselines -------------------------------------------------------------------------------

    def begin_baseline(self, set_id: int) -> int:
        """Start a baseline of a set: a new generation number for the rows it sees.

        An unfinished earlier baseline is abandoned (its generation is simply never finished).
        Changes applied while a baseline is open mark their rows with it even without a
        ``generation``, so rows created by a concurrent incremental change are not swept.
        """
        with self._write() as c:
            row = c.execute(
                "UPDATE sets SET generation = generation + 1, baseline_generation = generation + 1 "
                "WHERE id = ? RETURNING generation",
                (set_id,),
            ).fetchone()
            if row is None:
                raise KeyError(f"unknown set {set_id}")
            return row[0]

    def finish_baseline(
        self,
        set_id: int,
        generation: int,
        cursor: Cursor,
        retries: RetryChanges | None = None,
    ) -> list[Change]:
        """Tombstone (and log "deleted") every live row of the set not seen in ``generation``, store
        the cursor and close the baseline, in one transaction (``retries`` too, as in ``apply``).
        Returns the deletions."""
        with self._write() as c:
            row = c.execute(
                f"SELECT baseline_generation FROM sets WHERE id = ?{self.d.for_update}", (set_id,)
            ).fetchone()
            if row is None:
                raise KeyError(f"unknown set {set_id}")
            if row[0] != generation:
                raise ValueError(f"set {set_id}: baseline {generation} is not the open one ({row[0]})")
            gone = c.execute(
                "SELECT id, uri FROM resources WHERE set_id = ? AND deleted = 0 "
                "AND (generation IS NULL OR generation < ?) ORDER BY id",
                (set_id, generation),
            ).fetchall()
            if (
                gone
                and not c.execute(
                    "SELECT 1 FROM resources WHERE set_id = ? AND generation = ? LIMIT 1",
                    (set_id, generation),
                ).fetchone()
            ):
                raise EmptySnapshot(f"it saw no resource, {len(gone)} held: none deleted")
            seq, log_time = self._log_time(c)
            now, now_row = self.d.t(log_time), self.d.t_row(log_time)
            if gone:
                c.execute(
                    "UPDATE resources SET deleted = ?, generation = ?, updated_at = ? "
                    "WHERE id IN (SELECT value FROM json_each(?))",
                    (True, generation, now_row, self.d.ids([rid for rid, _ in gone])),
                )
                self._append_log(
                    c, seq, [(set_id, rid, DELETED_CODE, now_row, None, None, None) for rid, _ in gone]
                )
            self._put_cursor(c, set_id, cursor, now)
            c.execute("UPDATE sets SET baseline_generation = NULL WHERE id = ?", (set_id,))
            if retries is not None:
                self._put_retries(c, now, set_id, retries)
        return [Change(uri, DELETED, generation=generation) for _, uri in gone]
