"""Every outbound path of rsagg obeys the address policy on the address it connects to, for every name —
a configured Source's own name included (DNS rebinding) — and nothing requests rsagg's own URLs.

The names resolve through a resolver the test controls (``outbound.system_resolver`` replaced), and every
connection the policed clients make is seen by a spy network backend (``httpcore.TrioBackend`` replaced):
"refused" here means refused *and* never connected to, not only an error message. Nothing leaves loopback:
the refused addresses are never connected to, the allowed ones are servers the test runs on 127.0.0.x.
"""

from __future__ import annotations

import ast
import ipaddress
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import httpcore
import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from aggregator.config import Config, parse_config
from aggregator.harvest.fetch import Expected, FetchError
from aggregator.net import outbound
from aggregator.observe.report import collect
from aggregator.run.compose import Assembly, open_assembly, open_context
from aggregator.run.serving import serving
from aggregator.scope import current_source
from aggregator.store.open import open_state
from aggregator.store.rows import NotifySubscription

from .harvesting import harvest, held
from .test_outbound import Internal, _NoStore, _port, hub_server, internal

ROOT = Path(__file__).resolve().parent.parent / "aggregator"

#: (address, the rule that refuses it): every kind the policy knows, v4, v6 and v4-in-v6.
REFUSED = [
    ("127.0.0.1", "loopback"),
    ("127.0.0.2", "loopback"),
    ("::1", "loopback"),
    ("::ffff:127.0.0.1", "loopback"),
    ("10.1.2.3", "private"),
    ("172.20.0.1", "private"),
    ("192.168.0.7", "private"),
    ("100.64.1.1", "private"),
    ("fd00::7", "private"),
    ("169.254.169.254", "link-local"),
    ("::ffff:169.254.169.254", "link-local"),
    ("fe80::1", "link-local"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("224.0.0.1", "multicast"),
    ("192.0.2.9", "reserved"),
]


class Spy(httpcore.AsyncNetworkBackend):
    """Stands in for httpcore's trio backend under the policed clients: records every (address, port)
    connected to, and connects for real (on loopback, where the test's servers are)."""

    connects: ClassVar[list[tuple[str, int]]] = []

    def __init__(self) -> None:
        self._inner = _REAL_TRIO()

    async def connect_tcp(self, host: str, port: int, *args: Any, **kw: Any) -> httpcore.AsyncNetworkStream:
        Spy.connects.append((str(ipaddress.ip_address(host.strip("[]"))), port))
        return await self._inner.connect_tcp(host, port, *args, **kw)

    async def connect_unix_socket(self, *args: Any, **kw: Any) -> httpcore.AsyncNetworkStream:
        raise AssertionError("no unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


_REAL_TRIO = httpcore.TrioBackend


class Names:
    """The test's DNS: name -> addresses, changed at will (re-pointing a name = rebinding)."""

    def __init__(self) -> None:
        self.table: dict[str, list[str]] = {}

    async def __call__(self, host: str, port: int) -> list[str]:
        await trio.lowlevel.checkpoint()
        try:
            return list(self.table[host.lower()])
        except KeyError:
            raise OSError(f"unknown test name {host}") from None


@pytest.fixture
def names(monkeypatch: pytest.MonkeyPatch) -> Names:
    table = Names()
    monkeypatch.setattr(outbound, "system_resolver", table)
    monkeypatch.setattr(httpcore, "TrioBackend", Spy)
    Spy.connects = []
    return table


def refused_count(parts: Assembly, rule: str) -> float:
    value = parts.metrics.registry.get_sample_value("rsagg_outbound_refused_total", {"reason": rule})
    return value or 0.0


def _good_app(hits: list[str]) -> Starlette:
    """The intranet Source: a Resource List, a resource, a redirect to wherever ``to`` says, a hub."""

    async def resourcelist(request: Request) -> Response:
        base = str(request.base_url).rstrip("/")
        return Response(
            '<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" '
            'xmlns:rs="http://www.openarchives.org/rs/terms/">'
            '<rs:md capability="resourcelist" at="2026-01-01T00:00:00Z"/>'
            f"<url><loc>{base}/a</loc></url></urlset>",
            media_type="application/xml",
        )

    async def anything(request: Request) -> Response:
        hits.append(f"{request.method} {request.url.path}")
        if request.url.path == "/redirect":
            return RedirectResponse(request.query_params["to"], status_code=302)
        return PlainTextResponse(f"content of {request.url.path}", status_code=202)

    return Starlette(
        routes=[
            Route("/resourcelist.xml", resourcelist),
            Route("/{p:path}", anything, methods=["GET", "POST"]),
        ]
    )


def _config(tmp_path: Path, good: str, **extra: Any) -> Config:
    """A public daemon (loopback refused): the intranet Source ``good`` by name, trusted at 127.0.0.1 only;
    ``evil`` a Source elsewhere (its documents are never fetched here)."""
    return parse_config(
        {
            "server": {"base_url": "https://agg.example.org", "listen": "127.0.0.1:1"},
            "store": {"path": str(tmp_path / "store")},
            "harvest": {"retries": 0, "timeout": 10},
            "publish": {"dump_interval": 0},
            "sources": [
                {"name": "good", "url": f"{good}/resourcelist.xml", "addresses": ["127.0.0.1/32"]},
                {"name": "evil", "url": "https://evil.example.org/resourcelist.xml", "enabled": False},
            ],
            **extra,
        },
        str(tmp_path / "rsagg.toml"),
    )


@asynccontextmanager
async def daemon_parts(config: Config) -> AsyncIterator[Assembly]:
    """The production composition (open_assembly): the clients under test are the daemon's; the
    embedded hub's worker runs (verifications)."""
    async with open_assembly(config) as parts:
        notes = parts.notifications
        assert notes is not None and notes.hub is not None
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(notes.hub.run)
                yield parts
                nursery.cancel_scope.cancel()
        finally:
            await notes.aclose()


def _sub(source: str, hub: str) -> NotifySubscription:
    return NotifySubscription(
        0, "tok" + source, "s3cret-of-" + source, source, "https://x.example/cl.xml",
        "change-notification", "https://x.example/cn.xml", hub,
    )  # fmt: skip


async def _hub_post(parts: Assembly, form: dict[str, str]) -> httpx.Response:
    """A POST to the daemon's embedded hub, as any client would send it."""
    notes = parts.notifications
    assert notes is not None and notes.hub is not None
    app = Starlette(routes=notes.hub.routes())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="https://agg.example.org") as c:
        return await c.post("/hub", data=form)


# -- the entry points: each makes the daemon request ``url`` the way it does in production ----------


async def _harvest_get(parts: Assembly, url: str) -> None:
    token = current_source.set("good")  # in the intranet Source's own sync: its pins are in play
    try:
        with pytest.raises(FetchError) as info:
            await parts.harvest.fetcher.get_bytes(url, max_bytes=1000)
    finally:
        current_source.reset(token)
    assert info.value.kind == "refused", info.value


async def _harvest_resource(parts: Assembly, url: str) -> None:
    token = current_source.set("evil")
    try:
        with pytest.raises(FetchError) as info:
            await parts.harvest.fetcher.resource([url], Expected({}), _NoStore())
    finally:
        current_source.reset(token)
    assert info.value.kind == "refused", info.value


def _redirect_via(good: str) -> Callable[[Assembly, str], Awaitable[None]]:
    async def follow(parts: Assembly, url: str) -> None:
        await _harvest_get(parts, f"{good}/redirect?to={url}")  # the first hop is the trusted origin

    return follow


async def _subscription_request(parts: Assembly, url: str) -> None:
    notes = parts.notifications
    assert notes is not None and notes.subscriber is not None
    before = notes.subscriber.counters["subscribe.failed"]
    await notes.subscriber._request(_sub("good", url), "subscribe")
    assert notes.subscriber.counters["subscribe.failed"] == before + 1


async def _external_hub_ping(parts: Assembly, url: str) -> None:
    notes = parts.notifications
    assert notes is not None
    notifier = notes.notifier
    hub, hub_url = notifier.hub, notifier.hub_url
    notifier.hub, notifier.hub_url = None, url  # as with [notifications] hub = url
    try:
        assert not await notifier._publish("https://agg.example.org/s/change-notification.xml", b"x", "cl")
    finally:
        notifier.hub, notifier.hub_url = hub, hub_url


async def _hub_callback(parts: Assembly, url: str) -> None:
    """A subscriber names ``url`` as its callback: the hub's verification GET is refused."""
    notes = parts.notifications
    assert notes is not None and notes.hub is not None
    form = {"hub.mode": "subscribe", "hub.topic": "https://agg.example.org/s/change-notification.xml",
            "hub.callback": url}  # fmt: skip
    r = await _hub_post(parts, form)
    assert r.status_code in (202, 403), r.text
    if r.status_code == 202:  # a name: judged where the hub connects (WebSub §5.1.2: 202 first)
        with trio.fail_after(30):
            while (await trio.to_thread.run_sync(notes.hub.pending))["verifications"]:
                await trio.sleep(0.01)
    assert notes.hub.subscriptions() == []


async def _hub_topic_fetch(parts: Assembly, url: str) -> None:
    """A generic ping of one of rsagg's own topics whose host name now points at ``url``'s address."""
    names: Names = outbound.system_resolver  # type: ignore[assignment]
    host = httpx.URL(url).host
    names.table["agg.example.org"] = names.table.get(host) or [host]
    try:
        form = {"hub.mode": "publish", "hub.topic": "https://agg.example.org/s/change-notification.xml"}
        r = await _hub_post(parts, form)
    finally:
        del names.table["agg.example.org"]
    assert r.status_code == 502 and "outbound policy refused" in r.text, r.text


ENTRY_POINTS: dict[str, Callable[..., Any]] = {
    "harvest fetch": lambda good: _harvest_get,
    "harvest resource": lambda good: _harvest_resource,
    "redirect hop": _redirect_via,
    "subscription request to a hub": lambda good: _subscription_request,
    "external hub ping": lambda good: _external_hub_ping,
    "hub callback": lambda good: _hub_callback,
    "hub topic fetch": lambda good: _hub_topic_fetch,
}


async def test_every_entry_point_refuses_every_refused_address_by_every_name(
    tmp_path: Path, names: Names
) -> None:
    """The table: entry points x refused addresses x the ways to name them (a fresh name, the intranet
    Source's own name re-pointed, the literal address). Each request is refused with the address's rule,
    counted once, named in the error, and no connection is made to the address."""
    hits: list[str] = []
    async with serving(_good_app(hits)) as real:
        port = _port(real)
        good = f"http://good.test:{port}"
        names.table["good.test"] = ["127.0.0.1"]
        config = _config(tmp_path, good)
        async with daemon_parts(config) as parts:
            hub = parts.notifications.hub  # type: ignore[union-attr]
            assert hub is not None
            cases = 0
            for entry, make in ENTRY_POINTS.items():
                run = make(good)
                for i, (address, rule) in enumerate(REFUSED):
                    host = f"[{address}]" if ":" in address else address
                    spellings = {
                        "a name": (f"n{i}.rebind.test", f"http://n{i}.rebind.test:{port}/x"),
                        "literal": (None, f"http://{host}:{port}/x"),
                    }
                    pinned = address in ("127.0.0.1", "::ffff:127.0.0.1")  # good.test's own pin
                    if entry in ("harvest fetch", "subscription request to a hub") and not pinned:
                        # made for the intranet Source: its own name, re-pointed, gets no trust from it
                        spellings["the source's own name"] = ("good.test", f"{good}/x")
                    for how, (name, url) in spellings.items():
                        if name is not None:
                            names.table[name] = [address]
                        before = refused_count(parts, rule)
                        connects = len(Spy.connects)
                        try:
                            await run(parts, url)
                        finally:
                            names.table["good.test"] = ["127.0.0.1"]
                        where = f"{entry} / {address} / {how}"
                        assert refused_count(parts, rule) == before + 1, where
                        new = Spy.connects[connects:]
                        assert all(a == "127.0.0.1" for a, _ in new), (where, new)  # only the redirector
                        cases += 1
            assert cases == len(REFUSED) * len(ENTRY_POINTS) * 2 + (len(REFUSED) - 2) * 2
    assert hits == ["GET /redirect"] * len(REFUSED) * 2  # the trusted first hops, nothing else


async def test_a_sources_own_name_re_pointed_is_refused_counted_and_named(
    tmp_path: Path, names: Names
) -> None:
    """DNS rebinding through a Source's own origin: the intranet Source ``good.test`` (trusted at
    127.0.0.1) is harvested; its name then moves to 127.0.0.2, where another internal service listens on
    the same port: the next sync is refused, counted, the error and the status name the name, the
    address and why, and the internal service sees no request."""
    hits: list[str] = []
    inner = Internal()
    async with serving(_good_app(hits)) as real, serving(inner, host="127.0.0.2", port=_port(real)):
        good = f"http://good.test:{_port(real)}"
        names.table["good.test"] = ["127.0.0.1"]
        config = _config(tmp_path, good)
        first = (await harvest(config))["good"]
        assert first.ok and first.failures == []
        assert sorted(held(config)) == [f"{good}/a"]
        names.table["good.test"] = ["127.0.0.2"]  # the name moves inside
        async with open_context(config) as ctx:
            from aggregator.harvest.source import sync_source

            second = await sync_source(ctx, config.sources[0])
            refused = ctx.metrics.registry.get_sample_value(
                "rsagg_outbound_refused_total", {"reason": "loopback"}
            )
        assert not second.ok
        assert second.error is not None
        for word in ("good.test", "127.0.0.2", "loopback", "source 'good'", "moved", "addresses"):
            assert word in second.error, (word, second.error)
        assert refused == 3.0  # the three URLs discovery tries, each refused once (never retried)
        with open_state(config) as state:
            [row] = [r for r in collect(state, config)["sources"] if r["name"] == "good"]
        assert "127.0.0.2" in (row["last_error"] or "")
    assert inner.hits == []
    assert ("127.0.0.2", _port(real)) not in Spy.connects


async def test_a_name_moving_out_and_back_is_checked_on_every_connection(
    tmp_path: Path, names: Names
) -> None:
    """The property behind the table, on one origin: whatever sequence of addresses a name takes, a new
    connection is made only to an address the policy allows for that requester, and one is refused for
    every other."""
    async with serving(_good_app([])) as real:
        port = _port(real)
        config = _config(tmp_path, f"http://good.test:{port}")
        sequence = ["127.0.0.1", "169.254.169.254", "127.0.0.1", "::ffff:10.0.0.1", "127.0.0.1", "::1"]
        async with daemon_parts(config) as parts:
            for k, address in enumerate(sequence):
                names.table["good.test"] = [address]
                await parts.harvest.fetcher.aclose()  # no pooled connection: a new one each time
                parts.harvest.fetcher = type(parts.harvest.fetcher)(
                    policy=parts.harvest.fetcher.policy, retries=0
                )
                token = current_source.set("good")
                try:
                    if address == "127.0.0.1":
                        got = await parts.harvest.fetcher.get_bytes(
                            f"http://good.test:{port}/{k}", max_bytes=100
                        )
                        assert got.status == 202
                    else:
                        with pytest.raises(FetchError, match="the name moved"):
                            await parts.harvest.fetcher.get_bytes(
                                f"http://good.test:{port}/{k}", max_bytes=100
                            )
                finally:
                    current_source.reset(token)
            await parts.harvest.fetcher.aclose()
    assert {a for a, _ in Spy.connects} == {"127.0.0.1"}


async def test_a_callback_verified_outside_then_re_pointed_inside_gets_no_delivery(
    tmp_path: Path, names: Names
) -> None:
    """Hub deliveries: a callback name verified on an allowed address (127.0.0.2, opened by the
    allow-list) then re-pointed at an internal one (127.0.0.1): the delivery POST is refused and counted,
    the internal service on the same port sees nothing."""

    refused: list[str] = []
    outside = Internal()
    async with internal() as (svc, ibase), serving(outside, host="127.0.0.2", port=_port(ibase)):
        port = _port(ibase)
        names.table["cb.test"] = ["127.0.0.2"]
        policy = outbound.AddressPolicy(
            allow=outbound.parse_networks(["127.0.0.2/32"]), on_refused=refused.append
        )
        async with hub_server(tmp_path, policy) as (hub, base), httpx.AsyncClient() as client:
            topic = f"{base}/t"
            form = {"hub.mode": "subscribe", "hub.topic": topic, "hub.callback": f"http://cb.test:{port}/cb"}
            assert (await client.post(f"{base}/hub", data=form)).status_code == 202
            with trio.fail_after(30):
                while not await trio.to_thread.run_sync(hub.subscriptions):
                    await trio.sleep(0.02)
            names.table["cb.test"] = ["127.0.0.1"]  # the callback's name moves inside
            await hub._http().aclose()  # hub clients pool: a new connection resolves the name again
            hub._client = hub._owned = None
            assert await hub.publish(topic, b"<urlset/>", "application/xml") == 1
            with trio.fail_after(30):
                while "loopback" not in refused:
                    await trio.sleep(0.02)
    assert len(outside.hits) == 1 and "hub.challenge=" in outside.hits[0]  # the verification only
    assert svc.hits == []
    assert ("127.0.0.1", port) not in Spy.connects


# -- rsagg's own URLs --------------------------------------------------------------------------


async def test_rsaggs_own_urls_are_not_harvested(tmp_path: Path, names: Names) -> None:
    """A hostile Source lists rsagg's own ``/status.json`` and ``/metrics`` (by its base URL, spelt in
    other ways, by another name of its listen address, or through a redirect): nothing is fetched from
    rsagg, each is refused with the rule ``self``, counted, and named."""
    own = Internal()  # stands in for rsagg's own server: it counts what reaches it
    async with serving(own) as base:
        port = _port(base)
        names.table["me.test"] = names.table["localhost"] = ["127.0.0.1"]
        own_urls = [
            f"{base}/status.json",
            f"{base}/metrics",
            f"{base}/set/resourcelist.xml",
            f"http://127.0.0.1.:{port}/metrics",  # trailing dot
            f"{base}/x/../metrics",
            f"{base}/%6Detrics",
            f"http://localhost:{port}/metrics",  # another name: the listen address
            f"http://[::ffff:127.0.0.1]:{port}/metrics",
            f"http://me.test:{port}/metrics",
        ]

        items = list(own_urls)

        def hostile(redirect_to: str) -> Starlette:
            async def resourcelist(request: Request) -> Response:
                locs = "".join(f"<url><loc>{u.replace('&', '&amp;')}</loc></url>" for u in items)
                return Response(
                    '<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" '
                    'xmlns:rs="http://www.openarchives.org/rs/terms/">'
                    f'<rs:md capability="resourcelist" at="2026-01-01T00:00:00Z"/>{locs}</urlset>',
                    media_type="application/xml",
                )

            async def redirect(request: Request) -> Response:
                return RedirectResponse(redirect_to, status_code=302)

            return Starlette(routes=[Route("/resourcelist.xml", resourcelist), Route("/go", redirect)])

        async with serving(hostile(f"{base}/metrics")) as up:
            items.append(f"{up}/go")
            config = parse_config(
                {
                    # a local instance (loopback allowed): only the self rule stands between
                    "server": {"base_url": base, "listen": f"127.0.0.1:{port}"},
                    "store": {"path": str(tmp_path / "store")},
                    "harvest": {"retries": 0, "timeout": 10},
                    "sources": [{"name": "up", "url": f"{up}/resourcelist.xml"}],
                },
                str(tmp_path / "rsagg.toml"),
            )
            result = (await harvest(config))["up"]
    assert own.hits == []
    assert held(config) == {}
    failed = {f.uri: (f.kind, f.message) for f in result.failures}
    assert set(failed) == set(items)
    for uri, (kind, message) in failed.items():
        assert kind == "refused" and "self" in message, (uri, message)


async def test_the_hub_serves_and_fetches_only_rsaggs_own_topics(tmp_path: Path, names: Names) -> None:
    """Anyone may subscribe to ``BASE/metrics`` and ping the hub to publish it: the ping is refused
    (403, counted as ``self``), the subscription denied, and nothing is fetched; one of rsagg's own
    channels is fetched and published."""
    own = Internal()
    async with serving(own) as base:
        port = _port(base)
        config = parse_config(
            {
                "server": {"base_url": base, "listen": f"127.0.0.1:{port}"},
                "store": {"path": str(tmp_path / "store")},
                "sources": [{"name": "up", "url": "https://up.example.org/", "enabled": False}],
            },
            str(tmp_path / "rsagg.toml"),
        )
        async with daemon_parts(config) as parts:
            for topic in (f"{base}/metrics", f"{base}/status.json", f"{base}/", f"{base}/set/x.xml",
                          f"{base}/set/resourcelist.xml", f"{base}/a/b/change-notification.xml",
                          f"{base}/%2E%2E/change-notification.xml?x=1"):  # fmt: skip
                before = refused_count(parts, "self")
                r = await _hub_post(parts, {"hub.mode": "publish", "hub.topic": topic})
                assert r.status_code == 403 and topic in r.text, (topic, r.text)
                assert refused_count(parts, "self") == before + 1
            assert own.hits == []
            topic = f"{base}/set/change-notification.xml"
            r = await _hub_post(parts, {"hub.mode": "publish", "hub.topic": topic})
            assert r.status_code == 202, r.text
            assert own.hits == [topic]  # the one request rsagg makes to its own URLs
            r = await _hub_post(
                parts, {"hub.mode": "subscribe", "hub.topic": f"{base}/metrics", "hub.callback": f"{base}/cb"}
            )
            assert r.status_code == 403 and "rsagg's own URL" in r.text


# -- hubs named by Sources: trust does not leak across sources --------------------------------------


async def test_a_hub_on_another_sources_origin_gets_no_subscription(tmp_path: Path, names: Names) -> None:
    """``evil`` names the intranet Source's origin as its hub: its subscription request (with a secret)
    is refused before anything is sent there; ``good`` subscribing to a hub on its own origin is not."""
    hits: list[str] = []
    async with serving(_good_app(hits)) as real:
        good = f"http://good.test:{_port(real)}"
        names.table["good.test"] = ["127.0.0.1"]
        async with daemon_parts(_config(tmp_path, good)) as parts:
            subscriber = parts.notifications.subscriber  # type: ignore[union-attr]
            assert subscriber is not None
            for hub in (f"{good}/hub", f"http://127.0.0.1:{_port(real)}/hub"):
                before = refused_count(parts, "loopback")
                await subscriber._request(_sub("evil", hub), "subscribe")
                assert refused_count(parts, "loopback") == before + 1
            assert hits == []
            await subscriber._request(_sub("good", f"{good}/hub"), "subscribe")
            assert hits == ["POST /hub"]


# -- one place: no other client is built -------------------------------------------------------

#: Modules allowed to build an HTTP client or open a connection themselves, and why.
UNPOLICED = {
    "aggregator/net/outbound.py": "the policy itself: every client built for others' URLs comes from here",
    "aggregator/harvest/fetch.py": "the Fetcher's client: its transports are outbound.transport (below)",
    "aggregator/net/lean.py": "the Fetcher's lean pool: connects only to outbound.checked_addresses (below)",
    "aggregator/run/workers.py": "a serving worker forwards to its own daemon at the loopback URL it got",
    "aggregator/commands/validate.py": "`rsagg validate URL`: the operator's own request on the command line",
    "aggregator/testing/notify.py": "a test double (never imported by runtime code: test_imports.py)",
    "aggregator/testing/upstream.py": "a test double",
}
_CONSTRUCTORS = {
    ("httpx", "AsyncClient"), ("httpx", "Client"), ("httpx", "AsyncHTTPTransport"),
    ("httpx", "HTTPTransport"),
    ("httpx", "get"), ("httpx", "post"), ("httpx", "stream"), ("httpx", "request"),
    ("httpcore", "AsyncConnectionPool"), ("httpcore", "ConnectionPool"), ("httpcore", "TrioBackend"),
    ("trio", "open_tcp_stream"), ("socket", "create_connection"), ("request", "urlopen"),
}  # fmt: skip


def _calls(tree: ast.AST) -> set[tuple[str, str]]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            found.add((name, node.func.attr))
        if isinstance(node, ast.ImportFrom) and node.module in ("httpx", "httpcore", "urllib.request"):
            found.update((node.module.rpartition(".")[2], a.name) for a in node.names)
    return found & _CONSTRUCTORS


def test_own_urls_however_spelt() -> None:
    """``own_url``: at or below the base URL, by path segment, whatever the spelling or default port."""
    policy = outbound.AddressPolicy(own_urls=("https://agg.example.org/rs",))
    for url in ("https://agg.example.org/rs", "https://agg.example.org/rs/metrics", "http://agg.example.org/rs/x",
                "https://AGG.example.org./rs/status.json", "https://agg.example.org:443/a/../rs/x",
                "https://agg.example.org/%72s/metrics", "https://agg.example.org//rs/x"):  # fmt: skip
        assert policy.own_url(url), url
    for url in ("https://agg.example.org/rsx", "https://agg.example.org/other/rs", "https://agg.example.org:8443/rs",
                "https://other.example.org/rs", "ftp://agg.example.org/rs"):  # fmt: skip
        assert not policy.own_url(url), url


def test_no_module_builds_its_own_client() -> None:
    """Every outbound connection goes through ``outbound.py``: no other module builds an HTTP client,
    a connection pool or a socket connection (a new one must be policed, or listed here with why)."""
    seen = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT.parent))
        calls = _calls(ast.parse(path.read_text(), filename=rel))
        if calls:
            seen[rel] = calls
    assert set(seen) <= set(UNPOLICED), {k: v for k, v in seen.items() if k not in UNPOLICED}
    assert "aggregator/net/outbound.py" in seen and "aggregator/run/workers.py" in seen  # the scan sees them


