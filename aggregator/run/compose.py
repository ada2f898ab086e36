"""The composition root: the one place rsagg's parts are built and wired together.

Why one place: every stage gets what it needs handed in, typed, at construction (nothing set on it
from outside later), and the order of wiring is written down here instead of being implied by the
daemon's start-up. The stages do not know each other: harvest/, publish/ and websub/ import only
``rs``, the HTTP layer, ``store``, ``config``, ``plugins`` and the shared helpers (tests/test_imports.py);
this module, the daemon and the commands sit above them.

- ``open_context(config)``: the parts every run shares — plugins, the blob store, metrics, the one
  HTTP ``Fetcher``, the state (a writer and a reader handle) — as the harvest stage's ``HarvestContext``.
  ``rsagg harvest`` and ``rsagg audit`` need no more.
- ``assemble(ctx, ...)``: a daemon's parts on top of it, in this order: the dump builder (its own state
  handle; off when ``publish.dump_interval = 0``), then notifications (hub, notifier, subscriber, each with
  a state handle of its own; the subscriber gets a ``Harvester`` of ``ctx``, the notifier the dump
  builder, the harvest context the notifier's wake-up as a commit listener, the metrics the counters).
  ``Assembly.app(config)`` builds the publisher for a configuration (start and every reload) from them,
  with that configuration's plugins (``Assembly.plugins_for``); the dump builder reads the running
  configuration and its plugins through getters, so its publish filter is the lists' after a reload too.
- ``start_node(parts, ...)``: on a cluster node (``[cluster] enabled``), this process as a ``cluster.Node``
  with a state handle of its own, opened here and closed here once the node has left the cluster.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from ..config import Config
from ..harvest.access import Access, user_agent
from ..harvest.context import HarvestContext, open_blob_store, prepare_store, store_recipe
from ..harvest.fetch import Fetcher
from ..harvest.notices import NotifiedHarvest
from ..harvest.offload import Offload
from ..harvest.source import FollowedSources
from ..net import outbound
from ..observe.logs import add_secrets, config_secrets
from ..observe.metrics import Metrics, current_source
from ..plugins.manager import Plugins
from ..store.blobs import BlobStore
from ..store.open import open_state, state_path
from .cluster import Node, StartSource, StopSource

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from ..publish.dumps import DumpBuilder
    from ..publish.schedule import Wake
    from ..websub.hub import HubLimits
    from ..websub.service import Notifications
    from ..websub.subscriber import SubscriberSettings


@asynccontextmanager
async def open_context(
    config: Config, sources: Collection[str] | None = None
) -> AsyncIterator[HarvestContext]:
    """Open the store, the state (reader + writer handles) and the one HTTP client for a run.

    ``sources``: the names of the sources the run works on (``--source``), whose secrets must be there
    now; None: every configured source's (a daemon, which a reload may set to work on any of them)."""
    hc = config.harvest
    # Secret values of the backend's and the plugins' settings (S3 keys...) never reach a log line.
    add_secrets(config_secrets(config))
    access = Access(config, sources)  # reads those secrets: a missing one stops here (a ConfigError)
    prepare_store(config)  # the store folder exists and is writable (a ConfigError otherwise)
    plugins = Plugins.from_config(config)
    blobs = open_blob_store(config, plugins)
    writer = open_state(config, cache_mib=config.store.cache_mib)
    # The reader only walks the (set_id, uri) index for lookups: a small cache holds its hot pages.
    reader = open_state(config, cache_mib=8)
    metrics = Metrics()
    metrics.attach(plugins=plugins, store=blobs)
    fetcher = Fetcher(
        metrics_hook=metrics.fetch_hook,
        per_host=hc.per_host,
        max_connections=hc.max_connections,
        timeout=hc.timeout,
        retries=hc.retries,
        backoff_base=hc.backoff_base,
        backoff_max=hc.backoff_max,
        max_document_bytes=hc.max_document_bytes,
        max_resource_bytes=hc.max_resource_bytes,
        policy=outbound.policy_for(
            config, current_source=current_source.get, on_refused=metrics.outbound_refused_hook
        ),
        user_agent=user_agent(config),
        request_hook=access,
    )
    plugins.call("rsagg_startup", config=config)
    try:
        ctx = HarvestContext(
            config, fetcher, blobs, reader, writer,
            patch_formats=plugins.merged("rsagg_patch_formats"), plugins=plugins, metrics=metrics,
            offload=Offload(blobs, store_recipe(config, plugins), hc.processes),
        )  # fmt: skip
        access.follow(lambda: ctx.config)  # a reloaded config's credentials and rates apply at once
        yield ctx
    finally:
        plugins.call("rsagg_shutdown")
        with trio.CancelScope(shield=True):
            await fetcher.aclose()
        reader.close()
        writer.close()


