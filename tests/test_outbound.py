"""The outbound address policy (net/outbound.py): no request reaches a refused address, whether it is
named literally, through a DNS name (a resolver the test controls), a redirect, a mirror, a metadata
record, or a hub callback; the allow-list opens exactly what it names.

Every "internal" service here is a real HTTP server on 127.0.0.1 that counts the requests it receives;
the policy under test refuses loopback (as in production), so the count must stay 0.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from aggregator.config import ConfigError, parse_config
from aggregator.harvest.fetch import Expected, Fetcher, FetchError
from aggregator.harvest.metadata import MetadataRecords
from aggregator.net import outbound
from aggregator.net.outbound import AddressPolicy, parse_networks, refusal_rule
from aggregator.observe.metrics import Metrics
from aggregator.rs.model import Entry, Link
from aggregator.run.compose import open_context
from aggregator.run.serving import serving
from aggregator.store.open import connect
from aggregator.websub.hub import Hub, HubLimits, delivery_client, topics_under

from .harvesting import harvest, held


class Internal:
    """An "internal" service: answers everything with 200 and the challenge (so a verification would
    succeed), counting every request that reaches it."""

    def __init__(self) -> None:
        self.hits: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        request = Request(scope, receive)
        self.hits.append(str(request.url))
        body = request.query_params.get("hub.challenge", "secret internal data").encode()
        await Response(body)(scope, receive, send)


async def _lifespan(receive: Any, send: Any) -> None:
    msg = await receive()
    while msg["type"] != "lifespan.shutdown":
        await send({"type": msg["type"] + ".complete"})
        msg = await receive()
    await send({"type": "lifespan.shutdown.complete"})


@asynccontextmanager
async def internal() -> AsyncIterator[tuple[Internal, str]]:
    app = Internal()
    async with serving(app) as base:
        yield app, base


def resolver(names: dict[str, list[str]]) -> Callable[[str, int], Any]:
    async def resolve(host: str, port: int) -> list[str]:
        await trio.lowlevel.checkpoint()
        if host not in names:
            raise OSError(f"unknown test name {host}")
        return names[host]

    return resolve


def _port(url: str) -> int:
    return httpx.URL(url).port or 80


# -- the rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "rule"),
    [
        ("127.0.0.1", "loopback"),
        ("127.1.2.3", "loopback"),
        ("::1", "loopback"),
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),
        ("100.64.0.1", "private"),
        ("fd12:3456::1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("192.0.2.1", "reserved"),
        ("240.0.0.1", "reserved"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("::ffff:169.254.169.254", "link-local"),
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 of 169.254.169.254
        ("2002:7f00:1::1", "loopback"),  # 6to4 of 127.0.0.1
        ("93.184.215.14", None),
        ("2606:4700::6810:84e5", None),
    ],
)
def test_rules(address: str, rule: str | None) -> None:
    assert refusal_rule(ipaddress.ip_address(address)) == rule


def test_allow_list_opens_exactly_what_it_names() -> None:
    policy = AddressPolicy(allow=parse_networks(["10.1.0.0/16", "127.0.0.1/32", "fd00:1::/64"]))
    assert policy.rule_for("10.1.255.7") is None
    assert policy.rule_for("10.2.0.1") == "private"
    assert policy.rule_for("127.0.0.1") is None
    assert policy.rule_for("127.0.0.2") == "loopback"
    assert policy.rule_for("::ffff:127.0.0.1") is None  # the same address, mapped
    assert policy.rule_for("fd00:1::5") is None
    assert policy.rule_for("fd00:2::5") == "private"
    assert policy.rule_for("169.254.169.254") == "link-local"
    with pytest.raises(ValueError, match=r"10\.1\.2\.3/16"):
        parse_networks(["10.1.2.3/16"])  # host bits set: not silently widened


def test_config_defaults_and_errors(tmp_path: Path) -> None:
    local = parse_config({})
    assert outbound.local_instance(local)
    assert outbound.allowed_networks(local) == outbound.LOOPBACK
    public = parse_config({"server": {"base_url": "https://rsagg.example.org"}})
    assert not outbound.local_instance(public)  # behind a proxy on loopback, but public
    assert outbound.allowed_networks(public) == ()
    exposed = parse_config({"server": {"listen": "0.0.0.0:8080"}})
    assert outbound.allowed_networks(exposed) == ()
    explicit = parse_config({"outbound": {"allow": ["10.0.0.0/8"]}})  # replaces the local default
    assert outbound.allowed_networks(explicit) == (ipaddress.ip_network("10.0.0.0/8"),)
    with pytest.raises(ConfigError, match=r"outbound\.allow: '10\.0\.0\.1/8' is not a network"):
        parse_config({"outbound": {"allow": ["10.0.0.1/8"]}})
    with pytest.raises(ConfigError, match=r"outbound\.allow: must be an array"):
        parse_config({"outbound": {"allow": "10.0.0.0/8"}})
    with pytest.raises(ConfigError, match=r"outbound\.deny: unknown key"):
        parse_config({"outbound": {"deny": []}})
    cfg = parse_config(
        {
            "server": {"base_url": "https://agg.example.org"},
            "sources": [{"name": "a", "url": "http://10.0.0.5:81/x"}],
        }
    )
    assert outbound.policy_for(cfg).pins[("10.0.0.5", 81)] == {"a": parse_networks(["10.0.0.5/32"])}
    assert ("10.0.0.5", 81) not in outbound.policy_for(cfg, hub=True).pins


# -- the fetcher ---------------------------------------------------------------------------------


async def test_fetcher_refuses_names_literals_and_redirects_to_refused_addresses() -> None:
    refused: Counter[str] = Counter()
    async with internal() as (svc, base):
        port = _port(base)

        async def redirect(request: Request) -> Response:
            return RedirectResponse(f"http://internal.test:{port}/r", status_code=302)

        async with serving(Starlette(routes=[Route("/go", redirect)])) as origin_base:
            policy = AddressPolicy(
                pins={outbound.origin(origin_base): {"": outbound.LOOPBACK}},  # type: ignore[dict-item]
                resolver=resolver({"internal.test": ["127.0.0.1"], "mixed.test": ["127.0.0.1", "10.0.0.9"]}),
                on_refused=lambda rule: refused.update([rule]),
            )
            async with Fetcher(policy=policy, retries=2, backoff_base=0.01) as f:
                for url in (
                    f"{base}/literal",
                    f"http://internal.test:{port}/by-name",
                    f"http://mixed.test:{port}/by-name",
                    f"http://[::ffff:127.0.0.1]:{port}/mapped",
                    f"{origin_base}/go",  # the trusted origin redirects to an internal name
                ):
                    with pytest.raises(FetchError) as info:
                        await f.get_bytes(url, max_bytes=1000)
                    assert info.value.kind == "refused", url
                    assert "rule loopback" in str(info.value)
                with pytest.raises(FetchError) as info:
                    await f.resource([f"http://internal.test:{port}/res"], Expected({}), _NoStore())
                assert info.value.kind == "refused"
    assert svc.hits == []
    assert refused["loopback"] == 6 and refused["private"] == 0  # one per request: never retried


class _NoStore:
    """A blob store that must receive no byte."""

    def begin(self, algorithms: Any) -> Any:
        return self

    def write(self, data: bytes) -> None:
        raise AssertionError("nothing may be stored")

    def abort(self) -> None:
        pass


async def test_allow_list_opens_the_named_network_only() -> None:
    async with internal() as (svc, base):
        port = _port(base)
        names = resolver({"internal.test": ["127.0.0.1"]})
        wrong = AddressPolicy(allow=parse_networks(["127.0.0.2/32", "10.0.0.0/8"]), resolver=names)
        async with Fetcher(policy=wrong, retries=0) as f:
            with pytest.raises(FetchError, match="rule loopback"):
                await f.get_bytes(f"http://internal.test:{port}/a", max_bytes=1000)
        assert svc.hits == []
        right = AddressPolicy(allow=parse_networks(["127.0.0.1/32"]), resolver=names)
        async with Fetcher(policy=right, retries=0) as f:
            got = await f.get_bytes(f"http://internal.test:{port}/b", max_bytes=1000)
        assert got.content == b"secret internal data"
        assert svc.hits == [f"http://internal.test:{port}/b"]


# -- the harvester: a hostile upstream -----------------------------------------------------------


def _hostile_app(internal_base: str, internal_port: int) -> Starlette:
    inner = f"http://internal.test:{internal_port}"

    async def resourcelist(request: Request) -> Response:
        origin = str(request.base_url).rstrip("/")
        body = f"""<?xml version="1.0" encoding="UTF-8"?>
