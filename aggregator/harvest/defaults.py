"""The built-in patch format: RFC 6902 JSON Patch (§14.4)."""

from __future__ import annotations

from ..hookspecs import hookimpl


@hookimpl
def rsagg_patch_formats():
    from .patch import builtin_patch_formats  # trio, httpx: loaded when a harvest asks, not here

    return builtin_patch_formats()
