"""The outbound address policy: which addresses rsagg may connect to, checked where it connects.

Why here, at the connection: rsagg makes requests to URLs that others choose (callbacks of hub
subscribers, resources, mirrors, redirects and ``describedby`` records named by upstream documents, the
hubs upstream documents name). Left alone, that makes every rsagg a relay into its own network
(server-side request forgery): the hub would GET ``http://169.254.169.254/latest/meta-data/`` for anyone
who asks, and the harvester would fetch and then *republish* whatever a hostile upstream points at on
``127.0.0.1``. Checking the URL's host is not enough: a name may resolve (or re-resolve, between a check
and the connection: DNS rebinding) to an internal address. So every client rsagg builds for such requests
uses ``PolicedTransport`` (this module is the one place: tests/test_outbound_paths.py proves no other client
is built, but the Fetcher's lean pool, ``net/lean.py``, which connects through ``checked_addresses`` too),
whose network backend resolves the name itself, drops the refused addresses and connects to a checked
address only; a redirect is a new request and so a new check. See docs/security.md.

Refused by default (rule names are the ``reason`` label of ``rsagg_outbound_refused_total``): loopback,
private (RFC 1918, fc00::/7, RFC 6598 shared space), link-local (169.254/16 with the cloud metadata
services, fe80::/10), unspecified (0.0.0.0/8, ::), multicast, and every other range that is not globally
reachable (documentation, benchmarking, reserved: ``reserved``). IPv4 addresses embedded in IPv6
(``::ffff:a.b.c.d``, NAT64 ``64:ff9b::/96``, 6to4 ``2002::/16``) are judged as the IPv4 address.
``self``: rsagg's own server, by URL (``server.base_url`` and below) and by address (``server.listen``).

Trust is per requester and per address, never per name: ``allow`` opens networks for everyone; ``pins``
open networks for one origin (host, port) and one requester only, e.g. an intranet source's own origin
for that source's requests (its literal address, ``localhost``, or ``[[sources]] addresses``). Whatever
a name resolves to, the address connected to is checked. A connection opened under a pin is pooled apart
(one pool per pin), so it never serves another requester's request.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import posixpath
import socket
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import httpcore
import httpx
import trio

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger("rsagg.outbound")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: ``await resolver(host, port)`` -> the addresses of ``host`` as strings (a seam for tests).
Resolver = Callable[[str, int], Awaitable[list[str]]]

_N = ipaddress.ip_network
#: (rule, network), the first match names the rule; anything else not ``is_global`` is "reserved".
RULES: tuple[tuple[str, IPNetwork], ...] = (
    ("loopback", _N("127.0.0.0/8")),
    ("loopback", _N("::1/128")),
    ("private", _N("10.0.0.0/8")),
    ("private", _N("172.16.0.0/12")),
    ("private", _N("192.168.0.0/16")),
    ("private", _N("100.64.0.0/10")),  # RFC 6598 carrier-grade NAT: an operator's internal network
    ("private", _N("fc00::/7")),
    ("link-local", _N("169.254.0.0/16")),  # includes 169.254.169.254, the cloud metadata services
    ("link-local", _N("fe80::/10")),
    ("unspecified", _N("0.0.0.0/8")),  # "this network": 0.0.0.0 reaches the local host on Linux
    ("unspecified", _N("::/128")),
    ("multicast", _N("224.0.0.0/4")),
    ("multicast", _N("ff00::/8")),
)
REASONS = ("loopback", "private", "link-local", "unspecified", "multicast", "reserved", "self")
#: Requesters that are not sources (source names are ``[a-z0-9_-]``: these never collide). A request is
#: made for ``current_source()`` (the source whose sync runs), or for the one ``acting_for`` names.
NOTIFIER = "<notifier>"  # pings of the external hub (``notifications.hub``) for rsagg's own topics
OWN_TOPICS = "<own-topics>"  # the embedded hub fetching one of rsagg's own topics (a generic ping)
ANONYMOUS = ""  # anyone else: hub callbacks, requests outside a source's sync
LOOPBACK: tuple[IPNetwork, ...] = (_N("127.0.0.0/8"), _N("::1/128"))
_NAT64 = _N("64:ff9b::/96")
DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)


def refusal_rule(address: IPAddress) -> str | None:
    """The rule that refuses ``address`` by default, or None for a globally reachable address."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return refusal_rule(embedded)
    for rule, network in RULES:
        if address.version == network.version and address in network:
            return rule
    return None if address.is_global else "reserved"


