"""When rsagg builds its dumps (§11, §13): a daemon task over ``publish/dumps.py``.

Every ``publish.dump_interval`` seconds each published set gets a new Resource Dump (the builder skips a
set that did not change since its last run); every minute the Change Dump packages of Change List windows
that closed since are built (a closed window never changes, so each is built once). ``dump_interval = 0``
turns dumps off: the Capability Lists then advertise none.

The builder reads the running configuration and plugins through getters (a reload replaces both): every
round builds with the publish filter of the moment, and a round starts at once when the daemon reloads
(``Wake``), so the dumps built under the filter before are withdrawn and built again without waiting for
the next interval (publish/dumps.py: fingerprints).

A round runs off the serving event loop: in the daemon, in a process of its own at a lower priority
(``run/dumpworker.py``: a thread, even niced, shares the GIL with the event loop and slowed serving);
without one (a blob store another process cannot open, tests), in a niced thread (``run_low_priority``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import trio

from ..config import Config
from ..plugins.manager import Plugins
from ..rs.w3cdt import utcnow
from ..store.interface import StateStore
from .documents import Site
from .dumps import DumpBuilder, dump_routes
from .site import build_site, link_policy, publish_filter, view_fingerprint

log = logging.getLogger("rsagg.publish")

#: Seconds between looks for newly closed Change List windows.
CHANGE_DUMP_PERIOD = 60.0
#: Added to the nice value of the thread that builds dumps (Linux schedules threads one by one): on a
#: busy machine the serving event loop, the serving workers and nginx get the CPU first.
DUMP_NICE = 10

T = TypeVar("T")

#: One round of ``build_due`` with the given running configuration, off the event loop: the count built.
BuildRunner = Callable[[Config, bool], Awaitable[int]]


class Wake:
    """Cuts the schedule's sleep short: the daemon sets it on a reload (a new filter: rebuild now)."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` or until ``set``, whichever comes first."""
        with trio.move_on_after(seconds):
            await self._event.wait()
        if self._event.is_set():
            self._event = trio.Event()


class CurrentView:
    """The fingerprint of the running configuration and plugins, computed once per pair (by identity:
    routes ask for it on every request), and the Site a dump package is built from: a DumpBuilder's
    ``fingerprint`` and ``site_of`` (the composition builds the one DumpBuilder of a process with them:
    every package is built with the running publish filter and recorded under its fingerprint, and only
    packages of the current fingerprint are served)."""

    def __init__(self, get_config: Callable[[], Config], get_plugins: Callable[[], Plugins]) -> None:
        self.get_config, self.get_plugins = get_config, get_plugins
        self._last: tuple[Config, Plugins, str] | None = None

    def fingerprint(self) -> str:
        config, plugins = self.get_config(), self.get_plugins()
        last = self._last
        if last is not None and last[0] is config and last[1] is plugins:
            return last[2]
        fp = view_fingerprint(config, plugins)
        self._last = (config, plugins, fp)
        return fp

    def site(self, state: StateStore) -> Site:
        return _site(self.get_config(), self.get_plugins(), state)


def dump_app_options(builder: DumpBuilder | None, options: dict[str, Any]) -> dict[str, Any]:
    """``create_app`` keyword arguments with the dump routes and the dumps a Capability List lists."""
    if builder is None:
        return options
    return {
        **options,
        "extra_routes": [*options.get("extra_routes", ()), *dump_routes(builder)],
        "dumps_available": builder.available,
    }


def _site(config: Config, plugins: Plugins, state: StateStore) -> Site:
    """The Site the app serves (sets, link policy, publish filter): a package holds what the lists show."""
    return build_site(config, state, policy=link_policy(config, plugins), visible=publish_filter(plugins))


def build_due(builder: DumpBuilder, *, resource_dumps: bool) -> int:
    """Build what is due for every published set with the running configuration and plugins, once the
    dumps of another filter are withdrawn (blocking: call it in a worker thread). A set without a
    Resource Dump under the current filter (none yet, or withdrawn) gets one now, due or not."""
    builder.refresh()
    site = builder.site
    built = 0
    for ps in site.sets.values():
        built += len(builder.build_change_dumps(ps.name, ps.set_ids, site.changelist_size))
        if resource_dumps or builder.latest_run(ps.name) is None:
            built += len(builder.build_resource_dump(ps.name, ps.set_ids))
    return built