<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" xmlns:rs="http://www.openarchives.org/rs/terms/">
  <rs:md capability="resourcelist" at="2026-01-01T00:00:00Z"/>
  <url><loc>{internal_base}/literal</loc></url>
  <url><loc>{inner}/by-name</loc></url>
  <url><loc>{origin}/redirect</loc></url>
  <url><loc>{origin}/mirrored</loc>
    <rs:ln rel="duplicate" pri="1" href="{internal_base}/mirror"/>
    <rs:ln rel="duplicate" pri="2" href="{inner}/mirror"/>
  </url>
  <url><loc>{origin}/fine</loc><rs:ln rel="describedby" href="{inner}/meta"/></url>
</urlset>"""
        return Response(body, media_type="application/xml")

    async def redirect(request: Request) -> Response:
        return RedirectResponse(f"{inner}/redirected", status_code=302)

    async def content(request: Request) -> Response:
        return PlainTextResponse(f"public {request.url.path}")

    return Starlette(
        routes=[
            Route("/resourcelist.xml", resourcelist),
            Route("/redirect", redirect),
            Route("/mirrored", content),
            Route("/fine", content),
        ]
    )


async def test_hostile_upstream_gets_nothing_internal_fetched_or_republished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outbound, "system_resolver", resolver({"internal.test": ["127.0.0.1"]}))
    async with internal() as (svc, base):
        async with serving(_hostile_app(base, _port(base))) as up:
            # A public daemon (its base URL is not loopback): loopback is refused, the source's own
            # origin (configured, on 127.0.0.1 too) is trusted.
            config = parse_config(
                {
                    "server": {"base_url": "https://agg.example.org"},
                    "store": {"path": str(tmp_path / "store")},
                    "harvest": {"retries": 0, "timeout": 10},
                    "sources": [{"name": "up", "url": f"{up}/resourcelist.xml"}],
                },
                str(tmp_path / "test.toml"),
            )
            result = (await harvest(config))["up"]
            # The describedby record, as a filter plugin would ask for it.
            async with open_context(config) as ctx:
                records = MetadataRecords(ctx, 0, "up")
                entry = Entry(
                    f"{up}/fine", links=[Link("describedby", f"http://internal.test:{_port(base)}/meta")]
                )
                with pytest.raises(FetchError) as info:
                    await records(entry)
                assert info.value.kind == "refused"
    assert svc.hits == []
    got = held(config)
    assert sorted(got) == [f"{up}/fine", f"{up}/mirrored"]  # the mirror refused, loc itself served
    failed = {f.uri: f.kind for f in result.failures}
    assert failed == {
        f"{base}/literal": "refused",
        f"http://internal.test:{_port(base)}/by-name": "refused",
        f"{up}/redirect": "refused",
    }


async def test_refusals_are_counted_in_metrics(tmp_path: Path) -> None:
    metrics = Metrics(process=False)
    policy = AddressPolicy(on_refused=lambda rule: metrics.outbound_refused.labels(rule).inc())
    async with internal() as (svc, base), Fetcher(policy=policy, retries=0) as f:
        with pytest.raises(FetchError):
            await f.get_bytes(f"{base}/x", max_bytes=10)
    text = metrics.registry.get_sample_value("rsagg_outbound_refused_total", {"reason": "loopback"})
    assert text == 1.0
    assert metrics.registry.get_sample_value("rsagg_outbound_refused_total", {"reason": "private"}) == 0.0
    assert svc.hits == []


# -- the hub: callbacks on refused addresses -----------------------------------------------------


@asynccontextmanager
async def hub_server(tmp_path: Path, policy: AddressPolicy, **limits: Any) -> AsyncIterator[tuple[Hub, str]]:
    holder: dict[str, Hub] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        await holder["app"](scope, receive, send)  # type: ignore[operator]

    async with serving(app) as base:
        hub = Hub(
            connect(tmp_path / "hub.db"),
            client=delivery_client(policy, HubLimits(request_timeout=5.0, poll_interval=0.2, **limits)),
            hub_url=f"{base}/hub",
            allowed_topic=topics_under(base),
            policy=policy,
            limits=HubLimits(request_timeout=5.0, poll_interval=0.2, **limits),
        )
        holder["app"] = Starlette(routes=hub.routes())  # type: ignore[assignment]
        async with hub, trio.open_nursery() as nursery:
            await nursery.start(hub.run)
            yield hub, base
            nursery.cancel_scope.cancel()


async def test_hub_never_calls_back_into_refused_addresses(tmp_path: Path) -> None:
    refused: Counter[str] = Counter()
    async with internal() as (svc, ibase):
        port = _port(ibase)
        policy = AddressPolicy(
            resolver=resolver({"admin.internal.test": ["127.0.0.1"], "meta.test": ["169.254.169.254"]}),
            on_refused=lambda rule: refused.update([rule]),
        )
        async with hub_server(tmp_path, policy) as (hub, base), httpx.AsyncClient() as client:
            topic = f"{base}/topic"

            async def subscribe(callback: str) -> httpx.Response:
                form = {"hub.mode": "subscribe", "hub.topic": topic, "hub.callback": callback}
                return await client.post(f"{base}/hub", data=form)

            for callback in (
                f"{ibase}/internal-admin?delete=all",
                f"http://[::1]:{port}/x",
                f"http://[::ffff:127.0.0.1]:{port}/x",
                "http://169.254.169.254/latest/meta-data/",
                "http://10.0.0.1/x",
                "http://192.168.0.1/x",
                "http://0.0.0.0/x",
            ):
                r = await subscribe(callback)
                assert r.status_code == 403, callback
                assert "outbound policy" in r.text
            assert await trio.to_thread.run_sync(hub.pending) == {"verifications": 0, "deliveries": 0}
            # Names are judged where the hub connects: accepted (WebSub §5.1.2), then never reached.
            for callback in (f"http://admin.internal.test:{port}/cb", "http://meta.test/latest/meta-data/"):
                assert (await subscribe(callback)).status_code == 202
            with trio.fail_after(30):
                while refused["loopback"] < 3 + 1 or refused["link-local"] < 1 + 1:  # the 403s count too
                    await trio.sleep(0.02)
            with trio.fail_after(30):
                while (await trio.to_thread.run_sync(hub.pending))["verifications"]:
                    await trio.sleep(0.02)
            assert hub.subscriptions() == []  # stored only after a successful verification
    assert svc.hits == []


async def test_hub_allow_list_opens_a_callback_network(tmp_path: Path) -> None:
    async with internal() as (svc, ibase):
        policy = AddressPolicy(allow=parse_networks(["127.0.0.1/32"]))
        async with hub_server(tmp_path, policy) as (hub, base), httpx.AsyncClient() as client:
            form = {"hub.mode": "subscribe", "hub.topic": f"{base}/t", "hub.callback": f"{ibase}/cb"}
            assert (await client.post(f"{base}/hub", data=form)).status_code == 202
            with trio.fail_after(30):
                while not hub.subscriptions():
                    await trio.sleep(0.02)
    assert len(svc.hits) == 1 and "hub.challenge=" in svc.hits[0]


# -- the real daemon: production composition, public base URL ------------------------------------


async def test_daemon_hub_refuses_internal_callbacks_and_survives_a_flood(tmp_path: Path) -> None:
    """``rsagg run`` as deployed behind a proxy (listens on loopback, public base URL): its hub refuses
    callbacks into the loopback network, literal or by name (``localhost``), nothing reaches the internal
    listener, refusals are counted in /metrics, and a flood of subscription requests gets 429 while a
    well-behaved client keeps being served."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = "https://agg.example.org"
    (tmp_path / "rsagg.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "{base}"\n[store]\npath = "data"\n'
        # a source is required; disabled, it is never polled (no outbound request of the harvester)
        '[[sources]]\nname = "up"\nurl = "https://up.example.org/"\nenabled = false\n'
    )
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "daemon.log").open("wb")
    paths = [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    cmd = [sys.executable, "-m", "aggregator", "run", "-c", str(tmp_path / "rsagg.toml")]
    proc = await trio.lowlevel.open_process(cmd, env=env, stdout=log, stderr=log)
    try:
        async with internal() as (svc, ibase), httpx.AsyncClient(timeout=20) as client:
            with trio.fail_after(60):
                while True:
                    try:
                        if (await client.get(f"{url}/status.json")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.1)
            topic = f"{base}/"
            iport = _port(ibase)

            async def subscribe(callback: str, c: httpx.AsyncClient = client) -> httpx.Response:
                form = {"hub.mode": "subscribe", "hub.topic": topic, "hub.callback": callback}
                return await c.post(f"{url}/hub", data=form)

            r = await subscribe(f"{ibase}/internal-admin?delete=all")
            assert r.status_code == 403 and "loopback" in r.text
            assert (await subscribe("http://169.254.169.254/latest/meta-data/")).status_code == 403
            assert (await subscribe(f"http://localhost:{iport}/by-name")).status_code == 202
            with trio.fail_after(60):
                while True:
                    text = (await client.get(f"{url}/metrics")).text
                    line = 'rsagg_outbound_refused_total{reason="loopback"}'
                    value = next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)
                    if value >= 2:  # the literal one, then the verification GET to "localhost"
                        break
                    await trio.sleep(0.1)
            # A flood from another loopback address: bounded, answered 429, others still served.
            flood = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
            statuses: list[int] = []
            async with httpx.AsyncClient(timeout=20, transport=flood) as attacker:

                async def attack(k: int) -> None:
                    for i in range(50):
                        statuses.append(
                            (await subscribe(f"http://cb{k}.flood.invalid/{i}", attacker)).status_code
                        )

                with trio.fail_after(120):
                    async with trio.open_nursery() as nursery:
                        for k in range(4):
                            nursery.start_soon(attack, k)
                        for _ in range(10):
                            assert (await client.get(f"{url}/status.json")).status_code == 200
            assert len(statuses) == 200 and 429 in statuses
            assert set(statuses) <= {202, 429}
        assert svc.hits == []
    finally:
        proc.terminate()
        with trio.move_on_after(20):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()
        print((tmp_path / "daemon.log").read_text(errors="replace")[-3000:])