def parse_networks(values: Iterable[str]) -> tuple[IPNetwork, ...]:
    """``["10.1.0.0/16", "fd00::1"]`` -> networks (a bare address is a /32 or /128); ValueError names
    the bad value (host bits set, e.g. 10.1.2.3/16, are an error: the allow-list opens exactly what it
    names)."""
    out = []
    for value in values:
        try:
            out.append(ipaddress.ip_network(value.strip(), strict=True))
        except ValueError as exc:
            raise ValueError(f"{value!r} is not a network: {exc}") from None
    return tuple(out)


@functools.lru_cache(maxsize=4096)  # a pure function of the text, asked per configured URL and per listen
def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or a literal address) is this machine's loopback only."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin(url: str) -> tuple[str, int] | None:
    """(host, port) of an http(s) URL, the key of ``AddressPolicy.pins``; None when it has none."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return _host_key(parts.hostname), port


@functools.lru_cache(maxsize=64)  # own_urls rarely change: their origins, parsed once
def _origins(urls: tuple[str, ...]) -> tuple[tuple[str, int] | None, ...]:
    return tuple(origin(u) for u in urls)


@functools.lru_cache(maxsize=4096)  # a pure function of the text, asked on every request (pins, own URLs)
def _host_key(host: str) -> str:
    """A host as the policy compares it: lower case, no brackets, no trailing dot of a fully
    qualified name (``agg.example.org.`` is ``agg.example.org``), an address in its canonical form."""
    host = host.strip("[]").lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


@functools.lru_cache(maxsize=4096)  # asked before every lean GET; keyed by own_urls too (a reload)
def _own_origin(own_urls: tuple[str, ...], host: str, port: int) -> bool:
    """``AddressPolicy.own_origin``'s answer for these own URLs."""
    key = _host_key(host)
    return any(b is not None and b[0] == key and (b[1] == port or {b[1], port} == {80, 443})
               for b in _origins(own_urls))  # fmt: skip


def implicit_networks(url: str) -> tuple[IPNetwork, ...]:
    """The networks a configured URL's origin is trusted at without being told: its literal address
    (no name, so nothing to re-point), or loopback for ``localhost`` (RFC 6761 §6.3: always loopback;
    what it resolves to is still checked against loopback). Other names: none."""
    return _implicit_networks(urlsplit(url).hostname or "")


# Why cached: a pure function of the host, asked for every configured Source (300 Sources on one host
# parsed the same address 300 times), and the networks it returns are then the same objects for every
# Source of the host, which the connection pools' keys compare by identity first (``LeanPool``).
@functools.lru_cache(maxsize=4096)
def _implicit_networks(host: str) -> tuple[IPNetwork, ...]:
    """``implicit_networks`` of a URL whose host (``urlsplit(...).hostname``) is ``host``."""
    if is_loopback_host(host) and not _is_literal(host):
        return LOOPBACK
    try:
        return (ipaddress.ip_network(ipaddress.ip_address(host.strip("[]"))),)
    except ValueError:
        return ()


@functools.lru_cache(maxsize=4096)  # a pure function of the text: per configured URL, per literal check
def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


_acting_for: ContextVar[str | None] = ContextVar("rsagg_outbound_acting_for", default=None)


@contextmanager
def acting_for(requester: str) -> Iterator[None]:
    """Requests made inside are made for ``requester`` (a source's name, ``NOTIFIER``, ``OWN_TOPICS``):
    its pins apply, nobody else's. Why a context variable: the check is made deep in the connection
    pool, in the task that sends the request."""
    token = _acting_for.set(requester)
    try:
        yield
    finally:
        _acting_for.reset(token)


