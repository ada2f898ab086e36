"""rsagg as a WebSub subscriber of its upstreams' notification channels (Change/Framework Notification).

Why: polling a Change List every few minutes costs latency; a notification says "this changed" within
milliseconds. Polling stays — the Change List is the truth — but only as a safety net.

Channels are found by discovery: a Capability List entry with ``capability="change-notification"`` or
``"framework-notification"`` whose ``loc`` is the topic and whose ``rs:ln rel="hub"`` names the hub
(Framework Notification §5; spec/NOTES.md). For each, rsagg subscribes (WebSub §5.1) with:

- a callback on its own server, ``BASE/_websub/<token>``: ``token`` is random (256 bits) per
  subscription, so a callback cannot be guessed, and set names (``[a-z0-9]...``) never collide;
- its own ``hub.secret`` (WebSub §7.1), and the lease of ``[notifications] lease_seconds``.

Verification of intent (WebSub §5.3) is strict: the challenge is echoed only when the token names a
subscription with a pending request of ours in exactly that ``hub.mode`` for exactly that
``hub.topic``; anything else gets 404. The request is marked pending *before* it is sent, since a hub
may verify before it answers the request (flask-websub does). ``hub.mode=denied`` (§5.2) ends a pending
request. Leases are renewed at ``renew_fraction`` of their length; a channel that disappears from the
Capability List, a source that is removed, disabled or has notifications turned off is unsubscribed
(and forgotten if the hub never verifies that; deliveries to a forgotten callback get 410, which makes
the hub drop it, WebSub §7).

Delivery (WebSub §7): answered 202 at once — never after applying anything. Before that the handler
checks, cheaply: a known callback (else 410), size (``max_payload_bytes``), ``X-Hub-Signature`` with
``sha256``, ``sha384`` or ``sha512`` (``sha1`` only with ``accept_sha1``; WebSub §8 recommends
SHA-256 or better): unsigned or forged deliveries are dropped (still 202, §7.1 lets the subscriber
acknowledge; nothing tells a forger what failed); then the payload goes through the hardened parser
(``rs.parse``: no DTD, no entities, byte cap) and must be a ``<urlset>`` of the channel's capability,
with ``from`` and ``until`` for change notifications. A parse problem asks for a poll. The parsed
notice goes into the source's bounded inbox (a full inbox drops it and asks for a poll).

The source's task (``run_source``, started by ``poll_source`` for followed sources) owns everything
that changes the store: it syncs (discovery + Change List, exactly as without notifications) at start,
on demand and every ``notified_interval`` while every set's change channel is live (else the normal
``interval``), and between syncs takes notices from its inbox:

- change notification: continuity first (NOTES "Payload"): its ``from`` must be the ``until`` of the
  previous one taken on that channel. A first notice, a gap or a notice that cannot be placed on the
  cursor makes it poll the Change List instead (which holds the same changes); an old or repeated one
  (``until`` not after the last) is dropped. Otherwise its entries go to the harvest
  (``Harvester.apply_notice``, harvest/notices.py), which places them on the set's cursor and takes those
  not yet applied through the one pipeline (docs/architecture.md invariant 1), exactly like Change List
  entries; a notice it cannot place makes the source poll.
- framework notification: a capability document changed: sync at once (the sync re-reads the
  Capability List, then the Change List, or the Resource List of a set without one).

The subscriber drives harvests through the ``Harvester`` it is given (harvest/notices.py's
``NotifiedHarvest``), without knowing how they are done.

State: the subscriptions (``StateStore.notify_subscriptions``, migration 8), through a state handle of
the subscriber's own, mirrored in memory (one process owns them). Counters: ``Subscriber.counters``
(keys listed at ``COUNTERS``).

On a cluster node (``[cluster] enabled``, ``Subscriber.shared``) a hub may call back any node, so the
memory is only a cache: a callback reads its subscription from the shared state, a verification is
answered from it, a signed and parsed delivery goes to the shared inbox (``add_notify_notice``,
migration 10: bounded, deduplicated) instead of the in-memory one. The source's task, which runs on the
node holding the source's lease and under its fence, reads its subscriptions back and maintains them
(``_follow_shared``, every ``inbox_poll``: requests, renewals, retries — fenced, so a node that lost the
lease renews nothing, and a new holder takes the subscriptions over), and hands the inbox's notices to the
same ``_take`` as above (docs/cluster.md, "How it holds together"). Whether a source is still
followed is not the holder's call there (a rolling change reaches the nodes one at a time): the node
holding the "@orphans" role unsubscribes the channels of the sources no live node follows
(``sweep_orphans``; each heartbeat says what its node follows, store/nodes.py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import random
import secrets
from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar
from urllib.parse import urljoin

import httpx
import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from ..config import Config, SourceConfig
from ..net import outbound
from ..net.retry import backoff, retry_after
from ..rs.model import CHANGE_NOTIFICATION, FRAMEWORK_NOTIFICATION, URLSET, Entry, Head
from ..rs.parse import DocumentError, parse_bytes
from ..rs.w3cdt import utcnow
from ..store.calls import Closed, StoreCalls
from ..store.interface import LeaseLost, StateStore
from ..store.nodes import followed_by_live, follows
from ..store.rows import NotifySubscription, format_dt

log = logging.getLogger("rsagg.subscriber")
T = TypeVar("T")

KINDS = (CHANGE_NOTIFICATION, FRAMEWORK_NOTIFICATION)
CALLBACK_PREFIX = "/_websub/"
FORM = "application/x-www-form-urlencoded"
#: X-Hub-Signature methods (WebSub §7.1) -> hashlib name; sha1 only when configured.
STRONG_SIGNATURES = {"sha256": hashlib.sha256, "sha384": hashlib.sha384, "sha512": hashlib.sha512}

#: Every counter key, for the metrics issue (``Subscriber.counters[key]``).
COUNTERS = (
    "subscribe.requested",  # subscription requests (first ones and renewals) accepted by a hub
    "subscribe.failed",  # requests a hub refused or did not verify in time
    "renewals",  # of those, renewals of a live lease
    "unsubscribe.requested",
    "verify.subscribed",  # verifications answered with the challenge
    "verify.unsubscribed",
    "verify.denied",  # hub.mode=denied for a pending request
    "verify.refused",  # 404: unknown callback, no pending request in that mode, other topic
    "delivery.accepted",  # queued for the source's task
    "delivery.unknown_callback",  # 410
    "delivery.unsigned",  # dropped
    "delivery.bad_signature",  # dropped (wrong, unknown or weak method)
    "delivery.too_large",  # 413
    "delivery.parse_error",  # dropped, poll asked for
    "delivery.overflow",  # inbox full: dropped, poll asked for
    "delivery.duplicate",  # in a cluster: the same delivery is in the shared inbox already
    "notice.applied",  # change notifications taken through the pipeline
    "notice.duplicate",  # until not after the last one taken
    "notice.known",  # every entry was applied already (by a poll): nothing to do
    "notice.gap",  # first notice or from != previous until: polled instead
    "notice.unplaceable",  # entries without time, out of order, or tied at from: polled instead
    "notice.framework",  # framework notifications (each makes a sync)
    "changes.applied",  # changes logged from notifications
    "poll",  # syncs run by subscriber tasks (start, fallback, safety net)
)


@dataclass(frozen=True)
class SubscriberSettings:
    """Timing and size knobs (defaults for production; tests shrink the times)."""

    tick: float = 5.0  # the maintenance task looks at subscriptions at least this often
    verify_timeout: float = 120.0  # a request not verified by then has failed
    # Every failure is retried (the wish to follow stands) with rsagg's backoff (retry.py).
    retry_base: float = 10.0  # first retry of a failed request within this; doubles each failure
    retry_max: float = 3600.0
    renew_fraction: float = 0.75  # renew a lease when this fraction of it is over
    unsubscribe_attempts: int = 3  # then the subscription is forgotten (deliveries get 410)
    inbox_size: int = 64  # notices waiting per source (bounded: docs/architecture.md invariant 4)
    max_payload_bytes: int = 8 * 1024 * 1024
    request_timeout: float = 10.0
    #: A channel that goes live gets a catch-up poll this much later: a hub records a subscription
    #: only after our answer to its verification, and what it published meanwhile never reaches us.
    settle: float = 1.0
    #: In a cluster: how often a source's holder looks at the shared inbox and its subscriptions.
    inbox_poll: float = 0.5


#: One channel of one set of one source: the working copy of what the state keeps
#: (``StateStore.notify_subscriptions``).
Subscription = NotifySubscription


@dataclass
class Notice:
    """A verified, parsed delivery on its way to the source's task."""

    sub: Subscription
    head: Head
    entries: list[Entry]


