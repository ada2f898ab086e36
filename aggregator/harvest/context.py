"""What every harvest task shares: config, the one Fetcher, the blob store and the state.

The state is used through two handles: a reader used directly on the trio thread for quick indexed
lookups (WAL lets it read while a write is in progress), and a writer used only from a worker thread, one
call at a time, so that a long transaction never blocks the event loop.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..config import Config, ConfigError
from ..plugins.manager import Plugins
from ..progress_text import progress_figures
from ..store.blobs import BLOB_STORE_METHODS, BlobStore, BlobWriter
from .admission import Admissions
from .writes import AfterBlobs, Gathering, SharedHops

if TYPE_CHECKING:  # the harvest's libraries (trio, httpx, prometheus-client) load with a HarvestContext:
    # ``rsagg status`` and ``retries`` import this module for prepare_store only (benchmarks/bench_startup.py)
    import trio

    from ..store.interface import StateStore
    from .fetch import Fetcher
    from .offload import Offload, StoreRecipe
    from .patch import PatchApplier

T = TypeVar("T")
log = logging.getLogger("rsagg.harvest")

#: Seconds between two saves of a running baseline's progress in the sources table (``rsagg status``,
#: the status page): the save rides along with the next state write (``HarvestContext.write``).
PROGRESS_SAVE_EVERY = 1.0
#: Seconds a state write waits at most for others to share its thread hop and transaction while other
#: syncs run (``harvest/writes.py``); it goes earlier once three quarters of the syncs running have a
#: write waiting (``HarvestContext._enough``). In a harvest of 300 small Sources a hop took 1.4 writes
#: without the wait, 2.8 with 5 ms, 3.3 with 10 ms. With the upstream 20 ms late, Sources' writes came
#: tens of milliseconds apart and a 10 ms wait gathered few: 50 ms, ended early, spared CPU there and
#: at full speed without costing time (benchmarks/bench_many_sources.py; docs/benchmarks.md "Many
#: sources", twelfth to fourteenth passes).
GATHER = 0.050


class HarvestMetrics(Protocol):
    """What a harvest reports to the process's metrics (``observe.metrics.Metrics`` is one): the
    harvest counts its work without knowing who exposes it."""

    def committed(self, source: str, applied: Sequence[Any], failures: Iterable[Any]) -> None: ...

    def sync_finished(
        self,
        source: str,
        ok: bool,
        seconds: float,
        exc: BaseException | None = None,
        *,
        degraded: bool = False,
    ) -> None: ...

    def failure_not_recorded(self, source: str, line: str) -> None: ...

    def reconciled(self, source: str, result: str, repaired: dict[str, int]) -> None: ...

    def deviation(self, source: str, rule: str) -> None: ...

    def error(self, source: str, kind: str) -> None: ...


def _one_writer() -> trio.CapacityLimiter:
    import trio

    return trio.CapacityLimiter(1)


@dataclass
class HarvestContext:
    config: Config
    fetcher: Fetcher
    blobs: BlobStore
    reader: StateStore
    writer: StateStore
    patch_formats: dict[str, PatchApplier]
    plugins: Plugins
    #: This process's metrics (``metrics.py``); the pipeline and ``sync_source`` report to it.
    metrics: HarvestMetrics
    #: Where CPU-bound page work runs (``harvest/offload.py``): worker processes (``harvest.processes``)
    #: or worker threads with ``blobs``.
    offload: Offload
    #: Called on the trio thread after each state transaction that logged changes (rsagg's notifier
    #: publishes them at once instead of at its next look: the composition hands ``Notifier.wake``).
    commit_listeners: tuple[Callable[[], None], ...]
    #: source -> (done, expected or None): live progress of the running baseline (``harvest/progress.py``).
    progress: dict[str, tuple[int, int | None, float | None]] = field(default_factory=dict)
    _write_limiter: trio.CapacityLimiter = field(default_factory=_one_writer)
    _progress_unsaved: dict[str, tuple[int, int | None, float | None]] = field(default_factory=dict)
    _progress_saved_at: float = 0.0
    #: source -> state writes that ride along with the next write made for that source (``write_later``).
    _later: dict[str, list[Callable[[], object]]] = field(default_factory=dict)
    #: source -> URL -> the capability documents its last discovery read, with their validators
    #: (``discovery.Known``): the next sync asks for them conditionally. In memory only: a restart
    #: reads each once afresh.
    discovered: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The writes waiting for the worker thread, taken together by its next hop (``writes.py``).
    _writes: SharedHops | None = None
    #: Which syncs run now, a few per host (``harvest/admission.py``).
    admissions: Admissions = field(default_factory=Admissions)

    def committed(self) -> None:
        for listener in self.commit_listeners:
            listener()

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """A read of the state from the event loop (``store/calls.py``): direct on SQLite, in a worker
        thread under the backend's limiter on a server (PostgreSQL), so no download waits on it."""
        from ..store.calls import state_call

        return await state_call(self.reader, fn, *args)

    async def write(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a state-writing call in a worker thread; one at a time (SQLite has one writer)."""
        from ..scope import current_source

        progress = self._progress_due()
        later = self._later.pop(current_source.get(), None) if self._later else None

        def call() -> T:
            if not progress and not later:
                return fn(*args, **kwargs)
            # What rides along and the write itself: one transaction where the state can join them.
            with together() if (together := getattr(self.writer, "together", None)) else nullcontext():
                if progress:
                    self._save_progress(progress)
                for step in later or ():
                    step()
                return fn(*args, **kwargs)

        return await self._shared_writes().run(call, fn.writers if isinstance(fn, AfterBlobs) else ())

    def _shared_writes(self) -> SharedHops:
        """The writer thread's hops (``harvest/writes.py``), made at the first write: one transaction for
        the writes of a hop where the state can join them (SQLite), their blobs committed together."""
        if self._writes is None:
            from ..store.calls import in_thread

            gathering = self.writer if isinstance(self.writer, Gathering) else None
            self._writes = SharedHops(
                partial(in_thread, limiter=self._write_limiter),
                gathering=gathering,
                gather=self._gather,
                enough=self._enough,
                commit_blobs=self.blobs.commit if gathering is not None else None,
            )
        return self._writes

    def _gather(self) -> float:
        """How long a write waits for others to share its hop, at most: ``GATHER`` while other syncs run
        (their writes are on their way), else nothing (a write alone goes at once)."""
        return GATHER if self.admissions.running > 1 else 0.0

    def _enough(self) -> int:
        """Writes waiting (the first included) that end that wait: three quarters of the syncs running,
        two at least. Why: each sync has a write on its way at most, and a hop's transaction, commit and
        ``fsync`` cost the same for one write as for ten. At full speed (300 small Sources), hops of
        the writes of three quarters of the syncs spent 0.09 s less CPU than of half (1.62 -> 1.53 s),
        all of them 0.13 s less but 4 % more time: every sync stopped until the hop went. With the
        upstream 20 ms late most hops end at ``GATHER`` either way (benchmarks/bench_many_sources.py,
        docs/benchmarks.md "Many sources", fourteenth pass)."""
        return max(2, self.admissions.running * 3 // 4)

    def write_later(self, source: str, fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """A state write for ``source`` (its status) that needs no thread hop of its own: it runs, in the
        order given, in the thread hop of the next ``write`` made for that source (``current_source``),
        just before that write. Why: a sync's status writes, each its own hop, were a good part of the
        per-source cost of a harvest of many small sources (benchmarks/bench_many_sources.py).

        Two status updates in a row (``set_source_status`` of the same source) are one write of their
        fields, the later's winning: one transaction, the same row in the end."""
        queued = self._later.setdefault(source, [])
        last = queued[-1] if queued else None
        if (
            isinstance(last, partial)
            and fn == self.writer.set_source_status
            and last.func == fn
            and last.args == args
        ):
            queued[-1] = partial(fn, *args, **{**last.keywords, **kwargs})
            return
        queued.append(partial(fn, *args, **kwargs))

    def later_waiting(self, source: str) -> bool:
        """Writes wait to ride along with ``source``'s next write."""
        return bool(self._later.get(source))

    def drop_later(self, source: str) -> None:
        """Forget the writes waiting for ``source``'s next write (its sync ended without one: the store
        refused it)."""
        self._later.pop(source, None)

    def progress_update(self, source: str, done: int, total: int | None, rate: float | None = None) -> None:
        """Live progress in memory; saved in the sources table with the next state write once
        PROGRESS_SAVE_EVERY seconds have passed (no timer task, no extra thread hop per batch). ``rate``:
        resources per second lately (``Progress.rate``), saved with it for the status displays."""
        self.progress[source] = (done, total, rate)
        self._progress_unsaved[source] = (done, total, rate)

    def progress_finished(self, source: str) -> None:
        """The sync writes its final figures itself: nothing left to ride along."""
        self._progress_unsaved.pop(source, None)

    def _progress_due(self) -> dict[str, tuple[int, int | None, float | None]]:
        if not self._progress_unsaved or time.monotonic() - self._progress_saved_at < PROGRESS_SAVE_EVERY:
            return {}
        self._progress_saved_at = time.monotonic()
        due, self._progress_unsaved = self._progress_unsaved, {}
        return due

    def _save_progress(self, progress: dict[str, tuple[int, int | None, float | None]]) -> None:
        for name, (done, total, rate) in progress.items():
            try:
                self.writer.set_source_status(
                    name, progress_done=done, progress_total=total, progress_what=progress_figures(rate)
                )
            except Exception as exc:  # progress is a display: never fail the write it rides along with
                log.warning("source=%s progress not saved: %s", name, exc)

    def scratch_dir(self) -> Path:
        """A folder for big temporary files (dump packages) that a killed process cannot leak.

        The blob store's temp area when it has one (``tmp`` of FileBlobStore, S3BlobStore): a store
        empties it when a process opens it as its only user, so what a kill -9 left goes at the next start.
        """
        tmp = getattr(self.blobs, "tmp", None)
        folder = tmp if isinstance(tmp, Path) else self.config.store_path / "tmp-dumps"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    async def write_after_blobs(
        self, writers: list[BlobWriter], fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """``commit_blobs(writers)``, then ``write(fn, ...)``: the blobs durable before the state write
        that names them (docs/architecture.md invariant 2). A batch whose blobs the store commits as one
        ``small.db`` transaction (``FileBlobStore.commits_inline``) is committed in the write's own
        thread hop, just before ``fn``: one hop where there were two. Why: a small Source's batch of a
        few resources paid a hop for its blobs and one for its rows, and the hops (each a GIL handoff
        with the busy event loop) were much of a small Source's cost (benchmarks/bench_many_sources.py).
        Should the blobs fail to commit, ``fn`` does not run and the error is the caller's, as before."""
        inline = getattr(self.blobs, "commits_inline", None)
        if not writers or inline is None or not inline(writers):
            await self.commit_blobs(writers)
            return await self.write(fn, *args, **kwargs)
        return await self.write(AfterBlobs(writers, self.blobs.commit, fn, *args, **kwargs))

    async def commit_blobs(self, writers: list[BlobWriter]) -> None:
        """Make blobs durable before any state row names them (docs/architecture.md invariant 2)."""
        if not writers:
            return
        import trio

        steps = getattr(self.blobs, "commit_steps", None)
        if steps is None:
            await trio.to_thread.run_sync(self.blobs.commit, writers, abandon_on_cancel=False)
            return
        # The quick per-blob steps run here, only the syncs in a thread (FileBlobStore.commit_steps: run
        # whole in a thread, each of its syscalls handed the GIL back and forth with this busy loop).
        for slow in steps(writers):
            await trio.to_thread.run_sync(slow, abandon_on_cancel=False)


def prepare_store(config: Config, *, create: bool = True) -> Path:
    """The store folder, created if needed (``create``) and proven writable; a ConfigError naming
    ``store.path`` when it cannot be used (a file in the way, a read-only or virtual file system).

    Without ``create`` (``rsagg status``) a missing folder is fine when it could be created."""
    root = config.store_path
    try:
        if create:
            root.mkdir(parents=True, exist_ok=True)
        elif not root.exists():
            parent = next(p for p in root.parents if p.exists())  # "/" exists
            if not parent.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(parent))
            os.rmdir(tempfile.mkdtemp(prefix=".rsagg-probe-", dir=parent))
            return root
        if not root.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(root))
        with tempfile.TemporaryFile(dir=root, prefix=".rsagg-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(
            config.file, "store.path", f"cannot use {str(root)!r} as the store folder: {exc.strerror or exc}"
        ) from None
    return root


