"""Notifications in a running rsagg: the hub, the notifier and the subscriber, started with one call.

Why one module: the composition (compose.py) should not know the parts. It calls
``prepare_notifications(...)`` with what they need (the running configuration, the blob store, the
harvester's outbound policy, a ``Harvester`` when rsagg follows upstream channels, the dump builder),
builds the publisher app with ``create_app(..., **app_options(notes))``, then
``run_notifications(nursery, notes, stop_when=...)``; that is all. Parts (see their modules):

- ``websub/hub.py`` — the embedded WebSub hub at ``[notifications] hub_path`` (unless ``hub`` names
  an external hub); topics limited to rsagg's own URLs, payload POSTs off (rsagg publishes in-process).
- ``websub/notifier.py`` — rsagg's own channels: topic documents, Capability List entries, the
  change and framework notifications (woken by every harvest commit, ``HarvestContext.committed``).
- ``websub/subscriber.py`` — subscriptions to upstream channels, the callback routes, and the task of
  every followed source (``poll_source`` hands them over: the composition passes it the subscriber).

Off entirely with ``[notifications] enabled = false``. Changing ``[notifications]`` or
``server.base_url`` takes effect at the next start (a reload keeps the running hub and topics).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import trio

from .. import __version__
from ..config import Config
from ..net import outbound
from ..store.blobs import BlobStore
from ..store.open import open_state

if TYPE_CHECKING:  # imported when used: the daemon imports this module, harvest-only runs need no more
    from starlette.routing import BaseRoute

    from ..publish.dumps import DumpBuilder
    from .hub import Hub, HubLimits
    from .notifier import Notifier
    from .subscriber import Harvester, Subscriber, SubscriberSettings

log = logging.getLogger("rsagg.notify")

#: Page cache of the hub's and the subscriber's state handles (their tables are small: SQLite's default
#: size) and of the notifier's (it reads the changelog and the published sets).
SMALL_CACHE_MIB = 2
NOTIFIER_CACHE_MIB = 8


@dataclass
class Notifications:
    hub_url: str
    notifier: Notifier
    client: httpx.AsyncClient
    hub: Hub | None = None
    subscriber: Subscriber | None = None
    hub_counters: Counter[str] = field(default_factory=Counter)
    _scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    def routes(self) -> list[BaseRoute]:
        """Hub (POST), callbacks (GET/POST ``/_websub/TOKEN``), topics (GET/HEAD): matched first."""
        routes: list[BaseRoute] = []
        if self.hub is not None:
            routes += self.hub.routes()
        if self.subscriber is not None:
            routes += self.subscriber.routes()
        return routes + self.notifier.routes()

    @property
    def counters(self) -> dict[str, int]:
        """Everything counted, prefixed ``hub.``, ``notifier.``, ``subscriber.`` (for the metrics issue)."""
        out = {f"hub.{k}": v for k, v in self.hub_counters.items()}
        out.update({f"notifier.{k}": v for k, v in self.notifier.counters.items()})
        if self.subscriber is not None:
            out.update({f"subscriber.{k}": v for k, v in self.subscriber.counters.items()})
        return out

    async def run_publishing(self) -> None:
        """The hub's deliveries and the notifier's rounds, for as long as this cluster node holds the
        "@hub" role (``cluster.py``): exactly one node sends them. Every node serves the hub endpoint
        and the topics; what they record is in the shared state, which the holder polls."""
        self.notifier._load()  # the rounds start from what the last holder saved
        self.notifier.publishing = True
        try:
            async with trio.open_nursery() as inner:
                if self.hub is not None:
                    await inner.start(self.hub.run)
                await inner.start(self.notifier.run)
        finally:
            self.notifier.publishing = False

    def stop(self) -> None:
        """Stop the workers (the daemon is shutting down); their connections close when they have."""
        self._scope.cancel()

    async def aclose(self) -> None:
        if self.hub is not None:
            await self.hub.aclose()
        await self.notifier.aclose()
        if self.subscriber is not None:
            await self.subscriber.aclose()
        await self.client.aclose()


def app_options(notes: Notifications | None) -> dict[str, Any]:
    """Keyword arguments for ``publish.app.create_app``: the routes and the Capability List entries."""
    if notes is None:
        return {}
    return {"extra_routes": notes.routes(), "extra_capabilities": notes.notifier.capabilities}


def prepare_notifications(
    get_config: Callable[[], Config],
    blobs: BlobStore,
    *,
    policy: outbound.AddressPolicy | None,
    harvester: Harvester | None = None,
    dumps: DumpBuilder | None = None,
    hub_limits: HubLimits | None = None,
    settings: SubscriberSettings | None = None,
    poll_interval: float = 1.0,
    framework_interval: float = 5.0,
) -> Notifications | None:
    """Build hub, notifier and (with a ``harvester``) subscriber, each with a state handle of its own.
    None when ``[notifications] enabled = false``. Nothing runs yet (``run_notifications``).

    ``policy``: the harvester's outbound address policy (subscription requests go to hubs that upstream
    documents name); ``dumps``: the process's dump builder (the notifier advertises its dumps).
    """
    config = get_config()
    nc = config.notifications
    if not nc.enabled:
        return None
    from .hub import Hub, channel_topics
    from .notifier import TOPICS, Notifier
    from .subscriber import Subscriber

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
        hub = Hub(
            open_state(config, cache_mib=SMALL_CACHE_MIB),
            # Anyone names the callbacks: source origins are not trusted here (outbound.py).
            policy=outbound.policy_for(config, hub=True, on_refused=refused),
            hub_url=hub_url,
            path=nc.hub_path,
            allowed_topic=channel_topics(base, list(TOPICS.values())),  # rsagg's own topics only
            limits=hub_limits,
            metrics=count,
        )
    notifier = Notifier(
        get_config,
        open_state(config, cache_mib=NOTIFIER_CACHE_MIB),
        blobs,
        hub_url=hub_url,
        hub=hub,
        client=client,
        dumps_available=dumps.available if dumps is not None else (lambda name: {}),
        dump_versions=lambda name: _dump_versions(dumps, name),
        poll_interval=poll_interval,
        framework_interval=framework_interval,
    )
    subscriber = None
    if harvester is not None:
        state = open_state(config, cache_mib=SMALL_CACHE_MIB)
        subscriber = Subscriber(get_config, state, harvester, client=client, settings=settings)
    where = f"external hub {hub_url}" if nc.hub else f"embedded hub {hub_url}"
    log.info("notifications on: %s%s", where, ", following upstream channels" if subscriber else "")
    return Notifications(hub_url, notifier, client, hub, subscriber, counts)


def _dump_versions(builder: DumpBuilder | None, set_name: str) -> dict[str, str]:
    """A rebuilt dump keeps its URL: the newest Resource Dump run and the Change Dump packages tell."""
    if builder is None:
        return {}
    run = builder.latest_run(set_name)
    return {
        "resourcedump": str(run.id) if run else "",
        "changedump": str(len(builder.change_dump_packages(set_name))),
    }


async def run_notifications(
    nursery: trio.Nursery,
    notes: Notifications | None,
    *,
    stop_when: Callable[[], Awaitable[Any]] | None = None,
    publishing: bool = True,
) -> None:
    """Start the workers of ``notes`` (if any) in ``nursery``. They stop when the nursery is cancelled,
    on ``Notifications.stop()``, or when ``stop_when()`` returns (the daemon's shutdown), and then close
    their state handles and HTTP client. ``publishing=False`` (a cluster node): the hub's deliveries and
    the notifier's rounds are left to ``Notifications.run_publishing``, run by the one node holding the
    "@hub" role."""
    if notes is not None:
        if not publishing:
            notes.notifier.publishing = False
        await nursery.start(_run, notes, stop_when, publishing)


async def _run(
    notes: Notifications,
    stop_when: Callable[[], Awaitable[Any]] | None,
    publishing: bool = True,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        with notes._scope:
            async with trio.open_nursery() as inner:
                if publishing:
                    if notes.hub is not None:
                        await inner.start(notes.hub.run)
                    await inner.start(notes.notifier.run)
                if notes.subscriber is not None:
                    await inner.start(notes.subscriber.run)
                if stop_when is not None:

                    async def stopper() -> None:
                        await stop_when()
                        notes.stop()

                    inner.start_soon(stopper)
                task_status.started()
    finally:
        with trio.CancelScope(shield=True):
            await notes.aclose()


__all__ = ["Notifications", "app_options", "prepare_notifications", "run_notifications"]
