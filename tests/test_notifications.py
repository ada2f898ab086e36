"""Change and Framework Notification end to end, over real HTTP on 127.0.0.1.

rsagg nodes are the real daemon run in-process (``tests/notifying.py``); the upstream is the demo
``Upstream`` publishing its notifications (``testing/notify.py``) through rsagg's ``Hub`` embedded in it
or through flask-websub, a WebSub hub nobody here wrote. Subscribers: rsagg itself, and a minimal one
written here (it checks signatures with ``hmac`` on its own). Polling intervals are an hour, so what
arrives, arrived by notification; counters tell which way it came.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from aggregator.harvest.context import HarvestContext
from aggregator.publish.uris import rsagg_uri
from aggregator.rs.linkheader import parse_link_header
from aggregator.rs.model import (
    CHANGE_NOTIFICATION,
    CHANGEDUMP,
    CHANGEDUMP_ARCHIVE,
    FRAMEWORK_NOTIFICATION,
    RESOURCEDUMP,
    RESOURCEDUMP_ARCHIVE,
    Entry,
    Head,
)
from aggregator.rs.parse import parse_bytes
from aggregator.rs.w3cdt import format_w3c, utcnow
from aggregator.run.parts import load_plugins, published_views
from aggregator.store.open import open_state
from aggregator.store.state import State
from aggregator.testing.notify import UpstreamNotifier
from aggregator.testing.upstream import Upstream
from aggregator.websub.subscriber import CALLBACK_PREFIX, Subscriber

from .httpserver import serve_app
from .notifying import flask_hub, node_config, rsagg_node, wait_until

# Runs Flask-WebSub hubs and subscribers as real peers.
pytestmark = pytest.mark.slow

HOUR = {"interval": 3600, "notified_interval": 3600}


# -- helpers -----------------------------------------------------------------------------------------


def subscriber(ctx: HarvestContext) -> Subscriber:
    assert ctx.notifications is not None and ctx.notifications.subscriber is not None
    return ctx.notifications.subscriber


def all_live(ctx: HarvestContext, n: int = 2) -> bool:
    now = utcnow()
    subs = subscriber(ctx).subscriptions()
    return len(subs) >= n and all(s.live(now) for s in subs)


def held(ctx: HarvestContext) -> dict[str, str]:
    """upstream-of-this-node URI -> sha256 of the live resources of a node."""
    with State(ctx.config.store_path / "state.db", readonly=True) as st:
        return {r.uri: r.sha256 for r in st.iter_resources() if r.sha256}


def content(ctx: HarvestContext, uri: str) -> bytes:
    with State(ctx.config.store_path / "state.db", readonly=True) as st:
        row = next(r for r in st.iter_resources() if r.uri == uri)
    with ctx.blobs.open(row.sha256) as f:
        return f.read()


def last_success(ctx: HarvestContext) -> datetime | None:
    with State(ctx.config.store_path / "state.db", readonly=True) as st:
        row = st.source("up")
        return row.last_success if row else None


def syncs(ctx: HarvestContext) -> float:
    """Syncs of the source "up" (polls) the node ran so far."""
    get = ctx.metrics.registry.get_sample_value
    return sum(
        get("rsagg_syncs_total", {"source": "up", "result": r}) or 0 for r in ("ok", "error", "degraded")
    )


def log_size(ctx: HarvestContext) -> int:
    with State(ctx.config.store_path / "state.db", readonly=True) as st:
        return st.last_seq()


async def change_list(client: httpx.AsyncClient, base: str, set_name: str) -> list[Entry]:
    """Every entry of a node's Change List (index walked)."""
    r = await client.get(f"{base}/{set_name}/changelist.xml")
    assert r.status_code == 200
    head, entries = parse_bytes(r.content)
    if not head.is_index:
        return entries
    out: list[Entry] = []
    for part in entries:
        out += parse_bytes((await client.get(part.loc)).content)[1]
    return out


def via(entry: Entry) -> str:
    return next(ln.href for ln in entry.links if ln.rel == "via")


async def quiet(*ctxs: HarvestContext) -> None:
    """Every node done with what it received (counters are final: they move after the commit)."""
    for ctx in ctxs:
        await wait_until(lambda ctx=ctx: subscriber(ctx).idle("up"), "idle")


