"""Dump builds in a process of their own, at a lower priority (``publish/schedule.py`` runs them).

Why: a build is seconds of CPU in Python (reading the state, zipping, hashing). In a thread of the
daemon, even niced, it shares the GIL with the serving event loop, which then answers fewer requests
while it runs (``python benchmarks/bench_publish.py --no-nginx --dumps MODE``). In a process of its own,
niced by ``schedule.DUMP_NICE`` as a whole, it takes only what the serving process leaves of the CPU.

The process is a trio-parallel worker of a context of its own (not the default one the harvest's page
work shares: nicing that would slow the harvest), spawned at the first build (about 0.5 s of imports)
and kept for the next. It opens what a build needs from picklable recipes: the running configuration
(its plugins loaded from it, as the daemon loads them: the same publish filter, the same fingerprint)
and the daemon's blob store (``StoreRecipe``); its own state handle. Crash safety is the builder's: a
package is recorded in the same transaction that follows its blobs, so a worker killed mid-build (the
daemon stops: ``kill_on_cancel``; out of memory) leaves temp files only, and the next round builds it
again. An exception raised by a build is raised where it was awaited (the schedule logs it by name);
a worker that dies is reported as ``DumpWorkerError`` and the next round starts a new one; a worker that
never finished a build (a sandbox that forbids new processes) turns the daemon to its niced thread. What the
worker's store committed is counted by the daemon's metrics as if its own store had (``on_commit``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from collections.abc import AsyncIterator
from typing import Any

import trio
import trio_parallel

from ..config import Config
from ..harvest.offload import StoreRecipe
from ..publish.dumps import DumpBuilder
from ..publish.schedule import DUMP_NICE, BuildRunner, build_due, in_thread
from ..store.blobs import BlobInfo, BlobStore

log = logging.getLogger("rsagg.publish")

#: Seconds an idle dump worker is kept (the next Change Dump look comes within a minute).
IDLE_TIMEOUT = 600.0

#: What a build's commits stored, as the worker sends it back: per commit, (sha-256, length) of the
#: blobs written and of those found there already.
Tally = list[tuple[list[tuple[str, int]], list[tuple[str, int]]]]

#: The worker's builder, with the pickled (configuration, store recipe) it was opened from, and what to
#: close with it; opened again when either changes (a reload).
_OPENED: list[tuple[bytes, Any, list[Any]]] = []


class DumpWorkerError(Exception):
    """The dump worker process died while it built (killed, out of memory): the build is lost."""


def _lower_priority() -> bool:
    """The worker's ``init``: the whole process DUMP_NICE lower (up to 19); refused: normal priority."""
    try:
        os.nice(min(DUMP_NICE, 19 - os.nice(0)))
    except OSError as exc:
        log.debug("dump builds run at normal priority: %s", exc)
    return True


def _close_opened() -> None:
    while _OPENED:
        for thing in reversed(_OPENED.pop()[2]):
            close = getattr(thing, "close", None)
            if callable(close):
                close()


def _build_in_worker(opened_from: bytes, resource_dumps: bool) -> tuple[int, str, Tally]:
    """The entry point in the worker: the builder opened once per (configuration, store), then one round
    of ``build_due``; its count, the fingerprint it built under and what its commits stored."""
    if not _OPENED or _OPENED[0][0] != opened_from:
        _close_opened()
        from .parts import dump_builder, load_plugins

        config, recipe = pickle.loads(opened_from)
        store: BlobStore = recipe.factory(dict(recipe.settings), recipe.path)
        plugins = load_plugins(config)
        opened = dump_builder(config, store, get_config=lambda: config, get_plugins=lambda: plugins)
        if opened is None:  # dumps turned off meanwhile: nothing to build
            getattr(store, "close", lambda: None)()
            return 0, "", []
        _OPENED.append((opened_from, opened, [store, opened.state]))
    builder = _OPENED[0][1]
    blobs: Any = builder.blobs  # (on_commit: FileBlobStore's, not the BlobStore protocol's)
    tally: Tally = []
    counted = hasattr(blobs, "on_commit")  # FileBlobStore's metrics seam (metrics.py)
    if counted:
        blobs.on_commit = lambda written, found: tally.append(
            ([(i.sha256, i.length) for i in written], [(i.sha256, i.length) for i in found])
        )
    try:
        built = build_due(builder, resource_dumps=resource_dumps)
        return built, builder.fingerprint(), tally
    finally:
        if counted:
            blobs.on_commit = None


