"""The TOML configuration: strict (unknown keys are errors), with messages naming file, key and problem.

The shape, types and ranges are declared on the config dataclasses and checked by pydantic v2: unknown
keys, wrong types (strict: "5" is no number, 5 no string, true no int) and out-of-range values come back
as one ``ConfigError`` per problem with its key path (``sources[2].interval``). What pydantic cannot see
in one field (duplicate names, ``[[sets]]`` naming known sources, auth that never holds a secret inline)
is checked after it, in the same error form. Configs built in code (``Config()``, ``dataclasses.replace``)
are checked by the same types, raising pydantic's ValidationError.

The classes are standard frozen dataclasses, and this module does not import pydantic when it is
imported: the types carry their rules as small metadata objects (``_Scalar``, ``_Rule``, ``_Before``,
``_After``) that pydantic turns into its validators through ``__get_pydantic_core_schema__`` when it
checks a configuration. So a configuration can be rebuilt from a snapshot of one already checked
(``aggregator/config_cache.py``) without pydantic, which is a third of a one-shot command's start-up.

Why pydantic rather than msgspec: the classes stay standard frozen dataclasses, so every caller's
``dataclasses.replace``, ``fields`` and ``repr`` (a cache key of renderings) keep working, and each error
comes with a structured location, type and context we turn into our own wording; msgspec's Structs are
not dataclasses and its errors carry the path only inside the message text.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, get_args
from urllib.parse import urlsplit

from .errors import ConfigError  # defined there: `rsagg plugins` raises it without pydantic

if TYPE_CHECKING:
    from pydantic import TypeAdapter
    from pydantic_core import PydanticCustomError

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}\Z")
#: ``server.offload``: who sends a resource's bytes (see ServerConfig).
Offload = Literal["none", "x-accel", "redirect"]
OFFLOAD_MODES: tuple[str, ...] = get_args(Offload)
#: ``sources.kind``: the protocol a source speaks.
SourceKind = Literal["resourcesync", "oai-pmh"]
SOURCE_KINDS: tuple[str, ...] = get_args(SourceKind)


# The rules as metadata of the field types. pydantic asks each for its part of the validator
# (``__get_pydantic_core_schema__``) when it builds one; nothing here imports pydantic before that.


class _Scalar:
    """Keys of pydantic-core's scalar schema: ``strict`` ("5" is no int, 5 no str, true no int), bounds
    (``ge``, ``gt``, ``le``, ``min_length``): the same validators, and errors, as pydantic's ``Strict``
    and ``Field(ge=...)``."""

    def __init__(self, **keys: Any) -> None:
        self.keys = keys

    def __get_pydantic_core_schema__(self, source: Any, handler: Callable[[Any], Any]) -> Any:
        return {**handler(source), **self.keys}


class _Rule:
    """A one-field check whose failure reads as ``problem(value)`` at that field's key."""

    def __init__(self, ok: Callable[[Any], Any], problem: Callable[[Any], str]) -> None:
        self.ok, self.problem = ok, problem

    def check(self, value: Any) -> Any:
        if not self.ok(value):
            raise _fail(self.problem(value))
        return value

    def __get_pydantic_core_schema__(self, source: Any, handler: Callable[[Any], Any]) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(self.check, handler(source))


class _After:
    """A conversion of the checked value (pydantic's ``AfterValidator``)."""

    def __init__(self, convert: Callable[[Any], Any]) -> None:
        self.convert = convert

    def __get_pydantic_core_schema__(self, source: Any, handler: Callable[[Any], Any]) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(self.convert, handler(source))


class _Before:
    """A check and conversion of the raw value before its type's (pydantic's ``BeforeValidator``)."""

    def __init__(self, convert: Callable[[Any], Any]) -> None:
        self.convert = convert

    def __get_pydantic_core_schema__(self, source: Any, handler: Callable[[Any], Any]) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_before_validator_function(self.convert, handler(source))


def _rule(ok: Callable[[Any], Any], problem: Callable[[Any], str]) -> _Rule:
    return _Rule(ok, problem)


def _fail(problem: str) -> PydanticCustomError:
    """An error whose text is ours, word for word (``_problem`` passes it through)."""
    from pydantic_core import PydanticCustomError

    return PydanticCustomError("rsagg", "{problem}", {"problem": problem})


