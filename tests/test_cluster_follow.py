"""Cluster nodes following an upstream's WebSub channels (websub/subscriber.py on a cluster): the
subscriptions and the inbox of notices live in the shared state, the hub's callbacks reach a node that
does NOT hold the source (a load balancer in front of the nodes sends them there), and the holder applies
the changes at once — once each — long before its poll interval."""

from __future__ import annotations

import hashlib
import hmac
import re
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aggregator.rs.model import CHANGE_NOTIFICATION, FRAMEWORK_NOTIFICATION
from aggregator.rs.w3cdt import format_w3c, utcnow
from aggregator.run.serving import serving
from aggregator.testing.notify import UpstreamNotifier
from aggregator.testing.upstream import Upstream
from aggregator.websub.subscriber import CALLBACK_PREFIX

from .clustering import NodeProcess, SharedState, wait_for

# Runs rsagg cluster nodes as processes behind a WebSub hub.
pytestmark = pytest.mark.slow

HARVEST = (
    "[harvest]\njitter = 0\nretries = 2\nbackoff_base = 0.01\nbackoff_max = 0.05\ntimeout = 10\n"
    "use_dumps = false\n"
)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def backend(request: pytest.FixtureRequest) -> str | None:
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("pg_server").fresh_url()


def _holder(db: SharedState) -> str | None:
    if not db.exists():
        return None
    now = utcnow()
    with db.open() as st:
        return next(
            (
                le.node
                for le in st.leases()
                if le.source == "s" and le.node and le.expires_at and le.expires_at > now
            ),
            None,
        )


def _live_subs(db: SharedState) -> list:
    if not db.exists():
        return []
    now = utcnow()
    with db.open() as st:
        return [s for s in st.notify_subscriptions() if s.live(now)]


def _polls_over(db: SharedState, node: NodeProcess, *after: str) -> bool:
    """The node's syncs of the source are over (once its log shows every one of ``after``): the source's
    last success is after the start of its last sync (log times are local, ms)."""
    text = node.log_text()
    syncs = [line for line in text.splitlines() if "rsagg.subscriber: source=s syncing (" in line]
    if not syncs or not all(word in text for word in after):
        return False
    last = syncs[-1]
    started = datetime.strptime(last[:23], "%Y-%m-%d %H:%M:%S,%f").astimezone()
    with db.open() as st:
        row = st.source("s")
    return row is not None and row.last_success is not None and row.last_success >= started


