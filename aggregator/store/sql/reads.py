"""Reading resources and the changelog: the harvester's lookups, the publisher's lists (aggregator/publish/)
and the versions of one resource (publish/versions.py; §14.6, RFC 7089).

A published set is a list of state sets (config [[sets]] grouping). Queries run per state set on the
indexes of the schema (resources_live, in PostgreSQL resources_set since step 17; the (uri_key, set_id)
key; changelog_set_seq) and are merged by id / seq in Python, so a small set in a big database never
scans other sets' rows.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

from ..interface import ListingRow
from ..retention import Retention, retained_sql
from ..rows import LogRecord, Resource
from . import codec, dialect
from .base import SqlState
from .codec import DELETED_CODE, LOG_SELECT, R_URI, RES_COLS, SELECT_RES, log_record, resource_row
from .dialect import MAX_INT, uri_key

SELECT_RES_COLS = ("id", *RES_COLS)


class Reads(SqlState):
    def referenced_hashes(self, retention: Retention | None = None) -> Iterator[str]:
        """Every sha256 gc must keep, each once, in ascending order, as of one instant.

        That is the blobs of live resources, of every changelog record (rsagg's Change Dumps are
        built from the changelog and need the content of past versions; pruning the changelog is what
        lets old versions go) and of cached capability documents (the body answering a 304).
        ``retention`` (``[publish] versions``): only the changelog records it retains count, and every
        record after ``retention.floor_seq`` (not in a Change Dump yet); None: every record.
        Ascending order lets gc merge this with ``FileBlobStore.iter_hashes`` without holding a set.
        No index on sha256 serves this (random-order index pages made every commit ~3x slower): one
        sorted snapshot (``_snapshot``), read in pages.
        """
        sql = (  # resources and changelog store binary hashes (step 15), documents hex text
            f"SELECT {self.d.hex('b.sha256')} FROM (SELECT sha256 FROM resources WHERE deleted = 0 "
            f"AND sha256 IS NOT NULL UNION {retained_sql(retention, self.d.literal_row)}) AS b "
            "UNION SELECT sha256 FROM documents WHERE sha256 IS NOT NULL ORDER BY 1"
        )
        for (sha,) in self._snapshot(sql):
            yield sha

    def iter_live_part_boundaries(self, set_ids: Sequence[int], size: int) -> Iterator[int]:
        """The id of every ``size``-th live resource of the sets in id order (``live_part_boundaries``,
        yielded as found): the sets' live ids read by keyset pages and merged, so nothing is held
        between pages (a publisher's reader has one connection)."""
        if size < 1:
            raise ValueError("size must be at least 1")
        sql = "SELECT id FROM resources WHERE set_id = ? AND deleted = 0 AND id > ? ORDER BY id LIMIT ?"
        iters = [self._pages(sql, [sid], 0, 0, None) for sid in dict.fromkeys(set_ids)]
        for n, (rid,) in enumerate(heapq.merge(*iters), 1):
            if n % size == 0:
                yield rid

    def resource(self, set_id: int, uri: str) -> Resource | None:
        dt = self.d.dt_row
        with self._read() as c:
            row = c.execute(
                SELECT_RES + " WHERE set_id = ? AND uri_key = ? AND uri = ?", (set_id, uri_key(uri), uri)
            ).fetchone()
        return resource_row(row, dt) if row else None

    def resources(self, set_id: int, uris: Sequence[str]) -> dict[str, Resource]:
        """The stored rows of those of ``uris`` the set holds (one query; json_each: no variable limit)."""
        dt = self.d.dt_row
        if not uris:
            return {}
        with self._read() as c:
            rows = c.execute(*self.d.by_uri(SELECT_RES_COLS, set_id, uris)).fetchall()
        wanted = set(uris)  # not another uri of the same key (by_uri)
        return {r[R_URI]: resource_row(r, dt) for r in rows if r[R_URI] in wanted}

    def iter_resources(
        self,
        set_id: int | None = None,
        *,
        include_deleted: bool = False,
        after_id: int = 0,
        limit: int | None = None,
    ) -> Iterator[Resource]:
        """Resources by id (stable keyset paging: pass the last id seen as ``after_id``)."""
        dt = self.d.dt_row
        where: list[str] = []
        params: list[Any] = []
        if set_id is not None:
            where.append("set_id = ?")
            params.append(set_id)
        if not include_deleted:
            where.append("deleted = 0")
        where.append("id > ?")
        sql = f"{SELECT_RES} WHERE {' AND '.join(where)} ORDER BY id LIMIT ?"
        for row in self._pages(sql, params, 0, after_id, limit):
            yield resource_row(row, dt)

    def count_resources(
        self, set_id: int | None = None, *, source: str | None = None, include_deleted: bool = False
    ) -> int:
        """Live resources held (of a set, of a source, or all); tombstones too with include_deleted."""
        where: list[str] = []
        params: list[Any] = []
        if set_id is not None:
            where.append("set_id = ?")
            params.append(set_id)
        if source is not None:
            where.append("set_id IN (SELECT id FROM sets WHERE source = ?)")
            params.append(source)
        if not include_deleted:
            where.append("deleted = 0")
        sql = "SELECT count(*) FROM resources" + (f" WHERE {' AND '.join(where)}" if where else "")
        with self._read() as c:
            return c.execute(sql, params).fetchone()[0]

    def iter_changelog(
        self, after_seq: int = 0, *, set_id: int | None = None, limit: int | None = None
    ) -> Iterator[LogRecord]:
        """Changelog records in seq order (== datetime order), after ``after_seq``."""
        dt = self.d.dt_row
        if set_id is None:
            sql, params = f"{LOG_SELECT} WHERE c.seq > ? ORDER BY c.seq LIMIT ?", []
        else:
            sql = f"{LOG_SELECT} WHERE c.set_id = ? AND c.seq > ? ORDER BY c.seq LIMIT ?"
            params = [set_id]
        for r in self._pages(sql, params, 0, after_seq, limit):
            yield log_record(r, dt)

    def last_seq(self) -> int:
        """The highest changelog seq (0 when empty): where a reader starting now would begin."""
        with self._read() as c:
            return c.execute("SELECT coalesce(max(seq), 0) FROM changelog").fetchone()[0]

    def history_start(self, set_ids: Sequence[int]) -> datetime | None:
        """The earliest time the sets' change history covers: their creation, or their first changelog
        record if the clock stepped back since (the ``from`` of their first Change List, §12.1)."""
        dt = self.d.dt_row
        if not set_ids:
            return None
        times: list[datetime] = []
        with self._read() as c:
            for sid in set_ids:
                row = c.execute("SELECT created_at FROM sets WHERE id = ?", (sid,)).fetchone()
                if row:
                    times.append(self.d.dt(row[0]))  # sets: a time as ``t`` stores it
                row = c.execute(
                    "SELECT datetime FROM changelog WHERE set_id = ? ORDER BY seq LIMIT 1", (sid,)
                ).fetchone()
                if row:
                    times.append(dt(row[0]))
        return min(times) if times else None

    def count_live(self, set_ids: Sequence[int]) -> int:
        """Live resources of the sets (decides Resource List vs Resource List Index, §10.2)."""
        with self._read() as c:
            return sum(
                c.execute(
                    "SELECT count(*) FROM resources WHERE set_id = ? AND deleted = 0", (sid,)
                ).fetchone()[0]
                for sid in set_ids
            )

    def live_part_boundaries(self, set_ids: Sequence[int], size: int) -> list[int]:
        """The id of every ``size``-th live resource of the sets in id order.

        Part k of a Resource List Index then holds the live resources with ``b[k-1] < id <= b[k]``
        (b[0] = 0), at most ``size`` each (§7: 50,000 per document, §10.2). One pass in SQLite.
        """
        return list(self.iter_live_part_boundaries(set_ids, size))

    def live_more_than(self, set_ids: Sequence[int], n: int) -> bool:
        """True when the sets hold more than ``n`` live resources: reads at most n+1 index entries (a
        Resource List Index's head is written before its parts are counted out)."""
        left = n + 1
        with self._read() as c:
            for sid in dict.fromkeys(set_ids):
                left -= c.execute(
                    "SELECT count(*) FROM "
                    "(SELECT 1 FROM resources WHERE set_id = ? AND deleted = 0 LIMIT ?) AS x",
                    (sid, left),
                ).fetchone()[0]
                if left <= 0:
                    return True
        return False

    def live_part_boundary(self, set_id: int, after_id: int, size: int) -> int | None:
        """The id of the ``size``-th live resource of one set after ``after_id`` (None: fewer follow):
        ``iter_live_part_boundaries`` one part at a time, an index walk of ``size`` entries (10x faster
        than numbering every row)."""
        if size < 1:
            raise ValueError("size must be at least 1")
        with self._read() as c:
            row = c.execute(
                "SELECT id FROM resources WHERE set_id = ? AND deleted = 0 AND id > ? "
                "ORDER BY id LIMIT 1 OFFSET ?",
                (set_id, after_id, size - 1),
            ).fetchone()
        return None if row is None else row[0]

    def live_after(self, set_ids: Sequence[int], after_id: int) -> bool:
        """Whether the sets hold a live resource with ``id > after_id`` (an index seek per set)."""
        with self._read() as c:
            return any(
                c.execute(
                    "SELECT 1 FROM resources WHERE set_id = ? AND deleted = 0 AND id > ? LIMIT 1",
                    (sid, after_id),
                ).fetchone()
                for sid in dict.fromkeys(set_ids)
            )

    def rows_version(
        self, set_ids: Sequence[int], after_id: int = 0, until_id: int | None = None
    ) -> tuple[int, datetime | None]:
        """What changes whenever a row of the sets with ``after_id < id <= until_id`` changes (created,
        updated, deleted): their count and newest ``updated_at``. A Resource List part renders the same
        while these stay (one range scan of the rows)."""
        dt = self.d.dt_row
        top = MAX_INT if until_id is None else until_id
        count = 0
        newest: list[Any] = []
        with self._read() as c:
            for sid in dict.fromkeys(set_ids):
                n, m = c.execute(
                    "SELECT count(*), max(updated_at) FROM resources WHERE set_id = ? AND id > ? AND id <= ?",
                    (sid, after_id, top),
                ).fetchone()
                count += n
                if m is not None:
                    newest.append(m)
        return count, dt(max(newest)) if newest else None

    def set_last_seq(self, set_ids: Sequence[int]) -> int:
        """The sets' newest changelog seq (0: none): every change of their rows is logged, so lists
        built from them render the same while it stays."""
        with self._read() as c:
            return max(
                (
                    c.execute(
                        "SELECT coalesce(max(seq), 0) FROM changelog WHERE set_id = ?", (sid,)
                    ).fetchone()[0]
                    for sid in dict.fromkeys(set_ids)
                ),
                default=0,
            )

    def iter_live(
        self, set_ids: Sequence[int], *, after_id: int = 0, until_id: int | None = None
    ) -> Iterator[Resource]:
        """Live resources of the sets with ``after_id < id <= until_id`` (no upper bound when None), by id."""
        dt = self.d.dt_row
        top = MAX_INT if until_id is None else until_id
        sql = f"{SELECT_RES} WHERE set_id = ? AND deleted = 0 AND id <= ? AND id > ? ORDER BY id LIMIT ?"
        iters = [self._pages(sql, [sid, top], 0, after_id, None) for sid in dict.fromkeys(set_ids)]
        rows = iters[0] if len(iters) == 1 else heapq.merge(*iters, key=lambda r: r[0])
        for row in rows:
            yield resource_row(row, dt)

    def iter_live_listing(
        self, set_ids: Sequence[int], *, after_id: int = 0, until_id: int | None = None
    ) -> Iterator[ListingRow | Resource]:
        """``iter_live`` for list writers (``interface.ListingRow``): the columns a plain entry needs
        and, per row, whether it has more; the rows that do are read whole, a page at a time."""
        top = MAX_INT if until_id is None else until_id
        sql = f"SELECT {self.d.listing_cols} FROM resources "
        sql += "WHERE set_id = ? AND deleted = 0 AND id <= ? AND id > ? ORDER BY id LIMIT ?"
        iters = [self._listing_pages(sql, sid, top, after_id) for sid in dict.fromkeys(set_ids)]
        if len(iters) == 1:
            yield from iters[0]
        else:
            yield from heapq.merge(*iters, key=lambda r: r[0] if type(r) is tuple else r.id)  # type: ignore[union-attr]

    def _listing_pages(self, sql: str, set_id: int, top: int, after: int) -> Iterator[ListingRow | Resource]:
        dt = self.d.dt_row
        # ListingRow's times are format_dt's text: SQLite's integers turned to it here; the rows of a
        # batch share their updated_at, so one conversion per distinct value (bounded by the page)
        text = self.d.text_row
        if text is not dialect.POSTGRES.text_row:
            text = functools.lru_cache(maxsize=codec.PAGE_SIZE)(text)
        while True:
            with self._read() as c:
                rows = c.execute(sql, (set_id, top, after, codec.PAGE_SIZE)).fetchall()
                rich = [r[0] for r in rows if r[-1]]
                if rich:
                    full = c.execute(
                        f"{SELECT_RES} WHERE id IN (SELECT value FROM json_each(?))", (self.d.ids(rich),)
                    ).fetchall()
                    whole = {r[0]: resource_row(r, dt) for r in full}
            # ListingRow: the stored binary hashes (sha256, md5, sha1) as hex; the last column dropped
            for r in rows:
                if r[-1]:
                    yield whole[r[0]]
                else:
                    sha, md5, sha1 = r[2], r[6], r[7]
                    yield (r[0], r[1], sha and sha.hex(), r[3], r[4], r[5], md5 and md5.hex(),
                           sha1 and sha1.hex(), text(r[8]), text(r[9]), text(r[10]))  # fmt: skip
            if len(rows) < codec.PAGE_SIZE:
                return
            after = rows[-1][0]

    def resource_in(self, set_ids: Sequence[int], uri: str) -> Resource | None:
        """The resource ``uri`` held in any of the sets: a live row if there is one (the most recently
        changed when several sets hold it), else the most recent tombstone; None when never held."""
        best: Resource | None = None
        for sid in dict.fromkeys(set_ids):
            r = self.resource(sid, uri)
            if r is None:
                continue
            if best is None or (not r.deleted, r.updated_at) > (not best.deleted, best.updated_at):
                best = r
        return best

    def live_set_of(self, set_ids: Sequence[int], uri: str) -> int | None:
        """The first of the sets (in the order given) that holds ``uri`` live, else None: a cheap
        "do we hold it?" for rewriting links to our copy (§14.5)."""
        key = uri_key(uri)
        with self._read() as c:
            for sid in dict.fromkeys(set_ids):
                row = c.execute(
                    "SELECT 1 FROM resources WHERE set_id = ? AND uri_key = ? AND uri = ? AND deleted = 0",
                    (sid, key, uri),
                ).fetchone()
                if row:
                    return sid
        return None

    def iter_log_range(
        self, set_ids: Sequence[int], after_seq: int = 0, until_seq: int | None = None
    ) -> Iterator[tuple[LogRecord, Resource | None]]:
        """Changelog records of the sets with ``after_seq < seq <= until_seq``, in seq order, each with
        the resource row it names as that row is now (None if gone): the row holds what the record
        does not (md5, links, upstream lastmod), valid for the record when their sha256 agree."""
        dt = self.d.dt_row
        top = MAX_INT if until_seq is None else until_seq
        res_cols = "r.id, " + ", ".join(f"r.{c}" for c in RES_COLS)
        sql = (
            LOG_SELECT.replace(" FROM ", f", {res_cols} FROM ", 1)
            + " WHERE c.set_id = ? AND c.seq <= ? AND c.seq > ? ORDER BY c.seq LIMIT ?"
        )
        iters = [self._pages(sql, [sid, top], 0, after_seq, None) for sid in dict.fromkeys(set_ids)]
        if not iters:
            return
        rows = iters[0] if len(iters) == 1 else heapq.merge(*iters, key=lambda r: r[0])
        n = 9  # LOG_SELECT's columns
        for r in rows:
            yield log_record(r, dt), (resource_row(r[n:], dt) if r[n] is not None else None)

    def log_windows(self, set_ids: Sequence[int], size: int) -> list[int]:
        """Numbers k of the windows ``((k-1)*size, k*size]`` of the global changelog seq that hold at
        least one record of the sets, ascending. One index seek per set and window found."""
        if size < 1:
            raise ValueError("size must be at least 1")
        out: list[int] = []
        after = 0
        ids = list(dict.fromkeys(set_ids))
        while True:
            nxt = None
            with self._read() as c:
                for sid in ids:
                    row = c.execute(
                        "SELECT seq FROM changelog WHERE set_id = ? AND seq > ? ORDER BY seq LIMIT 1",
                        (sid, after),
                    ).fetchone()
                    if row and (nxt is None or row[0] < nxt):
                        nxt = row[0]
            if nxt is None:
                return out
            k = (nxt - 1) // size + 1
            out.append(k)
            after = k * size

    def log_datetime(self, seq: int) -> datetime | None:
        """The datetime of the last changelog record with seq <= ``seq`` (None when there is none): the
        ``until`` of a closed Change List window ending at ``seq`` (§12.1)."""
        dt = self.d.dt_row
        with self._read() as c:
            row = c.execute(
                "SELECT datetime FROM changelog WHERE seq <= ? ORDER BY seq DESC LIMIT 1", (seq,)
            ).fetchone()
        return dt(row[0]) if row else None

    def log_record(self, seq: int) -> LogRecord | None:
        """The changelog record ``seq`` (None when there is none): a memento names its version by it."""
        dt = self.d.dt_row
        if not 0 <= seq <= MAX_INT:
            return None
        with self._read() as c:
            r = c.execute(f"{LOG_SELECT} WHERE c.seq = ?", (seq,)).fetchone()
        return log_record(r, dt) if r else None

    def iter_versions(
        self, resource_id: int, after_seq: int = 0, limit: int | None = None
    ) -> Iterator[LogRecord]:
        """The changelog records of one resource row (deletions too), ascending seq, after ``after_seq``."""
        dt = self.d.dt_row
        sql = f"{LOG_SELECT} WHERE c.resource_id = ? AND c.seq > ? ORDER BY c.seq LIMIT ?"
        for r in self._pages(sql, [resource_id], 0, after_seq, limit):
            yield log_record(r, dt)

    def count_versions(self, resource_id: int, after_seq: int = 0, limit: int | None = None) -> int:
        """How many versions (records that are not deletions) the row has after ``after_seq``, counted up
        to ``limit`` (the retention check needs no more than N)."""
        top = MAX_INT if limit is None else limit
        with self._read() as c:
            return c.execute(
                "SELECT count(*) FROM (SELECT 1 FROM changelog WHERE resource_id = ? AND seq > ? "
                f"AND change != {DELETED_CODE} LIMIT ?) AS x",
                (resource_id, after_seq, top),
            ).fetchone()[0]

    def version_at(self, resource_id: int, when: datetime) -> LogRecord | None:
        """The version current at ``when`` (the last record that is not a deletion at or before it), else
        the first version: the best memento for a TimeGate (RFC 7089 §4.1); None: no version at all."""
        dt = self.d.dt_row
        with self._read() as c:
            # The row's records newest first (index changelog_resource), the first at or before
            # ``when``: the changelog's datetime never decreases with seq (``_log_time``), so that is
            # the last one by time too. A walk over the row's versions newer than ``when`` only (schema
            # step 16 dropped the index on datetime alone: 40 bytes a record, for this one query).
            r = c.execute(
                f"{LOG_SELECT} WHERE c.resource_id = ? AND c.datetime <= ? "
                f"AND c.change != {DELETED_CODE} ORDER BY c.seq DESC LIMIT 1",
                (resource_id, self.d.t_row(when)),
            ).fetchone()
            if r is None:
                r = c.execute(
                    f"{LOG_SELECT} WHERE c.resource_id = ? AND c.change != {DELETED_CODE} "
                    "ORDER BY c.seq LIMIT 1",
                    (resource_id,),
                ).fetchone()
        return log_record(r, dt) if r else None
