"""When rsagg builds its dumps (§11, §13): a daemon task over ``publish/dumps.py``.

Every ``publish.dump_interval`` seconds each published set gets a new Resource Dump (the builder skips a
set that did not change since its last run); every minute the Change Dump packages of Change List windows
that closed since are built (a closed window never changes, so each is built once). ``dump_interval = 0``
turns dumps off: the Capability Lists then advertise none.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

import trio

from ..config import Config
from ..plugins import Plugins
from ..store.blobs import BlobStore
from ..store.interface import StateStore
from ..store.state import open_state
from .documents import Site
from .dumps import DumpBuilder, dump_routes
from .site import build_site, link_policy, publish_filter

log = logging.getLogger("rsagg.publish")

#: Seconds between looks for newly closed Change List windows.
CHANGE_DUMP_PERIOD = 60.0


class DumpContext(Protocol):
    """What the dump schedule needs of the daemon's context (the harvest context provides it; publish/
    does not import harvest/). ``dumps`` holds the process's one DumpBuilder once built."""

    config: Config
    blobs: BlobStore
    plugins: Plugins
    dumps: Any


def dump_builder(ctx: DumpContext) -> DumpBuilder | None:
    """The process's one DumpBuilder (None when dumps are off), kept on the context."""
    config = ctx.config
    if config.publish.dump_interval <= 0:
        return None
    builder = getattr(ctx, "dumps", None)
    if builder is None:
        state = open_state(config)
        builder = DumpBuilder(state, ctx.blobs, base_url=config.server.base_url)
        ctx.dumps = builder
    return builder


def dump_app_options(ctx: DumpContext, options: dict[str, Any]) -> dict[str, Any]:
    """``create_app`` keyword arguments with the dump routes and the dumps a Capability List lists."""
    builder = dump_builder(ctx)
    if builder is None:
        return options
    return {
        **options,
        "extra_routes": [*options.get("extra_routes", ()), *dump_routes(builder)],
        "dumps_available": builder.available,
    }


def _site(ctx: DumpContext, state: StateStore) -> Site:
    """The Site the app serves (sets, link policy, publish filter): a package holds what the lists show."""
    plugins = ctx.plugins
    return build_site(
        ctx.config, state, policy=link_policy(ctx.config, plugins), visible=publish_filter(plugins)
    )


def build_due(builder: DumpBuilder, ctx: DumpContext, *, resource_dumps: bool) -> int:
    """Build what is due for every published set (blocking: call it in a worker thread)."""
    builder.site = _site(ctx, builder.state)
    built = 0
    for ps in builder.site.sets.values():
        built += len(builder.build_change_dumps(ps.name, ps.set_ids, ctx.config.publish.changelist_size))
        if resource_dumps:
            built += len(builder.build_resource_dump(ps.name, ps.set_ids))
    return built


async def run_dumps(ctx: DumpContext, stop_when: Callable[[], Awaitable[Any]]) -> None:
    """The daemon task: Resource Dumps on their interval, Change Dump packages as windows close; ends
    when ``stop_when()`` returns (the daemon's shutdown)."""
    builder = dump_builder(ctx)
    if builder is None:
        return
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_build_forever, ctx, builder)
        await stop_when()
        nursery.cancel_scope.cancel()


async def _build_forever(ctx: DumpContext, builder: DumpBuilder) -> None:
    next_resource_dump = trio.current_time()
    while True:
        due = trio.current_time() >= next_resource_dump
        try:
            # abandon_on_cancel: a stop must not wait for a long build. An abandoned build dies with the
            # process before its rows commit (one transaction after its blobs), leaving temp files only.
            built = await trio.to_thread.run_sync(
                partial(build_due, builder, ctx, resource_dumps=due), abandon_on_cancel=True
            )
            if built:
                log.info("built %d dump package(s)", built)
        except Exception as exc:  # a failed dump must not stop the daemon; the next round tries again
            log.error("building dumps failed: %s: %s", type(exc).__name__, exc)
        if due:
            next_resource_dump = trio.current_time() + ctx.config.publish.dump_interval
        await trio.sleep(min(CHANGE_DUMP_PERIOD, max(1.0, next_resource_dump - trio.current_time())))
