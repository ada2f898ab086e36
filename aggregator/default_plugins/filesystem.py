"""The default storage backend: content-addressed files under ``store.path``/blobs."""

from __future__ import annotations

from pathlib import Path

from ..hookspecs import hookimpl
from ..store.blobs import FileBlobStore


def create_store(settings: dict, root: Path) -> FileBlobStore:
    return FileBlobStore(Path(settings.get("path", root / "blobs")))


@hookimpl
def rsagg_blob_stores():
    return {"filesystem": create_store}
