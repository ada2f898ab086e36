"""The daemon: one trio nursery holding the HTTP server, one poll task per source and the watchdog.

Its parts are built by the composition root (compose.py: ``open_assembly``); the
daemon runs them, swaps the publisher on a reload, and stops them.

Signals (systemd's ``ExecReload=/bin/kill -HUP $MAINPID`` and stop):

- SIGHUP re-reads the configuration file. A broken file is refused (logged as ``FILE: KEY: PROBLEM``)
  and the running configuration stays. Otherwise sources that appeared start, sources that went away
  (or were disabled) stop, sources whose URL or effective settings changed restart, and the others keep
  running untouched. The publisher app is rebuilt for the new configuration (sets, base URL) and
  swapped in under the running server (``hotswap.py``).
  ``RELOADING=1`` ... ``READY=1`` goes to systemd around it.
- SIGTERM/SIGINT: ``STOPPING=1``, the server stops accepting (open requests get a short grace), the
  harvest tasks are cancelled. Blob commits and state transactions run in worker threads started with
  ``abandon_on_cancel=False`` (``HarvestContext.write``/``commit_blobs``, and trio's default for the
  other ``to_thread`` calls), so a cancelled task still waits for the one in flight to finish: the store
  is consistent when the process exits (docs/architecture.md invariant 2).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import trio
from starlette.types import ASGIApp

from ..config import Config, ConfigError, SourceConfig, load_config
from ..harvest.source import poll_source
from ..net import outbound
from ..rs import parse
from ..store.interface import Fence, LeaseLost, fenced
from . import sdnotify
from .cluster import Node
from .compose import Assembly, open_assembly, run_assembly, start_node
from .hotswap import HotSwapApp
from .serverguard import ServerLimits
from .serving import serve
from .workers import Workers

log = logging.getLogger("rsagg.daemon")

#: Seconds after SIGTERM before whatever still runs is cancelled outright (systemd's TimeoutStopSec=15
#: is the next line of defence). Worker threads committing blobs or state are never cut short.
STOP_GRACE = 8.0
#: Keys a reload cannot apply to a running process (the socket, the store, the one HTTP client).
RESTART_KEYS = (
    "server.listen",
    "server.base_url",
    "server.max_connections_per_client",
    "notifications.hub",
    "notifications.hub_path",
    "store.path",
    "store.synchronous",
    "harvest.per_host",
    "harvest.max_connections",
    "harvest.timeout",
    "harvest.retries",
    "harvest.backoff_base",
    "harvest.backoff_max",
    "harvest.max_document_bytes",
    "harvest.max_resource_bytes",
    "cluster.enabled",
    "cluster.node",
    "cluster.lease_seconds",
)

AppFactory = Callable[[Config, Assembly], ASGIApp]


def _listen(config: Config) -> tuple[str, int]:
    host, _, port = config.server.listen.rpartition(":")
    return host.strip("[]"), int(port)


def publisher_app(config: Config, parts: Assembly) -> ASGIApp:
    """The republishing Source for ``config``, from the daemon's parts (``Assembly.app``)."""
    return parts.app(config)


def source_settings(config: Config, src: SourceConfig) -> tuple[Any, ...]:
    """What a source's poll task was started with; a change means a restart of that task."""
    return (src.url, config.interval(src), config.use_dumps(src))


def _get(config: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    if dotted == "store.path":
        return config.store_path.resolve()
    return getattr(getattr(config, section), key)


@dataclass
class _SourceTask:
    src: SourceConfig
    settings: tuple[Any, ...]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)
    fence: Fence | None = None  # the lease it harvests under (cluster nodes only)