@dataclass
class Assembly:
    """A daemon's parts (``assemble``): the harvest context, the dump builder, the notifications."""

    harvest: HarvestContext
    dumps: DumpBuilder | None = None
    notifications: Notifications | None = None
    #: Set on a reload: the dump schedule starts a round at once (withdraws, rebuilds).
    dumps_wake: Wake = field(default_factory=lambda: _wake())
    #: (configuration, its plugins): the start-up pair and the newest reloaded one (``plugins_for``).
    _plugins: list[tuple[Config, Plugins]] = field(default_factory=list)

    def plugins_for(self, config: Config) -> Plugins:
        """The plugins of ``config`` (by identity): the harvest context's for the start-up configuration,
        a manager of its own for a reloaded one (its ``[plugins.*]`` tables, enabled or not). Raises
        ConfigError for plugins that do not load (plugins.py: they fail closed)."""
        if config is self.harvest.config and not self._plugins:
            self._plugins.append((config, self.harvest.plugins))
        for known, plugins in list(self._plugins):
            if known is config:
                return plugins
        plugins = Plugins.from_config(config)
        running = [pair for pair in self._plugins if pair[0] is self.config]  # kept: it runs
        self._plugins[:] = [*running[-1:], (config, plugins)]
        return plugins

    @property
    def plugins(self) -> Plugins:
        """The running configuration's plugins: what every published view filters with."""
        return self.plugins_for(self.config)

    @property
    def config(self) -> Config:
        """The running configuration: the harvest context's, which a reload replaces (every part reads
        it through a getter of it)."""
        return self.harvest.config

    @config.setter
    def config(self, config: Config) -> None:
        self.harvest.config = config

    @property
    def blobs(self) -> BlobStore:
        return self.harvest.blobs

    @property
    def metrics(self) -> Metrics:
        return self.harvest.metrics

    @property
    def followed(self) -> FollowedSources | None:
        """Who runs the sources whose notification channels rsagg follows (``poll_source``'s ``follow``)."""
        return self.notifications.subscriber if self.notifications is not None else None

    def roles(self) -> dict[str, Callable[[], Awaitable[Any]]]:
        """What one node of a cluster at a time does (cluster.py): build the dumps, send the hub's
        deliveries and rsagg's notifications, unsubscribe from the channels of sources no live node
        follows any more ("@orphans")."""
        from ..publish.schedule import run_dumps

        roles: dict[str, Callable[[], Awaitable[Any]]] = {
            "@dumps": partial(run_dumps, self.dumps, lambda: self.config, trio.sleep_forever, self.dumps_wake)
        }
        if self.notifications is not None:
            roles["@hub"] = self.notifications.run_publishing
            if self.notifications.subscriber is not None:
                roles["@orphans"] = self.notifications.subscriber.run_orphans
        return roles

    def app(self, config: Config) -> ASGIApp:
        """The publishing app for ``config`` (imported lazily: harvest-only commands do not need it)."""
        from ..publish.app import create_app
        from ..publish.schedule import dump_app_options
        from ..websub.service import app_options

        # app_options: the notification routes (hub, callbacks, topics) and Capability List entries;
        # dump_app_options: the dump documents, packages, manifests.
        options = dump_app_options(self.dumps, app_options(self.notifications))
        options["metrics"] = self.metrics  # /metrics shows this process's harvest too (metrics.py)
        options["plugins"] = self.plugins_for(config)  # the dump builder's, once config runs
        return create_app(config, blobs=self.blobs, state_path=state_path(config), **options)


