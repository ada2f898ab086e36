"""A real HTTP server for trio tests: any ASGI app served by hypercorn on 127.0.0.1, on a port the OS picks.

Usage (inside a trio test; pytest-trio runs ``async def`` tests)::

    from tests.httpserver import serve_app

    async def test_something():
        async with serve_app(app) as base_url:      # e.g. "http://127.0.0.1:40123"
            ...                                      # talk to f"{base_url}/path"

The server runs in its own nursery and is shut down (gracefully, briefly) when the block ends, so
nothing outlives the test. Close clients before leaving the block (``async with serve_app(app) as
base, Fetcher() as f:`` does that: the inner context exits first), otherwise idle keep-alive
connections make the shutdown wait up to ``graceful_timeout``.

Why bind port 0 through hypercorn: ``hypercorn.trio.serve`` reports the addresses it actually bound
through ``task_status.started``, so the port is known without a race (no "pick a free port, hope it stays
free" step).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve


@asynccontextmanager
async def serve_app(
    app: Any, *, host: str = "127.0.0.1", graceful_timeout: float = 0.5
) -> AsyncIterator[str]:
    """Serve the ASGI ``app`` on ``host`` at a free port; yields the base URL (no trailing slash)."""
    config = Config()
    config.bind = [f"{host}:0"]
    config.graceful_timeout = graceful_timeout
    config.accesslog = None
    config.loglevel = "WARNING"  # no "Running on ..." chatter in test output
    shutdown = trio.Event()
    # The test's own exception is carried out of the nursery by hand, so that it reaches the test (and
    # ``pytest.raises``) as itself rather than wrapped in an ExceptionGroup.
    error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(partial(serve, app, config, shutdown_trigger=shutdown.wait))
        try:
            yield binds[0].rstrip("/")
        except BaseException as exc:
            error = exc
        finally:
            shutdown.set()
    if error is not None:
        raise error
