"""FileBlobStore: spooled (in-memory) writers, commit as steps, and syncfs for big batches."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os

import pytest

from aggregator.store import blobs
from aggregator.store.blobs import SYNCFS_MIN_BATCH, FileBlobStore, SpooledBlobWriter
from tests.blobtesting import temp_files


def spooled(store: FileBlobStore, data: bytes, limit: int = 1024) -> SpooledBlobWriter:
    w = store.begin(frozenset({"md5"}), spool=limit)
    assert isinstance(w, SpooledBlobWriter)
    w.write(data)
    return w


def test_spooled_blob_touches_the_disk_only_at_commit(file_store: FileBlobStore) -> None:
    data = b"small resource"
    w = spooled(file_store, data)
    info = w.finish()
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert info.hashes["md5"] == hashlib.md5(data).hexdigest() and info.length == len(data)
    assert temp_files(file_store) == [] and w.tmp_path is None
    assert not file_store.exists(info.sha256)
    file_store.commit([w])
    assert w.state == "committed"
    assert file_store.open(info.sha256).read() == data
    assert oct(os.stat(file_store.local_path(info.sha256)).st_mode & 0o777) == oct(blobs.BLOB_MODE)
    assert temp_files(file_store) == []


def test_spooled_blob_spills_to_a_temp_file_when_it_grows(store: FileBlobStore) -> None:
    w = spooled(store, b"a" * 600, limit=1000)
    assert w.tmp_path is None
    w.write(b"b" * 600)  # over the limit: on to a temp file, the bytes so far included
    assert w.tmp_path is not None and temp_files(store) == [w.tmp_path.name]
    w.write(b"c")
    info = w.finish()
    store.commit([w])
    assert store.open(info.sha256).read() == b"a" * 600 + b"b" * 600 + b"c"
    assert temp_files(store) == []


def test_spooled_abort_leaves_nothing(store: FileBlobStore) -> None:
    small = spooled(store, b"x")
    small.abort()
    big = spooled(store, b"y" * 2000)
    assert temp_files(store) != []
    big.abort()
    assert temp_files(store) == [] and small.state == big.state == "aborted"
    with pytest.raises(ValueError):
        small.write(b"more")


def test_spooled_duplicate_of_a_stored_blob_is_never_written(
    store: FileBlobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = store.put_bytes(b"same")
    written: list[str] = []
    real = SpooledBlobWriter._write_temp
    monkeypatch.setattr(SpooledBlobWriter, "_write_temp", lambda w, p: (written.append(p), real(w, p)))
    dups = [spooled(store, b"same") for _ in range(3)]
    for w in dups:
        w.finish()
    store.commit(dups)
    assert written == [] and all(w.state == "committed" for w in dups)
    assert list(store.iter_hashes()) == [info.sha256] and temp_files(store) == []


def test_commit_steps_yield_the_syncs_in_order(
    file_store: FileBlobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quick work happens as the generator advances; nothing is visible before the first sync ran."""
    monkeypatch.setattr(file_store, "_use_syncfs", True)
    synced: list[str] = []
    monkeypatch.setattr(file_store, "_syncfs", lambda: synced.append("syncfs"))
    writers = [spooled(file_store, f"blob {n}".encode()) for n in range(SYNCFS_MIN_BATCH)]
    infos = [w.finish() for w in writers]
    steps = file_store.commit_steps(writers)
    first = next(steps)
    assert len(temp_files(file_store)) == SYNCFS_MIN_BATCH  # data written, to be synced by the caller
    assert not any(file_store.exists(i.sha256) for i in infos)  # no name before its bytes are durable
    first()
    second = next(steps)
    assert all(file_store.exists(i.sha256) for i in infos) and temp_files(file_store) == []
    second()
    with pytest.raises(StopIteration):
        next(steps)
    assert synced == ["syncfs", "syncfs"]
    assert all(w.state == "committed" for w in writers)


def test_small_batches_keep_per_file_fsyncs(
    file_store: FileBlobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(file_store, "_syncfs", lambda: calls.append("syncfs"))
    real = blobs._fsync_path
    monkeypatch.setattr(
        blobs, "_fsync_path", lambda p, flags=os.O_RDONLY: (calls.append("fsync"), real(p, flags))
    )
    writers = [spooled(file_store, f"few {n}".encode()) for n in range(SYNCFS_MIN_BATCH - 1)]
    for w in writers:
        w.finish()
    file_store.commit(writers)
    assert "syncfs" not in calls and calls.count("fsync") >= len(writers)


@pytest.mark.skipif(blobs._SYNCFS is None, reason="syncfs needs Linux >= 5.8")
def test_syncfs_failure_reaches_the_caller(
    file_store: FileBlobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(fd: int) -> int:
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(blobs, "_SYNCFS", failing)
    writers = [spooled(file_store, f"doomed {n}".encode()) for n in range(SYNCFS_MIN_BATCH)]
    infos = [w.finish() for w in writers]
    with pytest.raises(OSError) as ei:
        file_store.commit(writers)
    assert ei.value.errno == errno.EIO
    assert not any(file_store.exists(i.sha256) for i in infos)  # the first sync failed: nothing renamed
    for w in writers:
        w.abort()
    assert temp_files(file_store) == []


@pytest.mark.skipif(blobs._SYNCFS is None, reason="syncfs needs Linux >= 5.8")
def test_big_batch_through_real_syncfs(store: FileBlobStore) -> None:
    writers = [spooled(store, os.urandom(100)) for _ in range(SYNCFS_MIN_BATCH * 2)]
    writers.append(store.begin())  # a plain (file) writer in the same batch
    writers[-1].write(b"plain")
    infos = [w.finish() for w in writers]
    store.commit(writers)
    assert sorted(store.iter_hashes()) == sorted(i.sha256 for i in infos)
    assert temp_files(store) == []


def test_fanout_directory_removed_behind_our_back_is_made_again(file_store: FileBlobStore) -> None:
    first = file_store.put_bytes(b"one")
    leaf = file_store.local_path(first.sha256).parent
    file_store.delete(first.sha256)
    leaf.rmdir()  # the file_store remembers it existed
    w = spooled(file_store, b"one")
    w.finish()
    file_store.commit([w])
    assert file_store.open(first.sha256).read() == b"one"