#: Unknown keys are errors; numbers are finite. Scalars are strict through their types below (containers
#: stay lax: a TOML array becomes a tuple, a table a dataclass). pydantic reads it from each model class.
_STRICT: dict[str, Any] = {"extra": "forbid", "allow_inf_nan": False}

_checking = threading.local()  # .depth > 0: instances are made by a check, not by a caller


@contextmanager
def _trusted() -> Iterator[None]:
    """Instances made inside are not checked again on their own (pydantic makes them while it checks;
    ``config_cache`` rebuilds a configuration checked before)."""
    _checking.depth = getattr(_checking, "depth", 0) + 1
    try:
        yield
    finally:
        _checking.depth -= 1


_ADAPTERS: dict[type, TypeAdapter[Any]] = {}


def _adapter(cls: type) -> TypeAdapter[Any]:
    """pydantic's validator of a model class, built once (it is what takes time: imports and the build)."""
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        from pydantic import TypeAdapter

        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter


class _Model:
    """The base of the config dataclasses: an instance made in code (``Config()``,
    ``dataclasses.replace``) is checked by pydantic as a parsed one is, its values converted alike (an
    array to a tuple, an int to the float it stands for); a failure raises pydantic's ValidationError."""

    __pydantic_config__: ClassVar[dict[str, Any]] = _STRICT

    def __post_init__(self) -> None:
        if getattr(_checking, "depth", 0):
            return
        values = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        with _trusted():
            checked = _adapter(type(self)).validate_python(values)
        for name in values:
            object.__setattr__(self, name, getattr(checked, name))


#: What no URL holds (RFC 3986 §2): the C0 controls and DEL. ``urlsplit`` drops some of them silently,
#: httpx refuses them all, at a Source's first request, after the start.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _is_url(value: str) -> bool:
    """An http(s) URL with a host, readable as the harvest's clients read it: no control character, a
    port that is a number."""
    if _CONTROL.search(value):
        return False
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (ValueError: not a port)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def _is_listen(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def _is_offload_location(loc: str) -> bool:
    return loc.startswith("/") and loc.endswith("/") and not any(c in loc for c in "?#%\r\n ")


_HUB_PATH = re.compile(r"/[A-Za-z0-9._~-]+(/[A-Za-z0-9._~-]+)*\Z")

# The field types: strict scalars, their ranges and one-field rules (a failure names the field's key).
StrictInt = Annotated[int, _Scalar(strict=True)]
StrictFloat = Annotated[float, _Scalar(strict=True)]
StrictStr = Annotated[str, _Scalar(strict=True)]
Float = StrictFloat
Bool = Annotated[bool, _Scalar(strict=True)]
Str = StrictStr
NonNegInt = Annotated[int, _Scalar(strict=True, ge=0)]
NonNegFloat = Annotated[float, _Scalar(strict=True, ge=0)]
AtLeastOne = Annotated[int, _Scalar(strict=True, ge=1)]
Positive = Annotated[float, _Scalar(strict=True, gt=0)]
Url = Annotated[StrictStr, _rule(_is_url, lambda v: f"not an http(s) URL: {v!r}")]
Name = Annotated[
    StrictStr, _rule(NAME_RE.match, lambda v: f"{v!r} is not a short URL-safe name ([a-z0-9_-], max 63)")
]
NonEmptyStr = Annotated[str, _Scalar(strict=True, min_length=1)]
Table = dict[str, Any]


_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(s|m|h|d|w)\Z")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_versions(value: Any) -> tuple[int | None, float | None]:
    """``[publish] versions`` as (the last N versions, versions superseded less than S seconds ago),
    (None, None) for ``"all"``; ValueError names the value otherwise. ``store/retention.py`` builds the
    policy from it."""
    if value == "all":
        return None, None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"a count of versions must be at least 1, not {value}")
        return value, None
    if isinstance(value, str):
        m = _DURATION.match(value.strip())
        if m:
            seconds = float(m.group(1)) * _UNITS[m.group(2)]
            if seconds > 0:
                return None, seconds
    raise ValueError(
        f'must be "all", a number of versions >= 1 or a duration like "30d" (s, m, h, d, w), not {value!r}'
    )


