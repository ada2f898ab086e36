"""The one retry policy: which failures are worth another try, and how long to wait before it.

Used by every retrying client in rsagg: the harvester's fetches (``harvest/fetch.py``, an in-loop
retry), the hub's deliveries (``websub/hub.py``), subscription requests to upstream hubs
(``websub/subscriber.py``; both persist the next attempt in the state database) and the notifier's
pings of an external hub (``websub/notifier.py``). Each keeps its own bounds (``harvest.retries``,
``backoff_base``/``backoff_max``, ``HubLimits.backoff_*``, ``SubscriberSettings.retry_*``).

The formula is the one README documents for ``harvest.retries``: exponential backoff with full jitter
(a uniform draw in ``[0, min(cap, base * 2**attempt)]``, so clients that failed together do not retry
together), and a server's ``Retry-After`` (RFC 9110 §10.2.3) wins over it, bounded by the same cap.

Why not tenacity: only the fetcher retries in a loop; the hub and the subscriber store the time of the
next attempt in a table and their worker picks it up after a restart too, so what they need is the
delay, not a retrying wrapper — and these few lines are that delay.
"""

from __future__ import annotations

import email.utils
import random
from collections.abc import Mapping
from datetime import UTC, datetime

import httpx
import trio

from .outbound import refusal_of

#: Statuses worth another try: the server is busy or a gateway failed (RFC 9110 §15.5.9, §15.6, RFC 6585).
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

#: Attempts beyond this do not grow the delay further (it is long capped by then; avoids huge floats).
_MAX_DOUBLINGS = 60


def backoff(attempt: int, *, base: float, cap: float, retry_after: float | None = None) -> float:
    """Seconds to wait before retry number ``attempt + 1`` (``attempt`` 0: the first retry).

    Full jitter below ``min(cap, base * 2**attempt)``; a ``retry_after`` from the server is used
    instead, bounded by ``cap``.
    """
    if retry_after is not None:
        return min(cap, max(0.0, retry_after))
    return random.uniform(0, min(cap, base * 2 ** min(max(attempt, 0), _MAX_DOUBLINGS)))


def retryable_status(status: int) -> bool:
    """An HTTP status another try may cure (``RETRY_STATUSES``)."""
    return status in RETRY_STATUSES


def transient_error(exc: BaseException) -> bool:
    """A transport failure that may heal by itself: timeouts and network errors, but not a URL or
    protocol the client cannot use (the same request would fail the same way)."""
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL | httpx.LocalProtocolError):
        return False
    if refusal_of(exc) is not None:  # the outbound policy refuses the same address on every try
        return False
    return isinstance(exc, httpx.TransportError | trio.TooSlowError)


def retry_after_seconds(value: str | None, now: datetime | None = None) -> float | None:
    """``Retry-After`` as seconds from now: delta-seconds or an HTTP-date (RFC 9110 §10.2.3)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def retry_after(status: int, headers: Mapping[str, str]) -> float | None:
    """The server's ``Retry-After`` when it answered a retryable status, else None."""
    return retry_after_seconds(headers.get("retry-after")) if retryable_status(status) else None


__all__ = [
    "RETRY_STATUSES",
    "backoff",
    "retry_after",
    "retry_after_seconds",
    "retryable_status",
    "transient_error",
]