class _Nudge:
    """Wakes a source's task to recompute its poll deadline (a subscription became live or lapsed)."""


@dataclass
class _Inbox:
    send: trio.MemorySendChannel
    recv: trio.MemoryReceiveChannel
    poll_wanted: bool = False
    poll_at: float | None = None  # trio time of a catch-up poll
    busy: bool = False  # a sync or a notice is being worked on


class Channel(Protocol):
    """A capability a discovered set advertises (harvest/discovery.py ``Capability``)."""

    @property
    def url(self) -> str: ...

    @property
    def entry(self) -> Entry: ...


class AdvertisedSet(Protocol):
    """A set a sync discovered, with what its Capability List advertises (harvest/discovery.py
    ``SetInfo``): the notification channels are ``capabilities[kind]`` with ``rel="hub"`` links."""

    @property
    def capabilitylist_url(self) -> str: ...

    @property
    def capabilities(self) -> Mapping[str, Channel]: ...


class Harvester(Protocol):
    """What the subscriber asks of the harvest (harvest/notices.py ``NotifiedHarvest``)."""

    async def sync(self, src: SourceConfig) -> Sequence[AdvertisedSet]:
        """One sync of the source; the sets it discovered."""
        ...

    async def apply_notice(
        self,
        src: SourceConfig,
        capabilitylist_url: str,
        topic: str,
        from_: datetime,
        entries: Sequence[Entry],
    ) -> tuple[int, int] | None:
        """A change notice's entries applied on the set's cursor: (entries taken, changes logged); None
        when they cannot be placed or applied (then the source is polled)."""
        ...


