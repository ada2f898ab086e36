"""Blob folders are 0755 and blob files 0444 whatever the umask, so that a web server can read them.

Why: the systemd units run rsagg with ``UMask=0077``; before, every folder ``mkdir`` made was 0700 and
nginx (``server.offload = "x-accel"``) could read no blob. Who may reach the store at all is decided by
the folder above it (the units' ``StateDirectoryMode=0750``, docs/deploy.md).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from aggregator.store.blobs import BLOB_MODE, FOLDER_MODE, FileBlobStore

#: Every umask a unit or a shell might set, and some odd ones (a property over the umask).
UMASKS = sorted(
    {0o000, 0o002, 0o022, 0o027, 0o077, 0o277, 0o777} | set(random.Random(26).sample(range(512), 8))
)


def modes(root: Path) -> dict[str, int]:
    """Relative path -> permission bits of the root, every fan-out folder and every blob file."""
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for top in root.iterdir():
        if len(top.name) != 2:
            continue
        for path in [top, *top.rglob("*")]:
            out[str(path.relative_to(root))] = stat.S_IMODE(os.stat(path).st_mode)
    return out


def expected(rel: str) -> int:
    return FOLDER_MODE if rel == "." or len(Path(rel).name) == 2 else BLOB_MODE


@contextlib.contextmanager
def under_umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", UMASKS, ids=oct)
@pytest.mark.parametrize("inline", [0, 16384])
def test_folders_and_files_whatever_the_umask(tmp_path: Path, mask: int, inline: int) -> None:
    with under_umask(mask), FileBlobStore(tmp_path / "state" / "blobs", inline_bytes=inline) as store:
        shas = [store.put_bytes(f"blob {i}\n".encode() * (1 + i * 500)).sha256 for i in range(20)]
        for sha in shas:
            store.blob_name(sha)  # an inline blob gets its file for the front end here
    got = modes(tmp_path / "state" / "blobs")
    assert sum(1 for rel in got if len(Path(rel).name) == 64) == 20
    assert {rel: oct(m) for rel, m in got.items() if m != expected(rel)} == {}


def test_folders_of_an_older_store_are_repaired(tmp_path: Path) -> None:
    """A store written under UMask=0077 by an older rsagg has 0700 folders: opening it sets them."""
    root = tmp_path / "blobs"
    with FileBlobStore(root, inline_bytes=0) as store:
        shas = [store.put_bytes(f"old {i}".encode()).sha256 for i in range(30)]
    for rel in modes(root):
        if rel == "." or len(Path(rel).name) == 2:
            os.chmod(root / rel, 0o700)
    (root / "tmp").chmod(0o700)
    with FileBlobStore(root, inline_bytes=0) as store:
        assert all(store.exists(sha) for sha in shas)
    got = modes(root)
    assert len(got) > 30 and {rel: oct(m) for rel, m in got.items() if m != expected(rel)} == {}
    assert stat.S_IMODE(os.stat(root / "tmp").st_mode) == 0o700  # temp files stay private


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None, reason="needs root and runuser")
def test_another_user_reads_a_blob_under_umask_0077() -> None:
    """What nginx's worker does: another user reads a blob file by its path (the parents let it through).
    In a folder of its own under /tmp (1777): pytest's temp folders are 0700."""
    base = Path(tempfile.mkdtemp(prefix="rsagg-modes-"))
    try:
        base.chmod(0o755)
        with under_umask(0o077), FileBlobStore(base / "store" / "blobs", inline_bytes=0) as store:
            path = store.local_path(store.put_bytes(b"published bytes\n").sha256)
        check_reads(base, path)
    finally:
        shutil.rmtree(base)


def check_reads(base: Path, path: Path | None) -> None:
    assert path is not None
    (base / "store").chmod(0o755)  # the store's own folder: the unit's StateDirectoryMode decides
    r = subprocess.run(["runuser", "-u", "nobody", "--", "cat", str(path)], capture_output=True, timeout=30)
    assert (r.returncode, r.stdout) == (0, b"published bytes\n"), r.stderr
    (base / "store").chmod(0o700)  # and the folder above is what keeps other users out
    r = subprocess.run(["runuser", "-u", "nobody", "--", "cat", str(path)], capture_output=True, timeout=30)
    assert r.returncode != 0 and b"Permission denied" in r.stderr
