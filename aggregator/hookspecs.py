"""rsagg's plugin hooks: each one a seam in the flow upstream → harvest → store → publish.

Every hook may be implemented by any plugin; built-in behaviour is itself registered as default plugins
(each stage's ``defaults.py``), so these are the paths rsagg really takes. A hook may return an
awaitable where noted (it is awaited). ``plugin`` is a ``PluginContext``: ``plugin.settings(name,
source=None)`` gives a plugin its own settings table from the configuration.
"""

from __future__ import annotations

from pluggy import HookimplMarker, HookspecMarker

hookspec = HookspecMarker("rsagg")
hookimpl = HookimplMarker("rsagg")


@hookspec
def rsagg_blob_stores():
    """Register storage backends: return ``{name: factory(settings: dict, root: Path) -> BlobStore}``."""


@hookspec
def rsagg_patch_formats():
    """Register patch appliers (§14.4): return ``{media type: apply(current, patch) -> new bytes}``."""


@hookspec
def rsagg_filter_harvest(plugin, source, entry, metadata):
    """Decide whether an upstream entry is harvested: False skips it, None has no say (may be awaitable)."""


@hookspec
def rsagg_filter_publish(plugin, set_name, resource):
    """Decide whether a stored resource is republished: False hides it, None has no say."""


@hookspec(firstresult=True)
def rsagg_republish_links(plugin, set_name, resource, uri_of, record):
    """Return the links a resource is republished with (§14.8); the first non-None answer wins."""


@hookspec
def rsagg_resource_stored(plugin, source, set_name, uri, change, sha256):
    """A created or updated resource was committed to the store."""


@hookspec
def rsagg_resource_deleted(plugin, source, set_name, uri):
    """A resource was deleted (tombstoned) in the store."""


@hookspec
def rsagg_change_published(plugin, set_name, seq, uri, change, datetime):
    """A change entered rsagg's own change log, and so its Change Lists and notifications."""


@hookspec
def rsagg_startup(plugin, config):
    """The daemon (or a one-shot command) has started with this configuration."""


@hookspec
def rsagg_shutdown(plugin):
    """The daemon is stopping; release what the plugin holds."""