async def run_dumps(
    builder: DumpBuilder | None,
    get_config: Callable[[], Config],
    stop_when: Callable[[], Awaitable[Any]],
    wake: Wake | None = None,
    runner: Callable[[], AbstractAsyncContextManager[BuildRunner | None]] | None = None,
    on_error: Callable[[Exception], None] | None = None,
) -> None:
    """The daemon task: Resource Dumps on their interval, Change Dump packages as windows close; ends
    when ``stop_when()`` returns (the daemon's shutdown). ``get_config``: the running configuration;
    ``wake``: set on a reload, starts a round (withdraw, rebuild) at once; ``runner``: where a round
    runs while the task runs (``run/dumpworker.py``: a process of its own, stopped with the task; it may
    yield None); None, or a None it yields: a niced thread of this process (``run_low_priority``);
    ``on_error``: told of each failed round (the daemon counts it), besides the log naming it."""
    if builder is None:
        return
    async with (runner or _no_runner)() as build:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                _build_forever, builder, get_config, wake or Wake(), build or in_thread(builder), on_error
            )
            await stop_when()
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def _no_runner() -> AsyncIterator[None]:
    yield None


def in_thread(builder: DumpBuilder) -> BuildRunner:
    """A round in a niced thread of this process (``run_low_priority``), with ``builder`` (which reads the
    running configuration through its own getters)."""

    async def build(config: Config, resource_dumps: bool) -> int:
        return await run_low_priority(partial(build_due, builder, resource_dumps=resource_dumps))

    return build


def first_due(builder: DumpBuilder, config: Config) -> float:
    """Seconds until the next Resource Dumps are due: none built yet, at once; else an interval after
    the newest run, so a process that starts (or a cluster node that takes the dumps over, cluster.py)
    does not build again what another process has just built."""
    try:
        builder.refresh()
        runs = [builder.latest_run(name) for name in builder.site.sets]
    except Exception:  # a state that cannot say: build now, as before
        return 0.0
    if not runs or any(r is None for r in runs):
        return 0.0
    newest = max(r.created for r in runs if r is not None)
    age = (utcnow() - newest).total_seconds()
    return max(0.0, config.publish.dump_interval - age)


async def _build_forever(
    builder: DumpBuilder,
    get_config: Callable[[], Config],
    wake: Wake,
    build: BuildRunner,
    on_error: Callable[[Exception], None] | None = None,
) -> None:
    first = await trio.to_thread.run_sync(first_due, builder, get_config())
    next_resource_dump = trio.current_time() + first
    while True:
        due = trio.current_time() >= next_resource_dump
        try:
            # A stop must not wait for a long build: an abandoned build (a thread) dies with the process,
            # a worker process is killed, before its rows commit (one transaction after its blobs),
            # leaving temp files only.
            built = await build(get_config(), due)
            if built:
                log.info("built %d dump package(s)", built)
        except Exception as exc:  # a failed dump must not stop the daemon; the next round tries again
            log.error("building dumps failed: %s: %s", type(exc).__name__, exc)
            if on_error is not None:
                on_error(exc)
        if due:
            next_resource_dump = trio.current_time() + get_config().publish.dump_interval
        await wake.sleep(min(CHANGE_DUMP_PERIOD, max(1.0, next_resource_dump - trio.current_time())))


def _lower_priority() -> None:
    """Nice the calling thread by ``DUMP_NICE`` (Linux: ``setpriority`` of a thread id touches that thread
    alone); elsewhere, or when refused, the build runs at the process's priority."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + DUMP_NICE))
    except (AttributeError, OSError) as exc:
        log.debug("dump builds run at normal priority: %s", exc)


async def run_low_priority(fn: Callable[[], T]) -> T:
    """Run ``fn`` (a dump build: seconds of CPU) in a daemon thread of its own at a lower priority, off the
    serving event loop, and wait for it without blocking the loop.

    A thread of its own, not one of trio's: those are reused for the state calls of the requests, and an
    unprivileged process cannot raise a thread's priority again once lowered. A daemon thread, as trio's
    are: on cancellation the build is abandoned and dies with the process before its rows commit (one
    transaction after its blobs), leaving temp files only; a stop never waits for a long build."""
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()
    outcome: list[Any] = []

    def body() -> None:
        _lower_priority()
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the awaiting task, raised there
            outcome.append((False, exc))
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:  # the daemon stopped meanwhile: nobody waits
            pass

    threading.Thread(target=body, name="rsagg-dumps", daemon=True).start()
    await done.wait()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