def _versions_ok(value: Any) -> bool:
    try:
        parse_versions(value)
    except ValueError:
        return False
    return True


def _versions_problem(value: Any) -> str:
    try:
        parse_versions(value)
    except ValueError as e:
        return str(e)
    return ""


_Versions = Annotated[StrictInt | StrictStr, _rule(_versions_ok, _versions_problem)]
_UrlOrEmpty = Annotated[Str, _rule(lambda v: not v or _is_url(v), lambda v: f"not an http(s) URL: {v!r}")]
_Listen = Annotated[Str, _rule(_is_listen, lambda v: f"must be HOST:PORT, not {v!r}")]
_OffloadLocation = Annotated[
    Str, _rule(_is_offload_location, lambda v: f"must be a path like /_rsagg_blobs/, not {v!r}")
]
_RedirectLifetime = Annotated[
    Float, _rule(lambda v: 1 <= v <= 7 * 86400, lambda v: "must be 1 s to 7 days (604800 s, the S3 limit)")
]
_Synchronous = Annotated[
    Str, _rule(lambda v: v.upper() in ("NORMAL", "FULL"), lambda v: f"must be NORMAL or FULL, not {v!r}")
]
_StateLocation = Annotated[
    Str,
    _rule(
        lambda v: not v or (v.split("://", 1)[0].lower() in ("postgresql", "postgres") and "://" in v),
        lambda v: "must be empty (the SQLite file in store.path) or a postgresql://USER@HOST:PORT/DB URL",
    ),
]
_Fraction = Annotated[Float, _rule(lambda v: 0 <= v < 1, lambda v: "must be in [0, 1)")]
_HeaderValue = Annotated[
    Str,
    _rule(
        lambda v: not any(ord(c) < 32 or ord(c) == 127 for c in v),
        lambda v: "must not hold control characters",
    ),
]
_HubPath = Annotated[
    Str,
    _rule(
        lambda v: bool(_HUB_PATH.match(v)) and not v.startswith("/."),
        lambda v: f"must be a plain absolute path like /hub, not {v!r}",
    ),
]


def _source_names(value: Any) -> tuple[str, ...]:
    """``[[sets]] sources``: a non-empty array of source names (which exist is checked with the sources)."""
    if not isinstance(value, list | tuple) or not value:
        raise _fail("must be a non-empty array of source names")
    for name in value:
        if not isinstance(name, str):
            raise _fail(f"must hold source names, not {name!r}")
    return tuple(value)


