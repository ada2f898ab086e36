"""The state as a WebSub component uses it: one store call at a time, in a worker thread, until closed.

Why: the hub, the notifier and the subscriber each own a state handle of their own (the composition opens
one per component, so their writes never queue behind a harvest batch on the harvester's handle) and call
it from the trio loop; a state call blocks, so it runs in a worker thread (``store/calls.py``'s
``in_thread``: never abandoned on cancellation, a write started is a write finished), and refused once
the component closed.

Why always a thread, even on SQLite where ``state_call`` calls directly: these are mostly writes, and a
write waits for SQLite's one write lock while another handle (the harvester's) commits. Why one at a
time, on every backend: a call is often a component's own function doing several state calls and
updating the component's in-memory tables (e.g. the hub's ``_queue_verification``, the notifier's
``_plan``); serialised, no two of them interleave, and no call runs on a handle ``close`` is closing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from ..store.calls import in_thread
from ..store.interface import StateStore

T = TypeVar("T")


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


__all__ = ["Closed", "StoreCalls"]