class _Daemon:
    def __init__(
        self,
        parts: Assembly,
        nursery: trio.Nursery,
        *,
        harvest: bool,
        config_path: Path | None,
        app_factory: AppFactory,
    ) -> None:
        self.parts = parts
        self.ctx = parts.harvest
        self.nursery = nursery
        self.harvest = harvest
        self.config_path = config_path
        self.app_factory = app_factory
        self.tasks: dict[str, _SourceTask] = {}
        self._ending: dict[str, trio.Event] = {}  # source -> end of its stopped task
        #: This process as a cluster node (``cluster.py``), when ``[cluster] enabled``.
        self.node: Node | None = None
        self._node_scope = trio.CancelScope()
        self.shutdown = trio.Event()
        self.app = HotSwapApp(app_factory(parts.config, parts), nursery)
        self.bound = ""
        self.workers: Workers | None = None

    @property
    def config(self) -> Config:
        return self.ctx.config

    def status_line(self) -> str:
        return f"serving {self.bound}, harvesting {len(self.tasks)} source(s)"

    # ------------------------------------------------------------------ sources

    def start_source(
        self, src: SourceConfig, *, after: trio.Event | None = None, fence: Fence | None = None
    ) -> None:
        if after is None and src.name in self.tasks:  # e.g. a new grant while the old task still ends
            after = self.stop_source(src.name)
        if after is None:
            after = self._ending.get(src.name)
        task = _SourceTask(src, source_settings(self.config, src), fence=fence)
        self.tasks[src.name] = task
        self.nursery.start_soon(self._run_source, task, after, name=f"source {src.name}")

    async def _run_source(self, task: _SourceTask, after: trio.Event | None) -> None:
        try:
            with task.scope, fenced(task.fence):
                if after is not None:
                    await after.wait()  # the previous task of this source has finished its last commit
                await poll_source(self.ctx, task.src, self.parts.followed)
        except LeaseLost as exc:  # another node holds the source now: nothing of ours was written
            log.error("%s", exc)
            if self.node is not None and task.fence is not None:
                self.parts.metrics.cluster_fenced_writes.labels(self.node.name, task.src.name).inc()
                self.node.lost(task.fence, "write refused")
        finally:
            task.done.set()
            if self._ending.get(task.src.name) is task.done:
                del self._ending[task.src.name]

    def stop_source(self, name: str) -> trio.Event:
        """Cancel a source's task; the event is set once it has finished its last commit."""
        task = self.tasks.pop(name, None)
        if task is None:
            done = self._ending.get(name)
            if done is None:
                done = trio.Event()
                done.set()
            return done
        task.scope.cancel()
        if not task.done.is_set():
            self._ending[name] = task.done
        return task.done

    def start_sources(self) -> None:
        if not self.harvest:
            return
        if self.config.cluster.enabled:  # the node claims leases and starts what it holds
            self.node = start_node(
                self.parts, self.nursery, self._node_scope,
                start=lambda src, fence: self.start_source(src, fence=fence), stop=self.stop_source,
            )  # fmt: skip
            return
        for src in self.config.sources:
            if src.enabled:
                self.start_source(src)

    # ------------------------------------------------------------------ reload (SIGHUP)

    async def reload(self) -> None:
        sdnotify.reloading()
        try:
            await self._reload()
        finally:
            sdnotify.ready(self.status_line())

    async def _reload(self) -> None:
        if self.config_path is None:
            log.warning("SIGHUP: no configuration file to re-read (started without one); ignored")
            return
        log.info("SIGHUP: re-reading %s", self.config_path)
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            log.error("reload refused, the running configuration stays: %s", exc)
            return
        old = self.config
        for key in RESTART_KEYS:
            if _get(new, key) != _get(old, key):
                log.warning(
                    "%s: %s changed (%r -> %r): takes effect after a restart",
                    new.file, key, _get(old, key), _get(new, key),
                )  # fmt: skip
        new = self._keep_unreloadable(old, new)
        try:
            # In a thread: create_app opens the state database, which may wait for a harvest commit; it
            # loads the new configuration's plugins (a plugin that does not load refuses the reload).
            app = await trio.to_thread.run_sync(self.app_factory, new, self.parts)
            # The running configuration first: from now on the dumps are read under the new filter's
            # fingerprint (those of the old one are withdrawn), even while the old app finishes.
            self.ctx.config = new
            await self.app.replace(app)
        except Exception as exc:  # a publisher that cannot start with this config: keep the old one
            self.ctx.config = old
            log.error("reload refused, the publisher rejects %s: %s: %s", new.file, type(exc).__name__, exc)
            return
        self.parts.dumps_wake.set()  # withdrawn dumps are built again now, under the new filter
        if self.workers is not None:
            self.workers.restart()  # they read the configuration file again
        outbound.update_policy(self.ctx.fetcher.policy, new)  # new sources' origins, a changed allow-list
        notes = self.parts.notifications
        if notes is not None and notes.hub is not None:
            outbound.update_policy(notes.hub.policy, new, hub=True)
        if self.harvest:
            self._apply_sources(new)
        log.info("reloaded %s: %d source(s) harvested", new.file, len(self.tasks))

    @staticmethod
    def _keep_unreloadable(old: Config, new: Config) -> Config:
        """The config as it really runs: keys in RESTART_KEYS keep their old values until a restart."""
        fetch = {
            k: getattr(old.harvest, k) for _, k in (d.split(".") for d in RESTART_KEYS if d[:8] == "harvest.")
        }
        return replace(
            new,
            server=replace(new.server, listen=old.server.listen),
            store=old.store,
            harvest=replace(new.harvest, **fetch),
            cluster=old.cluster,
        )

    def _apply_sources(self, new: Config) -> None:
        wanted = {s.name: s for s in new.sources if s.enabled}
        if self.node is not None:  # a node: it releases what went away and claims what came at its beat
            for name, task in list(self.tasks.items()):
                src = wanted.get(name)
                if src is not None and (task.settings != source_settings(new, src) or task.src != src):
                    self.start_source(src, after=self.stop_source(name), fence=task.fence)
                    log.info("source=%s url or settings changed: restarted", name)
            return
        for name in [n for n in self.tasks if n not in wanted]:
            self.stop_source(name)
            log.info("source=%s removed from the configuration (or disabled): stopped", name)
        for name, src in wanted.items():
            current = self.tasks.get(name)
            if current is None:
                self.start_source(src)
                log.info("source=%s added: started", name)
            elif current.settings != source_settings(new, src) or current.src != src:
                self.start_source(src, after=self.stop_source(name))
                log.info("source=%s url or settings changed: restarted", name)

    # ------------------------------------------------------------------ stop (SIGTERM/SIGINT)

    def stop(self) -> None:
        sdnotify.stopping()
        self.shutdown.set()  # hypercorn stops accepting; open requests get their graceful timeout
        self._node_scope.cancel()  # a node releases its leases once its tasks have finished
        for name in list(self.tasks):
            self.stop_source(name)
        self.nursery.cancel_scope.deadline = trio.current_time() + STOP_GRACE