def store_recipe(config: Config, plugins: Plugins) -> StoreRecipe:
    """How ``[store] backend`` is built: the factory the plugin registered, the settings, the path; a
    ConfigError naming ``store.backend`` when no plugin registered that backend."""
    from .offload import StoreRecipe

    factories = plugins.merged("rsagg_blob_stores")
    name = config.store.backend
    if name not in factories:
        known = ", ".join(sorted(factories))
        raise ConfigError(config.file, "store.backend", f"no storage backend {name!r} (registered: {known})")
    return StoreRecipe(factories[name], dict(config.store.settings), config.store_path)


def open_blob_store(config: Config, plugins: Plugins) -> BlobStore:
    """The blob store ``[store] backend`` names, built by the plugin that registered it; a ConfigError
    naming ``store.backend`` or ``store.settings`` when the backend cannot be built with its settings."""
    recipe = store_recipe(config, plugins)
    name = config.store.backend
    try:
        store = recipe.factory(dict(recipe.settings), recipe.path)
    except (ValueError, TypeError, ImportError) as exc:  # a missing library, a missing or wrong setting
        key = (
            "store.backend"
            if isinstance(exc, ImportError) or "not installed" in str(exc)
            else "store.settings"
        )
        raise ConfigError(config.file, key, f"backend {name!r} cannot start: {exc}") from None
    except OSError as exc:
        raise ConfigError(
            config.file, "store.path", f"backend {name!r} cannot use {str(config.store_path)!r}: {exc}"
        ) from None
    # A backend written for an older interface fails here, by name, not at its first request.
    missing = [m for m in BLOB_STORE_METHODS if not callable(getattr(store, m, None))]
    if missing:
        close = getattr(store, "close", None)
        if callable(close):
            close()
        raise ConfigError(
            config.file, "store.backend",
            f"backend {name!r} lacks {', '.join(missing)} of the blob store interface (docs/plugins.md)",
        )  # fmt: skip
    return store
