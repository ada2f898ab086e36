"""An example rsagg plugin: a log of harvest events in a file, and resources hidden from republishing.

Configuration (``example`` is the entry-point name in this package's pyproject.toml)::

    [plugins.example]
    events_file = "/var/lib/rsagg/events.jsonl"  # one JSON object per line per event
    hide = '/drafts/'                            # regex: matching upstream URIs are not republished

    [[sources]]
    name = "museum"
    url = "https://museum.example.org/.well-known/resourcesync"
    plugins.example = { events_file = "/var/lib/rsagg/museum.jsonl" }  # this source's own events

Stored and deleted events of a source go to its own ``events_file`` when it has one (per-source settings
overlay ``[plugins.example]``); startup, shutdown and published changes go to the global one. Without
settings the plugin does nothing. rsagg calls hooks inline (on its event loop, or in the worker thread
building a document): this one appends a short line with ordinary file I/O, which is quick; a plugin
doing network I/O should hand the work to a queue or thread of its own instead of holding rsagg up.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from aggregator.plugin_api import hookimpl

NAME = "example"


def _event(plugin: Any, settings_of: str | None, /, **fields: Any) -> None:
    """Append one event to the events file of source ``settings_of`` (None: the global one)."""
    path = plugin.settings(NAME, settings_of).get("events_file")
    if not path:
        return
    line = json.dumps(fields, default=lambda v: v.isoformat() if isinstance(v, datetime) else str(v))
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


@hookimpl
def rsagg_startup(plugin, config):
    _event(plugin, None, event="startup", config=config.file)


@hookimpl
def rsagg_shutdown(plugin):
    _event(plugin, None, event="shutdown")


@hookimpl
def rsagg_resource_stored(plugin, source, set_name, uri, change, sha256):
    _event(plugin, source, event="stored", source=source, set=set_name, uri=uri, change=change, sha256=sha256)


@hookimpl
def rsagg_resource_deleted(plugin, source, set_name, uri):
    _event(plugin, source, event="deleted", source=source, set=set_name, uri=uri)


@hookimpl
def rsagg_change_published(plugin, set_name, seq, uri, change, datetime):
    _event(plugin, None, event="published", set=set_name, seq=seq, uri=uri, change=change, datetime=datetime)


@hookimpl
def rsagg_filter_publish(plugin, set_name, resource):
    """Hide resources whose upstream URI matches ``hide``; no say otherwise."""
    pattern = plugin.settings(NAME).get("hide")
    if pattern and re.search(pattern, resource.uri):
        return False
    return None
