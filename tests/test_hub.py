"""The embedded WebSub hub against a minimal subscriber of our own, over real HTTP on 127.0.0.1.

The subscriber (a starlette app) answers verification GETs as each test tells it (echo the challenge,
echo something else, 404), records every GET and POST, and answers POSTs with statuses the test queues.
Signatures are checked here with ``hmac`` independently of the hub's own helper.
"""

from __future__ import annotations

import hashlib
import hmac
import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from aggregator.rs.linkheader import parse_link_header
from aggregator.rs.w3cdt import utcnow
from aggregator.store.open import connect
from aggregator.websub import hub as hub_module
from aggregator.websub.hub import Hub, HubLimits, delivery_client, topics_under
from tests.httpserver import serve_app

TOKEN = "s3cret-publish-token"
PAYLOAD = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" '
    b'xmlns:rs="http://www.openarchives.org/rs/terms/"><rs:md capability="change-notification" '
    b'from="2024-05-01T12:00:00Z" until="2024-05-01T12:01:00Z"/></urlset>\n'
)
FAST = HubLimits(backoff_base=0.01, backoff_max=0.05, request_timeout=5.0, poll_interval=0.5)


class Clock:
    """The real clock plus an offset the test moves forward (lease expiry without waiting)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> datetime:
        return utcnow() + timedelta(seconds=self.offset)


@dataclass
class Post:
    name: str
    headers: dict[str, str]
    body: bytes
    status: int


@dataclass
class Subscriber:
    """Callbacks at /cb/NAME. ``answer[NAME]``: "echo" (default), "wrong", "newline" or "404"."""

    answer: dict[str, str] = field(default_factory=dict)
    statuses: dict[str, list[int]] = field(default_factory=dict)  # POST answers to give next
    gets: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)
    posts: list[Post] = field(default_factory=list)

    async def callback_get(self, request: Request) -> Response:
        name = request.path_params["name"]
        params = list(request.query_params.multi_items())
        self.gets.append((name, params))
        q = request.query_params
        if q.get("hub.mode") == "denied":
            return PlainTextResponse("ok")
        how = self.answer.get(name, "echo")
        if how == "404":
            return PlainTextResponse("not mine", status_code=404)
        challenge = q["hub.challenge"]
        body = {"echo": challenge, "wrong": "something else", "newline": challenge + "\n"}[how]
        return PlainTextResponse(body, headers={"X-Content-Type-Options": "nosniff"})

    async def callback_post(self, request: Request) -> Response:
        name = request.path_params["name"]
        queued = self.statuses.get(name) or []
        status = queued.pop(0) if queued else 204
        self.posts.append(Post(name, dict(request.headers), await request.body(), status))
        return Response(status_code=status)

    def received(self, name: str) -> list[Post]:
        """The deliveries this callback accepted (2xx)."""
        return [p for p in self.posts if p.name == name and 200 <= p.status < 300]

    def verifications(self, name: str) -> list[dict[str, str]]:
        return [dict(params) for n, params in self.gets if n == name]


@dataclass
class Harness:
    base: str
    hub_url: str
    topic: str  # a topic served by the test app (generic publishing fetches it)
    sub: Subscriber
    client: httpx.AsyncClient
    clock: Clock
    db: Path
    metrics: list[tuple[str, str]]
    hub: Hub = None  # type: ignore[assignment]
    _worker: tuple[trio.CancelScope, trio.Event] | None = None
    _nursery: trio.Nursery = None  # type: ignore[assignment]

    def callback(self, name: str, query: str = "") -> str:
        return f"{self.base}/cb/{name}{query}"

    def count(self, event: str, outcome: str) -> int:
        return self.metrics.count((event, outcome))

    async def subscribe(self, name: str, topic: str | None = None, **extra: str) -> httpx.Response:
        data = {
            "hub.mode": "subscribe",
            "hub.topic": topic or self.topic,
            "hub.callback": self.callback(name),
        }
        data.update({f"hub.{k}": v for k, v in extra.items()})
        return await self.client.post(self.hub_url, data=data)

    async def publish_payload(self, body: bytes = PAYLOAD, topic: str | None = None) -> httpx.Response:
        link = (
            f'<{topic or self.topic}>; rel="self", <{self.hub_url}>; rel="hub", '
            f'<{self.base}/cl.xml>; rel="resourcesync"'
        )
        headers = {"Content-Type": "application/xml", "Link": link, "Authorization": f"Bearer {TOKEN}"}
        return await self.client.post(self.hub_url, content=body, headers=headers)

    def open_hub(self, **kw: Any) -> Hub:
        kw.setdefault("limits", FAST)
        kw.setdefault("publish_token", TOKEN)
        self.hub = Hub(
            connect(self.db),
            client=kw.pop("client", None) or delivery_client(kw.get("policy"), kw.get("limits")),
            hub_url=self.hub_url,
            allowed_topic=topics_under(self.base),
            metrics=lambda e, o: self.metrics.append((e, o)),
            clock=self.clock,
            **kw,
        )
        self._hub_app = Starlette(routes=self.hub.routes())
        return self.hub

    async def start_worker(self) -> None:
        scope, done = trio.CancelScope(), trio.Event()

        async def worker(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                with scope:
                    await self.hub.run(task_status=task_status)
            finally:
                done.set()

        await self._nursery.start(worker)
        self._worker = (scope, done)

    async def stop_worker(self) -> None:
        """Cancel the worker and wait until it has really stopped (its last database call included)."""
        if self._worker is not None:
            scope, done = self._worker
            scope.cancel()
            await done.wait()
            self._worker = None


async def wait_until(cond: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    """Poll ``cond`` (a hang guard, not a timing assertion: the limit is far above any real need)."""
    with trio.move_on_after(limit):
        while not cond():
            await trio.sleep(0.005)
        return
    raise AssertionError(f"gave up waiting for: {what}")


@asynccontextmanager
async def harness(tmp_path: Path, *, worker: bool = True, **hub_kw: Any) -> AsyncIterator[Harness]:
    sub = Subscriber()
    topic_headers: dict[str, str] = {}

    async def topic(request: Request) -> Response:
        return Response(PAYLOAD, media_type="application/xml", headers=topic_headers)

    async def redirect(request: Request) -> Response:
        return Response(status_code=302, headers={"Location": "/topics/a"})

    test_app = Starlette(
        routes=[
            Route("/cb/{name}", sub.callback_get, methods=["GET"]),
            Route("/cb/{name}", sub.callback_post, methods=["POST"]),
            Route("/topics/{name}", topic, methods=["GET"]),
            Route("/redirect", redirect),
        ]
    )
    holder: dict[str, Harness] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        # /hub goes to the current hub's own routes (a restart swaps the Hub object underneath)
        h = holder.get("h")
        target = h._hub_app if h is not None and scope.get("path", "").startswith("/hub") else test_app
        await target(scope, receive, send)

    error: BaseException | None = None  # the test's own failure leaves as itself, not in a group
    async with (
        serve_app(app) as base,
        httpx.AsyncClient(timeout=10) as client,
        trio.open_nursery() as nursery,
    ):
        topic_url = f"{base}/topics/a"
        topic_headers["Link"] = (
            f'<{base}/hub>; rel="hub", <{topic_url}>; rel="self", <{base}/cl.xml>; rel="resourcesync"'
        )
        h = Harness(base, f"{base}/hub", topic_url, sub, client, Clock(), tmp_path / "state.db", [])
        h._nursery = nursery
        h.open_hub(**hub_kw)
        holder["h"] = h
        try:
            if worker:
                await h.start_worker()
            yield h
        except BaseException as exc:
            error = exc
        finally:
            await h.stop_worker()
            await h.hub.aclose()
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error


def assert_signed(post: Post, secret: str) -> None:
    expected = hmac.new(secret.encode(), post.body, hashlib.sha256).hexdigest()
    assert post.headers.get("x-hub-signature") == f"sha256={expected}"


def link_rels(post: Post) -> dict[str, str]:
    return {params["rel"]: target for target, params in parse_link_header(post.headers.get("link"))}


async def subscribed(h: Harness, name: str, **extra: str) -> None:
    r = await h.subscribe(name, **extra)
    assert r.status_code == 202, r.text
    await wait_until(
        lambda: any(s["callback"] == h.callback(name) for s in h.hub.subscriptions()), f"{name} in"
    )


# -- the whole flow ----------------------------------------------------------------------------------


async def test_subscribe_verify_then_publish_both_ways(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await subscribed(h, "a", secret="a-secret")
        await subscribed(h, "b")  # no secret: unsigned deliveries
        va, vb = h.sub.verifications("a")[0], h.sub.verifications("b")[0]
        assert va["hub.mode"] == "subscribe" and va["hub.topic"] == h.topic
        assert va["hub.lease_seconds"] == str(FAST.lease_default)
        assert len(va["hub.challenge"]) >= 32 and va["hub.challenge"] != vb["hub.challenge"]
        subs = {s["callback"]: s for s in h.hub.subscriptions()}
        assert subs[h.callback("a")]["has_secret"] and not subs[h.callback("b")]["has_secret"]
        assert subs[h.callback("a")]["lease_seconds"] == FAST.lease_default
        await wait_until(lambda: h.count("verification", "subscribed") == 2, "metrics")

        # generic WebSub: ping, the hub fetches the topic
        r = await h.client.post(h.hub_url, data={"hub.mode": "publish", "hub.topic": h.topic})
        assert r.status_code == 202, r.text
        await wait_until(
            lambda: len(h.sub.received("a")) == 1 and len(h.sub.received("b")) == 1, "ping fan-out"
        )
        # ResourceSync: the payload itself
        body2 = PAYLOAD.replace(b"12:01:00Z", b"12:02:00Z")
        r = await h.publish_payload(body2)
        assert r.status_code == 202, r.text
        # in-process (rsagg's own notifications)
        body3 = PAYLOAD.replace(b"12:01:00Z", b"12:03:00Z")
        assert await h.hub.publish(h.topic, body3, resourcesync=[f"{h.base}/cl.xml"]) == 2
        await wait_until(lambda: len(h.sub.received("a")) == 3 and len(h.sub.received("b")) == 3, "fan-out")

        for name in ("a", "b"):
            posts = h.sub.received(name)
            assert [p.body for p in posts] == [PAYLOAD, body2, body3]  # in publication order
            for p in posts:
                assert p.headers["content-type"].startswith("application/xml")
                assert link_rels(p) == {"hub": h.hub_url, "self": h.topic, "resourcesync": f"{h.base}/cl.xml"}
        for p in h.sub.received("a"):
            assert_signed(p, "a-secret")
        assert all("x-hub-signature" not in p.headers for p in h.sub.received("b"))
        await wait_until(lambda: h.count("delivery", "ok") == 6, "6 deliveries recorded")
        assert h.hub.pending() == {"verifications": 0, "deliveries": 0}


async def test_publish_without_subscribers_queues_nothing(tmp_path: Path) -> None:
    async with harness(tmp_path, worker=False) as h:
        assert await h.hub.publish(h.topic, PAYLOAD) == 0
        r = await h.publish_payload()
        assert r.status_code == 202 and "0 deliveries" in r.text
        assert h.hub.pending() == {"verifications": 0, "deliveries": 0}


# -- verification of intent ---------------------------------------------------------------------------


@pytest.mark.parametrize("answer", ["wrong", "newline", "404"])
async def test_failed_verification_does_not_subscribe(tmp_path: Path, answer: str) -> None:
    async with harness(tmp_path) as h:
        h.sub.answer["a"] = answer
        r = await h.subscribe("a")
        assert r.status_code == 202
        await wait_until(lambda: h.count("verification", "failed") == 1, "verification failed")
        assert len(h.sub.verifications("a")) == 1
        assert h.hub.subscriptions() == []
        assert h.hub.pending()["verifications"] == 0


async def test_unsubscribe_is_verified_too(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await subscribed(h, "a")
        # a forged unsubscription (the subscriber does not confirm it) changes nothing (WebSub §5.1)
        h.sub.answer["a"] = "404"
        r = await h.client.post(
            h.hub_url, data={"hub.mode": "unsubscribe", "hub.topic": h.topic, "hub.callback": h.callback("a")}
        )
        assert r.status_code == 202
        await wait_until(lambda: h.count("verification", "failed") == 1, "refused unsubscribe")
        assert len(h.hub.subscriptions()) == 1

        h.sub.answer["a"] = "echo"
        r = await h.client.post(
            h.hub_url, data={"hub.mode": "unsubscribe", "hub.topic": h.topic, "hub.callback": h.callback("a")}
        )
        assert r.status_code == 202
        await wait_until(lambda: h.hub.subscriptions() == [], "unsubscribed")
        last = h.sub.verifications("a")[-1]
        assert last["hub.mode"] == "unsubscribe" and "hub.lease_seconds" not in last and last["hub.challenge"]
        assert await h.hub.publish(h.topic, PAYLOAD) == 0


async def test_callback_query_is_kept_and_renewal_takes_the_new_secret(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        callback = h.callback("a", "?id=7&hub.mode=mine")
        data = {"hub.mode": "subscribe", "hub.topic": h.topic, "hub.callback": callback, "hub.secret": "one"}
        assert (await h.client.post(h.hub_url, data=data)).status_code == 202
        await wait_until(lambda: len(h.hub.subscriptions()) == 1, "subscribed")
        params = h.sub.gets[0][1]
        # WebSub §5.1.1: the callback's own parameters stay, ours are appended (none overwritten)
        assert params[:2] == [("id", "7"), ("hub.mode", "mine")]
        assert ("hub.mode", "subscribe") in params[2:]

        data["hub.secret"] = "two"
        assert (await h.client.post(h.hub_url, data=data)).status_code == 202
        await wait_until(lambda: h.count("verification", "subscribed") == 2, "renewed")
        assert len(h.hub.subscriptions()) == 1
        assert await h.hub.publish(h.topic, PAYLOAD) == 1
        await wait_until(lambda: len(h.sub.received("a")) == 1, "delivered")
        assert_signed(h.sub.received("a")[0], "two")


async def test_disallowed_topic_is_denied(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        elsewhere = "http://elsewhere.invalid/feed"
        r = await h.subscribe("a", topic=elsewhere)
        assert r.status_code == 202  # WebSub §5.1.2/§5.2: refusal is told to the callback, asynchronously
        await wait_until(lambda: h.count("verification", "denied") == 1, "denied")
        (v,) = h.sub.verifications("a")
        assert v["hub.mode"] == "denied" and v["hub.topic"] == elsewhere and v["hub.reason"]
        assert "hub.challenge" not in v
        assert h.hub.subscriptions() == []
        # neither way of publishing relays a foreign topic
        r = await h.client.post(h.hub_url, data={"hub.mode": "publish", "hub.topic": elsewhere})
        assert r.status_code == 403
        r = await h.publish_payload(topic=elsewhere)
        assert r.status_code == 403
        # nor a topic that only looks like ours
        r = await h.client.post(h.hub_url, data={"hub.mode": "publish", "hub.topic": h.base + ".evil.org/x"})
        assert r.status_code in (400, 403)


# -- leases -----------------------------------------------------------------------------------------


async def test_leases_are_clamped_and_expire(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await subscribed(h, "long", lease_seconds="9" * 5000)
        await subscribed(h, "short", lease_seconds="5")
        assert h.sub.verifications("long")[0]["hub.lease_seconds"] == str(FAST.lease_max)
        assert h.sub.verifications("short")[0]["hub.lease_seconds"] == str(FAST.lease_min)
        leases = {s["callback"]: s for s in h.hub.subscriptions()}
        short = leases[h.callback("short")]
        assert timedelta(0) < short["lease_expires"] - short["verified"] <= timedelta(seconds=FAST.lease_min)

        h.clock.offset = FAST.lease_min + 1
        h.hub.wake()
        await wait_until(lambda: len(h.hub.subscriptions()) == 1, "short lease purged")
        assert h.hub.subscriptions()[0]["callback"] == h.callback("long")
        await wait_until(lambda: h.count("subscription", "expired") == 1, "metric")
        assert await h.hub.publish(h.topic, PAYLOAD) == 1
        await wait_until(lambda: len(h.sub.received("long")) == 1, "delivered to long")
        assert h.sub.received("short") == []

        h.clock.offset = FAST.lease_max + 1
        h.hub.wake()
        await wait_until(lambda: h.hub.subscriptions() == [], "long lease purged")
        assert await h.hub.publish(h.topic, PAYLOAD) == 0


async def test_expired_subscription_gets_nothing_even_before_purge(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await subscribed(h, "a", lease_seconds="60")
        await h.stop_worker()  # nobody purges
        h.clock.offset = 61
        assert await h.hub.publish(h.topic, PAYLOAD) == 0


# -- delivery ---------------------------------------------------------------------------------------


async def test_gone_removes_the_subscription(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await subscribed(h, "a")
        h.sub.statuses["a"] = [410]
        assert await h.hub.publish(h.topic, PAYLOAD) == 1
        await wait_until(lambda: h.count("delivery", "gone") == 1, "410 seen")
        assert h.hub.subscriptions() == []
        assert h.hub.pending()["deliveries"] == 0
        assert await h.hub.publish(h.topic, PAYLOAD) == 0


async def test_failures_are_retried_in_order_until_delivered(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await subscribed(h, "a", secret="k")
        h.sub.statuses["a"] = [500, 503]
        first, second = PAYLOAD, PAYLOAD.replace(b"12:01:00Z", b"12:02:00Z")
        assert await h.hub.publish(h.topic, first) == 1
        assert await h.hub.publish(h.topic, second) == 1
        await wait_until(lambda: len(h.sub.received("a")) == 2, "both delivered")
        # the second waits for the first: a Destination never sees them out of order
        assert [(p.body, p.status) for p in h.sub.posts] == [
            (first, 500),
            (first, 503),
            (first, 204),
            (second, 204),
        ]
        for p in h.sub.posts:
            assert_signed(p, "k")
        await wait_until(lambda: h.count("delivery", "ok") == 2, "metrics")
        assert h.count("delivery", "retry") == 2
        assert h.hub.pending()["deliveries"] == 0


async def test_delivery_is_not_retried_past_the_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The jitter pinned to the top of its range (retry.py draws from [0, base * 2**attempt]): the retry
    # would be due after the lease ends, so it is not made.
    monkeypatch.setattr(hub_module, "backoff", lambda attempt, *, base, cap, retry_after=None: min(cap, base))
    slow = HubLimits(backoff_base=1000.0, backoff_max=2000.0, request_timeout=5.0, poll_interval=0.5)
    async with harness(tmp_path, limits=slow) as h:
        await subscribed(h, "a", lease_seconds="60")
        h.sub.statuses["a"] = [500]
        assert await h.hub.publish(h.topic, PAYLOAD) == 1
        await wait_until(lambda: h.count("delivery", "failed") == 1, "given up")
        assert h.hub.pending()["deliveries"] == 0
        assert len(h.hub.subscriptions()) == 1  # WebSub §7: the subscription stays until its lease ends


async def test_unreachable_callback_is_retried(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await subscribed(h, "a")
        with sqlite3.connect(h.db) as c:  # point the subscription at a port nobody listens on
            c.execute("UPDATE hub_subscriptions SET callback = 'http://127.0.0.1:9/cb'")
        assert await h.hub.publish(h.topic, PAYLOAD) == 1
        await wait_until(lambda: h.count("delivery", "retry") >= 2, "retried")
        assert h.hub.pending()["deliveries"] == 1


async def test_pending_deliveries_are_capped_per_subscription(tmp_path: Path) -> None:
    capped = HubLimits(max_pending_per_subscription=2)
    async with harness(tmp_path, limits=capped) as h:
        await subscribed(h, "a")
        await h.stop_worker()
        bodies = [PAYLOAD.replace(b"12:01:00Z", f"12:0{i}:00Z".encode()) for i in range(1, 4)]
        for b in bodies:
            assert await h.hub.publish(h.topic, b) == 1
        assert h.hub.pending()["deliveries"] == 2
        assert h.count("delivery", "dropped") == 1
        await h.start_worker()
        await wait_until(lambda: len(h.sub.received("a")) == 2, "delivered")
        assert [p.body for p in h.sub.received("a")] == bodies[1:]  # the oldest was dropped
        await wait_until(lambda: h.count("delivery", "ok") == 2, "metrics")
        with sqlite3.connect(h.db) as c:  # payloads delivered to everyone are not kept
            assert c.execute("SELECT COUNT(*) FROM hub_payloads").fetchone()[0] == 0


# -- persistence ------------------------------------------------------------------------------------


async def test_restart_keeps_subscriptions_and_pending_work(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await subscribed(h, "a", secret="persisted")
        await h.stop_worker()
        assert await h.hub.publish(h.topic, PAYLOAD) == 1
        assert (await h.subscribe("b")).status_code == 202  # its verification waits in the table
        assert h.hub.pending() == {"verifications": 1, "deliveries": 1}
        assert h.sub.posts == [] and h.sub.verifications("b") == []
        await h.hub.aclose()

        h.open_hub()  # a new process: same database, nothing in memory
        assert [s["callback"] for s in h.hub.subscriptions()] == [h.callback("a")]
        assert h.hub.pending() == {"verifications": 1, "deliveries": 1}
        await h.start_worker()
        await wait_until(lambda: len(h.sub.received("a")) == 1, "delivered after restart")
        assert_signed(h.sub.received("a")[0], "persisted")
        await wait_until(lambda: len(h.hub.subscriptions()) == 2, "b verified after restart")
        await wait_until(lambda: h.hub.pending() == {"verifications": 0, "deliveries": 0}, "all done")


# -- bad requests -------------------------------------------------------------------------------------


def _form(**kw: str) -> dict[str, Any]:
    return {"data": {k.replace("_", ".", 1): v for k, v in kw.items()}}


BAD = [
    ("no mode", lambda h: _form(hub_topic=h.topic, hub_callback=h.callback("a")), 400, "hub.mode"),
    ("unknown mode", lambda h: _form(hub_mode="nap", hub_topic=h.topic), 400, "nap"),
    ("no callback", lambda h: _form(hub_mode="subscribe", hub_topic=h.topic), 400, "hub.callback"),
    ("no topic", lambda h: _form(hub_mode="subscribe", hub_callback=h.callback("a")), 400, "hub.topic"),
    (
        "ftp callback",
        lambda h: _form(hub_mode="subscribe", hub_topic=h.topic, hub_callback="ftp://x.org/cb"),
        400,
        "http",
    ),
    (
        "relative callback",
        lambda h: _form(hub_mode="subscribe", hub_topic=h.topic, hub_callback="/cb/a"),
        400,
        "hub.callback",
    ),
    (
        "callback with a space",
        lambda h: _form(hub_mode="subscribe", hub_topic=h.topic, hub_callback=h.callback("a b")),
        400,
        "hub.callback",
    ),
    (
        "bad lease",
        lambda h: _form(
            hub_mode="subscribe", hub_topic=h.topic, hub_callback=h.callback("a"), hub_lease_seconds="-5"
        ),
        400,
        "lease",
    ),
    (
        "zero lease",
        lambda h: _form(
            hub_mode="subscribe", hub_topic=h.topic, hub_callback=h.callback("a"), hub_lease_seconds="0"
        ),
        400,
        "lease",
    ),
    (
        "long secret",
        lambda h: _form(
            hub_mode="subscribe", hub_topic=h.topic, hub_callback=h.callback("a"), hub_secret="x" * 200
        ),
        400,
        "200 bytes",
    ),
    (
        "repeated callback",
        lambda h: {
            "content": f"hub.mode=subscribe&hub.topic={h.topic}&hub.callback=http://a/&hub.callback=http://b/",
            "headers": {"Content-Type": "application/x-www-form-urlencoded"},
        },
        400,
        "2 times",
    ),
    ("publish without topic", lambda h: _form(hub_mode="publish"), 400, "hub.topic"),
    (
        "not utf-8",
        lambda h: {
            "content": b"hub.mode=subscribe&hub.topic=%ff",
            "headers": {"Content-Type": "application/x-www-form-urlencoded"},
        },
        400,
        "UTF-8",
    ),
    ("json", lambda h: {"json": {"hub.mode": "subscribe"}}, 415, "Content-Type"),
    (
        "huge form",
        lambda h: {
            "content": b"x" * 70_000,
            "headers": {"Content-Type": "application/x-www-form-urlencoded"},
        },
        413,
        "bytes",
    ),
    (
        "payload without token",
        lambda h: {
            "content": PAYLOAD,
            "headers": {"Content-Type": "application/xml", "Link": f'<{h.topic}>; rel="self"'},
        },
        401,
        "Bearer",
    ),
    (
        "payload with a wrong token",
        lambda h: {
            "content": PAYLOAD,
            "headers": {
                "Content-Type": "application/xml",
                "Link": f'<{h.topic}>; rel="self"',
                "Authorization": "Bearer no",
            },
        },
        401,
        "Bearer",
    ),
    (
        "payload without a self link",
        lambda h: {
            "content": PAYLOAD,
            "headers": {"Content-Type": "application/xml", "Authorization": f"Bearer {TOKEN}"},
        },
        400,
        'rel="self"',
    ),
    (
        "empty payload",
        lambda h: {
            "content": b"",
            "headers": {
                "Content-Type": "application/xml",
                "Link": f'<{h.topic}>; rel="self"',
                "Authorization": f"Bearer {TOKEN}",
            },
        },
        400,
        "empty",
    ),
]


@pytest.mark.parametrize(("case", "request_kw", "status", "words"), BAD, ids=[b[0] for b in BAD])
async def test_malformed_requests_are_refused(
    tmp_path: Path, case: str, request_kw: Callable[[Harness], dict[str, Any]], status: int, words: str
) -> None:
    async with harness(tmp_path) as h:
        r = await h.client.post(h.hub_url, **request_kw(h))
        assert r.status_code == status, r.text
        assert words in r.text
        assert r.headers["content-type"].startswith("text/plain")
        assert h.hub.pending() == {"verifications": 0, "deliveries": 0}
        await trio.sleep(0.05)  # give a wrongly queued verification a chance to show up
        assert h.sub.gets == []


async def test_waiting_verifications_are_bounded(tmp_path: Path) -> None:
    async with harness(tmp_path, worker=False, limits=HubLimits(max_pending_verifications=1)) as h:
        assert (await h.subscribe("a")).status_code == 202
        r = await h.subscribe("b")
        assert r.status_code == 429 and r.headers["retry-after"]
        assert (await h.subscribe("a", lease_seconds="100")).status_code == 202  # replaces its own request
        assert h.hub.pending()["verifications"] == 1
        await h.start_worker()
        await wait_until(lambda: len(h.hub.subscriptions()) == 1, "the latest request verified")
        assert h.hub.subscriptions()[0]["lease_seconds"] == 100
        assert [v["hub.lease_seconds"] for v in h.sub.verifications("a")] == ["100"]


async def test_payload_publishing_is_off_without_a_token(tmp_path: Path) -> None:
    async with harness(tmp_path, publish_token=None) as h:
        r = await h.publish_payload()
        assert r.status_code == 403 and "hub.mode=publish" in r.text


async def test_ping_for_a_topic_that_fails_reports_it(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await subscribed(h, "a")
        r = await h.client.post(h.hub_url, data={"hub.mode": "publish", "hub.url": f"{h.base}/redirect"})
        assert r.status_code == 502 and "302" in r.text
        r = await h.client.post(h.hub_url, data={"hub.mode": "publish", "hub.url": f"{h.base}/missing"})
        assert r.status_code == 502 and "404" in r.text
        assert h.hub.pending()["deliveries"] == 0
        # hub.url (the older name) works like hub.topic
        r = await h.client.post(h.hub_url, data={"hub.mode": "publish", "hub.url": h.topic})
        assert r.status_code == 202
        await wait_until(lambda: len(h.sub.received("a")) == 1, "delivered")


async def test_get_on_the_hub_is_not_allowed(tmp_path: Path) -> None:
    async with harness(tmp_path, worker=False) as h:
        assert (await h.client.get(h.hub_url)).status_code == 405


def test_topics_under() -> None:
    allowed = topics_under("https://agg.example.org/rsagg/")
    assert allowed("https://agg.example.org/rsagg/art/notifications")
    assert allowed("https://AGG.example.org/rsagg")
    assert not allowed("https://agg.example.org/rsaggevil/x")
    assert not allowed("https://agg.example.org/other")
    assert not allowed("http://agg.example.org/rsagg/x")  # another scheme
    assert not allowed("https://agg.example.org.evil.com/rsagg/x")
    assert not allowed("https://user@agg.example.org/rsagg/x")
    assert not allowed("https://agg.example.org/rsagg/../admin")
    root = topics_under("http://127.0.0.1:8080")
    assert root("http://127.0.0.1:8080/x") and not root("http://127.0.0.1:8081/x")
