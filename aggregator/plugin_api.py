"""The public API for rsagg plugins: everything a plugin imports from rsagg, and nothing else.

A plugin (a shipped one under ``plugins/`` or a third party's) imports only from this module; the
modules these names live in are rsagg's internals and may move. What is here:

- ``hookimpl``, the marker for hook implementations (the hooks are specified in ``aggregator.hookspecs``);
- ``PluginContext``, the ``plugin`` argument of hooks (a plugin's own settings);
- the types hooks receive: ``Entry`` (with ``Md`` and ``Link``) of an upstream list, the stored
  ``Resource`` and change-log ``LogRecord`` of the publish side, ``MetadataRecords`` (the ``metadata``
  argument of ``rsagg_filter_harvest``), ``Config`` (of ``rsagg_startup``);
- for a blob store backend (``rsagg_blob_stores``): the ``BlobStore`` protocol, ``BlobInfo`` and
  ``BlobWriter`` (with ``SpooledBlobWriter``, a writer that spools to a local temporary file), and the
  helpers a backend reuses — ``TempArea`` (temporary files under the store's local root), ``put_bytes``,
  ``pending_writers`` (writers still open, for the crash/leak checks), ``check_sha256`` and
  ``blob_name`` (the ``ab/cd/<sha256>`` name every store gives a blob, which offloading relies on);
- ``lazy_module``, a module a plugin imports when one of its hooks first uses it: the commands that load
  every plugin and call none of their hooks (``rsagg status``, ``retries``, ``plugins``) start without it.
"""

from __future__ import annotations

import typing as _typing

from .hookspecs import hookimpl
from .plugins.manager import PluginContext
from .rs.model import Entry, Link, Md
from .store.blobs import (
    BlobInfo,
    BlobStore,
    BlobWriter,
    SpooledBlobWriter,
    TempArea,
    blob_name,
    check_sha256,
    pending_writers,
    put_bytes,
)

if _typing.TYPE_CHECKING:
    from .config import Config
    from .harvest.metadata import MetadataRecords
    from .store.rows import LogRecord, Resource

#: Names imported when first asked for (PEP 562): loading a plugin that imports ``hookimpl`` does not load
#: the configuration (pydantic), the harvest (trio, httpx) or the state (sqlite3, lxml): ``rsagg
#: plugins`` starts without them.
_LAZY = {
    "Config": "aggregator.config",
    "MetadataRecords": "aggregator.harvest.metadata",
    "LogRecord": "aggregator.store.rows",
    "Resource": "aggregator.store.rows",
}


class _LazyModule:
    """Stands for a module until an attribute is first asked for; then imports it, puts it in its place
    in the plugin module's namespace (later uses go straight to the module) and answers."""

    __slots__ = ("_into", "_module", "_name")

    def __init__(self, module: str, into: dict[str, object], name: str) -> None:
        self._module, self._into, self._name = module, into, name

    def __getattr__(self, attr: str) -> object:
        import importlib

        module = importlib.import_module(self._module)
        self._into[self._name] = module
        return getattr(module, attr)


def lazy_module(module: str, into: dict[str, object], name: str) -> _typing.Any:
    """``module`` imported on first use and bound to ``name`` in ``into`` (the plugin's ``globals()``).

    ``etree = lazy_module("lxml.etree", globals(), "etree")`` (under ``if not TYPE_CHECKING``)."""
    return _LazyModule(module, into, name)


def __getattr__(name: str) -> object:
    """A name of ``_LAZY``, imported on first use and kept."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """Every public name, those not loaded yet too."""
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BlobInfo",
    "BlobStore",
    "BlobWriter",
    "Config",
    "Entry",
    "Link",
    "LogRecord",
    "Md",
    "MetadataRecords",
    "PluginContext",
    "Resource",
    "SpooledBlobWriter",
    "TempArea",
    "blob_name",
    "check_sha256",
    "hookimpl",
    "lazy_module",
    "pending_writers",
    "put_bytes",
]
