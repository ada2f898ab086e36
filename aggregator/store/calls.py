"""Calling the state from the event loop: the one place that decides whether a call hops to a thread,
and the one way a state call runs in a worker thread (``in_thread``).

A backend that talks to a server (PostgreSQL: each call a network round trip, or a wait when the server
stalls) gives a ``limiter`` (a ``trio.CapacityLimiter`` sized to its connection pool): its calls run in
worker threads, never more at once than it has connections, so the event loop keeps serving while they
wait. SQLite gives none: its reads are a few microseconds on a local file, less than a thread hop costs
(``benchmarks/bench_publish.py``), so they stay direct as they always were.

A component that owns a state handle of its own (the WebSub hub, notifier and subscriber) calls it
through ``StoreCalls``: always in a worker thread, even on SQLite, because its calls are mostly writes,
and a write waits for SQLite's one write lock while another handle (the harvester's) commits; one call
at a time on every backend, because a call is often the component's own function doing several state
calls and updating the component's in-memory tables (the hub's ``_queue_verification``, the notifier's
``_plan``): serialised, no two of them interleave, and no call runs on a handle ``close`` is closing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import trio

if TYPE_CHECKING:
    from .interface import StateStore

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


class Closed(Exception):
    """A call after ``close``: the process is stopping, the state keeps what was saved before."""


class StoreCalls:
    """``run(fn, *args)`` / ``call(fn, *args)``: ``fn(*args)`` on ``state``, serialised, until ``close``."""

    def __init__(self, state: StateStore) -> None:
        self.state = state
        self._lock = threading.RLock()
        self._closed = False
        self._limiter = trio.CapacityLimiter(1)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Blocking: from async code use ``run``."""
        with self._lock:
            if self._closed:
                raise Closed
            return fn(*args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await in_thread(self.call, fn, *args, limiter=self._limiter)

    def close(self) -> None:
        """Refuse further calls and close the state handle (the component owned it)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.state.close()


__all__ = ["Closed", "StoreCalls", "in_thread", "limiter_of", "state_call"]
