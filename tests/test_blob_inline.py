"""Small blobs as rows of ``blobs/small.db`` (store/inline.py): the same store to every caller, one
transaction per batch, durable before the state names them, and a file for a front end when asked."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from aggregator.commands.gc import Garbage, collect_garbage
from aggregator.config import ConfigError, parse_config
from aggregator.harvest.context import open_blob_store
from aggregator.plugins.manager import Plugins
from aggregator.store.blobs import INLINE_BYTES, BlobInfo, FileBlobStore, SpooledBlobWriter
from aggregator.store.rows import Change
from aggregator.store.state import State
from tests.blobtesting import temp_files


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob_files(store: FileBlobStore) -> list[str]:
    """The blob files under the fan-out directories (not small.db, not temp files)."""
    return sorted(p.name for p in store.root.glob("??/??/*"))


def spooled(store: FileBlobStore, data: bytes) -> SpooledBlobWriter:
    w = store.begin(frozenset({"md5"}), spool=64 * 1024)
    assert isinstance(w, SpooledBlobWriter)
    w.write(data)
    w.finish()
    return w


def test_small_blob_is_a_row_and_reads_as_any_blob(store: FileBlobStore) -> None:
    data = b"<oai_dc:dc>a record</oai_dc:dc>\n" * 10
    info = store.put_bytes(data)
    assert info == BlobInfo(sha(data), len(data), {"sha-256": sha(data)})
    assert blob_files(store) == [] and temp_files(store) == []
    assert (store.root / "small.db").is_file()
    assert store.read_inline(info.sha256) == data
    assert store.exists(info.sha256) and store.size(info.sha256) == len(data)
    with store.open(info.sha256) as f:
        assert f.read() == data
        f.seek(12)
        assert f.read(6) == data[12:18]
    assert list(store.iter_hashes()) == [info.sha256]
    store.delete(info.sha256)
    assert not store.exists(info.sha256) and store.read_inline(info.sha256) is None
    with pytest.raises(FileNotFoundError):
        store.open(info.sha256)
    assert list(store.iter_hashes()) == []


def test_the_limit_decides_row_or_file(tmp_path: Path) -> None:
    with FileBlobStore(tmp_path / "blobs", inline_bytes=64) as store:
        at, over = store.put_bytes(b"x" * 64), store.put_bytes(b"y" * 65)
        assert store.read_inline(at.sha256) == b"x" * 64
        assert store.read_inline(over.sha256) is None and blob_files(store) == [over.sha256]
        big = store.begin(spool=0)  # a writer with a temp file from the start stays a file
        big.write(b"z")
        big.finish()
        store.commit([big])
        assert blob_files(store) == sorted([over.sha256, sha(b"z")])
    with FileBlobStore(tmp_path / "off", inline_bytes=0) as store:
        info = store.put_bytes(b"small")
        assert blob_files(store) == [info.sha256] and not (store.root / "small.db").exists()


def test_a_batch_is_one_step_and_counts_what_was_new(store: FileBlobStore) -> None:
    counted: list[tuple[int, int]] = []
    store.on_commit = lambda new, dedup: counted.append((len(new), len(dedup)))
    before = spooled(store, b"stored before")
    store.commit([before])
    writers = [spooled(store, d) for d in (b"one", b"two", b"one", b"stored before")]
    steps = store.commit_steps(writers)  # quick work done as it advances, slow steps handed out
    step = next(steps)
    assert not store.exists(sha(b"two"))  # nothing visible before the step ran
    step()
    assert list(steps) == []  # one transaction: no file, no fsync of files or directories
    assert all(w.state == "committed" for w in writers)
    assert store.read_inline(sha(b"two")) == b"two"
    assert counted == [(1, 0), (2, 2)]  # "one" and "two" new; the second "one" and "stored before" not
    assert blob_files(store) == [] and temp_files(store) == []


@pytest.mark.parametrize("seed", range(12))
def test_put_small_stores_and_counts_as_commit_does(tmp_path: Path, seed: int) -> None:
    """``put_small`` (a page of small records at once, no writer each) against writers and ``commit``,
    on generated batches: repeats inside a batch, contents stored before, empty ones, every extra hash
    algorithm. Same BlobInfos in order, same rows, same counts of written vs deduplicated."""
    rng = random.Random(seed)
    pool = [rng.randbytes(rng.randrange(0, 40)) for _ in range(8)]
    algorithms = frozenset(rng.sample(["md5", "sha-1", "sha-512", "sha-256"], rng.randrange(0, 4)))
    earlier = rng.sample(pool, rng.randrange(0, 4))
    batch = [rng.choice(pool) for _ in range(rng.randrange(0, 12))]
    results = []
    for way in ("writers", "put_small"):
        with FileBlobStore(tmp_path / way, inline_bytes=64) as store:
            counted: list[tuple[list[str], list[str]]] = []
            store.commit([spooled(store, d) for d in earlier])
            store.on_commit = lambda new, dup, counted=counted: counted.append(
                (sorted(i.sha256 for i in new), sorted(i.sha256 for i in dup))
            )
            if way == "writers":
                writers = []
                for d in batch:
                    w = store.begin(algorithms, spool=64 * 1024)
                    w.write(d)
                    writers.append(w)
                infos = [w.finish() for w in writers]
                store.commit(writers)
            else:
                got = store.put_small(batch, algorithms)
                assert got is not None
                infos = got
            assert all(store.read_inline(i.sha256) == d for i, d in zip(infos, batch, strict=True))
            assert blob_files(store) == [] and temp_files(store) == []
            results.append((infos, counted, sorted(store.iter_hashes())))
    assert results[0] == results[1]


def test_put_small_leaves_bigger_blobs_to_writers(tmp_path: Path) -> None:
    """None, with nothing stored, when one blob is over ``inline_bytes`` or the store keeps none inline."""
    with FileBlobStore(tmp_path / "blobs", inline_bytes=8) as store:
        assert store.put_small([b"tiny", b"a bigger blob"]) is None
        assert list(store.iter_hashes()) == []
    with FileBlobStore(tmp_path / "off", inline_bytes=0) as store:
        assert store.put_small([b"tiny"]) is None
        assert list(store.iter_hashes()) == []


def test_a_mixed_batch_stores_rows_first_then_files(tmp_path: Path) -> None:
    with FileBlobStore(tmp_path / "blobs", inline_bytes=8) as store:
        small, big = spooled(store, b"tiny"), spooled(store, b"a bigger blob")
        steps = store.commit_steps([small, big])
        next(steps)()  # the rows' transaction
        assert store.read_inline(sha(b"tiny")) == b"tiny" and not store.exists(sha(b"a bigger blob"))
        for step in steps:
            step()
        assert blob_files(store) == [sha(b"a bigger blob")]


def test_rows_and_files_of_one_store_list_once_in_order(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    with FileBlobStore(root, inline_bytes=0) as old:  # a store from before inline blobs
        a, b = old.put_bytes(b"a"), old.put_bytes(b"b")
    with FileBlobStore(root) as store:
        assert store.put_bytes(b"b") == b  # stored again, as a row: read from the row from now on
        c = store.put_bytes(b"c")
        assert store.read_inline(b.sha256) == b"b" and store.read_inline(a.sha256) is None
        assert list(store.iter_hashes()) == sorted([a.sha256, b.sha256, c.sha256])
        store.delete(b.sha256)
        assert not store.exists(b.sha256) and blob_files(store) == [a.sha256]
    with FileBlobStore(root, inline_bytes=0) as off:  # turned off: the rows are still read
        assert off.read_inline(c.sha256) == b"c" and off.size(c.sha256) == 1


def test_front_end_file_copy(store: FileBlobStore) -> None:
    info = store.put_bytes(b"served by nginx")
    assert blob_files(store) == []
    assert store.blob_name(info.sha256) == f"{info.sha256[:2]}/{info.sha256[2:4]}/{info.sha256}"
    path = store.local_path(info.sha256)
    assert path is not None and path.read_bytes() == b"served by nginx"
    assert oct(path.stat().st_mode & 0o777) == "0o444" and temp_files(store) == []
    store.blob_name(info.sha256)  # once: the file is not written again
    assert list(store.iter_hashes()) == [info.sha256]
    store.delete(info.sha256)
    assert not path.exists() and not store.exists(info.sha256)


def test_collect_garbage_removes_unnamed_rows(tmp_path: Path, store: FileBlobStore) -> None:
    named, unnamed = store.put_bytes(b"named"), store.put_bytes(b"unnamed")
    with State(tmp_path / "state.db") as st:
        st.upsert_source("s", "http://example.org/")
        set_id = st.ensure_set("s", "http://example.org/cl.xml")
        st.apply(set_id, [Change(uri="http://example.org/r", change="created", sha256=named.sha256,
                                 length=named.length)])  # fmt: skip
        assert collect_garbage(st, store, grace=0) == Garbage(removed=1, freed=len(b"unnamed"))
    assert store.exists(named.sha256) and not store.exists(unnamed.sha256)


def test_a_killed_writer_leaves_committed_rows_and_no_partial_one(tmp_path: Path) -> None:
    """kill -9 right after one batch committed and in the middle of the next one's transaction."""
    root = tmp_path / "blobs"
    child = textwrap.dedent(
        f"""
        import os, signal, sys
        from aggregator.store.blobs import FileBlobStore
        store = FileBlobStore({str(root)!r})
        store.put_bytes(b"committed")
        conn = store._inline._conn().__enter__()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO blobs VALUES (?, ?, 0)", (bytes(32), b"never committed"))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", child], cwd=Path(__file__).parent.parent, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    with FileBlobStore(root) as store:
        assert store.read_inline(sha(b"committed")) == b"committed"
        assert list(store.iter_hashes()) == [sha(b"committed")]
    with sqlite3.connect(root / "small.db") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_refused_write_is_an_os_error_naming_the_database(store: FileBlobStore) -> None:
    store.put_bytes(b"first")
    with store._inline._conn() as conn:  # the pool's one connection: as a read-only store
        conn.execute("PRAGMA query_only = 1")
    with pytest.raises(OSError) as caught:
        store.put_bytes(os.urandom(400))
    assert caught.value.errno == errno.EROFS and "small.db" in str(caught.value)
    assert "readonly" in str(caught.value) or "read-only" in str(caught.value)
    assert store.read_inline(sha(b"first")) == b"first"  # what was there is intact


def test_a_damaged_database_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "data" / "blobs").mkdir(parents=True)
    (tmp_path / "data" / "blobs" / "small.db").write_bytes(b"not a database at all" * 100)
    cfg = parse_config({"store": {"path": str(tmp_path / "data")}}, str(tmp_path / "rsagg.toml"))
    with pytest.raises(ConfigError) as caught:
        open_blob_store(cfg, Plugins.from_config(cfg))
    assert "store.path" in str(caught.value) and "small.db" in str(caught.value)


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"inline_bytes": -1}, "inline_bytes must be an integer >= 0, not -1"),
        ({"inline_bytes": "16k"}, "inline_bytes must be an integer >= 0, not '16k'"),
        ({"inline_bytes": True}, "inline_bytes must be an integer >= 0, not True"),
        ({"inlinebytes": 5}, "unknown setting(s) inlinebytes"),
    ],
)
def test_filesystem_settings_are_checked(tmp_path: Path, settings: dict, says: str) -> None:
    cfg = parse_config({"store": {"path": str(tmp_path), "settings": settings}}, str(tmp_path / "r.toml"))
    with pytest.raises(ConfigError) as caught:
        open_blob_store(cfg, Plugins.from_config(cfg))
    assert "store.settings" in str(caught.value) and says in str(caught.value)


def test_filesystem_settings_reach_the_store(tmp_path: Path) -> None:
    cfg = parse_config(
        {"store": {"path": str(tmp_path), "settings": {"inline_bytes": 100}}}, str(tmp_path / "r.toml")
    )
    store = open_blob_store(cfg, Plugins.from_config(cfg))
    try:
        assert isinstance(store, FileBlobStore) and store.inline_bytes == 100
    finally:
        store.close()
    assert INLINE_BYTES == FileBlobStore(tmp_path / "other").inline_bytes


def test_connections_are_pooled_not_kept_per_thread(store: FileBlobStore) -> None:
    """A daemon's worker threads come and go for months: their reads reuse the idle connections."""
    info = store.put_bytes(b"read from many threads")
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):  # one thread after the other, as trio's thread cache replaces idle ones
        t = threading.Thread(target=store.read_inline, args=(info.sha256,))
        t.start()
        t.join()
    assert store._inline._idle.qsize() == 1 and len(os.listdir("/proc/self/fd")) <= fds


