"""The subscriber on a cluster node, in-process: renewals are written under the source's lease, so a node
that lost it renews nothing (the hub never hears from it) and the new holder renews the subscription the
old one made; a verification reaching a node that never saw the subscription is answered from the state;
the channels of a source no live node follows any more are unsubscribed once, by the "@orphans" role's
holder, and those of a source one live node still follows are left alone."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aggregator.config import Config, SourceConfig, parse_config
from aggregator.rs.model import CHANGE_NOTIFICATION, Entry, Link, Md
from aggregator.rs.w3cdt import utcnow
from aggregator.run.cluster import Node
from aggregator.run.serving import serving
from aggregator.store.interface import LeaseLost, fenced
from aggregator.store.nodes import followed_by_live
from aggregator.store.open import connect
from aggregator.store.rows import Fence, NotifySubscription
from aggregator.store.state import State
from aggregator.websub.subscriber import CALLBACK_PREFIX, Subscriber, SubscriberSettings

from .notifying import flask_hub, wait_until


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


def _form(request: httpx.Request) -> dict[str, str]:
    """A WebSub request's form, as the hub reads it."""
    return dict(httpx.QueryParams(request.content.decode()))


def _mock_hub(posts: list[dict[str, str]]) -> httpx.MockTransport:
    """A hub that accepts every request (202) and records its form in ``posts``."""

    def hub(request: httpx.Request) -> httpx.Response:
        posts.append(_form(request))
        return httpx.Response(202)

    return httpx.MockTransport(hub)


async def test_renewals_follow_the_lease(tmp_path: Path) -> None:
    config = _config(tmp_path)
    posts: list[dict[str, str]] = []
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

    async with httpx.AsyncClient(transport=_mock_hub(posts)) as client:
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


# -- sources no live node follows (the "@orphans" role) ---------------------------------------------------

TOPIC = "http://up.example/s/change-notification.xml"


@dataclass
class _Channel:
    url: str
    entry: Entry


@dataclass
class _Set:
    capabilitylist_url: str
    capabilities: dict[str, _Channel]


class _Upstream:
    """The harvest as the subscriber sees it: every sync discovers one set advertising a change channel
    on the real hub (a WebSub hub nobody here wrote)."""

    def __init__(self, hub: str) -> None:
        entry = Entry(TOPIC, md=Md(capability=CHANGE_NOTIFICATION), links=[Link("hub", hub)])
        self.sets = [
            _Set("http://up.example/s/capabilitylist.xml", {CHANGE_NOTIFICATION: _Channel(TOPIC, entry)})
        ]

    async def sync(self, src: SourceConfig) -> list[_Set]:
        return self.sets

    async def apply_notice(self, *args: object) -> None:
        return None


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str | Path:
    """The state the test's nodes share: the SQLite file, or a schema of the test PostgreSQL server."""
    if request.param == "sqlite":
        return tmp_path / "data" / "state.db"
    return request.getfixturevalue("pg_server").fresh_url()


class _ClusterNode:
    """One node in-process: ``cluster.Node`` (beats driven by the test), a ``Subscriber`` of its own on
    the shared state, the source's task started and stopped as the node's leases say, and the "@orphans"
    role run as compose.py wires it (here counting its passes)."""

    def __init__(
        self, name: str, folder: Path, location: str | Path, client: httpx.AsyncClient, lb: str, hub: str
    ) -> None:
        self.config = self.configure(folder, name, lb, follows=True)
        self.tasks: dict[str, tuple[trio.CancelScope, trio.Event]] = {}
        self.sweeps = 0
        settings = SubscriberSettings(tick=0.05, inbox_poll=0.05, retry_base=0.2, settle=0.05)
        self.sub = Subscriber(
            lambda: self.config, connect(location), _Upstream(hub), client=client, settings=settings
        )
        self.node = Node(
            lambda: self.config,
            state=connect(location),
            start=self.start,
            stop=self.stop,
            metrics=None,
            fetcher=None,
            roles={"@orphans": self.orphans},
        )

    @staticmethod
    def configure(folder: Path, name: str, lb: str, *, follows: bool) -> Config:
        return parse_config(
            {
                "server": {"listen": "127.0.0.1:1", "base_url": lb},  # the load balancer's: any node answers
                "store": {"path": str(folder / "data")},
                "cluster": {"enabled": True, "node": name, "lease_seconds": 120.0},  # no beat lapses
                "notifications": {"lease_seconds": 3600},
                "sources": [{"name": "s", "url": "http://up.example/s/capabilitylist.xml", "interval": 3600}]
                if follows
                else [],
            },
            str(folder / f"{name}.toml"),
        )

    def reload(self, folder: Path, lb: str) -> None:
        """What a SIGHUP with a configuration without the source does to a node (daemon.py)."""
        self.config = self.configure(folder, self.node.name, lb, follows=False)

    def start(self, src: SourceConfig, fence: Fence) -> None:
        scope, done = trio.CancelScope(), trio.Event()
        self.tasks[src.name] = (scope, done)

        async def run() -> None:
            try:
                with scope, fenced(fence):
                    await self.sub.run_source(src)
            finally:
                done.set()

        assert self.node._nursery is not None
        self.node._nursery.start_soon(run)

    def stop(self, name: str) -> trio.Event:
        scope, done = self.tasks.pop(name)
        scope.cancel()
        return done

    async def orphans(self) -> None:
        while True:
            await self.sub.sweep_orphans()
            self.sweeps += 1
            await trio.sleep(self.sub.settings.tick)

    async def beat(self) -> None:
        await self.node.beat()
        with trio.fail_after(30):  # a release commits in a worker thread once the task has ended
            while self.node._stopping:
                await trio.sleep(0.01)

    async def close(self) -> None:
        await self.sub.aclose()
        self.node.state.close()


