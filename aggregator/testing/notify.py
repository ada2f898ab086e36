"""Change and Framework Notification channels for the demo ``Upstream`` (tests and ``rsagg demo``).

Why: rsagg's subscriber needs an upstream that notifies, over a real hub — rsagg's own ``Hub``
embedded in the upstream's server (``/hub``), or an external one (flask-websub in the tests). The
upstream's hooks carry it: ``extra_capabilities`` advertises the two channels of every set in its
Capability List (topic ``loc`` + ``rs:ln rel="hub"``, Framework Notification §5), ``listeners`` wakes
the publishing task after every change, ``extra_routes`` serve the topics (and the embedded hub)::

    /SET/change-notification.xml      latest change notification (Link self + hub)
    /SET/framework-notification.xml   latest framework notification
    /hub                              the embedded hub (when no external hub is given)

Change notifications hold the set's change log entries (the same entries as its Change Lists) after
the last one sent, at most ``max_entries`` each, back to back: ``from`` = the previous ``until``,
``until`` = the datetime of the last entry (the first starts where the log stood when ``run`` began:
history is in the Change Lists). A framework notification goes out when Change Lists roll (the closed
one ``updated``, the new open one ``created``, each with ``rel="index"``).

Publishing: in-process ``Hub.publish``, or a generic WebSub ping (``hub.mode=publish``) after the
payload became the topic document — one at a time, so a hub that fetches the topic while handling the
ping (flask-websub) sees each payload. ``pause()``/``resume()`` let a test lose notifications on
purpose (a gap the subscriber must notice).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from ..rs import model
from ..rs.model import Entry, Head, Link, Md
from ..rs.write import iter_document_bytes
from ..store.open import connect
from ..websub.hub import Hub, HubLimits, delivery_client, topics_under
from .upstream import ChangeRecord, Upstream

log = logging.getLogger("rsagg.demo")
XML = "application/xml"
TOPICS = {
    model.CHANGE_NOTIFICATION: "change-notification.xml",
    model.FRAMEWORK_NOTIFICATION: "framework-notification.xml",
}


class UpstreamNotifier:
    """Publishes the notifications of an ``Upstream``; ``await nursery.start(n.run)`` after it serves."""

    def __init__(
        self,
        up: Upstream,
        *,
        hub: str | None = None,
        max_entries: int = 1000,
        hub_limits: HubLimits | None = None,
    ) -> None:
        """``hub``: an external hub URL; None embeds rsagg's ``Hub`` at ``/hub`` of the upstream."""
        self.up = up
        self.external_hub = hub
        self.max_entries = max_entries
        self.hub_limits = hub_limits
        self.hub: Hub | None = None
        self.hub_url: str | None = hub
        self.published: dict[str, int] = {}  # topic -> payloads published
        self.bodies: dict[str, bytes] = {}  # topic -> latest payload (the topic document)
        self._sent: dict[str, int] = {}  # set -> log entries sent
        self._until: dict[str, Any] = {}  # set -> until of the last change notification
        self._lists: dict[str, int] = {}  # set -> Change Lists known
        self._paused = False
        self._wake = trio.Event()
        self._hub_ready = trio.Event()
        up.extra_routes += [
            Route("/hub", self._hub_endpoint, methods=["POST"]),
            *(
                Route(f"/{{set}}/{name}", self._topic(kind), methods=["GET", "HEAD"])
                for kind, name in TOPICS.items()
            ),
        ]
        up.listeners.append(self._on_change)

    # -- test controls ---------------------------------------------------------------------------

    def pause(self) -> None:
        """Changes made while paused are never notified (their notification is "lost")."""
        self._paused = True

    def resume(self) -> None:
        """Go on after the changes made meanwhile, as if their notifications had been sent and lost:
        the next one starts at the last of them, so a subscriber sees a gap."""
        for name in self.up.set_names:
            self._skip_to_end(name)
        self._paused = False

    def topic(self, kind: str, set_name: str | None = None) -> str:
        return self.up.doc_url(TOPICS[kind], set_name)

    # -- HTTP ------------------------------------------------------------------------------------

    async def _hub_endpoint(self, request: Request) -> Response:
        if self.hub is None:
            return PlainTextResponse("no hub here\n", status_code=404)
        return await self.hub.endpoint(request)

    def _topic(self, kind: str) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            name = request.path_params["set"]
            if name not in self.up.set_names or self.hub_url is None:
                return PlainTextResponse("not found\n", status_code=404)
            topic = self.topic(kind, name)
            link = (
                f'<{topic}>; rel="self", <{self.hub_url}>; rel="hub", '
                f'<{self.up.doc_url("capabilitylist.xml", name)}>; rel="resourcesync"'
            )
            body = b"" if request.method == "HEAD" else self.bodies.get(topic, b"")
            return Response(body, media_type=XML, headers={"Link": link})

        return endpoint

    # -- publishing ------------------------------------------------------------------------------

    def _on_change(self, set_name: str, rec: ChangeRecord) -> None:
        self._wake.set()

    def _skip_to_end(self, name: str) -> None:
        log_ = self.up.changes(name)
        self._sent[name] = len(log_)
        self._until[name] = log_[-1].datetime if log_ else self.up.change_lists(name)[0].from_
        self._lists[name] = len(self.up.change_lists(name))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish until cancelled (the upstream must be served: its base URL is needed)."""
        base = self.up.base()
        folder = Path(tempfile.mkdtemp(prefix="rsagg-demo-hub-"))
        client = httpx.AsyncClient(timeout=10.0)
        try:
            async with trio.open_nursery() as nursery:
                if self.external_hub is None:
                    self.hub_url = base + "/hub"
                    self.hub = Hub(
                        connect(folder / "hub.db"), client=delivery_client(None, self.hub_limits),
                        hub_url=self.hub_url, allowed_topic=topics_under(base),
                        limits=self.hub_limits,
                    )  # fmt: skip
                    await nursery.start(self.hub.run)
                for name in self.up.set_names:
                    self.up.extra_capabilities[name] = [
                        Entry(
                            self.topic(kind, name),
                            md=Md(capability=kind),
                            links=[Link("hub", self.hub_url or "")],
                        )
                        for kind in TOPICS
                    ]
                    self._skip_to_end(name)
                task_status.started()
                while True:
                    self._wake = trio.Event()
                    for name in self.up.set_names:
                        await self._publish_set(client, name)
                    await self._wake.wait()
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()
                if self.hub is not None:
                    await self.hub.aclose()
                shutil.rmtree(folder, ignore_errors=True)

    async def _publish_set(self, client: httpx.AsyncClient, name: str) -> None:
        if self._paused:
            return
        up = self.up
        s = up._set(name)  # the demo's own package: the change entries exactly as its Change Lists
        base = up.base()
        records = up.changes(name)[self._sent[name] :]
        cl = up.doc_url("capabilitylist.xml", name)
        for i in range(0, len(records), self.max_entries):
            chunk = records[i : i + self.max_entries]
            head = Head(
                md=Md(
                    capability=model.CHANGE_NOTIFICATION, from_=self._until[name], until=chunk[-1].datetime
                ),
                links=[Link("up", cl)],
            )
            entries = [up._change_entry(base, s, rec) for rec in chunk]
            self._sent[name] += len(chunk)
            self._until[name] = chunk[-1].datetime
            await self._publish(client, self.topic(model.CHANGE_NOTIFICATION, name), head, entries, cl)
        lists = up.change_lists(name)
        if len(lists) > self._lists[name]:
            index = up.doc_url("changelist.xml", name)
            entries = []
            for cl_ in lists[max(0, self._lists[name] - 1) :]:
                change = model.CREATED if cl_.until is None else model.UPDATED
                md = Md(capability=model.CHANGELIST, change=change, datetime=cl_.until or cl_.from_)
                entries.append(
                    Entry(
                        up.doc_url(f"changelist-{cl_.number}.xml", name), md=md, links=[Link("index", index)]
                    )
                )
            self._lists[name] = len(lists)
            head = Head(md=Md(capability=model.FRAMEWORK_NOTIFICATION), links=[Link("up", cl)])
            await self._publish(client, self.topic(model.FRAMEWORK_NOTIFICATION, name), head, entries, cl)

    async def _publish(
        self, client: httpx.AsyncClient, topic: str, head: Head, entries: list[Entry], cl: str
    ) -> None:
        body = b"".join(iter_document_bytes(head, entries))
        self.bodies[topic] = body
        self.published[topic] = self.published.get(topic, 0) + 1
        if self.hub is not None:
            await self.hub.publish(topic, body, XML, resourcesync=[cl])
            return
        assert self.external_hub is not None
        try:
            r = await client.post(self.external_hub, data={"hub.mode": "publish", "hub.topic": topic})
            if r.status_code >= 300:
                log.warning("hub %s refused the ping for %s: %s", self.external_hub, topic, r.status_code)
        except httpx.HTTPError as exc:
            log.warning("hub %s unreachable for %s: %s", self.external_hub, topic, exc)


__all__ = ["TOPICS", "UpstreamNotifier"]
