"""The embedded WebSub hub's subscriptions, verifications and deliveries (websub/hub.py; migration 6)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from ..rows import HubBacklog, HubDelivery, HubRequestState, HubSubscription, HubVerification
from .base import SqlState

# The oldest pending delivery of each subscription: the only one that may go out (in-order delivery).
_HUB_HEADS = "SELECT min(id) FROM hub_deliveries GROUP BY subscription_id"
_HUB_GC_PAYLOADS = (
    "DELETE FROM hub_payloads WHERE NOT EXISTS "
    "(SELECT 1 FROM hub_deliveries d WHERE d.payload_id = hub_payloads.id)"
)


class Hub(SqlState):
    def hub_subscriptions(self, topic: str | None = None) -> list[HubSubscription]:
        """Subscriptions not yet purged (of one topic), by id."""
        sql = (
            "SELECT id, topic, callback, secret, lease_seconds, lease_expires, created, verified "
            "FROM hub_subscriptions" + (" WHERE topic = ?" if topic is not None else "") + " ORDER BY id"
        )
        with self._read() as c:
            rows = c.execute(sql, () if topic is None else (topic,)).fetchall()
        dt = self.d.dt
        return [
            HubSubscription(i, t, cb, sec, ls, dt(le), dt(cr), dt(ve))
            for i, t, cb, sec, ls, le, cr, ve in rows
        ]

    def hub_backlog(self) -> HubBacklog:
        with self._read() as c:
            v, d = c.execute(
                "SELECT (SELECT count(*) FROM hub_verifications), (SELECT count(*) FROM hub_deliveries)"
            ).fetchone()
        return HubBacklog(v, d)

    def hub_request_state(self, topic: str, callback: str) -> HubRequestState:
        with self._read() as c:
            waiting, pending, subscribed = c.execute(
                "SELECT (SELECT count(*) FROM hub_verifications), "
                "EXISTS (SELECT 1 FROM hub_verifications WHERE topic = ? AND callback = ?), "
                "EXISTS (SELECT 1 FROM hub_subscriptions WHERE topic = ? AND callback = ?)",
                (topic, callback, topic, callback),
            ).fetchone()
        return HubRequestState(waiting, bool(pending), bool(subscribed))

    def hub_subscriber_callbacks(self) -> list[str]:
        """The callback of every distinct (topic, callback) subscribed or waiting to subscribe."""
        with self._read() as c:
            rows = c.execute(
                "SELECT topic, callback FROM hub_subscriptions UNION "
                "SELECT topic, callback FROM hub_verifications WHERE mode = 'subscribe'"
            ).fetchall()
        return [cb for _, cb in rows]

    def hub_queue_verification(self, request: HubVerification, requested: datetime) -> int:
        r = request
        with self._write() as c:  # a newer request replaces the waiting one, with a new id
            c.execute("DELETE FROM hub_verifications WHERE topic = ? AND callback = ?", (r.topic, r.callback))
            return c.execute(
                "INSERT INTO hub_verifications (mode, topic, callback, secret, lease_seconds, reason, "
                "requested) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (r.mode, r.topic, r.callback, r.secret, r.lease_seconds, r.reason, self.d.t(requested)),
            ).fetchone()[0]

    def hub_due_verifications(self, exclude: Sequence[int], limit: int) -> list[HubVerification]:
        with self._read() as c:
            rows = c.execute(
                "SELECT id, mode, topic, callback, secret, lease_seconds, reason FROM hub_verifications "
                "WHERE id NOT IN (SELECT value FROM json_each(?)) ORDER BY id LIMIT ?",
                (self.d.ids(exclude), limit),
            ).fetchall()
        return [HubVerification(*r) for r in rows]

    def hub_finish_verification(
        self, verification: HubVerification, subscribe: bool | None, lease_expires: datetime, now: datetime
    ) -> bool:
        at = self.d.t(now)
        v = verification
        with self._write() as c:
            if c.execute("DELETE FROM hub_verifications WHERE id = ?", (v.id,)).rowcount == 0:
                return False
            if subscribe is None:
                return True
            if not subscribe:
                c.execute(
                    "DELETE FROM hub_subscriptions WHERE topic = ? AND callback = ?", (v.topic, v.callback)
                )
                c.execute(_HUB_GC_PAYLOADS)
                return True
            # A renewal keeps the row (and so the pending deliveries), with the new secret and lease.
            c.execute(
                "INSERT INTO hub_subscriptions "
                "(topic, callback, secret, lease_seconds, lease_expires, created, verified) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (topic, callback) DO UPDATE SET "
                "secret = excluded.secret, lease_seconds = excluded.lease_seconds, "
                "lease_expires = excluded.lease_expires, verified = excluded.verified",
                (v.topic, v.callback, v.secret, v.lease_seconds, self.d.t(lease_expires), at, at),
            )
            return True

    def hub_queue_payload(
        self,
        topic: str,
        body: bytes,
        content_type: str,
        link: str,
        now: datetime,
        max_pending_per_subscription: int,
    ) -> tuple[int, int]:
        at = self.d.t(now)
        with self._write() as c:
            subs = [
                r[0]
                for r in c.execute(
                    "SELECT id FROM hub_subscriptions WHERE topic = ? AND lease_expires > ? ORDER BY id",
                    (topic, at),
                ).fetchall()
            ]
            if not subs:
                return 0, 0
            pid = c.execute(
                "INSERT INTO hub_payloads (topic, body, content_type, link, created) VALUES (?, ?, ?, ?, ?) "
                "RETURNING id",
                (topic, body, content_type, link, at),
            ).fetchone()[0]
            c.executemany(
                "INSERT INTO hub_deliveries (subscription_id, payload_id, next_attempt) VALUES (?, ?, ?)",
                [(s, pid, at) for s in subs],
            )
            dropped = c.execute(
                "DELETE FROM hub_deliveries WHERE id IN (SELECT id FROM (SELECT id, row_number() OVER "
                "(PARTITION BY subscription_id ORDER BY id DESC) AS n FROM hub_deliveries "
                "WHERE subscription_id IN (SELECT id FROM hub_subscriptions WHERE topic = ?)) AS x "
                "WHERE n > ?)",
                (topic, max_pending_per_subscription),
            ).rowcount
            if dropped:
                c.execute(_HUB_GC_PAYLOADS)
        return len(subs), dropped

    def hub_expire(self, now: datetime) -> int:
        at = self.d.t(now)
        with self._read() as c:
            if not c.execute(
                "SELECT 1 FROM hub_subscriptions WHERE lease_expires <= ? LIMIT 1", (at,)
            ).fetchone():
                return 0  # the common case: no write transaction
        with self._write() as c:
            expired = c.execute("DELETE FROM hub_subscriptions WHERE lease_expires <= ?", (at,)).rowcount
            c.execute(_HUB_GC_PAYLOADS)
        return expired

    def hub_next_lease_end(self) -> datetime | None:
        with self._read() as c:
            row = c.execute("SELECT min(lease_expires) FROM hub_subscriptions").fetchone()
        return self.d.dt(row[0]) if row and row[0] else None

    def hub_due_deliveries(
        self, now: datetime, exclude_subscriptions: Sequence[int], limit: int
    ) -> list[HubDelivery]:
        with self._read() as c:
            rows = c.execute(
                "SELECT d.id, s.id, s.callback, s.secret, d.attempts, p.body, p.content_type, p.link "
                "FROM hub_deliveries d JOIN hub_subscriptions s ON s.id = d.subscription_id "
                "JOIN hub_payloads p ON p.id = d.payload_id "
                f"WHERE d.id IN ({_HUB_HEADS}) AND d.next_attempt <= ? "
                "AND s.id NOT IN (SELECT value FROM json_each(?)) ORDER BY d.next_attempt, d.id LIMIT ?",
                (self.d.t(now), self.d.ids(exclude_subscriptions), limit),
            ).fetchall()
        return [HubDelivery(*r) for r in rows]

    def hub_next_delivery_due(self, exclude_subscriptions: Sequence[int]) -> datetime | None:
        with self._read() as c:
            row = c.execute(
                f"SELECT min(next_attempt) FROM hub_deliveries WHERE id IN ({_HUB_HEADS}) "
                "AND subscription_id NOT IN (SELECT value FROM json_each(?))",
                (self.d.ids(exclude_subscriptions),),
            ).fetchone()
        return self.d.dt(row[0]) if row and row[0] else None

    def hub_finish_delivery(self, delivery: HubDelivery, outcome: str, retry_at: datetime, error: str) -> str:
        if outcome not in ("ok", "gone", "retry"):
            raise ValueError(f"unknown delivery outcome {outcome!r}")
        d = delivery
        with self._write() as c:
            if outcome == "gone":
                c.execute("DELETE FROM hub_subscriptions WHERE id = ?", (d.subscription_id,))
            elif outcome == "ok":
                c.execute("DELETE FROM hub_deliveries WHERE id = ?", (d.id,))
            else:
                row = c.execute(
                    "SELECT lease_expires FROM hub_subscriptions WHERE id = ?", (d.subscription_id,)
                ).fetchone()
                at = self.d.t(retry_at)
                if row is None or at >= row[0]:  # retried until the lease ends, no longer
                    c.execute("DELETE FROM hub_deliveries WHERE id = ?", (d.id,))
                    outcome = "failed"
                else:
                    c.execute(
                        "UPDATE hub_deliveries SET attempts = ?, next_attempt = ?, last_error = ? "
                        "WHERE id = ?",
                        (d.attempts + 1, at, error[:500], d.id),
                    )
            if outcome != "retry":
                c.execute(_HUB_GC_PAYLOADS)
        return outcome
