"""How many syncs of one host's Sources run at once: a few more than its request slots, the others wait.

Why: all of a host's Sources started at once (a ``rsagg harvest --once`` of 300 small Sources, a daemon
just started) share the host's few request slots (``harvest.per_host``) anyway, but each of them had its
documents parsed, its entries queued and its fetched content waiting for a commit, all at the same
time: a harvest of 300 Sources of 20 resources held 1.6 times the memory of one Source of 6,000, and the
garbage collector walked all of it again and again (benchmarks/bench_many_sources.py,
docs/benchmarks.md "Many sources"). Admitted a few at a time, the host's slots stay as busy and each
Source finishes sooner, with what it holds.

The rules:

- a sync is admitted at once while fewer than ``most`` syncs of its host (the host of the Source's
  ``url``, as the Fetcher's per-host slots count them) are admitted; else it waits its turn (first come,
  first served);
- a sync counts against its host for ``LEASE`` seconds at most: a long one (a big baseline, a slow
  upstream) then leaves its place to the next, so no Source waits on another's long sync for more than
  that (it only shares the host's slots with it, as it did before);
- Sources on different hosts never wait on each other; a URL without a host is never held back.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:  # trio loads with the harvest, not with this module (harvest/context.py imports it)
    import trio

#: Seconds a sync counts against its host's admissions: after that, it runs on uncounted and the next
#: waiting sync of the host is admitted.
LEASE = 10.0
#: Syncs admitted per request slot of the host (``Fetcher.host_limit``): two, so that the slots stay
#: busy while some of the admitted syncs read a document or wait for their commit.
PER_SLOT = 2


class _Ticket:
    """One admitted (or waiting) sync."""

    __slots__ = ("admitted_at", "wake")

    def __init__(self) -> None:
        import trio

        self.admitted_at: float | None = None
        self.wake: trio.Event = trio.Event()


class _Host:
    __slots__ = ("held", "timer", "waiting")

    def __init__(self) -> None:
        #: Admitted syncs still counted (admitted less than ``LEASE`` ago), oldest first.
        self.held: dict[_Ticket, None] = {}
        self.waiting: deque[_Ticket] = deque()
        #: The one waiting sync that wakes when the oldest admitted sync's lease ends (the others wait
        #: for their turn only): one timer per host, not one per waiting sync.
        self.timer: _Ticket | None = None


class Admissions:
    """The admissions of one harvest's syncs, per host (see the module docstring)."""

    def __init__(self, lease: float = LEASE) -> None:
        self.lease = lease
        self._hosts: dict[str, _Host] = {}
        #: Syncs running now, of every host, counted against it or not (``HarvestContext``'s writes
        #: wait for each other only while more than one runs).
        self.running = 0

    def held(self, url: str) -> int:
        """Syncs of ``url``'s host counted now (tests)."""
        h = self._hosts.get(_host(url))
        return len(h.held) if h is not None else 0

    def waiting(self, url: str) -> int:
        """Syncs of ``url``'s host waiting for their turn (tests)."""
        h = self._hosts.get(_host(url))
        return len(h.waiting) if h is not None else 0

    def syncs_of(self, host: str) -> int:
        """Syncs of ``host`` (lower case) admitted and counted now: they share its request slots
        (``pipeline.Pipeline._host_free`` starts no more fetch tasks than a sync's share)."""
        h = self._hosts.get(host)
        return len(h.held) if h is not None else 0

    @asynccontextmanager
    async def admitted(self, url: str, slots: Callable[[str], int]) -> AsyncIterator[None]:
        """``async with``: the sync of a Source at ``url`` runs inside, once admitted. ``slots(host)``:
        the host's request slots (``Fetcher.host_limit``); ``PER_SLOT`` syncs are admitted per slot."""
        host = _host(url)
        if not host:
            self.running += 1
            try:
                yield
            finally:
                self.running -= 1
            return
        most = PER_SLOT * max(1, slots(host))
        h = self._hosts.get(host)
        if h is None:
            h = self._hosts[host] = _Host()
        ticket = _Ticket()
        self._expire(h)
        if not h.waiting and len(h.held) < most:
            self._admit(h, ticket)
        else:
            await self._wait(h, ticket, most)
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            h.held.pop(ticket, None)
            self._admit_waiting(h, most)
            if not h.held and not h.waiting and self._hosts.get(host) is h:  # (a sync that ran on
                del self._hosts[host]  # past its lease may leave after its host's entry was renewed)

    async def _wait(self, h: _Host, ticket: _Ticket, most: int) -> None:
        """Wait for ``ticket``'s turn. One waiting sync of the host (``_Host.timer``) also watches the
        oldest admitted sync's lease and, when it ends, hands the places on; when it leaves the queue
        (admitted or cancelled), the last waiting sync takes the watch over (it waits the longest).
        Why one: a timed wait (a cancel scope) for each of 300 waiting Sources of a host was most of
        what waiting cost them, and they all woke at once when a lease ended."""
        import trio

        h.waiting.append(ticket)
        if h.timer is None:
            h.timer = ticket
        try:
            while ticket.admitted_at is None:
                if h.timer is ticket:
                    # Until a place is handed on, or the oldest admitted sync's lease ends (then it
                    # leaves its place: the places go to the waiting syncs in turn).
                    oldest = next(iter(h.held), None)
                    now = trio.current_time()
                    at = oldest.admitted_at if oldest is not None else None  # (0.0 is a time: a test clock)
                    deadline = at + self.lease if at is not None else now
                    with trio.move_on_at(deadline):
                        await ticket.wake.wait()
                else:
                    await ticket.wake.wait()
                if ticket.admitted_at is None and ticket.wake.is_set():  # woken to take the watch
                    ticket.wake = trio.Event()
                self._expire(h)
                self._admit_waiting(h, most)
        except BaseException:
            if ticket.admitted_at is None:
                h.waiting.remove(ticket)
            else:  # admitted as it was cancelled: its place goes to the next
                h.held.pop(ticket, None)
                self._admit_waiting(h, most)
            raise
        finally:
            if h.timer is ticket:
                h.timer = None
                self._hand_watch(h)

    @staticmethod
    def _hand_watch(h: _Host) -> None:
        """The watch of the leases goes to the last waiting sync, woken to take it (if it was admitted
        meanwhile, it hands it on again as it leaves ``_wait``)."""
        if h.waiting:
            h.timer = h.waiting[-1]
            h.timer.wake.set()

    def _admit(self, h: _Host, ticket: _Ticket) -> None:
        import trio

        ticket.admitted_at = trio.current_time()
        h.held[ticket] = None
        ticket.wake.set()

    def _admit_waiting(self, h: _Host, most: int) -> None:
        while h.waiting and len(h.held) < most:
            self._admit(h, h.waiting.popleft())

    def _expire(self, h: _Host) -> None:
        """Syncs admitted ``lease`` seconds ago or more no longer count (they run on)."""
        if not h.held:
            return
        import trio

        now = trio.current_time()
        for t in list(h.held):  # the sum as ``_wait`` computes its deadline: the same float
            if t.admitted_at is not None and t.admitted_at + self.lease <= now:
                del h.held[t]
            else:
                break  # oldest first: the rest are younger


@functools.lru_cache(maxsize=4096)  # a pure function of the text: each sync of a Source asks it again
def _host(url: str) -> str:
    try:
        return (urlsplit(url).hostname or "").lower()
    except ValueError:
        return ""