def _networks(value: Any) -> tuple[str, ...] | None:
    """``outbound.allow``, ``sources.addresses``: networks exactly as named (host bits set are an error),
    kept as strings."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(isinstance(a, str) for a in value):
        raise _fail(f"must be an array of networks (CIDR), not {value!r}")
    from ipaddress import ip_network  # here: only a check needs it

    for net in value:
        try:
            ip_network(net.strip(), strict=True)
        except ValueError as exc:
            raise _fail(f"{net!r} is not a network: {exc}") from None
    return tuple(a.strip() for a in value)


@dataclass(frozen=True)
class ServerConfig(_Model):
    #: Where the daemon serves, HOST:PORT.
    listen: _Listen = "127.0.0.1:8080"
    #: rsagg's public URL, used in everything it republishes (a trailing "/" is dropped).
    base_url: Annotated[Url, _After(lambda v: v.rstrip("/"))] = "http://127.0.0.1:8080"
    #: Database connections serving requests at once (each document stream holds one while it streams);
    #: past it a request waits up to 10 s, then gets 503 + Retry-After. Bounds the server's memory under
    #: a crawl.
    max_readers: AtLeastOne = 32
    #: Connections one client address may hold open at once (serverguard.py); 0 = no cap. Behind a reverse
    #: proxy every client is the proxy: raise it or set 0, and let the proxy limit per client.
    max_connections_per_client: NonNegInt = 256
    #: Who sends a resource's bytes: "none" (rsagg), "x-accel" (nginx in front, through an internal
    #: location named by ``X-Accel-Redirect``, see ``config/nginx.conf``) or "redirect" (307 to a URL of
    #: the blob store, e.g. S3: presigned, or its ``public_url``). rsagg still decides visibility,
    #: 404/410, 304 and the headers in every mode.
    offload: Offload = "none"
    #: "x-accel": the internal nginx location mapped onto the blob store's root (ends with "/").
    offload_location: _OffloadLocation = "/_rsagg_blobs/"
    #: "redirect": seconds a presigned URL stays valid, 1 s to 7 days (rsagg reuses one for half of it; a
    #: public bucket URL does not expire).
    redirect_lifetime: _RedirectLifetime = 3600.0
    #: Serving processes: the daemon itself and ``workers - 1`` more on the same port (SO_REUSEPORT),
    #: answering resources and lists; the harvester, hub, notifier and dump builder run once, in the
    #: daemon, which also answers what the others forward (``aggregator/run/workers.py``).
    workers: Annotated[int, _Scalar(strict=True, ge=1, le=64)] = 1
    #: "x-accel": seconds nginx may keep rsagg's answer for a resource (``X-Accel-Expires``) and send it
    #: without asking again (``config/nginx.conf`` caches these answers, bytes included); a change, a
    #: deletion or a publish-filter change shows through nginx at most this late. 0 = nginx asks rsagg
    #: every time.
    offload_cache_seconds: Annotated[int, _Scalar(strict=True, ge=0, le=86400)] = 10


@dataclass(frozen=True)
class StoreConfig(_Model):
    #: Folder of the state database (``state.db``) and the blob store (``blobs/``), caches and the store
    #: lock; relative to the configuration file.
    path: Str = "./data"
    #: Where the state lives: "" = the SQLite file ``state.db`` in ``path``; or a PostgreSQL database,
    #: "postgresql://USER@HOST:PORT/DB" (store/postgres.py). The password comes from PGPASSWORD or a
    #: PGPASSFILE (or the URL); rsagg never shows it. Blobs, caches and the lock stay in ``path``.
    state: _StateLocation = ""
    #: Durability: NORMAL survives a crash of rsagg; FULL also a power loss (SQLite, slower) or a crash of
    #: the server (PostgreSQL: ``synchronous_commit`` off / on).
    synchronous: _Synchronous = "NORMAL"
    #: SQLite page cache of the harvester's writing connection, MiB (its reader uses 8). It fills up as the
    #: database grows: 64 MiB took a 200,000-resource baseline to 156 MB RSS (target < 150), 32 MiB to
    #: 119 MB, with no measurable change in the time spent writing state (benchmarks/bench_harvest.py).
    cache_mib: NonNegInt = 32
    #: Blob store backend, registered by a plugin (``rsagg_blob_stores``): "filesystem" or e.g. "s3"
    #: (``pip install ./plugins/rsagg-s3``).
    backend: Str = "filesystem"
    #: The backend's own settings (``[store.settings]``; for "filesystem": ``path``, ``inline_bytes``; for
    #: "s3": the plugin's keys; see "Blob store settings").
    settings: Table = field(default_factory=dict)


@dataclass(frozen=True)
class HarvestConfig(_Model):
    """Defaults for every source; a source may override the ones marked per-source."""

    interval: NonNegFloat = 300.0  # seconds between polls (per source)
    jitter: _Fraction = 0.1  # +- fraction of the interval, so sources do not poll in lockstep
    #: Concurrent requests per upstream host (polite: a host 50 ms away then gives at most 160
    #: resources/s; raise it, with ``workers``, for a Source that welcomes it).
    per_host: AtLeastOne = 8
    max_connections: AtLeastOne = 64  # HTTP connections in all
    workers: AtLeastOne = 16  # concurrent resource fetches per set
    timeout: NonNegFloat = 30.0  # seconds per HTTP request
    #: Retries on network errors, timeouts, 408, 429, 500, 502, 503 and 504 (exponential backoff, full
    #: jitter, Retry-After honoured; the same policy, ``aggregator/net/retry.py``, paces hub deliveries and
    #: subscription requests).
    retries: NonNegInt = 4
    backoff_base: NonNegFloat = 0.5  # seconds: the first backoff's bound
    backoff_max: NonNegFloat = 60.0  # seconds: the longest backoff
    max_document_bytes: NonNegInt = 256 * 1024 * 1024  # cap on one ResourceSync document, bytes
    max_resource_bytes: NonNegInt = 16 * 1024**3  # cap on one resource or dump package, bytes
    #: Baseline from a Resource Dump when one is advertised; false prefers the Resource List (a set that
    #: offers only a Resource Dump is read from it either way).
    use_dumps: Bool = True
    batch_size: AtLeastOne = 256  # changes committed per state transaction
    #: Worker processes for CPU-bound page work (OAI-PMH pages: parse, canonicalise, hash, store);
    #: 0 = in the daemon's own threads (``harvest/offload.py``). Read at start; a blob store backend whose
    #: factory cannot be pickled always uses threads.
    processes: NonNegInt = 2
    #: The User-Agent of every request; "" = ``harvest/access.py`` DEFAULT_USER_AGENT,
    #: "rsagg/VERSION (+https://pypi.org/project/rsagg/)". Name a contact, e.g.
    #: "mirror-bot/2 (+mailto:ops@example.org)".
    user_agent: _HeaderValue = ""
    max_rate: NonNegFloat = 0.0  # requests per second per source (0 = no limit besides per_host)
    #: Seconds between reconciliations of a set with its Resource List (``harvest/reconcile.py``): what
    #: the Change Lists never said is repaired; a set is also reconciled whenever its Resource List's
    #: ``at`` or ETag moves. 0 = only when the list moves.
    reconcile_interval: NonNegFloat = 86_400.0


@dataclass(frozen=True)
class SourceConfig(_Model):
    name: Name  # short URL-safe name ([a-z0-9_-]), unique; the published set's name by default
    #: A well-known URI, Source Description, Capability List, Resource List or a bare site root (for
    #: ``kind = "oai-pmh"``: the OAI-PMH base URL).
    url: Url
    interval: NonNegFloat | None = None  # seconds between polls of this source (default harvest.interval)
    use_dumps: Bool | None = None  # baseline from a Resource Dump (default harvest.use_dumps)
    enabled: Bool = True  # a disabled source keeps its state but is not polled
    notifications: Bool | None = None  # subscribe to its notification channels (default: [notifications])
    #: Seconds between polls while the source's channels are live (a safety net: the Change List stays
    #: the truth); default ``notifications.notified_interval``.
    notified_interval: Positive | None = None
    #: Per-source plugin settings, ``plugins.NAME = {...}``: overlaid on ``[plugins.NAME]``.
    plugins: dict[str, Table] = field(default_factory=dict)
    #: "resourcesync" (default) or "oai-pmh" (``harvest/oaipmh.py``: ``url`` is the base URL).
    kind: SourceKind = "resourcesync"
    metadata_prefix: NonEmptyStr = "oai_dc"  # oai-pmh only
    set: NonEmptyStr | None = None  # oai-pmh only: a setSpec to harvest selectively
    #: oai-pmh only: seconds between full walks that sweep what is no longer listed (0 = the first only)
    full_harvest_interval: NonNegFloat = 0.0
    max_rate: NonNegFloat | None = None  # requests/s to this source (default harvest.max_rate)
    #: Credentials sent to the source's own origin only, read from files or the environment
    #: (``AUTH_KEYS``): checked for shape here, read by ``harvest/access.py`` when a harvest starts.
    auth: Table = field(default_factory=dict)
    #: Networks (CIDR; a bare address is one host) this source's own origin, the host and port of ``url``,
    #: may be reached at although the outbound policy refuses them: how an intranet source configured by
    #: host name is trusted, e.g. ["10.0.0.5/32"]. Checked on the address of every connection to that
    #: origin made for this source only; a name that moves elsewhere is refused (docs/security.md). A
    #: literal address in ``url`` (or ``localhost``) is trusted without it.
    addresses: Annotated[tuple[str, ...], _Before(_networks)] = ()
    #: A line shown with the source on the home page and in ``rsagg status`` (what it is, what its
    #: counts hold: e.g. "each record comes with its metadata record, so twice as many resources").
    note: NonEmptyStr | None = None
    #: Seconds between reconciliations with the Resource List (default ``harvest.reconcile_interval``;
    #: 0 = only when the list's ``at`` or ETag moves).
    reconcile_interval: NonNegFloat | None = None


@dataclass(frozen=True)
class PublishConfig(_Model):
    """How rsagg republishes what it holds (spec §6-§14)."""

    changelist_size: AtLeastOne = 10_000  # changes per Change List window (global changelog seq)
    #: Seconds between Resource Dumps; Change Dump packages are built as Change List windows close. 0 = no
    #: dumps.
    dump_interval: NonNegFloat = 86_400.0
    keep_collection_links: Bool = False  # §14.8: collection links may not fit the aggregator's copy
    keep_canonical_links: Bool = False  # §14.8: same for canonical
    #: Prior versions (§14.6 mementos, docs/versions.md) kept by ``rsagg gc``: "all"; a number N (the
    #: last N versions of each resource); or a duration "<number><s|m|h|d|w>", e.g. "90d" (versions
    #: superseded less than that long ago). The current version is always kept; a memento beyond it
    #: answers 410.
    versions: _Versions = "all"


@dataclass(frozen=True)
class NotificationsConfig(_Model):
    """Change and Framework Notification over WebSub, both ways (``websub/``).

    ``hub`` empty: rsagg's embedded hub at ``hub_path`` carries rsagg's own channels; else that external
    hub (generic WebSub publishing: ``hub.mode=publish`` ping, the hub fetches the topic).
    """

    enabled: Bool = True  # advertise + publish own channels, subscribe to upstream channels
    hub: _UrlOrEmpty = ""  # external hub URL for rsagg's own channels; "" = the embedded hub
    hub_path: _HubPath = "/hub"  # where the embedded hub is served
    lease_seconds: AtLeastOne = 86_400  # lease rsagg asks for when it subscribes (renewed before it ends)
    accept_sha1: Bool = False  # accept X-Hub-Signature: sha1=... (WebSub §7.1 allows it; weak)
    max_entries: AtLeastOne = 1000  # entries per change notification; a burst is split (never a sitemapindex)
    notified_interval: Positive = 3600.0  # default poll interval of a source whose channels are live


@dataclass(frozen=True)
class OutboundConfig(_Model):
    """Where rsagg's own requests may connect (``outbound.py``, docs/security.md)."""

    #: Networks opened although the policy refuses them (loopback, private, link-local, ...), exactly as
    #: named, e.g. ["10.1.0.0/16", "fd00:1::/64"]. Unset: none, except loopback on a local instance
    #: (``server.listen`` and ``server.base_url`` both loopback: the demo, development, tests).
    allow: Annotated[tuple[str, ...] | None, _Before(_networks)] = None


