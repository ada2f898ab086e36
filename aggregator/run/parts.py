"""The part builders of the composition root: every part of rsagg is built by a function here.

Why one module: it is the one place that opens the state (``open_state``, ``connect``), loads the plugins,
opens the blob store and makes the publisher's reader pools, so no stage opens or builds what it is
not handed (tests/test_compose.py checks it). ``run/compose.py`` calls these in order and keeps the
lifetimes; the commands get their parts here too. Each builder imports what it needs when called:
``rsagg status`` and ``retries`` load this module without the harvest's libraries.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..plugins.manager import Plugins

if TYPE_CHECKING:  # annotations only: ``rsagg plugins`` and ``status`` load this module, and no more
    import httpx
    from starlette.applications import Starlette
    from starlette.routing import BaseRoute

    from ..config import Config
    from ..net.outbound import AddressPolicy
    from ..observe.metrics import Metrics
    from ..publish.documents import DumpsAvailable, ExtraCapabilities, Site
    from ..publish.dumps import DumpBuilder
    from ..rs.model import Entry
    from ..store.blobs import BlobStore
    from ..store.interface import StateStore
    from ..store.rows import LogRecord, Resource
    from ..store.sets import PublishedSet
    from ..websub.hub import Hub, HubLimits
    from ..websub.notifier import Notifier
    from ..websub.service import Notifications
    from ..websub.subscriber import Harvester, SubscriberSettings
    from ..websub.views import ViewOf

log = logging.getLogger("rsagg.notify")

#: Page cache of the hub's and the subscriber's state handles (their tables are small: SQLite's default
#: size) and of the notifier's (it reads the changelog and the published sets).
SMALL_CACHE_MIB = 2
NOTIFIER_CACHE_MIB = 8
#: The harvest reader only walks the (set_id, uri) index for lookups: a small cache holds its hot pages.
READER_CACHE_MIB = 8
#: A publisher's pooled read connection, and the hot route's version watcher (publish/fastpath.py).
POOL_CACHE_MIB = 16
WATCHER_CACHE_MIB = 1
#: The cluster node's handle: heartbeats and leases only.
NODE_CACHE_MIB = 1


# -- plugins, blobs, the state ------------------------------------------------------------------------


def load_plugins(config: Config | None) -> Plugins:
    """The plugins ``config`` names (ConfigError for one that does not load: they fail closed); None:
    the installed ones, as ``rsagg plugins`` lists them without a configuration."""
    return Plugins() if config is None else Plugins.from_config(config)


def blob_store(config: Config, plugins: Plugins) -> BlobStore:
    """The blob store ``[store] backend`` names (harvest/context.py: ``open_blob_store``)."""
    from ..harvest.context import open_blob_store

    return open_blob_store(config, plugins)


def state_handle(config: Config, *, cache_mib: int | None = None) -> StateStore:
    """A state handle of its own for one part (writer, reader, hub, notifier, subscriber, dumps, node,
    a command): every handle rsagg opens is opened here."""
    from ..store.open import open_state

    if cache_mib is None:
        return open_state(config)
    return open_state(config, cache_mib=cache_mib)


def state_exists(config: Config) -> bool:
    """Whether there is a state to read (a SQLite file not made yet is none; a server's always is)."""
    from ..store.open import state_path

    db = state_path(config)
    return not isinstance(db, Path) or db.exists()


def check_store(config: Config) -> Path:
    """For the commands that only read (``status``, ``retries``): the store folder is usable, the plugins
    named exist, and a backend other than the local one starts with its settings (for S3 that is one
    request to the bucket). Nothing is created. Raises ConfigError naming the key."""
    from ..harvest.context import prepare_store

    root = prepare_store(config, create=False)
    plugins = load_plugins(config)
    if config.store.backend != "filesystem":
        store = blob_store(config, plugins)
        getattr(store, "close", lambda: None)()
    return root


# -- the publisher -------------------------------------------------------------------------------------


def publisher_app(
    config: Config,
    *,
    blobs: BlobStore,
    plugins: Plugins,
    metrics: Metrics,
    state_path: Path | str | None = None,
    extra_routes: Sequence[BaseRoute] = (),
    dumps_available: DumpsAvailable | None = None,
    extra_capabilities: ExtraCapabilities | None = None,
) -> Starlette:
    """The publisher app for ``config``: the schema created or migrated, its reader pool and the hot
    route's watcher opened over the state, the status routes and served-request metrics of ``metrics``.
    ``state_path``: where the state is (default: ``config``'s)."""
    from starlette.middleware import Middleware

    from ..observe.metrics import ServedMetrics
    from ..observe.page import status_routes
    from ..publish.app import Publisher, ReaderPool, create_app
    from ..publish.documents import no_dumps, no_extra_capabilities
    from ..store.open import connect
    from ..store.open import state_path as configured_path

    path = configured_path(config) if state_path is None else state_path
    if not (isinstance(path, str) and "://" in path):  # a file, not a server's URL
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
    connect(path, synchronous=config.store.synchronous).close()  # create / migrate the schema
    where = path

    def open_pooled() -> StateStore:
        return connect(where, readonly=True, cache_mib=POOL_CACHE_MIB)

    def open_watcher() -> StateStore:  # read in the event loop, between requests: never waits long
        return connect(where, readonly=True, busy_timeout=0.1, cache_mib=WATCHER_CACHE_MIB)

    # Renderings are cached beside a state file, else (a state in a server) in the store folder.
    folder = path.parent if isinstance(path, Path) else Path(config.store_path)
    publisher = Publisher(
        config, blobs, pool=ReaderPool(open_pooled, max_open=config.server.max_readers),
        open_watcher=open_watcher, cache_folder=folder, plugins=plugins, metrics=metrics,
        dumps_available=dumps_available or no_dumps,
        extra_capabilities=extra_capabilities or no_extra_capabilities,
    )  # fmt: skip
    return create_app(
        publisher,
        status_routes=status_routes(metrics),
        extra_routes=extra_routes,
        middleware=[Middleware(ServedMetrics, metrics=metrics)],  # by route template (metrics.py)
    )


def dump_builder(
    config: Config,
    blobs: BlobStore,
    *,
    get_config: Callable[[], Config],
    get_plugins: Callable[[], Plugins],
) -> DumpBuilder | None:
    """The process's one DumpBuilder over a state handle of its own (None when dumps are off:
    ``publish.dump_interval = 0``); it reads the running configuration and plugins through the getters."""
    if config.publish.dump_interval <= 0:
        return None
    from ..publish.dumps import DumpBuilder
    from ..publish.schedule import CurrentView

    current = CurrentView(get_config, get_plugins)
    return DumpBuilder(
        state_handle(config), blobs, base_url=config.server.base_url, fingerprint=current.fingerprint,
        site_of=current.site,
    )  # fmt: skip


# -- what the notifier reads of the published documents (websub/views.py) ------------------------------


class PublishedDocuments:
    """``websub.views.PublishedView`` made of publish/'s own functions: the notifier's entries are the
    app's, byte for byte (the same Site, link policy and publish filter)."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self._uri_of: dict[str, Any] = {}

    @property
    def base_url(self) -> str:
        return self.site.base_url

    @property
    def sets(self) -> Mapping[str, PublishedSet]:
        return self.site.sets

    @property
    def changelist_size(self) -> int:
        return self.site.changelist_size

    @property
    def well_known(self) -> str:
        return self.site.well_known

    def capabilitylist(self, name: str) -> str:
        return self.site.capabilitylist(name)

    def changelist(self, name: str) -> str:
        return self.site.changelist(name)

    def changelist_window(self, name: str, k: int) -> str:
        return self.site.changelist_window(name, k)

    def shows(self, set_name: str, row: Resource | None) -> bool:
        return self.site.shows(set_name, row)

    def dumps(self, set_name: str) -> dict[str, str]:
        return self.site.dumps_available(set_name) or {}

    def capability_entries(self, ps: PublishedSet) -> list[Entry]:
        from ..publish.documents import capability_list

        return list(capability_list(self.site, ps)[1])

    def change_entries(
        self, state: StateStore, ps: PublishedSet, records: Sequence[tuple[LogRecord, Resource | None]]
    ) -> list[Entry]:
        from ..publish.documents import UriOf, change_entry

        uri_of = self._uri_of.get(ps.name)  # one per set and round: its answers are cached
        if uri_of is None:
            uri_of = self._uri_of[ps.name] = UriOf(self.site, state, ps)
        return [change_entry(self.site, ps, rec, row, uri_of) for rec, row in records]

    def change_windows(self, state: StateStore, ps: PublishedSet, now: datetime) -> tuple[list[int], int]:
        from ..publish.documents import Windows

        ws = Windows(self.site, state, ps, now)
        return ws.listed, ws.open_k


def published_views(
    plugins_of: Callable[[Config], Plugins], dumps_available: DumpsAvailable | None
) -> Callable[[Config, StateStore, Callable[[str], list[Entry]]], PublishedDocuments]:
    """The notifier's ``view_of``: the published site for a configuration (its plugins' link policy
    and publish filter, computed once per configuration), the dumps the builder has, the notification
    channels' entries."""
    from ..publish.documents import no_dumps
    from ..publish.site import build_site, link_policy, publish_filter

    policies: list[tuple[Config, Any, Any]] = []

    def view_of(config: Config, state: StateStore, extra: Callable[[str], list[Entry]]) -> PublishedDocuments:
        if not policies or policies[0][0] is not config:
            plugins = plugins_of(config)
            policies[:] = [(config, link_policy(config, plugins), publish_filter(plugins))]
        _, policy, visible = policies[0]
        site = build_site(
            config, state, policy=policy, visible=visible, dumps_available=dumps_available or no_dumps,
            extra_capabilities=extra,
        )  # fmt: skip
        return PublishedDocuments(site)

    return view_of


