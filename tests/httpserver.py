"""A real HTTP server for trio tests: any ASGI app on 127.0.0.1, on a port the OS picks.

Usage (inside a trio test)::

    async with serve_app(app) as base_url:      # e.g. "http://127.0.0.1:40123"
        ...

The server is shut down (gracefully, briefly) when the block ends, so nothing outlives the test. Close
clients before leaving the block, or idle keep-alive connections make the shutdown wait
``graceful_timeout``. The test's own exception leaves as itself, not wrapped in an ExceptionGroup.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

from aggregator.run.serving import serving


def serve_app(
    app: Any, *, host: str = "127.0.0.1", graceful_timeout: float = 0.5
) -> AbstractAsyncContextManager[str]:
    """Serve the ASGI ``app`` on ``host`` at a free port; yields the base URL (no trailing slash)."""
    return serving(app, host, 0, graceful_timeout=graceful_timeout)


async def answer_lifespan(receive: Any, send: Any) -> None:
    """A raw ASGI app's answer to the server's lifespan messages (start-up, then shut-down)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        else:
            await send({"type": "lifespan.shutdown.complete"})
            return