async def settled(*ctxs: HarvestContext) -> None:
    """Every node's channels live and its catch-up poll done (then only notifications carry changes)."""
    for ctx in ctxs:
        await wait_until(lambda ctx=ctx: all_live(ctx), "subscriptions verified")
    await quiet(*ctxs)  # the catch-up poll done


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes


@dataclass
class MiniSubscriber:
    """The tests' own WebSub subscriber: echoes challenges for topics it asked for, records posts."""

    asked: set[str] = field(default_factory=set)
    posts: dict[str, list[Received]] = field(default_factory=dict)

    async def get(self, request: Request) -> Response:
        q = request.query_params
        if q.get("hub.topic") not in self.asked or q.get("hub.mode") != "subscribe":
            return PlainTextResponse("no", status_code=404)
        self.posts.setdefault(request.path_params["name"], [])
        return PlainTextResponse(q["hub.challenge"])

    async def post(self, request: Request) -> Response:
        name = request.path_params["name"]
        self.posts.setdefault(name, []).append(Received(dict(request.headers), await request.body()))
        return Response(status_code=204)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/cb/{name}", self.get, methods=["GET"]),
                Route("/cb/{name}", self.post, methods=["POST"]),
            ]
        )


@asynccontextmanager
async def mini_subscriber() -> AsyncIterator[tuple[MiniSubscriber, str]]:
    sub = MiniSubscriber()
    async with serve_app(sub.app()) as base:
        yield sub, base


async def subscribe(client: httpx.AsyncClient, hub: str, topic: str, callback: str, secret: str) -> None:
    r = await client.post(
        hub,
        data={"hub.mode": "subscribe", "hub.topic": topic, "hub.callback": callback, "hub.secret": secret},
    )
    assert r.status_code == 202, r.text


def signed_by(received: Received, secret: str) -> bool:
    method, _, digest = received.headers["x-hub-signature"].partition("=")
    algo = {"sha256": hashlib.sha256, "sha512": hashlib.sha512}[method]
    return hmac.compare_digest(hmac.new(secret.encode(), received.body, algo).hexdigest(), digest)


def payloads(received: list[Received]) -> list[tuple[Head, list[Entry]]]:
    return [parse_bytes(r.body) for r in received]


def back_to_back(heads: list[Head]) -> None:
    for a, b in itertools.pairwise(heads):
        assert a.md is not None and b.md is not None
        assert b.md.from_ == a.md.until, "consecutive change notifications must be back to back"
    for h in heads:
        assert h.md is not None and h.md.from_ is not None and h.md.until is not None
        assert h.md.from_ <= h.md.until


def topic_links(response: httpx.Response) -> dict[str, str]:
    return {params["rel"]: target for target, params in parse_link_header(response.headers.get("link"))}


# -- the chain ---------------------------------------------------------------------------------------