def _own_path(path: str) -> str:
    """A URL path as a server reads it (percent-decoded, dot segments resolved): ``/a/%2E%2E/metrics``
    is ``/metrics``."""
    decoded = unquote(path or "/")
    out = posixpath.normpath(decoded) if decoded not in ("", "/") else "/"
    return "/" + out.lstrip("/") if out != "." else "/"


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` from the system resolver (getaddrinfo, in a thread via trio)."""
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class OutboundRefused(httpx.ConnectError):
    """A connection the policy refused; ``str()`` names the host, the address and the rule."""

    def __init__(self, host: str, port: int, address: str, rule: str, note: str = "", hint: str = "") -> None:
        hint = hint or "open it with [outbound] allow if it is meant to be reached"
        what = f"address {address}" if address else "the URL"
        super().__init__(f"outbound policy refused {host}:{port} ({what} is {rule}{note}; {hint})")
        self.host, self.port, self.address, self.rule = host, port, address, rule


def refusal_of(exc: BaseException | None) -> OutboundRefused | None:
    """The OutboundRefused behind ``exc`` (itself, or a cause or context), if any."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OutboundRefused):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


Pins = dict[tuple[str, int], dict[str, tuple[IPNetwork, ...]]]


@dataclass
class AddressPolicy:
    """What may be connected to: everything but the refused ranges, plus ``allow``, plus ``pins``."""

    allow: tuple[IPNetwork, ...] = ()
    #: origin (host, port) -> requester -> the networks that origin may be reached at for that requester
    #: although refused (a source's intranet address). Never a name: the address connected to is checked.
    pins: Pins = field(default_factory=dict)
    #: rsagg's own server by URL (``server.base_url``): nothing at or below it is requested, but the
    #: embedded hub's fetch of one of its own topics (``OWN_TOPICS``, checked by the hub first).
    own_urls: tuple[str, ...] = ()
    #: rsagg's own server by address: (network, port) pairs of ``server.listen`` (rule ``self``).
    own_sockets: tuple[tuple[IPNetwork, int], ...] = ()
    #: None: ``system_resolver`` (looked up when used, so a test may replace it module-wide).
    resolver: Resolver | None = None
    #: Called with the rule of every refused connection (the metrics counter).
    on_refused: Callable[[str], None] | None = field(default=None, repr=False)
    #: The source a request is made for ("" outside a source's sync), unless ``acting_for`` says.
    current_source: Callable[[], str] | None = field(default=None, repr=False)

    def requester(self) -> str:
        """Who the request being made is for (``acting_for``, else the current source, else anyone)."""
        role = _acting_for.get()
        if role is not None:
            return role
        return self.current_source() if self.current_source is not None else ANONYMOUS

    def pinned(self, host: str, port: int, requester: str | None = None) -> tuple[IPNetwork, ...]:
        """The networks (host, port) may be reached at for ``requester`` (default: the current one)."""
        by = self.pins.get((_host_key(host), port))
        if not by:
            return ()
        return by.get(self.requester() if requester is None else requester, ())

    def rule_for(
        self,
        address: str | IPAddress,
        *,
        port: int | None = None,
        extra: tuple[IPNetwork, ...] = (),
        requester: str | None = None,
    ) -> str | None:
        """The rule refusing a connection to ``address`` (on ``port``, when known), or None when it may be
        connected to. ``extra``: networks pinned for this origin and requester."""
        ip = ipaddress.ip_address(address) if isinstance(address, str) else address
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # the same host: judged, allowed and pinned as the IPv4 address
        if port is not None and self._own_socket(ip, port):
            if (self.requester() if requester is None else requester) != OWN_TOPICS:
                return "self"
        if any(ip.version == n.version and ip in n for n in (*self.allow, *extra)):
            return None
        return refusal_rule(ip)

    def _own_socket(self, ip: IPAddress, port: int) -> bool:
        return any(p == port and ip.version == n.version and ip in n for n, p in self.own_sockets)

    def own_origin(self, host: str, port: int) -> bool:
        """Whether an own URL (``server.base_url``) may be on (host, port): only then does ``own_url``
        have a path to judge. Why: asked before every lean GET (``net/lean.py``), which already has the
        URL's parts; the answer for an origin asked before is one cache lookup (``_own_origin``)."""
        return bool(self.own_urls) and _own_origin(self.own_urls, host, port)

    def own_url(self, url: str) -> bool:
        """Whether ``url`` is rsagg's own (at or below ``server.base_url``), however it is spelt."""
        if not self.own_urls:
            return False
        o = origin(url)
        if o is None:
            return False
        path: str | None = None
        for base in self.own_urls:
            b = origin(base)
            # Same host; the same port, or the other default one (http://BASE reaches the proxy too).
            if b is None or b[0] != o[0] or (b[1] != o[1] and {b[1], o[1]} != {80, 443}):
                continue
            if path is None:  # only for a URL on rsagg's own host (checked on every request)
                try:
                    path = _own_path(urlsplit(url).path)
                except ValueError:
                    return False
            root = _own_path(urlsplit(base).path).rstrip("/")
            if not root or path == root or path.startswith(root + "/"):
                return True
        return False

    def literal_rule(self, url: str) -> str | None:
        """For a URL that is rsagg's own, or whose host is a literal address: the rule refusing it,
        checked before any connection (e.g. to answer a hub subscription at once), for anyone. Names
        are judged when connecting."""
        if self.own_url(url):
            return "self"
        o = origin(url)
        if o is None or not _is_literal(o[0]):
            return None
        return self.rule_for(o[0], port=o[1], requester=ANONYMOUS)

    def check_request(self, url: str) -> None:
        """Before every request (each redirect hop too): rsagg's own URLs are not requested
        (a hostile Source listing ``BASE/metrics`` must not get it fetched and republished), but
        by the embedded hub for its own topics."""
        if self.own_url(url) and self.requester() != OWN_TOPICS:
            o = origin(url) or ("", 0)
            note, hint = ", under rsagg's own server.base_url", "rsagg does not request its own URLs"
            raise self.refused(o[0], o[1], "", "self", note, hint)

    def refused(
        self, host: str, port: int, address: str, rule: str, note: str = "", hint: str = ""
    ) -> OutboundRefused:
        log.warning("outbound: refused %s:%s (address %s, rule %s%s)", host, port, address or "-", rule, note)
        if self.on_refused is not None:
            try:
                self.on_refused(rule)
            except Exception:
                log.exception("outbound: refusal hook failed")
        return OutboundRefused(host, port, address, rule, note, hint)

    def refusal_note(self, host: str, port: int, requester: str) -> tuple[str, str]:
        """Why an origin's pins did not help, and what the operator may do (named in the error):
        another requester's origin, or a name that moved away from the addresses trusted for it."""
        by = self.pins.get((_host_key(host), port)) or {}
        mine = by.get(requester)
        if mine:
            nets = ", ".join(str(n) for n in mine)
            hint = (
                f"if the move is meant, add the address to [[sources]] addresses of {requester!r}"
                if not requester.startswith("<")
                else "open it with [outbound] allow if the move is meant"
            )
            return f", not among the addresses trusted for {_who(requester)} ({nets}): the name moved", hint
        if any(by.values()):
            return ", and the origin of another source", ""
        return "", ""


def _who(requester: str) -> str:
    return requester if requester.startswith("<") else f"source {requester!r}"


async def _addresses(policy: AddressPolicy, name: str, port: int, timeout: float | None) -> list[str]:
    """A literal address, or the addresses ``name`` resolves to (httpcore's errors when it does not)."""
    try:
        return [str(ipaddress.ip_address(name))]
    except ValueError:
        pass
    try:
        with trio.fail_after(timeout if timeout is not None else float("inf")):
            addresses = await (policy.resolver or system_resolver)(name, port)
    except trio.TooSlowError:
        raise httpcore.ConnectTimeout(f"resolving {name} timed out") from None
    except OSError as exc:
        raise httpcore.ConnectError(f"cannot resolve {name}: {exc}") from exc
    if not addresses:
        raise httpcore.ConnectError(f"cannot resolve {name}: no addresses")
    return addresses


async def checked_addresses(
    policy: AddressPolicy,
    host: str,
    port: int,
    extra: tuple[IPNetwork, ...] = (),
    timeout: float | None = None,
) -> list[str]:
    """The addresses of ``host`` that a new connection may be made to, in the resolver's order: ``host``
    resolved now, each address judged by ``policy`` for the current requester (``extra``: the networks
    pinned for this origin and requester). Raises ``OutboundRefused`` when none may be (named by the
    first refused address's rule), httpcore's ConnectError/ConnectTimeout when the name does not
    resolve. Every client connects only to what this returns: ``PolicedBackend`` (httpx) and
    ``net/lean.py``'s pool."""
    name = host.strip("[]")
    requester = policy.requester()
    addresses = await _addresses(policy, name, port, timeout)
    allowed: list[str] = []
    first_refusal: tuple[str, str] | None = None
    for address in addresses:
        rule = policy.rule_for(address, port=port, extra=extra, requester=requester)
        if rule is None:
            allowed.append(address)
        elif first_refusal is None:
            first_refusal = (address, rule)
    if not allowed:
        assert first_refusal is not None
        if first_refusal[1] == "self":
            note, hint = ", rsagg's own server.listen", "rsagg does not request its own server"
        else:
            note, hint = policy.refusal_note(name, port, requester)
        raise policy.refused(name, port, *first_refusal, note, hint)
    return allowed


class PolicedBackend(httpcore.AsyncNetworkBackend):
    """An httpcore network backend that resolves, checks and connects to the checked address only.

    ``extra``: the networks pinned for the one origin and requester this backend's pool serves
    (``PolicedTransport``); empty for the shared pool."""

    def __init__(
        self,
        policy: AddressPolicy,
        inner: httpcore.AsyncNetworkBackend | None = None,
        extra: tuple[IPNetwork, ...] = (),
    ) -> None:
        self.policy = policy
        self.extra = extra
        self._inner = inner or httpcore.TrioBackend()  # rsagg runs on trio

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        allowed = await checked_addresses(self.policy, host, port, self.extra, timeout)
        error: Exception | None = None
        for address in allowed:  # in the resolver's order; each one checked
            try:
                return await self._inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not used for outbound requests")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class PolicedTransport(httpx.AsyncHTTPTransport):
    """``httpx.AsyncHTTPTransport`` whose connections go through ``PolicedBackend``: every outbound
    request of rsagg on behalf of someone else passes ``handle_async_request`` here.

    httpx does not take a network backend, so the pool it built is replaced by an equal one that uses
    ours (httpcore's documented ``network_backend`` argument). A request to a pinned origin, for a
    requester with a pin there, goes to a pool of its own (``extra``): a connection opened at a pinned
    (intranet) address is never reused for anybody else. No proxy: with a proxy, the proxy connects (and
    must enforce its own egress rules, docs/security.md).
    """

    def __init__(
        self,
        policy: AddressPolicy,
        *,
        verify: Any = True,
        limits: httpx.Limits = DEFAULT_LIMITS,
        extra: tuple[IPNetwork, ...] = (),
    ) -> None:
        ssl_context = verify if not isinstance(verify, bool) else httpx.create_ssl_context(verify=verify)
        super().__init__(verify=ssl_context, limits=limits, trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=PolicedBackend(policy, extra=extra),
        )
        self.policy = policy
        self._ssl_context, self._limits, self._extra = ssl_context, limits, extra
        self._pinned: dict[tuple[str, int, tuple[IPNetwork, ...]], PolicedTransport] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            self.policy.check_request(str(url))
        except OutboundRefused as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        if not self._extra:
            extra = self.policy.pinned(url.host, port)
            if extra:
                key = (_host_key(url.host), port, extra)
                pinned = self._pinned.get(key)
                if pinned is None:
                    pinned = self._pinned[key] = PolicedTransport(
                        self.policy, verify=self._ssl_context, limits=self._limits, extra=extra
                    )
                return await pinned.handle_async_request(request)
        return await super().handle_async_request(request)

    async def aclose(self) -> None:
        for pinned in list(self._pinned.values()):
            await pinned.aclose()
        await super().aclose()


def local_instance(config: Config) -> bool:
    """Whether the daemon is reachable from this machine only: ``server.listen`` and ``server.base_url``
    both loopback (a public deployment behind a proxy listens on loopback too, but its base URL is public).
    """
    listen_host = config.server.listen.rpartition(":")[0]
    return is_loopback_host(listen_host) and is_loopback_host(urlsplit(config.server.base_url).hostname or "")


def allowed_networks(config: Config) -> tuple[IPNetwork, ...]:
    """``[outbound] allow`` as networks; unset: loopback on a local instance, else nothing."""
    if config.outbound.allow is not None:
        return parse_networks(config.outbound.allow)
    return LOOPBACK if local_instance(config) else ()


def listen_sockets(config: Config) -> tuple[tuple[IPNetwork, int], ...]:
    """rsagg's own listening sockets as (network, port): ``server.listen``; a wildcard address is
    reached through loopback and "this host" (0.0.0.0/8, ::) as well (rule ``self``)."""
    host, _, port_text = config.server.listen.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        return ()
    if is_loopback_host(host) and not _is_literal(host):
        nets: tuple[IPNetwork, ...] = LOOPBACK
    elif host in ("", "0.0.0.0"):
        nets = (_N("0.0.0.0/8"), _N("127.0.0.0/8"))
    elif host == "::":
        nets = (_N("::/128"), _N("::1/128"), _N("0.0.0.0/8"), _N("127.0.0.0/8"))
    else:
        try:
            nets = (ipaddress.ip_network(ipaddress.ip_address(host)),)
        except ValueError:
            return ()  # a name: its own URL is still refused by ``own_urls``
    return tuple((n, port) for n in nets)


def configured_pins(config: Config) -> Pins:
    """The origins the operator configured, each trusted at the networks it names for its requester
    only: a source's (its literal address, ``localhost``, or ``[[sources]] addresses``) for that source,
    an external hub's (its literal address or ``localhost``) for the notifier's pings."""
    pins: Pins = {}

    def pin(url: str, requester: str, nets: tuple[IPNetwork, ...]) -> None:
        o = origin(url)
        if o is None or not nets:
            return
        mine = pins.setdefault(o, {}).get(requester, ())
        # One network alone is kept as it is (the same objects for every Source of the host).
        pins[o][requester] = nets if not mine and len(nets) == 1 else tuple(dict.fromkeys((*mine, *nets)))

    for src in config.sources:
        pin(src.url, src.name, implicit_networks(src.url) + parse_networks(src.addresses))
    if config.notifications.hub:
        pin(config.notifications.hub, NOTIFIER, implicit_networks(config.notifications.hub))
    return pins


def policy_for(
    config: Config, *, hub: bool = False, current_source: Callable[[], str] | None = None, **kw: Any
) -> AddressPolicy:
    """The policy of a daemon with ``config``. ``hub=True`` (the embedded hub: anyone names its
    callbacks) pins nothing but rsagg's own base URL for its own topic fetches. ``current_source``:
    which source a request is for (harvest: a source's origin is trusted for its own requests only)."""
    policy = AddressPolicy(allowed_networks(config), current_source=current_source, **kw)
    update_policy(policy, config, hub=hub)
    proxies = urllib.request.getproxies()
    if not hub and proxies:  # the harvester honours them (fetch.py); the WebSub clients do not
        log.warning(
            "outbound: proxies in the environment (%s): the harvester's requests through them are not "
            "checked by the address policy; the proxy must refuse internal addresses (docs/security.md)",
            ", ".join(sorted(proxies)),
        )
    return policy


def update_policy(policy: AddressPolicy | None, config: Config, *, hub: bool = False) -> None:
    """A reloaded configuration (new sources, a changed allow-list) applies to connections made from now."""
    if policy is None:
        return
    base = config.server.base_url
    if hub:
        own = origin(base)
        pins: Pins = {own: {OWN_TOPICS: implicit_networks(base)}} if own and implicit_networks(base) else {}
    else:
        pins = configured_pins(config)
    policy.allow = allowed_networks(config)
    policy.pins = pins
    policy.own_urls = (base,)
    policy.own_sockets = listen_sockets(config)


def transport(
    policy: AddressPolicy | None, *, verify: Any = True, limits: httpx.Limits | None = None
) -> httpx.AsyncHTTPTransport:
    """A policed transport, or httpx's own when ``policy`` is None (a library user's unchecked client)."""
    limits = limits or DEFAULT_LIMITS
    if policy is None:
        return httpx.AsyncHTTPTransport(verify=verify, limits=limits)
    return PolicedTransport(policy, verify=verify, limits=limits)


def client(
    policy: AddressPolicy | None, *, limits: httpx.Limits | None = None, **kw: Any
) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` whose every connection obeys ``policy`` (no proxies from the environment:
    a proxy would connect in our place, unchecked)."""
    limits = limits or DEFAULT_LIMITS
    return httpx.AsyncClient(
        transport=transport(policy, limits=limits), limits=limits, trust_env=policy is None, **kw
    )


__all__ = [
    "ANONYMOUS",
    "LOOPBACK",
    "NOTIFIER",
    "OWN_TOPICS",
    "REASONS",
    "AddressPolicy",
    "OutboundRefused",
    "PolicedBackend",
    "PolicedTransport",
    "acting_for",
    "allowed_networks",
    "checked_addresses",
    "client",
    "configured_pins",
    "implicit_networks",
    "is_loopback_host",
    "listen_sockets",
    "local_instance",
    "origin",
    "parse_networks",
    "policy_for",
    "refusal_of",
    "refusal_rule",
    "system_resolver",
    "transport",
    "update_policy",
]