def _waiting_flocks(pid: int) -> bool:
    """Whether ``pid`` waits for an flock (``/proc/locks`` marks a blocked request with ``->``)."""
    with open("/proc/locks") as f:
        return any(
            "->" in line and "FLOCK" in line and line.split("->")[1].split()[3] == str(pid) for line in f
        )


def test_writers_of_every_process_queue_on_one_lock_file(store: FileBlobStore) -> None:
    """A write of another process (the harvest's worker processes, gc) waits while this one holds the
    store's write lock, and goes on, not failing, the moment it is let go: they queue on an flock of
    ``small.db.lock``, not in SQLite's busy handler, whose sleeps cost processes storing pages at once a
    third of their time."""
    store.put_bytes(b"opens the database")
    child = textwrap.dedent(
        f"""
        from aggregator.store.blobs import FileBlobStore
        with FileBlobStore({str(store.root)!r}) as store:
            store.put_bytes(b"from the other process")
        """
    )
    with store._inline._write_lock():
        proc = subprocess.Popen([sys.executable, "-c", child], cwd=Path(__file__).parent.parent)
        try:
            for _ in range(1200):  # at most 2 minutes for the child to start and ask for the lock
                if _waiting_flocks(proc.pid) or proc.poll() is not None:
                    break
                threading.Event().wait(0.1)
            assert proc.poll() is None and _waiting_flocks(proc.pid), "the other process did not wait"
            assert store.read_inline(sha(b"from the other process")) is None
        except BaseException:
            proc.kill()
            raise
    assert proc.wait(timeout=120) == 0
    assert store.read_inline(sha(b"from the other process")) == b"from the other process"
    assert (store.root / "small.db.lock").is_file()


