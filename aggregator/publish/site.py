"""The one place a publishing ``Site`` is put together.

Documents, resource GETs, dumps and notifications are all views of the same published sets; built in
one function they cannot drift apart (a publish filter that reached the lists but not the dump packages
would ship hidden resources inside the ZIPs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from ..config import Config
from ..plugins.manager import Plugins
from ..store.interface import StateStore
from ..store.rows import Resource
from ..store.sets import published_sets
from .documents import DumpsAvailable, ExtraCapabilities, Site, no_dumps, no_extra_capabilities, show_all
from .links import LinkPolicy, PluginLinks


def publish_filter(plugins: Plugins) -> Callable[[str, Resource], bool]:
    """``visible(set name, resource)``: hidden when any plugin's ``rsagg_filter_publish`` answers False.
    When no plugin implements it, no plugin call is made per entry (lists of millions)."""
    if not plugins.pm.hook.rsagg_filter_publish.get_hookimpls():
        return show_all

    def visible(set_name: str, resource: Resource) -> bool:
        results = plugins.call("rsagg_filter_publish", set_name=set_name, resource=resource)
        return all(answer is not False for answer in results)

    return visible


def link_policy(config: Config, plugins: Plugins) -> PluginLinks:
    """The configured link policy (§14.8) behind the plugins' ``rsagg_republish_links``."""
    return PluginLinks(plugins, LinkPolicy.from_config(config.publish))


def view_fingerprint(config: Config, plugins: Plugins) -> str:
    """What decides which resources a published view shows and how it writes them, as a short name: the
    plugins (names, versions, which are disabled) with their global and per-source settings, the
    published sets, the base URL and the link policy. A dump built under another fingerprint may hold
    what the publish filter now hides: it is withdrawn and built again (publish/dumps.py)."""
    parts = (
        config.server.base_url,
        sorted(plugins.versions.items()),
        sorted(plugins.disabled),
        sorted((k, repr(v)) for k, v in plugins.context.global_settings.items()),
        sorted((k, repr(v)) for k, v in plugins.context.source_settings.items()),
        repr(config.sets),
        config.publish.changelist_size,
        config.publish.keep_collection_links,
        config.publish.keep_canonical_links,
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def build_site(
    config: Config,
    state: StateStore,
    *,
    policy: PluginLinks,
    visible: Callable[[str, Resource], bool],
    dumps_available: DumpsAvailable = no_dumps,
    extra_capabilities: ExtraCapabilities = no_extra_capabilities,
) -> Site:
    """The published sets as ``state`` has them now, with the policies every view applies (blocking)."""
    return Site(
        base_url=config.server.base_url,
        sets=published_sets(config, state.sets()),
        policy=policy,
        changelist_size=config.publish.changelist_size,
        dumps_available=dumps_available,
        visible=visible,
        extra_capabilities=extra_capabilities,
    )


__all__ = ["build_site", "link_policy", "publish_filter", "view_fingerprint"]
