"""Calling the state from the event loop: the one place that decides whether a call hops to a thread,
and the one way a state call runs in a worker thread (``in_thread``).

A backend that talks to a server (PostgreSQL: each call a network round trip, or a wait when the server
stalls) gives a ``limiter`` (a ``trio.CapacityLimiter`` sized to its connection pool): its calls run in
worker threads, never more at once than it has connections, so the event loop keeps serving while they
wait. SQLite gives none: its reads are a few microseconds on a local file, less than a thread hop costs
(``benchmarks/bench_publish.py``), so they stay direct as they always were.

Callers whose calls may wait on any backend (a write that queues behind another handle's transaction on
SQLite's one write lock, e.g. the WebSub components' ``websub/storecalls.py``) use ``in_thread`` with a
limiter of their own.
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


async def in_thread(fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter | None = None) -> T:
    """``fn(*args)`` in a worker thread under ``limiter`` (None: trio's default one), never abandoned on
    cancellation: a state call started finishes or fails as a whole (a write started is a write
    finished), and the cancelled caller waits for it."""
    return await trio.to_thread.run_sync(partial(fn, *args), limiter=limiter, abandon_on_cancel=False)


async def state_call(state: object, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (a method of ``state`` or a function taking it): directly for a local backend, in a
    worker thread under the backend's limiter for a remote one (``in_thread``)."""
    limiter = limiter_of(state)
    if limiter is None:
        return fn(*args)
    return await in_thread(fn, *args, limiter=limiter)