async def test_chain_upstream_a_b_c_through_embedded_hubs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """upstream -> A -> B -> C, polling hourly: a change at the upstream reaches C's Change List and
    content store by notification, hop by hop (each rsagg publishes what it applied)."""
    up = Upstream(changes_per_list=None)
    up.bulk_create(3)
    notifier = UpstreamNotifier(up)
    async with up.serving() as base, trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        await nursery.start(notifier.run)
        cfg_a = node_config(tmp_path / "a", f"{base}/.well-known/resourcesync", source=HOUR)
        async with rsagg_node(cfg_a) as (url_a, a):
            await wait_until(lambda: len(held(a)) == 3, "A's baseline")
            cfg_b = node_config(tmp_path / "b", f"{url_a}/.well-known/resourcesync", source=HOUR)
            async with rsagg_node(cfg_b) as (url_b, b):
                await wait_until(lambda: len(held(b)) == 3, "B's baseline")
                cfg_c = node_config(tmp_path / "c", f"{url_b}/.well-known/resourcesync", source=HOUR)
                async with rsagg_node(cfg_c) as (url_c, c):
                    await wait_until(lambda: len(held(c)) == 3, "C's baseline")
                    await settled(a, b, c)
                    # The first notification on each channel has no predecessor to continue: it is
                    # taken by polling once (notice.gap); afterwards notifications carry everything.
                    caplog.set_level(logging.INFO, logger="rsagg")
                    up.create("warm-up.txt", b"warm up")
                    await wait_until(lambda: len(held(c)) == 4, "warm-up at C")
                    await quiet(a, b, c)
                    assert "first notification" in caplog.text and "does not continue None" not in caplog.text
                    polls = [subscriber(x).counters["poll"] for x in (a, b, c)]
                    applied = [subscriber(x).counters["notice.applied"] for x in (a, b, c)]

                    up.create("new.txt", b"created upstream")
                    up.update("r000001.txt", b"updated upstream")
                    up.delete("r000002.txt")
                    c_new = rsagg_uri(url_b, "up", rsagg_uri(url_a, "up", up.url("new.txt")))
                    await wait_until(lambda: len(held(c)) == 4 and c_new in held(c), "the changes at C")
                    await quiet(a, b, c)

                    entries = await change_list(client, url_c, "up")
                    got = {(via(e), e.change) for e in entries}
                    assert (up.url("new.txt"), "created") in got
                    assert (up.url("r000001.txt"), "updated") in got
                    assert (up.url("r000002.txt"), "deleted") in got
                    assert content(c, c_new) == b"created upstream"
                    c_updated = rsagg_uri(url_b, "up", rsagg_uri(url_a, "up", up.url("r000001.txt")))
                    assert content(c, c_updated) == b"updated upstream"
                    # every hop took them from notifications, none from a poll
                    assert [subscriber(x).counters["poll"] for x in (a, b, c)] == polls
                    assert all(
                        subscriber(x).counters["notice.applied"] > n
                        for x, n in zip((a, b, c), applied, strict=True)
                    )
                    # each rsagg published back-to-back notifications of what it applied
                    r = await client.get(f"{url_b}/up/change-notification.xml")
                    head, _ = parse_bytes(r.content)
                    assert head.capability == CHANGE_NOTIFICATION and head.md is not None and head.md.until
        nursery.cancel_scope.cancel()


# -- flask-websub as the hub -------------------------------------------------------------------------


async def test_rsagg_follows_an_upstream_through_flask_websub(tmp_path: Path) -> None:
    with flask_hub(tmp_path / "hub") as hub_url:
        up = Upstream(changes_per_list=None)
        up.bulk_create(2)
        notifier = UpstreamNotifier(up, hub=hub_url)
        async with up.serving() as base, trio.open_nursery() as nursery:
            await nursery.start(notifier.run)
            cfg = node_config(tmp_path / "a", f"{base}/.well-known/resourcesync", source=HOUR)
            async with rsagg_node(cfg) as (_url, a):
                await settled(a)
                subs = subscriber(a).subscriptions()
                assert {s.hub for s in subs} == {hub_url}
                assert {s.kind for s in subs} == {CHANGE_NOTIFICATION, FRAMEWORK_NOTIFICATION}
                by_notice = 0
                for i in range(4):
                    before, polls = last_success(a), syncs(a)
                    up.create(f"n{i}.txt", f"note {i}".encode())
                    await wait_until(lambda i=i: len(held(a)) == 3 + i, f"n{i}.txt at A")
                    await quiet(a)
                    if syncs(a) == polls:  # no poll took this change: a notification did
                        by_notice += 1  # and "last success" moved with it, as with a poll
                        assert before is not None and last_success(a) > before
                counters = subscriber(a).counters
                assert counters["notice.applied"] >= 3, counters  # the first one went by polling
                assert by_notice >= 3
                assert counters["delivery.bad_signature"] == counters["delivery.unsigned"] == 0
            nursery.cancel_scope.cancel()