async def test_a_source_no_live_node_follows_is_unsubscribed_once(
    tmp_path: Path, location: str | Path
) -> None:
    """Two nodes follow source "s"; its holder subscribes (once). Removed from the holder's configuration
    only, the other node still follows it: nothing is unsubscribed, the other node takes the source and
    its subscription over. Removed from both: the node holding "@orphans" sends one unsubscription, the
    hub verifies it at the load balancer's URL, the subscription is forgotten and the hub drops it."""
    posts: list[dict[str, str]] = []

    async def record(request: httpx.Request) -> None:
        posts.append(_form(request))

    (tmp_path / "data").mkdir()
    with flask_hub(tmp_path / "hub") as hub_url:
        nodes: dict[str, _ClusterNode] = {}

        async def balancer(request: Request) -> Response:  # the callbacks reach node B, whoever holds "s"
            sub = nodes["B"].sub
            return await (sub.verify(request) if request.method == "GET" else sub.deliver(request))

        lb = Starlette(routes=[Route(CALLBACK_PREFIX + "{token}", balancer, methods=["GET", "POST"])])
        async with (
            serving(lb) as lb_url,
            httpx.AsyncClient(event_hooks={"request": [record]}) as client,
            trio.open_nursery() as nursery,
        ):
            nodes.update((n, _ClusterNode(n, tmp_path, location, client, lb_url, hub_url)) for n in "AB")
            a, b = nodes["A"], nodes["B"]
            a.node._nursery = b.node._nursery = nursery
            try:
                await a.beat()  # alone: takes "s" and the roles
                await b.beat()  # nothing free for it
                assert set(a.tasks) == {"s"} and not b.tasks and set(a.node.roles_held) == {"@orphans"}

                def subs() -> list[NotifySubscription]:
                    return a.sub.state.notify_subscriptions()

                await wait_until(lambda: [s.live(utcnow()) for s in subs()] == [True], "subscribed", 30)
                assert [p["hub.mode"] for p in posts] == ["subscribe"]  # by the holder only

                a.reload(tmp_path, lb_url)  # a rolling change: B has not got it yet
                seen = a.sweeps  # until its next beat, A's task of "s" goes on (under the new config)
                await wait_until(lambda: a.sweeps >= seen + 3, "a few passes before A's beat", 30)
                await a.beat()  # releases "s", says it follows nothing
                await b.beat()  # B still follows "s": takes it (and the subscription) over
                assert not a.tasks and set(b.tasks) == {"s"}
                seen = a.sweeps
                await wait_until(lambda: a.sweeps >= seen + 3, "the role looked a few times", 30)
                await wait_until(lambda: b.sub.idle("s"), "B's first sync of s", 30)
                assert [p["hub.mode"] for p in posts] == ["subscribe"]  # nothing unsubscribed
                (kept,) = subs()
                assert kept.wanted and kept.live(utcnow())

                b.reload(tmp_path, lb_url)
                await b.beat()  # releases "s": no live node follows it now
                # flask-websub verifies before it answers the request: wait for both
                await wait_until(lambda: not subs(), "unsubscribed and forgotten", 30)
                await wait_until(lambda: a.sub.counters["unsubscribe.requested"], "the hub's answer", 30)
                assert [p["hub.mode"] for p in posts] == ["subscribe", "unsubscribe"]
                assert posts[1]["hub.callback"] == f"{lb_url}{CALLBACK_PREFIX}{kept.token}"
                assert (
                    a.sub.counters["unsubscribe.requested"] == 1
                    and b.sub.counters["unsubscribe.requested"] == 0
                )
                assert b.sub.counters["verify.unsubscribed"] == 1  # answered by B from the state

                def hub_rows() -> int:
                    with sqlite3.connect(tmp_path / "hub" / "hub.db") as c:
                        return c.execute("SELECT COUNT(*) FROM hub").fetchone()[0]

                assert hub_rows() == 0  # flask-websub verified the unsubscription and dropped it
                seen = a.sweeps
                await wait_until(lambda: a.sweeps >= seen + 2, "more passes of the role", 30)
                assert len(posts) == 2  # once, not again
            finally:
                nursery.cancel_scope.cancel()
        for n in nodes.values():
            await n.close()


