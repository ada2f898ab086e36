"""The TOML configuration: strict (unknown keys are errors), with messages naming file, key and problem."""

from __future__ import annotations

import ipaddress
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}\Z")
#: ``server.offload``: who sends a resource's bytes (see ServerConfig).
OFFLOAD_MODES = ("none", "x-accel", "redirect")


class ConfigError(Exception):
    """A configuration problem; ``str()`` reads ``FILE: KEY: PROBLEM``."""

    def __init__(self, file: str, key: str, problem: str) -> None:
        super().__init__(f"{file}: {key}: {problem}")
        self.file, self.key, self.problem = file, key, problem


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "127.0.0.1:8080"
    base_url: str = "http://127.0.0.1:8080"
    #: Database connections serving requests at once (each document stream holds one while it streams);
    #: more requests wait a little, then get 503 + Retry-After. Bounds the server's memory under a crawl.
    max_readers: int = 32
    #: Connections one client address may hold open at once (serverguard.py); 0 = no cap. Behind a reverse
    #: proxy every client is the proxy: raise it or set 0, and let the proxy limit per client.
    max_connections_per_client: int = 256
    #: Who sends a resource's bytes: "none" (rsagg), "x-accel" (nginx in front, through an internal
    #: location, see ``config/nginx.conf``) or "redirect" (a blob store with URLs, e.g. S3: presigned or
    #: public). rsagg still decides visibility, 404/410, 304 and the headers in every mode.
    offload: str = "none"
    #: "x-accel": the internal nginx location mapped onto the blob store's root (ends with "/").
    offload_location: str = "/_rsagg_blobs/"
    #: "redirect": seconds a presigned URL stays valid (a public bucket URL does not expire).
    redirect_lifetime: float = 3600.0


@dataclass(frozen=True)
class StoreConfig:
    path: str = "./data"
    #: SQLite synchronous mode: NORMAL survives a process crash; FULL also a power loss (slower).
    synchronous: str = "NORMAL"
    #: SQLite page cache of the harvester's writing connection, MiB (its reader uses 8). It fills up as the
    #: database grows: 64 MiB took a 200,000-resource baseline to 156 MB RSS (target < 150), 32 MiB to
    #: 119 MB, with no measurable change in the time spent writing state (benchmarks/bench_harvest.py).
    cache_mib: int = 32
    #: Blob store backend, registered by a plugin (``rsagg_blob_stores``): "filesystem" or e.g. "s3".
    backend: str = "filesystem"
    #: The backend's own settings (``[store.settings]``).
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HarvestConfig:
    """Defaults for every source; a source may override the ones marked per-source."""

    interval: float = 300.0  # seconds between polls (per source)
    jitter: float = 0.1  # +- fraction of the interval, so sources do not poll in lockstep
    per_host: int = 8  # concurrent requests per upstream host
    max_connections: int = 64
    workers: int = 16  # concurrent resource fetches per set
    timeout: float = 30.0
    retries: int = 4
    backoff_base: float = 0.5
    backoff_max: float = 60.0
    max_document_bytes: int = 256 * 1024 * 1024
    max_resource_bytes: int = 16 * 1024**3
    use_dumps: bool = True  # baseline from a Resource Dump when one is advertised
    batch_size: int = 256  # changes committed per state transaction
    #: Sent on every request; "" = ``harvest/access.py`` DEFAULT_USER_AGENT (rsagg/VERSION (+project URL)).
    user_agent: str = ""
    max_rate: float = 0.0  # requests per second per source (0 = no limit besides per_host)


@dataclass(frozen=True)
class SourceConfig:
    name: str
    url: str
    interval: float | None = None
    use_dumps: bool | None = None
    enabled: bool = True
    notifications: bool | None = None  # subscribe to its notification channels (default: [notifications])
    notified_interval: float | None = None  # poll interval while notifications are live (safety net)
    #: Per-source plugin settings, ``plugins.NAME = {...}``: overlaid on ``[plugins.NAME]``.
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: "resourcesync" (default) or "oai-pmh" (``harvest/oaipmh.py``: ``url`` is the base URL).
    kind: str = "resourcesync"
    metadata_prefix: str = "oai_dc"  # oai-pmh only
    set: str | None = None  # oai-pmh only: a setSpec to harvest selectively
    #: oai-pmh only: seconds between full walks that sweep what is no longer listed (0 = the first only)
    full_harvest_interval: float = 0.0
    max_rate: float | None = None  # requests/s to this source (default harvest.max_rate)
    #: Credentials sent to the source's own origin only, read from files or the environment
    #: (``AUTH_KEYS``): checked for shape here, read by ``harvest/access.py`` when a harvest starts.
    auth: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PublishConfig:
    """How rsagg republishes what it holds (spec §6-§14; issue text "Publish contracts")."""

    changelist_size: int = 10_000  # changes per Change List window (global changelog seq)
    dump_interval: float = 86_400.0  # seconds between Resource Dumps (0 = off)
    keep_collection_links: bool = False  # §14.8: collection links may not fit the aggregator's copy
    keep_canonical_links: bool = False  # §14.8: same for canonical


