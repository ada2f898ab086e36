"""The subscriber on a cluster node, in-process: renewals are written under the source's lease, so a node
that lost it renews nothing (the hub never hears from it) and the new holder renews the subscription the
old one made; a verification reaching a node that never saw the subscription is answered from the state."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette

from aggregator.config import Config, parse_config
from aggregator.rs.model import CHANGE_NOTIFICATION
from aggregator.rs.w3cdt import utcnow
from aggregator.store.interface import LeaseLost, fenced
from aggregator.store.rows import NotifySubscription
from aggregator.store.state import State
from aggregator.websub.subscriber import Subscriber


def _config(folder: Path) -> Config:
    return parse_config(
        {
            "server": {"listen": "127.0.0.1:1", "base_url": "http://agg.example"},
            "store": {"path": str(folder)},
            "cluster": {"enabled": True, "node": "n"},
            "sources": [{"name": "src", "url": "http://up.example/cl.xml"}],
        },
        str(folder / "rsagg.toml"),
    )


async def test_renewals_follow_the_lease(tmp_path: Path) -> None:
    config = _config(tmp_path)
    posts: list[dict[str, str]] = []

    def hub(request: httpx.Request) -> httpx.Response:
        posts.append(dict(httpx.QueryParams(request.content.decode())))
        return httpx.Response(202)

    db = tmp_path / "state.db"
    setup = State(db)
    now = utcnow()
    sub = NotifySubscription(
        0,
        "tok",
        "sec",
        "src",
        "http://up.example/cl.xml",
        CHANGE_NOTIFICATION,
        "http://up.example/cn.xml",
        "http://hub.example/",
        lease_seconds=100,
        verified=now - timedelta(seconds=90),
        lease_expires=now + timedelta(seconds=10),
    )  # fmt: skip  (due for renewal: 90 % of its lease is over)
    setup.add_notify_subscription(sub)
    (old,) = setup.claim_leases("n1", ["src"], want=1, lease_seconds=60)
    assert setup.release_lease(old)
    (new,) = setup.claim_leases("n2", ["src"], want=1, lease_seconds=60)
    setup.close()

    async with httpx.AsyncClient(transport=httpx.MockTransport(hub)) as client:
        nodes = [Subscriber(lambda: config, State(db), harvester=None, client=client) for _ in range(2)]  # type: ignore[arg-type]
        stale, holder = nodes
        with fenced(old), pytest.raises(LeaseLost):
            await stale._refresh("src")
            await stale._maintain(stale.subscriptions("src"), None)
        assert posts == []  # the pending mark is written before the request: refused, nothing sent
        with fenced(new):
            await holder._refresh("src")
            await holder._maintain(holder.subscriptions("src"), None)
        assert [(p["hub.mode"], p["hub.callback"]) for p in posts] == [
            ("subscribe", "http://agg.example/_websub/tok")
        ]
        assert "hub.secret" in posts[0]

        # The hub verifies at a third node that has never seen the subscription: answered from the state.
        third = Subscriber(lambda: config, State(db), harvester=None, client=client)  # type: ignore[arg-type]
        third._subs.clear()
        app = Starlette(routes=third.routes())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://agg.example") as c:
            q = {
                "hub.mode": "subscribe",
                "hub.topic": sub.topic,
                "hub.challenge": "ch-1",
                "hub.lease_seconds": "500",
            }
            r = await c.get("/_websub/tok", params=q)
            assert r.status_code == 200 and r.text == "ch-1"
            r = await c.get("/_websub/tok", params={**q, "hub.topic": "http://up.example/other.xml"})
            assert r.status_code == 404  # intent check: another topic
        with State(db, readonly=True) as st:
            (row,) = st.notify_subscriptions()
        assert row.pending is None and row.lease_seconds == 500
        for s in (*nodes, third):
            await s.aclose()
