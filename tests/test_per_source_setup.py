"""What each configured Source costs before its first request is paid once per distinct host or URL, not
once per Source (benchmarks/bench_many_sources.py, docs/benchmarks.md "Many sources"): the pure
functions of a host or URL asked for every Source are memoised in bounded caches, and each cached answer
is the uncached function's (generated hosts and URLs: IPv4 and IPv6 literals, brackets, trailing dots,
``localhost`` spellings, upper case, ports, junk); the waiting syncs of a host share one lease timer.
"""

from __future__ import annotations

import ipaddress
import math
import random
from urllib.parse import urlsplit

import httpx
import pytest
import trio
import trio.testing

from aggregator.config import Config, SourceConfig
from aggregator.harvest import access, admission
from aggregator.net import outbound

# -- generated hosts and URLs ------------------------------------------------------------------------------

FIXED_HOSTS = [
    "localhost", "LOCALHOST", "localhost.", "LocalHost.", "a.localhost", "A.B.LOCALHOST", "a.localhost.",
    "localhost.example", "notlocalhost", "127.0.0.1", "127.1", "127.0.0.1.", "0177.0.0.1", "127.255.255.254",
    "10.0.0.5", "0.0.0.0", "1.2.3.4", "[::1]", "::1", "[::1", "::1]", "[0:0:0:0:0:0:0:1]",
    "[::ffff:127.0.0.1]",
    "[::FFFF:7f00:1]", "[fe80::1%25eth0]", "[fe80::1%eth0]", "[2001:DB8::1]", "2001:db8::1", "[]", "",
    "[v1.x]", "example.org", "EXAMPLE.ORG.", "xn--bcher-kva.example", "bücher.example", "ß.example",
    "a..b", ".", "[[::1]]", " 127.0.0.1", "127.0.0.1 ",
]  # fmt: skip


def _host(rng: random.Random) -> str:
    kind = rng.randrange(7)
    if kind == 0:
        host = rng.choice(FIXED_HOSTS)
    elif kind == 1:  # IPv4, sometimes loopback, sometimes with a leading zero
        first = rng.choice([127, 10, 192, 1, 0, 255])
        host = ".".join(str(o) for o in [first, *(rng.randrange(256) for _ in range(3))])
        if rng.random() < 0.1:
            host = "0" + host
    elif kind == 2:  # IPv6, compressed or not, maybe an embedded IPv4
        address = ipaddress.IPv6Address(
            rng.choice([1, rng.getrandbits(128), (0xFFFF << 32) | rng.getrandbits(32)])
        )
        host = address.compressed if rng.random() < 0.7 else address.exploded
        host = f"[{host}]" if rng.random() < 0.8 else host
    elif kind == 3:  # a name
        host = ".".join(
            rng.choice(["a", "b-c", "xn--p1ai", "localhost", "local", "x1"])
            for _ in range(rng.randrange(1, 4))
        )
    elif kind == 4:
        host = rng.choice(["localhost", "sub.localhost", "localhost.localdomain"])
    else:
        host = rng.choice(FIXED_HOSTS)
    if rng.random() < 0.3:
        host = "".join(c.upper() if rng.random() < 0.5 else c for c in host)
    if rng.random() < 0.15:
        host += "."
    return host


def _url(rng: random.Random) -> str:
    scheme = rng.choice(["http", "https", "HTTP", "Https", "ftp", ""])
    userinfo = rng.choice(["", "", "user@", "u:p@"])
    port = rng.choice(["", "", ":80", ":443", ":8080", ":0", ":65536", ":x", ":"])
    path = rng.choice(["", "/", "/caps.xml", "/a/../b?x=1#f", "?q", "#f", "/\x7f", "/a b"])
    return f"{scheme}://{userinfo}{_host(rng)}{port}{path}" if scheme or rng.random() < 0.5 else _host(rng)


def _answer(fn, *args):  # what a call gives: its value, or the kind of its error
    try:
        return ("=", fn(*args))
    except Exception as exc:  # the error is part of the answer
        return ("!", type(exc))


@pytest.mark.parametrize("seed", range(3))
def test_each_cached_answer_is_the_uncached_functions(seed: int) -> None:
    """Cache warmed in random order, each host and URL asked several times: every answer of a memoised
    function is what its undecorated function (``__wrapped__``) gives for the same text."""
    rng = random.Random(seed)
    hosts = [_host(rng) for _ in range(400)] + FIXED_HOSTS
    urls = [_url(rng) for _ in range(400)] + [f"http://{h}/x" for h in FIXED_HOSTS]
    cached = (
        outbound.is_loopback_host,
        outbound._is_literal,
        outbound._implicit_networks,
        outbound._host_key,
    )
    for fn in (*cached, access._url_origin, admission._host):
        fn.cache_clear()
    for _round in range(3):
        for host in rng.sample(hosts, len(hosts)):
            for fn in cached:
                assert _answer(fn, host) == _answer(fn.__wrapped__, host), (fn.__name__, host)
        for url in rng.sample(urls, len(urls)):
            assert _answer(access._url_origin, url) == _answer(access._url_origin.__wrapped__, url), url
            assert _answer(admission._host, url) == _answer(admission._host.__wrapped__, url), url
            assert _answer(outbound.implicit_networks, url) == _answer(_implicit_networks_uncached, url), url
    assert outbound.is_loopback_host.cache_info().hits > 0 and access._url_origin.cache_info().hits > 0