async def test_rsagg_publishes_through_flask_websub(tmp_path: Path) -> None:
    """A publishes its channels through flask-websub (generic ping, the hub fetches the topic): the
    tests' own subscriber and another rsagg (B) receive them from there."""
    up = Upstream(changes_per_list=None)
    up.bulk_create(2)
    notifier = UpstreamNotifier(up)
    with flask_hub(tmp_path / "hub") as hub_url:
        async with (
            up.serving() as base,
            trio.open_nursery() as nursery,
            httpx.AsyncClient() as client,
            mini_subscriber() as (mini, mini_base),
        ):
            await nursery.start(notifier.run)
            cfg_a = node_config(
                tmp_path / "a",
                f"{base}/.well-known/resourcesync",
                source=HOUR,
                notifications={"hub": hub_url},
            )
            async with rsagg_node(cfg_a) as (url_a, a):
                await wait_until(lambda: len(held(a)) == 2, "A's baseline")
                cl = parse_bytes((await client.get(f"{url_a}/up/capabilitylist.xml")).content)[1]
                channels = {
                    e.capability: e
                    for e in cl
                    if e.capability in (CHANGE_NOTIFICATION, FRAMEWORK_NOTIFICATION)
                }
                assert set(channels) == {CHANGE_NOTIFICATION, FRAMEWORK_NOTIFICATION}
                topic = channels[CHANGE_NOTIFICATION].loc
                assert [ln.href for ln in channels[CHANGE_NOTIFICATION].links if ln.rel == "hub"] == [hub_url]
                for method in ("GET", "HEAD"):
                    r = await client.request(method, topic)
                    assert r.status_code == 200 and r.headers["content-type"].startswith("application/xml")
                    assert topic_links(r) == {
                        "self": topic, "hub": hub_url, "resourcesync": f"{url_a}/up/capabilitylist.xml"
                    }  # fmt: skip
                mini.asked.add(topic)
                await subscribe(client, hub_url, topic, f"{mini_base}/cb/mini", "mini-secret")
                assert "mini" in mini.posts  # flask-websub verified before answering (eager tasks)

                cfg_b = node_config(tmp_path / "b", f"{url_a}/.well-known/resourcesync", source=HOUR)
                async with rsagg_node(cfg_b) as (_url_b, b):
                    await settled(a, b)
                    for i in range(3):
                        up.create(f"p{i}.txt", f"pushed {i}".encode())
                        await wait_until(lambda i=i: len(held(b)) == 3 + i, f"p{i}.txt at B")
                    await quiet(a, b)
                    assert subscriber(b).counters["notice.applied"] >= 2
                    await wait_until(
                        lambda: len(mini.posts["mini"]) >= 3, "deliveries to the mini subscriber"
                    )
                    got = mini.posts["mini"]
                    assert all(signed_by(p, "mini-secret") for p in got)
                    assert all(p.headers["x-hub-signature"].startswith("sha512=") for p in got)
                    heads = [h for h, _ in payloads(got)]
                    assert all(h.capability == CHANGE_NOTIFICATION and not h.is_index for h in heads)
                    back_to_back(heads)
                    announced = [via(e) for _, es in payloads(got) for e in es]
                    assert announced == [up.url(f"p{i}.txt") for i in range(3)]
            nursery.cancel_scope.cancel()


# -- rsagg's embedded hub with the tests' own subscriber ---------------------------------------------