async def test_the_daemons_clients_are_all_policed(tmp_path: Path) -> None:
    """The composition hands every part a policed client: the Fetcher's pools, the WebSub client
    (subscriber and notifier) and the hub's; the hub's policy pins nothing of the sources."""
    config = _config(tmp_path, "http://good.test:1")
    async with daemon_parts(config) as parts:
        notes = parts.notifications
        assert notes is not None and notes.hub is not None and notes.subscriber is not None
        fetcher = parts.harvest.fetcher
        transports = list(fetcher._client._transport._pools)  # type: ignore[attr-defined]
        if not urllib.request.getproxies():  # with proxies the client routes (docs/security.md "Proxies")
            assert fetcher._direct is fetcher._client._transport  # type: ignore[attr-defined]
        transports += [notes.client._transport, notes.hub._http()._transport]
        assert notes.subscriber.client is notes.client and notes.notifier.client is notes.client
        for t in transports:
            assert isinstance(t, outbound.PolicedTransport), t
            assert isinstance(t._pool._network_backend, outbound.PolicedBackend)
        assert fetcher.policy is not None and fetcher.policy.own_urls == ("https://agg.example.org",)
        if fetcher._lean is not None:  # the lean path's pool judges by the same policy object
            assert fetcher._lean.policy is fetcher.policy
        assert fetcher.policy.pins == {
            ("good.test", 1): {"good": (ipaddress.ip_network("127.0.0.1/32"),)},
        }
        hub_policy = notes.hub.policy
        assert hub_policy is not None and hub_policy.pins == {}  # a name: no pin for its topic fetches
