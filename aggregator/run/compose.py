"""The composition root: the one place rsagg's parts are built and wired together.

Why one place: every stage gets what it needs handed in, typed, at construction (nothing set on it
from outside later), and the order of wiring is written down here instead of being implied by the
daemon's start-up. The stages do not know each other: harvest/, publish/ and websub/ import only the
floors (tests/test_imports.py); this module, the daemon and the commands sit above them. The builders
themselves are in ``run/parts.py`` (the one module that opens state handles); here they are called in
order and their lifetimes kept.

- ``open_context(config)``: the parts every run shares — plugins, the blob store, metrics, the one
  HTTP ``Fetcher``, the state (a writer and a reader handle) — as the harvest stage's ``HarvestContext``.
  ``rsagg harvest`` and ``rsagg audit`` need no more.
- ``open_assembly(config, ...)``: a daemon's parts: those, and before the harvest context the dump
  builder (its own state handle; off when ``publish.dump_interval = 0``) and rsagg's own channels (hub,
  notifier: the harvest context gets the notifier's wake-up as a commit listener), then the subscriber
  (a ``Harvester`` of the context). ``Assembly.app(config)`` builds the publisher for a configuration
  (start and every reload) with that configuration's plugins (``Assembly.plugins_for``); the dump
  builder and the notifier read the running configuration and its plugins through getters.
- ``worker_app(config)``: the publisher of a serving worker process (run/workers.py).
- ``start_node(parts, ...)``: on a cluster node (``[cluster] enabled``), this process as a ``cluster.Node``
  with a state handle of its own, opened here and closed here once the node has left the cluster.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from ..config import Config
from ..harvest.access import Access, user_agent
from ..harvest.context import HarvestContext, prepare_store, store_recipe
from ..harvest.fetch import Fetcher
from ..harvest.notices import NotifiedHarvest
from ..harvest.offload import Offload
from ..harvest.source import FollowedSources
from ..net import outbound
from ..observe.metrics import Metrics
from ..plugins.manager import Plugins
from ..redact import add_secrets, config_secrets
from ..scope import current_source
from ..store.blobs import BlobStore
from . import parts as build
from .cluster import Node, StartSource, StopSource

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from starlette.types import ASGIApp

    from ..publish.dumps import DumpBuilder
    from ..publish.schedule import BuildRunner, Wake
    from ..websub.hub import HubLimits
    from ..websub.service import Notifications
    from ..websub.subscriber import SubscriberSettings


@asynccontextmanager
async def open_context(
    config: Config, sources: Collection[str] | None = None
) -> AsyncIterator[HarvestContext]:
    """The parts of a one-shot run (``rsagg harvest``, ``rsagg audit``) as a ``HarvestContext``.

    ``sources``: the names of the sources the run works on (``--source``), whose secrets must be there
    now; None: every configured source's."""
    async with _open(config, sources, None) as (ctx, _parts):
        yield ctx


@asynccontextmanager
async def open_assembly(
    config: Config,
    *,
    harvest: bool = True,
    hub_limits: HubLimits | None = None,
    settings: SubscriberSettings | None = None,
    poll_interval: float = 1.0,
    framework_interval: float = 5.0,
) -> AsyncIterator[Assembly]:
    """A daemon's parts (nothing runs yet: ``run_assembly``). ``harvest``: whether this process
    harvests (then it also follows upstream notification channels); the rest: the notifications'
    bounds and intervals."""
    options = _DaemonOptions(harvest, hub_limits, settings, poll_interval, framework_interval)
    async with _open(config, None, options) as (_ctx, parts):
        assert parts is not None
        yield parts


@dataclass
class _DaemonOptions:
    harvest: bool
    hub_limits: HubLimits | None
    settings: SubscriberSettings | None
    poll_interval: float
    framework_interval: float


