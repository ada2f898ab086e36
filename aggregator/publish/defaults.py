"""The default link policy (§14.8), as a plugin: another plugin answering first overrides it."""

from __future__ import annotations

from ..hookspecs import hookimpl


@hookimpl
def rsagg_republish_links(plugin, set_name, resource, uri_of, record):
    from .links import LinkPolicy  # the state's modules: loaded when publishing asks, not here

    s = plugin.settings("linkpolicy")
    policy = LinkPolicy(bool(s.get("keep_collection", False)), bool(s.get("keep_canonical", False)))
    return policy.links(resource, uri_of=uri_of, record=record)