async def test_embedded_hub_delivers_rsagg_notifications(tmp_path: Path) -> None:
    up = Upstream(changes_per_list=None)
    up.bulk_create(2)
    notifier = UpstreamNotifier(up)
    async with (
        up.serving() as base,
        trio.open_nursery() as nursery,
        httpx.AsyncClient() as client,
        mini_subscriber() as (mini, mini_base),
    ):
        await nursery.start(notifier.run)
        cfg = node_config(
            tmp_path / "a",
            f"{base}/.well-known/resourcesync",
            source=HOUR,
            notifications={"max_entries": 2},
        )
        cfg = replace(cfg, publish=replace(cfg.publish, changelist_size=4))
        async with rsagg_node(cfg) as (url, a):
            await settled(a)
            hub = f"{url}/hub"
            change_topic = f"{url}/up/change-notification.xml"
            framework_topic = f"{url}/up/framework-notification.xml"
            r = await client.get(change_topic)
            assert (
                r.status_code == 200
                and topic_links(r)["hub"] == hub
                and topic_links(r)["self"] == change_topic
            )
            assert (await client.get(f"{url}/nope/change-notification.xml")).status_code == 404
            mini.asked |= {change_topic, framework_topic}
            await subscribe(client, hub, change_topic, f"{mini_base}/cb/changes", "s1")
            await subscribe(client, hub, framework_topic, f"{mini_base}/cb/framework", "s2")
            assert a.notifications is not None and a.notifications.hub is not None
            hub_obj = a.notifications.hub
            await wait_until(lambda: len(hub_obj.subscriptions()) == 2, "the hub's subscriptions")

            before = log_size(a)
            for i in range(5):  # one batch at the upstream, more entries than max_entries
                up.create(f"b{i}.txt", f"burst {i}".encode())
            await wait_until(lambda: log_size(a) >= before + 5, "the burst at A")
            await wait_until(
                lambda: sum(len(es) for _, es in payloads(mini.posts.get("changes", []))) >= 5,
                "the notifications",
            )
            got = mini.posts["changes"]
            assert all(signed_by(p, "s1") and p.headers["x-hub-signature"].startswith("sha256=") for p in got)
            heads = [h for h, _ in payloads(got)]
            back_to_back(heads)
            sizes = [len(es) for _, es in payloads(got)]
            assert max(sizes) <= 2 * 2  # max_entries, extended at most to the end of a same-time group
            # the same entries as A's Change List, in its order
            listed = [
                e
                for e in await change_list(client, url, "up")
                if e.loc.endswith(tuple(f"b{i}.txt" for i in range(5)))
            ]
            notified = [e for _, es in payloads(got) for e in es]
            assert [(e.loc, e.change, e.md.datetime if e.md else None) for e in notified] == [
                (e.loc, e.change, e.md.datetime if e.md else None) for e in listed
            ]
            # changelist_size = 4: the changelog opened new windows -> framework notifications
            await wait_until(lambda: mini.posts.get("framework"), "a framework notification", limit=15)
            fw = [e for _, es in payloads(mini.posts["framework"]) for e in es]
            assert all(signed_by(p, "s2") for p in mini.posts["framework"])
            windows = [e for e in fw if e.capability == "changelist"]
            assert any(e.change == "created" for e in windows)
            assert all(
                ln.rel == "index" and ln.href == f"{url}/up/changelist.xml" for e in windows for ln in e.links
            )
        nursery.cancel_scope.cancel()


# -- security --------------------------------------------------------------------------------------------


def _payload(sub_topic: str, loc: str, from_: str, until: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" xmlns:rs="http://www.openarchives.org/rs/terms/">'
        f'<rs:md capability="change-notification" from="{from_}" until="{until}"/>'
        f'<url><loc>{loc}</loc><rs:md change="created" datetime="{until}"/></url></urlset>'
    ).encode()


BOMB = (
    b'<?xml version="1.0"?>\n<!DOCTYPE lolz [<!ENTITY lol "lol">'
    b'<!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">'
    b'<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">'
    b'<!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">]>'
    b'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" xmlns:rs="http://www.openarchives.org/rs/terms/">'
    b'<rs:md capability="change-notification" from="2024-01-01T00:00:00Z" until="2030-01-01T00:00:00Z"/>'
    b"<url><loc>&lol4;</loc></url></urlset>"
)


def _sign(secret: str, body: bytes, algo: str = "sha256") -> str:
    return f"{algo}=" + hmac.new(secret.encode(), body, getattr(hashlib, algo)).hexdigest()


