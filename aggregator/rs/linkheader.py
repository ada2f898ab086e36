"""RFC 8288 ``Link`` headers: how ResourceSync documents point at each other over HTTP.

ResourceSync discovery reads ``rel="resourcesync"`` links (§6.3.3); a notification names its topic
``rel="self"``, its hub ``rel="hub"`` and the Capability List ``rel="resourcesync"`` (Notification §4.1,
§4.3). The harvester's discovery and the WebSub hub both parse them here, so neither imports the other.
"""

from __future__ import annotations

import re
from urllib.parse import urljoin

_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_QUOTED = r'"(?:[^"\\]|\\.)*"'
_LINK_VALUE = re.compile(rf"<([^>]*)>((?:\s*;\s*{_TOKEN}\s*(?:=\s*(?:{_QUOTED}|[^;,\s]*))?)*)")
_LINK_PARAM = re.compile(rf";\s*({_TOKEN})\s*(?:=\s*({_QUOTED}|[^;,\s]*))?")


def parse_link_header(value: str | None) -> list[tuple[str, dict[str, str]]]:
    """RFC 8288 ``Link`` header -> [(target, {param: value})], parameter names lower-cased."""
    out: list[tuple[str, dict[str, str]]] = []
    for m in _LINK_VALUE.finditer(value or ""):
        params: dict[str, str] = {}
        for p in _LINK_PARAM.finditer(m.group(2)):
            v = p.group(2) or ""
            if v.startswith('"'):
                v = re.sub(r"\\(.)", r"\1", v[1:-1])
            params.setdefault(p.group(1).lower(), v)
        out.append((m.group(1).strip(), params))
    return out


def links_with_rel(value: str | None, rel: str, base: str) -> list[str]:
    """Absolute targets of the Link header entries whose ``rel`` includes ``rel`` (§6.3.3)."""
    return [
        urljoin(base, target)
        for target, params in parse_link_header(value)
        if rel in params.get("rel", "").lower().split()
    ]


__all__ = ["links_with_rel", "parse_link_header"]
