"""Helpers for notification tests and benchmarks: rsagg nodes in-process, a flask-websub hub, waits.

- ``rsagg_node(config)``: ``run_daemon`` in this trio run (the real daemon: server, sources, hub,
  notifier, subscriber), yields the bound URL; cancelled (and so stopped) when the block ends.
- ``flask_hub(folder)``: flask-websub 0.4.1 — a WebSub hub nobody here wrote — served by werkzeug's
  threaded server on 127.0.0.1 in a thread of its own, Celery with ``task_always_eager`` (no broker:
  the hub's tasks run inside its requests, so it verifies a subscription *before* answering the
  subscription request, and fetches + delivers before answering a publish ping). Stopped on exit.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import trio

from aggregator.config import Config, parse_config
from aggregator.harvest.context import HarvestContext
from aggregator.run.daemon import run_daemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_config(
    folder: Path,
    upstream: str,
    *,
    name: str = "up",
    notifications: dict[str, Any] | None = None,
    source: dict[str, Any] | None = None,
    harvest: dict[str, Any] | None = None,
) -> Config:
    """An rsagg harvesting ``upstream`` (a Source Description or Capability List URL) as source ``name``."""
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"retries": 2, "backoff_base": 0.01, "backoff_max": 0.05, "timeout": 10, "jitter": 0.0}
    return parse_config(
        {
            "server": {"listen": f"127.0.0.1:{port}", "base_url": f"http://127.0.0.1:{port}"},
            "store": {"path": str(folder / "data")},
            "harvest": {**settings, **(harvest or {})},
            "sources": [{"name": name, "url": upstream, **(source or {})}],
            "notifications": notifications or {},
        },
        str(folder / "rsagg.toml"),
    )


@asynccontextmanager
async def rsagg_node(config: Config) -> AsyncIterator[tuple[str, HarvestContext]]:
    """The daemon in-process; yields (bound URL, its HarvestContext)."""
    got: dict[str, HarvestContext] = {}

    async def ready(ctx: HarvestContext, bound: str) -> None:
        got["ctx"] = ctx

    error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(run_daemon, config, on_ready=ready))
        try:
            yield url, got["ctx"]
        except BaseException as exc:
            error = exc
        finally:
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error


async def wait_until(cond: Callable[[], Any], what: str, limit: float = 20.0) -> None:
    """Poll ``cond`` (a hang guard, not a timing assertion: the limit is far above any real need)."""
    with trio.move_on_after(limit):
        while not cond():
            await trio.sleep(0.01)
        return
    raise AssertionError(f"gave up waiting for: {what}")


@contextmanager
def flask_hub(folder: Path, **hub_config: Any) -> Iterator[str]:
    """A flask-websub hub at ``http://127.0.0.1:PORT/hub``; yields that URL."""
    from celery import Celery
    from flask import Flask
    from flask_websub.hub import Hub, SQLite3HubStorage
    from werkzeug.serving import make_server

    folder.mkdir(parents=True, exist_ok=True)
    celery = Celery("flask_websub_test", broker="memory://", backend="cache+memory://")
    celery.conf.task_always_eager = True
    celery.conf.task_eager_propagates = False
    app = Flask("flask_websub_test")
    settings = {
        "PUBLISH_SUPPORTED": True,
        "HUB_MIN_LEASE_SECONDS": 1,
        "REQUEST_TIMEOUT": 3,
        "MAX_ATTEMPTS": 2,  # eager retries run at once, inside the request: keep them few
        "BACKOFF_BASE": 0.1,
        **hub_config,
    }
    app.config.update(settings)
    hub = Hub(SQLite3HubStorage(str(folder / "hub.db")), celery, **settings)
    app.register_blueprint(hub.build_blueprint(url_prefix="/hub"))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="flask-websub", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hub"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
