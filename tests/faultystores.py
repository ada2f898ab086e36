"""Blob store backends that fail on purpose, in a module worker processes can import: the harvest's
worker processes (``harvest/offload.py``) open the daemon's store from its backend factory, so a fault
a test plants must travel with the factory, not be monkeypatched into the test's own process."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path

from aggregator.hookspecs import hookimpl
from aggregator.store.blobs import BlobWriter, FileBlobStore, SpooledBlobWriter


class FullDiskStore(FileBlobStore):
    """The default store, but a commit (or ``put_small``) holding a blob that contains ``marker`` fails with
    ENOSPC."""

    def __init__(self, root: Path, marker: bytes) -> None:
        super().__init__(root)
        self.marker = marker

    def commit(self, writers: Sequence[BlobWriter]) -> None:
        if any(self.marker in (w.held() or b"") for w in writers if isinstance(w, SpooledBlobWriter)):
            raise OSError(errno.ENOSPC, "No space left on device")
        super().commit(writers)

    def put_small(self, contents: Sequence[bytes], algorithms: frozenset[str] = frozenset()) -> list | None:
        if any(self.marker in c for c in contents):
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().put_small(contents, algorithms)


def full_disk(settings: dict, root: Path) -> FullDiskStore:
    """Backend ``full-disk``: the default store's folder; ``[store.settings] fail_on`` is the marker."""
    return FullDiskStore(root / "blobs", settings["fail_on"].encode())


class FaultyStores:
    @hookimpl
    def rsagg_blob_stores(self) -> dict:
        return {"full-disk": full_disk}
