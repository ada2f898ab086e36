"""A real HTTP server for trio tests: any ASGI app on 127.0.0.1, on a port the OS picks.

Usage (inside a trio test)::

    async with serve_app(app) as base_url:      # e.g. "http://127.0.0.1:40123"
        ...

The server is shut down (gracefully, briefly) when the block ends, so nothing outlives the test. Close
clients before leaving the block, or idle keep-alive connections make the shutdown wait
``graceful_timeout``. The test's own exception leaves as itself, not wrapped in an ExceptionGroup.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

from aggregator.serving import serve


@asynccontextmanager
async def serve_app(
    app: Any, *, host: str = "127.0.0.1", graceful_timeout: float = 0.5
) -> AsyncIterator[str]:
    """Serve the ASGI ``app`` on ``host`` at a free port; yields the base URL (no trailing slash)."""
    shutdown = trio.Event()
    error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        base = await nursery.start(
            partial(serve, app, host, 0, shutdown_trigger=shutdown.wait, graceful_timeout=graceful_timeout)
        )
        try:
            yield base
        except BaseException as exc:
            error = exc
        finally:
            shutdown.set()
    if error is not None:
        raise error
