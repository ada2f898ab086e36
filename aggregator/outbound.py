"""The outbound address policy: which addresses rsagg may connect to, checked where it connects.

Why here, at the connection: rsagg makes requests to URLs that others choose (callbacks of hub
subscribers, resources, mirrors, redirects and ``describedby`` records named by upstream documents). Left
alone, that makes every rsagg a relay into its own network (server-side request forgery): the hub would GET
``http://169.254.169.254/latest/meta-data/`` for anyone who asks, and the harvester would fetch and then
*republish* whatever a hostile upstream points at on ``127.0.0.1``. Checking the URL's host is not enough:
a name may resolve (or re-resolve, between a check and the connection) to an internal address. So every
client rsagg builds for such requests uses ``PolicedTransport``, whose network backend resolves the name
itself, drops the refused addresses and connects to a checked address only; a redirect is a new request
and so a new check. See docs/security.md for the threat model and the defaults.

Refused by default (rule names are the ``reason`` label of ``rsagg_outbound_refused_total``): loopback,
private (RFC 1918, fc00::/7, RFC 6598 shared space), link-local (169.254/16 with the cloud metadata
services, fe80::/10), unspecified (0.0.0.0/8, ::), multicast, and every other range that is not globally
reachable (documentation, benchmarking, reserved: ``reserved``). IPv4 addresses embedded in IPv6
(``::ffff:a.b.c.d``, NAT64 ``64:ff9b::/96``, 6to4 ``2002::/16``) are judged as the IPv4 address.
``allow`` opens exact networks; origins in ``trusted`` (host, port) connect without a check (the
origins an operator configured: a Source's own URL, an external hub). A Source's origin is trusted for
that Source's requests only (``owners``, ``check_request``).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpcore
import httpx
import trio

if TYPE_CHECKING:
    from .config import Config

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
REASONS = ("loopback", "private", "link-local", "unspecified", "multicast", "reserved")
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
    """(host, port) of an http(s) URL, the key of ``AddressPolicy.trusted``; None when it has none."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return parts.hostname.lower(), port


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` from the system resolver (getaddrinfo, in a thread via trio)."""
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class OutboundRefused(httpx.ConnectError):
    """A connection the policy refused; ``str()`` names the host, the address and the rule."""

    def __init__(self, host: str, port: int, address: str, rule: str, note: str = "") -> None:
        super().__init__(
            f"outbound policy refused {host}:{port} (address {address} is {rule}{note}; "
            f"open it with [outbound] allow if it is meant to be reached)"
        )
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


@dataclass
class AddressPolicy:
    """What may be connected to: everything but the refused ranges, plus ``allow``, plus ``trusted``."""

    allow: tuple[IPNetwork, ...] = ()
    trusted: frozenset[tuple[str, int]] = frozenset()
    #: None: ``system_resolver`` (looked up when used, so a test may replace it module-wide).
    resolver: Resolver | None = None
    #: Called with the rule of every refused connection (the metrics counter).
    on_refused: Callable[[str], None] | None = field(default=None, repr=False)
    #: Trusted origins that belong to sources: origin -> the names of the sources configured on it.
    #: A request to such an origin made for another source (``current_source()``) is checked like any.
    owners: dict[tuple[str, int], frozenset[str]] = field(default_factory=dict)
    #: The source a request is made for ("" outside a source's sync: the WebSub client).
    current_source: Callable[[], str] | None = field(default=None, repr=False)

    def rule_for(self, address: str | IPAddress) -> str | None:
        """The rule refusing a connection to ``address``, or None when it may be connected to."""
        ip = ipaddress.ip_address(address) if isinstance(address, str) else address
        if any(ip.version == n.version and ip in n for n in self.allow):
            return None
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            if any(n.version == 4 and ip.ipv4_mapped in n for n in self.allow):
                return None
        return refusal_rule(ip)

    def literal_rule(self, url: str) -> str | None:
        """For a URL whose host is a literal address: the rule refusing it (checked before any
        connection, e.g. to answer a hub subscription at once). Names are judged when connecting."""
        try:
            host = urlsplit(url).hostname or ""
            ip = ipaddress.ip_address(host)
        except ValueError:
            return None
        if origin(url) in self.trusted:
            return None
        return self.rule_for(ip)

    async def check_request(self, host: str, port: int) -> None:
        """Before a request: the origin of another source is not trusted for this one (a Source's own
        origin is trusted as configured, §"origins" in docs/security.md): its addresses are checked now.

        Why here and not only where connections are made: a connection opened for its own source is
        pooled, and would otherwise serve another source's request unchecked.
        """
        key = (host.strip("[]").lower(), port)
        owners = self.owners.get(key)
        if owners is None or self.current_source is None:
            return  # not a source's origin (policed where connecting), or trusted for everyone
        source = self.current_source()
        if not source or source in owners:
            return
        for address in await _addresses(self, key[0], port, None):
            rule = self.rule_for(address)
            if rule is not None:
                raise self.refused(key[0], port, address, rule, ", and the origin of another source")

    def refused(self, host: str, port: int, address: str, rule: str, note: str = "") -> OutboundRefused:
        log.warning("outbound: refused %s:%s (address %s, rule %s%s)", host, port, address, rule, note)
        if self.on_refused is not None:
            try:
                self.on_refused(rule)
            except Exception:
                log.exception("outbound: refusal hook failed")
        return OutboundRefused(host, port, address, rule, note)


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


class PolicedBackend(httpcore.AsyncNetworkBackend):
    """An httpcore network backend that resolves, checks and connects to the checked address only."""

    def __init__(self, policy: AddressPolicy, inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.policy = policy
        self._inner = inner or httpcore.TrioBackend()  # rsagg runs on trio

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        policy = self.policy
        name = host.strip("[]")
        if (name.lower(), port) in policy.trusted:
            return await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        addresses = await _addresses(policy, name, port, timeout)
        allowed: list[str] = []
        first_refusal: tuple[str, str] | None = None
        for address in addresses:
            rule = policy.rule_for(address)
            if rule is None:
                allowed.append(address)
            elif first_refusal is None:
                first_refusal = (address, rule)
        if not allowed:
            assert first_refusal is not None
            raise policy.refused(name, port, *first_refusal)
        error: Exception | None = None
        for address in allowed:  # in the resolver's order; each one checked above
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
    """``httpx.AsyncHTTPTransport`` whose connections go through ``PolicedBackend``.

    httpx does not take a network backend, so the pool it built is replaced by an equal one that uses
    ours (httpcore's documented ``network_backend`` argument). No proxy: with a proxy, the proxy
    connects (and must enforce its own egress rules, docs/security.md).
    """

    def __init__(
        self,
        policy: AddressPolicy,
        *,
        verify: Any = True,
        limits: httpx.Limits = DEFAULT_LIMITS,
    ) -> None:
        ssl_context = verify if not isinstance(verify, bool) else httpx.create_ssl_context(verify=verify)
        super().__init__(verify=ssl_context, limits=limits, trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=PolicedBackend(policy),
        )
        self.policy = policy

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            await self.policy.check_request(url.host, port)
        except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        return await super().handle_async_request(request)


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


def configured_origins(config: Config) -> dict[tuple[str, int], frozenset[str]]:
    """Origins the operator named, trusted as configured: each source's (owned by the sources on it),
    an external hub's and rsagg's own base URL's (owned by nobody: trusted for every request)."""
    owners: dict[tuple[str, int], set[str]] = {}
    for src in config.sources:
        o = origin(src.url)
        if o is not None:
            owners.setdefault(o, set()).add(src.name)
    for url in (config.server.base_url, config.notifications.hub):
        o = origin(url) if url else None
        if o is not None:
            owners[o] = set()
    return {o: frozenset(names) for o, names in owners.items()}


def policy_for(
    config: Config, *, trust_sources: bool = True, current_source: Callable[[], str] | None = None, **kw: Any
) -> AddressPolicy:
    """The policy of a daemon with ``config``. ``trust_sources=False`` (the hub: anyone names its
    callbacks) trusts rsagg's own base URL only. ``current_source``: which source a request is for
    (harvest: a source's origin is trusted for its own requests only)."""
    policy = AddressPolicy(allowed_networks(config), current_source=current_source, **kw)
    update_policy(policy, config, trust_sources=trust_sources)
    proxies = urllib.request.getproxies()
    if trust_sources and proxies:  # the harvester honours them (fetch.py); the WebSub clients do not
        log.warning(
            "outbound: proxies in the environment (%s): the harvester's requests through them are not "
            "checked by the address policy; the proxy must refuse internal addresses (docs/security.md)",
            ", ".join(sorted(proxies)),
        )
    return policy


def update_policy(policy: AddressPolicy | None, config: Config, *, trust_sources: bool = True) -> None:
    """A reloaded configuration (new sources, a changed allow-list) applies to connections made from now."""
    if policy is None:
        return
    owners = configured_origins(config)
    if not trust_sources:
        own = origin(config.server.base_url)
        owners = {own: frozenset()} if own is not None else {}
    policy.allow = allowed_networks(config)
    policy.trusted = frozenset(owners)
    policy.owners = {o: names for o, names in owners.items() if names}


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
    "LOOPBACK",
    "REASONS",
    "AddressPolicy",
    "OutboundRefused",
    "PolicedBackend",
    "PolicedTransport",
    "allowed_networks",
    "client",
    "configured_origins",
    "is_loopback_host",
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