_NodeName = Annotated[
    Str,
    _rule(
        lambda v: len(v) <= 100 and not any(ord(c) <= 32 or ord(c) == 127 for c in v),
        lambda v: f"must be at most 100 characters without spaces or control characters, not {v!r}",
    ),
]


@dataclass(frozen=True)
class ClusterConfig(_Model):
    """Many ``rsagg run`` nodes sharing one state and one blob store (``cluster.py``, docs/cluster.md)."""

    #: Take sources by lease instead of harvesting them all: every node of a cluster sets it.
    enabled: Bool = False
    #: This node's name in the state (``rsagg status``, metrics); "" = hostname-pid (a new name per start).
    node: _NodeName = ""
    #: Seconds a lease (and a node's heartbeat) lasts; renewed every third of it. A dead node's sources
    #: are taken over within about 1.3 lease times; a node paused longer than this loses its sources.
    lease_seconds: Annotated[float, _Scalar(strict=True, ge=1)] = 30.0


@dataclass(frozen=True)
class SetConfig(_Model):
    """A published set grouping the state sets of several sources under one Capability List (§9)."""

    name: Name  # the published set's name (``/NAME/capabilitylist.xml``)
    sources: Annotated[tuple[str, ...], _Before(_source_names)]  # the sources it groups
    describedby: Url | None = None  # §8/§9: a document about the set