def _implicit_networks_uncached(url: str) -> tuple:
    """``implicit_networks`` as it was before it was memoised: every parse made again."""
    host = urlsplit(url).hostname or ""
    loopback, literal = outbound.is_loopback_host.__wrapped__, outbound._is_literal.__wrapped__
    if loopback(host) and not literal(host):
        return outbound.LOOPBACK
    try:
        return (ipaddress.ip_network(ipaddress.ip_address(host.strip("[]"))),)
    except ValueError:
        return ()


def test_the_sources_of_one_host_are_pinned_at_the_same_networks() -> None:
    """300 Sources of one literal address: one parse, the very same network objects in every pin (a
    connection pool's key compares them by identity first)."""
    outbound._implicit_networks.cache_clear()
    config = Config(sources=tuple(
        SourceConfig(name=f"s{i}", url=f"http://127.0.0.1:8000/s{i}/caps.xml") for i in range(300)
    ))  # fmt: skip
    pins = outbound.configured_pins(config)
    by_source = pins[("127.0.0.1", 8000)]
    assert len(by_source) == 300 and len({id(nets) for nets in by_source.values()}) == 1
    assert by_source["s7"] == (ipaddress.ip_network("127.0.0.1/32"),)
    assert outbound._implicit_networks.cache_info().misses == 1
    # A source naming more networks still has them all, once each.
    config = Config(sources=(
        SourceConfig(name="a", url="http://127.0.0.1:8000/", addresses=("127.0.0.1/32", "10.0.0.0/8")),
    ))  # fmt: skip
    assert outbound.configured_pins(config)[("127.0.0.1", 8000)]["a"] == (
        ipaddress.ip_network("127.0.0.1/32"), ipaddress.ip_network("10.0.0.0/8"),
    )  # fmt: skip


def test_a_source_without_headers_parses_no_origin_until_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The origin of a Source is parsed where it is used (headers to keep on it): at once for a Source
    with headers (a URL httpx cannot read stops the start, as before), else when first asked; either way
    it is httpx's reading of the URL."""
    parsed: list[str] = []
    real = httpx.URL

    def counting(url: str) -> httpx.URL:
        parsed.append(url)
        return real(url)

    monkeypatch.setattr(access.httpx, "URL", counting)
    access._url_origin.cache_clear()
    bare = access.SourceAccess("http://Example.ORG:80/caps.xml", {}, 0)
    assert parsed == []
    assert bare.origin == ("http", "example.org", 80) and len(parsed) == 1
    with_headers = access.SourceAccess("https://example.org/x", {"X-Key": "v"}, 0)
    assert with_headers.origin == ("https", "example.org", 443) and len(parsed) == 2
    with pytest.raises(httpx.InvalidURL):
        access.SourceAccess("http://example.org/\x7f", {"X-Key": "v"}, 0)


def test_most_sources_read_no_secret_and_scrub_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    added: list[list] = []
    monkeypatch.setattr(access, "add_secrets", lambda values: added.append(list(values)))
    config = Config(sources=(SourceConfig(name="a", url="http://example.org/"),))
    assert access.resolve_headers(config, 0, config.sources[0]) == {}
    assert added == []


# -- the waiting syncs of a host share one lease timer (harvest/admission.py) ------------------------------


@pytest.mark.parametrize(("slots", "start"), [(1, 0.0), (3, 0.0), (2, 5.0)])
def test_the_waiting_syncs_of_a_host_share_one_timer(
    monkeypatch: pytest.MonkeyPatch, slots: int, start: float
) -> None:
    """60 syncs of one host arrive at once: all but ``PER_SLOT * slots`` wait, yet only one of them at a
    time waits with a deadline (the lease of the oldest admitted sync); when a long sync's lease ends,
    the next ones are admitted at that moment, and every sync runs, in the order it came. (Admitted at
    0.0 on the test clock, a sync has its lease too: the waiting ones once spun on it.)"""
    timed = 0
    real = trio.move_on_at

    def counting(deadline: float) -> trio.CancelScope:
        nonlocal timed
        timed += 1
        if timed > 10_000:
            raise AssertionError("the waiting syncs spin")
        return real(deadline)

    monkeypatch.setattr(trio, "move_on_at", counting)
    lease, most = 10.0, admission.PER_SLOT * slots
    adm = admission.Admissions(lease=lease)
    admitted: list[tuple[int, float]] = []

    async def one(i: int) -> None:
        async with adm.admitted("http://h.example/caps.xml", lambda host: slots):
            admitted.append((i, trio.current_time()))
            await trio.sleep(50.0 if i == 0 else 1.0)  # the first one runs past its lease

    async def main() -> None:
        await trio.sleep(start)
        async with trio.open_nursery() as nursery:
            for i in range(60):
                nursery.start_soon(one, i)
                await trio.sleep(0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    times = [t for _, t in sorted(admitted)]
    assert len(times) == 60 and times == sorted(times)  # every one ran, first come first served
    waited = 60 - most
    assert timed < waited / 4, (timed, waited)
    # The long sync stopped counting after its lease: someone was admitted at that very moment.
    assert any(math.isclose(t, start + lease) for _, t in admitted), admitted
    assert adm._hosts == {}
