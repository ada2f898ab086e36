"""The repository itself: nothing generated is tracked (stores, blobs, build output)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A content-addressed blob store lays files out as <2 hex>/<2 hex>/<hex digest>; a folder of such files
# in the tree is a test's store that was committed by mistake.
BLOB_PATH = re.compile(r"(^|/)[0-9a-f]{2}/([0-9a-f]{2}/)?[0-9a-f]{16,}[^/]*$")
GENERATED = re.compile(r"(^|/)(state\.db(-wal|-shm)?|[^/]+\.(so|pyd|o))$")


def _tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")  # an sdist has no history to check
    return [p for p in out.decode().split("\0") if p]


def test_no_blob_shaped_files_tracked() -> None:
    offenders = [p for p in _tracked() if BLOB_PATH.search(p)]
    assert not offenders, f"blob-store files are tracked (a test's store committed?): {offenders[:5]}"


def test_no_generated_files_tracked() -> None:
    offenders = [p for p in _tracked() if GENERATED.search(p)]
    assert not offenders, f"generated files are tracked: {offenders[:5]}"


def test_blob_pattern_matches_a_store_layout() -> None:
    # The guard above must be able to fail: the layout FileBlobStore writes is matched.
    assert BLOB_PATH.search("fsb5/00/07/" + "ab" * 32)
    assert BLOB_PATH.search("data/blobs/ab/cd/" + "0" * 64 + ".tmp")
    assert not BLOB_PATH.search("aggregator/rs/model.py")
