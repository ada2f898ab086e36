"""rsagg URIs of republished resources <-> the upstream URIs they copy (spec §14.8).

An aggregator publishes its copy of a resource under its own URI and links the original with
``rel="via"``. The mapping must be a function of the upstream URI alone (stable across harvests),
collision-free (two upstream URIs never share an rsagg URI) and invertible (a request for an rsagg URI
names exactly one upstream URI, so the resource is found with one indexed lookup):

    BASE/SET/r/<scheme>/<rest>        for an upstream URI ``<scheme>://<rest>``
    BASE/SET/r/_/<whole URI>          for any other URI (``urn:...``, ``mailto:...``, no ``//``)

where ``<rest>`` (netloc, path, query, fragment) and ``<whole URI>`` are percent-encoded with
``urllib.parse.quote``: every character outside ``A-Z a-z 0-9 - . _ ~ ! $ & ' ( ) * + , ; = : @ /``
becomes ``%XX`` of its UTF-8 bytes. That turns ``?`` into ``%3F``, ``#`` into ``%23``, ``%`` into
``%25``, spaces, brackets and non-ASCII characters into escapes, and leaves the rest readable; a path
segment that is exactly ``.`` or ``..`` is written ``%2E``/``%2E%2E`` (clients remove dot segments), e.g.

    http://example.org/a/b.html?x=1   ->  BASE/SET/r/http/example.org/a/b.html%3Fx=1
    http://example.org/a%20b          ->  BASE/SET/r/http/example.org/a%2520b
    https://[::1]:8080/é              ->  BASE/SET/r/https/%5B::1%5D:8080/%C3%A9
    urn:isbn:0451450523               ->  BASE/SET/r/_/urn:isbn:0451450523
    http://example.org/a/../b         ->  BASE/SET/r/http/example.org/a/%2E%2E/b

Why it is injective: ``quote`` escapes ``%`` itself, so ``unquote(quote(s)) == s`` for every string
(the dot-segment escapes decode to dots too);
the scheme segment never contains ``/`` and ``_`` is not a scheme (schemes start with a letter, RFC
3986 §3.1), so the two forms cannot meet. The inverse decodes the path as received on the wire
(``raw_path``: a server's decoded ``path`` has already lost the difference between ``%2F`` and ``/``)
and accepts any equivalent escaping (``%3f``, an unescaped ``~``), so clients that normalise
percent-encoding still reach the resource.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from starlette.convertors import Convertor, register_url_convertor

#: RFC 3986 pchar minus "%" (plus "/"): kept as is in the rsagg path; everything else is escaped.
SAFE = "-._~!$&'()*+,;=:@/"
#: The path segment between ``/SET`` and the mapped URI.
RESOURCES = "r"
OPAQUE = "_"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*\Z")
_DOTS = {".": "%2E", "..": "%2E%2E"}


class NotAResourcePath(ValueError):
    """A path under ``/SET/r/`` that does not decode to an upstream URI."""


def _quote(text: str) -> str:
    """``quote`` plus dot segments: a segment that is exactly ``.`` or ``..`` would be removed by
    clients (RFC 3986 §5.2.4; httpx does it), so it goes out as ``%2E``/``%2E%2E``, which ``quote``
    never writes otherwise (``.`` is safe) and ``unquote`` turns back into dots."""
    quoted = quote(text, safe=SAFE)
    if "." not in quoted:
        return quoted
    return "/".join(_DOTS.get(seg, seg) for seg in quoted.split("/"))


def rsagg_path(upstream_uri: str) -> str:
    """The part of the rsagg URI after ``/SET/r/`` (no leading slash)."""
    scheme, sep, rest = upstream_uri.partition("://")
    if sep and _SCHEME.match(scheme):
        return f"{scheme}/{_quote(rest)}"
    return f"{OPAQUE}/{_quote(upstream_uri)}"


def rsagg_uri(base_url: str, set_name: str, upstream_uri: str) -> str:
    """``BASE/SET/r/...`` for an upstream URI (``base_url`` without a trailing slash)."""
    return f"{base_url}/{set_name}/{RESOURCES}/{rsagg_path(upstream_uri)}"


def upstream_uri(path: str) -> str:
    """Invert ``rsagg_path``: ``path`` is the raw (still percent-encoded) text after ``/SET/r/``.

    Raises NotAResourcePath when it cannot come from ``rsagg_path`` (no scheme segment, a bad scheme,
    escapes that are not UTF-8).
    """
    head, sep, tail = path.partition("/")
    if not sep:
        raise NotAResourcePath(f"no scheme segment in {path!r}")
    try:
        decoded = unquote(tail, errors="strict")
    except UnicodeDecodeError:
        raise NotAResourcePath(f"escapes in {path!r} are not UTF-8") from None
    if head == OPAQUE:
        scheme, sep, _ = decoded.partition("://")
        if not decoded or (sep and _SCHEME.match(scheme)):
            raise NotAResourcePath(f"{path!r} is not the form rsagg writes for {decoded!r}")
        return decoded
    if not _SCHEME.match(head):
        raise NotAResourcePath(f"{head!r} is not a URI scheme")
    return f"{head}://{decoded}"


def split_resource_path(raw_path: str) -> tuple[str, str] | None:
    """``/SET/r/<mapped>`` (raw request path) -> (SET, upstream URI); None when not of that form."""
    parts = raw_path.split("/", 3)
    if len(parts) != 4 or parts[0] != "" or parts[2] != RESOURCES or not parts[1]:
        return None
    try:
        return unquote(parts[1], errors="strict"), upstream_uri(parts[3])
    except (NotAResourcePath, UnicodeDecodeError):
        return None


def base_path(base_url: str) -> str:
    """The path of ``server.base_url`` without its trailing slash: ``""`` for ``http://host``,
    ``"/rsagg"`` for ``http://host/rsagg/`` (a reverse proxy publishing rsagg under a prefix)."""
    return urlsplit(base_url).path.rstrip("/")


