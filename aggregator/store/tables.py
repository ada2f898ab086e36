"""A module's own tables in the state database, on a connection of its own.

Why: the WebSub hub, the notification publisher and the subscriber each keep a few tables next to the
harvester's (subscriptions, channels, deliveries) and write them from worker threads while the harvester
writes its own; each needs the same connection settings, one write transaction at a time
(``immediate_transaction``), one database call in flight, and a clean stop.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import trio

from .state import immediate_transaction

T = TypeVar("T")


class Closed(Exception):
    """A write after ``close``: the process is stopping, the tables keep what was saved before."""


class OwnTables:
    """One connection (WAL, ``synchronous=NORMAL``), the schema created, writes serialised under ``lock``."""

    def __init__(
        self,
        path: Path | str,
        schema: Iterable[str],
        *,
        busy_timeout: float = 30.0,
        foreign_keys: bool = False,
    ) -> None:
        #: Held around every use of ``conn`` (worker threads share it).
        self.lock = threading.RLock()
        self._closed = False
        self._limiter = trio.CapacityLimiter(1)
        self.conn = sqlite3.connect(
            str(path), timeout=busy_timeout, check_same_thread=False, isolation_level=None
        )
        self.conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = NORMAL")
        if foreign_keys:
            self.conn.execute("PRAGMA foreign_keys = ON")
        with self.write() as c:
            for statement in schema:
                c.execute(statement)

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; ``Closed`` once the tables are closed."""
        with self.lock:
            if self._closed:
                raise Closed
            with immediate_transaction(self.conn) as conn:
                yield conn

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, one at a time (a harvester transaction must not stall the loop);
        never abandoned on cancellation, so a write started is a write finished."""
        return await trio.to_thread.run_sync(
            lambda: fn(*args), limiter=self._limiter, abandon_on_cancel=False
        )

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self.conn.close()


__all__ = ["Closed", "OwnTables"]
