"""Updating a resource from a patch instead of fetching it whole (§14.4).

A Change List entry may carry ``<rs:ln rel="http://www.openarchives.org/rs/terms/patch" type=...>``: a
description of the change from the previous version. When we hold that previous version and know the
patch format, we fetch the (small) patch, apply it, and keep the result only when it matches the hash
(and length) announced for the new version in ``rs:md``; otherwise the caller fetches ``loc`` as usual
(§14.4: "A Destination that does not understand the Media Type should ignore the description of changes").

Appliers are plain functions ``(current bytes, patch bytes) -> new bytes`` keyed by media type, so a
plugin can add formats (for example RFC 5261 XML patches) without touching this module.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jsonpatch
import trio

from ..rs.model import Link
from ..store.blobs import BlobStore, begin_spooled
from .fetch import Expected, FetchedResource, Fetcher, FetchError

log = logging.getLogger("rsagg.patch")

PatchApplier = Callable[[bytes, bytes], bytes]  # (current content, patch document) -> new content

#: Patches are small by nature; a bigger one is not worth holding in memory (fetch ``loc`` instead).
MAX_PATCH_BYTES = 16 * 1024 * 1024


def media_type(value: str | None) -> str | None:
    """The bare, lower-case media type of a ``type`` attribute (parameters dropped)."""
    if not value:
        return None
    return value.split(";", 1)[0].strip().lower() or None


# -- JSON Patch (RFC 6902) -----------------------------------------------------------------------


def _json_styles() -> Iterator[dict[str, Any]]:
    """Serialisations a Source is likely to use: json.dumps defaults, compact, common indents."""
    # Sorted keys first: when the current document's keys happen to be sorted, a sorting serialiser is
    # the likelier explanation (and then new keys must land in order, not at the end).
    for ensure_ascii in (True, False):
        for sort_keys in (True, False):
            for separators in ((", ", ": "), (",", ":")):
                yield {"ensure_ascii": ensure_ascii, "sort_keys": sort_keys, "separators": separators}
            for indent in (2, 4, "\t", 1, 3):
                yield {
                    "ensure_ascii": ensure_ascii,
                    "sort_keys": sort_keys,
                    "indent": indent,
                    "separators": (",", ": "),
                }


def _json_style_of(current: bytes, value: Any) -> tuple[dict[str, Any], str]:
    """The json.dumps options (and trailing text) that reproduce ``current`` byte for byte.

    Why: JSON Patch works on the JSON *value*; the announced hash is of the Source's *bytes*. Writing
    the patched value the way the previous version was written is what makes the hash match when the
    Source serialises consistently. Falls back to json.dumps defaults.
    """
    text = current.decode("utf-8")
    stripped = text.rstrip()
    tail = text[len(stripped) :]
    for style in _json_styles():
        if json.dumps(value, **style) == stripped:
            return style, tail
    return {}, tail


def apply_json_patch(current: bytes, patch: bytes) -> bytes:
    """RFC 6902 JSON Patch through the ``jsonpatch`` library, written in the current document's style."""
    doc = json.loads(current)
    ops = json.loads(patch)
    style, tail = _json_style_of(current, doc)
    result = jsonpatch.apply_patch(doc, ops, in_place=False)
    return (json.dumps(result, **style) + tail).encode("utf-8")


def builtin_patch_formats() -> dict[str, PatchApplier]:
    """Appliers shipped with rsagg, by media type.

    RFC 6902 registers ``application/json-patch+json``; §14.4 Example 27 writes ``application/json-patch``,
    so both are accepted.
    """
    return {"application/json-patch+json": apply_json_patch, "application/json-patch": apply_json_patch}


# -- fetching by patch ---------------------------------------------------------------------------


async def fetch_by_patch(
    fetcher: Fetcher,
    link: Link,
    current: bytes,
    expected: Expected,
    store: BlobStore,
    appliers: Mapping[str, PatchApplier],
    *,
    max_patch_bytes: int = MAX_PATCH_BYTES,
) -> FetchedResource | None:
    """The new version built from ``current`` and the patch at ``link``, verified against ``expected``.

    Returns a finished, uncommitted blob, or None (logged at info) when the patch format is unknown,
    nothing can verify the result, the patch cannot be fetched or applied, or the result does not match:
    the caller then fetches ``loc``.
    """
    mtype = media_type(link.type)
    applier = appliers.get(mtype) if mtype else None
    if applier is None:
        log.info("patch %s: no applier for type %r, fetching the resource instead", link.href, link.type)
        return None
    if not expected.hashes:
        # A patched result nobody can check could silently diverge from the Source: not worth it.
        log.info("patch %s: no hash announced for the new version to verify it against", link.href)
        return None
    buf = io.BytesIO()
    try:
        # The link's own hash/length (§7 attributes of rs:ln) are checked by download().
        await fetcher.download(
            link.href, buf, max_bytes=max_patch_bytes, expected=Expected(link.hashes, link.length)
        )
    except FetchError as exc:
        log.info("patch %s: cannot fetch it (%s), fetching the resource instead", link.href, exc)
        return None
    try:
        new = await trio.to_thread.run_sync(applier, current, buf.getvalue())
    except Exception as exc:  # a malformed patch or a plugin applier's failure: fall back to loc
        log.info("patch %s: cannot apply it (%s: %s), fetching the resource instead", link.href,
                 type(exc).__name__, exc)  # fmt: skip
        return None
    if expected.length is not None and len(new) != expected.length:
        log.info("patch %s: result has %d bytes, %d announced", link.href, len(new), expected.length)
        return None
    writer = begin_spooled(store, frozenset(expected.hashes), len(new))  # in memory already
    try:
        writer.write(new)
        info = writer.finish()
    except BaseException:
        writer.abort()
        raise
    problems = expected.problems(info)
    if problems:
        writer.abort()
        log.info("patch %s: result does not match the announcement: %s", link.href, "; ".join(problems))
        return None
    return FetchedResource(url=link.href, blob=writer, info=info, content_type=None, encoding=None)
