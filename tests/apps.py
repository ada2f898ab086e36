"""Publisher apps and dump builders for tests, built as the composition builds them (run/parts.py).

A test names only what it cares about; the plugins of the configuration and a Metrics of the test's
own are filled in, as ``run/compose.py`` fills in the daemon's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.applications import Starlette

from aggregator.config import Config
from aggregator.observe.metrics import Metrics
from aggregator.plugins.manager import Plugins
from aggregator.publish.dumps import DumpBuilder
from aggregator.run import parts
from aggregator.store.blobs import BlobStore


def create_app(
    config: Config,
    *,
    blobs: BlobStore,
    state_path: Path | str | None = None,
    plugins: Plugins | None = None,
    metrics: Metrics | None = None,
    **options: Any,
) -> Starlette:
    """The publisher app for ``config`` (``run/parts.py``'s ``publisher_app``)."""
    plugins = plugins if plugins is not None else parts.load_plugins(config)
    if metrics is None:
        metrics = Metrics(plugins=parts.every_plugins(plugins), store=blobs)
    return parts.publisher_app(
        config, blobs=blobs, plugins=plugins, metrics=metrics, state_path=state_path, **options
    )


def open_dump_builder(config: Config, blobs: BlobStore, plugins: Plugins | None = None) -> DumpBuilder | None:
    """The dump builder for ``config`` and its plugins, for good (``run/parts.py``'s ``dump_builder``)."""
    plugins = plugins if plugins is not None else parts.load_plugins(config)
    return parts.dump_builder(config, blobs, get_config=lambda: config, get_plugins=lambda: plugins)
