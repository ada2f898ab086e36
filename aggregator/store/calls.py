"""Calling the state from the event loop: the one place that decides whether a call hops to a thread.

A backend that talks to a server (PostgreSQL: each call a network round trip, or a wait when the server
stalls) gives a ``limiter`` (a ``trio.CapacityLimiter`` sized to its connection pool): its calls run in
worker threads, never more at once than it has connections, so the event loop keeps serving while they
wait. SQLite gives none: its reads are a few microseconds on a local file, less than a thread hop costs
(``benchmarks/bench_publish.py``), so they stay direct as they always were.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import trio

T = TypeVar("T")


def limiter_of(state: object) -> trio.CapacityLimiter | None:
    """The backend's limiter; None: its calls are local and cheap, made directly."""
    return getattr(state, "limiter", None)


async def state_call(state: object, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (a method of ``state`` or a function taking it): directly for a local backend, in a
    worker thread under the backend's limiter for a remote one (not abandoned on cancel: a state call
    finishes or fails as a whole)."""
    limiter = limiter_of(state)
    if limiter is None:
        return fn(*args)
    return await trio.to_thread.run_sync(partial(fn, *args), limiter=limiter)