@asynccontextmanager
async def _open(
    config: Config, sources: Collection[str] | None, daemon: _DaemonOptions | None
) -> AsyncIterator[tuple[HarvestContext, Assembly | None]]:
    """Build every part in order (docs/architecture.md "The composition root"); close them in reverse."""
    hc = config.harvest
    # Secret values of the backend's and the plugins' settings (S3 keys...) never reach a log line.
    add_secrets(config_secrets(config))
    built: list[HarvestContext] = []  # the harvest context, once built below: its config is the running one
    # Access reads those secrets: a missing one stops here (a ConfigError). A reloaded config's
    # credentials and rates apply at once.
    access = Access(config, sources, running=lambda: built[0].config if built else config)
    prepare_store(config)  # the store folder exists and is writable (a ConfigError otherwise)
    plugins = build.load_plugins(config)
    blobs = build.blob_store(config, plugins)
    seen: list[Plugins] = [plugins]  # every plugin manager of the process: the metrics count them all
    # The notifications once built below: their client's address policy reports to the metrics, whose
    # scrape reads their counters (so the metrics get a getter of them).
    notes: list[Notifications | None] = [None]
    metrics = Metrics(plugins=lambda: tuple(seen), store=blobs, notifications=lambda: notes[0])
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
    try:
        with contextlib.ExitStack() as handles:
            writer = handles.enter_context(
                _closing(build.state_handle(config, cache_mib=config.store.cache_mib))
            )
            reader = handles.enter_context(
                _closing(build.state_handle(config, cache_mib=build.READER_CACHE_MIB))
            )
            parts = Assembly(config, plugins, seen, metrics) if daemon is not None else None
            own = None
            if parts is not None and daemon is not None:
                parts.dumps = build.dump_builder(
                    config, blobs, get_config=lambda: parts.config, get_plugins=lambda: parts.plugins
                )
                available = parts.dumps.available if parts.dumps is not None else None
                if parts.dumps is not None:  # built in a process of its own
                    from .dumpworker import dump_process

                    parts.dump_runner = partial(
                        dump_process, blobs, store_recipe(config, plugins), parts.dumps
                    )
                own = build.publishing(
                    lambda: parts.config, blobs, policy=fetcher.policy,
                    view_of=build.published_views(parts.plugins_for, available),
                    dump_versions=build.dump_versions(parts.dumps), hub_limits=daemon.hub_limits,
                    poll_interval=daemon.poll_interval, framework_interval=daemon.framework_interval,
                )  # fmt: skip
            plugins.call("rsagg_startup", config=config)
            try:
                ctx = HarvestContext(
                    config, fetcher, blobs, reader, writer,
                    patch_formats=plugins.merged("rsagg_patch_formats"), plugins=plugins, metrics=metrics,
                    offload=Offload(blobs, store_recipe(config, plugins), hc.processes),
                    # rsagg's own notifications go out at once after a commit, not at the next look
                    commit_listeners=(own.notifier.wake,) if own is not None else (),
                )  # fmt: skip
                built.append(ctx)
                if parts is not None and daemon is not None:
                    parts.harvest_context = ctx
                    harvester = NotifiedHarvest(ctx) if daemon.harvest else None
                    parts.notifications = notes[0] = build.notifications(
                        lambda: parts.config, own, harvester=harvester, settings=daemon.settings
                    )
                yield ctx, parts
            finally:
                plugins.call("rsagg_shutdown")
    finally:
        with trio.CancelScope(shield=True):
            await fetcher.aclose()


@contextlib.contextmanager
def _closing(handle: Any) -> Iterator[Any]:
    try:
        yield handle
    finally:
        handle.close()


