"""The daemon: one trio nursery holding the per-source harvest tasks and the HTTP server.

SIGTERM/SIGINT cancel the nursery: in-flight blob commits and state transactions run in worker threads
that are not abandoned on cancel, so they finish before the process exits (ARCHITECTURE invariant 2).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable

import trio

from .config import Config
from .harvest.context import HarvestContext, open_context
from .harvest.source import poll_source
from .serving import serve

log = logging.getLogger("rsagg.daemon")


def _listen(config: Config) -> tuple[str, int]:
    host, _, port = config.server.listen.rpartition(":")
    return host.strip("[]"), int(port)


async def run_daemon(
    config: Config,
    *,
    harvest: bool = True,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    on_ready: Callable[[HarvestContext, str], Awaitable[None]] | None = None,
) -> None:
    """Serve and harvest until SIGTERM/SIGINT (or cancellation); ``task_status`` gets the bound URL."""
    from .publish.app import create_app  # the publisher is optional for harvest-only commands

    async with open_context(config) as ctx, trio.open_nursery() as nursery:
        app = create_app(config, blobs=ctx.blobs, state_path=config.store_path / "state.db")
        host, port = _listen(config)
        bound = await nursery.start(serve, app, host, port)
        log.info("serving %s on %s", config.server.base_url, bound)
        if harvest:
            for src in config.sources:
                if src.enabled:
                    nursery.start_soon(poll_source, ctx, src)
        nursery.start_soon(_signals, nursery.cancel_scope)
        if on_ready is not None:
            await on_ready(ctx, bound)
        task_status.started(bound)


async def _signals(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s: stopping (in-flight commits finish first)", signal.Signals(signum).name)
            scope.cancel()
            return