class Subscriber:
    """Subscriptions, callback routes (``routes()``), maintenance (``run()``) and source tasks."""

    def __init__(
        self,
        get_config: Callable[[], Config],
        state: StateStore,
        harvester: Harvester,
        *,
        client: httpx.AsyncClient,
        settings: SubscriberSettings | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        """``get_config``: the running configuration (a reload's is followed); ``state``: a state handle
        of the subscriber's own, closed by ``aclose``; ``harvester``: runs the syncs and applies notices."""
        self.get_config = get_config
        self.harvester = harvester
        self.client = client
        self.settings = settings or SubscriberSettings()
        self.counters: Counter[str] = Counter()
        self._clock = clock
        self._subs: dict[str, Subscription] = {}  # token -> subscription
        self._inboxes: dict[str, _Inbox] = {}
        self._discovered: dict[str, list[str]] = {}  # source -> capability list URLs of its last sync
        self._wake = trio.Event()
        self.state = state
        self._store = StoreCalls(state)
        for sub in self._store.call(state.notify_subscriptions):
            self._subs[sub.token] = sub

    # -- plumbing --------------------------------------------------------------------------------

    async def _db(self, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return await self._store.run(fn, *args)
        except Closed:  # a task still finishing while the process stops
            return None

    async def _save(self, *subs: Subscription) -> None:
        await self._db(self.state.put_notify_subscriptions, subs)

    async def aclose(self) -> None:
        self._store.close()

    def _now(self) -> datetime:
        return self._clock()

    def wake(self) -> None:
        self._wake.set()

    @property
    def shared(self) -> bool:
        """A cluster node (``[cluster] enabled``): the subscriptions and the inbox live in the shared state,
        any node answers the callbacks, the holder of a source's lease does the rest (``_follow_shared``)."""
        return self.get_config().cluster.enabled

    async def _refresh(self, source: str | None = None) -> None:
        """The subscriptions (of ``source``) as the shared state has them now: another node may have
        answered a verification, or held the source before. A channel that went live here gets the
        catch-up poll its verification would have scheduled."""
        rows = await self._db(self.state.notify_subscriptions)
        if rows is None:
            return
        now = self._now()
        fresh = {s.token: s for s in rows if source is None or s.source == source}
        for token, old in list(self._subs.items()):
            if (source is None or old.source == source) and token not in fresh:
                del self._subs[token]
        for token, sub in fresh.items():
            prev = self._subs.get(token)
            if prev is not None and not prev.live(now) and sub.live(now) and sub.kind == CHANGE_NOTIFICATION:
                self._box(sub.source).poll_at = trio.current_time() + self.settings.settle
                self._nudge(sub.source)
            self._subs[token] = sub

    async def _lookup(self, token: str) -> Subscription | None:
        """The subscription a callback names; on a cluster node as the shared state has it now."""
        if self.shared:
            rows = await self._db(self.state.notify_subscriptions, token)
            if rows is None:
                return None
            if not rows:
                self._subs.pop(token, None)
                return None
            self._subs[token] = rows[0]
        return self._subs.get(token)

    # -- reads (status, tests) -------------------------------------------------------------------

    def subscriptions(self, source: str | None = None) -> list[Subscription]:
        """Copies of the subscriptions (of one source), oldest first."""
        subs = sorted(self._subs.values(), key=lambda s: s.id)
        return [replace(s) for s in subs if source is None or s.source == source]

    def idle(self, source: str) -> bool:
        """Nothing to do for this source right now: no sync or notice in progress, no catch-up poll
        due, no notice waiting (for status displays and tests)."""
        box = self._box(source)
        stats = box.recv.statistics()
        return not box.busy and box.poll_at is None and not box.poll_wanted and stats.current_buffer_used == 0

    def follows(self, src: SourceConfig) -> bool:
        """Whether this source's channels are followed (``[notifications]`` and the source's switch)."""
        return self.get_config().notifications_on(src)

    def callback_url(self, sub: Subscription) -> str:
        return f"{self.get_config().server.base_url}{CALLBACK_PREFIX}{sub.token}"

    # -- subscribing -----------------------------------------------------------------------------

    async def ensure(self, src: SourceConfig, sets: Sequence[AdvertisedSet]) -> None:
        """Subscribe to the channels these sets advertise; retire subscriptions they no longer do."""
        self._discovered[src.name] = [s.capabilitylist_url for s in sets]
        wanted: dict[tuple[str, str], tuple[str, str]] = {}  # (capability list, kind) -> (topic, hub)
        for info in sets:
            for kind in KINDS:
                cap = info.capabilities.get(kind)
                hubs = cap.entry.links_by_rel("hub") if cap is not None else []
                if cap is not None and hubs:
                    wanted[(info.capabilitylist_url, kind)] = (cap.url, urljoin(cap.url, hubs[0].href))
                elif cap is not None:
                    log.warning(
                        "source=%s %s %s advertises no rel=hub: not followed", src.name, kind, cap.url
                    )
        have = {
            (s.capabilitylist_url, s.kind): s
            for s in self._subs.values()
            if s.source == src.name and s.wanted
        }
        for key, sub in have.items():
            if wanted.get(key) != (sub.topic, sub.hub):
                await self._retire(
                    sub, "no longer advertised" if key not in wanted else "topic or hub changed"
                )
        for key, (topic, hub) in wanted.items():
            current = have.get(key)
            if current is not None and (current.topic, current.hub) == (topic, hub):
                continue
            # Stored as pending already: on a cluster node, the holder's ``_follow_shared`` may read the
            # row back before ``_request`` marks it, and must not take it for one to request itself.
            sub = Subscription(
                0, secrets.token_urlsafe(32), secrets.token_hex(32), src.name, key[0], key[1], topic, hub,
                pending="subscribe", requested=self._now(),
            )  # fmt: skip
            sub.id = await self._db(self.state.add_notify_subscription, sub) or 0
            self._subs[sub.token] = sub
            log.info("source=%s subscribing to %s %s at hub %s", src.name, key[1], topic, hub)
            await self._request(sub, "subscribe")
        self.wake()

    async def _retire(self, sub: Subscription, why: str) -> None:
        log.info("source=%s %s %s: unsubscribing (%s)", sub.source, sub.kind, sub.topic, why)
        sub.wanted = False
        sub.failures = 0
        await self._request(sub, "unsubscribe")

    async def _request(self, sub: Subscription, mode: str) -> None:
        """WebSub §5.1: POST the (un)subscription request. Pending is set first: the verification may
        come before the hub answers the POST."""
        now = self._now()
        renewal = mode == "subscribe" and sub.live(now)
        sub.pending, sub.requested, sub.next_attempt = mode, now, None
        await self._save(sub)
        form = {"hub.mode": mode, "hub.topic": sub.topic, "hub.callback": self.callback_url(sub)}
        if mode == "subscribe":
            form["hub.secret"] = sub.secret
            form["hub.lease_seconds"] = str(self.get_config().notifications.lease_seconds)
        error = ""
        wait: float | None = None
        try:
            # For this source: a hub on its own origin is trusted as the source is, nothing else is
            # (a hostile source naming another source's origin as its hub gets no form posted there).
            with trio.fail_after(self.settings.request_timeout), outbound.acting_for(sub.source):
                r = await self.client.post(sub.hub, data=form)
            if 200 <= r.status_code < 300:
                self.counters[f"{mode}.requested"] += 1
                self.counters["renewals"] += renewal
                return
            error = f"hub answered {r.status_code}: {r.text[:200]!r}"
            wait = retry_after(r.status_code, r.headers)
        except trio.TooSlowError:
            error = "hub did not answer in time"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        if sub.pending == mode:  # not verified meanwhile
            await self._failed(sub, error, wait)

    async def _failed(self, sub: Subscription, why: str, wait: float | None = None) -> None:
        s = self.settings
        sub.pending = None
        sub.failures += 1
        if not sub.wanted and sub.failures >= s.unsubscribe_attempts:
            log.warning(
                "%s %s: unsubscribe failed %d times (%s); forgotten", sub.kind, sub.topic, sub.failures, why
            )
            await self._forget(sub)
            return
        delay = backoff(sub.failures - 1, base=s.retry_base, cap=s.retry_max, retry_after=wait)
        sub.next_attempt = self._now() + timedelta(seconds=delay)
        self.counters["subscribe.failed"] += sub.wanted
        what = "subscription to" if sub.wanted else "unsubscription from"
        log.warning(
            "source=%s %s %s at %s failed (%s); again in %.0f s",
            sub.source,
            what,
            sub.topic,
            sub.hub,
            why,
            delay,
        )
        await self._save(sub)

    async def _forget(self, sub: Subscription) -> None:
        self._subs.pop(sub.token, None)
        await self._db(self.state.delete_notify_subscription, sub.id)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Maintenance until cancelled: renewals, retries, time-outs, sources that went away."""
        task_status.started()
        while True:
            self._wake = trio.Event()
            try:
                delay = await self.maintain()
            except Exception:
                log.exception("subscriber maintenance failed; trying again")
                delay = self.settings.tick
            with trio.move_on_after(delay):
                await self._wake.wait()

    async def maintain(self) -> float:
        """One look at every subscription; returns the seconds until the next thing is due."""
        s = self.settings
        if self.shared:  # each source's holder maintains its subscriptions (``_follow_shared``)
            return s.tick
        return await self._maintain(list(self._subs.values()), set(follows(self.get_config())))

    async def _maintain(self, subs: list[Subscription], followed: Container[str] | None) -> float:
        """``followed``: the sources whose subscriptions stay (the others' are retired); None: all of them
        (a cluster's holder: whether a source is still followed is the "@orphans" role's call)."""
        s = self.settings
        now = self._now()
        due = now + timedelta(seconds=s.tick)
        for sub in subs:
            if sub.wanted and followed is not None and sub.source not in followed:
                await self._retire(sub, "source removed, disabled or not followed")
                continue
            if sub.pending is not None:
                assert sub.requested is not None
                timeout = sub.requested + timedelta(seconds=s.verify_timeout)
                if now >= timeout:
                    await self._failed(sub, "the hub did not verify the request in time")
                else:
                    due = min(due, timeout)
                continue
            if not sub.wanted:
                if sub.next_attempt is None or now >= sub.next_attempt:
                    await self._request(sub, "unsubscribe")
                else:
                    due = min(due, sub.next_attempt)
                continue
            if sub.lease_expires is not None and sub.verified is not None and sub.lease_seconds:
                renew_at = sub.verified + timedelta(seconds=sub.lease_seconds * s.renew_fraction)
                if sub.next_attempt is not None:  # a renewal failed: retry on its schedule
                    renew_at = max(renew_at, sub.next_attempt)
                if now >= renew_at:
                    if now >= sub.lease_expires:
                        self._nudge(sub.source)  # lapsed: the source polls at its normal pace again
                    await self._request(sub, "subscribe")
                else:
                    due = min(due, renew_at)
                continue
            if sub.next_attempt is None or now >= sub.next_attempt:
                await self._request(sub, "subscribe")
            else:
                due = min(due, sub.next_attempt)
        return max(0.0, (due - self._now()).total_seconds())

    # -- the callback ----------------------------------------------------------------------------

    def routes(self) -> list[Route]:
        return [
            Route(CALLBACK_PREFIX + "{token}", self.verify, methods=["GET"]),
            Route(CALLBACK_PREFIX + "{token}", self.deliver, methods=["POST"]),
        ]

    async def verify(self, request: Request) -> Response:
        """WebSub §5.3 verification of intent, §5.2 denial: only for a pending request of ours."""
        sub = await self._lookup(request.path_params["token"])
        q = request.query_params
        mode, topic = q.get("hub.mode"), q.get("hub.topic")
        if sub is None or topic != sub.topic or mode is None:
            return self._refuse(sub, mode, topic, "no such subscription")
        if mode == "denied":
            if sub.pending != "subscribe" and not sub.live(self._now()):
                return self._refuse(sub, mode, topic, "nothing to deny")
            self.counters["verify.denied"] += 1
            sub.lease_expires = None
            await self._failed(sub, f"denied by the hub: {q.get('hub.reason', '')[:200]!r}")
            self._nudge(sub.source)
            return PlainTextResponse("ok")
        challenge = q.get("hub.challenge")
        if mode != sub.pending or not challenge:
            return self._refuse(sub, mode, topic, f"no pending {mode} request")
        now = self._now()
        was_live = sub.live(now)
        if mode == "unsubscribe":
            self.counters["verify.unsubscribed"] += 1
            await self._forget(sub)
            log.info("source=%s unsubscribed from %s %s", sub.source, sub.kind, sub.topic)
            return PlainTextResponse(challenge)
        raw = q.get("hub.lease_seconds", "")
        lease = int(raw) if raw.isascii() and raw.isdigit() and 0 < int(raw) < 10**9 else None
        lease = lease or self.get_config().notifications.lease_seconds
        sub.pending, sub.failures, sub.next_attempt = None, 0, None
        sub.lease_seconds, sub.verified = lease, now
        sub.lease_expires = now + timedelta(seconds=lease)
        # The catch-up poll is due from the moment the channel is live (the save below waits on a worker
        # thread, and whoever sees the live channel meanwhile must also see the poll it calls for).
        if not was_live and sub.kind == CHANGE_NOTIFICATION:
            self._box(sub.source).poll_at = trio.current_time() + self.settings.settle
        await self._save(sub)
        self.counters["verify.subscribed"] += 1
        log.info("source=%s subscribed to %s %s (lease %d s)", sub.source, sub.kind, sub.topic, lease)
        self._nudge(sub.source)
        self.wake()
        return PlainTextResponse(challenge)

    def _refuse(self, sub: Subscription | None, mode: str | None, topic: str | None, why: str) -> Response:
        self.counters["verify.refused"] += 1
        log.warning("verification refused (%s): mode=%r topic=%r", why, mode, topic)
        return PlainTextResponse("not found\n", status_code=404)

    async def deliver(self, request: Request) -> Response:
        """WebSub §7 content distribution: checks, then the source's inbox; 202 at once."""
        sub = await self._lookup(request.path_params["token"])
        if sub is None or not sub.wanted:
            self.counters["delivery.unknown_callback"] += 1
            return PlainTextResponse("gone\n", status_code=410)  # §7: the hub drops the subscription
        body = await _read_capped(request, self.settings.max_payload_bytes)
        if body is None:
            self.counters["delivery.too_large"] += 1
            return PlainTextResponse("payload too large\n", status_code=413)
        problem = self._signature_problem(sub, request.headers.get("x-hub-signature"), body)
        if problem is not None:
            self.counters[problem] += 1
            log.warning("source=%s delivery on %s dropped: %s", sub.source, sub.topic, problem)
            return PlainTextResponse("accepted\n", status_code=202)  # §7.1: acknowledge, ignore locally
        try:
            notice = self._parse(sub, body)
        except DocumentError as exc:
            self.counters["delivery.parse_error"] += 1
            log.warning(
                "source=%s notification on %s unusable (%s): polling instead", sub.source, sub.topic, exc
            )
            if self.shared:
                await self._db(self.state.add_notify_notice, sub.source, "", b"", self.settings.inbox_size)
            else:
                self._poll_wanted(sub.source)
            return PlainTextResponse("accepted\n", status_code=202)
        if self.shared:  # the holder of the source's lease takes it from the shared inbox
            done = await self._db(self._put_shared, sub, body)
            self.counters[{"added": "delivery.accepted", "duplicate": "delivery.duplicate"}.get(
                done or "", "delivery.overflow")] += 1  # fmt: skip
            return PlainTextResponse("accepted\n", status_code=202)
        box = self._box(sub.source)
        try:
            box.send.send_nowait(notice)
            self.counters["delivery.accepted"] += 1
        except trio.WouldBlock:
            self.counters["delivery.overflow"] += 1
            self._poll_wanted(sub.source)
        return PlainTextResponse("accepted\n", status_code=202)

    def _put_shared(self, sub: Subscription, body: bytes) -> str:
        return self.state.add_notify_notice(sub.source, sub.token, body, limit=self.settings.inbox_size)

    def _signature_problem(self, sub: Subscription, header: str | None, body: bytes) -> str | None:
        if not header:
            return "delivery.unsigned"
        method, _, digest = header.strip().partition("=")
        method = method.strip().lower()
        algos: dict[str, Any] = dict(STRONG_SIGNATURES)
        if self.get_config().notifications.accept_sha1:
            algos["sha1"] = hashlib.sha1
        if method not in algos:
            return "delivery.bad_signature"
        expected = hmac.new(sub.secret.encode("utf-8"), body, algos[method]).hexdigest()
        if not hmac.compare_digest(expected, digest.strip().lower()):
            return "delivery.bad_signature"
        return None

    def _parse(self, sub: Subscription, body: bytes) -> Notice:
        """The hardened parser, on this (the event loop's) thread: lxml parsers must not hop threads."""

        def problem(line: int | None, message: str) -> None:
            log.warning("notification %s line %s: %s (value ignored)", sub.topic, line, message)

        head, entries = parse_bytes(
            body, sub.topic, max_bytes=self.settings.max_payload_bytes, on_problem=problem, require=True
        )
        md = head.md
        if head.root != URLSET or head.capability != sub.kind:
            raise DocumentError(sub.topic, head.line, f"not a <urlset> with capability {sub.kind!r}")
        if sub.kind == CHANGE_NOTIFICATION and (md is None or md.from_ is None or md.until is None):
            raise DocumentError(sub.topic, head.line, "a change notification needs from and until")
        return Notice(sub, head, entries)  # relative <loc> are resolved against the topic when applied

    # -- the source's task -----------------------------------------------------------------------

    def _box(self, source: str) -> _Inbox:
        box = self._inboxes.get(source)
        if box is None:
            send, recv = trio.open_memory_channel[Notice | _Nudge](self.settings.inbox_size)
            box = self._inboxes[source] = _Inbox(send, recv)
        return box

    def _poll_wanted(self, source: str) -> None:
        box = self._box(source)
        box.poll_wanted = True
        self._nudge(source)

    def _nudge(self, source: str) -> None:
        try:
            self._box(source).send.send_nowait(_Nudge())
        except trio.WouldBlock:
            pass  # the task has plenty to wake it

    def interval(self, src: SourceConfig) -> float:
        """``notified_interval`` while every set of the source has a live change channel, else
        the normal ``interval``."""
        now = self._now()
        config = self.get_config()
        sets = self._discovered.get(src.name) or []
        live = {
            s.capabilitylist_url
            for s in self._subs.values()
            if s.source == src.name and s.kind == CHANGE_NOTIFICATION and s.live(now)
        }
        if sets and all(url in live for url in sets):
            return config.notified_interval(src)
        return config.interval(src)

    async def run_source(self, src: SourceConfig) -> None:
        """A followed source's task: syncs and notices, one at a time, until cancelled. On a cluster node
        (which runs it under the source's lease) a second task feeds it from the shared state."""
        if not self.shared:
            await self._run_source(src)
            return
        await self._refresh(src.name)  # what the previous holder subscribed to is ours now
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow_shared, src)
            await self._run_source(src)

    async def _follow_shared(self, src: SourceConfig) -> None:
        """The holder's side of a cluster: every ``inbox_poll`` the source's subscriptions are read back
        from the state and maintained (renewals, retries, time-outs: written under this task's fence,
        so a node that lost the lease writes nothing, and a task cancelled with its lease renews nothing),
        and the notices waiting in the shared inbox go to the source's task in arrival order. A notice
        is deleted once handed over: one lost with a crashing node leaves a gap the next notice shows
        (``from`` after the last ``until``), which polls the Change List."""
        while True:
            try:
                await self._refresh(src.name)
                await self._maintain([s for s in self._subs.values() if s.source == src.name], None)
                await self._take_shared(src)
            except (trio.Cancelled, LeaseLost):
                raise
            except Exception as exc:  # the state out of reach for a moment: look again; the poll is the net
                log.error("source=%s shared inbox: %s: %s", src.name, type(exc).__name__, exc)
            await trio.sleep(self.settings.inbox_poll)

    async def run_orphans(self) -> None:
        """The "@orphans" role of a cluster (compose.py ``Assembly.roles``): one node at a time, under the
        role's fence, looks every ``tick`` for subscriptions no holder will ever maintain again and ends
        them (``sweep_orphans``)."""
        while True:
            try:
                await self.sweep_orphans()
            except (trio.Cancelled, LeaseLost):
                raise
            except Exception as exc:  # the state out of reach for a moment: look again
                log.error("orphaned subscriptions: %s: %s", type(exc).__name__, exc)
            await trio.sleep(self.settings.tick)

    async def sweep_orphans(self) -> list[str]:
        """In a cluster, the sources no live node follows any more (removed from every node's configuration,
        disabled, notifications off: each node's heartbeat names what it follows, cluster.py) have no
        holder following them, so nobody would unsubscribe their channels: this does, as a single process
        does for a source that went away (retire, retry, forget after ``unsubscribe_attempts``), and empties
        their shared inbox. A source some live node still follows (a rolling change that has not reached
        it) is left to its holder. Returns the orphaned sources that had subscriptions."""
        nodes = await self._db(self.state.nodes)
        followed = None if nodes is None else followed_by_live(nodes, self._now())
        rows = None if followed is None else await self._db(self.state.notify_subscriptions)
        if followed is None or rows is None:
            return []
        orphans = sorted({r.source for r in rows} - followed)
        fresh = {r.token: r for r in rows if r.source in orphans}
        for token, old in list(self._subs.items()):
            if old.source in orphans and token not in fresh:
                del self._subs[token]
        self._subs.update(fresh)
        await self._maintain([self._subs[t] for t in fresh if t in self._subs], followed)
        for source in orphans:  # nobody takes what is waiting for them
            waiting = await self._db(self.state.notify_notices, source, self.settings.inbox_size) or []
            if waiting:
                await self._db(self.state.delete_notify_notices, [n.id for n in waiting])
        return orphans

    async def _take_shared(self, src: SourceConfig) -> None:
        box = self._box(src.name)
        rows = await self._db(self.state.notify_notices, src.name, self.settings.inbox_size) or []
        for row in rows:
            sub = self._subs.get(row.token)
            if not row.token:  # a delivery some node could not record or use
                self._poll_wanted(src.name)
                continue
            if sub is None or not sub.wanted:
                continue
            try:
                notice = self._parse(sub, row.body)
            except DocumentError:
                self._poll_wanted(src.name)
                continue
            await box.send.send(notice)
        if rows:
            await self._db(self.state.delete_notify_notices, [r.id for r in rows])

    async def _run_source(self, src: SourceConfig) -> None:
        box = self._box(src.name)
        jitter = self.get_config().harvest.jitter
        why: str | None = "start"
        last = trio.current_time()
        factor = 1.0
        while True:
            if why is not None or box.poll_wanted:
                started = trio.current_time()
                box.poll_wanted, box.busy = False, True
                await self._sync(src, why or "unusable notification")
                last, factor, why = trio.current_time(), 1 + random.uniform(-jitter, jitter), None
                if box.poll_at is not None and started >= box.poll_at:
                    box.poll_at = None  # that sync was the catch-up
            box.busy = False
            deadline = last + self.interval(src) * factor
            if box.poll_at is not None:
                deadline = min(deadline, box.poll_at)
            with trio.move_on_at(deadline) as waiting:
                item = await box.recv.receive()
            box.busy = True
            if waiting.cancelled_caught:
                why = "catch-up" if box.poll_at is not None and box.poll_at <= deadline else "interval"
                box.poll_at = None
                continue
            if isinstance(item, Notice):
                try:
                    if await self._take(src, item):
                        why = "notification"
                except (trio.Cancelled, LeaseLost):  # a cluster node lost the source: its task ends
                    raise
                except Exception:  # never take the daemon down: the Change List has the same changes
                    log.exception(
                        "source=%s notification on %s failed; polling instead", src.name, item.sub.topic
                    )
                    why = "failed notification"

    async def _sync(self, src: SourceConfig, why: str) -> None:
        self.counters["poll"] += 1
        log.info("source=%s syncing (%s)", src.name, why)
        discovered = await self.harvester.sync(src)
        if discovered:
            try:
                await self.ensure(src, discovered)
            except LeaseLost:
                raise
            except Exception:
                log.exception("source=%s could not update its subscriptions", src.name)

    async def _take(self, src: SourceConfig, notice: Notice) -> bool:
        """Apply one notice; True when the source must be polled instead (see the module docstring)."""
        sub = self._subs.get(notice.sub.token) if self.shared else notice.sub
        if sub is None or not sub.wanted or sub.token not in self._subs:
            return False
        if sub.kind == FRAMEWORK_NOTIFICATION:
            self.counters["notice.framework"] += 1
            log.info("source=%s framework notification on %s: syncing now", src.name, sub.topic)
            return True
        md = notice.head.md
        assert md is not None and md.from_ is not None and md.until is not None
        if sub.last_until is not None and md.until <= sub.last_until:
            self.counters["notice.duplicate"] += 1
            return False
        continuous = sub.last_until is not None and md.from_ == sub.last_until
        if not continuous:
            self.counters["notice.gap"] += 1
            if sub.last_until is None:  # the first notification since subscribing: nothing to continue
                log.info("source=%s %s: first notification (from %s): polling the Change List",
                         src.name, sub.topic, format_dt(md.from_))  # fmt: skip
            else:
                log.info(
                    "source=%s %s: notification from %s does not continue the last one (until %s): "
                    "polling the Change List",
                    src.name, sub.topic, format_dt(md.from_), format_dt(sub.last_until),
                )  # fmt: skip
            await self._until(sub, md.until)
            return True
        placed = await self._apply(src, sub, notice)
        await self._until(sub, md.until)
        if not placed:
            self.counters["notice.unplaceable"] += 1
        return not placed

    async def _until(self, sub: Subscription, until: datetime) -> None:
        sub.last_until = until
        await self._save(sub)

    async def _apply(self, src: SourceConfig, sub: Subscription, notice: Notice) -> bool:
        """The notice's entries through the harvest on the set's cursor; False when they cannot be
        placed on it (then the caller polls)."""
        md = notice.head.md
        assert md is not None and md.from_ is not None
        done = await self.harvester.apply_notice(
            src, sub.capabilitylist_url, sub.topic, md.from_, notice.entries
        )
        if done is None:
            return False
        taken, logged = done
        if not taken:
            self.counters["notice.known"] += 1
            return True
        self.counters["notice.applied"] += 1
        self.counters["changes.applied"] += logged
        return True


async def _read_capped(request: Request, limit: int) -> bytes | None:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


__all__ = [
    "CALLBACK_PREFIX",
    "COUNTERS",
    "AdvertisedSet",
    "Harvester",
    "Notice",
    "Subscriber",
    "SubscriberSettings",
    "Subscription",
]
