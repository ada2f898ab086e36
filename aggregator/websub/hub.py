"""rsagg's embedded WebSub hub: subscriptions, verification of intent, signed and retried delivery.

Follows the W3C WebSub Recommendation (2018; "WebSub §N" below) as the transport of ResourceSync Change
and Framework Notification (Notification 1.0 §4; spec/NOTES.md "Change Notification"):

- ``POST`` at the hub path, form-encoded (WebSub §5.1): ``hub.mode=subscribe|unsubscribe`` is answered
  202 at once and verified later (§5.1.2: the answer never depends on the verification); the worker
  GETs the callback with a random single-use ``hub.challenge`` (§5.3, §8) and only a 2xx whose body is
  exactly the challenge changes anything (§5.3.1), so a failed verification leaves the state as it was
  (§5.1). A topic this hub does not serve is refused by the validation step, ``hub.mode=denied`` (§5.2).
- Publishing, both ways (NOTES "Source -> hub"): ``hub.mode=publish`` with ``hub.topic`` (or the older
  ``hub.url``) makes the hub GET the topic and fan its body out (WebSub §6, generic); a ``POST`` of an
  XML payload whose ``Link`` header names the topic ``rel="self"`` fans that body out (Notification §4.1,
  ResourceSync). rsagg itself calls ``Hub.publish`` in-process.
- Delivery (WebSub §7): POST of the body with the topic's Content-Type and ``Link: <hub>; rel="hub",
  <topic>; rel="self"`` (plus the publisher's ``rel="resourcesync"``, Notification §4.3 Example 7),
  ``X-Hub-Signature: sha256=<hex HMAC>`` when the subscriber gave a secret (§7.1; SHA-256 as the floor
  §8 recommends). 2xx = delivered; 410 = subscription deleted; anything else is retried with
  rsagg's backoff (``retry.py``: exponential, full jitter, Retry-After honoured) until the lease ends
  (§7: the subscription stays active meanwhile).
  Deliveries to one callback go out in publication order (a later one waits for the earlier), since
  a ResourceSync Destination reads out-of-order notifications as a gap (NOTES "Payload").

Everything the worker does comes from the hub's tables in the state (``StateStore.hub_*``, migration 6
of store/state.py): pending verifications, subscriptions, payloads and deliveries survive a restart, and
there is no in-memory queue to grow. A delivery interrupted by a crash is sent again (at-least-once).
Bounds: concurrent jobs, per-request deadlines, payload size, pending deliveries per subscription (the
oldest are dropped, §7 "self-imposed limits"), pending verifications (503 when full).

Security (docs/security.md): a payload POST makes the hub sign and send whatever it is given to every
subscriber, so it needs ``Authorization: Bearer <publish_token>`` (refused when no token is configured);
the generic ping is harmless (the hub fetches the topic itself). Topics are limited by ``allowed_topic``
(the daemon's, ``channel_topics``: rsagg's own notification channels only; a hub relaying anything is
an open relay, and one fetching any URL under rsagg's base URL hands ``/metrics`` to anyone). A topic
fetch is the one request rsagg makes to its own URLs (``outbound.OWN_TOPICS``); a callback there is
refused.
Verification GETs and deliveries go wherever a subscriber points, so every request obeys the outbound
address policy (``policy``, outbound.py: no loopback, private, link-local... addresses, checked on the
address connected to), and a callback naming such an address literally is refused at once (403).
Abuse bounds (``HubLimits``): callback URL length; subscriptions in total and per callback host (active
plus waiting for verification); subscription requests per second, per callback host and in total (a
token bucket each); over a count or rate limit the answer is 429 with Retry-After. Secrets are kept in
the database as given: the hub needs them to sign.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import math
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import httpx
import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from .. import __version__
from ..net import outbound
from ..net.retry import backoff, retry_after
from ..rs.linkheader import links_with_rel
from ..rs.w3cdt import utcnow
from ..store.calls import StoreCalls
from ..store.interface import StateStore
from ..store.rows import HubDelivery, HubVerification

log = logging.getLogger("rsagg.hub")

#: ``metrics(event, outcome)``; the pairs sent:
#: ("verification", "subscribed" | "unsubscribed" | "failed" | "denied"),
#: ("delivery", "ok" | "retry" | "failed" | "gone" | "dropped"), ("subscription", "expired"),
#: ("publish", "accepted") once per payload queued for at least one subscriber.
MetricsHook = Callable[[str, str], None]
TopicPolicy = Callable[[str], bool]

FORM = "application/x-www-form-urlencoded"
MAX_FORM_BYTES = 64 * 1024
MAX_URL_CHARS = 4096
MAX_SECRET_BYTES = 200  # WebSub §5.1: hub.secret MUST be less than 200 bytes
MAX_TOPICS_PER_PING = 16
COUNTS_TTL = 10.0  # seconds between scans counting subscriptions per callback host
# Characters that would break a Link header or a request line; the rest is httpx's to check.
_BAD_URL_CHARS = re.compile(r'[\x00-\x20\x7f<>"\\]')


@dataclass(frozen=True)
class HubLimits:
    """Policy numbers (defaults for production; tests shrink the times)."""

    lease_default: int = 86_400  # seconds granted when the subscriber asks for none
    lease_min: int = 60
    lease_max: int = 864_000  # WebSub §8: "10 days is a good default"; we never grant more
    concurrency: int = 16  # verifications + deliveries in flight
    request_timeout: float = 10.0  # whole-request deadline for every hub request
    backoff_base: float = 5.0  # first retry within this (full jitter, retry.py); doubles each failure
    backoff_max: float = 3600.0
    max_payload_bytes: int = 4 * 1024 * 1024  # notifications are small: bursts are split (NOTES)
    max_pending_per_subscription: int = 1000  # older undelivered payloads are dropped beyond this
    max_pending_verifications: int = 10_000
    max_callback_chars: int = 2048  # a longer hub.callback is refused (400)
    max_subscriptions: int = 10_000  # active + waiting for verification; more: 429
    max_subscriptions_per_host: int = 100  # the same, per callback host
    requests_per_second: float = 20.0  # subscription requests (each costs a verification GET), in total
    requests_burst: int = 200
    host_requests_per_second: float = 1.0  # ... and per callback host
    host_requests_burst: int = 30
    max_topic_fetches: int = 4  # concurrent topic GETs for hub.mode=publish
    poll_interval: float = 60.0  # worker wakes at least this often (clock changes, other writers)


def topics_under(base_url: str) -> TopicPolicy:
    """A topic policy: URLs at or below ``base_url`` (same scheme and host, path prefix by segment)."""
    base = urlsplit(base_url.rstrip("/"))
    scheme, netloc, root = base.scheme.lower(), base.netloc.lower(), base.path

    def allowed(topic: str) -> bool:
        try:
            t = urlsplit(topic)
        except ValueError:
            return False
        path = t.path or "/"
        if t.scheme.lower() != scheme or t.netloc.lower() != netloc:
            return False
        if any(seg in (".", "..") for seg in path.split("/")):
            return False
        return path == root or path.startswith(root + "/")

    return allowed


def channel_topics(base_url: str, files: Sequence[str]) -> TopicPolicy:
    """A topic policy: the notification channels of ``base_url``, ``BASE/<set>/<file>`` for one of
    ``files`` (rsagg's own topics), and nothing else under it. Why not every URL under ``base_url``: a
    generic ping makes the hub GET the topic and POST it to every subscriber, so ``BASE/metrics`` or
    ``BASE/status.json`` as a topic would hand them to anyone, around the operator's access control."""
    under = topics_under(base_url)
    root = urlsplit(base_url.rstrip("/")).path
    names = frozenset(files)

    def allowed(topic: str) -> bool:
        if not under(topic):
            return False
        try:
            t = urlsplit(topic)
        except ValueError:
            return False
        if t.query or t.fragment or "%" in t.path:
            return False
        rest = t.path[len(root) :].split("/")
        return len(rest) == 3 and rest[0] == "" and bool(rest[1]) and rest[2] in names

    return allowed


def signature(secret: str, body: bytes) -> str:
    """The ``X-Hub-Signature`` value for ``body`` (WebSub §7.1, sha256)."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


class _Buckets:
    """Token buckets by key (``rate`` per second, up to ``burst``), for the hub's request rate limits.

    Bounded: at most ``max_keys`` keys. When full, the buckets that have refilled (idle keys) are
    forgotten (at most once a second: a scan); a new key that still finds no room waits like an empty
    bucket (a flood of distinct callback hosts cannot grow the table).
    """

    def __init__(self, rate: float, burst: int, max_keys: int = 10_000) -> None:
        self.rate, self.burst, self.max_keys = rate, max(1, burst), max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)
        self._swept = -float("inf")

    def take(self, key: str, now: float) -> float:
        """Take a token: 0 when there was one, else the seconds until there will be one."""
        refill = 1.0 / self.rate if self.rate > 0 else 3600.0
        if key not in self._buckets and len(self._buckets) >= self.max_keys:
            if now - self._swept >= 1.0:
                self._swept = now
                full = [k for k, (t, a) in self._buckets.items() if t + (now - a) * self.rate >= self.burst]
                for k in full:
                    del self._buckets[k]
            if len(self._buckets) >= self.max_keys:
                return refill
        tokens, at = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) * refill
        self._buckets[key] = (tokens - 1.0, now)
        return 0.0


def _too_many(message: str, wait: float) -> _Refusal:
    return _Refusal(429, message, {"Retry-After": str(max(1, math.ceil(wait)))})


def _callback_host(url: str | None) -> str | None:
    """The host of a callback URL (the per-host limits)."""
    try:
        return (urlsplit(url or "").hostname or "").lower() or None
    except ValueError:
        return None


class _Refusal(ValueError):
    """A request answered with an error status and a plain-text reason (WebSub §5.1.2)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass(slots=True)
class _Plan:
    verifications: list[HubVerification]
    deliveries: list[HubDelivery]
    next_due: datetime | None
    expired: int


def delivery_client(
    policy: outbound.AddressPolicy | None, limits: HubLimits | None = None
) -> Callable[[], httpx.AsyncClient]:
    """A factory of the hub's own HTTP client (verifications, deliveries, topic fetches), obeying
    ``policy`` and sized to ``limits``: what the composition hands a ``Hub`` as its ``client``."""
    lim = limits or HubLimits()

    def make() -> httpx.AsyncClient:
        n = lim.concurrency + lim.max_topic_fetches
        return outbound.client(
            policy,
            timeout=lim.request_timeout,
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
            headers={"User-Agent": f"rsagg/{__version__} (WebSub hub)"},
            follow_redirects=False,
        )

    return make


class Hub:
    """The embedded WebSub hub: ``routes()`` for the HTTP side, ``run()`` for the worker, ``publish()``.

    One instance per process; it owns ``state``, a state handle of its own (the harvester's writes and
    the publisher's reads go on alongside; its calls run in worker threads), closed by ``aclose``.
    """

    def __init__(
        self,
        state: StateStore,
        *,
        client: httpx.AsyncClient | Callable[[], httpx.AsyncClient],
        hub_url: str,
        allowed_topic: TopicPolicy,
        allowed_callback: TopicPolicy | None = None,
        publish_token: str | None = None,
        policy: outbound.AddressPolicy | None = None,
        path: str | None = None,
        limits: HubLimits | None = None,
        metrics: MetricsHook | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        """``client``: an httpx client to share (not closed here) or a factory (called on first use,
        closed by ``aclose``; ``delivery_client``). ``policy``: the outbound address
        policy (outbound.py); a callback naming a refused address literally is refused at once. ``path``:
        the route path, by default the path of ``hub_url`` (differs when a proxy adds a prefix)."""
        self.policy = policy
        self.hub_url = hub_url
        self.path = path or urlsplit(hub_url).path or "/"
        self.allowed_topic = allowed_topic
        self.allowed_callback = allowed_callback
        self.publish_token = publish_token
        self.limits = limits or HubLimits()
        self.metrics = metrics
        self._clock = clock
        if isinstance(client, httpx.AsyncClient):
            self._client: httpx.AsyncClient | None = client
            self._factory: Callable[[], httpx.AsyncClient] | None = None
        else:
            self._client = None
            self._factory = client
        self._owned: httpx.AsyncClient | None = None
        self._wake = trio.Event()
        self._busy_verifications: set[int] = set()
        self._busy_subscriptions: set[int] = set()
        self._fetch_limiter = trio.CapacityLimiter(self.limits.max_topic_fetches)
        self.state = state
        self._store = StoreCalls(state)
        self._counts: collections.Counter[str] = collections.Counter()  # see _check_counts
        self._counts_total = 0
        self._counts_at = -float("inf")
        lim = self.limits
        self._rate = _Buckets(lim.requests_per_second, lim.requests_burst, max_keys=1)
        self._host_rate = _Buckets(lim.host_requests_per_second, lim.host_requests_burst)

    # -- lifecycle -------------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            assert self._factory is not None
            self._client = self._owned = self._factory()
        return self._client

    async def aclose(self) -> None:
        """Close an own HTTP client and the state handle."""
        if self._owned is not None:
            await self._owned.aclose()
            self._owned = self._client = None
        self._store.close()

    async def __aenter__(self) -> Hub:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def wake(self) -> None:
        """Make the worker look at the tables now (new work, or a changed clock in tests)."""
        self._wake.set()

    # -- database plumbing -----------------------------------------------------------------------

    def _now(self) -> datetime:
        return self._clock()

    def _metric(self, event: str, outcome: str, n: int = 1) -> None:
        if self.metrics is None:
            return
        for _ in range(n):
            try:
                self.metrics(event, outcome)
            except Exception:
                log.exception("hub metrics hook failed")

    # -- reads (status, tests) -------------------------------------------------------------------

    def subscriptions(self, topic: str | None = None) -> list[dict[str, Any]]:
        """Active and not yet purged subscriptions (secrets are not returned, only whether one is set).

        Blocking (a quick read, but it may wait for the hub's lock): from async code, call it through
        ``trio.to_thread.run_sync``; so for ``pending``."""
        return [
            {
                "topic": s.topic, "callback": s.callback, "has_secret": s.secret is not None,
                "lease_seconds": s.lease_seconds, "lease_expires": s.lease_expires, "created": s.created,
                "verified": s.verified,
            }
            for s in self._store.call(self.state.hub_subscriptions, topic)
        ]  # fmt: skip

    def pending(self) -> dict[str, int]:
        """How much work waits: verifications and deliveries."""
        backlog = self._store.call(self.state.hub_backlog)
        return {"verifications": backlog.verifications, "deliveries": backlog.deliveries}

    # -- HTTP side -------------------------------------------------------------------------------

    def routes(self) -> list[Route]:
        """The hub URL: POST only (subscription requests, pings, payloads)."""
        return [Route(self.path, self.endpoint, methods=["POST"], name="websub-hub")]

    async def endpoint(self, request: Request) -> Response:
        """One POST at the hub URL, dispatched on its Content-Type and ``hub.mode``."""
        try:
            mime = request.headers.get("content-type", "").partition(";")[0].strip().lower()
            if mime == FORM:
                form = _parse_form(await _read_body(request, MAX_FORM_BYTES))
                mode = _one(form, "hub.mode")
                if mode in ("subscribe", "unsubscribe"):
                    return await self._subscription_request(mode, form)
                if mode == "publish":
                    return await self._ping(form)
                if mode is None:
                    raise _Refusal(400, "hub.mode is missing (subscribe, unsubscribe or publish)")
                raise _Refusal(400, f"hub.mode {mode!r} is not supported (subscribe, unsubscribe, publish)")
            if mime in ("application/xml", "text/xml") or mime.endswith("+xml"):
                return await self._payload(request, mime)
            raise _Refusal(
                415,
                f"Content-Type must be {FORM} (WebSub requests) or application/xml (a ResourceSync "
                f"notification payload), not {mime or 'none'!r}",
            )
        except _Refusal as r:
            return PlainTextResponse(r.message + "\n", status_code=r.status, headers=r.headers)

    async def _subscription_request(self, mode: str, form: dict[str, list[str]]) -> Response:
        """WebSub §5.1: check the request, queue its verification, answer 202 (§5.1.2)."""
        raw_callback = _one(form, "hub.callback")
        if raw_callback is not None and len(raw_callback) > self.limits.max_callback_chars:
            raise _Refusal(400, f"hub.callback is longer than {self.limits.max_callback_chars} characters")
        callback = _url(raw_callback, "hub.callback")
        topic = _url(_one(form, "hub.topic"), "hub.topic")
        if self.allowed_callback is not None and not self.allowed_callback(callback):
            raise _Refusal(403, f"hub.callback {callback} is refused by this hub's policy")
        rule = self.policy.literal_rule(callback) if self.policy is not None else None
        if self.policy is not None and rule is not None:
            host, port = outbound.origin(callback) or ("", 0)
            self.policy.refused(host, port, host, rule)  # logged and counted like a refused connection
            what = "it is rsagg's own URL" if rule == "self" else f"its address is {rule}"
            raise _Refusal(403, f"hub.callback {callback} is refused: {what} (outbound policy)")
        self._check_rate(callback)
        secret = _one(form, "hub.secret") or None  # an empty secret signs nothing: treated as none
        if secret is not None and len(secret.encode("utf-8")) >= MAX_SECRET_BYTES:
            raise _Refusal(400, f"hub.secret must be less than {MAX_SECRET_BYTES} bytes (WebSub §5.1)")
        lease: int | None = None
        reason: str | None = None
        if mode == "subscribe":  # §5.1: lease_seconds of an unsubscription MUST be ignored
            lease = self._grant_lease(_one(form, "hub.lease_seconds"))
            if not self.allowed_topic(topic):
                mode, secret = "denied", None
                reason = "this hub only serves topics of the aggregator that runs it"
        request = HubVerification(0, mode, topic, callback, secret, lease, reason)
        await self._store.run(self._queue_verification, request, self._now())
        self.wake()
        return PlainTextResponse("Accepted: the hub will verify this request with the callback.\n", 202)

    def _check_rate(self, callback: str) -> None:
        """Each subscription request costs a verification GET: bounded per callback host and in total."""
        now = trio.current_time()
        host = _callback_host(callback) or ""
        wait = self._host_rate.take(host, now)
        if wait:
            raise _too_many(f"too many subscription requests for callbacks at {host}; try later", wait)
        wait = self._rate.take("", now)
        if wait:
            raise _too_many("too many subscription requests; try later", wait)

    def _grant_lease(self, raw: str | None) -> int:
        """WebSub §5.1/§5.3.1: the hub decides; we clamp to [lease_min, lease_max], never perpetual."""
        lim = self.limits
        if raw is None or raw == "":
            return lim.lease_default
        if not raw.isascii() or not raw.isdigit() or not raw.strip("0"):
            raise _Refusal(400, f"hub.lease_seconds must be a positive decimal integer, not {raw[:40]!r}")
        if len(raw) > 18:  # far beyond any maximum (and int() refuses very long digit strings)
            return lim.lease_max
        return max(lim.lease_min, min(lim.lease_max, int(raw)))

    def _queue_verification(self, request: HubVerification, now: datetime) -> None:
        """Check the bounds and queue the request (in a worker thread: the hub's store calls run one at a
        time, so nothing of this hub comes between the check and the write)."""
        found = self.state.hub_request_state(request.topic, request.callback)
        if found.waiting >= self.limits.max_pending_verifications and not found.pending:
            raise _too_many("too many subscription requests waiting; try later", 60)
        counted = None
        if request.mode == "subscribe" and not found.pending and not found.subscribed:
            counted = self._check_counts(request.callback)
        # A newer request for the same (topic, callback) replaces the waiting one: the latest intent
        # is the one to verify (§5.1: each request overrides the previous state once verified).
        self.state.hub_queue_verification(request, now)
        if counted is not None:
            self._counts[counted] += 1
            self._counts_total += 1

    def _check_counts(self, callback: str) -> str:
        """A new subscription (neither active nor waiting) must fit the total and per-host limits;
        returns the callback host to count once it is queued.

        The counts per host come from a scan of both tables at most every ``COUNTS_TTL`` seconds (a scan
        of 10,000 rows per request would cost a flood's worth of CPU), plus every request queued since;
        what was deleted meanwhile is still counted until the next scan: never fewer than there are.
        """
        now = time.monotonic()  # a worker thread: no trio clock here
        if now - self._counts_at > COUNTS_TTL:
            callbacks = self.state.hub_subscriber_callbacks()
            self._counts = collections.Counter(_callback_host(cb) or "" for cb in callbacks)
            self._counts_total, self._counts_at = len(callbacks), now
        lim = self.limits
        if self._counts_total >= lim.max_subscriptions:
            raise _too_many(f"this hub holds its maximum of {lim.max_subscriptions} subscriptions", 3600)
        host = _callback_host(callback) or ""
        if self._counts[host] >= lim.max_subscriptions_per_host:
            raise _too_many(
                f"callbacks at {host} hold the maximum of {lim.max_subscriptions_per_host} subscriptions",
                3600,
            )
        return host

    async def _ping(self, form: dict[str, list[str]]) -> Response:
        """Generic WebSub publishing (§6): fetch each named topic, fan its body out."""
        topics = list(dict.fromkeys(form.get("hub.topic", []) + form.get("hub.url", [])))
        if not topics:
            raise _Refusal(400, "hub.mode=publish needs hub.topic (or hub.url) naming the updated topic")
        if len(topics) > MAX_TOPICS_PER_PING:
            raise _Refusal(400, f"at most {MAX_TOPICS_PER_PING} topics per publish request")
        for t in topics:
            _url(t, "hub.topic")
            if not self.allowed_topic(t):
                if self.policy is not None and self.policy.own_url(t):  # e.g. BASE/metrics: never fetched
                    host, port = outbound.origin(t) or ("", 0)
                    self.policy.refused(host, port, "", "self", f" ({t} is not one of rsagg's own topics)")
                raise _Refusal(403, f"topic {t} is not published through this hub")
        fetched = [await self._fetch_topic(t) for t in topics]
        queued = 0
        for t, (body, content_type, resourcesync) in zip(topics, fetched, strict=True):
            queued += await self.publish(t, body, content_type, resourcesync=resourcesync)
        return PlainTextResponse(f"Accepted: {queued} deliveries queued.\n", 202)

    async def _fetch_topic(self, topic: str) -> tuple[bytes, str, list[str]]:
        """GET the topic (no redirects, bounded size and time): body, Content-Type, resourcesync links."""
        lim = self.limits
        with trio.move_on_after(lim.request_timeout) as waiting:
            await self._fetch_limiter.acquire()
        if waiting.cancelled_caught:
            raise _Refusal(503, "the hub is busy fetching topics; try again", {"Retry-After": "5"})
        try:
            # One of rsagg's own topics (``allowed_topic`` checked it): the only request to its own URLs.
            with trio.fail_after(lim.request_timeout), outbound.acting_for(outbound.OWN_TOPICS):
                headers = {"Accept-Encoding": "identity"}
                async with self._http().stream("GET", topic, headers=headers, follow_redirects=False) as r:
                    if r.status_code != 200:
                        raise _Refusal(502, f"GET {topic} answered {r.status_code}, not 200")
                    body = await _read_capped(r, lim.max_payload_bytes)
                    if body is None:
                        raise _Refusal(502, f"GET {topic}: body over {lim.max_payload_bytes} bytes")
                    content_type = r.headers.get("content-type") or "application/octet-stream"
                    resourcesync = links_with_rel(r.headers.get("link"), "resourcesync", topic)
        except trio.TooSlowError:
            raise _Refusal(502, f"GET {topic} timed out after {lim.request_timeout} s") from None
        except httpx.HTTPError as exc:
            raise _Refusal(502, f"GET {topic} failed: {type(exc).__name__}: {exc}") from None
        finally:
            self._fetch_limiter.release()
        return body, content_type, resourcesync

    async def _payload(self, request: Request, content_type: str) -> Response:
        """ResourceSync publishing (Notification §4.1): the body is the payload, Link rel="self" the topic."""
        if self.publish_token is None:
            raise _Refusal(
                403,
                "publishing a payload to this hub is disabled (no publish token configured); "
                "ping it with hub.mode=publish&hub.topic=TOPIC instead",
            )
        auth = request.headers.get("authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {self.publish_token}".encode()):
            raise _Refusal(
                401, "a payload POST needs Authorization: Bearer <token>", {"WWW-Authenticate": "Bearer"}
            )
        link = ", ".join(request.headers.getlist("link"))
        base = str(request.url)
        selves = list(dict.fromkeys(links_with_rel(link, "self", base)))
        if len(selves) != 1:
            raise _Refusal(
                400, f'the Link header must name exactly one topic with rel="self" (found {len(selves)})'
            )
        topic = _url(selves[0], 'Link rel="self"')
        if not self.allowed_topic(topic):
            raise _Refusal(403, f"topic {topic} is not published through this hub")
        body = await _read_body(request, self.limits.max_payload_bytes)
        if not body:
            raise _Refusal(400, "the notification payload is empty")
        resourcesync = [u for u in links_with_rel(link, "resourcesync", base) if _valid_url(u)]
        queued = await self.publish(
            topic, body, request.headers.get("content-type", content_type), resourcesync=resourcesync
        )
        return PlainTextResponse(f"Accepted: {queued} deliveries queued.\n", 202)

    # -- publishing ------------------------------------------------------------------------------

    async def publish(
        self,
        topic: str,
        body: bytes,
        content_type: str = "application/xml",
        *,
        resourcesync: Sequence[str] = (),
    ) -> int:
        """Queue ``body`` for every active subscriber of ``topic``; returns how many deliveries.

        In-process publishing for rsagg's own notifications (not checked against ``allowed_topic``).
        ``resourcesync``: Capability List URLs sent as ``rel="resourcesync"`` (Notification §4.1).
        """
        _url(topic, "topic")
        links = [f'<{self.hub_url}>; rel="hub"', f'<{topic}>; rel="self"']
        links += [f'<{u}>; rel="resourcesync"' for u in resourcesync if _valid_url(u)]
        queued, dropped = await self._store.run(
            self.state.hub_queue_payload, topic, bytes(body), content_type, ", ".join(links), self._now(),
            self.limits.max_pending_per_subscription,
        )  # fmt: skip
        if queued:
            self._metric("publish", "accepted")
            self.wake()
        self._metric("delivery", "dropped", dropped)
        return queued

    # -- the worker ------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The background worker: verifications, deliveries, retries, lease expiry. Runs until cancelled.

        Each round reads what is due from the tables (at most ``concurrency`` jobs in flight), starts
        it, and sleeps until the next due time, a wake-up (new work, a job done) or ``poll_interval``.
        Cancelling it leaves unfinished work in the tables for the next start; call ``aclose`` only
        after it has returned.
        """
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                self._wake = trio.Event()  # before reading: a wake-up during the read is not lost
                now = self._now()
                free = self.limits.concurrency - len(self._busy_verifications) - len(self._busy_subscriptions)
                plan = await self._store.run(
                    self._plan, now, free, sorted(self._busy_verifications), sorted(self._busy_subscriptions)
                )
                self._metric("subscription", "expired", plan.expired)
                for v in plan.verifications:
                    self._busy_verifications.add(v.id)
                    nursery.start_soon(self._job, self._verify, v)
                for d in plan.deliveries:
                    self._busy_subscriptions.add(d.subscription_id)
                    nursery.start_soon(self._job, self._deliver, d)
                delay = self.limits.poll_interval
                if plan.next_due is not None:
                    delay = max(0.0, min(delay, (plan.next_due - now).total_seconds()))
                with trio.move_on_after(delay):
                    await self._wake.wait()

    def _plan(self, now: datetime, free: int, busy_v: list[int], busy_s: list[int]) -> _Plan:
        st = self.state
        expired = st.hub_expire(now)  # WebSub §5.3.1: hubs MUST enforce lease expirations
        next_due = st.hub_next_lease_end()
        if free <= 0:  # wait for a job to finish (it wakes us)
            return _Plan([], [], next_due, expired)
        verifications = st.hub_due_verifications(busy_v, free + 1)
        if len(verifications) > free:
            verifications, next_due = verifications[:free], now
        free -= len(verifications)
        deliveries: list[HubDelivery] = []
        if free > 0:
            deliveries = st.hub_due_deliveries(now, busy_s, free + 1)
            if len(deliveries) > free:
                deliveries, next_due = deliveries[:free], now
        due = st.hub_next_delivery_due(busy_s + [d.subscription_id for d in deliveries])
        if due is not None:
            next_due = due if next_due is None else min(next_due, due)
        return _Plan(verifications, deliveries, next_due, expired)

    async def _job(self, fn: Callable[[Any], Any], item: HubVerification | HubDelivery) -> None:
        try:
            await fn(item)
        except Exception:
            log.exception("hub: %s failed unexpectedly", item)
            await trio.sleep(1.0)  # a persistent failure (database?) must not spin the worker
        finally:
            if isinstance(item, HubVerification):
                self._busy_verifications.discard(item.id)
            else:
                self._busy_subscriptions.discard(item.subscription_id)
            self.wake()

    async def _verify(self, v: HubVerification) -> None:
        """WebSub §5.3 (verification of intent) or §5.2 (denial): one GET to the callback."""
        challenge = secrets.token_urlsafe(32)  # §8: random, single-use
        params = [("hub.mode", v.mode), ("hub.topic", v.topic)]
        if v.mode == "denied":
            params.append(("hub.reason", v.reason or "refused"))
        else:
            params.append(("hub.challenge", challenge))
            if v.mode == "subscribe":
                params.append(("hub.lease_seconds", str(v.lease_seconds)))
        started = self._now()  # §5.3: the lease runs from the time of the verification request
        ok, detail = False, ""
        try:
            with trio.fail_after(self.limits.request_timeout):
                headers = {"Accept-Encoding": "identity"}
                url = _with_query(v.callback, params)
                async with self._http().stream("GET", url, headers=headers, follow_redirects=False) as r:
                    detail = f"status {r.status_code}"
                    if v.mode != "denied" and 200 <= r.status_code < 300:  # §5.3.1: 3xx/4xx/5xx = failed
                        body = await _read_capped(r, len(challenge))
                        ok = body == challenge.encode("ascii")
                        detail += "" if ok else ", body is not the challenge"
        except trio.TooSlowError:
            detail = "timed out"
        except httpx.HTTPError as exc:
            detail = f"{type(exc).__name__}: {exc}"
        outcome = await self._store.run(
            self._verified, v, ok, started + timedelta(seconds=v.lease_seconds or 0)
        )
        if outcome is None:
            return  # replaced by a newer request for the same pair while we asked
        log.info("hub: %s %s for %s -> %s (%s)", v.mode, v.topic, v.callback, outcome, detail)
        self._metric("verification", outcome)

    def _verified(self, v: HubVerification, ok: bool, lease_expires: datetime) -> str | None:
        if v.mode == "denied":  # §5.2: denied at any point ends the subscription too
            outcome, subscribe = "denied", False
        elif not ok:  # §5.1: if verification fails, the subscription state MUST be left unchanged
            outcome, subscribe = "failed", None
        elif v.mode == "unsubscribe":
            outcome, subscribe = "unsubscribed", False
        else:
            outcome, subscribe = "subscribed", True
        if not self.state.hub_finish_verification(v, subscribe, lease_expires, self._now()):
            return None  # replaced by a newer request for the same pair
        return outcome

    async def _deliver(self, d: HubDelivery) -> None:
        """WebSub §7: POST the payload; the response body is ignored (never read)."""
        headers = {"Content-Type": d.content_type, "Link": d.link}
        if d.secret:
            headers["X-Hub-Signature"] = signature(d.secret, d.body)  # §7.1
        status: int | None = None
        wait: float | None = None
        error = ""
        try:
            with trio.fail_after(self.limits.request_timeout):
                async with self._http().stream(
                    "POST", d.callback, content=d.body, headers=headers, follow_redirects=False
                ) as r:
                    status = r.status_code
                    wait = retry_after(status, r.headers)
        except trio.TooSlowError:
            error = "timed out"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        if status is not None:
            error = f"status {status}"
        if status is not None and 200 <= status < 300:
            outcome = "ok"
        elif status == 410:  # §7: the subscription has been deleted
            outcome = "gone"
        else:
            outcome = "retry"
        # WebSub §7: every failure but 410 is retried (until the lease ends); only the delay is ours.
        delay = backoff(
            d.attempts, base=self.limits.backoff_base, cap=self.limits.backoff_max, retry_after=wait
        )
        retry_at = self._now() + timedelta(seconds=delay)
        outcome = await self._store.run(self.state.hub_finish_delivery, d, outcome, retry_at, error)
        if outcome != "ok":
            log.info("hub: delivery to %s (attempt %d): %s -> %s", d.callback, d.attempts + 1, error, outcome)
        self._metric("delivery", outcome)


# -- small helpers -------------------------------------------------------------------------------


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) beyond ``limit`` bytes before or while reading."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _Refusal(413, f"request body over {limit} bytes")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise _Refusal(413, f"request body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_capped(response: httpx.Response, limit: int) -> bytes | None:
    """A response body of at most ``limit`` bytes, or None (stops reading) when longer."""
    buf = bytearray()
    async for chunk in response.aiter_bytes():
        buf += chunk
        if len(buf) > limit:
            return None
    return bytes(buf)


def _parse_form(body: bytes) -> dict[str, list[str]]:
    """WebSub §5.1: UTF-8, form-encoded; unknown parameters are kept aside (and so ignored)."""
    try:
        text = body.decode("utf-8")
        pairs = parse_qsl(text, keep_blank_values=True, max_num_fields=100, errors="strict")
    except UnicodeDecodeError:
        raise _Refusal(400, "the form is not UTF-8 (WebSub §5.1)") from None
    except ValueError as exc:
        raise _Refusal(400, f"malformed form: {exc}") from None
    form: dict[str, list[str]] = {}
    for k, v in pairs:
        form.setdefault(k, []).append(v)
    return form


def _one(form: dict[str, list[str]], name: str) -> str | None:
    values = form.get(name, [])
    if len(values) > 1:
        raise _Refusal(400, f"{name} is given {len(values)} times")
    return values[0] if values else None


def _valid_url(value: str) -> bool:
    try:
        _url(value, "url")
    except _Refusal:
        return False
    return True


def _url(value: str | None, name: str) -> str:
    """An absolute http(s) URL fit for a request and a Link header, else a 400 naming the parameter."""
    if not value:
        raise _Refusal(400, f"{name} is missing")
    if len(value) > MAX_URL_CHARS:
        raise _Refusal(400, f"{name} is longer than {MAX_URL_CHARS} characters")
    if _BAD_URL_CHARS.search(value):
        raise _Refusal(400, f'{name} contains characters not allowed in a URL (space, control, <>"\\)')
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError on a bad port
        httpx.URL(value)
    except (ValueError, httpx.InvalidURL) as exc:
        raise _Refusal(400, f"{name} is not a valid URL: {exc}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise _Refusal(400, f"{name} must be an absolute http or https URL, not {value!r}")
    return value


def _with_query(url: str, params: list[tuple[str, str]]) -> str:
    """WebSub §5.1.1: keep the callback's own query, append ours with ``&`` (nothing is overwritten)."""
    base, _, _fragment = url.partition("#")
    sep = "" if base.endswith(("?", "&")) else ("&" if "?" in base else "?")
    return base + sep + urlencode(params)


__all__ = [
    "FORM",
    "Hub",
    "HubLimits",
    "MetricsHook",
    "channel_topics",
    "delivery_client",
    "signature",
    "topics_under",
]
