"""The one retry policy (net/retry.py) every retrying client uses: fetch, hub, subscriber, notifier."""

from __future__ import annotations

import httpx
import pytest
import trio

from aggregator.net import retry


def test_backoff_is_exponential_with_full_jitter_and_capped() -> None:
    for attempt, top in [(0, 0.5), (1, 1.0), (3, 4.0), (10, 60.0), (10_000, 60.0)]:
        draws = [retry.backoff(attempt, base=0.5, cap=60.0) for _ in range(400)]
        assert all(0.0 <= d <= top for d in draws), (attempt, max(draws))
        # full jitter: the draws cover the range from near 0 to near the top (not half fixed)
        assert min(draws) < top * 0.1 and max(draws) > top * 0.9, (attempt, min(draws), max(draws))


def test_retry_after_wins_and_is_capped() -> None:
    assert retry.backoff(0, base=0.5, cap=60.0, retry_after=7.0) == 7.0
    assert retry.backoff(5, base=0.5, cap=60.0, retry_after=3600.0) == 60.0
    assert retry.backoff(5, base=0.5, cap=60.0, retry_after=-3.0) == 0.0


def test_retryable_statuses() -> None:
    assert {s for s in range(100, 600) if retry.retryable_status(s)} == {408, 429, 500, 502, 503, 504}


def test_retry_after_is_read_only_for_a_retryable_status() -> None:
    headers = httpx.Headers({"Retry-After": "12"})
    assert retry.retry_after(503, headers) == 12.0
    assert retry.retry_after(429, headers) == 12.0
    assert retry.retry_after(404, headers) is None
    assert retry.retry_after(503, httpx.Headers()) is None


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (httpx.ConnectError("refused"), True),
        (httpx.ReadTimeout("slow"), True),
        (httpx.RemoteProtocolError("peer closed"), True),
        (trio.TooSlowError(), True),
        (httpx.UnsupportedProtocol("ftp"), False),
        (httpx.LocalProtocolError("bad header"), False),
        (ValueError("not HTTP"), False),
    ],
)
def test_transient_errors(exc: BaseException, transient: bool) -> None:
    assert retry.transient_error(exc) is transient
