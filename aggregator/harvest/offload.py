"""CPU-bound harvest work in worker processes, beside the event loop (``harvest.processes``).

Why: the daemon is one Python process, and the GIL lets one thread at a time run Python. An OAI-PMH
page of small records costs more CPU to parse, canonicalise, hash and store than its fetch and its
state transaction together; run in the daemon's threads, that work and the event loop took turns on
one core. In a worker process it runs on another core, while the event loop fetches the next page and
the state writer commits the pages before it (``python benchmarks/bench_oaipmh.py``).

A job is a module-level function ``fn(blobs, *args)``: ``blobs`` is the daemon's blob store, which a
worker opens once from the same backend factory, settings and path (``StoreRecipe``): a blob it
commits is as durable and visible as one the daemon commits (a store is shared by processes already:
``rsagg gc``, cluster nodes on one host). Jobs and their results travel pickled; an exception raised
by a job is raised where the job was awaited. ``harvest.processes = 0``, or a backend whose factory
cannot be pickled, runs the same functions in a worker thread of the daemon instead.

Worker processes are trio-parallel's default ones: spawned at the first job (about 0.5 s of imports),
kept for the next, gone after 10 minutes idle or when the daemon exits. A worker that dies fails its
job with ``OffloadError`` (the sync fails, and is tried again as any failed sync); the next job starts
a new worker. What a worker's commits stored is counted by the daemon's metrics as if its own store had
committed it (``FileBlobStore.on_commit``).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import trio
import trio_parallel

from ..store.blobs import BlobInfo, BlobStore

log = logging.getLogger("rsagg.harvest")

T = TypeVar("T")


@dataclass(frozen=True)
class StoreRecipe:
    """How a worker process opens the daemon's blob store: the backend's factory, its settings and
    the store path (``open_blob_store``'s arguments), all picklable."""

    factory: Callable[[dict, Path], BlobStore]
    settings: dict[str, Any] = field(default_factory=dict)
    path: Path = Path()

    def pickled(self) -> bytes | None:
        """The recipe as a worker gets it, or None when it cannot travel (a lambda, a closure...)."""
        try:
            return pickle.dumps(self)
        except Exception:
            return None


#: The store a worker process opened, with its pickled recipe: one, the daemon's (a recipe that differs,
#: e.g. after the configuration changed, closes it and opens the new one).
_OPENED: list[tuple[bytes, BlobStore]] = []


#: What a job's commits stored, as a worker sends it back: per commit, (sha-256, length) of the blobs
#: written and of those found there already.
Tally = list[tuple[list[tuple[str, int]], list[tuple[str, int]]]]


def _run_in_worker(recipe: bytes, fn: Callable[..., T], args: tuple) -> tuple[T, Tally]:
    """The entry point in a worker process: the store opened once, then the job, with what its commits
    stored (the daemon's metrics count it: ``Offload.run``)."""
    if not _OPENED or _OPENED[0][0] != recipe:
        while _OPENED:
            close = getattr(_OPENED.pop()[1], "close", None)
            if callable(close):
                close()
        opened: StoreRecipe = pickle.loads(recipe)
        _OPENED.append((recipe, opened.factory(dict(opened.settings), opened.path)))
    blobs = _OPENED[0][1]
    tally: Tally = []
    counted = hasattr(blobs, "on_commit")  # FileBlobStore's metrics seam (metrics.py)
    if counted:
        blobs.on_commit = lambda written, found: tally.append(  # type: ignore[attr-defined]
            ([(i.sha256, i.length) for i in written], [(i.sha256, i.length) for i in found])
        )
    try:
        return fn(blobs, *args), tally
    finally:
        if counted:
            blobs.on_commit = None  # type: ignore[attr-defined]


class OffloadError(Exception):
    """A worker process died while it ran a job (killed, out of memory): the job's work is lost."""


class Offload:
    """Runs ``fn(blobs, *args)`` in a worker process (``processes`` at most at once), or in a worker
    thread with the daemon's own store when there are none."""

    def __init__(self, blobs: BlobStore, recipe: StoreRecipe | None = None, processes: int = 0) -> None:
        self.blobs = blobs
        self._recipe = recipe.pickled() if recipe is not None and processes else None
        self.processes = processes if self._recipe is not None else 0
        if processes and not self.processes:
            log.info("the blob store backend cannot be opened by a worker process: page work runs in threads")
        self._limiter = trio.CapacityLimiter(max(1, self.processes))

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if not self.processes:
            return await trio.to_thread.run_sync(fn, self.blobs, *args)
        try:
            result, tally = await trio_parallel.run_sync(
                _run_in_worker, self._recipe, fn, args, limiter=self._limiter
            )
        except trio_parallel.BrokenWorkerError as exc:
            raise OffloadError(
                f"a worker process died while it ran {fn.__name__}: {exc} (a worker that cannot start at "
                "all, e.g. in a sandbox that forbids new processes: harvest.processes = 0 runs page work "
                "in the daemon's threads)"
            ) from None
        report = getattr(self.blobs, "on_commit", None)
        if report is not None:  # as if the daemon's own store had committed them
            for written, found in tally:
                report([BlobInfo(s, n, {}) for s, n in written], [BlobInfo(s, n, {}) for s, n in found])
        return result


__all__ = ["Offload", "OffloadError", "StoreRecipe"]
