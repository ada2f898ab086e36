"""The link policy: which ``rs:ln`` of an upstream entry rsagg republishes, and how (spec §14, §14.8).

One place decides, for every republished entry (Resource List, Change List, dumps), so the rules are
the same everywhere (docs/architecture.md: plugins at the seams):

- exactly one ``rel="via"`` (§14.8): an upstream via link is kept unchanged (chained aggregation: "each
  aggregator should maintain only the existing via link"), else a new one to the upstream ``loc`` with
  the upstream's lastmod (else its change datetime) as ``modified`` and the hashes, length and type
  we verified;
- ``collection`` and ``canonical`` are dropped unless configured (§14.8: "may not be appropriate in the
  context of the aggregator's copy");
- ``duplicate`` is dropped: mirrors of the upstream are not mirrors of our copy (§14.2);
- ``http://www.openarchives.org/rs/terms/patch`` is dropped: patches go from the upstream's previous
  version, which need not be what a Destination of ours holds (§14.4);
- ``memento`` is dropped: rsagg names the memento of each version it holds itself (§14.6,
  publish/versions.py), and an upstream memento link stored with the current row would misdescribe
  every past version's record (its hash is the current version's);
- ``describedby``/``describes`` to a resource we harvested point at our copy (§14.5), else kept;
- everything else (alternate, timegate, timemap, license, profile, ...) is kept unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..config import PublishConfig
from ..rs.fixity import format_hash
from ..rs.model import PATCH_REL, Link
from ..store.rows import LogRecord, Resource

VIA = "via"
#: Relations whose target is another resource we may hold: rewritten to our copy (§14.5).
REWRITTEN = frozenset({"describedby", "describes"})
ALWAYS_DROPPED = frozenset({"duplicate", PATCH_REL, "memento"})


def _rel(link: Link) -> str:
    # Registered relation types compare case-insensitively (RFC 8288 §2.1.1); extension types are URIs.
    return link.rel if ":" in link.rel else link.rel.lower()


@dataclass(frozen=True)
class LinkPolicy:
    keep_collection: bool = False
    keep_canonical: bool = False

    @classmethod
    def from_config(cls, publish: PublishConfig) -> LinkPolicy:
        return cls(publish.keep_collection_links, publish.keep_canonical_links)

    def links(
        self,
        resource: Resource,
        *,
        uri_of: Callable[[str], str | None],
        record: LogRecord | None = None,
        set_name: str = "",
    ) -> list[Link]:
        """The links of ``resource``'s republished entry; ``uri_of(upstream uri)`` gives our URI of a
        resource we hold (None otherwise).

        ``record``: the entry is a Change List record rather than the current state. When it is a
        deletion or names another version than the row holds (superseded since), the via link carries
        only what is true of that version (href, and for our own via the record's sha-256/length/type).
        """
        dropped = set(ALWAYS_DROPPED)
        if not self.keep_collection:
            dropped.add("collection")
        if not self.keep_canonical:
            dropped.add("canonical")
        current = record is None or (record.change != "deleted" and record.sha256 == resource.sha256)
        via: Link | None = None
        out: list[Link] = []
        for ln in resource.links:
            rel = _rel(ln)
            if rel == VIA:
                if via is None or ln.priority < via.priority:
                    via = ln
                continue
            if rel in dropped:
                continue
            if rel in REWRITTEN:
                ours = uri_of(ln.href)
                if ours is not None:
                    ln = replace(ln, href=ours)
            out.append(ln)
        if via is not None:
            if not current:
                via = Link(VIA, via.href)
        elif current:
            via = Link(
                VIA,
                resource.uri,
                modified=resource.lastmod or resource.upstream_datetime,
                hash=format_hash(resource.hashes),
                length=resource.length,
                type=resource.type,
            )
        else:
            assert record is not None
            deleted = record.change == "deleted"
            via = Link(
                VIA,
                resource.uri,
                hash=None if deleted or not record.sha256 else format_hash({"sha-256": record.sha256}),
                length=None if deleted else record.length,
                type=None if deleted else record.type,
            )
        return [via, *out]


__all__ = ["LinkPolicy"]


class PluginLinks:
    """The link policy as the plugins decide it (``rsagg_republish_links``; the default plugin applies
    ``LinkPolicy``). Should every plugin fail, the built-in policy answers: exactly one via link is an
    invariant of republishing (§14.8), not something a broken plugin may take away."""

    def __init__(self, plugins, fallback: LinkPolicy | None = None) -> None:
        self.plugins = plugins
        self.fallback = fallback or LinkPolicy()
        #: The built-in policy when no other plugin implements the hook: applied without the plugin
        #: call (a list renders ~2x faster), with the settings the built-in plugin would read.
        self.direct: LinkPolicy | None = None
        impls = getattr(getattr(plugins, "pm", None), "hook", None)
        impls = impls.rsagg_republish_links.get_hookimpls() if impls is not None else None
        if impls is not None and [i.plugin_name for i in impls] == ["linkpolicy"]:
            s = plugins.context.settings("linkpolicy")
            self.direct = LinkPolicy(
                bool(s.get("keep_collection", False)), bool(s.get("keep_canonical", False))
            )

    def links(
        self,
        resource: Resource,
        *,
        uri_of: Callable[[str], str | None],
        record: LogRecord | None = None,
        set_name: str = "",
    ) -> list[Link]:
        if self.direct is not None:
            return self.direct.links(resource, uri_of=uri_of, record=record)
        links = self.plugins.first(
            "rsagg_republish_links", set_name=set_name, resource=resource, uri_of=uri_of, record=record
        )
        if links is None:
            return self.fallback.links(resource, uri_of=uri_of, record=record)
        return links