def _check_state_directory(config: Config) -> None:
    """Under systemd (StateDirectory=, ProtectSystem=strict) the store must be inside the state
    directory, or every write fails with "read-only file system": say so up front."""
    dirs = [Path(d).resolve() for d in os.environ.get("STATE_DIRECTORY", "").split(":") if d]
    store = config.store_path.resolve()
    if dirs and not any(store.is_relative_to(d) for d in dirs):
        log.warning(
            "%s: store.path %s is outside the service's state directory %s: it is probably not writable",
            config.file, store, ":".join(map(str, dirs)),
        )  # fmt: skip


class ListenError(OSError):
    """The server socket could not be bound (address in use, no permission): ``FILE: server.listen: ...``."""


async def run_daemon(
    config: Config,
    *,
    config_path: str | Path | None = None,
    harvest: bool = True,
    app_factory: AppFactory = publisher_app,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    on_ready: Callable[[Assembly, str], Awaitable[None]] | None = None,
) -> None:
    """Serve and harvest until SIGTERM/SIGINT (or cancellation); ``task_status`` gets the bound URL.

    ``config_path`` is the file SIGHUP re-reads (None: SIGHUP is ignored with a warning); ``on_ready``
    gets the daemon's parts (compose.py ``Assembly``) and the bound URL once it serves. Raises
    ``ListenError`` (plain, not in an exception group) when the server socket cannot be bound.
    """
    path = Path(config_path) if config_path is not None else None
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async with trio.open_nursery() as outer:
                watchdog = trio.CancelScope()
                outer.start_soon(_scoped, watchdog, sdnotify.watchdog_task)  # also during a slow start-up
                try:
                    await _serve_and_harvest(
                        config, path, harvest, app_factory, signals, task_status, on_ready
                    )
                finally:
                    watchdog.cancel()
    except BaseExceptionGroup as group:
        listen_error = _sole(group, ListenError)
        if listen_error is None:
            raise
        raise listen_error from None
    log.info("stopped")