# -- notifications (websub/) ---------------------------------------------------------------------------


@dataclass
class Publishing:
    """rsagg's own channels, before the harvest context exists (the notifier's ``wake`` is one of its
    commit listeners): the hub (None with an external one), the notifier, their HTTP client."""

    hub_url: str
    notifier: Notifier
    client: httpx.AsyncClient
    hub: Hub | None
    counts: Counter[str]


def publishing(
    get_config: Callable[[], Config],
    blobs: BlobStore,
    *,
    policy: AddressPolicy | None,
    view_of: ViewOf,
    dump_versions: Callable[[str], dict[str, str]],
    hub_limits: HubLimits | None = None,
    poll_interval: float = 1.0,
    framework_interval: float = 5.0,
) -> Publishing | None:
    """The hub and the notifier, each with a state handle of its own; None when ``[notifications]
    enabled = false``. ``policy``: the harvester's outbound address policy (the client's requests go to
    hubs that upstream documents name); ``view_of``: the published documents (``published_views``)."""
    config = get_config()
    nc = config.notifications
    if not nc.enabled:
        return None
    from .. import __version__
    from ..net import outbound
    from ..websub.hub import Hub, channel_topics, delivery_client
    from ..websub.notifier import TOPICS, Notifier

    base = config.server.base_url
    client = outbound.client(
        policy, timeout=10.0, follow_redirects=False, headers={"User-Agent": f"rsagg/{__version__} (WebSub)"}
    )
    hub: Hub | None = None
    counts: Counter[str] = Counter()
    if nc.hub:
        hub_url = nc.hub
    else:
        hub_url = base + nc.hub_path

        def count(event: str, outcome: str) -> None:
            counts[f"{event}.{outcome}"] += 1

        refused = policy.on_refused if policy is not None else None
        # Anyone names the callbacks: source origins are not trusted here (outbound.py).
        hub_policy = outbound.policy_for(config, hub=True, on_refused=refused)
        hub = Hub(
            state_handle(config, cache_mib=SMALL_CACHE_MIB),
            client=delivery_client(hub_policy, hub_limits),
            policy=hub_policy,
            hub_url=hub_url,
            path=nc.hub_path,
            allowed_topic=channel_topics(base, list(TOPICS.values())),  # rsagg's own topics only
            limits=hub_limits,
            metrics=count,
        )
    notifier = Notifier(
        get_config,
        state_handle(config, cache_mib=NOTIFIER_CACHE_MIB),
        blobs,
        view_of=view_of,
        hub_url=hub_url,
        hub=hub,
        client=client,
        dump_versions=dump_versions,
        poll_interval=poll_interval,
        framework_interval=framework_interval,
    )
    return Publishing(hub_url, notifier, client, hub, counts)


