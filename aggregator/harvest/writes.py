"""State writes from many tasks, taken together by the one writer thread: shared hops, and on SQLite
shared transactions (group commit).

Why: a harvest of many small Sources made, for each Source, a few writes of its own (a set opened, a
batch with its baseline's end and status), each a thread hop, a transaction and, for the blobs it names,
a ``small.db`` commit with its ``fsync``. Those fixed costs were most of what a small Source cost more
than its resources (benchmarks/bench_many_sources.py, docs/benchmarks.md "Many sources"). Here:

- the writes asked while a hop runs go together in the next hop, each still its own call with its own
  result or error, in the order they were asked for, each in its caller's context (its fence, its
  source in the logs);
- where the state can join writes in one transaction (SQLite's ``together``), a hop's writes are one
  transaction, each write in a savepoint of its own: a write that raises is undone alone and its caller
  gets its error, the others commit. A transaction that fails to commit fails every write in it (none
  is written, each caller hears so). A caller hears of success only after the commit: what it was told
  is durable is durable (docs/architecture.md invariant 2 holds per write, as before);
- the blobs the hop's writes name (those a ``small.db`` transaction stores, ``AfterBlobs``) are
  committed first, together: one ``small.db`` transaction and ``fsync`` for the hop. Should that fail,
  each write commits its own blobs, and fails alone if they fail;
- while other syncs run, the write that would make the next hop first waits for more to join it: until
  ``enough()`` writes wait (itself included), at most ``gather()`` seconds. That wait costs the write
  that much time and no CPU; alone (one Source syncing, a one-shot write) a write goes at once. Why
  both: writes come fast at full speed (a hop fills in a few milliseconds, and need not wait longer)
  and slowly when the upstream is slow (Sources' writes tens of milliseconds apart: a short wait
  gathered none, and each write was a transaction and a ``small.db`` ``fsync`` of its own).

A waiting write whose caller is cancelled before a hop takes it is dropped (nothing of it ran); once
taken it runs to its end and its caller waits for it.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager, suppress
from functools import partial, update_wrapper
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:  # trio loads with the harvest (harvest/context.py imports this module: its docstring)
    import trio

    from ..store.blobs import BlobWriter

T = TypeVar("T")
log = logging.getLogger("rsagg.harvest")


@runtime_checkable
class Gathering(Protocol):
    """A state that joins writes in one transaction (``store.state.State``)."""

    def together(self, *, fence: bool = True) -> AbstractContextManager[None]: ...

    def savepoint(self) -> AbstractContextManager[None]: ...


class AfterBlobs(Generic[T]):
    """A write that commits ``writers`` (one ``small.db`` transaction, ``FileBlobStore.commits_inline``)
    and then runs ``fn(*args, **kwargs)``, in one thread hop: the blobs durable before the state that
    names them (docs/architecture.md invariant 2). Named as ``fn`` (logs; tests that count the writes)."""

    def __init__(
        self,
        writers: Sequence[BlobWriter],
        commit: Callable[[Sequence[BlobWriter]], None],
        fn: Callable[..., T],
        /,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self.writers, self.commit = writers, commit
        self.call: Callable[[], T] = partial(fn, *args, **kwargs)
        update_wrapper(self, fn)

    def __call__(self) -> T:
        self.commit(self.writers)  # nothing left to do when the hop committed them with the others'
        return self.call()


class _Waiting:
    """One write call waiting for a hop, and what came of it."""

    __slots__ = ("blobs", "call", "context", "done", "error", "lead", "ran", "result", "taken", "wake")

    def __init__(self, call: Callable[[], Any], blobs: Sequence[BlobWriter], wake: trio.Event) -> None:
        self.call, self.blobs, self.wake = call, blobs, wake
        self.context = contextvars.copy_context()
        self.taken = self.ran = self.done = self.lead = False
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        """The call, in its caller's context; raises what it raised after noting it (for a savepoint)."""
        try:
            self.result = self.context.run(self.call)
        except BaseException as exc:  # handed to its caller, raised there
            self.error = exc
            raise
        finally:
            self.ran = True


def _go_now() -> float:
    return 0.0


def _never_early() -> int:
    return 0