def _metric(text: str, name: str, label: str) -> float:
    m = re.search(rf'^{name}\{{[^}}]*"{label}"[^}}]*\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


async def test_a_callback_at_any_node_reaches_the_holders_pipeline(
    tmp_path: Path, backend: str | None
) -> None:
    up = Upstream(sets=("only",), changes_per_list=None, resource_dump=False, change_dump=False)
    up.bulk_create(3, set_name="only")
    notifier = UpstreamNotifier(up)
    store = tmp_path / "store"
    db = SharedState(store, backend)
    nodes = {n: NodeProcess(tmp_path, n, store) for n in ("A", "B")}
    forwarded: dict[str, int] = {"A": 0, "B": 0}

    async def balancer(request: Request) -> Response:
        """The load balancer in front of the nodes: every request to the node NOT holding the source."""
        holder = _holder(db)
        name = "B" if holder == "A" else "A"
        proc = nodes[name].proc
        if proc is not None and proc.returncode is not None:  # killed: the survivor gets everything
            name = "A" if name == "B" else "B"
        forwarded[name] += request.url.path.startswith(CALLBACK_PREFIX)
        content = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with httpx.AsyncClient() as client:
            with trio.fail_after(30):  # a node still starting: hold the request until it listens
                while True:
                    try:
                        r = await client.request(
                            request.method, nodes[name].url + request.url.path, params=request.query_params,
                            content=content, headers=headers, timeout=30,
                        )  # fmt: skip
                        break
                    except httpx.ConnectError:
                        await trio.sleep(0.1)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    lb = Starlette(routes=[Route("/{path:path}", balancer, methods=["GET", "POST"])])
    async with up.serving() as base, serving(lb) as lb_url, trio.open_nursery() as nursery:
        await nursery.start(notifier.run)
        body = HARVEST + (
            f'[[sources]]\nname = "s"\nurl = "{base}/only/capabilitylist.xml"\n'
            "interval = 3600\nnotified_interval = 3600\n"  # only notifications can bring changes in time
        )
        for n in nodes.values():
            n.configure(
                body, base_url=lb_url, lease_seconds=3.0, store_extra=db.store_extra, notifications=True
            )
        try:
            for n in nodes.values():
                await n.start()
            for n in nodes.values():
                await n.wait_serving()
            await wait_for(lambda: len(_live_subs(db)) == 2, "both channels verified through the other node")
            # and active at the upstream's hub: it records a subscription once the node's answer to its
            # challenge is back, a moment after the node recorded it; a change made in that moment is
            # published to nobody, and its notification never comes (the catch-up poll brings it instead)
            assert notifier.hub is not None
            hub = notifier.hub

            async def hub_active() -> bool:
                subs = await trio.to_thread.run_sync(hub.subscriptions)
                return sum(s["verified"] is not None for s in subs) == 2

            with trio.move_on_after(90):
                while not await hub_active():
                    await trio.sleep(0.1)
            assert await hub_active(), "timed out waiting for both subscriptions at the upstream's hub"
            holder = _holder(db)
            assert holder in nodes
            other = "B" if holder == "A" else "A"
            assert forwarded[other] >= 2 and {s.kind for s in _live_subs(db)} == {
                CHANGE_NOTIFICATION,
                FRAMEWORK_NOTIFICATION,
            }
            with db.open() as st:
                seq = st.last_seq()
            # The first notice after subscribing has nothing to continue: it makes the holder poll at once
            # (as does the catch-up a channel gets when it goes live). Once those polls are over, nothing
            # but the notices' payloads can bring changes in (the poll interval is an hour).
            for i in range(4):
                up.create(f"n{i}.txt", f"note {i}\n".encode(), set_name="only")
                uri = up.url(f"n{i}.txt", "only")

                def arrived(uri: str = uri) -> bool:
                    with db.open() as st:
                        return any(r.uri == uri for r in st.iter_resources())

                await wait_for(arrived, f"n{i}.txt, notified through node {other}", timeout=60)
                if i == 0:
                    await wait_for(
                        lambda: _polls_over(db, nodes[holder], "first notification", "syncing (catch-up)"),
                        "the first polls over",
                    )
            with db.open() as st:
                records = [r for r in st.iter_changelog() if r.seq > seq]
            assert sorted(r.uri for r in records) == sorted(up.url(f"n{i}.txt", "only") for i in range(4))
            assert all(r.change == "created" for r in records)  # each once: nothing applied twice
            held_metrics = (await nodes[holder].get("/metrics")).text
            other_metrics = (await nodes[other].get("/metrics")).text
            assert _metric(other_metrics, "rsagg_notifications_received_total", "accepted") >= 4, (
                other_metrics
            )
            assert _metric(held_metrics, "rsagg_notifications_processed_total", "applied") >= 3, held_metrics
            assert "syncing (interval)" not in nodes[holder].log_text()

            # Forged deliveries (a wrong secret) to either node: acknowledged (WebSub §7.1), counted,
            # never recorded nor applied.
            with db.open() as st:
                sub = next(s for s in st.notify_subscriptions() if s.kind == CHANGE_NOTIFICATION)
                seq = st.last_seq()
            target = up.url("forged.txt", "only")
            forged = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                '<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" '
                'xmlns:rs="http://www.openarchives.org/rs/terms/">'
                f'<rs:md capability="change-notification" from="{format_w3c(sub.last_until or utcnow())}" '
                f'until="{format_w3c(utcnow())}"/>'
                f'<url><loc>{target}</loc><rs:md change="created"/></url></urlset>'
            ).encode()
            async with httpx.AsyncClient() as client:
                for n in nodes.values():
                    r = await client.post(
                        f"{n.url}{CALLBACK_PREFIX}{sub.token}",
                        content=forged,
                        headers={
                            "Content-Type": "application/xml",
                            "X-Hub-Signature": _sign("forged", forged),
                        },
                    )
                    assert r.status_code == 202
            for n in nodes.values():
                text = (await n.get("/metrics")).text
                assert _metric(text, "rsagg_notifications_rejected_total", "bad_signature") == 1, n.name
            await trio.sleep(1.5)  # three inbox looks of the holder: a recorded forgery would be applied
            with db.open() as st:
                assert st.last_seq() == seq
                assert st.notify_notices("s") == []
                assert not any(r.uri == target for r in st.iter_resources())

            # The holder dies: the other node takes the source over with its subscriptions (their
            # continuity included) and applies the next notice from its payload.
            applied = _metric(other_metrics, "rsagg_notifications_processed_total", "applied")
            await nodes[holder].kill()
            await wait_for(lambda: _holder(db) == other, f"node {other}'s takeover", timeout=60)
            await wait_for(lambda: _polls_over(db, nodes[other]), f"node {other}'s first sync")
            up.create("after.txt", b"after the takeover\n", set_name="only")
            uri = up.url("after.txt", "only")

            def taken_over() -> bool:
                with db.open() as st:
                    return any(r.uri == uri for r in st.iter_resources())

            await wait_for(taken_over, "after.txt through the new holder", timeout=60)
            with db.open() as st:
                assert [r.uri for r in st.iter_changelog() if r.seq > seq] == [uri]
            text = (await nodes[other].get("/metrics")).text
            assert _metric(text, "rsagg_notifications_processed_total", "applied") > applied, text
        finally:
            for n in nodes.values():
                await n.kill()
            nursery.cancel_scope.cancel()
