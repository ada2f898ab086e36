"""Harvest only the resources whose metadata record matches: the filtering §14.5 suggests.

§14.5: "a Destination can use the metadata that describes a resource as a filtering mechanism to only
synchronize with those resources that meet its metadata-based selection criteria". The record is the
resource an entry links with ``rs:ln rel="describedby"``; rsagg fetches it (once, cached for the run)
when this filter asks for it through the ``metadata(entry)`` callable, before fetching the resource.

Configuration, globally and/or per source (the source's table overlays the global one key by key)::

    [plugins.metadatafilter]
    # either a Dublin Core element and the values it may have (any of them; case-insensitive, trimmed;
    # elements of http://purl.org/dc/elements/1.1/ and http://purl.org/dc/terms/ both count) ...
    field = "type"
    values = ["Text", "Image"]
    # ... or an XPath 1.0 expression, true or non-empty for a matching record (context: the root element)
    xpath = "dc:type[. = 'Text'] and not(dc:rights = 'restricted')"
    namespaces = { dc = "http://purl.org/dc/elements/1.1/" }
    keep_without_record = false   # entries with no describedby link (e.g. the records themselves)
    max_record_bytes = 1048576    # bigger records do not match

    [[sources]]
    name = "library"
    url = "https://library.example.org/.well-known/resourcesync"
    plugins.metadatafilter = { field = "type", values = ["Text"] }

Given both ``field`` and ``xpath``, a record must satisfy both. A source whose effective settings give
neither is not filtered (the plugin has no say); ``plugins.metadatafilter = { enabled = false }`` on a
source turns it off there. Records are parsed with lxml hardened as everywhere in rsagg: no entity
expansion (a DOCTYPE declaring entities, or an entity reference, is refused), no network, no DTD
loading, libxml2's limits; a record that is too big, not well-formed or hostile does not match. When
``metadata(entry)`` gives no record (None) the entry is treated like one without a describedby link
(``keep_without_record``); when it raises, the filter has no say for that entry this time (the next
sync decides again).

Note that with ``keep_without_record = false`` the metadata records themselves (which have no
describedby link of their own) are not harvested; set it to true to keep every entry without a record.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aggregator.plugin_api import hookimpl, lazy_module

if TYPE_CHECKING:
    from lxml import etree
else:  # imported when a hook first uses it: ``rsagg status`` loads this module and calls no hook
    etree = lazy_module("lxml.etree", globals(), "etree")

log = logging.getLogger("rsagg.plugins.metadatafilter")

NAME = "metadatafilter"
DC_NAMESPACES = ("http://purl.org/dc/elements/1.1/", "http://purl.org/dc/terms/")
DEFAULT_MAX_RECORD_BYTES = 1024 * 1024
SETTINGS = frozenset(
    {"field", "values", "xpath", "namespaces", "keep_without_record", "max_record_bytes", "enabled"}
)
_HARDENED = {"resolve_entities": False, "no_network": True, "load_dtd": False, "huge_tree": False}


class RecordError(ValueError):
    """A metadata record that cannot be read: too big, not well-formed, or hostile."""


class Criteria:
    """What a record must satisfy, built once per distinct settings table."""

    def __init__(self, settings: dict[str, Any]) -> None:
        unknown = sorted(set(settings) - SETTINGS)
        if unknown:
            raise ValueError(
                f"{NAME}: unknown setting(s) {', '.join(unknown)} (known: {', '.join(sorted(SETTINGS))})"
            )
        self.field: str | None = settings.get("field")
        if self.field is not None and (not isinstance(self.field, str) or not self.field):
            raise ValueError(f"{NAME}: field must be a Dublin Core element name, not {self.field!r}")
        values = settings.get("values", [])
        if isinstance(values, str):
            values = [values]
        if not isinstance(values, list | tuple) or not all(isinstance(v, str) for v in values):
            raise ValueError(f"{NAME}: values must be a list of strings, not {values!r}")
        if self.field is not None and not values:
            raise ValueError(f"{NAME}: field {self.field!r} needs values")
        self.values = frozenset(_normalize(v) for v in values)
        namespaces = settings.get("namespaces", {})
        if not isinstance(namespaces, dict) or not all(isinstance(v, str) for v in namespaces.values()):
            raise ValueError(f"{NAME}: namespaces must be a table of prefix = URI, not {namespaces!r}")
        expr = settings.get("xpath")
        self.xpath: etree.XPath | None = None
        if expr is not None:
            if not isinstance(expr, str):
                raise ValueError(f"{NAME}: xpath must be a string, not {expr!r}")
            try:
                self.xpath = etree.XPath(expr, namespaces=namespaces)
            except etree.XPathSyntaxError as exc:
                raise ValueError(f"{NAME}: bad xpath {expr!r}: {exc}") from None
        self.keep_without_record = settings.get("keep_without_record", False)
        if not isinstance(self.keep_without_record, bool):
            raise ValueError(f"{NAME}: keep_without_record must be true or false")
        self.max_bytes = settings.get("max_record_bytes", DEFAULT_MAX_RECORD_BYTES)
        if not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool) or self.max_bytes < 1:
            raise ValueError(f"{NAME}: max_record_bytes must be a positive integer")

    @property
    def active(self) -> bool:
        return self.field is not None or self.xpath is not None

    def matches(self, record: bytes) -> bool:
        """Whether a record satisfies the criteria; RecordError when it cannot be read."""
        root = parse_record(record, self.max_bytes)
        if self.field is not None:
            tags = {f"{{{ns}}}{self.field}" for ns in DC_NAMESPACES}
            found = {_normalize("".join(el.itertext())) for el in root.iter(*tags)}
            if not found & self.values:
                return False
        if self.xpath is not None:
            try:
                result = self.xpath(root)
            except etree.XPathEvalError as exc:  # e.g. an undefined prefix: reported, does not match
                raise RecordError(f"xpath failed on the record: {exc}") from None
            if not _truthy(result):
                return False
        return True


def _normalize(value: str) -> str:
    return " ".join(value.split()).casefold()


def _truthy(result: Any) -> bool:
    """XPath 1.0 ``boolean()`` of a result: node-sets non-empty, strings non-empty, numbers not 0/NaN."""
    if isinstance(result, bool):
        return result
    if isinstance(result, float):
        return result == result and result != 0
    if isinstance(result, list | str):
        return len(result) > 0
    return bool(result)


def parse_record(data: bytes, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> etree._Element:
    """Parse an untrusted record; its root element. Raises RecordError."""
    if len(data) > max_bytes:
        raise RecordError(f"record larger than {max_bytes} bytes")
    parser = etree.XMLParser(**_HARDENED)
    try:
        root = etree.fromstring(data, parser)
    except etree.XMLSyntaxError as exc:
        raise RecordError(f"record is not well-formed XML: {exc}") from None
    dtd = root.getroottree().docinfo.internalDTD
    if dtd is not None and any(True for _ in dtd.iterentities()):
        raise RecordError("record declares entities in its DOCTYPE (refused)")
    if next(root.iter(etree.Entity), None) is not None:
        raise RecordError("record contains an entity reference (refused)")
    return root


@functools.lru_cache(maxsize=256)
def _criteria(frozen: str) -> Criteria:
    return Criteria(json.loads(frozen))


def criteria_for(settings: dict[str, Any]) -> Criteria:
    """The criteria of a settings table (built once per distinct table); ValueError when invalid."""
    return _criteria(json.dumps(settings, sort_keys=True, default=str))


def has_record_link(entry: Any) -> bool:
    return any(ln.rel.lower() == "describedby" for ln in entry.links)


async def _decide(
    criteria: Criteria, source: str | None, entry: Any, metadata: Callable[[Any], Awaitable[bytes | None]]
) -> bool | None:
    try:
        record = await metadata(entry)
    except Exception as exc:  # transient fetch problems: no say this time (a later sync decides)
        log.warning("source=%s %s: metadata record not fetched: %s", source, entry.loc, exc)
        return None
    if record is None:
        return criteria.keep_without_record
    try:
        return criteria.matches(record)
    except RecordError as exc:
        log.warning("source=%s %s: metadata record unreadable, not matching: %s", source, entry.loc, exc)
        return False


@hookimpl
def rsagg_filter_harvest(plugin, source, entry, metadata):
    """Synchronous when it has no say; otherwise a coroutine the harvester awaits (``Plugins.acall``)."""
    settings = plugin.settings(NAME, source)
    if settings.get("enabled") is False:
        return None
    criteria = criteria_for(settings)
    if not criteria.active:
        return None
    if not has_record_link(entry):
        return criteria.keep_without_record
    if metadata is None:
        return None
    return _decide(criteria, source, entry, metadata)


@hookimpl
def rsagg_startup(plugin, config):
    """Check every source's settings once at start, so a mistake is reported before the first harvest."""
    criteria_for(plugin.settings(NAME))
    for src in config.sources:
        criteria_for(plugin.settings(NAME, src.name))