class SharedHops:
    """The writes of a harvest, taken by the writer thread's hops (see the module docstring).

    ``hop(fn)`` runs ``fn`` in the writer thread; ``gathering``: the state, when it can join writes in
    one transaction; ``gather()``: seconds the next hop's first write waits for others at most (0: none;
    never without ``gathering``); ``enough()``: writes waiting (the first included) that end that wait
    early (0: it lasts ``gather()``); ``commit_blobs``: the blob store's ``commit``, for the hop's blobs
    together."""

    def __init__(
        self,
        hop: Callable[[Callable[[], None]], Awaitable[object]],
        *,
        gathering: Gathering | None = None,
        gather: Callable[[], float] = _go_now,
        enough: Callable[[], int] = _never_early,
        commit_blobs: Callable[[Sequence[BlobWriter]], None] | None = None,
    ) -> None:
        self._hop = hop
        self._gathering = gathering
        self._gather = gather
        self._enough = enough
        self._commit_blobs = commit_blobs
        self._queue: list[_Waiting] = []
        self._leading = False
        #: While the first write waits for others: set once ``_want`` writes wait (``run``).
        self._filled: trio.Event | None = None
        self._want = 0
        #: Hops made, calls run in them, and hops whose calls shared one transaction (tests count them).
        self.hops = self.calls = self.shared = 0

    async def run(self, call: Callable[[], T], blobs: Sequence[BlobWriter] = ()) -> T:
        """``call()`` in a hop of the writer thread; its result, or its error raised here. ``blobs``:
        those ``call`` commits first (``AfterBlobs``), committed with the hop's others when it can."""
        import trio

        me = _Waiting(call, blobs, trio.Event())
        self._queue.append(me)
        if self._filled is not None and len(self._queue) >= self._want:
            self._filled.set()  # the first write need wait no longer
        if self._leading:  # a hop runs: wait to be taken by the next one, or to be handed the lead
            try:
                await me.wake.wait()
            except trio.Cancelled:
                if not me.taken:
                    self._drop(me)
                    raise
                with trio.CancelScope(shield=True):  # taken: it runs whole; wait for it
                    await me.wake.wait()
                raise
        else:
            self._leading = me.lead = True
            pause = self._gather() if self._gathering is not None else 0.0  # (no shared transaction:
            if pause > 0:  # a wait would buy nothing) others are likely to ask soon: let them join
                try:
                    await self._wait_for_others(pause)
                except trio.Cancelled:
                    self._drop(me)
                    raise
        if not me.done:  # leading: this task's hop takes every write waiting, this one included
            try:
                with trio.CancelScope(shield=True):  # the others wait on this hop
                    await self._one_hop()
            finally:
                self._hand_on()
        if me.error is not None:
            raise me.error
        return me.result  # type: ignore[no-any-return]

    async def _wait_for_others(self, pause: float) -> None:
        """The first write's wait: ``pause`` seconds, or until ``enough()`` writes wait."""
        import trio

        want = self._enough() or sys.maxsize  # 0: none end it early
        if len(self._queue) >= want:
            return
        self._filled, self._want = trio.Event(), want
        try:
            with trio.move_on_after(pause):
                await self._filled.wait()
        finally:
            self._filled = None

    def _drop(self, me: _Waiting) -> None:
        """A write whose caller went before a hop took it: out of the line (its lead, if it had it, to
        the next)."""
        self._queue.remove(me)
        if me.lead:
            self._hand_on()

    def _hand_on(self) -> None:
        """The lead to the first write still waiting (it makes the next hop), or to nobody."""
        if self._queue:
            nxt = self._queue[0]
            nxt.lead = True
            nxt.wake.set()
        else:
            self._leading = False

    async def _one_hop(self) -> None:
        batch, self._queue = self._queue, []
        for w in batch:
            w.taken = True
        gathering = self._gathering if len(batch) > 1 else None
        self.hops += 1
        self.calls += len(batch)
        if gathering is not None:
            self.shared += 1
        try:
            await self._hop(lambda: self._run_all(batch, gathering))
        except BaseException as exc:  # the hop itself failed (no thread): what did not run fails with it
            for w in batch:
                if not w.ran:
                    w.error = exc
            raise
        finally:
            for w in batch:
                w.done = True
                w.wake.set()

    def _run_all(self, batch: list[_Waiting], gathering: Gathering | None) -> None:
        """In the writer thread: each write, alone or in the hop's one transaction."""
        if gathering is None:
            for w in batch:
                with suppress(BaseException):  # noted for its caller (``_Waiting.run``)
                    w.run()
            return
        self._blobs_first(batch)
        try:
            with gathering.together(fence=False):  # each write checks its own fence (its context)
                for w in batch:
                    try:
                        with gathering.savepoint():  # its failure undoes it alone
                            w.run()
                    except BaseException as exc:  # noted for its caller; or the savepoint's own end
                        w.error = w.error or exc  # failed (the transaction lost: the commit fails it all)
        except BaseException as exc:  # not committed: none of it is written, every caller hears so
            # (what lost the transaction, when a write met it, says more than a failed COMMIT)
            from ..store.interface import StateUnavailable

            cause = next((w.error for w in batch if isinstance(w.error, StateUnavailable)), exc)
            for w in batch:
                if w.error is None:
                    w.result, w.error = None, cause
                w.ran = True

    def _blobs_first(self, batch: list[_Waiting]) -> None:
        """The blobs the hop's writes name, committed in one ``small.db`` transaction. On failure each
        write commits its own (``AfterBlobs``), and fails alone if they fail."""
        if self._commit_blobs is None:
            return
        writers = [bw for w in batch for bw in w.blobs]
        if len(writers) <= 1:
            return
        try:
            self._commit_blobs(writers)
        except Exception as exc:  # the writes' own commits try again, each alone
            log.debug("the blobs of %d writes not committed together: %s", len(batch), exc)


__all__ = ["AfterBlobs", "Gathering", "SharedHops"]