class Assembly:
    """A daemon's parts (``open_assembly``): the harvest context, the dump builder, the notifications."""

    def __init__(self, config: Config, plugins: Plugins, seen: list[Plugins], metrics: Metrics) -> None:
        self._start = config
        #: This process's metrics (the harvest context holds them typed by what a harvest reports).
        self.metrics = metrics
        self.harvest_context: HarvestContext | None = None
        self.dumps: DumpBuilder | None = None
        #: Where the dump schedule runs a round (None: a niced thread of the daemon).
        self.dump_runner: Callable[[], AbstractAsyncContextManager[BuildRunner | None]] | None = None
        self.notifications: Notifications | None = None
        #: Set on a reload: the dump schedule starts a round at once (withdraws, rebuilds).
        self.dumps_wake: Wake = _wake()
        #: (configuration, its plugins): the start-up pair and the newest reloaded one (``plugins_for``).
        self._plugins: list[tuple[Config, Plugins]] = [(config, plugins)]
        self._seen = seen
        # plugins_for is called from worker threads (the notifier's rounds, a reload's app) and the loop
        self._plugins_lock = threading.Lock()

    def dump_failed(self, exc: Exception) -> None:
        """A dump round failed (the schedule logs it by name): ``rsagg_errors{source="",kind="dump"}``."""
        self.metrics.error("", "dump")

    @property
    def harvest(self) -> HarvestContext:
        assert self.harvest_context is not None, "built by open_assembly"
        return self.harvest_context

    def plugins_for(self, config: Config) -> Plugins:
        """The plugins of ``config`` (by identity): the harvest context's for the start-up configuration,
        a manager of its own for a reloaded one (its ``[plugins.*]`` tables, enabled or not). Raises
        ConfigError for plugins that do not load (plugins.py: they fail closed)."""
        with self._plugins_lock:
            for known, plugins in list(self._plugins):
                if known is config:
                    return plugins
            plugins = build.load_plugins(config)
            self._seen.append(plugins)
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
        return self.harvest_context.config if self.harvest_context is not None else self._start

    @config.setter
    def config(self, config: Config) -> None:
        self.harvest.config = config

    @property
    def blobs(self) -> BlobStore:
        return self.harvest.blobs

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
            "@dumps": partial(
                run_dumps,
                self.dumps,
                lambda: self.config,
                trio.sleep_forever,
                self.dumps_wake,
                self.dump_runner,
                self.dump_failed,
            )
        }
        if self.notifications is not None:
            roles["@hub"] = self.notifications.run_publishing
            if self.notifications.subscriber is not None:
                roles["@orphans"] = self.notifications.subscriber.run_orphans
        return roles

    def app(self, config: Config) -> ASGIApp:
        """The publishing app for ``config``: the notification routes (hub, callbacks, topics) and
        Capability List entries, the dump documents, this process's metrics (``/metrics`` shows its
        harvest too), the plugins of ``config`` (the dump builder's, once ``config`` runs)."""
        from ..publish.schedule import dump_app_options
        from ..websub.service import app_options

        options = dump_app_options(self.dumps, app_options(self.notifications))
        return build.publisher_app(
            config, blobs=self.blobs, plugins=self.plugins_for(config), metrics=self.metrics, **options
        )


def _wake() -> Wake:
    from ..publish.schedule import Wake

    return Wake()


@contextlib.contextmanager
def worker_app(config: Config) -> Iterator[tuple[ASGIApp, Metrics]]:
    """The publisher of a serving worker process (run/workers.py): its own plugins, blob store and
    metrics (in multiprocess mode: the daemon's ``/metrics`` adds what it counts)."""
    add_secrets(config_secrets(config))  # never in this process's log lines either (logs.py)
    plugins = build.load_plugins(config)
    blobs = build.blob_store(config, plugins)
    try:
        # the one Metrics of this process (in multiprocess mode two would write the same series of one
        # file)
        metrics = Metrics(process=False, plugins=build.every_plugins(plugins), store=blobs)
        yield build.publisher_app(config, blobs=blobs, plugins=plugins, metrics=metrics), metrics
    finally:
        getattr(
            blobs, "close", lambda: None
        )()  # the BlobStore protocol has no close (a plugin's may lack it)


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
        nursery.start_soon(
            run_dumps,
            parts.dumps,
            lambda: parts.config,
            stop_when,
            parts.dumps_wake,
            parts.dump_runner,
            parts.dump_failed,
        )


def start_node(
    parts: Assembly, nursery: trio.Nursery, scope: trio.CancelScope, *, start: StartSource, stop: StopSource
) -> Node:
    """This process as a cluster node (cluster.py), run in ``nursery`` until ``scope`` is cancelled: it
    then releases its leases, and the state handle opened for it here is closed.

    The handle is the node's own, not ``ctx.writer``: heartbeats and lease renewals never queue behind
    this process's harvest writes (a beat held up by a long harvest batch would let the leases lapse and
    stop every task of the node)."""
    state = build.state_handle(parts.config, cache_mib=build.NODE_CACHE_MIB)
    try:
        node = Node(
            lambda: parts.config, state=state, start=start, stop=stop, metrics=parts.metrics,
            fetcher=parts.harvest.fetcher, roles=parts.roles(),
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


__all__ = ["Assembly", "open_assembly", "open_context", "run_assembly", "start_node", "worker_app"]