# -- a batch whose commit is one small.db transaction (HarvestContext.write_after_blobs) ----------------


def test_commits_inline_says_when_a_commit_is_one_transaction_and_no_file(tmp_path: Path) -> None:
    """Random batches (blobs at, under and over the limit, repeats, some committed already, a writer with
    a temp file from the start): ``commits_inline`` is True exactly when every blob still to commit is
    small and in memory, and then the commit stores them all as rows and writes no file."""
    rng = random.Random(11)
    limit = 64
    with FileBlobStore(tmp_path / "blobs", inline_bytes=limit) as store:
        for round_ in range(60):
            batch: list = []
            expect = True
            for i in range(rng.randrange(0, 8)):
                kind = rng.choice(["small", "small", "small", "at", "over", "file", "repeat", "committed"])
                if kind == "repeat" and batch:
                    data = batch[-1][1]
                    kind = "small" if len(data) <= limit else "over"
                else:
                    n = {"at": limit, "over": limit + 1 + rng.randrange(100)}.get(
                        kind, rng.randrange(1, limit)
                    )
                    data = f"{round_}.{i}.".encode() + rng.randbytes(n)[: n - len(f"{round_}.{i}.")]
                if kind == "file":
                    w = store.begin(spool=0)
                    w.write(data)
                    w.finish()
                else:
                    w = spooled(store, data)
                if kind == "committed":
                    store.commit([w])
                elif kind in ("over", "file"):
                    expect = False
                batch.append((w, data))
            writers = [w for w, _ in batch]
            files_before = blob_files(store)
            assert store.commits_inline(writers) is expect, [len(d) for _, d in batch]
            store.commit(writers)
            assert all(w.state == "committed" for w in writers)
            for _, data in batch:
                assert store.exists(sha(data))
                with store.open(sha(data)) as f:
                    assert f.read() == data
            if expect:
                assert blob_files(store) == files_before  # rows only: no file touched
        with FileBlobStore(tmp_path / "none", inline_bytes=0) as plain:  # no small.db: never inline
            assert not plain.commits_inline([spooled(plain, b"tiny")])
