"""FileBlobStore: content addressing, dedup, durability order, crash leftovers, path safety."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aggregator.store import blobs
from aggregator.store.blobs import BlobInfo, BlobStore, FileBlobStore
from tests.blobtesting import temp_files


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_round_trip(file_store: FileBlobStore) -> None:
    data = b"hello, resourcesync\n" * 100
    info = file_store.put_bytes(data)
    assert info == BlobInfo(sha(data), len(data), {"sha-256": sha(data)})
    assert file_store.exists(info.sha256)
    assert file_store.size(info.sha256) == len(data)
    with file_store.open(info.sha256) as f:
        assert f.read() == data
        f.seek(7)
        assert f.read(5) == b"resou"
    path = file_store.local_path(info.sha256)
    assert path == file_store.root / info.sha256[:2] / info.sha256[2:4] / info.sha256
    assert path.read_bytes() == data
    assert list(file_store.iter_hashes()) == [info.sha256]
    assert temp_files(file_store) == []


def test_streamed_write_with_extra_algorithms(store: FileBlobStore) -> None:
    chunks = [os.urandom(1000) for _ in range(10)] + [b""]
    data = b"".join(chunks)
    w = store.begin(frozenset({"md5", "sha-1"}))
    for c in chunks:
        w.write(c)
    info = w.finish()
    assert info.hashes == {
        "sha-256": sha(data),
        "md5": hashlib.md5(data).hexdigest(),
        "sha-1": hashlib.sha1(data).hexdigest(),
    }
    assert info.length == len(data)
    store.commit([w])
    assert store.open(info.sha256).read() == data


def test_empty_blob(store: FileBlobStore) -> None:
    info = store.put_bytes(b"")
    assert info.sha256 == sha(b"") and info.length == 0
    assert store.size(info.sha256) == 0


def test_blob_visible_only_after_commit(store: FileBlobStore) -> None:
    w = store.begin()
    w.write(b"not yet")
    info = w.finish()
    assert not store.exists(info.sha256)
    with pytest.raises(FileNotFoundError):
        store.open(info.sha256)
    assert list(store.iter_hashes()) == []
    assert temp_files(store) == [w.tmp_path.name]  # the bytes are only in tmp/
    store.commit([w])
    assert store.exists(info.sha256)
    assert temp_files(store) == []
    assert w.state == "committed"


def test_dedup_same_content_twice(file_store: FileBlobStore) -> None:
    first = file_store.put_bytes(b"same bytes")
    w = file_store.begin()
    w.write(b"same bytes")
    assert w.finish() == first
    assert w.tmp_path.exists()
    file_store.commit([w])
    assert not w.tmp_path.exists()  # the second temp file was dropped, not renamed
    assert w.state == "committed"
    assert list(file_store.iter_hashes()) == [first.sha256]
    files = [p for p in file_store.root.rglob("*") if p.is_file() and p.parent != file_store.tmp]
    assert files == [file_store.local_path(first.sha256)]


def test_dedup_within_one_batch(store: FileBlobStore) -> None:
    ws = []
    for data in (b"a", b"b", b"a", b"a"):
        w = store.begin()
        w.write(data)
        w.finish()
        ws.append(w)
    store.commit(ws)
    assert sorted(store.iter_hashes()) == sorted({sha(b"a"), sha(b"b")})
    assert all(w.state == "committed" for w in ws)
    assert temp_files(store) == []
    store.commit(ws)  # committing again is harmless


def test_damaged_existing_blob_is_replaced(file_store: FileBlobStore) -> None:
    info = file_store.put_bytes(b"0123456789")
    path = file_store.local_path(info.sha256)
    path.chmod(0o644)
    path.write_bytes(b"01234")  # truncated by some accident
    file_store.put_bytes(b"0123456789")
    assert path.read_bytes() == b"0123456789"


def test_commit_order_fsync_rename_dirsync(store: FileBlobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = blobs._fsync_path, os.replace

    def fsync(path, flags=os.O_RDONLY):
        events.append(("fsync-dir" if flags & os.O_DIRECTORY else "fsync", str(path)))
        real_fsync(path, flags)

    def replace(src, dst):
        events.append(("rename", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(blobs, "_fsync_path", fsync)
    monkeypatch.setattr(blobs.os, "replace", replace)
    ws = []
    for data in (b"one", b"two"):
        w = store.begin()
        w.write(data)
        w.finish()
        ws.append(w)
    tmp_names = {str(w.tmp_path) for w in ws}
    store.commit(ws)
    kinds = [k for k, _ in events]
    assert kinds.index("rename") > max(i for i, k in enumerate(kinds) if k == "fsync")
    assert min(i for i, k in enumerate(kinds) if k == "fsync-dir") > max(
        i for i, k in enumerate(kinds) if k == "rename"
    )
    assert {p for k, p in events if k == "fsync"} == tmp_names
    dirs = [p for k, p in events if k == "fsync-dir"]
    assert len(dirs) == len(set(dirs))  # each directory once
    for w in ws:
        leaf = store.local_path(w.info.sha256).parent
        assert str(leaf) in dirs  # the new name's directory
        assert str(leaf.parent) in dirs and str(store.root) in dirs  # fan-out dirs created now


def test_fsync_error_reaches_caller_and_blob_stays_invisible(
    store: FileBlobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(path, flags=os.O_RDONLY):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(blobs, "_fsync_path", failing)
    w = store.begin()
    w.write(b"unlucky")
    info = w.finish()
    with pytest.raises(OSError):
        store.commit([w])
    assert not store.exists(info.sha256)
    w.abort()
    assert temp_files(store) == []


def test_committed_blob_is_read_only(store: FileBlobStore) -> None:
    w = store.begin()
    assert stat.S_IMODE(os.stat(w.tmp_path).st_mode) == 0o600  # private while being written
    w.write(b"x")
    info = w.finish()
    store.commit([w])
    assert stat.S_IMODE(os.stat(store.local_path(info.sha256)).st_mode) == 0o444
    with store.open(info.sha256) as f:
        assert f.mode == "rb"


def test_writer_states(store: FileBlobStore) -> None:
    w = store.begin()
    w.write(b"abc")
    with pytest.raises(ValueError, match="commit of a open"):
        store.commit([w])
    w.abort()
    assert not w.tmp_path.exists()
    w.abort()  # idempotent
    with pytest.raises(ValueError):
        w.write(b"more")
    with pytest.raises(ValueError):
        store.commit([w])

    w2 = store.begin()
    w2.write(b"abc")
    info = w2.finish()
    assert w2.finish() == info
    with pytest.raises(ValueError):
        w2.write(b"late")
    store.commit([w2])
    w2.abort()  # no-op once committed
    assert store.exists(info.sha256)


def test_writer_context_manager_aborts_on_error(store: FileBlobStore) -> None:
    with pytest.raises(RuntimeError), store.begin() as w:
        w.write(b"partial")
        raise RuntimeError("download failed")
    assert w.state == "aborted"
    assert temp_files(store) == []


@pytest.mark.parametrize(
    "bad",
    ["A" * 64, "a" * 63, "a" * 65, "g" * 64, "../" + "a" * 61, "a" * 62 + "/a", "a" * 64 + "\n", "", None],
)
def test_sha256_argument_is_validated(store: FileBlobStore, bad) -> None:
    for call in (store.exists, store.open, store.size, store.delete, store.local_path):
        with pytest.raises(ValueError):
            call(bad)


def test_delete_and_iter_hashes(store: FileBlobStore) -> None:
    infos = [store.put_bytes(bytes([i]) * 10) for i in range(20)]
    (store.root / "README").write_text("not a blob")
    (store.root / "ab").mkdir(exist_ok=True)
    (store.root / "ab" / "zz").mkdir()
    (store.root / "ab" / "zz" / ("ab" + "0" * 62)).write_text("wrong fan-out")
    leftover = store.begin()
    leftover.write(b"in tmp")
    leftover.finish()
    assert list(store.iter_hashes()) == sorted(i.sha256 for i in infos)
    store.delete(infos[0].sha256)
    store.delete(infos[0].sha256)  # already gone: fine
    assert not store.exists(infos[0].sha256)
    assert sorted(store.iter_hashes()) == sorted(i.sha256 for i in infos[1:])
    leftover.abort()


def test_satisfies_protocol(store: FileBlobStore) -> None:
    assert isinstance(store, BlobStore)


CRASHER = textwrap.dedent(
    """
    import os, sys
    from aggregator.store.blobs import FileBlobStore
    s = FileBlobStore(sys.argv[1])
    done = s.put_bytes(b"committed before the crash")
    w = s.begin(); w.write(b"finished, never committed"); w.finish()
    w2 = s.begin(); w2.write(b"half written")
    print(done.sha256, w.info.sha256, flush=True)
    os._exit(9)  # like kill -9: no cleanup, no close
    """
)


def test_crash_leftovers_are_cleaned_at_start(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    out = subprocess.run(
        [sys.executable, "-c", CRASHER, str(root)], capture_output=True, text=True, check=False, timeout=60
    )
    assert out.returncode == 9, out.stderr
    done, uncommitted = out.stdout.split()
    assert len([p for p in (root / "tmp").iterdir() if p.name != ".lock"]) == 2
    with FileBlobStore(root) as s:
        assert [p.name for p in s.tmp.iterdir()] == [".lock"]
        assert list(s.iter_hashes()) == [done]
        assert not s.exists(uncommitted)
        assert s.open(done).read() == b"committed before the crash"


def test_live_store_keeps_its_temp_files_when_another_opens(tmp_path: Path) -> None:
    first = FileBlobStore(tmp_path / "blobs")
    w = first.begin()
    w.write(b"in progress")
    w.finish()
    second = FileBlobStore(tmp_path / "blobs")  # e.g. `rsagg gc` next to the daemon
    assert w.tmp_path.exists()
    first.commit([w])
    assert second.exists(w.info.sha256)
    second.close()
    first.close()
    stale = tmp_path / "blobs" / "tmp" / "blob-stale"
    stale.write_bytes(b"x")
    with FileBlobStore(tmp_path / "blobs"):
        assert not stale.exists()  # nobody holds the store now: cleaned
