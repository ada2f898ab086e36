"""Serving an ASGI app with hypercorn's trio worker (the daemon, the demo upstream and tests use this).

Every server is bounded per client (header and body size and time, slow readers, connections per
address): ``serverguard.py``.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import trio
from hypercorn.config import Config, Sockets
from starlette.types import ASGIApp

from .serverguard import ServerLimits, serve_guarded


async def serve(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout: float = 0.5,
    limits: ServerLimits | None = None,
    reuse_port: bool = False,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an ASGI app with hypercorn's trio worker until cancelled (or ``shutdown_trigger`` returns).

    ``base_url = await nursery.start(serve, app)`` binds (port 0: the OS picks a free port) and hands
    back ``http://host:port`` of the socket actually bound, so there is no pick-then-bind race.
    ``reuse_port``: bound with SO_REUSEPORT, so that other processes doing the same share the port (the
    kernel spreads the connections over them: ``server.workers``).
    """
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.loglevel = "WARNING"  # errors still reach stderr; no "Running on ..." lines
    config.graceful_timeout = graceful_timeout
    sockets = _reuse_port_socket(host, port, config.backlog) if reuse_port else None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(
                serve_guarded,
                app,
                config,
                limits or ServerLimits(),
                shutdown_trigger=shutdown_trigger,
                sockets=sockets,
            )
        )
        task_status.started(binds[0].rstrip("/"))


def _reuse_port_socket(host: str, port: int, backlog: int) -> Sockets:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[])


@asynccontextmanager
async def serving(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    graceful_timeout: float = 0.5,
    limits: ServerLimits | None = None,
) -> AsyncIterator[str]:
    """``async with serving(app) as base_url:`` serves for the duration of the block.

    Close HTTP clients before the block ends (idle keep-alive connections delay the graceful shutdown).
    An exception of the block leaves as itself, not wrapped in an ExceptionGroup, so ``pytest.raises``
    around the block works.
    """
    shutdown = trio.Event()
    error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        base_url = await nursery.start(
            partial(
                serve,
                app,
                host,
                port,
                shutdown_trigger=shutdown.wait,
                graceful_timeout=graceful_timeout,
                limits=limits,
            )
        )
        try:
            yield base_url
        except BaseException as exc:
            error = exc
        finally:
            shutdown.set()
    if error is not None:
        raise error
