"""rsagg's notification channels (websub/notifier.py; migration 7), its subscriptions to upstream
channels (websub/subscriber.py; migration 8) and the shared inbox of upstream notifications (migration 10)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from ..rows import NotifyChannel, NotifyNotice, NotifySubscription
from .base import SqlState
from .codec import upsert

_CHANNEL_COLS = ("topic", "set_name", "kind", "last_seq", "last_until", "body", "snapshot", "updated")
_NSUB_COLS = tuple(f.name for f in dataclasses.fields(NotifySubscription))
_NSUB_TIMES = frozenset({"requested", "lease_expires", "verified", "last_until", "next_attempt"})


class Notifications(SqlState):
    def notify_channels(self) -> list[NotifyChannel]:
        with self._read() as c:
            rows = c.execute(
                f"SELECT {', '.join(_CHANNEL_COLS[:-1])} FROM notify_channels ORDER BY topic"
            ).fetchall()
        dt = self.d.dt
        return [
            NotifyChannel(topic, name, kind, seq, dt(until), bytes(body or b""), json.loads(snap or "{}"))
            for topic, name, kind, seq, until, body, snap in rows
        ]

    def put_notify_channels(self, channels: Sequence[NotifyChannel], drop: Sequence[str] = ()) -> None:
        t = self.d.t
        now = t(self._now())
        with self._write() as c:
            if channels:
                c.executemany(
                    upsert("notify_channels", _CHANNEL_COLS, ("topic",)),
                    [(ch.topic, ch.set_name, ch.kind, ch.last_seq, t(ch.last_until), ch.body,
                      json.dumps(ch.snapshot) if ch.snapshot else None, now) for ch in channels],
                )  # fmt: skip
            if drop:
                c.execute(
                    "DELETE FROM notify_channels WHERE topic IN (SELECT value FROM json_each(?))",
                    (self.d.ids(drop),),
                )

    def notify_subscriptions(self, token: str | None = None) -> list[NotifySubscription]:
        where, args = ("WHERE token = ?", (token,)) if token is not None else ("", ())
        with self._read() as c:
            rows = c.execute(
                f"SELECT {', '.join(_NSUB_COLS)} FROM notify_subscriptions {where} ORDER BY id", args
            ).fetchall()
        dt = self.d.dt
        out = []
        for row in rows:
            d: dict[str, Any] = {
                k: dt(v) if k in _NSUB_TIMES else v for k, v in zip(_NSUB_COLS, row, strict=True)
            }
            d["wanted"] = bool(d["wanted"])
            out.append(NotifySubscription(**d))
        return out

    def _nsub_values(self, sub: NotifySubscription) -> list[Any]:
        t = self.d.t
        return [t(v) if isinstance(v, datetime) else v for v in (getattr(sub, k) for k in _NSUB_COLS[1:])]

    def add_notify_subscription(self, subscription: NotifySubscription) -> int:
        cols = _NSUB_COLS[1:]
        with self._write() as c:
            return c.execute(
                f"INSERT INTO notify_subscriptions ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
                "RETURNING id",
                self._nsub_values(subscription),
            ).fetchone()[0]

    def put_notify_subscriptions(self, subscriptions: Sequence[NotifySubscription]) -> None:
        sql = f"UPDATE notify_subscriptions SET {', '.join(f'{k} = ?' for k in _NSUB_COLS[1:])} WHERE id = ?"
        with self._write() as c:
            if subscriptions:
                c.executemany(sql, [(*self._nsub_values(s), s.id) for s in subscriptions])

    def delete_notify_subscription(self, subscription_id: int) -> None:
        with self._write() as c:
            c.execute("DELETE FROM notify_subscriptions WHERE id = ?", (subscription_id,))

    def add_notify_notice(self, source: str, token: str, body: bytes, *, limit: int) -> str:
        digest = hashlib.sha256(body).hexdigest()
        with self._write(fence=False) as c:
            (waiting,) = c.execute("SELECT count(*) FROM notify_inbox WHERE source = ?", (source,)).fetchone()
            full = waiting >= limit
            if full:  # one poll request instead (deduplicated like any notice)
                token, body, digest = "", b"", "poll:" + source
            cur = c.execute(
                "INSERT INTO notify_inbox (source, token, digest, body, received_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (source, token, digest, body, self.d.t(self._now())),
            )
            return "full" if full else "added" if cur.rowcount else "duplicate"

    def notify_notices(self, source: str, limit: int = 100) -> list[NotifyNotice]:
        with self._read() as c:
            rows = c.execute(
                "SELECT id, source, token, body FROM notify_inbox WHERE source = ? ORDER BY id LIMIT ?",
                (source, limit),
            ).fetchall()
        return [NotifyNotice(r[0], r[1], r[2], bytes(r[3])) for r in rows]

    def delete_notify_notices(self, ids: Sequence[int]) -> None:
        with self._write() as c:
            if ids:
                c.execute(
                    "DELETE FROM notify_inbox WHERE id IN (SELECT value FROM json_each(?))",
                    (self.d.ids(ids),),
                )