def notifications(
    get_config: Callable[[], Config],
    own: Publishing | None,
    *,
    harvester: Harvester | None,
    settings: SubscriberSettings | None = None,
) -> Notifications | None:
    """The three as one: ``own`` (``publishing``) and, with a ``harvester`` (this process harvests), the
    subscriber to upstream channels with a state handle of its own."""
    if own is None:
        return None
    from ..websub.service import Notifications
    from ..websub.subscriber import Subscriber

    config = get_config()
    subscriber = None
    if harvester is not None:
        state = state_handle(config, cache_mib=SMALL_CACHE_MIB)
        subscriber = Subscriber(get_config, state, harvester, client=own.client, settings=settings)
    where = f"external hub {own.hub_url}" if config.notifications.hub else f"embedded hub {own.hub_url}"
    log.info("notifications on: %s%s", where, ", following upstream channels" if subscriber else "")
    return Notifications(own.hub_url, own.notifier, own.client, own.hub, subscriber, own.counts)


def dump_versions(builder: DumpBuilder | None) -> Callable[[str], dict[str, str]]:
    """A rebuilt dump keeps its URL: the newest Resource Dump run and the Change Dump packages tell."""

    def versions(set_name: str) -> dict[str, str]:
        if builder is None:
            return {}
        run = builder.latest_run(set_name)
        return {
            "resourcedump": str(run.id) if run else "",
            "changedump": str(len(builder.change_dump_packages(set_name))),
        }

    return versions


def every_plugins(*managers: Plugins) -> Callable[[], Iterable[Plugins]]:
    """A getter of fixed plugin managers, for ``Metrics(plugins=...)``."""
    return lambda: managers


__all__ = [
    "PublishedDocuments",
    "Publishing",
    "blob_store",
    "check_store",
    "dump_builder",
    "dump_versions",
    "every_plugins",
    "load_plugins",
    "notifications",
    "published_views",
    "publisher_app",
    "publishing",
    "state_exists",
    "state_handle",
]