async def test_forged_unsigned_unknown_and_hostile_deliveries_are_rejected(tmp_path: Path) -> None:
    up = Upstream(changes_per_list=None)
    up.bulk_create(2)
    notifier = UpstreamNotifier(up)
    async with up.serving() as base, trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        await nursery.start(notifier.run)
        cfg = node_config(tmp_path / "a", f"{base}/.well-known/resourcesync", source=HOUR)
        async with rsagg_node(cfg) as (url, a):
            await settled(a)
            up.create("first.txt", b"first")  # takes the channel past its first notice
            await wait_until(lambda: len(held(a)) == 3, "first.txt")
            await quiet(a)
            await wait_until(
                lambda: all(
                    s.last_until for s in subscriber(a).subscriptions() if s.kind == CHANGE_NOTIFICATION
                ),
                "continuity",
            )
            sub = next(s for s in subscriber(a).subscriptions() if s.kind == CHANGE_NOTIFICATION)
            assert sub.last_until is not None
            notifier.pause()  # the upstream changes, but A hears nothing: only a forgery could tell it
            up.create("target.txt", b"must not arrive by a forgery")
            target = up.url("target.txt")
            body = _payload(sub.topic, target, format_w3c(sub.last_until), format_w3c(utcnow()))
            callback = f"{url}{CALLBACK_PREFIX}{sub.token}"
            counters = subscriber(a).counters
            size = log_size(a)

            cases = [
                ({"X-Hub-Signature": _sign("not-the-secret", body)}, "delivery.bad_signature"),
                ({"X-Hub-Signature": _sign(sub.secret, body + b" ")}, "delivery.bad_signature"),
                ({"X-Hub-Signature": _sign(sub.secret, body, "sha1")}, "delivery.bad_signature"),  # sha1 off
                ({}, "delivery.unsigned"),
            ]
            for headers, counter in cases:
                n = counters[counter]
                r = await client.post(
                    callback, content=body, headers={"Content-Type": "application/xml", **headers}
                )
                assert r.status_code == 202  # acknowledged (WebSub §7.1), ignored
                assert counters[counter] == n + 1
            r = await client.post(
                f"{url}{CALLBACK_PREFIX}{'x' * 43}",
                content=body,
                headers={"Content-Type": "application/xml", "X-Hub-Signature": _sign(sub.secret, body)},
            )
            assert r.status_code == 410 and counters["delivery.unknown_callback"] == 1

            # verification requests we never asked for: unknown callback, other topic, no pending request
            refused = counters["verify.refused"]
            for cb, topic in [
                (f"{url}{CALLBACK_PREFIX}{'y' * 43}", sub.topic),
                (callback, f"{base}/elsewhere/change-notification.xml"),
                (callback, sub.topic),
            ]:
                params = {
                    "hub.mode": "subscribe",
                    "hub.topic": topic,
                    "hub.challenge": "c-123",
                    "hub.lease_seconds": "60",
                }
                r = await client.get(cb, params=params)
                assert r.status_code == 404 and "c-123" not in r.text
            assert counters["verify.refused"] == refused + 3

            await trio.sleep(0.3)  # whatever was queued had its chance
            assert target not in held(a) and log_size(a) == size
            applied = counters["notice.applied"]

            # a correctly signed XML bomb: refused by the parser, counted; A falls back to its Change List
            polls = counters["poll"]
            r = await client.post(
                callback,
                content=BOMB,
                headers={"Content-Type": "application/xml", "X-Hub-Signature": _sign(sub.secret, BOMB)},
            )
            assert r.status_code == 202 and counters["delivery.parse_error"] == 1
            await wait_until(lambda: counters["poll"] > polls, "the fallback poll")
            await wait_until(lambda: target in held(a), "target.txt through the Change List")
            await quiet(a)
            assert counters["notice.applied"] == applied  # nothing came from a payload
            assert log_size(a) == size + 1
        nursery.cancel_scope.cancel()


# -- falling back, framework notifications, leases ----------------------------------------------------


async def test_a_missed_notification_makes_rsagg_poll(tmp_path: Path) -> None:
    up = Upstream(changes_per_list=None)
    up.bulk_create(1)
    notifier = UpstreamNotifier(up)
    async with up.serving() as base, trio.open_nursery() as nursery:
        await nursery.start(notifier.run)
        cfg = node_config(tmp_path / "a", f"{base}/.well-known/resourcesync", source=HOUR)
        async with rsagg_node(cfg) as (_url, a):
            await settled(a)
            up.create("one.txt", b"1")
            await wait_until(lambda: len(held(a)) == 2, "one.txt")
            await quiet(a)
            counters = subscriber(a).counters
            gaps, polls = counters["notice.gap"], counters["poll"]
            notifier.pause()
            up.create("lost.txt", b"its notification is lost")
            notifier.resume()
            up.create("after.txt", b"the next notification does not continue the last one A saw")
            await wait_until(lambda: len(held(a)) == 4, "lost.txt and after.txt")
            await quiet(a)
            assert counters["notice.gap"] == gaps + 1 and counters["poll"] == polls + 1
            up.create("again.txt", b"continuity restored")
            await wait_until(lambda: len(held(a)) == 5, "again.txt")
            await quiet(a)
            assert counters["poll"] == polls + 1
        nursery.cancel_scope.cancel()