async def test_a_source_origin_is_trusted_for_that_source_only(tmp_path: Path) -> None:
    """Two intranet sources (loopback here, refused by the policy): each harvests its own origin; a URL on
    the *other* source's origin, named in a document, is checked like any other and refused."""
    hits: list[str] = []

    def app(items: list[str]) -> Starlette:
        async def resourcelist(request: Request) -> Response:
            urls = "".join(f"<url><loc>{u}</loc></url>" for u in items)
            return Response(
                '<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" '
                'xmlns:rs="http://www.openarchives.org/rs/terms/">'
                f'<rs:md capability="resourcelist" at="2026-01-01T00:00:00Z"/>{urls}</urlset>',
                media_type="application/xml",
            )

        async def content(request: Request) -> Response:
            hits.append(str(request.url))
            return PlainTextResponse(f"content of {request.url.path}")

        return Starlette(routes=[Route("/resourcelist.xml", resourcelist), Route("/{name}", content)])

    good_items: list[str] = []
    bad_items: list[str] = []
    async with serving(app(good_items)) as good, serving(app(bad_items)) as bad:
        good_items.append(f"{good}/a")
        bad_items += [f"{bad}/b", f"{good}/private"]
        config = parse_config(
            {
                "server": {"base_url": "https://agg.example.org"},
                "store": {"path": str(tmp_path / "store")},
                "harvest": {"retries": 0, "timeout": 10},
                "sources": [
                    {"name": "good", "url": f"{good}/resourcelist.xml"},
                    {"name": "bad", "url": f"{bad}/resourcelist.xml"},
                ],
            },
            str(tmp_path / "test.toml"),
        )
        results = await harvest(config)
    assert sorted(held(config)) == sorted([f"{good}/a", f"{bad}/b"])
    assert results["good"].failures == []
    [failure] = results["bad"].failures
    assert failure.uri == f"{good}/private" and failure.kind == "refused"
    assert "the origin of another source" in failure.message
    assert f"{good}/private" not in hits


async def test_a_name_that_re_resolves_inside_is_refused() -> None:
    """DNS rebinding: the name first resolves to an allowed address, then to an internal one; every
    connection is checked on the address it is made to, so the second never reaches the internal one."""
    answers = [["127.0.0.2"], ["127.0.0.1"]]

    async def rebinding(host: str, port: int) -> list[str]:
        await trio.lowlevel.checkpoint()
        return answers.pop(0) if len(answers) > 1 else answers[0]

    outside = Internal()
    async with internal() as (svc, ibase), serving(outside, host="127.0.0.2", port=_port(ibase)) as obase:
        assert _port(obase) == _port(ibase)  # one port, two addresses: only the address differs
        policy = AddressPolicy(allow=parse_networks(["127.0.0.2/32"]), resolver=rebinding)
        url = f"http://rebind.test:{_port(ibase)}/x"
        async with Fetcher(policy=policy, retries=0) as f:
            assert (await f.get_bytes(url, max_bytes=100)).content == b"secret internal data"
        async with Fetcher(policy=policy, retries=0) as f:  # a new connection: resolved again
            with pytest.raises(FetchError, match="rule loopback"):
                await f.get_bytes(url, max_bytes=100)
    assert len(outside.hits) == 1
    assert svc.hits == []
