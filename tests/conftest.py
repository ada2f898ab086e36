"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from aggregator.store.blobs import FileBlobStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FileBlobStore]:
    """A FileBlobStore in the test's folder (test_s3store.py has its own ``store``: an S3BlobStore)."""
    s = FileBlobStore(tmp_path / "blobs")
    yield s
    s.close()