async def test_framework_notification_makes_rsagg_refetch(tmp_path: Path) -> None:
    up = Upstream(changes_per_list=3)
    up.bulk_create(1)
    notifier = UpstreamNotifier(up)
    async with up.serving() as base, trio.open_nursery() as nursery:
        await nursery.start(notifier.run)
        cfg = node_config(tmp_path / "a", f"{base}/default/capabilitylist.xml", source=HOUR)
        async with rsagg_node(cfg) as (_url, a):
            await settled(a)
            counters = subscriber(a).counters
            fetched = up.counts["/default/capabilitylist.xml"]
            for i in range(3):  # the third change closes the open Change List: a framework notification
                up.create(f"f{i}.txt", b"x")
            await wait_until(lambda: counters["notice.framework"] >= 1, "the framework notification")
            await wait_until(lambda: up.counts["/default/capabilitylist.xml"] > fetched, "the refetch")
            await wait_until(lambda: len(held(a)) == 4, "everything")
        nursery.cancel_scope.cancel()


async def test_leases_are_renewed_and_a_removed_source_unsubscribes(tmp_path: Path) -> None:
    with flask_hub(tmp_path / "hub") as hub_url:
        up = Upstream(changes_per_list=None)
        up.bulk_create(1)
        notifier = UpstreamNotifier(up, hub=hub_url)
        async with up.serving() as base, trio.open_nursery() as nursery:
            await nursery.start(notifier.run)
            cfg = node_config(
                tmp_path / "a",
                f"{base}/.well-known/resourcesync",
                source=HOUR,
                notifications={"lease_seconds": 2},
            )
            async with rsagg_node(cfg) as (_url, a):
                await wait_until(lambda: all_live(a), "subscribed")
                sub = subscriber(a)
                first = {s.token: s.lease_expires for s in sub.subscriptions()}
                await wait_until(
                    lambda: sub.counters["renewals"] >= 2, "renewals before the leases end", limit=10
                )
                assert all(s.lease_expires > first[s.token] for s in sub.subscriptions() if s.token in first)
                assert all_live(a)

                def hub_rows() -> int:
                    with sqlite3.connect(tmp_path / "hub" / "hub.db") as c:
                        return c.execute("SELECT COUNT(*) FROM hub").fetchone()[0]

                assert hub_rows() == 2
                a.config = replace(a.config, sources=())  # what a reload without the source leaves
                sub.wake()
                await wait_until(lambda: not sub.subscriptions(), "unsubscribed and forgotten")
                assert sub.counters["verify.unsubscribed"] == 2
                await wait_until(lambda: hub_rows() == 0, "the hub dropped them")  # after its verification
            nursery.cancel_scope.cancel()


DUMP_CAPABILITIES = {RESOURCEDUMP, CHANGEDUMP, RESOURCEDUMP_ARCHIVE, CHANGEDUMP_ARCHIVE}


async def test_notifications_off_means_no_channels(tmp_path: Path) -> None:
    up = Upstream(changes_per_list=None)
    up.bulk_create(1)
    notifier = UpstreamNotifier(up)
    async with up.serving() as base, trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        await nursery.start(notifier.run)
        cfg = node_config(
            tmp_path / "a", f"{base}/.well-known/resourcesync", notifications={"enabled": False}, source=HOUR
        )
        async with rsagg_node(cfg) as (url, a):
            await wait_until(lambda: len(held(a)) == 1, "baseline")
            assert a.notifications is None
            cl = parse_bytes((await client.get(f"{url}/up/capabilitylist.xml")).content)[1]
            capabilities = {e.capability for e in cl}
            # Dumps (and their archives) are built in the background and may be listed or not yet: no
            # notification channel either way (§9: one Capability List entry per capability offered).
            assert {"resourcelist", "changelist"} <= capabilities
            assert capabilities <= {"resourcelist", "changelist", *DUMP_CAPABILITIES}
            assert not capabilities & {CHANGE_NOTIFICATION, FRAMEWORK_NOTIFICATION}
            assert (await client.get(f"{url}/up/change-notification.xml")).status_code == 404
            assert (await client.post(f"{url}/hub", data={"hub.mode": "subscribe"})).status_code in (404, 405)
        nursery.cancel_scope.cancel()


