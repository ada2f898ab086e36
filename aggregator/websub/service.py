"""Notifications in a running rsagg: the hub, the notifier and the subscriber, run as one.

The composition (run/compose.py) builds the three, each with what it needs (a state handle of its own,
the HTTP client, the outbound policy, a ``Harvester`` when rsagg follows upstream channels, the published
views), and bundles them as ``Notifications``; it hands the publisher app ``app_options(notes)`` and
starts them with ``run_notifications(nursery, notes, stop_when=...)``. Parts (see their modules):

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

from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import trio

if TYPE_CHECKING:  # imported when used: the daemon imports this module, harvest-only runs need no more
    from starlette.routing import BaseRoute

    from .hub import Hub
    from .notifier import Notifier
    from .subscriber import Subscriber


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


__all__ = ["Notifications", "app_options", "run_notifications"]