@dataclass(frozen=True)
class NotificationsConfig:
    """Change and Framework Notification over WebSub, both ways (spec/NOTES.md, ``websub/``).

    ``hub`` empty: rsagg's embedded hub at ``hub_path`` carries rsagg's own channels; else that external
    hub (generic WebSub publishing: ``hub.mode=publish`` ping, the hub fetches the topic).
    """

    enabled: bool = True  # advertise + publish own channels, subscribe to upstream channels
    hub: str = ""  # external hub URL for rsagg's own channels; "" = the embedded hub
    hub_path: str = "/hub"  # where the embedded hub is served
    lease_seconds: int = 86_400  # lease rsagg asks for when it subscribes (renewed before it ends)
    accept_sha1: bool = False  # accept X-Hub-Signature: sha1=... (WebSub §7.1 allows it; weak)
    max_entries: int = 1000  # entries per change notification; a burst is split (never a sitemapindex)
    notified_interval: float = 3600.0  # default poll interval of a source whose channels are live


@dataclass(frozen=True)
class OutboundConfig:
    """Where rsagg's own requests may connect (``outbound.py``, docs/security.md)."""

    #: Networks opened although the policy refuses them (loopback, private, link-local, ...), exactly as
    #: named, e.g. ["10.1.0.0/16", "fd00:1::/64"]. Unset: none, except loopback on a local instance
    #: (``server.listen`` and ``server.base_url`` both loopback: the demo, development, tests).
    allow: tuple[str, ...] | None = None


@dataclass(frozen=True)
class SetConfig:
    """A published set grouping the state sets of several sources under one Capability List (§9)."""

    name: str
    sources: tuple[str, ...] = ()
    describedby: str | None = None  # §8/§9: a document about the set


@dataclass(frozen=True)
class Config:
    file: str = "<defaults>"
    server: ServerConfig = field(default_factory=ServerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    harvest: HarvestConfig = field(default_factory=HarvestConfig)
    sources: tuple[SourceConfig, ...] = ()
    publish: PublishConfig = field(default_factory=PublishConfig)
    sets: tuple[SetConfig, ...] = ()
    #: ``[plugins.NAME]`` tables: ``enabled = false`` turns a plugin off, the rest are its settings.
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)
    notifications: NotificationsConfig = field(default_factory=NotificationsConfig)
    outbound: OutboundConfig = field(default_factory=OutboundConfig)

    @property
    def store_path(self) -> Path:
        """The store path, relative paths taken from the config file's folder."""
        p = Path(self.store.path)
        if not p.is_absolute() and self.file != "<defaults>":
            p = Path(self.file).parent / p
        return p

    def source(self, name: str) -> SourceConfig:
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(name)

    def interval(self, source: SourceConfig) -> float:
        return source.interval if source.interval is not None else self.harvest.interval

    def max_rate(self, source: SourceConfig) -> float:
        """Requests per second to this source; 0 = unlimited (per_host still bounds concurrency)."""
        return source.max_rate if source.max_rate is not None else self.harvest.max_rate

    def use_dumps(self, source: SourceConfig) -> bool:
        return source.use_dumps if source.use_dumps is not None else self.harvest.use_dumps

    def notifications_on(self, source: SourceConfig) -> bool:
        """Whether rsagg subscribes to this source's notification channels."""
        return self.notifications.enabled and source.notifications is not False and source.kind != "oai-pmh"

    def notified_interval(self, source: SourceConfig) -> float:
        """The safety-net poll interval of a source while its change notifications are live."""
        if source.notified_interval is not None:
            return source.notified_interval
        return self.notifications.notified_interval