@dataclass(frozen=True)
class Config(_Model):
    file: Str = "<defaults>"
    server: ServerConfig = field(default_factory=ServerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    harvest: HarvestConfig = field(default_factory=HarvestConfig)
    sources: tuple[SourceConfig, ...] = ()
    publish: PublishConfig = field(default_factory=PublishConfig)
    sets: tuple[SetConfig, ...] = ()
    #: ``[plugins.NAME]`` tables: ``enabled = false`` turns a plugin off, the rest are its settings (a
    #: source's ``plugins.NAME`` overlays them for that source); an unknown NAME is an error.
    plugins: dict[str, Table] = field(default_factory=dict)
    notifications: NotificationsConfig = field(default_factory=NotificationsConfig)
    outbound: OutboundConfig = field(default_factory=OutboundConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

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

    def reconcile_interval(self, source: SourceConfig) -> float:
        """Seconds between scheduled reconciliations of the source's sets (0 = only when a list moves)."""
        if source.reconcile_interval is not None:
            return source.reconcile_interval
        return self.harvest.reconcile_interval

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


#: The model classes, by name (``config_cache`` rebuilds these and only these).
MODELS: dict[str, type] = {
    cls.__name__: cls
    for cls in (ServerConfig, StoreConfig, HarvestConfig, SourceConfig, PublishConfig, NotificationsConfig,
                OutboundConfig, ClusterConfig, SetConfig, Config)
}  # fmt: skip


def parse_config(data: dict[str, Any], file: str = "<config>") -> Config:
    """Check and build a Config from parsed TOML."""
    from pydantic import ValidationError

    if "file" in data:  # the one field of Config that is not a section
        raise ConfigError(file, "file", f"unknown section (known: {', '.join(_known(()))})")
    try:
        with _trusted():
            config = _adapter(Config).validate_python({**data, "file": file})
    except ValidationError as exc:
        problems = [(_key(e["loc"]), _problem(e)) for e in exc.errors(include_url=False)]
        (key, problem), *more = problems
        raise ConfigError(file, key, problem, tuple(more)) from None
    seen: set[str] = set()
    for i, src in enumerate(config.sources):
        prefix = f"sources[{i}]"
        if src.name in seen:
            raise ConfigError(file, f"{prefix}.name", f"duplicate source name {src.name!r}")
        seen.add(src.name)
        _check_plugin_tables(file, f"{prefix}.plugins", src.plugins)
        _check_source_access(file, prefix, src)
    _check_sets(file, config.sets, config.sources)
    _check_plugin_tables(file, "plugins", config.plugins)
    return config


def _key(loc: tuple[int | str, ...]) -> str:
    """pydantic's location as the config's key path: ``sources[2].interval``."""
    key = ""
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else f".{part}" if key else str(part)
    return key or "-"


def _known(loc: tuple[int | str, ...]) -> list[str]:
    """The keys the table at ``loc`` may hold (the fields of its dataclass), for "unknown key" errors."""
    from typing import get_type_hints

    cls: Any = Config
    for part in loc:
        if isinstance(part, int):
            cls = get_args(cls)[0]  # tuple[X, ...]
        else:
            hints = get_type_hints(cls) if cls in MODELS.values() else {}
            if part not in hints:
                return []
            cls = hints[part]
    if cls not in MODELS.values():
        return []
    return sorted(f.name for f in fields(cls) if cls is not Config or f.name != "file")


_TYPE_NAMES = {"int_type": "int", "float_type": "float", "bool_type": "bool", "string_type": "str"}


def _problem(error: Any) -> str:
    """One pydantic error in the config's own words (never its generic text with a documentation URL)."""
    kind, loc, ctx, value = error["type"], error["loc"], error.get("ctx") or {}, error.get("input")
    if kind == "rsagg":
        return str(ctx["problem"])
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        what = "section" if len(loc) == 1 else "key"
        known = _known(loc[:-1])
        return f"unknown {what} (known: {', '.join(known)})" if known else f"unknown {what}"
    if kind in ("missing", "missing_argument"):
        return "missing"
    if kind in _TYPE_NAMES:
        return f"must be {_TYPE_NAMES[kind]}, not {value!r}"
    if kind in ("dict_type", "dataclass_type"):
        # A string here may be a secret put where its table belongs (auth, a plugin's settings): not shown.
        return (
            "must be a table"
            if isinstance(value, str) or "auth" in loc
            else f"must be a table, not {value!r}"
        )
    if kind in ("tuple_type", "list_type"):
        if loc in (("sources",), ("sets",)):
            return f"must be an array of tables ([[{loc[0]}]])"
        return f"must be an array, not {value!r}"
    if kind == "greater_than_equal":
        return (
            f"must not be negative, not {value!r}"
            if ctx["ge"] == 0
            else f"must be at least {_num(ctx['ge'])}"
        )
    if kind == "greater_than":
        return f"must be more than {_num(ctx['gt'])}"
    if kind == "literal_error":
        expected = str(ctx["expected"]).replace("'", "").replace(" or ", ", ")
        return f"must be one of {expected}, not {value!r}"
    if kind == "string_too_short":
        return "must be a non-empty string"
    if kind == "finite_number":
        return f"must be a finite number, not {value!r}"
    return str(error["msg"])


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _check_plugin_tables(file: str, key: str, tables: dict[str, dict[str, Any]]) -> None:
    for name, table in tables.items():
        if "enabled" in table and not isinstance(table["enabled"], bool):
            raise ConfigError(file, f"{key}.{name}.enabled", "must be true or false")


#: ``[sources.auth]`` keys; each secret is named by a ``*_file`` or ``*_env`` key, never given inline.
AUTH_KEYS = frozenset({"bearer_token_file", "bearer_token_env", "basic_username", "basic_password_file",
                       "basic_password_env", "headers"})  # fmt: skip
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")


def _check_source_access(file: str, prefix: str, src: SourceConfig) -> None:
    """OAI-PMH keys on OAI-PMH sources only, no password in the URL, the shape of ``auth`` (its secrets
    are read by harvest/access.py, never given inline)."""
    if src.kind != "oai-pmh" and (
        src.set is not None or src.metadata_prefix != "oai_dc" or src.full_harvest_interval
    ):
        raise ConfigError(
            file, f"{prefix}.kind", 'metadata_prefix, set and full_harvest_interval need kind = "oai-pmh"'
        )
    if urlsplit(src.url).password is not None:
        raise ConfigError(file, f"{prefix}.url", "holds a password: name it in [sources.auth] instead")
    auth, key = src.auth, f"{prefix}.auth"
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


def _check_sets(file: str, sets: tuple[SetConfig, ...], sources: tuple[SourceConfig, ...]) -> None:
    """``[[sets]]``: each names known sources; a source belongs to at most one set, and a set name may
    not be the default published name of a source outside it (both would claim ``/NAME/``)."""
    known = {s.name for s in sources}
    names: set[str] = set()
    owner: dict[str, str] = {}  # source -> set name
    for i, st in enumerate(sets):
        prefix = f"sets[{i}]"
        if st.name in names:
            raise ConfigError(file, f"{prefix}.name", f"duplicate set name {st.name!r}")
        names.add(st.name)
        for src in st.sources:
            if src not in known:
                raise ConfigError(file, f"{prefix}.sources", f"unknown source {src!r}")
            if src in owner:
                raise ConfigError(
                    file, f"{prefix}.sources", f"source {src!r} is already in set {owner[src]!r}"
                )
            owner[src] = st.name
    for i, st in enumerate(sets):
        if st.name in known and owner.get(st.name) != st.name:
            raise ConfigError(
                file, f"sets[{i}].name", f"{st.name!r} is the published name of source {st.name!r}"
            )


def read_config_file(path: str | Path) -> bytes:
    """The bytes of a config file; a file that cannot be read is a ConfigError naming it."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), "-", f"cannot read: {exc.strerror or exc}") from None


def load_config(path: str | Path) -> Config:
    """Read and check a config file; every problem is a ConfigError naming the file."""
    return parse_toml(read_config_file(path), str(path))


def parse_toml(raw: bytes, file: str) -> Config:
    """Check and build a Config from the bytes of a config file (``load_config`` without the read)."""
    import tomllib

    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(file, "-", f"not UTF-8: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(file, "-", f"not valid TOML: {exc}") from None
    return parse_config(data, file)