def test_framework_differences_name_created_updated_deleted_documents() -> None:
    from aggregator.websub.notifier import _differences

    now = utcnow()
    index = "http://r.example/s/changelist.xml"
    old = {
        "http://r.example/s/capabilitylist.xml": ["capabilitylist", "a", None],
        "http://r.example/s/changelist/1.xml": ["changelist", "open", index],
        "http://r.example/s/resourcedump.xml": ["resourcedump", "run-1", None],
        "http://r.example/gone/capabilitylist.xml": ["capabilitylist", "x", None],
    }
    new = {
        "http://r.example/s/capabilitylist.xml": ["capabilitylist", "a", None],  # unchanged: not sent
        "http://r.example/s/changelist/1.xml": ["changelist", "closed", index],
        "http://r.example/s/changelist/2.xml": ["changelist", "open", index],
        "http://r.example/s/resourcedump.xml": ["resourcedump", "run-2", None],  # rebuilt, same URL
    }
    got = {
        (e.loc.rsplit("/", 2)[-2] + "/" + e.loc.rsplit("/", 1)[-1], e.change, e.capability): e
        for e in _differences(old, new, now)
    }
    assert set(got) == {
        ("changelist/1.xml", "updated", "changelist"),
        ("changelist/2.xml", "created", "changelist"),
        ("s/resourcedump.xml", "updated", "resourcedump"),
        ("gone/capabilitylist.xml", "deleted", "capabilitylist"),
    }
    assert [(ln.rel, ln.href) for ln in got[("changelist/2.xml", "created", "changelist")].links] == [
        ("index", index)
    ]
    assert all(e.md is not None and e.md.datetime == now for e in got.values())


def test_signature_methods_sha256_or_stronger_and_sha1_only_when_configured() -> None:
    from types import SimpleNamespace

    from aggregator.websub.subscriber import Subscription

    body = b"<urlset/>"
    sub = Subscription(1, "t", "the-secret", "up", "cl", CHANGE_NOTIFICATION, "topic", "hub")

    def problem(header: str | None, accept_sha1: bool = False) -> str | None:
        config = SimpleNamespace(notifications=SimpleNamespace(accept_sha1=accept_sha1))
        fake = SimpleNamespace(get_config=lambda: config)
        return Subscriber._signature_problem(fake, sub, header, body)  # type: ignore[arg-type]

    for algo in ("sha256", "sha384", "sha512"):
        assert problem(_sign("the-secret", body, algo)) is None
        assert (
            problem(_sign("the-secret", body, algo).upper().replace(algo.upper(), algo)) is None
        )  # hex case
        assert problem(_sign("wrong", body, algo)) == "delivery.bad_signature"
    assert problem(_sign("the-secret", body, "sha1")) == "delivery.bad_signature"
    assert problem(_sign("the-secret", body, "sha1"), accept_sha1=True) is None
    assert problem("md5=" + hashlib.md5(body).hexdigest()) == "delivery.bad_signature"
    assert problem(None) == problem("") == "delivery.unsigned"


async def test_a_topic_answers_as_soon_as_its_set_is_advertised(tmp_path: Path) -> None:
    """The Capability List is a view of the state and may name a new set's channels before the notifier's
    next round: the topic must answer then (a hub fetching it, or a subscriber checking it, got 404)."""
    from aggregator.store.blobs import FileBlobStore
    from aggregator.websub.notifier import Notifier

    from .harvesting import harvest, make_config

    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(2)
    async with up.serving() as base:
        config = make_config(tmp_path / "data", {"up": base})
        assert (await harvest(config))["up"].ok
    async with httpx.AsyncClient() as pings:  # an external hub: never pinged, no round runs
        blobs = FileBlobStore(config.store_path / "blobs")
        hub = "http://hub.test/hub"
        views = published_views(load_plugins, None)
        notifier = Notifier(
            lambda: config, open_state(config), blobs, view_of=views, hub_url=hub, hub=None, client=pings
        )
        try:
            app = Starlette(routes=notifier.routes())  # no round has run: the notifier knows no set yet
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.get("/up/change-notification.xml")
                assert r.status_code == 200 and r.headers["content-type"].startswith("application/xml")
                assert topic_links(r)["self"].endswith("/up/change-notification.xml")
                assert (await c.get("/nothing/change-notification.xml")).status_code == 404
        finally:
            await notifier.aclose()
            blobs.close()
