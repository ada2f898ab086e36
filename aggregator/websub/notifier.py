"""rsagg's own notification channels: Change Notification and Framework Notification 1.0.1 over WebSub.

Why: a Destination of rsagg (another rsagg, say) learns of a change within milliseconds instead of at
its next poll of our Change List. Per published set (one Capability List, §9) there are two channels,
each a WebSub topic (spec/NOTES.md "Change Notification": one channel per set, change and framework
notifications on separate channels)::

    /SET/change-notification.xml       change notifications (payload capability="change-notification")
    /SET/framework-notification.xml    framework notifications (capability="framework-notification")

Both are advertised in the set's Capability List: an entry whose ``loc`` is the topic, with
``rs:md capability=...`` and ``rs:ln rel="hub"`` (Framework Notification §5, Example 8). A topic
answers GET and HEAD with 200, ``Content-Type: application/xml`` and ``Link: <TOPIC>; rel="self",
<HUB>; rel="hub", <CAPABILITY LIST>; rel="resourcesync"``; the body is the latest payload (empty before
the first) — which is also what a generic WebSub hub fetches when pinged (NOTES "Source -> hub").

Change notifications are a view of the changelog (docs/architecture.md invariant 3), like our Change Lists:
after each harvest commit (``HarvestContext.committed`` wakes ``Notifier.wake``) and at least every
``poll_interval`` seconds, the records after the channel's ``last_seq`` become payloads:

- entries are exactly our Change List entries (``documents.change_entry``: our URI, change, datetime,
  fixity, the via link), in seq order (forward chronological: the changelog datetime never decreases);
- payloads are back to back: ``from`` = the previous payload's ``until``, ``until`` = the datetime of
  the payload's last record (NOTES "Payload"), so a Destination can detect a missed one;
- a burst is split into payloads of ``max_entries`` (never a ``<sitemapindex>``), extended to the end
  of a group of records that share one datetime (one commit) up to twice that, so that a split seldom
  cuts such a group: a Destination cannot tell which of a cut group it already holds (it then polls);
- channel state (``last_seq``, ``last_until``, the latest payload) lives in the state
  (``StateStore.notify_channels``, migration 7; a state handle of the notifier's own), so the chain of
  from/until goes on across restarts. A new channel starts at the current end of the changelog: history
  is in the lists.

Framework notifications (Framework Notification §2-§3): at most every ``framework_interval`` seconds,
and at once when the changelog opens a new Change List window, each set's capability documents are
compared with what was last announced: the Capability List (its entries), the Source Description
(the sets; announced on every channel, §2), each Change List window (open/closed; a window under the
index carries ``rs:ln rel="index"``, indexes themselves are never announced), and the dumps
(``dumps_available``, versioned by ``dump_versions``: a rebuilt Resource Dump keeps its URL).
Differences are sent as ``created``/``updated``/``deleted`` entries with the document's ``capability``.
A set that is no longer published gets ``capabilitylist deleted`` and its channels are dropped.

Publishing: through the embedded hub in-process (``Hub.publish``; a topic nobody subscribed to gets no
payload built at all), or to an external hub with a generic WebSub ping (``hub.mode=publish`` +
``hub.topic``; the hub then GETs the topic). Pings go one at a time, each after its payload became the
topic document, so a hub that fetches while handling the ping (flask-websub) sees every payload; one
that fetches later may see only the newest — its subscribers then notice the gap and poll our Change
List, which stays the truth.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from ..config import Config
from ..net import outbound
from ..net.retry import backoff, retry_after, retryable_status, transient_error
from ..plugins.manager import Plugins
from ..publish.documents import Site, UriOf, Windows, capability_list, change_entry, no_dumps
from ..publish.site import build_site, link_policy, publish_filter
from ..rs.model import (
    CAPABILITYLIST,
    CHANGE_NOTIFICATION,
    CHANGELIST,
    CREATED,
    DELETED,
    DESCRIPTION,
    FRAMEWORK_NOTIFICATION,
    UPDATED,
    Entry,
    Head,
    Link,
    Md,
)
from ..rs.w3cdt import utcnow
from ..rs.write import iter_document_bytes
from ..store.blobs import BlobStore
from ..store.interface import StateStore
from ..store.rows import LogRecord, NotifyChannel, Resource
from ..store.sets import PublishedSet, published_sets
from .hub import Hub
from .storecalls import StoreCalls

log = logging.getLogger("rsagg.notify")

XML = "application/xml"
#: Topic path names under /SET/ (kind -> file name).
TOPICS = {
    CHANGE_NOTIFICATION: "change-notification.xml",
    FRAMEWORK_NOTIFICATION: "framework-notification.xml",
}
#: Payloads built per set in one round (bounds memory; the next round follows at once).
MAX_PAYLOADS_PER_ROUND = 8
#: Pings of an external hub: tries, and the backoff bounds between them (``retry.py``; a hub's
#: Retry-After is honoured up to the cap: the notifier round waits meanwhile).
PING_ATTEMPTS = 3
PING_BACKOFF = 0.2
PING_BACKOFF_MAX = 5.0

Snapshot = dict[str, list[Any]]  # url -> [capability, version, index url or None]


def topic_url(base_url: str, set_name: str, kind: str) -> str:
    return f"{base_url}/{set_name}/{TOPICS[kind]}"


#: A channel's working copy: what the state keeps of it (``StateStore.notify_channels``).
Channel = NotifyChannel


@dataclass
class _Payload:
    channel: Channel
    body: bytes
    last_seq: int
    until: datetime | None
    snapshot: Snapshot | None = None
    entries: int = 0


@dataclass
class _Plan:
    """What one round found: payloads to send, channel updates without payload, channels to drop."""

    payloads: list[_Payload] = field(default_factory=list)
    silent: list[Channel] = field(default_factory=list)  # new channels: saved, nothing to send
    #: Channels moved past records they do not publish (other sets', hidden ones, nobody listening):
    #: kept in memory only (after a restart the scan from the saved position finds the same).
    advanced: list[Channel] = field(default_factory=list)
    dropped: list[Channel] = field(default_factory=list)
    more: bool = False  # a set had more payloads than one round builds
    set_names: set[str] = field(default_factory=set)
    framework_checked: bool = False


class Notifier:
    """Builds and publishes rsagg's notifications; serves the topic documents (``routes()``).

    ``get_config`` is read at each round, so a reload's new sets and base URL are followed (the hub
    URL is fixed at start). Counters (for the metrics issue): ``counters["published.change"]``,
    ``["published.framework"]`` (payloads handed to the hub), ``["entries.change"]``,
    ``["skipped.no_subscriber"]`` (embedded hub, nobody listening: not built), ``["publish.failed"]``.
    """

    def __init__(
        self,
        get_config: Callable[[], Config],
        state: StateStore,
        blobs: BlobStore,
        *,
        hub_url: str,
        hub: Hub | None = None,
        client: httpx.AsyncClient | None = None,
        dumps_available: Callable[[str], dict[str, str]] | None = None,
        dump_versions: Callable[[str], dict[str, str]] | None = None,
        poll_interval: float = 1.0,
        framework_interval: float = 5.0,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        """``state``: a state handle of the notifier's own (closed by ``aclose``). ``hub``: the embedded
        hub (in-process publishing); else ``client`` pings ``hub_url``."""
        if hub is None and client is None:
            raise ValueError("an external hub needs an HTTP client to ping it")
        self.get_config = get_config
        self.state = state
        self.blobs = blobs
        self.hub_url = hub_url
        self.hub = hub
        self.client = client
        self.dumps_available = dumps_available
        #: capability -> version of a set's dumps (their URLs stay when they are rebuilt)
        self.dump_versions = dump_versions or (lambda set_name: {})
        self.poll_interval = poll_interval
        self.framework_interval = framework_interval
        self.counters: Counter[str] = Counter()
        self._clock = clock
        self._channels: dict[str, Channel] = {}
        self._set_names: set[str] = set()
        self._wake = trio.Event()
        self._policies: tuple[Config, Any, Any] | None = None
        self._last_framework = float("-inf")
        self._last_open_k: int | None = None
        self._store = StoreCalls(state)
        #: False on a cluster node that does not hold the publishing role (cluster.py, "@hub"): another
        #: node runs the rounds, so a topic answers with the channel as the state holds it now.
        self.publishing = True
        self._load()

    # -- plumbing --------------------------------------------------------------------------------

    def _load(self) -> None:
        for ch in self._store.call(self.state.notify_channels):
            self._channels[ch.topic] = ch

    def _stored(self, topic: str) -> Channel | None:
        """A channel as the state holds it (blocking): what another node's rounds last saved."""
        return next((ch for ch in self.state.notify_channels() if ch.topic == topic), None)

    def _save(self, channels: Sequence[Channel], drop: Sequence[Channel] = ()) -> None:
        self.state.put_notify_channels(channels, [ch.topic for ch in drop])

    def _state(self) -> StateStore:
        return self.state

    def _published(self, set_name: str) -> bool:
        """Whether ``set_name`` is published now (blocking)."""
        return set_name in published_sets(self.get_config(), self._state().sets())

    def _site(self, config: Config, state: StateStore) -> Site:
        """Our documents exactly as the app writes them (link policy, plugins' filter, extra entries)."""
        if self._policies is None or self._policies[0] is not config:
            plugins = Plugins.from_config(config)
            self._policies = (config, link_policy(config, plugins), publish_filter(plugins))
        _, policy, visible = self._policies
        return build_site(
            config,
            state,
            policy=policy,
            visible=visible,
            dumps_available=self.dumps_available or no_dumps,
            extra_capabilities=self.capabilities,
        )

    async def aclose(self) -> None:
        self._store.close()

    def wake(self) -> None:
        """Look at the changelog now (called after each harvest commit)."""
        self._wake.set()

    # -- what the app shows ----------------------------------------------------------------------

    def topic(self, set_name: str, kind: str) -> str:
        return topic_url(self.get_config().server.base_url, set_name, kind)

    def capabilities(self, set_name: str) -> list[Entry]:
        """The Capability List entries of a set's two channels (Framework Notification §5)."""
        return [
            Entry(self.topic(set_name, kind), md=Md(capability=kind), links=[Link("hub", self.hub_url)])
            for kind in (CHANGE_NOTIFICATION, FRAMEWORK_NOTIFICATION)
        ]

    def routes(self) -> list[Route]:
        return [
            Route(f"/{{set}}/{name}", self._topic_endpoint(kind), methods=["GET", "HEAD"])
            for kind, name in TOPICS.items()
        ]

    def _topic_endpoint(self, kind: str) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            set_name = request.path_params["set"]
            topic = self.topic(set_name, kind)
            ch = self._channels.get(topic) if self.publishing else await self._store.run(self._stored, topic)
            if ch is None and set_name not in self._set_names:
                # The Capability List naming this topic is a view of the state, which may be newer than
                # the last round: a published set's topic answers from the moment it is advertised.
                if not await self._store.run(self._published, set_name):
                    return PlainTextResponse("not found\n", status_code=404)
            base = self.get_config().server.base_url
            headers = {
                "Link": f'<{topic}>; rel="self", <{self.hub_url}>; rel="hub", '
                f'<{base}/{set_name}/capabilitylist.xml>; rel="resourcesync"',
                "Cache-Control": "no-cache",
            }
            body = ch.body if ch is not None else b""
            if request.method == "HEAD":
                headers["Content-Length"] = str(len(body))
                return Response(b"", media_type=XML, headers=headers)
            return Response(body, media_type=XML, headers=headers)

        return endpoint

    # -- the worker ------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish until cancelled: a round after each wake-up, at least every ``poll_interval``."""
        task_status.started()
        while True:
            self._wake = trio.Event()  # before reading: a commit during the round is not lost
            try:
                more = await self.round()
            except Exception:
                log.exception("notifier round failed; trying again")
                more = False
                await trio.sleep(self.poll_interval)
            if more:
                continue
            with trio.move_on_after(self.poll_interval):
                await self._wake.wait()

    async def round(self) -> bool:
        """One look at the changelog and the documents; returns True when more is waiting."""
        config = self.get_config()
        now_m = trio.current_time()
        framework_due = now_m - self._last_framework >= self.framework_interval
        plan = await self._store.run(self._plan, config, framework_due)
        if plan.framework_checked:
            self._last_framework = now_m
        self._set_names = plan.set_names
        for ch in plan.advanced:
            self._channels[ch.topic] = ch
        if plan.silent:
            await self._store.run(self._save, plan.silent)
            for ch in plan.silent:
                self._channels[ch.topic] = ch
        for p in plan.payloads:
            await self._send(config, p)
        if plan.dropped:
            await self._store.run(self._save, [], plan.dropped)
            for ch in plan.dropped:
                self._channels.pop(ch.topic, None)
        return plan.more

    async def _send(self, config: Config, p: _Payload) -> None:
        ch = p.channel
        new = Channel(ch.topic, ch.set_name, ch.kind, p.last_seq, p.until, p.body, p.snapshot or ch.snapshot)
        await self._store.run(self._save, [new])  # first the topic document (a pinged hub fetches it)
        self._channels[ch.topic] = new
        capabilitylist = f"{config.server.base_url}/{ch.set_name}/capabilitylist.xml"
        ok = await self._publish(ch.topic, p.body, capabilitylist)
        short = "change" if ch.kind == CHANGE_NOTIFICATION else "framework"
        if ok:
            self.counters[f"published.{short}"] += 1
            self.counters[f"entries.{short}"] += p.entries
        else:
            self.counters["publish.failed"] += 1

    async def _publish(self, topic: str, body: bytes, capabilitylist: str) -> bool:
        if self.hub is not None:
            await self.hub.publish(topic, body, XML, resourcesync=[capabilitylist])
            return True
        assert self.client is not None
        error = ""
        for attempt in range(PING_ATTEMPTS):
            wait: float | None = None
            try:
                with outbound.acting_for(outbound.NOTIFIER):  # the configured external hub, as configured
                    r = await self.client.post(self.hub_url, data={"hub.mode": "publish", "hub.topic": topic})
                if 200 <= r.status_code < 300:
                    return True
                error = f"status {r.status_code}: {r.text[:200]!r}"
                if not retryable_status(r.status_code):  # the same ping gets the same answer
                    break
                wait = retry_after(r.status_code, r.headers)
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
                if not transient_error(exc):
                    break
            if attempt + 1 < PING_ATTEMPTS:
                await trio.sleep(backoff(attempt, base=PING_BACKOFF, cap=PING_BACKOFF_MAX, retry_after=wait))
        log.warning(
            "notify: ping of %s for %s failed: %s (subscribers will poll)", self.hub_url, topic, error
        )
        return False

    # -- planning (blocking, in a worker thread) -------------------------------------------------

    def _plan(self, config: Config, framework_due: bool) -> _Plan:
        state = self._state()
        site = self._site(config, state)
        plan = _Plan()
        plan.set_names = set(site.sets)
        top = state.last_seq()
        open_k = top // site.changelist_size + 1
        if open_k != self._last_open_k or plan.set_names != self._set_names:
            framework_due, self._last_open_k = True, open_k
        now = self._clock()
        for ps in site.sets.values():
            self._plan_changes(config, state, site, ps, top, now, plan)
        if framework_due:
            plan.framework_checked = True
            for ps in site.sets.values():
                self._plan_framework(state, site, ps, now, plan)
            self._plan_dropped(site, now, plan)
        return plan

    def _subscribed(self, topic: str) -> bool:
        """False only when the embedded hub knows nobody listens (then no payload is built)."""
        if self.hub is None:
            return True
        now = self._clock()
        return any(s["lease_expires"] > now for s in self.hub.subscriptions(topic))

    def _plan_changes(
        self,
        config: Config,
        state: StateStore,
        site: Site,
        ps: PublishedSet,
        top: int,
        now: datetime,
        plan: _Plan,
    ) -> None:
        topic = topic_url(site.base_url, ps.name, CHANGE_NOTIFICATION)
        ch = self._channels.get(topic)
        if ch is None:  # a new channel starts at the end of the changelog (history is in the lists)
            plan.silent.append(
                Channel(topic, ps.name, CHANGE_NOTIFICATION, top, state.log_datetime(top) or now)
            )
            return
        if ch.last_seq >= top:
            return
        if not self._subscribed(topic):
            last = state.log_datetime(top)
            until = max(last, ch.last_until) if last and ch.last_until else (last or ch.last_until)
            plan.advanced.append(Channel(topic, ps.name, ch.kind, top, until, ch.body))
            self.counters["skipped.no_subscriber"] += 1
            return
        soft = config.notifications.max_entries
        hard = 2 * soft
        last_until, last_seq = ch.last_until, ch.last_seq
        chunk: list[tuple[LogRecord, Resource | None]] = []
        built = 0
        finished = True
        uri_of = UriOf(site, state, ps)
        for rec, row in state.iter_log_range(ps.set_ids, ch.last_seq, top):
            if chunk and len(chunk) >= soft and (rec.datetime != chunk[-1][0].datetime or len(chunk) >= hard):
                p = self._change_payload(site, ps, ch, chunk, last_until, chunk[-1][0].seq, uri_of)
                plan.payloads.append(p)
                last_until, last_seq, chunk = p.until, p.last_seq, []
                built += 1
                if built >= MAX_PAYLOADS_PER_ROUND:
                    finished, plan.more = False, True
                    break
            if site.shows(ps.name, row):
                chunk.append((rec, row))
        if chunk:
            seq = top if finished else chunk[-1][0].seq
            plan.payloads.append(self._change_payload(site, ps, ch, chunk, last_until, seq, uri_of))
        elif finished and last_seq < top:  # other sets' records, or hidden ones (plugins' filter)
            plan.advanced.append(Channel(topic, ps.name, ch.kind, top, last_until, ch.body))

    def _change_payload(
        self,
        site: Site,
        ps: PublishedSet,
        ch: Channel,
        chunk: list[tuple[LogRecord, Resource | None]],
        from_: datetime | None,
        last_seq: int,
        uri_of: UriOf,
    ) -> _Payload:
        until = chunk[-1][0].datetime
        if from_ is not None and until < from_:  # never: the changelog clock does not go back
            until = from_
        head = Head(
            md=Md(capability=CHANGE_NOTIFICATION, from_=from_ or chunk[0][0].datetime, until=until),
            links=[Link("up", site.capabilitylist(ps.name))],
        )
        entries = [change_entry(site, ps, rec, row, uri_of) for rec, row in chunk]
        body = b"".join(iter_document_bytes(head, entries))
        return _Payload(ch, body, last_seq, until, entries=len(entries))

    # -- framework notifications -----------------------------------------------------------------

    def _snapshot(self, state: StateStore, site: Site, ps: PublishedSet, now: datetime) -> Snapshot:
        """Every capability document of the set that Framework Notification §2.1 speaks of, versioned."""
        snap: Snapshot = {}
        sets = sorted((p.name, p.describedby or "") for p in site.sets.values())
        snap[site.well_known] = [DESCRIPTION, _digest(sets), None]
        _, entries = capability_list(site, ps)
        snap[site.capabilitylist(ps.name)] = [
            CAPABILITYLIST,
            _digest([(e.loc, e.capability) for e in entries]),
            None,
        ]
        ws = Windows(site, state, ps, now)
        if len(ws.listed) == 1:
            snap[site.changelist(ps.name)] = [CHANGELIST, "open", None]
        else:
            for k in ws.listed:
                version = "open" if k == ws.open_k else "closed"
                snap[site.changelist_window(ps.name, k)] = [CHANGELIST, version, site.changelist(ps.name)]
        versions = self.dump_versions(ps.name) if site.dumps_available(ps.name) else {}
        for capability, url in (site.dumps_available(ps.name) or {}).items():
            snap[url] = [capability, versions.get(capability, url), None]
        return snap

    def _plan_framework(
        self, state: StateStore, site: Site, ps: PublishedSet, now: datetime, plan: _Plan
    ) -> None:
        topic = topic_url(site.base_url, ps.name, FRAMEWORK_NOTIFICATION)
        ch = self._channels.get(topic)
        snap = self._snapshot(state, site, ps, now)
        if ch is None:  # nobody can have subscribed to a channel that did not exist: no notice
            plan.silent.append(Channel(topic, ps.name, FRAMEWORK_NOTIFICATION, 0, now, b"", snap))
            return
        entries = _differences(ch.snapshot, snap, now)
        if entries:
            plan.payloads.append(self._framework_payload(site, ps.name, ch, entries, now, snap))

    def _plan_dropped(self, site: Site, now: datetime, plan: _Plan) -> None:
        """Channels of sets no longer published: a last ``capabilitylist deleted``, then gone."""
        for ch in list(self._channels.values()):
            if ch.set_name in site.sets:
                continue
            plan.dropped.append(ch)
            if ch.kind == FRAMEWORK_NOTIFICATION:
                entry = Entry(
                    site.capabilitylist(ch.set_name),
                    md=Md(capability=CAPABILITYLIST, change=DELETED, datetime=now),
                )
                plan.payloads.append(self._framework_payload(site, ch.set_name, ch, [entry], now, {}))

    def _framework_payload(
        self, site: Site, set_name: str, ch: Channel, entries: list[Entry], now: datetime, snap: Snapshot
    ) -> _Payload:
        head = Head(
            md=Md(capability=FRAMEWORK_NOTIFICATION, from_=ch.last_until or now, until=now),
            links=[Link("up", site.capabilitylist(set_name))],
        )
        body = b"".join(iter_document_bytes(head, entries))
        return _Payload(ch, body, 0, now, snapshot=snap, entries=len(entries))


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _differences(old: Snapshot, new: Snapshot, now: datetime) -> list[Entry]:
    """Framework Notification §2.1: created / updated / deleted capability documents."""
    out: list[Entry] = []
    for url, (capability, version, index) in new.items():
        before = old.get(url)
        if before is not None and before[1] == version:
            continue
        change = CREATED if before is None else UPDATED
        links = [Link("index", index)] if index else []
        out.append(Entry(url, md=Md(capability=capability, change=change, datetime=now), links=links))
    for url, (capability, _version, _index) in old.items():
        if url not in new:
            out.append(Entry(url, md=Md(capability=capability, change=DELETED, datetime=now)))
    return out


__all__ = ["TOPICS", "Channel", "Notifier", "topic_url"]
