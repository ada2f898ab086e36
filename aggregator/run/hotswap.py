"""An ASGI app that a configuration reload can replace while the server keeps its socket.

hypercorn serves one app and drives one lifespan. ``HotSwapApp`` is that app: it forwards requests to
the current inner app and runs each inner app's own ASGI lifespan (startup before its first request,
shutdown when it is replaced or the server stops), so an inner app that opens things at startup and
closes them at shutdown (the publisher's read-connection pool) keeps working across swaps. Requests
already running finish on the app they started on.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import trio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("rsagg.daemon")


class LifespanError(RuntimeError):
    """The inner app refused to start (``lifespan.startup.failed``)."""


class _Lifespan:
    """One inner app's lifespan protocol, run in a task of its own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self._to_app, self._app_inbox = trio.open_memory_channel[Message](1)
        self._to_us, self._replies = trio.open_memory_channel[Message](1)
        self._stopped = False

    async def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._run, name="lifespan")
        try:
            await self._to_app.send({"type": "lifespan.startup"})
        except trio.BrokenResourceError:  # returned at once: no lifespan support
            return
        reply = await self._reply()
        if reply is not None and reply["type"] == "lifespan.startup.failed":
            raise LifespanError(reply.get("message") or "startup failed")

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            await self._to_app.send({"type": "lifespan.shutdown"})
        except trio.BrokenResourceError:  # the app's lifespan already returned
            return
        reply = await self._reply()
        if reply is not None and reply["type"] == "lifespan.shutdown.failed":
            log.warning("publisher app shutdown failed: %s", reply.get("message"))

    async def _reply(self) -> Message | None:
        """The app's answer, or None when it returned without one (no lifespan support: fine)."""
        try:
            return await self._replies.receive()
        except trio.EndOfChannel:
            return None

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self.state}
        try:
            async with self._to_us, self._app_inbox:
                await self.app(scope, self._app_inbox.receive, self._to_us.send)
        except Exception as exc:  # ASGI: an app without lifespan support raises; it just gets none
            log.debug("app without lifespan support (%s: %s)", type(exc).__name__, exc)


class HotSwapApp:
    """The app hypercorn serves; ``await swap.replace(new_app)`` switches to another inner app."""

    def __init__(self, app: ASGIApp, nursery: trio.Nursery) -> None:
        self._current = _Lifespan(app)
        self._nursery = nursery
        #: ``state.fast_lane``: the current inner app's (``serverguard``'s fast lane asks it once).
        self.state = SimpleNamespace(fast_lane=self._fast_lane)

    async def _fast_lane(self, method: bytes, target: bytes) -> Any:
        lane = getattr(getattr(self._current.app, "state", None), "fast_lane", None)
        return None if lane is None else await lane(method, target)

    @property
    def app(self) -> ASGIApp:
        return self._current.app

    async def replace(self, app: ASGIApp) -> None:
        """Start ``app``'s lifespan, route new requests to it, then shut the old one down.

        Raises ``LifespanError`` (and keeps the old app) when the new one fails to start.
        """
        new = _Lifespan(app)
        await new.start(self._nursery)
        old, self._current = self._current, new
        await old.stop()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._serve_lifespan(receive, send)
            return
        current = self._current
        await current.app({**scope, "state": dict(current.state)}, receive, send)

    async def _serve_lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self._current.start(self._nursery)
                except LifespanError as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._current.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return