def strip_base_path(path: bytes, prefix: bytes) -> bytes:
    """A request path with ``server.base_url``'s path taken off, when it carries it (a reverse proxy
    that passes the prefix on); as it came when it does not (a proxy that strips the prefix, or a
    client talking to rsagg directly). ``/rsagg`` alone is the home page."""
    if prefix and path.startswith(prefix) and (len(path) == len(prefix) or path[len(prefix)] in b"/?"):
        rest = path[len(prefix) :]
        return rest if rest[:1] == b"/" else b"/" + rest
    return path


class BasePath:
    """ASGI middleware, outermost: a request under ``server.base_url``'s path is routed as if the path
    were not there (``strip_base_path``). Every URL rsagg writes is absolute, from ``base_url``, so
    nothing needs ``root_path``."""

    def __init__(self, app: Any, prefix: str) -> None:
        self.app = app
        self.prefix = prefix.encode("utf-8")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.prefix and scope["type"] == "http":
            raw = scope.get("raw_path") or scope["path"].encode("utf-8")
            stripped = strip_base_path(raw, self.prefix)
            if stripped is not raw:
                path = strip_base_path(scope["path"].encode("utf-8"), self.prefix).decode("utf-8")
                scope = {**scope, "raw_path": stripped, "path": path}
        await self.app(scope, receive, send)


__all__ = [
    "BasePath",
    "NotAResourcePath",
    "base_path",
    "number",
    "rsagg_path",
    "rsagg_uri",
    "split_resource_path",
    "strip_base_path",
    "upstream_uri",
]


# ---------------------------------------------------------------------------------------------------
# Numbers in rsagg's own URLs (dump packages, Resource List parts, Change List windows)

#: Digits a number in a URL may have: 18 stay below 2**63 (SQLite's INTEGER, PostgreSQL's BIGINT), so a
#: number a route accepts can always be compared in SQL. Longer: no route matches (404), where starlette's
#: ``int`` convertor took any length and the state raised OverflowError (a 500).
MAX_DIGITS = 18


class _Seq(Convertor[int]):
    """A non-negative number of at most ``MAX_DIGITS`` ASCII digits (``{name:seq}`` in a route)."""

    regex = f"[0-9]{{1,{MAX_DIGITS}}}"

    def convert(self, value: str) -> int:
        return int(value)

    def to_string(self, value: int) -> str:
        return str(int(value))


class _SeqOrEnd(Convertor[int | None]):
    """``_Seq``, or ``end`` (None): the upper bound of a Resource List part (``{hi:seqend}``)."""

    regex = f"[0-9]{{1,{MAX_DIGITS}}}|end"

    def convert(self, value: str) -> int | None:
        return None if value == "end" else int(value)

    def to_string(self, value: int | None) -> str:
        return "end" if value is None else str(int(value))


register_url_convertor("seq", _Seq())
register_url_convertor("seqend", _SeqOrEnd())


def number(name: str, *, or_end: bool = False) -> str:
    """A route's path parameter for a number that reaches SQL: ``{name:seq}`` (or ``{name:seqend}``)."""
    return f"{{{name}:{'seqend' if or_end else 'seq'}}}"
