"""What every harvest task shares: config, the one Fetcher, the blob store and the state database.

SQLite is used through two connections: a reader used directly on the trio thread for quick indexed
lookups (WAL lets it read while a write is in progress), and a writer used only from a worker thread, one
call at a time, so that a long transaction never blocks the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import trio

from ..config import Config, ConfigError
from ..plugins import Plugins
from ..store.blobs import BlobStore, BlobWriter
from ..store.state import State
from .fetch import Fetcher
from .patch import PatchApplier, builtin_patch_formats

T = TypeVar("T")
log = logging.getLogger("rsagg.harvest")


@dataclass
class HarvestContext:
    config: Config
    fetcher: Fetcher
    blobs: BlobStore
    reader: State
    writer: State
    patch_formats: dict[str, PatchApplier] = field(default_factory=builtin_patch_formats)
    plugins: Plugins = field(default_factory=lambda: Plugins(entry_point_plugins=False))
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    _write_limiter: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(1))
    #: Called on the trio thread after each state transaction that logged changes (rsagg's notifier
    #: publishes them at once instead of at its next look; ``publish/notify.py``).
    commit_listeners: list[Callable[[], None]] = field(default_factory=list)
    #: ``notifications.Notifications`` when they are on (set by ``start_notifications``): its
    #: ``subscriber`` runs the sources whose channels rsagg follows (``poll_source``).
    notifications: Any = None
    #: ``publish.dumps.DumpBuilder`` of the daemon when dumps are on (``publish/schedule.py``).
    dumps: Any = None

    def committed(self) -> None:
        for listener in self.commit_listeners:
            listener()

    async def write(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a state-writing call in a worker thread; one at a time (SQLite has one writer)."""
        return await trio.to_thread.run_sync(
            lambda: fn(*args, **kwargs), limiter=self._write_limiter, abandon_on_cancel=False
        )

    def progress_update(self, source: str, done: int, total: int) -> None:
        """Live progress stays in memory (state is written once per sync, not per batch)."""
        self.progress[source] = (done, total)

    def scratch_dir(self) -> Path:
        """A folder for big temporary files (dump packages) that a killed process cannot leak.

        The blob store's temp area when it has one (``tmp`` of FileBlobStore, S3BlobStore): a store
        empties it when a process opens it as its only user, so what a kill -9 left goes at the next start.
        """
        tmp = getattr(self.blobs, "tmp", None)
        folder = tmp if isinstance(tmp, Path) else self.config.store_path / "tmp-dumps"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    async def commit_blobs(self, writers: list[BlobWriter]) -> None:
        """Make blobs durable before any state row names them (ARCHITECTURE invariant 2)."""
        if writers:
            await trio.to_thread.run_sync(self.blobs.commit, writers, abandon_on_cancel=False)


def open_blob_store(config: Config, plugins: Plugins) -> BlobStore:
    """The blob store ``[store] backend`` names, built by the plugin that registered it."""
    factories = plugins.merged("rsagg_blob_stores")
    name = config.store.backend
    if name not in factories:
        known = ", ".join(sorted(factories))
        raise ConfigError(config.file, "store.backend", f"no storage backend {name!r} (registered: {known})")
    return factories[name](dict(config.store.settings), config.store_path)


@asynccontextmanager
async def open_context(config: Config) -> AsyncIterator[HarvestContext]:
    """Open the store, the state database (reader + writer) and the one HTTP client for a run."""
    hc = config.harvest
    root = config.store_path
    root.mkdir(parents=True, exist_ok=True)
    plugins = Plugins.from_config(config)
    blobs = open_blob_store(config, plugins)
    writer = State(root / "state.db", synchronous=config.store.synchronous)
    reader = State(root / "state.db", synchronous=config.store.synchronous)
    fetcher = Fetcher(
        per_host=hc.per_host,
        max_connections=hc.max_connections,
        timeout=hc.timeout,
        retries=hc.retries,
        backoff_base=hc.backoff_base,
        backoff_max=hc.backoff_max,
        max_document_bytes=hc.max_document_bytes,
        max_resource_bytes=hc.max_resource_bytes,
    )
    plugins.call("rsagg_startup", config=config)
    try:
        yield HarvestContext(
            config, fetcher, blobs, reader, writer,
            patch_formats=plugins.merged("rsagg_patch_formats"), plugins=plugins,
        )  # fmt: skip
    finally:
        plugins.call("rsagg_shutdown")
        with trio.CancelScope(shield=True):
            await fetcher.aclose()
        reader.close()
        writer.close()