def worker_recipe(config: Config, recipe: StoreRecipe | None) -> bytes | None:
    """The pickled (configuration, store recipe) a worker opens, or None when either cannot travel."""
    if recipe is None:
        return None
    try:
        return pickle.dumps((config, recipe))
    except Exception:
        return None


@contextlib.asynccontextmanager
async def dump_process(
    blobs: BlobStore, recipe: StoreRecipe | None, builder: DumpBuilder
) -> AsyncIterator[BuildRunner | None]:
    """A ``BuildRunner`` that builds in the dump worker process while the block runs (the worker is
    stopped with it), or None when the blob store cannot be opened by another process (then the
    schedule builds in a thread). ``builder``: the daemon's, whose fingerprint a worker's build must
    match (the same plugins loaded from the same configuration), and which builds in a niced thread
    when no worker can start."""
    if recipe is None or recipe.pickled() is None:
        log.info("the blob store backend cannot be opened by another process: dumps build in a thread")
        yield None
        return
    fingerprint = builder.fingerprint
    thread = in_thread(builder)
    finished = False  # a worker finished a build: one that dies later is not a sandbox's refusal
    fallback = False
    async with _worker_context() as ctx:

        async def build(config: Config, resource_dumps: bool) -> int:
            nonlocal finished, fallback
            opened_from = worker_recipe(config, recipe)
            if fallback or opened_from is None:
                return await thread(config, resource_dumps)
            try:
                built, fp, tally = await ctx.run_sync(
                    _build_in_worker, opened_from, resource_dumps, kill_on_cancel=True
                )
            except trio_parallel.BrokenWorkerError as exc:
                if not finished:
                    fallback = True
                    log.warning("the dump worker process cannot run (%s): dumps build in a thread", exc)
                raise DumpWorkerError(f"the dump worker process died while it built: {exc}") from None
            finished = True
            report = getattr(blobs, "on_commit", None)
            if report is not None:  # as if the daemon's own store had committed them
                for written, found in tally:
                    report([BlobInfo(s, n, {}) for s, n in written], [BlobInfo(s, n, {}) for s, n in found])
            if fp and fp != fingerprint():
                raise DumpWorkerError(
                    f"the dump worker built under fingerprint {fp}, the daemon serves {fingerprint()}: "
                    "its plugins differ from the daemon's (the next round builds again)"
                )
            return built

        yield build
        # (leaving the context stops the worker; a build under way was killed by the cancellation)
        await trio.lowlevel.checkpoint()


@contextlib.asynccontextmanager
async def _worker_context() -> AsyncIterator[trio_parallel.WorkerContext]:
    """trio-parallel's worker context, whose closing never fails the daemon: a worker that did not exit
    cleanly (the stop signal reached it too: systemd signals the unit's whole control group, a terminal
    its process group) raised from the context's end and turned the daemon's clean stop into a
    traceback and exit status 1. Nothing is lost with it: a build it had under way is built again by
    the next round. Logged in one line; what the block itself raised goes on as it was."""
    manager = trio_parallel.open_worker_context(idle_timeout=IDLE_TIMEOUT, init=_lower_priority)
    ctx = await manager.__aenter__()
    try:
        yield ctx
    except BaseException as exc:
        await _close(manager, exc)
        raise
    await _close(manager, None)


async def _close(manager: contextlib.AbstractAsyncContextManager[object], exc: BaseException | None) -> None:
    try:
        await manager.__aexit__(
            type(exc) if exc is not None else None, exc, exc.__traceback__ if exc else None
        )
    except trio_parallel.BrokenWorkerError as broken:
        log.info(
            "the dump worker process did not stop cleanly (a build it had under way is built again): %s",
            broken.args[0],
        )


__all__ = ["IDLE_TIMEOUT", "DumpWorkerError", "dump_process", "worker_recipe"]
