"""Many ``rsagg run`` nodes on one state (run/cluster.py; migrations 9 and 11): their heartbeats, the
source leases and the lease history.

Lease times are the database's clock (``_db_now``): SQLite's is the claimer's (one machine shares one
SQLite file), PostgreSQL's the server's ``now()`` (nodes on many machines agree on one clock; constant
within a transaction). SQLite serialises these transactions (BEGIN IMMEDIATE); PostgreSQL claims with
``FOR UPDATE SKIP LOCKED`` (``Dialect.skip_locked``): concurrent claimers skip what another is granting.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from ..rows import Fence, LeaseGrant, LeaseRow, NodeRow
from .base import SqlState


class Cluster(SqlState):
    def _db_now(self, c: Any) -> datetime:
        """The clock leases are measured by, inside transaction ``c``."""
        return self._now()

    def node_heartbeat(
        self,
        node: str,
        *,
        lease_seconds: float,
        pid: int | None,
        host: str | None,
        url: str | None,
        follows: Sequence[str] | None = None,
    ) -> None:
        t = self.d.t
        said = None if follows is None else self.d.array(sorted(set(follows)))
        with self._write(fence=False) as c:
            now = self._db_now(c)
            at = t(now)
            c.execute(
                "INSERT INTO nodes (name, pid, host, url, started_at, heartbeat_at, expires_at, follows) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET pid = excluded.pid, "
                "host = excluded.host, url = excluded.url, heartbeat_at = excluded.heartbeat_at, "
                "expires_at = excluded.expires_at, stopped_at = NULL, follows = excluded.follows",
                (node, pid, host, url, at, at, t(now + timedelta(seconds=lease_seconds)), said),
            )
            # Nodes silent for a day are forgotten (their leases expired long ago).
            c.execute("DELETE FROM nodes WHERE expires_at < ?", (t(now - timedelta(days=1)),))

    def node_stopped(self, node: str) -> None:
        with self._write(fence=False) as c:
            at = self.d.t(self._db_now(c))
            c.execute("UPDATE nodes SET stopped_at = ?, expires_at = ? WHERE name = ?", (at, at, node))

    def nodes(self) -> list[NodeRow]:
        with self._read() as c:
            rows = c.execute(
                "SELECT name, pid, host, url, started_at, heartbeat_at, expires_at, stopped_at, follows "
                "FROM nodes ORDER BY name"
            ).fetchall()
        dt = self.d.dt
        return [
            NodeRow(r[0], r[1], r[2], r[3], dt(r[4]), dt(r[5]), dt(r[6]), dt(r[7]), self.d.array_out(r[8]))
            for r in rows
        ]

    def claim_leases(
        self, node: str, sources: Sequence[str], *, want: int, lease_seconds: float
    ) -> list[Fence]:
        if want <= 0 or not sources:
            return []
        t = self.d.t
        names = sorted(set(sources))
        with self._write(fence=False) as c:
            now = self._db_now(c)
            at, until = t(now), t(now + timedelta(seconds=lease_seconds))
            c.executemany(
                "INSERT INTO leases (source, epoch) VALUES (?, 0) ON CONFLICT (source) DO NOTHING",
                [(n,) for n in names],
            )
            free = c.execute(
                "SELECT source, node, epoch, expires_at FROM leases "
                "WHERE source IN (SELECT value FROM json_each(?)) AND (node IS NULL OR expires_at <= ?) "
                f"ORDER BY source LIMIT ?{self.d.skip_locked}",
                (self.d.ids(names), at, want),
            ).fetchall()
            out = []
            for source, old_node, epoch, expired_at in free:
                if old_node is not None:  # taken over: the old grant ended when it expired
                    c.execute(
                        "UPDATE lease_history SET ended_at = ?, end_reason = 'expired' "
                        "WHERE source = ? AND epoch = ? AND ended_at IS NULL",
                        (expired_at, source, epoch),
                    )
                c.execute(
                    "UPDATE leases SET node = ?, epoch = ?, granted_at = ?, expires_at = ? WHERE source = ?",
                    (node, epoch + 1, at, until, source),
                )
                c.execute(
                    "INSERT INTO lease_history (source, epoch, node, granted_at) VALUES (?, ?, ?, ?)",
                    (source, epoch + 1, node, at),
                )
                out.append(Fence(source, node, epoch + 1))
        return out

    def renew_leases(self, fences: Sequence[Fence], *, lease_seconds: float) -> list[Fence]:
        kept = []
        with self._write(fence=False) as c:
            now = self._db_now(c)
            at, until = self.d.t(now), self.d.t(now + timedelta(seconds=lease_seconds))
            for f in fences:
                cur = c.execute(
                    "UPDATE leases SET expires_at = ? WHERE source = ? AND node = ? AND epoch = ? "
                    "AND expires_at > ?",
                    (until, f.source, f.node, f.epoch, at),
                )
                if cur.rowcount:
                    kept.append(f)
        return kept

    def release_lease(self, fence: Fence) -> bool:
        with self._write(fence=False) as c:
            at = self.d.t(self._db_now(c))
            released = bool(
                c.execute(
                    "UPDATE leases SET node = NULL, expires_at = ? "
                    "WHERE source = ? AND node = ? AND epoch = ? AND expires_at > ?",
                    (at, fence.source, fence.node, fence.epoch, at),
                ).rowcount
            )
            if released:
                c.execute(
                    "UPDATE lease_history SET ended_at = ?, end_reason = 'released' "
                    "WHERE source = ? AND epoch = ? AND ended_at IS NULL",
                    (at, fence.source, fence.epoch),
                )
        return released

    def leases(self) -> list[LeaseRow]:
        with self._read() as c:
            rows = c.execute(
                "SELECT source, node, epoch, granted_at, expires_at FROM leases ORDER BY source"
            ).fetchall()
        dt = self.d.dt
        return [LeaseRow(r[0], r[1], r[2], dt(r[3]), dt(r[4])) for r in rows]

    def lease_history(self, source: str | None = None) -> list[LeaseGrant]:
        sql = "SELECT source, node, epoch, granted_at, ended_at, end_reason FROM lease_history"
        with self._read() as c:
            if source is None:
                rows = c.execute(sql + " ORDER BY source, epoch").fetchall()
            else:
                rows = c.execute(sql + " WHERE source = ? ORDER BY epoch", (source,)).fetchall()
        dt = self.d.dt
        return [LeaseGrant(r[0], r[1], r[2], dt(r[3]), dt(r[4]), r[5]) for r in rows]
