"""The built-in patch format: RFC 6902 JSON Patch (§14.4)."""

from __future__ import annotations

from ..harvest.patch import builtin_patch_formats
from ..hookspecs import hookimpl


@hookimpl
def rsagg_patch_formats():
    return builtin_patch_formats()
