"""The default storage backend: content-addressed files under ``store.path``/blobs, small blobs as rows of
``blobs/small.db`` (``store/inline.py``)."""

from __future__ import annotations

from pathlib import Path

from ..hookspecs import hookimpl
from .blobs import INLINE_BYTES, FileBlobStore

#: ``[store.settings]`` of this backend: ``path`` (default ``store.path``/blobs) and ``inline_bytes``
#: (blobs up to this size are rows of small.db; 0 = a file each, as a store shared over NFS needs).
SETTINGS = {"path", "inline_bytes"}


def create_store(settings: dict, root: Path) -> FileBlobStore:
    unknown = sorted(set(settings) - SETTINGS)
    if unknown:
        raise ValueError(f"filesystem blob store: unknown setting(s) {', '.join(unknown)}")
    inline = settings.get("inline_bytes", INLINE_BYTES)
    if not isinstance(inline, int) or isinstance(inline, bool) or inline < 0:
        raise ValueError(f"filesystem blob store: inline_bytes must be an integer >= 0, not {inline!r}")
    return FileBlobStore(Path(settings.get("path", root / "blobs")), inline_bytes=inline)


@hookimpl
def rsagg_blob_stores():
    return {"filesystem": create_store}