async def test_nodes_say_what_they_follow_with_their_heartbeat(location: str | Path) -> None:
    """``NodeRow.follows``: what the last heartbeat said; a node that said nothing blocks the orphan
    decision (``followed_by_live``), a stopped or silent node does not count."""
    if isinstance(location, Path):
        location.parent.mkdir(parents=True)
    st = connect(location)
    try:
        beat = {"lease_seconds": 60.0, "pid": 1, "host": "h", "url": None}
        st.node_heartbeat("A", follows=["s", "t", "s"], **beat)
        st.node_heartbeat("B", follows=[], **beat)
        st.node_heartbeat("C", follows=["u"], **beat)
        st.node_stopped("C")
        assert {n.name: n.follows for n in st.nodes()} == {"A": ("s", "t"), "B": (), "C": ("u",)}
        now = utcnow()
        assert followed_by_live(st.nodes(), now) == {"s", "t"}
        st.node_heartbeat("A", follows=["t"], **beat)  # reloaded without s
        assert followed_by_live(st.nodes(), now) == {"t"}
        st.node_heartbeat("B", follows=None, **beat)
        assert st.nodes()[1].follows is None and followed_by_live(st.nodes(), now) is None
        assert followed_by_live(st.nodes(), now + timedelta(seconds=120)) == set()  # none alive
    finally:
        st.close()


async def test_the_orphans_role_sweeps_only_what_no_live_node_follows(tmp_path: Path) -> None:
    """``sweep_orphans`` on its own: nothing while a live node follows the source or a live node did not
    say what it follows; else one unsubscription (under the role's fence: a stale holder sends nothing) and
    the source's waiting notices deleted."""
    config = _config(tmp_path)
    posts: list[dict[str, str]] = []
    db = tmp_path / "state.db"
    setup = State(db)
    now = utcnow()
    sub = NotifySubscription(
        0, "tok", "sec", "gone", "http://up.example/cl.xml", CHANGE_NOTIFICATION, "http://up.example/cn.xml",
        "http://hub.example/", lease_seconds=3600, verified=now, lease_expires=now + timedelta(hours=1),
    )  # fmt: skip
    setup.add_notify_subscription(sub)
    assert setup.add_notify_notice("gone", "tok", b"<urlset/>", limit=10) == "added"
    beat = {"lease_seconds": 600.0, "pid": 1, "host": "h", "url": None}
    setup.node_heartbeat("A", follows=[], **beat)
    setup.node_heartbeat("B", follows=["gone"], **beat)  # its configuration still has the source
    (stale,) = setup.claim_leases("A", ["@orphans"], want=1, lease_seconds=60)
    assert setup.release_lease(stale)
    (role,) = setup.claim_leases("B", ["@orphans"], want=1, lease_seconds=60)

    async with httpx.AsyncClient(transport=_mock_hub(posts)) as client:
        sweeper = Subscriber(lambda: config, State(db), harvester=None, client=client)  # type: ignore[arg-type]
        with fenced(role):
            assert await sweeper.sweep_orphans() == []
            setup.node_heartbeat("B", follows=None, **beat)  # a node that does not say
            assert await sweeper.sweep_orphans() == []
            setup.node_heartbeat("B", follows=["other"], **beat)
        assert posts == [] and len(setup.notify_notices("gone")) == 1
        with fenced(stale), pytest.raises(LeaseLost):
            await sweeper.sweep_orphans()
        assert posts == []  # the pending mark is written first: refused, nothing sent
        with fenced(role):
            assert await sweeper.sweep_orphans() == ["gone"]
        assert [(p["hub.mode"], p["hub.callback"]) for p in posts] == [
            ("unsubscribe", "http://agg.example/_websub/tok")
        ]
        (row,) = setup.notify_subscriptions()
        assert not row.wanted and row.pending == "unsubscribe"  # until the hub verifies it
        assert setup.notify_notices("gone") == []
        with fenced(role):
            await sweeper.sweep_orphans()
        assert len(posts) == 1  # pending: not sent again
        await sweeper.aclose()
    setup.close()