async def _serve_and_harvest(
    config: Config,
    config_path: Path | None,
    harvest: bool,
    app_factory: AppFactory,
    signals: AsyncIterator[int],
    task_status: trio.TaskStatus[str],
    on_ready: Callable[[Assembly, str], Awaitable[None]] | None,
) -> None:
    _check_state_directory(config)
    async with open_assembly(config, harvest=harvest) as parts, trio.open_nursery() as nursery:
        daemon = _Daemon(parts, nursery, harvest=harvest, config_path=config_path, app_factory=app_factory)
        await run_assembly(nursery, parts, daemon.shutdown.wait)  # notifications, the dump schedule
        host, port = _listen(config)
        limits = ServerLimits(
            max_connections_per_client=config.server.max_connections_per_client,
            on_refused=parts.metrics.server_refused_hook,
        )
        workers = config.server.workers
        if workers > 1 and config_path is None:
            log.warning(
                "server.workers = %d needs a configuration file to start them: serving alone", workers
            )
            workers = 1
        try:
            daemon.bound = await nursery.start(
                partial(serve, daemon.app, host, port, shutdown_trigger=daemon.shutdown.wait, limits=limits,
                        reuse_port=workers > 1)
            )  # fmt: skip
        except* OSError as group:
            exc = _sole(group, OSError)
            reason = (exc.strerror if exc is not None else None) or str(group.exceptions[0])
            raise ListenError(
                f"{config.file}: server.listen: cannot listen on {host}:{port}: {reason}"
            ) from None
        log.info("listening on %s, publishing as %s (server.base_url)", daemon.bound, config.server.base_url)
        if workers > 1:  # workers.py: they forward what only this process answers to a listener of its own
            assert config_path is not None
            internal = await nursery.start(
                partial(serve, daemon.app, "127.0.0.1", 0, shutdown_trigger=daemon.shutdown.wait,
                        limits=replace(limits, max_connections_per_client=0))
            )  # fmt: skip
            bound_port = int(daemon.bound.rsplit(":", 1)[1])
            daemon.workers = Workers(config_path, workers - 1, host, bound_port, internal, parts.metrics)
            nursery.start_soon(daemon.workers.run, nursery, daemon.shutdown.wait)
            log.info("%d worker processes serve on the same port (server.workers)", workers - 1)
        log.info("document parser: %s", "compiled fast path" if parse.SPEEDUPS else "pure Python (slower)")
        daemon.start_sources()
        if on_ready is not None:
            await on_ready(parts, daemon.bound)
        task_status.started(daemon.bound)
        sdnotify.ready(daemon.status_line())
        async for signum in signals:
            if signum == signal.SIGHUP:
                await daemon.reload()
                continue
            log.info("%s: stopping (in-flight commits finish first)", signal.Signals(signum).name)
            daemon.stop()
            break


def _sole(group: BaseExceptionGroup, kind: type[BaseException]) -> Any:
    """The one exception of ``kind`` a (nested) group consists of, else None."""
    match, rest = group.split(kind)
    if match is None or rest is not None:
        return None
    leaves = list(_leaves(match))
    return leaves[0] if len(leaves) == 1 else None


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _leaves(e)
    else:
        yield exc


async def _scoped(scope: trio.CancelScope, fn: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await fn()