def _check_url(file: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(file, key, f"must be a string URL, not {type(value).__name__}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(file, key, f"not an http(s) URL: {value!r}")
    return value


def _section(file: str, prefix: str, cls: type, table: Any, required: tuple[str, ...] = ()) -> Any:
    """Build a dataclass from a TOML table, rejecting unknown keys and wrong types."""
    if not isinstance(table, dict):
        raise ConfigError(file, prefix, "must be a table")
    known = {f.name: f for f in fields(cls)}
    for key in table:
        if key not in known:
            raise ConfigError(file, f"{prefix}.{key}", f"unknown key (known: {', '.join(sorted(known))})")
    for key in required:
        if key not in table:
            raise ConfigError(file, f"{prefix}.{key}", "missing")
    kwargs = {}
    for key, value in table.items():
        expected = known[key].type
        ok = {
            "str": isinstance(value, str),
            "bool": isinstance(value, bool),
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "float | None": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool | None": isinstance(value, bool),
        }.get(expected, True)
        if not ok:
            raise ConfigError(file, f"{prefix}.{key}", f"must be {expected.split(' |')[0]}, not {value!r}")
        if expected in ("int", "float", "float | None") and value < 0:
            raise ConfigError(file, f"{prefix}.{key}", f"must not be negative, not {value!r}")
        kwargs[key] = float(value) if expected.startswith("float") else value
    return cls(**kwargs)


def _check_plugin_tables(file: str, key: str, tables: Any) -> None:
    if not isinstance(tables, dict):
        raise ConfigError(file, key, "must be a table of plugin tables")
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(file, f"{key}.{name}", "must be a table of settings")
        if "enabled" in table and not isinstance(table["enabled"], bool):
            raise ConfigError(file, f"{key}.{name}.enabled", "must be true or false")


def parse_config(data: dict[str, Any], file: str = "<config>") -> Config:
    """Check and build a Config from parsed TOML."""
    allowed = {"server", "store", "harvest", "sources", "publish", "sets", "plugins", "notifications"}
    allowed.add("outbound")  # the outbound address policy (outbound.py)
    for key in data:
        if key not in allowed:
            raise ConfigError(file, key, f"unknown section (known: {', '.join(sorted(allowed))})")
    server = _section(file, "server", ServerConfig, data.get("server", {}))
    _check_url(file, "server.base_url", server.base_url)
    host, sep, port = server.listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(file, "server.listen", f"must be HOST:PORT, not {server.listen!r}")
    if server.max_readers < 1:
        raise ConfigError(file, "server.max_readers", "must be at least 1")
    if server.offload not in OFFLOAD_MODES:
        raise ConfigError(
            file, "server.offload", f"must be one of {', '.join(OFFLOAD_MODES)}, not {server.offload!r}"
        )
    loc = server.offload_location
    if not (loc.startswith("/") and loc.endswith("/")) or any(c in loc for c in "?#%\r\n "):
        raise ConfigError(file, "server.offload_location", f"must be a path like /_rsagg_blobs/, not {loc!r}")
    if server.redirect_lifetime < 1 or server.redirect_lifetime > 7 * 86400:
        raise ConfigError(file, "server.redirect_lifetime", "must be 1 s to 7 days (604800 s, the S3 limit)")
    if server.base_url.endswith("/"):
        server = replace(server, base_url=server.base_url.rstrip("/"))
    store = _section(file, "store", StoreConfig, data.get("store", {}))
    if store.synchronous.upper() not in ("NORMAL", "FULL"):
        raise ConfigError(file, "store.synchronous", f"must be NORMAL or FULL, not {store.synchronous!r}")
    harvest = _section(file, "harvest", HarvestConfig, data.get("harvest", {}))
    for key in ("per_host", "max_connections", "workers", "batch_size"):
        if getattr(harvest, key) < 1:
            raise ConfigError(file, f"harvest.{key}", "must be at least 1")
    if not 0 <= harvest.jitter < 1:
        raise ConfigError(file, "harvest.jitter", "must be in [0, 1)")
    if any(ord(c) < 32 or ord(c) == 127 for c in harvest.user_agent):
        raise ConfigError(file, "harvest.user_agent", "must not hold control characters")
    raw_sources = data.get("sources", [])
    if not isinstance(raw_sources, list):
        raise ConfigError(file, "sources", "must be an array of tables ([[sources]])")
    sources: list[SourceConfig] = []
    seen: set[str] = set()
    for i, table in enumerate(raw_sources):
        prefix = f"sources[{i}]"
        src = _section(file, prefix, SourceConfig, table, required=("name", "url"))
        if not NAME_RE.match(src.name):
            raise ConfigError(
                file, f"{prefix}.name", f"{src.name!r} is not a short URL-safe name ([a-z0-9_-], max 63)"
            )
        if src.name in seen:
            raise ConfigError(file, f"{prefix}.name", f"duplicate source name {src.name!r}")
        seen.add(src.name)
        _check_url(file, f"{prefix}.url", src.url)
        _check_plugin_tables(file, f"{prefix}.plugins", src.plugins)
        if src.notified_interval is not None and src.notified_interval <= 0:
            raise ConfigError(file, f"{prefix}.notified_interval", "must be more than 0")
        _check_source_access(file, prefix, src)
        sources.append(src)
    publish = _section(file, "publish", PublishConfig, data.get("publish", {}))
    if publish.changelist_size < 1:
        raise ConfigError(file, "publish.changelist_size", "must be at least 1")
    sets = _parse_sets(file, data.get("sets", []), sources)
    plugins = data.get("plugins", {})
    _check_plugin_tables(file, "plugins", plugins)
    notifications = _parse_notifications(file, data.get("notifications", {}))
    return Config(
        file=file,
        server=server,
        store=store,
        harvest=harvest,
        sources=tuple(sources),
        publish=publish,
        sets=sets,
        plugins=plugins,
        notifications=notifications,
        outbound=_parse_outbound(file, data.get("outbound", {})),
    )


SOURCE_KINDS = ("resourcesync", "oai-pmh")
#: ``[sources.auth]`` keys; each secret is named by a ``*_file`` or ``*_env`` key, never given inline.
AUTH_KEYS = frozenset({"bearer_token_file", "bearer_token_env", "basic_username", "basic_password_file",
                       "basic_password_env", "headers"})  # fmt: skip
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")


def _check_source_access(file: str, prefix: str, src: SourceConfig) -> None:
    """kind, OAI-PMH keys, max_rate and the shape of ``auth`` (secrets are read by harvest/access.py)."""
    if src.kind not in SOURCE_KINDS:
        raise ConfigError(
            file, f"{prefix}.kind", f"must be one of {', '.join(SOURCE_KINDS)}, not {src.kind!r}"
        )
    if not src.metadata_prefix or not isinstance(src.metadata_prefix, str):
        raise ConfigError(file, f"{prefix}.metadata_prefix", "must be a non-empty string")
    if src.set is not None and (not isinstance(src.set, str) or not src.set):
        raise ConfigError(file, f"{prefix}.set", "must be a non-empty setSpec string")
    if src.kind != "oai-pmh" and (
        src.set is not None or src.metadata_prefix != "oai_dc" or src.full_harvest_interval
    ):
        raise ConfigError(
            file, f"{prefix}.kind", 'metadata_prefix, set and full_harvest_interval need kind = "oai-pmh"'
        )
    if urlsplit(src.url).password is not None:
        raise ConfigError(file, f"{prefix}.url", "holds a password: name it in [sources.auth] instead")
    auth, key = src.auth, f"{prefix}.auth"
    if not isinstance(auth, dict):
        raise ConfigError(file, key, "must be a table")
    for k, v in auth.items():
        if k not in AUTH_KEYS:
            raise ConfigError(file, f"{key}.{k}", f"unknown key (known: {', '.join(sorted(AUTH_KEYS))})")
        if k != "headers" and (not isinstance(v, str) or not v):
            raise ConfigError(file, f"{key}.{k}", "must be a non-empty string")
    if "bearer_token_file" in auth and "bearer_token_env" in auth:
        raise ConfigError(
            file, f"{key}.bearer_token_env", "give bearer_token_file or bearer_token_env, not both"
        )
    basic = [k for k in auth if k.startswith("basic_")]
    if basic and any(k.startswith("bearer_") for k in auth):
        raise ConfigError(file, key, "bearer_token_* and basic_* both set Authorization: choose one")
    if basic and ("basic_username" not in auth or len(basic) != 2):
        raise ConfigError(
            file, key, "basic auth needs basic_username and one of basic_password_file, basic_password_env"
        )
    headers = auth.get("headers", {})
    if not isinstance(headers, dict):
        raise ConfigError(file, f"{key}.headers", 'must be a table of header = "env:NAME" or "file:PATH"')
    for name, ref in headers.items():
        if not _HEADER_NAME.match(name) or name.lower() in ("host", "authorization", "cookie"):
            raise ConfigError(file, f"{key}.headers.{name}", "not a header name rsagg may set")
        if (
            not isinstance(ref, str)
            or not ref.startswith(("env:", "file:"))
            or len(ref.split(":", 1)[1]) == 0
        ):
            raise ConfigError(
                file, f"{key}.headers.{name}",
                "must name its value as \"env:VARIABLE\" or \"file:PATH\" (never the secret itself)",
            )  # fmt: skip


_HUB_PATH = re.compile(r"/[A-Za-z0-9._~-]+(/[A-Za-z0-9._~-]+)*\Z")


def _parse_notifications(file: str, table: Any) -> NotificationsConfig:
    n = _section(file, "notifications", NotificationsConfig, table)
    if n.hub:
        _check_url(file, "notifications.hub", n.hub)
    if not _HUB_PATH.match(n.hub_path) or n.hub_path.startswith("/."):
        raise ConfigError(
            file, "notifications.hub_path", f"must be a plain absolute path like /hub, not {n.hub_path!r}"
        )
    if n.lease_seconds < 1:
        raise ConfigError(file, "notifications.lease_seconds", "must be at least 1")
    if n.max_entries < 1:
        raise ConfigError(file, "notifications.max_entries", "must be at least 1")
    if n.notified_interval <= 0:
        raise ConfigError(file, "notifications.notified_interval", "must be more than 0")
    return n


def _parse_outbound(file: str, table: Any) -> OutboundConfig:
    if isinstance(table, dict) and "allow" in table:
        allow = table["allow"]
        if not isinstance(allow, list) or not all(isinstance(a, str) for a in allow):
            raise ConfigError(file, "outbound.allow", f"must be an array of networks (CIDR), not {allow!r}")
        for value in allow:
            try:
                ipaddress.ip_network(value.strip(), strict=True)
            except ValueError as exc:
                raise ConfigError(file, "outbound.allow", f"{value!r} is not a network: {exc}") from None
        table = {**table, "allow": tuple(a.strip() for a in allow)}
    return _section(file, "outbound", OutboundConfig, table)


def _parse_sets(file: str, raw: Any, sources: list[SourceConfig]) -> tuple[SetConfig, ...]:
    """``[[sets]]``: each names known sources; a source belongs to at most one set, and a set name may
    not be the default published name of a source outside it (both would claim ``/NAME/``)."""
    if not isinstance(raw, list):
        raise ConfigError(file, "sets", "must be an array of tables ([[sets]])")
    known = {s.name for s in sources}
    names: set[str] = set()
    owner: dict[str, str] = {}  # source -> set name
    out: list[SetConfig] = []
    for i, table in enumerate(raw):
        prefix = f"sets[{i}]"
        if isinstance(table, dict) and isinstance(table.get("sources"), list):
            table = {**table, "sources": tuple(table["sources"])}
        st = _section(file, prefix, SetConfig, table, required=("name", "sources"))
        if not isinstance(st.name, str) or not NAME_RE.match(st.name):
            raise ConfigError(
                file, f"{prefix}.name", f"{st.name!r} is not a short URL-safe name ([a-z0-9_-], max 63)"
            )
        if st.name in names:
            raise ConfigError(file, f"{prefix}.name", f"duplicate set name {st.name!r}")
        names.add(st.name)
        if not isinstance(st.sources, tuple) or not st.sources:
            raise ConfigError(file, f"{prefix}.sources", "must be a non-empty array of source names")
        for src in st.sources:
            if not isinstance(src, str):
                raise ConfigError(file, f"{prefix}.sources", f"must hold source names, not {src!r}")
            if src not in known:
                raise ConfigError(file, f"{prefix}.sources", f"unknown source {src!r}")
            if src in owner:
                raise ConfigError(
                    file, f"{prefix}.sources", f"source {src!r} is already in set {owner[src]!r}"
                )
            owner[src] = st.name
        if st.describedby is not None:
            _check_url(file, f"{prefix}.describedby", st.describedby)
        out.append(st)
    for i, st in enumerate(out):
        if st.name in known and owner.get(st.name) != st.name:
            raise ConfigError(
                file, f"sets[{i}].name", f"{st.name!r} is the published name of source {st.name!r}"
            )
    return tuple(out)


def load_config(path: str | Path) -> Config:
    """Read and check a config file; every problem is a ConfigError naming the file."""
    file = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(file, "-", f"cannot read: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(file, "-", f"not UTF-8: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(file, "-", f"not valid TOML: {exc}") from None
    return parse_config(data, file)