def _wake() -> Wake:
    from ..publish.schedule import Wake

    return Wake()


def assemble(
    ctx: HarvestContext,
    *,
    harvest: bool = True,
    hub_limits: HubLimits | None = None,
    settings: SubscriberSettings | None = None,
    **notifier_options: Any,
) -> Assembly:
    """Build a daemon's parts on ``ctx`` (nothing runs yet: ``run_assembly``). ``harvest``: whether
    this process harvests (then it also follows upstream notification channels)."""
    from ..publish.schedule import open_dump_builder
    from ..websub.service import prepare_notifications

    parts = Assembly(ctx)
    dumps = open_dump_builder(
        ctx.config, ctx.blobs, get_config=lambda: parts.config, get_plugins=lambda: parts.plugins
    )
    # On a cluster node (cluster.py) the subscriber keeps its subscriptions and its inbox in the shared
    # state: a callback may reach any node, the holder of the source's lease applies it.
    follow = harvest
    notes = prepare_notifications(
        lambda: ctx.config,
        ctx.blobs,
        policy=ctx.fetcher.policy,
        harvester=NotifiedHarvest(ctx) if follow else None,
        dumps=dumps,
        hub_limits=hub_limits,
        settings=settings,
        **notifier_options,
    )
    if notes is not None:
        ctx.commit_listeners.append(notes.notifier.wake)  # rsagg's own notifications go out at once
        ctx.metrics.attach(notifications=lambda: notes)
    parts.dumps, parts.notifications = dumps, notes
    return parts


async def run_assembly(
    nursery: trio.Nursery, parts: Assembly, stop_when: Callable[[], Awaitable[Any]]
) -> None:
    """Start the background workers of ``parts`` in ``nursery``: notifications (hub, notifier,
    subscriber) and the dump schedule; they stop when ``stop_when()`` returns (the daemon's shutdown).
    On a cluster node the hub's deliveries, rsagg's notifications and the dumps are roles that one node
    at a time holds (``Assembly.roles``, run by cluster.py), not started here."""
    from ..publish.schedule import run_dumps
    from ..websub.service import run_notifications

    node = parts.config.cluster.enabled
    await run_notifications(nursery, parts.notifications, stop_when=stop_when, publishing=not node)
    if not node:
        nursery.start_soon(run_dumps, parts.dumps, lambda: parts.config, stop_when, parts.dumps_wake)


def start_node(
    parts: Assembly, nursery: trio.Nursery, scope: trio.CancelScope, *, start: StartSource, stop: StopSource
) -> Node:
    """This process as a cluster node (cluster.py), run in ``nursery`` until ``scope`` is cancelled: it
    then releases its leases, and the state handle opened for it here is closed.

    The handle is the node's own, not ``ctx.writer``: heartbeats and lease renewals never queue behind
    this process's harvest writes (a beat held up by a long harvest batch would let the leases lapse and
    stop every task of the node)."""
    config = parts.config
    state = open_state(config, cache_mib=1)
    try:
        node = Node(
            config, state=state, start=start, stop=stop, metrics=parts.metrics, fetcher=parts.harvest.fetcher,
            roles=parts.roles(),
        )  # fmt: skip
    except BaseException:
        state.close()
        raise

    async def run() -> None:
        try:
            with scope:
                await node.run()
        finally:
            state.close()

    nursery.start_soon(run, name=f"cluster node {node.name}")
    return node


__all__ = ["Assembly", "assemble", "open_context", "run_assembly", "start_node"]
